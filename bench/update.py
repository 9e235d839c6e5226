"""Update speed of the RL trainer's own `policy_update` on a random-init model (no download).

Default: a Qwen2-1.5B-shaped model (hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate
8960, vocab 151936, tied embeddings) in bf16 on CUDA, one update on 8 sequences × 2048 tokens,
for a grid of variants (micro-batch size, gradient checkpointing, log-prob chunk size). Reports
tokens/s, model-FLOPs utilisation MFU = 6 · N_params · tokens / time / peak, and peak memory;
prints a table and writes JSON. A variant that fails (e.g. out of memory) is reported and the
others still run.

    python bench/update.py                                   # the GPU benchmark
    python bench/update.py --variants "mb=4,ckpt=0,chunk=2048;mb=8,ckpt=1,chunk=2048;plain"
    python bench/update.py --tiny                            # CPU smoke test, tiny shape

Variant keys: mb (sequences per micro-batch), ckpt (gradient checkpointing 0/1), chunk (tokens
per log-softmax chunk, 0 = one chunk per micro-batch), ent (log the entropy 0/1). `plain` is a
reference loop outside the trainer: full-batch forward, full [B, L, V] logits, log-softmax,
backward, fused AdamW.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from drkernel.trainer import TrainConfig, UpdateSample, make_optimizer, policy_update  # noqa: E402

QWEN2_15B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=4096)
GPU_VARIANTS = ("mb=8,ckpt=0,chunk=0;mb=8,ckpt=0,chunk=2048;mb=4,ckpt=0,chunk=2048;mb=2,ckpt=0,chunk=2048;"
                "mb=4,ckpt=0,chunk=2048,ent=0;mb=8,ckpt=1,chunk=2048;mb=4,ckpt=1,chunk=2048;plain")
TINY_VARIANTS = "mb=2,ckpt=0,chunk=0;mb=1,ckpt=1,chunk=16;plain"
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0}  # dense


def parse_variant(text: str) -> dict:
    text = text.strip()
    if text == "plain":
        return {"name": "plain", "plain": True}
    v = {"mb": 8, "ckpt": 0, "chunk": 2048, "ent": 1}
    for part in text.split(","):
        key, _, val = part.partition("=")
        if key.strip() not in v or not val.strip():
            raise ValueError(f"bad variant part {part!r} in {text!r} (keys: mb, ckpt, chunk, ent)")
        v[key.strip()] = int(val)
    v["name"] = f"mb={v['mb']},ckpt={v['ckpt']},chunk={v['chunk']}" + ("" if v["ent"] else ",ent=0")
    v["plain"] = False
    return v


def build_model(shape: dict, device: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", **shape)
    cfg.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        except TypeError:  # older transformers
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    return model.to(device=device, dtype=dtype)


def n_params(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:  # tied embeddings count once
            seen.add(p.data_ptr())
            total += p.numel()
    return total


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


def run_variant(v: dict, model, accelerator, samples, args, device: str, params: int) -> dict:
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    optimizer = None
    try:
        # mismatch correction off: the random "rollout" log-probs would reject every sequence
        cfg = TrainConfig(micro_batch_size=v.get("mb", len(samples)), logprob_chunk_size=v.get("chunk", 0),
                          log_entropy=bool(v.get("ent", 1)), mismatch_correction=False, learning_rate=1e-7,
                          num_iterations=1, skip_zero_advantage=False)
        if v.get("ckpt"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        model.train()
        optimizer = make_optimizer(model, cfg, device)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()

        def once():
            if v["plain"]:
                plain_update(model, optimizer, samples, device)
            else:
                policy_update(model, optimizer, samples, cfg, accelerator, pad_id=0)

        for _ in range(args.warmup):
            once()
        sync(device)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            once()
            sync(device)
            times.append(time.perf_counter() - t0)
        sec = sorted(times)[len(times) // 2]
        row = {"variant": v["name"], "ok": True, "step_s": sec, "tokens": tokens, "tokens_per_s": tokens / sec,
               "tflops": 6 * params * tokens / sec / 1e12}
        row["mfu"] = row["tflops"] / args.peak_tflops if args.peak_tflops else None
        if device.startswith("cuda"):
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        return row
    except Exception as exc:  # noqa: BLE001 - one failing variant must not stop the others
        print(f"[bench/update] variant {v['name']} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        traceback.print_exc(limit=3)
        return {"variant": v["name"], "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    finally:
        for p in model.parameters():
            p.grad = None
        del optimizer
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shape on CPU (smoke test)")
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda, or cpu with --tiny)")
    ap.add_argument("--dtype", default=None, help="bf16 | fp32 (default: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--batch", type=int, default=None, help="sequences (default 8; 2 with --tiny)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 2048; 64 with --tiny)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens of each sequence (no loss)")
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--variants", default=None, help="';'-separated, e.g. 'mb=4,ckpt=0,chunk=2048;plain'")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak dense TFLOPS for MFU (auto on H100/H200/A100)")
    default_out = (Path(os.environ["OUT"]) / "update.json" if os.environ.get("OUT")
                   else Path(__file__).resolve().parent / "results" / "update.json")
    ap.add_argument("--out", default=str(default_out))
    args = ap.parse_args(argv)

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
    args.warmup = 1 if args.warmup is None else args.warmup
    args.repeats = (1 if args.tiny else 3) if args.repeats is None else args.repeats
    gpu_name = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu"
    if args.peak_tflops is None and device.startswith("cuda") and dtype == torch.bfloat16:
        args.peak_tflops = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in gpu_name), None)
    variants = [parse_variant(t) for t in (args.variants or (TINY_VARIANTS if args.tiny else GPU_VARIANTS)).split(";")
                if t.strip()]

    from accelerate import Accelerator

    accelerator = Accelerator(cpu=not device.startswith("cuda"))
    model = build_model(shape, device, dtype)
    params = n_params(model)
    samples = make_samples(batch, seq_len, prompt_len, shape["vocab_size"])
    print(f"[bench/update] {gpu_name}: qwen2 {shape['num_hidden_layers']}L h{shape['hidden_size']} "
          f"V{shape['vocab_size']} ({params / 1e9:.3f}B params), {batch} x {seq_len} tokens, {dtype_name}; "
          f"peak {args.peak_tflops} TFLOPS", flush=True)
    rows = []
    for v in variants:
        row = run_variant(v, model, accelerator, samples, args, device, params)
        rows.append(row)
        print(json.dumps(row), flush=True)

    print()
    print(f"{'variant':34s} {'step s':>8s} {'tok/s':>10s} {'TFLOPS':>8s} {'MFU':>6s} {'peak GiB':>9s}")
    for r in rows:
        if not r["ok"]:
            print(f"{r['variant']:34s} FAILED: {r['error'][:80]}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "n/a"
        print(f"{r['variant']:34s} {r['step_s']:8.3f} {r['tokens_per_s']:10.0f} {r['tflops']:8.1f} {mfu:>6s} {peak:>9s}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": gpu_name, "dtype": dtype_name, "shape": shape, "params": params, "batch": batch,
        "seq_len": seq_len, "prompt_len": prompt_len, "peak_tflops": args.peak_tflops,
        "torch": torch.__version__, "results": rows}, indent=1))
    print(f"\nwrote {out}")
    return 0 if any(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
