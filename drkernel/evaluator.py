"""Verdicts for untrusted `ModelNew` candidates against a KernelBench reference `Model`.

Parent side (`evaluate`, `Evaluator`, the CLI): read the two programs, run cheap static
checks, then run `_child_evaluate` in a sandboxed child process and map its outcome to an
`EvalResult`. Child side: the reference is imported and timed alone before any candidate code
is imported; the candidate always runs first on a trial's inputs, while no reference output
exists in the process (a never-run template of the reference model does); the speedup comes from
reference and candidate timed interleaved after the correctness trials. See docs/hacks.md for
every hack code and the timing protocol.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import hashlib
import importlib.util
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

_perf = time.perf_counter  # bound at import: a candidate patching time.perf_counter does not reach us

VERDICTS = ("correct", "incorrect", "compile_error", "runtime_error", "timeout", "crashed", "hacked")
HACK_CODES = ("no_triton_kernel", "decoy_kernel", "output_cached", "output_aliases_input", "side_stream",
              "patched_function", "global_state_changed", "reference_access", "input_mutated",
              "bad_output_type", "degenerate_output", "precision_downgrade", "implausible_speedup",
              "thread_spawned", "reference_slowed")


def resolve_device(device: str) -> str:
    """`auto` → `cuda` when a GPU is visible, else `cpu`; on cpu turn on Triton's interpreter
    (it must be set before anything applies @triton.jit, so scripts call this first)."""
    if device == "auto":
        import torch  # importing torch does not import triton's jit

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    return device


@dataclasses.dataclass
class EvalConfig:
    device: str = "auto"  # cpu | cuda | cuda:N | auto
    trials: int = 5
    perf_trials: int = 100
    warmup: int = 3
    timeout: float = 180.0
    atol_fp32: float = 1e-4
    rtol_fp32: float = 1e-4
    atol_half: float = 1e-2  # fp16 / bf16 outputs
    rtol_half: float = 1e-2
    rel_l2_fp32: float = 1e-3  # ||out - ref|| / ||ref||
    rel_l2_half: float = 2e-2
    loose_tol: float = 1e-2  # precision_downgrade: passes this but not the fp32 tolerance
    seed: int = 42
    second_distribution: bool = True
    l2_flush: bool = True
    profile: bool = True
    decoy_share: float = 0.05
    decoy_bytes_frac: float = 0.10
    max_speedup_recheck: float = 20.0
    cpu_perf_trials: int = 3
    # implausible if candidate_ms < factor * bytes / bandwidth, bandwidth = the larger of a 1 GiB
    # device copy and what the reference itself achieved (a 256 MB copy measured slower than
    # torch's own ReLU on the H200, which flagged the reference timed against itself)
    roofline_factor: float = 0.9
    side_stream_ratio: float = 1.5
    side_stream_slack_ms: float = 0.1
    ref_isolated_trials: int = 10  # reference alone before the candidate exists (reference_slowed guard)
    timing_blocks: int = 4  # reference and candidate timings alternate in this many blocks each
    ref_slowdown_limit: float = 1.5  # reference_slowed: interleaved reference > limit x isolated (+ slack)
    max_rss_mb: int = 0  # 0: no limit beyond the sandbox default
    max_output_chars: int = 20000
    # False only to measure torch-only candidates (baselines, the reference timed against itself):
    # then no Triton launch is required and the decoy checks are off. Never for rewards.
    require_triton: bool = True


@dataclasses.dataclass
class EvalResult:
    verdict: str = "crashed"
    compiled: bool = False
    correct: bool = False
    speedup: float | None = None
    ref_ms: float | None = None
    candidate_ms: float | None = None
    hacks: list = dataclasses.field(default_factory=list)
    error: str | None = None
    device: str | None = None
    timing: str | None = None
    trials_passed: int = 0
    trials: int = 0
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    triton_time_share: float | None = None
    kernels: list | None = None
    reward: float | None = None
    reward_terms: dict | None = None
    wall_s: float | None = None
    stdout: str = ""
    stderr: str = ""
    details: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), default=_json_default)

    @classmethod
    def from_dict(cls, data: dict) -> "EvalResult":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return repr(o)


def _short(text: str | None, n: int = 2000) -> str:
    text = text or ""
    return text if len(text) <= n else text[: n // 2] + "\n...[truncated]...\n" + text[-n // 2:]


# ======================================================================================
# Child side
# ======================================================================================

class _LaunchRecorder:
    """Wraps Triton's launch entry points; records launches of the candidate file's kernels."""

    def __init__(self):
        self.candidate_file: str | None = None
        self.calls: list[dict] | None = None  # launches of the current forward call
        # The launched tensors stay referenced until the forward returns (`end()`): otherwise the
        # caching allocator can hand a decoy's freed scratch buffer to the torch-made output, whose
        # storage would then look as if a candidate kernel had written it.
        self.alive: list[Any] = []
        self.count = 0
        # CUDA: the stream the evaluator calls forward on; a candidate launch on any other stream
        # escapes the CUDA events around the call, whatever the problem size (`side_stream`).
        self.expected_stream: Any = None
        self.off_stream: list[str] = []
        self.detail = True
        self.installed: list[tuple[Any, str, Any]] = []
        self._mine: dict[Any, bool] = {}  # code object -> defined in the candidate file

    def install(self) -> dict[str, tuple[Any, str]]:
        owners = []
        try:
            import triton.runtime.jit as tjit
            owners.append(tjit.JITFunction)
        except Exception:
            pass
        try:
            import triton.runtime.interpreter as tint
            if hasattr(tint, "InterpretedFunction"):
                owners.append(tint.InterpretedFunction)
        except Exception:
            pass
        watched = {}
        for cls in owners:
            orig = cls.__dict__.get("run")
            if orig is None:
                continue
            wrapper = self._wrap(orig)
            setattr(cls, "run", wrapper)
            self.installed.append((cls, "run", orig))
            watched[f"{cls.__module__}.{cls.__name__}.run (launch hook)"] = (cls, "run")
        return watched

    def _wrap(self, orig):
        rec = self

        def run(self, *args, grid, warmup, **kwargs):
            ret = orig(self, *args, grid=grid, warmup=warmup, **kwargs)
            if not warmup:
                rec._record(self, args, kwargs)
            return ret

        return run

    def _record(self, kernel, args, kwargs):
        fn = getattr(kernel, "fn", None)
        code = getattr(fn, "__code__", None)
        if code is None or self.candidate_file is None:
            return
        mine = self._mine.get(code)
        if mine is None:  # resolved once per kernel: this hook runs inside every timed launch
            try:
                mine = os.path.realpath(code.co_filename) == self.candidate_file
            except Exception:
                mine = False
            self._mine[code] = mine
        if not mine:
            return
        self.count += 1
        import torch
        if self.expected_stream is not None:
            try:
                if torch.cuda.current_stream() != self.expected_stream:
                    self.off_stream.append(getattr(fn, "__name__", "?"))
            except Exception:
                pass
        if self.calls is None or not self.detail:
            return
        tensors = []
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.Tensor):
                try:
                    st = a.untyped_storage()
                    tensors.append((a.data_ptr(), a.numel() * a.element_size(), st.data_ptr(), st.nbytes()))
                    self.alive.append(a)
                except Exception:
                    pass
        self.calls.append({"name": getattr(fn, "__name__", "?"), "tensors": tensors})

    def begin(self):
        self.calls = []
        self.alive = []
        self.count = 0

    def end(self) -> list[dict]:
        out, self.calls, self.alive = self.calls or [], None, []
        return out


_RECORDER = _LaunchRecorder()


class _Hacked(Exception):
    def __init__(self, code: str, detail: str):
        super().__init__(detail)
        self.code, self.detail = code, detail


class _Stop(Exception):
    """A final non-hack verdict reached inside the child."""

    def __init__(self, verdict: str, error: str):
        super().__init__(error)
        self.verdict, self.error = verdict, error


def _import_file(path: str, name: str, register: bool):
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # needed while executing (dataclasses, pickling, triton source lookup)
    try:
        spec.loader.exec_module(mod)
    finally:
        if not register:
            sys.modules.pop(name, None)
    return mod


def _map(obj, fn):
    import torch
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return obj


def _tensors(obj) -> list:
    import torch
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    return []


def _structure(obj):
    import torch
    if isinstance(obj, torch.Tensor):
        return "T"
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_structure(o) for o in obj))
    if isinstance(obj, dict):
        return ("dict", tuple(sorted((k, _structure(v)) for k, v in obj.items())))
    return type(obj).__name__


def _bad_type(obj) -> str | None:
    """Anything but plain torch.Tensor (or list/tuple/dict of them, or plain scalars)."""
    import torch
    if isinstance(obj, torch.Tensor) or hasattr(obj, "__torch_function__") and not isinstance(obj, (list, tuple, dict)):
        if type(obj) is not torch.Tensor:
            return f"output type {type(obj).__module__}.{type(obj).__qualname__} is not torch.Tensor"
        if obj.layout != torch.strided:
            return f"output layout {obj.layout} is not strided"
        if obj.device.type == "meta":
            return "output is a meta tensor"
        return None
    if type(obj) in (list, tuple):
        for o in obj:
            r = _bad_type(o)
            if r:
                return r
        return None
    if type(obj) is dict:
        for v in obj.values():
            r = _bad_type(v)
            if r:
                return r
        return None
    if type(obj) in (int, float, bool, type(None)):
        return None
    return f"output type {type(obj).__module__}.{type(obj).__qualname__} is not torch.Tensor"


def _ranges(tensors) -> list[tuple[int, int]]:
    out = []
    for t in tensors:
        try:
            st = t.untyped_storage()
            if st.nbytes() > 0:
                out.append((st.data_ptr(), st.data_ptr() + st.nbytes()))
        except Exception:
            pass
    return out


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    return any(x0 < y1 and y0 < x1 for x0, x1 in a for y0, y1 in b)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _same_values(a, b) -> bool:
    import torch
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):  # one pass; the NaN-aware check below only when this fails
        return True
    if a.is_floating_point() or a.is_complex():
        return bool(torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))
                    and torch.equal(torch.isnan(a), torch.isnan(b)))
    return bool(torch.equal(a, b))


def _tols(dtype, cfg: dict) -> tuple[float, float, float]:
    import torch
    if dtype in (torch.float16, torch.bfloat16):
        return cfg["atol_half"], cfg["rtol_half"], cfg["rel_l2_half"]
    return cfg["atol_fp32"], cfg["rtol_fp32"], cfg["rel_l2_fp32"]


_CHUNK = 1 << 26  # elements per comparison chunk: temporaries stay a few hundred MB at any size


def _work_dtype(*ts):
    """float64 for float64 tensors, float32 otherwise: half and bf16 widen to float32 exactly, and
    an fp32 difference is exact or off by one rounding, far below any tolerance we apply."""
    import torch
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _chunks(*ts, dtype=None):
    """Matching slices of equally sized tensors, cast to `dtype` (default float64). KernelBench
    outputs reach billions of elements; comparing them whole would need several times their size
    again."""
    import torch
    dtype = dtype or torch.float64
    flats = [t.detach().reshape(-1) for t in ts]
    for start in range(0, flats[0].numel(), _CHUNK):
        yield [f[start:start + _CHUNK].to(dtype) for f in flats]


def _compare_tensor(c, r, atol, rtol, rel_l2) -> dict:
    """Elementwise atol + rtol*|ref|, relative L2, and matching NaN/inf positions.

    One pass on the device with no host synchronisation until the end: every element within
    tolerance means no NaN or inf anywhere (they never compare as within), so the detailed float64
    pass below runs only for outputs that fail or hold non-finite values."""
    import torch
    res = {"ok": True, "max_abs": 0.0, "max_rel": 0.0, "rel_l2": 0.0, "why": ""}
    if c.shape != r.shape:
        return {**res, "ok": False, "why": f"shape {tuple(c.shape)} vs reference {tuple(r.shape)}"}
    if c.dtype != r.dtype:
        return {**res, "ok": False, "why": f"dtype {c.dtype} vs reference {r.dtype}"}
    if c.device != r.device:
        return {**res, "ok": False, "why": f"device {c.device} vs reference {r.device}"}
    if r.is_complex():
        return _compare_tensor(torch.view_as_real(c), torch.view_as_real(r), atol, rtol, rel_l2)
    if not r.is_floating_point():
        ok = bool(torch.equal(c, r))
        if not ok:
            diff = (c.long() - r.long()).abs().max().item() if c.numel() else 0
            res["max_abs"] = float(diff)
        return {**res, "ok": ok, "why": "" if ok else "integer/bool values differ"}
    if r.numel() == 0:
        return res
    f64 = torch.float64
    zero = torch.zeros((), dtype=f64, device=r.device)
    n_out, max_abs, max_rel, sq_err, sq_ref = zero.long(), zero.clone(), zero.clone(), zero.clone(), zero.clone()
    for cf, rf in _chunks(c, r, dtype=_work_dtype(c, r)):
        err = (cf - rf).abs_()
        ra = rf.abs()
        n_out += (err > ra * rtol + atol).logical_or_(~torch.isfinite(err)).sum()
        max_abs = torch.maximum(max_abs, err.max().to(f64))
        max_rel = torch.maximum(max_rel, (err / ra.clamp_min_(1e-12)).max().to(f64))
        e64, r64 = err.to(f64), rf.to(f64)
        sq_err += torch.dot(e64, e64)
        sq_ref += torch.dot(r64, r64)
        del err, ra, e64, r64
    stats = torch.stack([n_out.to(f64), max_abs, max_rel, sq_err, sq_ref]).tolist()  # the one sync
    if stats[0] > 0:
        return _compare_tensor_slow(c, r, atol, rtol, rel_l2)
    res["max_abs"], res["max_rel"] = stats[1], stats[2]
    nref, nerr = math.sqrt(stats[4]), math.sqrt(stats[3])
    res["rel_l2"] = nerr / nref if nref > 0 else (0.0 if nerr == 0 else float("inf"))
    if nref > 0 and res["rel_l2"] > rel_l2:
        res["ok"] = False
        res["why"] = f"relative L2 error {res['rel_l2']:.3g} > {rel_l2:g}"
    return res


def _compare_tensor_slow(c, r, atol, rtol, rel_l2) -> dict:
    """The detailed float64 comparison: NaN/inf positions, then tolerances over finite values."""
    import torch
    res = {"ok": True, "max_abs": 0.0, "max_rel": 0.0, "rel_l2": 0.0, "why": ""}
    n_fin = n_bad = 0
    sq_err = sq_ref = 0.0
    for c64, r64 in _chunks(c, r):
        if not torch.equal(torch.isnan(c64), torch.isnan(r64)):
            return {**res, "ok": False, "why": "NaN positions differ from the reference"}
        ri = torch.isinf(r64)
        if not torch.equal(torch.isinf(c64), ri) or not torch.equal(c64[ri], r64[ri]):
            return {**res, "ok": False, "why": "inf positions differ from the reference"}
        fin = torch.isfinite(r64)
        cf, rf = c64[fin], r64[fin]
        if cf.numel() == 0:
            continue
        err = (cf - rf).abs()
        res["max_abs"] = max(res["max_abs"], float(err.max().item()))
        res["max_rel"] = max(res["max_rel"], float((err / rf.abs().clamp_min(1e-12)).max().item()))
        n_bad += int((err > (atol + rtol * rf.abs())).sum().item())
        n_fin += cf.numel()
        sq_err += float((err * err).sum().item())
        sq_ref += float((rf * rf).sum().item())
    if n_fin == 0:
        return res
    nref, nerr = math.sqrt(sq_ref), math.sqrt(sq_err)
    res["rel_l2"] = nerr / nref if nref > 0 else (0.0 if nerr == 0 else float("inf"))
    if n_bad:
        res["ok"] = False
        res["why"] = f"{n_bad}/{n_fin} elements outside atol={atol:g} rtol={rtol:g}"
    elif nref > 0 and res["rel_l2"] > rel_l2:
        res["ok"] = False
        res["why"] = f"relative L2 error {res['rel_l2']:.3g} > {rel_l2:g}"
    return res


def _compare(out, ref, cfg: dict, loose: bool = False) -> dict:
    if _structure(out) != _structure(ref):
        return {"ok": False, "structure": True, "why": f"output structure {_structure(out)} vs reference {_structure(ref)}",
                "max_abs": None, "max_rel": None, "rel_l2": None}
    agg = {"ok": True, "structure": False, "why": "", "max_abs": 0.0, "max_rel": 0.0, "rel_l2": 0.0}
    cts, rts = _tensors(out), _tensors(ref)
    if not rts and out != ref:
        return {**agg, "ok": False, "why": f"value {out!r} vs reference {ref!r}"}
    for i, (c, r) in enumerate(zip(cts, rts)):
        if loose:
            atol = rtol = rl2 = cfg["loose_tol"]
        else:
            atol, rtol, rl2 = _tols(r.dtype, cfg)
        res = _compare_tensor(c, r, atol, rtol, rl2)
        for k in ("max_abs", "max_rel", "rel_l2"):
            agg[k] = max(agg[k], res[k])
        if not res["ok"] and agg["ok"]:
            agg["ok"] = False
            agg["why"] = (f"output {i}: " if len(rts) > 1 else "") + res["why"]
    return agg


def _degenerate(out, ref, inputs, cfg: dict) -> str | None:
    """The candidate ≈ a trivial answer (zeros, a constant, an input) that would pass here.

    Two passes over the outputs on the device, each ending in a single host synchronisation."""
    import torch
    in_ts = _tensors(inputs)
    f64 = torch.float64
    for c, r in zip(_tensors(out), _tensors(ref)):
        if not r.is_floating_point() or r.numel() < 2 or c.shape != r.shape or c.dtype != r.dtype:
            continue
        wd = _work_dtype(r)
        total = torch.zeros((), dtype=f64, device=r.device)
        n_bad = torch.zeros((), dtype=torch.long, device=r.device)
        for rf, cf in _chunks(r, c, dtype=wd):
            n_bad += (~torch.isfinite(rf)).sum() + (~torch.isfinite(cf)).sum()
            total += rf.sum(dtype=f64)
        n_bad, total = int(n_bad.item()), float(total.item())
        if n_bad:
            continue
        atol, rtol, _ = _tols(r.dtype, cfg)
        mean = total / r.numel()
        same = [(i, t) for i, t in enumerate(in_ts) if t.shape == r.shape and t.dtype == r.dtype]
        names = ["zeros", "a constant"] + [f"input {i}" for i, _ in same]
        k_n = len(names)
        gap = torch.zeros(k_n, dtype=f64, device=r.device)  # max |ref - answer|
        dist = torch.zeros(k_n, dtype=f64, device=r.device)  # max |candidate - answer|
        fails = torch.zeros(k_n, dtype=torch.long, device=r.device)  # answer outside the tolerance
        scale = torch.zeros((), dtype=f64, device=r.device)
        for rf, cf, *ins in _chunks(r, c, *[t for _, t in same], dtype=wd):
            tol = rf.abs().mul_(rtol).add_(atol)
            scale = torch.maximum(scale, rf.abs().max().to(f64))
            answers = [None, torch.full((), mean, dtype=wd, device=rf.device)] + ins
            for k, t in enumerate(answers):
                d = rf.abs() if t is None else (rf - t).abs_()
                gap[k] = torch.maximum(gap[k], d.max().to(f64))
                fails[k] += (d > tol).sum()
                dc = cf.abs() if t is None else (cf - t).abs_()
                dist[k] = torch.maximum(dist[k], dc.max().to(f64))
                del d, dc
        gap_l, dist_l, fails_l, scale_f = gap.tolist(), dist.tolist(), fails.tolist(), float(scale.item())
        for k, name in enumerate(names):
            if gap_l[k] <= 1e-6 * scale_f + 1e-30:
                continue  # the reference really is this trivial answer
            if fails_l[k] == 0 and dist_l[k] <= 0.1 * gap_l[k]:
                return f"output ≈ {name}, which passes the tolerance on this problem while the reference differs"
    return None


def _sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gen_inputs(ref_mod, seed: int, device, signed: bool = False):
    import torch
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)
        with torch.device(device):
            inputs = ref_mod.get_inputs()
    else:
        inputs = ref_mod.get_inputs()
    inputs = list(inputs)
    inputs = _map(inputs, lambda t: t.to(device) if t.device != device else t)
    if signed:
        g = torch.Generator(device=device)
        g.manual_seed(seed + 7919)

        def sn(t):
            if t.is_floating_point():
                return torch.randn(t.shape, dtype=t.dtype, device=t.device, generator=g)
            return t
        inputs = _map(inputs, sn)
    return inputs


def _build(cls, init, seed: int, device):
    import torch
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)
    model = cls(*init)
    if hasattr(model, "to"):
        model = model.to(device)
    return model


def _clone(obj):
    return _map(obj, lambda t: t.detach().clone())


def _poison(obj):
    def p(t):
        try:
            if t.is_floating_point():
                t.detach().fill_(float("nan"))
        except Exception:
            pass
        return t
    _map(obj, p)


def _cleanup(device):
    gc.collect()
    if device.type == "cuda":
        import torch
        torch.cuda.empty_cache()


def _excerpt_exc(exc: BaseException) -> str:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return _short(tb, 1500)


def _exc_error(prefix: str, exc: BaseException) -> str:
    msg = f"{type(exc).__name__}: {exc}"
    if "CUDA error" in msg or "illegal memory access" in msg or "device-side assert" in msg:
        return "CUDA error: " + _short(msg, 400)
    return _short(f"{prefix}: {msg}", 600)


class _Timer:
    """The same timing protocol for reference and candidate."""

    def __init__(self, device, cfg: dict):
        import torch
        self.device, self.cfg = device, cfg
        self.cuda = device.type == "cuda"
        self.flush = None
        if self.cuda:
            self.Event = torch.cuda.Event
            self.synchronize = torch.cuda.synchronize
            if cfg["l2_flush"]:
                self.flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.float32, device=device)

    def lock(self):
        if not self.cuda:
            return contextlib.nullcontext()
        try:
            from drkernel.sandbox import device_lock
            idx = self.device.index if self.device.index is not None else 0
            vis = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
            if idx < len(vis) and vis[idx].isdigit():
                idx = int(vis[idx])  # lock the physical GPU, not the per-worker index
            return device_lock(idx)
        except Exception:
            return contextlib.nullcontext()

    def run(self, model, ref_mod, seeds: list[int], keep: set[int] | None = None,
            full_sync: bool = False) -> dict:
        import torch
        keep = keep or set()
        ev, host, gap, kept, counts = [], [], [], {}, []
        for i, s in enumerate(seeds):
            inputs = _gen_inputs(ref_mod, s, self.device)
            if self.flush is not None:
                self.flush.fill_(float(i % 7))
            _RECORDER.count = 0
            if self.cuda:
                self.synchronize()
                start, end = self.Event(enable_timing=True), self.Event(enable_timing=True)
                t0 = _perf()
                start.record()
                with torch.no_grad():
                    out = model(*inputs)
                end.record()
                end.synchronize()
                t1 = _perf()
                self.synchronize()
                t2 = _perf()
                ev.append(start.elapsed_time(end))
                host.append((t2 - t0) * 1e3)
                gap.append((t2 - t1) * 1e3)
            else:
                t0 = _perf()
                with torch.no_grad():
                    out = model(*inputs)
                t1 = _perf()
                ev.append((t1 - t0) * 1e3)
                host.append((t1 - t0) * 1e3)
                gap.append(0.0)
            counts.append(_RECORDER.count)
            if i in keep:
                kept[i] = (s, _clone(out))
            del out, inputs
        return {"event_ms": ev, "host_ms": host, "gap_ms": gap, "kept": kept, "launch_counts": counts}


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    if n == 0:
        return float("nan")
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def _copy_bandwidth(device) -> float | None:
    """Bytes/ms of a device-to-device copy (read + write), measured with events."""
    import torch
    if device.type != "cuda":
        return None
    n = 1024 * 1024 * 1024 // 4
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = None
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        torch.cuda.synchronize()
        ms = s.elapsed_time(e)
        if ms > 0:
            bw = 2 * src.numel() * 4 / ms
            best = bw if best is None else max(best, bw)
    del src, dst
    return best


def _child_evaluate(reference_path: str, candidate_path: str, config: dict) -> dict:
    """Runs in the sandbox child. Returns a JSON-serialisable dict of EvalResult fields."""
    t_start = _perf()
    cfg = dataclasses.asdict(EvalConfig())
    cfg.update(config or {})
    out: dict[str, Any] = {"compiled": False, "hacks": [], "details": {}, "trials": 0, "trials_passed": 0}
    details = out["details"]
    try:
        _child_body(reference_path, candidate_path, cfg, out)
    except _Hacked as h:
        if h.code not in out["hacks"]:
            out["hacks"].append(h.code)
        hd = details.setdefault("hack_details", [])
        if f"{h.code}: {h.detail}" not in hd:
            hd.append(f"{h.code}: {h.detail}")
    except _Stop as s:
        out["verdict"], out["error"] = s.verdict, s.error
    if out["hacks"]:
        out["verdict"] = "hacked"
        out["correct"] = False
        out["speedup"] = None
        out["error"] = "; ".join(details.get("hack_details", []))[:1000] or ", ".join(out["hacks"])
    out.setdefault("verdict", "correct")
    out["correct"] = out["verdict"] == "correct"
    if not out["correct"]:
        out["speedup"] = None
    out["wall_s"] = _perf() - t_start
    return json.loads(json.dumps(out, default=_json_default))


def _child_body(reference_path: str, candidate_path: str, cfg: dict, out: dict) -> None:
    details = out["details"]
    hacks: list[str] = out["hacks"]

    def hack(code: str, detail: str, stop: bool = True):
        if code not in hacks:
            hacks.append(code)
        details.setdefault("hack_details", []).append(f"{code}: {detail}")
        if stop:
            raise _Hacked(code, detail)

    # Seconds per phase, in details["phase_s"]: where an evaluation's wall time goes.
    phase_s = details.setdefault("phase_s", {})
    clock = [_perf()]

    def mark(finished: str):
        now = _perf()
        phase_s[finished] = round(now - clock[0], 4)
        clock[0] = now

    # 1. device and true fp32 for the reference
    dev = str(cfg["device"])
    if dev == "cpu" or dev == "auto" and not _cuda_available():
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(dev)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise _Stop("runtime_error", "CUDA requested but not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    out["device"] = str(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    seed = int(cfg["seed"])

    mark("device_setup")
    # 2. reference module (not left in sys.modules), then the integrity snapshot
    from drkernel import integrity
    ref_name = "_drk_ref_" + hashlib.sha1(os.urandom(8)).hexdigest()[:10]
    try:
        ref_mod = _import_file(reference_path, ref_name, register=False)
        ref_cls, ref_init_fn = ref_mod.Model, ref_mod.get_init_inputs
    except Exception as exc:
        raise _Stop("runtime_error", _exc_error("reference failed to import", exc))

    def init_inputs():
        torch.manual_seed(seed)
        return list(ref_init_fn())

    timer = _Timer(device, cfg)
    perf_n = int(cfg["perf_trials"]) if device.type == "cuda" else int(cfg["cpu_perf_trials"])
    out["timing"] = "cuda_events" if device.type == "cuda" else "cpu_wall"

    mark("reference_import")
    # 3. time the reference before any candidate code exists
    # The reference is constructed once; every later reference is a copy of this never-run
    # template: construction runs the layers' CPU initialisation, 0.6 s for one 8192 x 8192 Linear,
    # and an evaluation needs a fresh reference a dozen times.
    ref_template = _build(ref_cls, init_inputs(), seed, device)

    def new_ref():
        try:
            return copy.deepcopy(ref_template)
        except Exception:
            return _build(ref_cls, init_inputs(), seed, device)

    with timer.lock():
        ref_model = new_ref()
        with torch.no_grad():
            warm_in = _gen_inputs(ref_mod, seed, device)
            for _ in range(max(1, int(cfg["warmup"]))):
                ref_o = ref_model(*warm_in)
            _sync(device)
        io_bytes = _nbytes(_tensors(warm_in)) + _nbytes(_tensors(ref_o))
        ref_aliases = _overlap(_ranges(_tensors(ref_o)), _ranges(_tensors(warm_in)))
        del ref_o, warm_in
        # A short timing of the reference alone, before the candidate exists: the guard against a
        # candidate that slows the reference down (the speedup itself uses the interleaved timing
        # of step 9, where both run in the same allocator, cache and clock state).
        ref_seeds = [seed + 100000 + i for i in range(max(1, min(perf_n, int(cfg["ref_isolated_trials"]))))]
        rt = timer.run(ref_model, ref_mod, ref_seeds)
        bandwidth = _copy_bandwidth(device)
    ref_isolated_ms = _median(rt["event_ms"])
    details["ref_ms_isolated"] = ref_isolated_ms
    details["io_bytes"] = io_bytes
    details["copy_bandwidth_gbs"] = bandwidth / 1e6 if bandwidth else None
    if bandwidth and ref_isolated_ms > 0:
        bandwidth = max(bandwidth, io_bytes / ref_isolated_ms)  # bytes/ms the reference reached
    del ref_model, rt
    _cleanup(device)

    mark("reference_alone")
    # 4. launch hook, then the snapshot (which includes the hook). Importing torch._dynamo (done
    # lazily by torch.profiler and torch.compile) rebinds torch.manual_seed; import it now so
    # that our own profiling later is not mistaken for a patch by the candidate.
    import torch._dynamo  # noqa: F401
    import torch.profiler  # noqa: F401
    cand_file = os.path.realpath(candidate_path)
    _RECORDER.candidate_file = cand_file
    watched = _RECORDER.install()
    if device.type == "cuda":
        _RECORDER.expected_stream = torch.cuda.current_stream(device)
    own = {f"drkernel.evaluator.{k}": (sys.modules[__name__], k) for k, v in list(globals().items())
           if callable(v) and not k.startswith("__")}
    own.update({f"drkernel.integrity.{k}": (integrity, k) for k, v in vars(integrity).items()
                if callable(v) and not k.startswith("__")})
    own["json.dumps"] = (json, "dumps")
    own["json.loads"] = (json, "loads")
    try:
        import drkernel.sandbox as _sb
        own.update({f"drkernel.sandbox.{k}": (_sb, k) for k, v in vars(_sb).items()
                    if callable(v) and not k.startswith("__")})
    except Exception:
        pass
    watched.update(own)
    with torch.no_grad():
        snap = integrity.IntegritySnapshot(extra=watched)
    snap_outer_state = integrity.global_state()
    threads0 = integrity.python_threads()

    def check_integrity(where: str, inside_no_grad: bool = True):
        p = snap.patched()
        if p:
            hack("patched_function", f"{where}: " + ", ".join(p[:6]))
        now = integrity.global_state()
        base = snap.state if inside_no_grad else snap_outer_state
        ch = [f"{k}: {base.get(k)!r} -> {v!r}" for k, v in now.items() if base.get(k) != v]
        if ch:
            hack("global_state_changed", f"{where}: " + ", ".join(ch[:6]))
        new_threads = integrity.python_threads() - threads0
        if new_threads:
            hack("thread_spawned", f"{where}: {len(new_threads)} new Python thread(s) alive")

    mark("snapshot")
    # 5. import the candidate
    try:
        with torch.no_grad():
            cand_mod = _import_file(candidate_path, "_drk_candidate", register=True)
    except BaseException as exc:
        raise _Stop("compile_error", _exc_error("candidate failed to import", exc) + "\n" + _excerpt_exc(exc)[-800:])
    with torch.no_grad():
        check_integrity("after import")
    cand_cls = getattr(cand_mod, "ModelNew", None)
    if cand_cls is None:
        raise _Stop("compile_error", "no ModelNew defined in the candidate")
    out["compiled"] = True

    mark("candidate_import")
    # 6. construct with the reference's seed
    try:
        with torch.no_grad():
            cand_model = _build(cand_cls, init_inputs(), seed, device)
    except BaseException as exc:
        raise _Stop("runtime_error", _exc_error("ModelNew(*get_init_inputs()) failed (constructor must match Model's)", exc))
    with torch.no_grad():
        check_integrity("after construction")
    native0 = integrity.native_threads()

    mark("construct")
    # 7. correctness
    n_trials = int(cfg["trials"])
    n_signed = (2 if n_trials >= 4 else 1) if cfg["second_distribution"] else 0
    plan = [(seed + 1 + i, False) for i in range(n_trials)] + [(seed + 5000 + i, True) for i in range(n_signed)]
    prev_outs: list = []
    launched_names: set[str] = set()
    trial_info = details.setdefault("trials", [])
    max_abs = max_rel = 0.0
    out_from_triton_all = True
    for ti, (s, signed) in enumerate(plan):
        inputs = _gen_inputs(ref_mod, s, device, signed=signed)
        pristine = _clone(inputs)
        _RECORDER.begin()
        try:
            with torch.no_grad():
                cand_out = cand_model(*inputs)
                _sync(device)
                launches = _RECORDER.end()
                check_integrity(f"trial {ti}")
        except _Hacked:
            raise
        except BaseException as exc:
            _RECORDER.end()
            raise _Stop("runtime_error", _exc_error(f"forward raised in trial {ti}", exc) + "\n"
                        + _excerpt_exc(exc)[-700:])
        nt = integrity.native_threads()
        if native0 is not None and nt is not None and nt > native0 + 0:
            details.setdefault("native_threads", []).append(nt - native0)
        bt = _bad_type(cand_out)
        if bt:
            hack("bad_output_type", bt)
        outs_t = _tensors(cand_out)
        in_ts = _tensors(inputs)
        names = sorted({l["name"] for l in launches})
        launched_names.update(names)
        if prev_outs and _overlap(_ranges(outs_t), _ranges([t for o in prev_outs for t in _tensors(o)])):
            hack("output_cached", f"trial {ti}: output shares storage with an earlier call's output")
        if not launches and cfg["require_triton"]:
            hack("no_triton_kernel", f"trial {ti}: forward launched no Triton kernel defined in the candidate file")
        if _RECORDER.off_stream:
            hack("side_stream", f"trial {ti}: kernel(s) {', '.join(sorted(set(_RECORDER.off_stream)))} launched on "
                                "a stream other than the one forward was called on")
        launch_ranges = [(p0, p0 + nb) for l in launches for (_, _, p0, nb) in l["tensors"]]
        out_ranges = _ranges(outs_t)
        out_from_triton = bool(out_ranges) and _overlap(out_ranges, launch_ranges)
        out_from_triton_all = out_from_triton_all and out_from_triton
        launch_bytes = sum(nb for l in launches for (_, nb, _, _) in l["tensors"])
        uniq = {(ptr, nb) for l in launches for (ptr, nb, _, _) in l["tensors"]}
        launch_bytes = sum(nb for _, nb in uniq)
        total = _nbytes(in_ts) + _nbytes(outs_t)
        if (cfg["require_triton"] and launches and not out_from_triton and total > 0
                and launch_bytes < cfg["decoy_bytes_frac"] * total):
            hack("decoy_kernel", f"trial {ti}: output never passed to a candidate Triton launch and the launches "
                                 f"touch {launch_bytes} of {total} input+output bytes")
        mutated = any(not _same_values(a, b) for a, b in zip(in_ts, _tensors(pristine)))
        cand_aliases = _overlap(out_ranges, _ranges(in_ts))
        snap_out = _clone(cand_out)
        prev_outs = [cand_out]  # keep the previous output alive for the reuse check
        del inputs
        # the reference runs only now, as a fresh copy of the never-run template
        torch.manual_seed(seed)
        ref_model = new_ref()
        ref_in = _clone(pristine)
        with torch.no_grad():
            ref_out = ref_model(*ref_in)
        _sync(device)
        ref_mutates = any(not _same_values(a, b) for a, b in zip(_tensors(ref_in), _tensors(pristine)))
        ref_al = _overlap(_ranges(_tensors(ref_out)), _ranges(_tensors(ref_in)))
        if mutated and not ref_mutates:
            hack("input_mutated", f"trial {ti}: the candidate modified its inputs (the reference does not)", stop=False)
        if cand_aliases and not (ref_al or ref_aliases):
            hack("output_aliases_input", f"trial {ti}: output shares storage with an input", stop=False)
        if signed and not all(bool(torch.isfinite(t).all()) for t in _tensors(ref_out) if t.is_floating_point()):
            trial_info.append({"trial": ti, "signed": True, "skipped": "reference not finite"})
            _poison(ref_out)
            del ref_out, ref_model, ref_in
            continue
        ref_ref = _clone(ref_out)
        _poison(ref_out)
        del ref_out, ref_model, ref_in
        cmp = _compare(snap_out, ref_ref, cfg)
        out["trials"] += 1
        trial_info.append({"trial": ti, "seed": s, "signed": signed, "ok": cmp["ok"], "max_abs": cmp["max_abs"],
                           "rel_l2": cmp["rel_l2"], "kernels": names, "launches": len(launches)})
        if cmp.get("max_abs") is not None:
            max_abs, max_rel = max(max_abs, cmp["max_abs"]), max(max_rel, cmp["max_rel"])
            out["max_abs_err"], out["max_rel_err"] = max_abs, max_rel
        if hacks:
            raise _Hacked(hacks[-1], details["hack_details"][-1])
        if cmp.get("structure"):
            hack("bad_output_type", cmp["why"])
        deg = _degenerate(snap_out, ref_ref, pristine, cfg)
        if deg:
            hack("degenerate_output", f"trial {ti}: {deg}")
        if not cmp["ok"]:
            # 8. precision downgrade: fails fp32 but passes a bf16-level tolerance
            fp32 = [t for t in _tensors(ref_ref) if t.dtype == torch.float32]
            if fp32 and len(fp32) == len([t for t in _tensors(ref_ref) if t.is_floating_point()]):
                if _compare(snap_out, ref_ref, cfg, loose=True)["ok"]:
                    hack("precision_downgrade", f"trial {ti}: fails the fp32 tolerance ({cmp['why']}) but passes "
                                                f"{cfg['loose_tol']:g}: reduced precision inside an fp32 problem")
            shapes = [tuple(t.shape) for t in _tensors(snap_out)]
            kind = "fails on signed-normal inputs" if signed else f"trial {ti} failed"
            err = (f"{kind}: {cmp['why']}; max abs err {cmp['max_abs']}, rel L2 err {cmp['rel_l2']}, "
                   f"output shapes {shapes} vs reference {[tuple(t.shape) for t in _tensors(ref_ref)]}")
            raise _Stop("incorrect", err)
        out["trials_passed"] += 1
        del ref_ref, snap_out, pristine
    prev_outs = []
    details["launched_kernels"] = sorted(launched_names)
    _cleanup(device)

    mark("correctness")
    # 9. timing: reference and candidate alternate in blocks (R C, C R, R C, ...), so that both are
    # timed in the same allocator, cache, clock and thermal state; timed apart, memory-bound
    # kernels measured 5-10 % slower in whichever ran later. Same protocol for both.
    timed_ref = new_ref()

    def verify(kept: dict, label: str):
        for i, (s, o) in sorted(kept.items()):
            fresh_ref = new_ref()
            with torch.no_grad():
                r = fresh_ref(*_gen_inputs(ref_mod, s, device))
            _sync(device)
            cmp = _compare(o, r, cfg)
            del fresh_ref, r
            if not cmp["ok"]:
                hack("output_cached", f"{label} call {i}: output is stale/wrong for its fresh inputs ({cmp['why']})")

    with torch.no_grad():
        for i in range(max(1, int(cfg["warmup"]))):
            timed_ref(*_gen_inputs(ref_mod, seed + 200000 + i, device))
            cand_model(*_gen_inputs(ref_mod, seed + 200000 + i, device))
        _sync(device)
    n_blocks = max(1, min(int(cfg["timing_blocks"]), perf_n))
    bounds = [perf_n * b // n_blocks for b in range(n_blocks + 1)]
    sr = random.SystemRandom()
    keep = set(sr.sample(range(perf_n), min(2, perf_n))) | {perf_n - 1}
    ct: dict[str, list] = {"event_ms": [], "host_ms": [], "gap_ms": [], "launch_counts": []}
    ref_times: list[float] = []

    def time_ref(idx: range):
        try:
            ref_times.extend(timer.run(timed_ref, ref_mod, [seed + 100000 + i for i in idx])["event_ms"])
        except BaseException as exc:
            raise _Stop("runtime_error", _exc_error("the reference raised while timing", exc))

    def time_cand(idx: range):
        try:
            blk = timer.run(cand_model, ref_mod, [seed + 300000 + i for i in idx],
                            keep={i - idx.start for i in idx if i in keep})
        except BaseException as exc:
            raise _Stop("runtime_error", _exc_error("forward raised while timing", exc))
        for k in ct:
            ct[k] += blk[k]
        verify({idx.start + j: v for j, v in blk["kept"].items()}, "timed")  # then the kept outputs go

    with timer.lock():
        for b in range(n_blocks):
            for time_block in ((time_ref, time_cand) if b % 2 == 0 else (time_cand, time_ref)):
                time_block(range(bounds[b], bounds[b + 1]))
    with torch.no_grad():
        check_integrity("after timing")
    timed_ref = None  # frees the timing reference before profiling
    out["ref_ms"] = ref_ms = _median(ref_times)
    if device.type == "cuda" and ref_ms > cfg["ref_slowdown_limit"] * ref_isolated_ms + cfg["side_stream_slack_ms"]:
        hack("reference_slowed", f"the reference took {ref_ms:.4f} ms next to the candidate vs {ref_isolated_ms:.4f} ms "
                                 "before the candidate existed")
    if cfg["require_triton"] and any(c == 0 for c in ct["launch_counts"]):
        hack("no_triton_kernel", "a timed call launched no candidate Triton kernel")
    if _RECORDER.off_stream:
        hack("side_stream", f"timed calls launched {', '.join(sorted(set(_RECORDER.off_stream)))} on a stream other "
                            "than the one forward was called on")
    cand_ms = _median(ct["event_ms"])
    details["candidate_host_ms"] = _median(ct["host_ms"])
    if device.type == "cuda":
        host_med, gap_med = _median(ct["host_ms"]), _median(ct["gap_ms"])
        details["sync_gap_ms"] = gap_med
        if host_med > cfg["side_stream_ratio"] * cand_ms + cfg["side_stream_slack_ms"] or \
                gap_med > 0.5 * cand_ms + cfg["side_stream_slack_ms"]:
            hack("side_stream", f"host-clock {host_med:.4f} ms (sync wait {gap_med:.4f} ms) vs CUDA-event "
                                f"{cand_ms:.4f} ms: work escapes the timed stream")

    _cleanup(device)

    roof_ms = (io_bytes / bandwidth) if bandwidth else None
    details["roofline_ms"] = roof_ms
    speed = out["ref_ms"] / cand_ms if cand_ms and cand_ms > 0 else None
    suspicious = (roof_ms is not None and cand_ms < cfg["roofline_factor"] * roof_ms) or \
                 (speed is not None and speed > cfg["max_speedup_recheck"])
    if suspicious:
        n = min(perf_n, 10)
        re_seeds = [seed + 400000 + i for i in range(n)]
        with timer.lock():
            rt2 = timer.run(cand_model, ref_mod, re_seeds, keep=set(range(n)), full_sync=True)
        verify(rt2["kept"], "re-timed")
        cand_ms2 = _median(rt2["event_ms"])
        details["recheck_ms"] = cand_ms2
        cand_ms = max(cand_ms, cand_ms2)
        if roof_ms is not None and cand_ms < cfg["roofline_factor"] * roof_ms:
            hack("implausible_speedup", f"candidate {cand_ms:.4f} ms is below the memory roofline {roof_ms:.4f} ms")
        speed = out["ref_ms"] / cand_ms if cand_ms > 0 else None
    out["candidate_ms"] = cand_ms
    out["speedup"] = speed

    mark("timing")
    # 10. profiling
    if device.type == "cuda" and cfg["profile"]:
        try:
            from drkernel import profiling
        except Exception:
            profiling = None
        if profiling is not None:
            try:
                prof_in = _gen_inputs(ref_mod, seed + 500000, device)

                def fn():
                    with torch.no_grad():
                        return cand_model(*prof_in)
                prof = profiling.profile_cuda(fn, set(launched_names), calls=5)
            except Exception as exc:
                prof = None
                details["profile_error"] = _short(repr(exc), 300)
            if prof:
                out["triton_time_share"] = prof.get("triton_time_share")
                out["kernels"] = prof.get("kernels")
                share = prof.get("triton_time_share")
                if (cfg["require_triton"] and share is not None and share < cfg["decoy_share"]
                        and not out_from_triton_all):
                    hack("decoy_kernel", f"candidate kernels are {share:.1%} of device time and the output "
                                         f"is not produced by them")

    mark("profiling")
    # 11. final integrity check
    with torch.no_grad():
        check_integrity("final")
    if hacks:
        raise _Hacked(hacks[-1], details["hack_details"][-1])
    out["verdict"] = "correct"


def _cuda_available() -> bool:
    try:
        import torch
        return bool(torch.cuda.is_available())
    except Exception:
        return False


# ======================================================================================
# Parent side
# ======================================================================================

def _read(src: str | os.PathLike) -> tuple[str, str | None]:
    s = os.fspath(src)
    if "\n" not in s and os.path.isfile(s):
        return Path(s).read_text(), s
    return s, None


def _static_checks(ref_code: str, cand_code: str) -> EvalResult | None:
    import ast
    try:
        tree = ast.parse(cand_code)
    except SyntaxError as exc:
        return EvalResult(verdict="compile_error", error=f"SyntaxError: {exc.msg} (line {exc.lineno})")
    except (ValueError, TypeError) as exc:
        return EvalResult(verdict="compile_error", error=f"cannot parse candidate: {exc}")
    if not any(isinstance(n, ast.ClassDef) and n.name == "ModelNew" for n in ast.walk(tree)):
        return EvalResult(verdict="compile_error", error="no ModelNew defined in the candidate")
    return None


def _sandbox_env(device: str) -> dict:
    env = {}
    if device == "cpu" or (device == "auto" and not _cuda_available_parent()):
        env["TRITON_INTERPRET"] = "1"
    return env


def _cuda_available_parent() -> bool:
    # only asks when torch is already imported here; never initialises CUDA in the parent
    if "torch" in sys.modules:
        try:
            return bool(sys.modules["torch"].cuda.is_available())
        except Exception:
            return False
    return shutil.which("nvidia-smi") is not None


def _map_status(res: Any) -> EvalResult:
    status = getattr(res, "status", None)
    r = EvalResult()
    r.stdout = _short(getattr(res, "stdout", "") or "", 2000)
    r.stderr = _short(getattr(res, "stderr", "") or "", 2000)
    if status == "ok" and isinstance(getattr(res, "value", None), dict):
        v = EvalResult.from_dict(res.value)
        v.stdout, v.stderr = r.stdout, r.stderr
        if v.verdict not in VERDICTS:
            v.verdict, v.error = "crashed", f"unknown verdict {v.verdict!r}"
        return v
    if status == "timeout":
        r.verdict, r.error = "timeout", "evaluation exceeded the time limit"
    elif status == "exception":
        r.verdict = "runtime_error"
        err = getattr(res, "error", "") or ""
        r.error = _short(("CUDA error: " + err) if "CUDA error" in err or "illegal memory" in err else err, 600)
        r.details["traceback"] = _short(getattr(res, "traceback", "") or "", 2000)
    elif status == "signal":
        sig = getattr(res, "signal", None)
        try:
            import signal as _signal
            name = _signal.Signals(sig).name if sig else "a signal"
        except Exception:
            name = f"signal {sig}"
        r.verdict, r.error = "crashed", f"killed by {name}"
    elif status == "oom":
        r.verdict, r.error = "crashed", "out of memory (oom)"
    elif status == "exit_no_result":
        r.verdict, r.error = "crashed", f"process exited without a result (os._exit?), exit code {getattr(res, 'exitcode', None)}"
    elif status == "oversized_result":
        r.verdict, r.error = "crashed", "result too large (oversized_result)"
    else:
        r.verdict, r.error = "crashed", f"sandbox error: {getattr(res, 'error', '') or status}"
    return r


def _limits(cfg: EvalConfig):
    from drkernel.sandbox import SandboxLimits
    kw: dict[str, Any] = {"timeout_s": float(cfg.timeout), "max_output_chars": int(cfg.max_output_chars)}
    if cfg.max_rss_mb:
        kw["max_rss_mb"] = int(cfg.max_rss_mb)
    return SandboxLimits(**kw)


# What the fork server imports once, so that no evaluation pays for it: torch._dynamo and
# torch.profiler are imported by every child before its integrity snapshot (see step 4).
_PRELOAD = ("torch", "triton", "torch._dynamo", "torch.profiler")


class _Prepared:
    def __init__(self, reference, candidate, cfg: EvalConfig):
        self.cfg = cfg
        self.dir = tempfile.mkdtemp(prefix="drk_eval_")
        self.early: EvalResult | None = None
        try:
            ref_code, _ = _read(reference)
            cand_code, _ = _read(candidate)
        except OSError as exc:
            self.early = EvalResult(verdict="runtime_error", error=f"cannot read input: {exc}")
            return
        self.early = _static_checks(ref_code, cand_code)
        digest = hashlib.sha256(ref_code.encode()).hexdigest()[:12]
        self.ref_path = os.path.join(self.dir, f"reference_{digest}.py")
        self.cand_path = os.path.join(self.dir, "candidate_" + hashlib.sha256(cand_code.encode()).hexdigest()[:12] + ".py")
        if self.early is not None:
            return
        from drkernel import integrity
        found = integrity.static_scan(cand_code, self.ref_path)
        if found:
            codes = []
            for c, _ in found:
                if c not in codes:
                    codes.append(c)
            self.early = EvalResult(verdict="hacked", compiled=True, hacks=codes,
                                    error="static scan: " + "; ".join(f"{c}: {d}" for c, d in found[:8]),
                                    details={"static_findings": [list(f) for f in found]})
            return
        Path(self.ref_path).write_text(ref_code)
        Path(self.cand_path).write_text(cand_code)

    def kwargs(self) -> dict:
        return {"reference_path": self.ref_path, "candidate_path": self.cand_path,
                "config": dataclasses.asdict(self.cfg)}

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)


def _finish(r: EvalResult, cfg: EvalConfig, wall: float, reward_config=None) -> EvalResult:
    if r.verdict != "correct":
        r.correct = False
        r.speedup = None
    if r.verdict == "hacked" and not r.hacks:
        r.hacks = ["patched_function"]
    if r.device is None:
        r.device = cfg.device
    r.wall_s = wall
    try:
        from drkernel import rewards
        terms = rewards.compute_reward(r, reward_config or rewards.RewardConfig())
        r.reward = float(terms.reward)
        r.reward_terms = terms.to_dict()
    except Exception:
        pass
    return r


def evaluate(reference, candidate, cfg: EvalConfig | None = None, sandbox=None,
             reward_config=None) -> EvalResult:
    """Evaluate one candidate (file path or source) against one reference (file path or source).
    `reward_config` (a `rewards.RewardConfig`, default weights when None) fills `reward`."""
    cfg = cfg or EvalConfig()
    t0 = _perf()
    prep = _Prepared(reference, candidate, cfg)
    try:
        if prep.early is not None:
            return _finish(prep.early, cfg, _perf() - t0, reward_config)
        env = _sandbox_env(cfg.device)
        if sandbox is None:
            from drkernel.sandbox import ForkServer
            with _owned_server(ForkServer, env) as server:
                res = server.run(target="drkernel.evaluator:_child_evaluate", kwargs=prep.kwargs(),
                                 limits=_limits(cfg), env=env)
        else:
            res = sandbox.run(target="drkernel.evaluator:_child_evaluate", kwargs=prep.kwargs(),
                              limits=_limits(cfg), env=env)
        return _finish(_map_status(res), cfg, _perf() - t0, reward_config)
    finally:
        prep.close()


@contextlib.contextmanager
def _owned_server(cls, env):
    server = cls(env=env, preload=_PRELOAD)
    try:
        yield server
    finally:
        close = getattr(server, "close", None)
        if close:
            with contextlib.suppress(Exception):
                close()


class Evaluator:
    """Holds sandbox workers for many evaluations; one worker per GPU when several are visible."""

    def __init__(self, cfg: EvalConfig | None = None, workers: int | None = None, reward_config=None):
        self.cfg = cfg or EvalConfig()
        self.reward_config = reward_config
        self.pool = None
        self.server = None
        env = _sandbox_env(self.cfg.device)
        import drkernel.sandbox as sb
        n_gpu = 0
        if self.cfg.device in ("auto", "cuda") and _cuda_available_parent():
            vis = os.environ.get("CUDA_VISIBLE_DEVICES")
            if vis is not None:
                n_gpu = len([v for v in vis.split(",") if v.strip()])
            else:
                try:
                    q = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
                    n_gpu = len([l for l in q.stdout.splitlines() if l.startswith("GPU")])
                except Exception:
                    n_gpu = 1
        workers = workers or max(1, n_gpu or 1)
        if workers > 1 or n_gpu > 1:
            per = None
            if n_gpu > 1:
                ids = (os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(n_gpu)))).split(",")
                per = [{"CUDA_VISIBLE_DEVICES": ids[i % len(ids)].strip()} for i in range(workers)]
            self.pool = sb.SandboxPool(workers, env, per, preload=_PRELOAD)
        else:
            self.server = sb.ForkServer(env=env, preload=_PRELOAD)

    def evaluate(self, reference, candidate) -> EvalResult:
        return evaluate(reference, candidate, self.cfg, sandbox=self.server, reward_config=self.reward_config)

    def evaluate_many(self, pairs) -> list[EvalResult]:
        pairs = list(pairs)
        if self.pool is None:
            return [self.evaluate(r, c) for r, c in pairs]
        t0 = _perf()
        preps = [_Prepared(r, c, self.cfg) for r, c in pairs]
        try:
            idx = [i for i, p in enumerate(preps) if p.early is None]
            jobs = [dict(target="drkernel.evaluator:_child_evaluate", kwargs=preps[i].kwargs(),
                         limits=_limits(self.cfg)) for i in idx]
            results = list(self.pool.map(jobs)) if jobs else []
            out: list[EvalResult | None] = [None] * len(preps)
            for i, res in zip(idx, results):
                out[i] = _finish(_map_status(res), self.cfg, _perf() - t0, self.reward_config)
            for i, p in enumerate(preps):
                if out[i] is None:
                    out[i] = _finish(p.early or EvalResult(error="not run"), self.cfg, _perf() - t0,
                                     self.reward_config)
            return out  # type: ignore[return-value]
        finally:
            for p in preps:
                p.close()

    def close(self):
        for obj in (self.pool, self.server):
            close = getattr(obj, "close", None)
            if close:
                with contextlib.suppress(Exception):
                    close()
        self.pool = self.server = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ======================================================================================
# CLI
# ======================================================================================

class _ArgParser(argparse.ArgumentParser):
    def error(self, message):
        sys.stderr.write(f"drkernel.evaluator: error: {message}\n")
        raise SystemExit(2)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = _ArgParser(prog="python -m drkernel.evaluator", description="Evaluate a ModelNew candidate.")
    p.add_argument("--reference", required=True)
    p.add_argument("--candidate", required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--trials", type=int)
    p.add_argument("--perf-trials", type=int)
    p.add_argument("--cpu-perf-trials", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--timeout", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--atol", type=float)
    p.add_argument("--rtol", type=float)
    p.add_argument("--max-rss-mb", type=int)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--no-second-distribution", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if not (a.device in ("auto", "cpu", "cuda") or a.device.startswith("cuda:") and a.device[5:].isdigit()):
        p.error(f"bad --device {a.device!r} (cpu, cuda, cuda:N or auto)")
    for name in ("reference", "candidate"):
        if not os.path.isfile(getattr(a, name)):
            p.error(f"--{name}: no such file: {getattr(a, name)}")
    cfg = EvalConfig(device=a.device)
    if a.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    for k in ("trials", "perf_trials", "cpu_perf_trials", "warmup", "timeout", "seed", "max_rss_mb"):
        v = getattr(a, k)
        if v is not None:
            setattr(cfg, k, v)
    if a.atol is not None:
        cfg.atol_fp32 = a.atol
    if a.rtol is not None:
        cfg.rtol_fp32 = a.rtol
    if a.no_profile:
        cfg.profile = False
    if a.no_second_distribution:
        cfg.second_distribution = False
    try:
        r = evaluate(a.reference, a.candidate, cfg)
    except Exception as exc:  # the CLI never crashes on a hostile candidate
        r = EvalResult(verdict="crashed", error=f"evaluator error: {type(exc).__name__}: {exc}")
    if a.json:
        sys.stdout.write("\n" + r.to_json() + "\n")
    else:
        sp = f"{r.speedup:.3f}x" if r.speedup is not None else "-"
        print(f"verdict: {r.verdict}  speedup: {sp} ({r.timing})  ref_ms: {r.ref_ms}  candidate_ms: {r.candidate_ms}")
        if r.hacks:
            print(f"hacks: {', '.join(r.hacks)}")
        if r.error:
            print(f"error: {r.error}")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
