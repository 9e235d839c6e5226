"""Rollout throughput: plain `model.generate` vs our static-cache decode loop (eager and compiled).

A random-init model with Qwen2.5-0.5B's shapes (no download), a batch of random prompts,
and a fixed number of new tokens per row (EOS ignored, so every row decodes the same
length). Prints a table and writes JSON.

    python bench/rollout.py --device cuda                  # the real benchmark (bf16)
    python bench/rollout.py --device cpu --layers 1 --batch 2 --prompt-len 8 --new-tokens 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.entry import check_outputs, count, exit_status  # noqa: E402
from bench.jsonfile import save_json  # noqa: E402
from bench.qwen2 import random_model  # noqa: E402
from drkernel.generation import GenerationConfig, generate  # noqa: E402

QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                  tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0,
                  rms_norm_eps=1e-6)


def build_model(layers: int, device: str, dtype: torch.dtype):
    # no end-of-sequence token: every row decodes the full length
    model = random_model(dict(QWEN25_05B, num_hidden_layers=layers, eos_token_id=None), device, dtype)
    model.generation_config.eos_token_id = None
    return model.eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_plain_generate(model, prompts, new_tokens, device):
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0,
                       top_p=1.0, pad_token_id=0)


def profile_run(fn) -> dict:
    """Where one generate call's time goes: CUDA kernel totals and how many CUDA graph launches
    (a compiled step that is not replayed as a graph shows thousands of small kernel launches)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    cuda = sorted((e for e in events if getattr(e, "device_time_total", 0) > 0),
                  key=lambda e: -e.device_time_total)
    graph_launches = sum(e.count for e in events if "cudaGraphLaunch" in e.key)
    kernel_launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    top = [{"kernel": e.key[:90], "calls": e.count, "ms": round(e.device_time_total / 1e3, 2)} for e in cuda[:12]]
    summary = {"graph_launches": graph_launches, "kernel_launches": kernel_launches,
               "device_ms": round(sum(e.device_time_total for e in cuda) / 1e3, 1), "top": top}
    print(json.dumps(summary, indent=1), flush=True)
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=count, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--layers", type=int, default=QWEN25_05B["num_hidden_layers"])
    ap.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"), help="bf16 | fp16 | fp32 (default bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--repeats", type=count, default=3)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled static backend")
    ap.add_argument("--dynamic-shapes", action="store_true",
                    help="add a compiled run after two other prompt lengths: dynamo then compiles the decode "
                         "step with dynamic batch/cache sizes, as it does in train.py once turns change shape")
    ap.add_argument("--methods", default="", help="comma list of substrings (or =exact names): run only matching methods")
    ap.add_argument("--profile", action="store_true",
                    help="after timing, profile one compiled static run: top CUDA kernels and graph launches")
    default_out = (Path(os.environ["OUT"]) / "rollout.json" if os.environ.get("OUT")
                   else Path(__file__).resolve().parent / "results" / "rollout.json")
    ap.add_argument("--out", default=str(default_out))
    args = ap.parse_args(argv)
    check_outputs(("--out", args.out, False))

    from drkernel.evaluator import resolve_device
    device = resolve_device(args.device)  # a GPU asked for and missing: one line, exit 2
    dtype_name = args.dtype or ("bf16" if device.startswith("cuda") else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    model = build_model(args.layers, device, dtype)
    tokenizer = types.SimpleNamespace(eos_token_id=None, pad_token_id=0)  # ids only
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, QWEN25_05B["vocab_size"], (args.batch, args.prompt_len), generator=g).tolist()

    def ours(backend, compile_, gqa_decode=True):
        cfg = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=True, temperature=1.0,
                               backend=backend, batch_size=args.batch, ignore_eos=True,
                               compile=compile_, seed=0, gqa_decode=gqa_decode)
        return lambda: generate(model, tokenizer, prompts, cfg)

    def dynamic_shapes(run):
        """The first call first decodes half the batch, then a quarter of it with 512 more prompt
        tokens (other batch and cache sizes); automatic dynamic shapes then make the compiled
        step's sizes symbolic for the timed shape. Dynamo's caches are reset first, so the static
        graph compiled for the timed shape by an earlier method cannot be picked."""
        state = {"warm": False}

        def fn():
            if not state["warm"]:
                torch._dynamo.reset()
                for rows, extra in ((max(1, args.batch // 2), 0), (max(1, args.batch // 4), 512)):
                    other = [p + (p * 2)[:extra] for p in prompts[:rows]]
                    generate(model, tokenizer, other, GenerationConfig(
                        max_new_tokens=8, backend="static", batch_size=args.batch, ignore_eos=True,
                        compile=True, seed=0))
                state["warm"] = True
            run()
        return fn

    methods = [("hf model.generate", lambda: run_plain_generate(model, prompts, args.new_tokens, device)),
               ("ours hf (+logits)", ours("hf", False)),
               ("ours static eager", ours("static", False))]
    if device.startswith("cuda") and not args.no_compile:
        # the same compiled loop with transformers' SDPA (K/V heads expanded every step), to show
        # what the GQA decode attention is worth
        methods.append(("ours static compiled kv-expand", ours("static", True, gqa_decode=False)))
        methods.append(("ours static compiled", ours("static", True)))
        if args.dynamic_shapes:
            methods.append(("ours static compiled dynamic-shapes", dynamic_shapes(ours("static", True))))

    if args.methods:
        keys = [k.strip() for k in args.methods.split(",") if k.strip()]
        methods = [m for m in methods if any(m[0] == k[1:] if k.startswith("=") else k in m[0] for k in keys)]
    n_tokens = args.batch * args.new_tokens
    rows = []
    for name, fn in methods:
        row = {"method": name}
        try:
            t0 = time.perf_counter()
            fn()  # warm-up with the timed shapes (compiles and captures graphs once)
            sync(device)
            row["warmup_s"] = time.perf_counter() - t0
            times = []
            for _ in range(max(1, args.repeats)):
                sync(device)
                t0 = time.perf_counter()
                fn()
                sync(device)
                times.append(time.perf_counter() - t0)
            row.update(seconds=statistics.median(times), best_s=min(times),
                       tokens_per_s=n_tokens / statistics.median(times),
                       best_tokens_per_s=n_tokens / min(times))
        except Exception as exc:  # keep the other rows of the table
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        rows.append(row)
        print(f"  done: {name}", file=sys.stderr, flush=True)

    profile_summary = None
    if args.profile and device.startswith("cuda") and not args.no_compile:
        profile_summary = profile_run(ours("static", True))

    import transformers

    result = {
        "config": {"device": device, "dtype": dtype_name, "batch": args.batch,
                   "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                   "layers": args.layers, "repeats": args.repeats, "model": "qwen2.5-0.5b-shaped random"},
        "env": {"torch": torch.__version__, "transformers": transformers.__version__,
                "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None},
        "results": rows,
        "profile_static_compiled": profile_summary,
    }
    base = next((r.get("tokens_per_s") for r in rows if r.get("tokens_per_s")), None)
    print(f"{'method':<32}{'tokens/s':>12}{'median s':>10}{'vs generate':>13}")
    for r in rows:
        if "error" in r:
            print(f"{r['method']:<32}  ERROR {r['error']}")
            continue
        rel = r["tokens_per_s"] / base if base else float("nan")
        print(f"{r['method']:<32}{r['tokens_per_s']:>12.1f}{r['seconds']:>10.3f}{rel:>12.2f}x")
    save_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
