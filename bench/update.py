"""Update speed of the RL trainer's own `policy_update` on a random-init model (no download).

Default: a Qwen2-1.5B-shaped model (hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate
8960, vocab 151936, tied embeddings) in bf16 on CUDA, one update on 8 sequences × 2048 tokens,
for a grid of variants (torch.compile, micro-batch size, gradient checkpointing, log-prob chunk
size). Reports tokens/s, model-FLOPs utilisation MFU = 6 · N_params · tokens / time / peak (the
headline), MFU+attn (the same plus the causal attention matmuls, 6 · layers · d_attn · Σ L²), and
peak memory; prints a table and writes the JSON after every variant. Each variant gets a fresh
model, prepared as the Trainer prepares it (`modeling.enable_gradient_checkpointing`,
`modeling.compile_decoder_layers`); a variant that fails (out of memory, a compile error) is
reported and the others still run.

    python bench/update.py                                   # the GPU benchmark (GPU_VARIANTS)
    python bench/update.py --variants "compile=1,mb=8,ckpt=0,chunk=0;mb=4,ckpt=0,chunk=2048;plain"
    python bench/update.py --tiny                            # CPU smoke test, tiny shape

Variant keys: mb (sequences per micro-batch), ckpt (gradient checkpointing: 0 = off, n = every
n-th decoder layer, 1 = all), chunk (tokens per log-softmax chunk, 0 = one chunk per micro-batch,
no recompute), ent (log the entropy 0/1, the trainer's default is 1), compile (TrainConfig
torch_compile 0/1: decoder layers and log-prob head), chead (with compile=1: 0 leaves the head
eager, to separate the two gains). `plain` is a reference loop outside the trainer: full-batch
forward, full [B, L, V] logits, log-softmax, backward, fused AdamW.

Compiled graphs stay in the process: variants with the same shapes reuse them (a fresh model
passes the same guards), so the grid orders the compiled variants by shape. torch.compile's
automatic dynamic shapes compile a second, shape-generic graph the first time a shape changes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # less fragmentation
import platform
import sys
import time
import traceback
from pathlib import Path

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.entry import InputError, check_outputs, count, exit_status  # noqa: E402
from bench.jsonfile import save_json  # noqa: E402
from bench.qwen2 import random_model  # noqa: E402
from drkernel import modeling  # noqa: E402
from drkernel.trainer import TrainConfig, UpdateSample, disable_dropout, make_optimizer, policy_update  # noqa: E402

QWEN2_15B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=4096)
# Most promising first; compiled variants grouped by shape so they share compiled graphs (the
# static [8, 2048] layer graph first, then mb=4, which compiles the shape-generic one); eager
# baselines and the plain loop last.
GPU_VARIANTS = ("compile=1,mb=8,ckpt=0,chunk=0;"      # no head recompute; bf16 logits kept (~5 GiB)
                "compile=1,mb=8,ckpt=0,chunk=4096;"   # head recomputed per chunk: less memory
                "compile=1,mb=8,ckpt=4,chunk=0;"      # 7 of 28 layers recomputed, if the first is > 60 GiB
                "compile=1,chead=0,mb=8,ckpt=0,chunk=2048;"  # layers only: what the head compile adds
                "compile=1,mb=4,ckpt=0,chunk=0;"      # half the activations (second, dynamic compile)
                "mb=8,ckpt=0,chunk=2048;"             # eager baselines
                "mb=4,ckpt=0,chunk=2048;"
                "plain")
TINY_VARIANTS = "mb=2,ckpt=0,chunk=0;mb=1,ckpt=1,chunk=16;plain"
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0}  # dense
KEYS = ("mb", "ckpt", "chunk", "ent", "compile", "chead")


def parse_variant(text: str) -> dict:
    text = text.strip()
    if text == "plain":
        return {"name": "plain", "plain": True}
    v = {"mb": 8, "ckpt": 0, "chunk": 2048, "ent": 1, "compile": 0}
    for part in text.split(","):
        key, _, val = part.partition("=")
        key = key.strip()
        if key not in KEYS or not val.strip():
            raise InputError(f"bad variant part {part!r} in {text!r} (keys: {', '.join(KEYS)})")
        try:
            v[key] = int(val)
        except ValueError:
            raise InputError(f"bad variant part {part!r} in {text!r}: the value must be an integer") from None
    if v["ckpt"] < 0 or v["chunk"] < 0 or v.get("chead", 0) not in (0, 1) or v["compile"] not in (0, 1):
        raise InputError(f"bad variant {text!r}: ckpt, chunk >= 0; compile, chead 0 or 1")
    v.setdefault("chead", v["compile"])
    if v["chead"] and not v["compile"]:
        raise InputError(f"bad variant {text!r}: chead=1 needs compile=1")
    v["name"] = (("compile=1," if v["compile"] else "") + ("chead=0," if v["compile"] and not v["chead"] else "")
                 + f"mb={v['mb']},ckpt={v['ckpt']},chunk={v['chunk']}" + ("" if v["ent"] else ",ent=0"))
    v["plain"] = False
    return v


def build_model(shape: dict, device: str, dtype: torch.dtype):
    return random_model(dict(shape, use_cache=False), device, dtype)


def attention_flops(shape: dict, samples) -> float:
    """FLOPs of the causal attention matmuls (QK^T and PV), forward + backward: 6 · layers · d_attn · Σ L²
    (forward, each costs 2 · L² · d_attn over the full square, half of it under the causal mask;
    backward costs twice the forward)."""
    d_attn = shape["num_attention_heads"] * shape.get("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
    return 6.0 * shape["num_hidden_layers"] * d_attn * sum(
        (len(s.prompt_ids) + len(s.response_ids)) ** 2 for s in samples)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields tied embeddings once


def make_samples(batch: int, seq_len: int, prompt_len: int, vocab: int, seed: int = 0) -> list[UpdateSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(batch):
        ids = torch.randint(0, vocab, (seq_len,), generator=g).tolist()
        resp = seq_len - prompt_len
        out.append(UpdateSample(ids[:prompt_len], ids[prompt_len:], [0.0] * resp,
                                advantage=1.0 if i % 2 == 0 else -1.0))
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def plain_update(model, optimizer, samples, device):
    """A plain bf16 loop for reference: full logits, log-softmax, gather, mean loss, one step."""
    ids = torch.tensor([s.prompt_ids + s.response_ids for s in samples], device=device)
    adv = torch.tensor([s.advantage for s in samples], device=device)
    p = len(samples[0].prompt_ids)
    logits = model(input_ids=ids, use_cache=False).logits[:, p - 1:-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, p:, None]).squeeze(-1)
    loss = -(adv[:, None] * logp).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_variant(v: dict, shape: dict, dtype, accelerator, samples, args, device: str) -> dict:
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    model = optimizer = None
    row: dict = {"variant": v["name"]}
    try:
        if device.startswith("cuda"):
            row["start_gib"] = torch.cuda.memory_allocated() / 2**30  # what earlier variants left behind
        # mismatch correction off: the random "rollout" log-probs would reject every sequence
        cfg = TrainConfig(micro_batch_size=v.get("mb", len(samples)), logprob_chunk_size=v.get("chunk", 0),
                          log_entropy=bool(v.get("ent", 1)), mismatch_correction=False, learning_rate=1e-7,
                          num_iterations=1, skip_zero_advantage=False, gradient_checkpointing=bool(v.get("ckpt")),
                          gradient_checkpointing_every=max(1, v.get("ckpt", 0)),
                          torch_compile=bool(v.get("chead")))
        # a fresh model per variant, prepared in the Trainer's order
        model = build_model(shape, device, dtype)
        params = n_params(model)
        if cfg.gradient_checkpointing:
            modeling.enable_gradient_checkpointing(model, cfg.gradient_checkpointing_every)
        disable_dropout(model)
        if v.get("compile"):
            modeling.compile_decoder_layers(model)
        model.train()
        optimizer = make_optimizer(model, cfg, device)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()

        def once():
            if v["plain"]:
                plain_update(model, optimizer, samples, device)
            else:
                policy_update(model, optimizer, samples, cfg, accelerator, pad_id=0)

        t0 = time.perf_counter()
        for _ in range(args.warmup):
            once()
        sync(device)
        row["warmup_s"] = time.perf_counter() - t0  # includes compiling
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            once()
            sync(device)
            times.append(time.perf_counter() - t0)
        sec = sorted(times)[len(times) // 2]
        row.update({"ok": True, "step_s": sec, "tokens": tokens, "tokens_per_s": tokens / sec,
                    "tflops": 6 * params * tokens / sec / 1e12,
                    "tflops_attn": (6 * params * tokens + attention_flops(shape, samples)) / sec / 1e12})
        row["mfu"] = row["tflops"] / args.peak_tflops if args.peak_tflops else None
        row["mfu_attn"] = row["tflops_attn"] / args.peak_tflops if args.peak_tflops else None
        if device.startswith("cuda"):
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        return row
    except Exception as exc:  # noqa: BLE001 - one failing variant must not stop the others
        print(f"[bench/update] variant {v['name']} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        traceback.print_exc(limit=3)
        row.update({"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        # a compiler failure (not an OOM inside compiled code) would repeat in every compiled variant
        row["compile_error"] = (type(exc).__module__.startswith(("torch._dynamo", "torch._inductor"))
                                and "out of memory" not in str(exc).lower())
        return row
    finally:
        model = optimizer = None  # free this variant's weights, gradients and optimizer state
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shape on CPU (smoke test)")
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda, or cpu with --tiny)")
    ap.add_argument("--dtype", default=None, choices=("bf16", "fp32"), help="bf16 | fp32 (default: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--batch", type=count, default=None, help="sequences (default 8; 2 with --tiny)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 2048; 64 with --tiny)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens of each sequence (no loss)")
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--variants", default=None, help="';'-separated, e.g. 'mb=4,ckpt=0,chunk=2048;plain'")
    ap.add_argument("--warmup", type=int, default=None, help="untimed updates per variant (default 2; 1 with --tiny)")
    ap.add_argument("--repeats", type=count, default=None)
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak dense TFLOPS for MFU (auto on H100/H200/A100)")
    ap.add_argument("--mem-limit-gib", type=float, default=60.0, help="the summary's best variant must stay under this")
    default_out = (Path(os.environ["OUT"]) / "update.json" if os.environ.get("OUT")
                   else Path(__file__).resolve().parent / "results" / "update.json")
    ap.add_argument("--out", default=str(default_out))
    args = ap.parse_args(argv)
    check_outputs(("--out", args.out, False))

    device = args.device or ("cpu" if args.tiny else "cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("bench/update.py: no CUDA device; use --tiny (or --device cpu) on a CPU machine", file=sys.stderr)
        return 2
    dtype_name = args.dtype or ("bf16" if device.startswith("cuda") else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype_name]
    shape = dict(TINY if args.tiny else QWEN2_15B)
    for key, name in (("hidden_size", "hidden"), ("num_hidden_layers", "layers"), ("num_attention_heads", "heads"),
                      ("num_key_value_heads", "kv_heads"), ("intermediate_size", "intermediate"),
                      ("vocab_size", "vocab")):
        if getattr(args, name) is not None:
            shape[key] = getattr(args, name)
    batch = args.batch or (2 if args.tiny else 8)
    seq_len = args.seq_len or (64 if args.tiny else 2048)
    prompt_len = args.prompt_len or (8 if args.tiny else 128)
    if not 1 <= prompt_len < seq_len:
        print("bench/update.py: need 1 <= --prompt-len < --seq-len", file=sys.stderr)
        return 2
    args.warmup = (1 if args.tiny else 2) if args.warmup is None else args.warmup
    args.repeats = (1 if args.tiny else 3) if args.repeats is None else args.repeats
    gpu_name = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu"
    if args.peak_tflops is None and device.startswith("cuda") and dtype == torch.bfloat16:
        args.peak_tflops = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in gpu_name), None)
    variants = [parse_variant(t) for t in (args.variants or (TINY_VARIANTS if args.tiny else GPU_VARIANTS)).split(";")
                if t.strip()]

    import transformers
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=not device.startswith("cuda"))
    params = n_params(build_model(shape, "meta", dtype))
    samples = make_samples(batch, seq_len, prompt_len, shape["vocab_size"])
    print(f"[bench/update] {gpu_name}: qwen2 {shape['num_hidden_layers']}L h{shape['hidden_size']} "
          f"V{shape['vocab_size']} ({params / 1e9:.3f}B params), {batch} x {seq_len} tokens, {dtype_name}; "
          f"peak {args.peak_tflops} TFLOPS; compile backend {modeling.compile_backend()}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    compile_failed = None
    for v in variants:
        t0 = time.perf_counter()
        if compile_failed and v.get("compile"):  # do not spend minutes failing the same compile again
            row = {"variant": v["name"], "ok": False, "error": f"skipped: {compile_failed} failed to compile"}
        else:
            print(f"[bench/update] {v['name']} ...", flush=True)
            row = run_variant(v, shape, dtype, accelerator, samples, args, device)
            if row.get("compile_error"):
                compile_failed = v["name"]
        row["variant_wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print(json.dumps(row), flush=True)
        save_json(out, {  # after every variant: a killed run still leaves its results
            "device": gpu_name, "dtype": dtype_name, "shape": shape, "params": params, "batch": batch,
            "seq_len": seq_len, "prompt_len": prompt_len, "peak_tflops": args.peak_tflops,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "compile_backend": modeling.compile_backend(), "results": rows})

    def pct(x):
        return f"{100 * x:.1f}%" if x is not None else "n/a"

    print()
    print(f"{'variant':44s} {'step s':>7s} {'tok/s':>8s} {'TFLOPS':>7s} {'MFU':>6s} {'MFU+attn':>8s} "
          f"{'peak GiB':>8s} {'warmup s':>8s}")
    for r in rows:
        if not r["ok"]:
            print(f"{r['variant']:44s} FAILED: {r['error'][:80]}")
            continue
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "n/a"
        print(f"{r['variant']:44s} {r['step_s']:7.3f} {r['tokens_per_s']:8.0f} {r['tflops']:7.1f} "
              f"{pct(r['mfu']):>6s} {pct(r['mfu_attn']):>8s} {peak:>8s} {r['warmup_s']:8.1f}")
    print("MFU = 6·N·tokens/time/peak (the headline); MFU+attn adds the causal attention matmuls")
    fits = [r for r in rows if r["ok"] and r.get("mfu") is not None and r.get("peak_gib") is not None
            and r["peak_gib"] <= args.mem_limit_gib and r["variant"] != "plain"]
    if fits:
        best = max(fits, key=lambda r: r["mfu"])
        print(f"best trainer variant within {args.mem_limit_gib:g} GiB: {best['variant']}: "
              f"{pct(best['mfu'])} MFU at {best['peak_gib']:.1f} GiB")
    print(f"\nwrote {out}")
    return 0 if any(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
