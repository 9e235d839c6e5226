"""Tensor facts and output comparison, used by the judge (values) and the runner (self-reports).

`compare` decides correctness: elementwise atol + rtol*|ref| and a relative-L2 limit, NaN and inf
positions matching, exact integers; `degenerate` flags trivial answers (zeros, a constant, an
input) that pass only because the problem barely varies. The passes over floating outputs are
Triton kernels (`compare_kernels`); the detailed float64 pass for failing or non-finite outputs
is chunked, so that multi-GB KernelBench outputs never need several copies of themselves.
"""

from __future__ import annotations

import dataclasses
import math

from drkernel.evaltypes import EvalConfig


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
    """The tensors of an output, in the order of its `structure` (a dict's by sorted key)."""
    return [x for x in _leaves(obj) if _is_tensor(x)]


def leaves(obj) -> list:
    """The values of an output that are not tensors (ints, floats, strings, None), in the same order."""
    return [x for x in _leaves(obj) if not _is_tensor(x)]


def _is_tensor(x) -> bool:
    import torch
    return isinstance(x, torch.Tensor)


def _leaves(obj) -> list:
    if isinstance(obj, (list, tuple)):
        return [x for o in obj for x in _leaves(o)]
    if isinstance(obj, dict):
        return [x for k in sorted(obj) for x in _leaves(obj[k])]
    return [obj]


def _same_value(a, b) -> bool:
    """Two non-tensor output values: floats within the fp32 tolerances, anything else equal."""
    if type(a) is float and type(b) is float:
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4) or (math.isnan(a) and math.isnan(b))
    return type(a) is type(b) and a == b


def short_repr(x, n: int = 200) -> str:
    text = repr(x)
    return text if len(text) <= n else text[:n] + "..."


def structure(obj):
    """The output's shape of containers: "T" per tensor; a list, a tuple and torch's named tuples
    (`torch.max(x, 1)`) are all one "seq" (an honest kernel returns its values as any of them)."""
    import torch
    if isinstance(obj, torch.Tensor):
        return "T"
    if isinstance(obj, (list, tuple)):
        return ("seq", tuple(structure(o) for o in obj))
    if isinstance(obj, dict):
        return ("dict", tuple(sorted((k, structure(v)) for k, v in obj.items())))
    return type(obj).__name__


def strided(t) -> bool:
    """A tensor with elements of its own in one strided block: not sparse, not nested."""
    import torch
    return t.layout == torch.strided and not t.is_nested


def _torch_named_tuple(obj) -> bool:
    """One of torch's own named tuples (`torch.return_types.max`), not a class made to look like one."""
    import torch
    return type(obj) is getattr(torch.return_types, type(obj).__name__, None)


def bad_type(obj) -> str | None:
    """Anything but plain torch.Tensor (or list/tuple/dict of them, or plain scalars)."""
    import torch
    if isinstance(obj, torch.Tensor) or hasattr(obj, "__torch_function__") and not isinstance(obj, (list, tuple, dict)):
        if type(obj) is not torch.Tensor:
            return f"output type {type(obj).__module__}.{type(obj).__qualname__} is not torch.Tensor"
        if not strided(obj):
            return f"output layout {'nested' if obj.is_nested else obj.layout} is not strided"
        if obj.device.type == "meta":
            return "output is a meta tensor"
        return None
    if type(obj) in (list, tuple) or _torch_named_tuple(obj):
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


def extent(t) -> int:
    """Bytes from a tensor's first element to the end of its last (0 when it has none)."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def data_ranges(ts) -> list[tuple[int, int]]:
    """Byte ranges of the tensors' own elements: views into one shared buffer (the runner's
    inputs all live in the judge's arena) overlap only where their elements do."""
    return [(t.data_ptr(), t.data_ptr() + extent(t)) for t in ts if t.numel()]


def overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    return any(x0 < y1 and y0 < x1 for x0, x1 in a for y0, y1 in b)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def same_values(a, b) -> bool:
    """Bit-for-bit the same values (NaN where the other has NaN). Floating tensors are read by one
    kernel pass (`compare_kernels`), which allocates nothing the size of the tensors."""
    import torch
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() and a.numel():
        from drkernel import compare_kernels
        st = compare_kernels.stats(a, b, 0.0, 0.0)
        if not st.n_nonfinite:
            return st.n_out == 0
    if torch.equal(a, b):
        return True
    if a.is_floating_point() or a.is_complex():
        return bool(torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))
                    and torch.equal(torch.isnan(a), torch.isnan(b)))
    return False


