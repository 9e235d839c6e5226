"""A launch of the candidate's kernel that reads other data: does the output notice?

The data flow (`drkernel.dataflow`) says which launches the output is structurally made of. It
cannot see arithmetic that cancels a kernel's result (`torch.relu(x) + 0.0 * y`), a kernel whose
result does not depend on what it read (a busy kernel that sets a flag to 1.0), or torch writing
over a kernel's result in pieces. A counterfactual call asks by value instead: every launch of one
kernel reads perturbed data, everything else runs as in a checked call, and if the output still
matches the reference, that kernel's work was not needed (`judge.check_needed`).

Perturbed means: every floating-point range the launch may read multiplied element by element by
-2 and 4 in turn (a sign flip and a change of scale that is not uniform, so that neither an even,
nor a scale-invariant, nor a ratio-only function hides it); every integer or boolean range rolled
by half its length (its values stay the same set: indices stay in range). A range is the bytes of
one storage that overlapping arguments span: inputs side by side in the judge's arena are apart.
A range the launch only reads is put back after it, exactly (powers of two, or from a copy). A
range it reads and writes keeps what the launch wrote; every element the launch left as it found
it gets its old value back from a copy. A range it only writes is left alone: its old content is
not the launch's input. A float range holding a NaN or a finite value that the scaling could
overflow (it would not come back bit for bit), one reached through two dtypes, and one of a dtype
torch has no such ops for, have their bytes rolled instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from drkernel.dataflow import unobserved
from drkernel.triton_source import Kernel

FACTORS = (-2.0, 4.0)  # by element, in turn; powers of two, so that scaling back is exact
_CHUNK = 1 << 24  # elements per step of the overflow check (its temporaries stay this small)
# dtypes whose values are scaled or rolled as such; any other (complex, 8-bit floats, sub-byte and
# quantized dtypes, where torch lacks the ops) has its bytes rolled, so no dtype escapes the perturbation
_TYPED = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64,
                    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


def scale(flat: torch.Tensor, phase: int, inverse: bool = False) -> torch.Tensor:
    """`flat` multiplied in place by FACTORS in turn, element 0 by FACTORS[phase], or by their
    inverses."""
    n = len(FACTORS)
    for k in range(n):
        f = FACTORS[(k + phase) % n]
        flat[k::n].mul_(1 / f if inverse else f)
    return flat


@dataclasses.dataclass
class _Region:
    """One range of a storage and how it is perturbed: `phase` of the float factors, or `shift` (a
    roll) for the rest; `saved` is its old content where a copy is needed to put it back."""
    flat: torch.Tensor
    written: bool
    phase: int = 0
    shift: int | None = None
    saved: torch.Tensor | None = None

    def perturb(self) -> None:
        if self.written or self.shift is not None:
            self.saved = self.flat.clone()
        if self.shift is not None:
            self.flat.copy_(self.saved.roll(self.shift))
        else:
            scale(self.flat, self.phase)

    def restore(self) -> None:
        if not self.written:
            if self.shift is not None:
                self.flat.copy_(self.saved)
            else:
                scale(self.flat, self.phase, inverse=True)
            return
        # elements still as perturbed are the launch's to leave: their old values back (one mask
        # beside the copy, so that a storage of several GB does not need three)
        if self.shift is not None:
            untouched = self.flat == self.saved.roll(self.shift)
        else:  # scaled there and back in place: exact, the range's values are bounded
            untouched = self.flat == scale(self.saved, self.phase)
            scale(self.saved, self.phase, inverse=True)
        torch.where(untouched, self.saved, self.flat, out=self.saved)
        self.flat.copy_(self.saved)


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """First and end byte of `t` in its storage."""
    lo = hi = t.storage_offset()
    for size, stride in zip(t.shape, t.stride()):
        lo += min(0, (size - 1) * stride)
        hi += max(0, (size - 1) * stride)
    return lo * t.element_size(), (hi + 1) * t.element_size()


def _scalable(flat: torch.Tensor) -> bool:
    """No NaN, and no finite value the factors could overflow (infinities scale back exactly)."""
    bound = torch.finfo(flat.dtype).max / max(abs(f) for f in FACTORS)
    low, high = torch.aminmax(flat)  # a reduction, no temporary of the range's size; NaN fails both
    if bool(low >= -bound) and bool(high <= bound):
        return True
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start:start + _CHUNK]
        if bool(part.isnan().any()) or bool(((part.abs() > bound) & part.isfinite()).any()):
            return False
    return True


def _region(tensors: list[torch.Tensor], lo: int, hi: int, written: bool, phase: int) -> _Region:
    """The perturbation of bytes `lo` to `hi` of the tensors' one storage: scaled where one float
    dtype reads it and scaling comes back exactly, else its bytes rolled (a range reached through
    two dtypes, or holding a NaN, is perturbed too: left alone, a kernel could be handed its data
    unperturbed under a second dtype)."""
    t = tensors[0]
    size = t.element_size()
    if len({x.dtype for x in tensors}) > 1 or t.dtype not in _TYPED or lo % size or hi % size:
        return _rolled(t, lo, hi, written)
    flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), lo // size, ((hi - lo) // size,), (1,))
    if not t.is_floating_point():
        return _Region(flat, written, shift=flat.numel() // 2)
    return _Region(flat, written, phase=phase) if _scalable(flat) else _rolled(t, lo, hi, written)


def _rolled(t: torch.Tensor, lo: int, hi: int, written: bool) -> _Region:
    """Bytes `lo` to `hi` of `t`'s storage, rolled by half their length."""
    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), lo, (hi - lo,), (1,))
    return _Region(flat, written, shift=flat.numel() // 2)


def _ranges(members: list[tuple[str, torch.Tensor]]) -> list[tuple[int, int, list[tuple[str, torch.Tensor]]]]:
    """The arguments on one storage, merged where their bytes overlap."""
    out: list[tuple[int, int, list]] = []
    for lo, hi, param, t in sorted((*_byte_span(t), p, t) for p, t in members if t.numel()):
        if out and lo < out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi), out[-1][2] + [(param, t)])
        else:
            out.append((lo, hi, [(param, t)]))
    return out


def _regions(bound: dict, kernel: Kernel | None) -> list[_Region]:
    """One region per range that the launch may read, flagged where it may also write. Without
    the kernel's source facts every tensor argument counts as read and written."""
    read = set(bound) if kernel is None else kernel.loads | (set(kernel.params) - kernel.stores)
    written = set(bound) if kernel is None else kernel.stores
    storages: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for param, t in bound.items():
        if isinstance(t, torch.Tensor):
            storages.setdefault(t.untyped_storage().data_ptr(), []).append((param, t))
    out = []
    for members in storages.values():
        for lo, hi, group in _ranges(members):
            if any(p in read for p, _ in group):
                out.append(_region([t for _, t in group], lo, hi, any(p in written for p, _ in group), len(out)))
    return out


@contextlib.contextmanager
def perturbed(bound: dict, kernel: Kernel | None) -> Iterator[None]:
    """Inside: the launch's readable ranges perturbed; after: put back as described above.
    Candidate dispatch modes and tensor subclasses see none of it."""
    with unobserved():
        regions = _regions(bound, kernel)
        for r in regions:
            r.perturb()
    try:
        yield
    finally:
        with unobserved():
            for r in reversed(regions):
                r.restore()
