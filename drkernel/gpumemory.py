"""How much GPU memory one evaluation may hold, estimated without memory or work (the meta device).

The judge asks for this before it takes GPU memory, so that jobs sharing a GPU are admitted only
when their estimates fit beside each other (`sandbox.MemoryLedger`).
"""

from __future__ import annotations

import os
import signal
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from drkernel import compare

_CONTEXTS = 3 * 2**30  # the judge's, the reference twin's and a runner's CUDA contexts
_KEPT = 2**30  # reference outputs kept for a group's later candidates (judge._CACHE_BYTES)


def memory_estimate(ref_mod, total: int) -> int:
    """GPU bytes one evaluation may hold at once: the reference's parameters four times (the
    template, a fresh copy, the twin's model, the candidate's model); its inputs twice (the arena,
    the fresh inputs the reference also runs on; a reference that writes into its inputs runs on
    yet another copy, not counted); the larger of its inputs and outputs once more (a checked
    call's output copy, or the input-sized block the judge's caching allocator held in the H200
    runs); its outputs twice (the arena's slots, the candidate's output in the runner, which keeps
    no earlier output alive); the peak of the reference's forward twice (the judge's and the twin's:
    output and intermediates); and the three CUDA contexts. Reference outputs the judge keeps for
    later candidates of its group come on top where they fit its bound (`judge._CACHE_BYTES`).
    A forward that does not run on the meta device within two seconds (recurrent layers step by
    step) counts its output and peak as large as its inputs; a reference that cannot even be built
    there is assumed to need half the GPU."""
    try:
        with torch.device("meta"):
            model = ref_mod.Model(*ref_mod.get_init_inputs())
            inputs = list(ref_mod.get_inputs())
        held = [*model.parameters(), *model.buffers()] if isinstance(model, torch.nn.Module) else []
        params, ins = compare.nbytes(held), compare.nbytes(compare.tensors(inputs))
    except Exception:
        return total // 2
    outs, peak = meta_forward_bytes(model, inputs, ins)
    kept = _KEPT if outs <= _KEPT else 0
    return 4 * params + 2 * ins + max(ins, outs) + 2 * outs + 2 * peak + _CONTEXTS + kept


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages created under it while they are alive (`live`) and their
    high-water mark (`peak`); views and in-place results add nothing."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        known = self.storages | {t.untyped_storage()._cdata for t in compare.tensors([args, kwargs])}
        for t in compare.tensors(out):
            st = t.untyped_storage()
            if st._cdata not in known:
                known.add(st._cdata)
                self.storages.add(st._cdata)
                self.live += st.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(st, self._freed, st._cdata, st.nbytes())
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self.storages.discard(key)
        self.live -= nbytes


def _too_slow(signum, frame):
    raise TimeoutError


def meta_forward_bytes(model, inputs: list, fallback: int, limit_s: float = 2.0) -> tuple[int, int]:
    """(output bytes, peak live bytes) of the reference's forward on the meta device, or
    (`fallback`, `fallback`) when it cannot tell in time. A caller's own alarm (the judge's group
    deadline) is put back afterwards, less the time spent here."""
    previous = signal.signal(signal.SIGALRM, _too_slow)
    t0 = time.monotonic()
    outer, _ = signal.setitimer(signal.ITIMER_REAL, limit_s)
    live = LiveBytes()
    try:
        with torch.device("meta"), torch.no_grad(), live:
            out = model(*inputs)
        return compare.nbytes(compare.tensors(out)), live.peak
    except Exception:
        return fallback, fallback
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - t0), 1e-3))


def holders(top: int = 6) -> str:
    """Where this process's GPU memory is, for an out-of-memory error's text: what the allocator
    holds and reserves, and the largest live CUDA tensors (the judge's own: it runs no candidate
    code, so looking at its objects is safe)."""
    import gc

    seen, sizes = set(), []
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                sizes.append((storage.nbytes(), tuple(obj.shape), str(obj.dtype)))
    sizes.sort(reverse=True)
    big = ", ".join(f"{n / 2**30:.2f} GiB {shape} {dtype}" for n, shape, dtype in sizes[:top])
    free, total = torch.cuda.mem_get_info()
    # used on the device beyond what this allocator reserved: other processes', or this process's
    # own outside torch (a CUDA context, memory mapped from another process)
    beyond = (total - free - torch.cuda.memory_reserved()) / 2**30
    # every process's share as the driver sees it (pynvml), to tell this one's from its runners'
    try:
        procs = " ".join(torch.cuda.list_gpu_processes().split())
    except Exception as exc:  # noqa: BLE001 - NVML's own errors; the rest of the text still helps
        procs = f"processes unknown ({type(exc).__name__})"
    return (f"allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB, reserved "
            f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB, used on the device beyond that {beyond:.2f} GiB; "
            f"largest live tensors: {big or 'none'}; this process is {os.getpid()}; {procs}")