def all_finite(t) -> bool:
    """No NaN or inf in a floating tensor (one kernel pass, no tensor-sized temporary)."""
    from drkernel import compare_kernels
    return t.numel() == 0 or compare_kernels.stats(t, t, 0.0, 0.0).n_nonfinite == 0


@dataclasses.dataclass
class Match:
    """How an output compares with the reference's: `ok`, and why not."""
    ok: bool = True
    why: str = ""
    max_abs: float | None = 0.0
    max_rel: float | None = 0.0
    rel_l2: float | None = 0.0
    structure: bool = False  # the structure (tuple/list/dict nesting) differs


def tolerances(dtype, cfg: EvalConfig) -> tuple[float, float, float]:
    import torch
    if dtype in (torch.float16, torch.bfloat16):
        return cfg.atol_half, cfg.rtol_half, cfg.rel_l2_half
    return cfg.atol_fp32, cfg.rtol_fp32, cfg.rel_l2_fp32


_CHUNK = 1 << 24  # elements per comparison chunk: the detailed pass holds about 7 chunks' worth of
# float64 temporaries at its peak, about 1 GiB (3.6 GiB at 1 << 26, beside a full-size problem's own)


def _chunks(*ts):
    """Matching float64 slices of equally sized tensors: the detailed pass holds a few chunks of
    temporaries, whatever the output's size."""
    import torch
    flats = [t.detach().reshape(-1) for t in ts]
    for start in range(0, flats[0].numel(), _CHUNK):
        yield [f[start:start + _CHUNK].to(torch.float64) for f in flats]


def _compare_tensor(c, r, atol, rtol, rel_l2, finite_only: bool = False) -> Match:
    """Elementwise atol + rtol*|ref|, relative L2, and matching NaN/inf positions (with
    `finite_only`, only where the reference is finite, and the candidate must be finite there).

    One pass over both tensors (`compare_kernels.stats`); the detailed float64 pass below runs
    only for outputs that fail or hold non-finite values."""
    import torch
    if c.shape != r.shape:
        return Match(False, f"shape {tuple(c.shape)} vs reference {tuple(r.shape)}")
    if c.dtype != r.dtype:
        return Match(False, f"dtype {c.dtype} vs reference {r.dtype}")
    if c.device != r.device:
        return Match(False, f"device {c.device} vs reference {r.device}")
    if r.is_complex():
        return _compare_tensor(torch.view_as_real(c), torch.view_as_real(r), atol, rtol, rel_l2, finite_only)
    if not r.is_floating_point():
        if torch.equal(c, r):
            return Match()
        diff = (c.long() - r.long()).abs().max().item() if c.numel() else 0
        return Match(False, "integer/bool values differ", max_abs=float(diff))
    if r.numel() == 0:
        return Match()
    from drkernel import compare_kernels
    st = compare_kernels.stats(c, r, atol, rtol)
    # the sums of squares overflow to inf for huge values: the float64 pass then decides
    if st.n_out or st.n_nonfinite or not all(map(math.isfinite, (st.sq_err, st.sq_ref))):
        return _compare_tensor_slow(c, r, atol, rtol, rel_l2, finite_only)
    nref, nerr = math.sqrt(st.sq_ref), math.sqrt(st.sq_err)
    res = Match(max_abs=st.max_abs, max_rel=st.max_rel,
                rel_l2=nerr / nref if nref > 0 else (0.0 if nerr == 0 else float("inf")))
    if _l2_fails(nerr, nref, r.numel(), atol, rel_l2):
        res.ok, res.why = False, f"relative L2 error {res.rel_l2:.3g} > {rel_l2:g}"
    return res


# An error whose root mean square is below this fraction of atol is rounding noise: an output that
# is zero in exact arithmetic (the mean of a group just normalised) holds only noise, the
# reference's and any honest kernel's alike, and their relative L2 distance says nothing
_L2_NOISE = 1e-3


def _l2_fails(nerr: float, nref: float, n: int, atol: float, rel_l2: float) -> bool:
    return nref > 0 and nerr > rel_l2 * nref + _L2_NOISE * atol * math.sqrt(n)


