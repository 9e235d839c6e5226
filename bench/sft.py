"""SFT update throughput: tokens/s, MFU and peak memory of `drkernel.sft.sft_step`.

A random-init model of a given shape (default: Qwen2.5-1.5B's, no download) trains on
random token batches (default 8 x 2048 tokens per optimiser step, every token trained),
through the same step function and loss as `drkernel.sft` (chunked cross-entropy from the
hidden states, never [B, L, V] fp32 logits). Each variant changes one thing: weights
precision, gradient checkpointing, micro-batching, full logits vs chunked loss. A variant
that fails (OOM, a missing kernel) prints its error and the others still run.

    MFU = 6 * N * tokens / step_time / peak_flops    (N: parameters; the attention term is not counted)

    python bench/sft.py                       # on the GPU: bf16, prints a table, writes JSON
    python bench/sft.py --tiny                # CPU smoke test of the same code path
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.entry import check_outputs, count, exit_status  # noqa: E402
from bench.jsonfile import save_json  # noqa: E402
from drkernel.modeling import enable_gradient_checkpointing  # noqa: E402
from drkernel.sft import SFTLoss, sft_step  # noqa: E402

QWEN25_15B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True,
                  max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6)
TINY = dict(QWEN25_15B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512, max_position_embeddings=1024)

# name -> (weights dtype, autocast bf16, gradient checkpointing, micro-batch size (None: whole batch),
#          loss chunk (0: full logits), fused AdamW)
VARIANTS = {
    "bf16+ckpt": ("bf16", False, True, None, 4096, True),
    "bf16": ("bf16", False, False, None, 4096, True),
    "bf16+ckpt, micro 2 x accum": ("bf16", False, True, 2, 4096, True),
    "bf16, micro 2 x accum": ("bf16", False, False, 2, 4096, True),
    "bf16+ckpt, full logits": ("bf16", False, True, None, 0, True),
    "bf16+ckpt, unfused AdamW": ("bf16", False, True, None, 4096, False),
    "fp32 weights + bf16 autocast +ckpt": ("fp32", True, True, None, 4096, True),
}


def build_model(shape: dict, dtype: torch.dtype, device: str, ckpt: bool, attn: str | None):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", **shape)
    cfg.use_cache = False
    kwargs = {"attn_implementation": attn} if attn else {}
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, **kwargs)
    if ckpt:  # as drkernel.sft's model loading does
        enable_gradient_checkpointing(model)
    return model.train()


def run_variant(acc, name, spec, args, shape, device) -> dict:
    wdtype, autocast, ckpt, micro, chunk, fused = spec
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[wdtype]
    if device == "cpu":
        dtype, autocast = torch.float32, False
    model = build_model(shape, dtype, device, ckpt, args.attn)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=(fused and device.startswith("cuda")) or None)
    model, opt = acc.prepare(model, opt)
    loss_fn = SFTLoss(chunk)
    g = torch.Generator().manual_seed(0)
    mb = micro or args.batch
    if args.batch % mb:
        raise ValueError(f"batch {args.batch} is not a multiple of the micro-batch {mb}")

    def batches():
        ids = torch.randint(0, shape["vocab_size"], (args.batch, args.seq), generator=g)
        out = []
        for s in range(0, args.batch, mb):
            x = ids[s:s + mb].to(device)
            out.append({"input_ids": x, "labels": x, "attention_mask": torch.ones_like(x),
                        "position_ids": None, "num_tokens": x.numel()})
        return out

    ctx = (torch.autocast("cuda", dtype=torch.bfloat16) if autocast else torch.autocast(device, enabled=False))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        data = batches()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with ctx:
            out = sft_step(acc, model, opt, data, loss_fn, max_grad_norm=1.0)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(out["loss"])
    step_s = sorted(times)[len(times) // 2]
    tokens = args.batch * args.seq
    row = {"variant": name, "params": n_params, "tokens_per_step": tokens, "step_s": step_s,
           "tokens_per_s": tokens / step_s, "mfu": 6 * n_params * tokens / step_s / args.peak_flops,
           "peak_mem_gib": (torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None),
           "loss_first": losses[0], "loss_last": losses[-1], "weights": wdtype, "autocast_bf16": autocast,
           "grad_ckpt": ckpt, "micro_batch": mb, "loss_chunk": chunk, "fused_adamw": fused, "error": None}
    del model, opt
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke: a tiny model, 2 x 64 tokens")
    ap.add_argument("--device", default=None)
    ap.add_argument("--batch", type=count, default=None, help="sequences per optimiser step (default 8)")
    ap.add_argument("--seq", type=count, default=None, help="tokens per sequence (default 2048)")
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--steps", type=count, default=None)
    ap.add_argument("--peak-flops", type=float, default=989e12, help="H200 bf16 dense")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager, flash_attention_2)")
    ap.add_argument("--variants", default="", help="comma list of variant names (default: all)")
    default_out = (Path(os.environ["OUT"]) / "sft.json" if os.environ.get("OUT")
                   else Path(__file__).resolve().parent / "results" / "sft.json")
    ap.add_argument("--out", default=str(default_out))
    args = ap.parse_args(argv)
    check_outputs(("--out", args.out, False))

    shape = dict(TINY if args.tiny else QWEN25_15B)
    for key, val in (("hidden_size", args.hidden), ("num_hidden_layers", args.layers),
                     ("num_attention_heads", args.heads), ("num_key_value_heads", args.kv_heads),
                     ("intermediate_size", args.intermediate), ("vocab_size", args.vocab)):
        if val is not None:
            shape[key] = val
    device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    args.batch = args.batch or (2 if args.tiny else 8)
    args.seq = args.seq or (64 if args.tiny else 2048)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    args.steps = args.steps or (2 if args.tiny else 5)
    names = [v.strip() for v in args.variants.split(",") if v.strip()] or list(VARIANTS)
    if args.tiny and not args.variants:
        names = ["bf16+ckpt", "bf16, micro 2 x accum", "bf16+ckpt, full logits"]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; known: {list(VARIANTS)}")

    from accelerate import Accelerator

    acc = Accelerator(cpu=device == "cpu")
    info = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "shape": shape, "batch": args.batch, "seq": args.seq,
            "peak_flops": args.peak_flops, "attn": args.attn, "steps": args.steps, "warmup": args.warmup}
    print(json.dumps(info))
    rows = []
    for name in names:
        try:
            rows.append(run_variant(acc, name, VARIANTS[name], args, shape, device))
        except Exception as exc:  # one failing variant must not stop the others
            traceback.print_exc(limit=3)
            rows.append({"variant": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            print(f"[bench/sft] {name}: FAILED: {rows[-1]['error']}", file=sys.stderr)
        finally:
            acc.free_memory()
            gc.collect()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()

    print(f"\n{'variant':38s} {'step s':>8s} {'tok/s':>10s} {'MFU':>6s} {'peak GiB':>9s} {'loss 1st→last':>16s}")
    for r in rows:
        if r.get("error"):
            print(f"{r['variant']:38s} FAILED: {r['error'][:80]}")
            continue
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        print(f"{r['variant']:38s} {r['step_s']:8.3f} {r['tokens_per_s']:10.0f} {100 * r['mfu']:5.1f}% "
              f"{mem:>9s} {r['loss_first']:7.3f}→{r['loss_last']:7.3f}")
    save_json(args.out, {"info": info, "results": rows})
    print(f"wrote {args.out}")
    return 0 if any(not r.get("error") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
