"""Device-time share of the candidate's own Triton kernels (the paper's profiling-based reward).

`profile_cuda` runs a forward a few times under `torch.profiler`, keeps only device kernel events
(memcpy/memset included) and hands them to `summarize_kernels`, which splits device time into

- `candidate`: kernels launched from the candidate's own `@triton.jit` functions,
- `library`:   cuBLAS/cuDNN/CUTLASS/ATen kernels, memcpy/memset,
- `other`:     everything else (e.g. somebody else's Triton kernels, Inductor output).

Name matching (deliberately strict; KernelGYM matched by substring, which lets torch's own kernels
count as the candidate's when the names overlap, e.g. a candidate kernel called `gemm`):
a device kernel name counts as the candidate's iff it is EXACTLY one of `candidate_names` (what
Triton >= 3.0 emits: the kernel symbol is the Python function name), or that name followed by a
Triton 2.x specialization suffix `_<digits><d|c|e>...` (e.g. `relu_kernel_0d1d2de`, the suffix made
of argument indices and specialisation letters, at least one letter). Nothing else: no prefix,
substring or case-insensitive match. Names are compared after stripping surrounding whitespace.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Iterable

log = logging.getLogger(__name__)

# Triton 2.x appended `_0d1d2de`-style specialisation signatures to the kernel symbol.
_TRITON_SUFFIX = re.compile(r"_(?=[0-9cde]*[cde])(?:[0-9]+[cde]*)+$")

# Lower-case substrings that identify vendor-library / ATen / copy kernels.
_LIBRARY_MARKERS = (
    "cublas", "cublaslt", "cudnn", "cutlass", "cute::", "nvjet", "xmma", "gemm", "gemv",
    "at::native", "at::cuda", "aten::", "c10::", "elementwise", "reduce_kernel", "reduce",
    "memcpy", "memset", "splitkreduce", "cub::", "thrust::", "softmax_warp", "cunn_",
    "pytorch_flash", "flash_fwd", "flash_bwd", "fmha", "ampere_", "volta_", "turing_", "sm80_",
    "sm90_", "sm100_", "nchwtonhwc", "nhwctonchw", "implicit_convolve", "winograd", "fft",
)

NAME_WIDTH = 80


def is_candidate_name(name: str, candidate_names: Iterable[str]) -> bool:
    """Exact match, or exact match plus a Triton 2.x specialisation suffix (see module doc)."""
    name = name.strip()
    names = set(candidate_names)
    if name in names:
        return True
    m = _TRITON_SUFFIX.search(name)
    return bool(m) and m.start() > 0 and name[: m.start()] in names


def classify_kernel(name: str, candidate_names: Iterable[str]) -> str:
    """`candidate`, `library` or `other`."""
    if is_candidate_name(name, candidate_names):
        return "candidate"
    low = name.lower()
    if any(marker in low for marker in _LIBRARY_MARKERS):
        return "library"
    return "other"


def _truncate(name: str, width: int = NAME_WIDTH) -> str:
    name = " ".join(name.split())
    return name if len(name) <= width else name[: width - 1] + "…"


def summarize_kernels(events: list[tuple[str, float]], candidate_names: set[str],
                      top_k: int = 10) -> dict:
    """Split device time (µs per launch) into candidate / library / other shares.

    Returns `triton_time_share`, `library_share`, `other_share` (None when the total is 0),
    `total_device_ms`, `num_launches` and `kernels`: the `top_k` kernels by total time, each
    `{name, kind, calls, total_ms, share}`.
    """
    names = {str(n).strip() for n in (candidate_names or ()) if n}
    per_kind = {"candidate": 0.0, "library": 0.0, "other": 0.0}
    per_name: dict[str, dict] = {}
    total = 0.0
    for name, us in events:
        name = str(name)
        us = float(us) if us is not None else 0.0
        if not us > 0.0:  # negative / NaN / zero durations carry no time
            us = 0.0
        kind = classify_kernel(name, names)
        per_kind[kind] += us
        total += us
        row = per_name.setdefault(name, {"name": _truncate(name), "kind": kind, "calls": 0, "us": 0.0})
        row["calls"] += 1
        row["us"] += us

    def share(x: float) -> float | None:
        return x / total if total > 0 else None

    rows = sorted(per_name.values(), key=lambda r: (-r["us"], r["name"]))[: max(0, top_k)]
    kernels = [{"name": r["name"], "kind": r["kind"], "calls": r["calls"],
                "total_ms": r["us"] / 1000.0, "share": share(r["us"])} for r in rows]
    return {
        "triton_time_share": share(per_kind["candidate"]),
        "library_share": share(per_kind["library"]),
        "other_share": share(per_kind["other"]),
        "total_device_ms": total / 1000.0,
        "num_launches": len(events),
        "kernels": kernels,
    }


def _event_us(evt: Any) -> float:
    """Duration of one device event in µs, across torch versions."""
    tr = getattr(evt, "time_range", None)
    if tr is not None:
        try:
            return float(tr.elapsed_us())
        except Exception:
            pass
    for attr in ("device_time_total", "cuda_time_total", "device_time", "cuda_time"):
        try:
            v = getattr(evt, attr, None)
        except Exception:
            v = None
        if v is not None:
            return float(v)
    return 0.0


def _device_events(prof: Any) -> list[tuple[str, float]]:
    import torch

    cuda_type = torch.autograd.DeviceType.CUDA
    out: list[tuple[str, float]] = []
    for evt in prof.events() or []:
        if getattr(evt, "device_type", None) != cuda_type:
            continue
        if getattr(evt, "is_user_annotation", False):  # GPU-side ranges, not kernels
            continue
        name = getattr(evt, "name", None) or getattr(evt, "key", "")
        out.append((str(name), _event_us(evt)))
    return out


def profile_cuda(fn: Callable[[], Any], candidate_names: set[str], calls: int = 5,
                 warmup: int = 1) -> dict | None:
    """Profile `calls` calls of `fn` on the GPU; `summarize_kernels` of its device kernels + `calls`.

    None when CUDA is unavailable or the profiler fails (logged, never raised). `fn` itself
    raising is the caller's business: it propagates.
    """
    try:
        import torch
        if not torch.cuda.is_available():
            return None
        from torch.profiler import ProfilerActivity, profile
    except Exception as exc:  # pragma: no cover - broken torch install
        log.warning("profiling unavailable: %r", exc)
        return None
    for _ in range(max(0, warmup)):
        fn()
    torch.cuda.synchronize()
    try:
        prof_cm = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        prof_cm.__enter__()
    except Exception as exc:
        log.warning("torch.profiler failed to start: %r", exc)
        return None
    try:
        for _ in range(max(1, calls)):
            fn()
            torch.cuda.synchronize()
    finally:
        try:
            prof_cm.__exit__(None, None, None)
        except Exception as exc:
            log.warning("torch.profiler failed to stop: %r", exc)
            prof_cm = None
    if prof_cm is None:
        return None
    try:
        events = _device_events(prof_cm)
    except Exception as exc:
        log.warning("reading profiler events failed: %r", exc)
        return None
    summary = summarize_kernels(events, set(candidate_names or ()))
    summary["calls"] = max(1, calls)
    return summary


def format_kernel_table(summary: dict | None, k: int = 5) -> str:
    """A compact text table of the top-k kernels plus the share line, for the policy's feedback."""
    if not summary:
        return "no device profile (CPU run)"
    def pct(x):
        return "n/a" if x is None else f"{100.0 * x:.1f}%"
    lines = [f"device time {summary.get('total_device_ms', 0.0):.3f} ms over "
             f"{summary.get('calls', '?')} calls; your Triton kernels {pct(summary.get('triton_time_share'))}, "
             f"library {pct(summary.get('library_share'))}, other {pct(summary.get('other_share'))}"]
    kernels = (summary.get("kernels") or [])[:k]
    if kernels:
        width = min(NAME_WIDTH, max(len(r["name"]) for r in kernels))
        lines.append(f"{'kernel':<{width}}  {'kind':<9}  {'calls':>5}  {'ms':>9}  {'share':>6}")
        for r in kernels:
            lines.append(f"{r['name'][:width]:<{width}}  {r['kind']:<9}  {r['calls']:>5}  "
                         f"{r['total_ms']:>9.4f}  {pct(r['share']):>6}")
    return "\n".join(lines)