def _compare_tensor_slow(c, r, atol, rtol, rel_l2, finite_only: bool = False) -> Match:
    """The detailed float64 comparison: NaN/inf positions, then tolerances over finite values."""
    import torch
    res = Match()
    n_fin = n_bad = 0
    sq_err = sq_ref = 0.0
    for c64, r64 in _chunks(c, r):
        if not finite_only and not torch.equal(torch.isnan(c64), torch.isnan(r64)):
            return Match(False, "NaN positions differ from the reference")
        ri = torch.isinf(r64)
        if not finite_only and (not torch.equal(torch.isinf(c64), ri) or not torch.equal(c64[ri], r64[ri])):
            return Match(False, "inf positions differ from the reference")
        fin = torch.isfinite(r64)
        cf, rf = c64[fin], r64[fin]
        if cf.numel() == 0:
            continue
        n_bad += int((~torch.isfinite(cf)).sum().item())  # NaN or inf where the reference is finite
        cf = torch.nan_to_num(cf, nan=0.0, posinf=0.0, neginf=0.0)
        err = (cf - rf).abs()
        res.max_abs = max(res.max_abs, float(err.max().item()))
        res.max_rel = max(res.max_rel, float((err / rf.abs().clamp_min(1e-12)).max().item()))
        n_bad += int((err > (atol + rtol * rf.abs())).sum().item())
        n_fin += cf.numel()
        sq_err += float((err * err).sum().item())
        sq_ref += float((rf * rf).sum().item())
    if n_fin == 0:
        return res
    nref, nerr = math.sqrt(sq_ref), math.sqrt(sq_err)
    res.rel_l2 = nerr / nref if nref > 0 else (0.0 if nerr == 0 else float("inf"))
    if n_bad:
        res.ok, res.why = False, f"{n_bad}/{n_fin} elements outside atol={atol:g} rtol={rtol:g}"
    elif _l2_fails(nerr, nref, n_fin, atol, rel_l2):
        res.ok, res.why = False, f"relative L2 error {res.rel_l2:.3g} > {rel_l2:g}"
    return res


def compare(out, ref, cfg: EvalConfig, loose: bool = False, finite_only: bool = False) -> Match:
    """The candidate's output against the reference's (tolerances by dtype, or `loose_tol`);
    `finite_only`: where the reference is finite (inputs outside its domain give NaN or inf
    elsewhere, whose positions an honest kernel need not reproduce)."""
    if structure(out) != structure(ref):
        return Match(False, f"output structure {structure(out)} vs reference {structure(ref)}",
                     max_abs=None, max_rel=None, rel_l2=None, structure=True)
    agg = Match()
    cts, rts = tensors(out), tensors(ref)
    if not all(map(_same_value, leaves(out), leaves(ref))):
        return Match(False, f"non-tensor values {short_repr(leaves(out))} vs reference {short_repr(leaves(ref))}")
    for i, (c, r) in enumerate(zip(cts, rts)):
        atol, rtol, rl2 = (cfg.loose_tol,) * 3 if loose else tolerances(r.dtype, cfg)
        res = _compare_tensor(c, r, atol, rtol, rl2, finite_only)
        agg.max_abs, agg.max_rel = max(agg.max_abs, res.max_abs), max(agg.max_rel, res.max_rel)
        agg.rel_l2 = max(agg.rel_l2, res.rel_l2)
        if not res.ok and agg.ok:
            agg.ok, agg.why = False, (f"output {i}: " if len(rts) > 1 else "") + res.why
    return agg


def degenerate(out, ref, inputs, cfg: EvalConfig) -> str | None:
    """The candidate ≈ a trivial answer (zeros, a constant, an input) that would pass here.

    A pass for the reference's mean, then one per trivial answer (`compare_kernels`)."""
    from drkernel import compare_kernels
    in_ts = tensors(inputs)
    for c, r in zip(tensors(out), tensors(ref)):
        if not r.is_floating_point() or r.numel() < 2 or c.shape != r.shape or c.dtype != r.dtype:
            continue
        atol, rtol, _ = tolerances(r.dtype, cfg)
        st = compare_kernels.stats(c, r, atol, rtol)
        if st.n_nonfinite:
            continue
        answers = {"zeros": 0.0, "a constant": st.sum_ref / r.numel()}
        answers.update({f"input {i}": t for i, t in enumerate(in_ts) if t.shape == r.shape and t.dtype == r.dtype})
        for name, a in answers.items():
            got = compare_kernels.answer(r, c, a, atol, rtol)
            if got.gap <= 1e-6 * got.scale + 1e-30:
                continue  # the reference really is this trivial answer
            if got.fails == 0 and got.dist <= 0.1 * got.gap:
                return f"output ≈ {name}, which passes the tolerance on this problem while the reference differs"
    return None
