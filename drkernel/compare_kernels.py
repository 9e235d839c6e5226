"""The comparison's passes over an output as Triton kernels (the judge's own, trusted code).

KernelBench outputs reach billions of elements. In torch, each statistic of the comparison is
one or more full passes with full-size temporaries (about 20 passes for the tolerance, error and
L2 figures); here each pass reads every element once and keeps nothing but one row of partial
results per program, which torch folds in float64. On the CPU the same kernels run in Triton's
interpreter (the evaluator turns it on for CPU jobs).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

# Elements per block by device type: Triton's CPU interpreter pays per operation on a block, so
# that its blocks are large (its time then goes to numpy on whole blocks).
_BLOCK = {"cuda": 1024, "cpu": 1 << 16}
_PROGRAMS = 4096  # at most; each program walks one contiguous range of blocks


@triton.jit(do_not_specialize=["n", "iters"])  # one compiled variant per dtype, whatever the size
def _stats_kernel(c_ptr, r_ptr, part_ptr, n, iters, atol, rtol, WORK: tl.constexpr, BLOCK: tl.constexpr):
    """Per program: elements outside atol + rtol*|r|, non-finite elements, max |c - r|, max
    relative error, sum of squared errors, of squared reference values and of reference values."""
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    n_out = tl.zeros([BLOCK], dtype=tl.int32)
    n_bad = tl.zeros([BLOCK], dtype=tl.int32)
    max_abs = tl.zeros([BLOCK], dtype=WORK)
    max_rel = tl.zeros([BLOCK], dtype=WORK)
    sq_err = tl.zeros([BLOCK], dtype=WORK)
    sq_ref = tl.zeros([BLOCK], dtype=WORK)
    total = tl.zeros([BLOCK], dtype=WORK)
    for i in range(0, iters):
        offs = (pid.to(tl.int64) * iters + i) * BLOCK + lanes
        mask = offs < n
        c = tl.load(c_ptr + offs, mask=mask, other=0.0).to(WORK)
        r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(WORK)
        err = tl.abs(c - r)
        ra = tl.abs(r)
        finite = (tl.abs(c) < float("inf")) & (ra < float("inf"))  # False for NaN too
        n_bad += tl.where(finite, 0, 1)
        n_out += tl.where(err > atol + rtol * ra, 1, 0)
        max_abs = tl.maximum(max_abs, err)
        max_rel = tl.maximum(max_rel, err / tl.maximum(ra, 1e-12))
        sq_err += err * err
        sq_ref += r * r
        total += r
    row = part_ptr + pid * 7
    tl.store(row + 0, tl.sum(n_out.to(tl.float64), axis=0))
    tl.store(row + 1, tl.sum(n_bad.to(tl.float64), axis=0))
    tl.store(row + 2, tl.max(max_abs, axis=0).to(tl.float64))
    tl.store(row + 3, tl.max(max_rel, axis=0).to(tl.float64))
    tl.store(row + 4, tl.sum(sq_err.to(tl.float64), axis=0))
    tl.store(row + 5, tl.sum(sq_ref.to(tl.float64), axis=0))
    tl.store(row + 6, tl.sum(total.to(tl.float64), axis=0))


@triton.jit(do_not_specialize=["n", "iters", "const"])
def _answer_kernel(r_ptr, c_ptr, a_ptr, part_ptr, n, iters, const, atol, rtol,
                   USE_A: tl.constexpr, WORK: tl.constexpr, BLOCK: tl.constexpr):
    """Per program, for one trivial answer a (the tensor at a_ptr, or `const`): max |r - a|,
    elements where a misses the tolerance, max |c - a| and max |r|."""
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    gap = tl.zeros([BLOCK], dtype=WORK)
    dist = tl.zeros([BLOCK], dtype=WORK)
    scale = tl.zeros([BLOCK], dtype=WORK)
    fails = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, iters):
        offs = (pid.to(tl.int64) * iters + i) * BLOCK + lanes
        mask = offs < n
        r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(WORK)
        c = tl.load(c_ptr + offs, mask=mask, other=0.0).to(WORK)
        if USE_A:
            a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(WORK)
        else:
            a = tl.zeros([BLOCK], dtype=WORK) + const
        a = tl.where(mask, a, 0.0)
        d = tl.abs(r - a)
        ra = tl.abs(r)
        gap = tl.maximum(gap, d)
        fails += tl.where(d > atol + rtol * ra, 1, 0)
        dist = tl.maximum(dist, tl.abs(c - a))
        scale = tl.maximum(scale, ra)
    row = part_ptr + pid * 4
    tl.store(row + 0, tl.max(gap, axis=0).to(tl.float64))
    tl.store(row + 1, tl.sum(fails.to(tl.float64), axis=0))
    tl.store(row + 2, tl.max(dist, axis=0).to(tl.float64))
    tl.store(row + 3, tl.max(scale, axis=0).to(tl.float64))


@dataclasses.dataclass
class Stats:
    """One comparison pass over a candidate output c and the reference r."""
    n_out: int  # elements with |c - r| > atol + rtol*|r|
    n_nonfinite: int  # NaN or inf in c or r (the figures below are then meaningless)
    max_abs: float
    max_rel: float
    sq_err: float
    sq_ref: float
    sum_ref: float


@dataclasses.dataclass
class Answer:
    """One trivial answer a against the reference r and the candidate c."""
    gap: float  # max |r - a|
    fails: int  # elements where a misses the tolerance
    dist: float  # max |c - a|
    scale: float  # max |r|


def _flat(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements in order, contiguous: the kernels read memory from the start on (a strided
    view, such as one column, reshaped to 1-D is still a strided view)."""
    return t.detach().reshape(-1).contiguous()


