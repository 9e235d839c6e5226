"""Tensor facts and output comparison, used by the judge (values) and the runner (self-reports).

`compare` decides correctness: elementwise atol + rtol*|ref| and a relative-L2 limit, NaN and inf
positions matching, exact integers; `degenerate` flags trivial answers (zeros, a constant, an
input) that pass only because the problem barely varies. Chunked so that multi-GB KernelBench
outputs never need several copies of themselves.
"""

from __future__ import annotations

import math

def map_tensors(obj, fn):
    import torch
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def tensors(obj) -> list:
    import torch
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in tensors(o)]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors(v)]
    return []


def structure(obj):
    import torch
    if isinstance(obj, torch.Tensor):
        return "T"
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(structure(o) for o in obj))
    if isinstance(obj, dict):
        return ("dict", tuple(sorted((k, structure(v)) for k, v in obj.items())))
    return type(obj).__name__


def bad_type(obj) -> str | None:
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
            r = bad_type(o)
            if r:
                return r
        return None
    if type(obj) is dict:
        for v in obj.values():
            r = bad_type(v)
            if r:
                return r
        return None
    if type(obj) in (int, float, bool, type(None)):
        return None
    return f"output type {type(obj).__module__}.{type(obj).__qualname__} is not torch.Tensor"


def ranges(tensors) -> list[tuple[int, int]]:
    out = []
    for t in tensors:
        try:
            st = t.untyped_storage()
            if st.nbytes() > 0:
                out.append((st.data_ptr(), st.data_ptr() + st.nbytes()))
        except Exception:
            pass
    return out


def data_ranges(ts) -> list[tuple[int, int]]:
    """Byte ranges of the tensors' own elements: views into one shared buffer (the runner's
    inputs all live in the judge's arena) overlap only where their elements do."""
    out = []
    for t in ts:
        if t.numel() == 0:
            continue
        span = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1
        out.append((t.data_ptr(), t.data_ptr() + span * t.element_size()))
    return out


def overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    return any(x0 < y1 and y0 < x1 for x0, x1 in a for y0, y1 in b)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def same_values(a, b) -> bool:
    import torch
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):  # one pass; the NaN-aware check below only when this fails
        return True
    if a.is_floating_point() or a.is_complex():
        return bool(torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))
                    and torch.equal(torch.isnan(a), torch.isnan(b)))
    return bool(torch.equal(a, b))


def tolerances(dtype, cfg: dict) -> tuple[float, float, float]:
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

    One pass on the device with no host synchronisation until the end; the detailed float64 pass
    below runs only for outputs that fail or hold non-finite values (they make the sums of squares
    non-finite)."""
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
        n_out += (err > ra.mul(rtol).add_(atol)).sum()
        max_abs = torch.maximum(max_abs, err.max().to(f64))
        max_rel = torch.maximum(max_rel, err.div(ra.clamp_min_(1e-12)).max().to(f64))
        # sums of squares in the work dtype per chunk (a relative error near 1e-7, far below the
        # L2 limit); a NaN or inf anywhere makes them non-finite, which sends us to the slow pass
        sq_err += torch.dot(err, err).to(f64)
        sq_ref += torch.dot(rf, rf).to(f64)
        del err, ra
    stats = torch.stack([n_out.to(f64), max_abs, max_rel, sq_err, sq_ref]).tolist()  # the one sync
    if stats[0] > 0 or not all(map(math.isfinite, stats)):
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


def compare(out, ref, cfg: dict, loose: bool = False) -> dict:
    if structure(out) != structure(ref):
        return {"ok": False, "structure": True, "why": f"output structure {structure(out)} vs reference {structure(ref)}",
                "max_abs": None, "max_rel": None, "rel_l2": None}
    agg = {"ok": True, "structure": False, "why": "", "max_abs": 0.0, "max_rel": 0.0, "rel_l2": 0.0}
    cts, rts = tensors(out), tensors(ref)
    if not rts and out != ref:
        return {**agg, "ok": False, "why": f"value {out!r} vs reference {ref!r}"}
    for i, (c, r) in enumerate(zip(cts, rts)):
        if loose:
            atol = rtol = rl2 = cfg["loose_tol"]
        else:
            atol, rtol, rl2 = tolerances(r.dtype, cfg)
        res = _compare_tensor(c, r, atol, rtol, rl2)
        for k in ("max_abs", "max_rel", "rel_l2"):
            agg[k] = max(agg[k], res[k])
        if not res["ok"] and agg["ok"]:
            agg["ok"] = False
            agg["why"] = (f"output {i}: " if len(rts) > 1 else "") + res["why"]
    return agg


def degenerate(out, ref, inputs, cfg: dict) -> str | None:
    """The candidate ≈ a trivial answer (zeros, a constant, an input) that would pass here.

    Two passes over the outputs on the device, each ending in a single host synchronisation."""
    import torch
    in_ts = tensors(inputs)
    f64 = torch.float64
    for c, r in zip(tensors(out), tensors(ref)):
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
        atol, rtol, _ = tolerances(r.dtype, cfg)
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
