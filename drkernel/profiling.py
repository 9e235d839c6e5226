"""Device-time share of the candidate's own Triton kernels that do work its output needs (the
paper's profiling-based reward, PR).

The runner runs one forward under `torch.profiler` (`profile_cuda`), commits its output like any
call's (the judge verifies it) and sends the raw kernel trace, one (name, 1, µs) row per device
kernel it ran (memcpy/memset included). The judge classifies the rows (`summarize_kernels`) into

- `candidate`: kernels launched from the candidate's own `@triton.jit` functions, as the judge
  found them in the candidate's source text (`drkernel.triton_source`), never as the runner names them,
- `library`:   cuBLAS/cuDNN/CUTLASS/ATen kernels, memcpy/memset,
- `other`:     everything else (e.g. somebody else's Triton kernels, Inductor output),

and counts, of each candidate kernel's time, only as many launches as the data flow found writing
what the output needs (`drkernel.dataflow`), its shortest: a heavy launch whose result nothing
uses adds device time, not share, even beside light needed launches of the same kernel.

Name matching (deliberately strict; KernelGYM matched by substring, which lets torch's own kernels
count as the candidate's when the names overlap, e.g. a candidate kernel called `gemm`):
a device kernel name counts as the candidate's iff it is EXACTLY one of `candidate_names` (what
Triton >= 3.0 emits: the kernel symbol is the Python function name), or that name followed by a
Triton 2.x specialization suffix `_<digits><d|c|e>...` (e.g. `relu_kernel_0d1d2de`, the suffix made
of argument indices and specialisation letters, at least one letter). Nothing else: no prefix,
substring or case-insensitive match. Names are compared after stripping surrounding whitespace.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Iterable

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


def candidate_name(name: str, candidate_names: Iterable[str]) -> str | None:
    """The candidate's kernel a device kernel name is: an exact match, or one plus a Triton 2.x
    specialisation suffix (see module doc); None for any other kernel."""
    name = name.strip()
    names = set(candidate_names)
    if name in names:
        return name
    m = _TRITON_SUFFIX.search(name)
    return name[: m.start()] if m and m.start() > 0 and name[: m.start()] in names else None


def is_candidate_name(name: str, candidate_names: Iterable[str]) -> bool:
    return candidate_name(name, candidate_names) is not None


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


def summarize_kernels(rows: list[tuple[str, int, float]], candidate_names: set[str],
                      needed: dict[str, float] | None = None, top_k: int = 10) -> dict:
    """Split device time (µs) into candidate / library / other shares.

    `rows` are (kernel name, launches, total µs); `needed[name]` is the fraction of that candidate
    kernel's launches whose writes reach the output (1 when `needed` is None), counted as its
    shortest launches (`_needed_us`). Returns
    `triton_time_share` (needed candidate time over all device time), `library_share`,
    `other_share` (None when the total is 0), `total_device_ms`, `num_launches` and `kernels`: the
    `top_k` kernels by total time, each `{name, kind, calls, total_ms, share}`.
    """
    names = {str(n).strip() for n in (candidate_names or ()) if n}
    per_kind = {"candidate": 0.0, "library": 0.0, "other": 0.0}
    per_name: dict[str, dict] = {}
    own: dict[str, list[tuple[int, float]]] = {}  # candidate kernel -> (launches, µs each) per row
    total = 0.0
    launches = 0
    for name, calls, us in rows:
        us = us if us > 0.0 else 0.0  # negative / NaN durations carry no time
        kind = classify_kernel(name, names)
        per_kind[kind] += us
        total += us
        launches += calls
        if kind == "candidate" and calls > 0:
            own.setdefault(name.strip(), []).append((calls, us / calls))
        row = per_name.setdefault(name, {"name": _truncate(name), "kind": kind, "calls": 0, "us": 0.0})
        row["calls"] += calls
        row["us"] += us
    useful = sum(_needed_us(parts, 1.0 if needed is None else needed.get(k, 0.0)) for k, parts in own.items())

    top = sorted(per_name.values(), key=lambda r: (-r["us"], r["name"]))[: max(0, top_k)]
    kernels = [{"name": r["name"], "kind": r["kind"], "calls": r["calls"],
                "total_ms": r["us"] / 1000.0, "share": _share(r["us"], total)} for r in top]
    return {"triton_time_share": _share(useful, total), "library_share": _share(per_kind["library"], total),
            "other_share": _share(per_kind["other"], total), "total_device_ms": total / 1000.0,
            "num_launches": launches, "kernels": kernels}


def _needed_us(parts: list[tuple[int, float]], fraction: float) -> float:
    """The device time of `fraction` of a kernel's launches, its shortest ones (`parts`: launches and
    µs each). Which launches the output needed is known by their order in the checked calls, not
    in the profiled ones: counting the shortest, a heavy launch beside needed light ones adds nothing."""
    left = fraction * sum(calls for calls, _ in parts)
    total = 0.0
    for calls, each in sorted(parts, key=lambda p: p[1]):
        if left <= 0:
            break
        take = min(calls, left)
        total, left = total + take * each, left - take
    return total


def candidate_launches(rows: list[tuple[str, int, float]], candidate_names: Iterable[str]) -> dict[str, int]:
    """Launches per kernel of the candidate's (by its source name), summed over the rows."""
    names = set(candidate_names)
    out: dict[str, int] = {}
    for name, calls, _ in rows:
        if own := candidate_name(name, names):
            out[own] = out.get(own, 0) + calls
    return out


def _share(x: float, total: float) -> float | None:
    return x / total if total > 0 else None


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


def _rows(events: list[tuple[str, float]]) -> list[tuple[str, int, float]]:
    """(name, 1, µs) per device kernel, in the order they ran: the judge weighs each launch."""
    return [(name, 1, us if us > 0.0 else 0.0) for name, us in events]


def profile_cuda(fn: Callable[[], Any]) -> tuple[Any, list[tuple[str, int, float]] | None]:
    """One call of `fn` under torch.profiler: its result, and the device kernels it ran as (name,
    1, µs) rows (None without CUDA). A failure of `fn` or of the profiler propagates."""
    import torch
    # Kineto keeps CUPTI subscribed after a trace unless told to tear it down, and every later
    # launch of the process then pays for it: a launch-bound reference profiled before it is timed
    # (the twin's profiler probe) ran 1.37x slower after its one profiled call (bench/profiler_after.py)
    os.environ["TEARDOWN_CUPTI"] = "1"
    if not torch.cuda.is_available():
        return fn(), None
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, _rows(_device_events(prof))