def _grid(n: int, device: torch.device) -> tuple[int, int, int]:
    """(programs, blocks per program, block) covering n elements."""
    block = _BLOCK["cpu" if device.type == "cpu" else "cuda"]
    blocks = triton.cdiv(n, block)
    programs = min(blocks, _PROGRAMS)
    return programs, triton.cdiv(blocks, programs), block


def _work(*ts: torch.Tensor):
    """float64 where a tensor is float64, else float32: half and bf16 widen to float32 exactly."""
    return tl.float64 if any(t.dtype == torch.float64 for t in ts) else tl.float32


def warm_up(device: torch.device) -> None:
    """Compile (or fetch from Triton's disk cache) the float32 kernels without launching them:
    Triton's start in a fresh process costs most of a second of CPU time, which a judge pays
    here, before it holds the GPU, rather than inside its first comparison."""
    x = torch.empty(_BLOCK["cuda"], dtype=torch.float32, device=device)
    part = torch.empty(1, 7, dtype=torch.float64, device=device)
    _stats_kernel.warmup(x, x, part, x.numel(), 1, 0.0, 0.0, WORK=tl.float32, BLOCK=_BLOCK["cuda"], grid=(1,))
    for use_a in (False, True):
        _answer_kernel.warmup(x, x, x, part, x.numel(), 1, 0.0, 0.0, 0.0, USE_A=use_a, WORK=tl.float32,
                              BLOCK=_BLOCK["cuda"], grid=(1,))


def stats(c: torch.Tensor, r: torch.Tensor, atol: float, rtol: float) -> Stats:
    """The comparison figures of two equally shaped floating tensors on one device (one sync)."""
    c, r = _flat(c), _flat(r)
    n = r.numel()
    if n == 0:
        return Stats(0, 0, 0.0, 0.0, 0.0, 0.0, 0.0)
    programs, iters, block = _grid(n, r.device)
    part = torch.empty(programs, 7, dtype=torch.float64, device=r.device)
    _stats_kernel[(programs,)](c, r, part, n, iters, atol, rtol, WORK=_work(c, r), BLOCK=block)
    sums, maxes = torch.stack([part.sum(0), part.amax(0)]).tolist()  # the one sync
    n_out, n_bad, _, _, sq_err, sq_ref, total = sums
    max_abs, max_rel = maxes[2:4]
    return Stats(int(n_out), int(n_bad), max_abs, max_rel, sq_err, sq_ref, total)


def answer(r: torch.Tensor, c: torch.Tensor, a: torch.Tensor | float, atol: float, rtol: float) -> Answer:
    """How a trivial answer `a` (a tensor shaped like r, or a constant) fares against r and c."""
    r, c = _flat(r), _flat(c)
    n = r.numel()
    programs, iters, block = _grid(max(n, 1), r.device)
    part = torch.zeros(programs, 4, dtype=torch.float64, device=r.device)
    use_a = isinstance(a, torch.Tensor)
    _answer_kernel[(programs,)](r, c, _flat(a) if use_a else r, part, n, iters, 0.0 if use_a else float(a),
                                atol, rtol, USE_A=use_a, WORK=_work(r, c), BLOCK=block)
    folded = part.amax(0)
    folded[1] = part[:, 1].sum()
    gap, fails, dist, scale = folded.tolist()
    return Answer(gap, int(fails), dist, scale)
