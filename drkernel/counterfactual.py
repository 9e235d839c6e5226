"""A launch of the candidate's kernel that reads other data: does the output notice?

The data flow (`drkernel.dataflow`) says which launches the output is structurally made of. It
cannot see arithmetic that cancels a kernel's result (`torch.relu(x) + 0.0 * y`), a kernel whose
result does not depend on what it read (a busy kernel that sets a flag to 1.0), or torch writing
over a kernel's result in pieces. A counterfactual call asks by value instead: every launch of one
kernel reads perturbed data, everything else runs as in a checked call, and if the output still
matches the reference, that kernel's work was not needed (`judge.check_needed`).

Perturbed means every floating-point storage the launch may read scaled by -2 (a sign flip and a
change of scale, so that neither an even nor a scale-invariant function hides it). A storage the
launch only reads is scaled back after it, exactly (powers of two). A storage it reads and writes
keeps what the launch wrote; every element the launch left as it found it gets its old value back
from a copy. A storage it only writes is left alone: its old content is not the launch's input.
Integer and boolean storages are never perturbed (indices out of range would fault the device),
nor storages reached through two dtypes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from drkernel.dataflow import unobserved
from drkernel.triton_source import Kernel

FACTOR = -2.0


@dataclasses.dataclass
class _Region:
    """The elements of one storage that a launch's arguments span."""
    flat: torch.Tensor
    written: bool
    saved: torch.Tensor | None = None


def _span(t: torch.Tensor) -> tuple[int, int]:
    """First and end element of `t` in its storage."""
    lo = hi = t.storage_offset()
    for size, stride in zip(t.shape, t.stride()):
        lo += min(0, (size - 1) * stride)
        hi += max(0, (size - 1) * stride)
    return lo, hi + 1


def _perturbable(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.element_size() >= 2 and t.numel() > 0


def _regions(bound: dict, kernel: Kernel | None) -> list[_Region]:
    """One region per storage that the launch may read, flagged where it may also write. Without
    the kernel's source facts every tensor argument counts as read and written."""
    read = set(bound) if kernel is None else kernel.loads | (set(kernel.params) - kernel.stores)
    written = set(bound) if kernel is None else kernel.stores
    groups: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for param, t in bound.items():
        if isinstance(t, torch.Tensor):
            groups.setdefault(t.untyped_storage().data_ptr(), []).append((param, t))
    out = []
    for members in groups.values():
        tensors = [t for _, t in members]
        if not any(p in read for p, _ in members) or len({t.dtype for t in tensors}) > 1 \
                or not all(map(_perturbable, tensors)):
            continue
        spans = [_span(t) for t in tensors]
        lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
        t = tensors[0]
        flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), lo, (hi - lo,), (1,))
        out.append(_Region(flat, written=any(p in written for p, _ in members)))
    return out


@contextlib.contextmanager
def perturbed(bound: dict, kernel: Kernel | None) -> Iterator[None]:
    """Inside: the launch's readable storages scaled by FACTOR; after: put back as described above.
    Candidate dispatch modes and tensor subclasses see none of it."""
    with unobserved():
        regions = _regions(bound, kernel)
        for r in regions:
            if r.written:
                r.saved = r.flat.clone()
            r.flat.mul_(FACTOR)
    try:
        yield
    finally:
        with unobserved():
            for r in reversed(regions):
                if r.saved is None:
                    r.flat.mul_(1 / FACTOR)
                else:
                    untouched = r.flat == r.saved * FACTOR
                    r.flat.copy_(torch.where(untouched, r.saved, r.flat))
