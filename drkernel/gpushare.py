"""One GPU shared by several evaluations: its readers-writer lock, its memory ledger and its
timing core.

Judges of different jobs on one GPU coordinate through two kinds of files in `lock_dir()`:

* ``DeviceLock`` -- a readers-writer ``flock`` per GPU: shared for GPU work whose numbers enter no
  verdict, alone for measurements;
* ``MemoryLedger`` -- GPU memory promised to the jobs on one GPU; a job waits until its share fits.

and one plan made by the evaluator before any sandbox starts:

* ``CorePlan`` -- the CPU core each GPU's timed processes run on while measured, kept free of
  every other sandbox process (a launch-bound forward runs at its host thread's speed).

Runners cannot read `lock_dir()` (`confine.restrict` hides it), so no candidate can take a lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import time
from typing import Iterator


def lock_dir() -> str:
    """Where the per-GPU lock and memory-ledger files live: `DRKERNEL_LOCK_DIR`, or
    /tmp/drkernel-locks (a fixed path, not TMPDIR, which is private per job). Runners cannot read
    it (`confine.restrict`'s hidden directories), so no candidate can take a lock."""
    path = os.environ.get("DRKERNEL_LOCK_DIR") or "/tmp/drkernel-locks"
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


class DeviceLock:
    """A readers-writer lock on one GPU across processes (two ``flock`` files).

    Evaluations hold it *shared* for GPU work whose numbers enter no verdict (building models,
    correctness calls), and *alone* for work whose numbers do (timing, calibration, profiling),
    so a verdict never depends on what neighbours run. A writer first waits ``patience_s`` for a
    moment with no readers, while readers keep the GPU busy (a reader may be compiling for a
    second); then it takes a gate that new readers must pass, so a stream of readers cannot starve
    it. ``waited`` sums the seconds spent waiting per mode. The files live in `lock_dir()`."""

    def __init__(self, index: int | str, timeout_s: float | None = None, patience_s: float = 1.0):
        self.path = os.path.join(lock_dir(), f"drkernel-device-{index}.lock")
        self.timeout_s = timeout_s
        self.patience_s = patience_s
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        self._gate = os.open(self.path + ".gate", os.O_RDWR | os.O_CREAT, 0o666)
        self.mode: str | None = None  # None, "shared" or "alone"
        self.waited = {"shared": 0.0, "alone": 0.0}

    def _try(self, fd: int, op: int, seconds: float | None) -> bool:
        """`flock(fd, op)`, waiting at most `seconds` (None: for as long as it takes)."""
        if seconds is None:
            fcntl.flock(fd, op)
            return True
        end = time.monotonic() + seconds
        while True:
            try:
                fcntl.flock(fd, op | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > end:
                    return False
                time.sleep(0.005)

    def _flock(self, fd: int, op: int, end: float | None) -> None:
        if not self._try(fd, op, None if end is None else max(0.0, end - time.monotonic())):
            raise TimeoutError(f"device lock {self.path} is busy") from None

    def acquire(self, alone: bool) -> float:
        """Take the lock shared or alone; returns the seconds waited."""
        t0 = time.monotonic()
        end = None if self.timeout_s is None else t0 + self.timeout_s
        patience = self.patience_s if self.timeout_s is None else min(self.patience_s, self.timeout_s)
        if not (alone and self._try(self._fd, fcntl.LOCK_EX, patience)):
            self._flock(self._gate, fcntl.LOCK_EX, end)
            try:
                self._flock(self._fd, fcntl.LOCK_EX if alone else fcntl.LOCK_SH, end)
            finally:
                fcntl.flock(self._gate, fcntl.LOCK_UN)
        self.mode = "alone" if alone else "shared"
        waited = time.monotonic() - t0
        self.waited[self.mode] += waited
        return waited

    def release(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self.mode = None

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """The GPU to this holder alone for a while; back to the previous mode afterwards."""
        before = self.mode
        if before == "alone":
            yield
            return
        if before is not None:
            self.release()
        self.acquire(alone=True)
        try:
            yield
        finally:
            self.release()
            if before is not None:
                self.acquire(alone=False)

    def close(self) -> None:
        for fd in (self._fd, self._gate):
            with contextlib.suppress(OSError):
                os.close(fd)


class MemoryLedger:
    """GPU memory promised to the evaluations on one GPU, across processes: each holder writes
    its estimate to a file named after its pid; the sum over live pids is what is promised. A
    job is admitted when its estimate fits beside the others' (or when it would be alone), so
    that concurrent jobs do not run each other out of memory. A holder that dies without
    releasing frees its share, since its pid is gone."""

    def __init__(self, index: int | str, capacity_bytes: int):
        self.dir = os.path.join(lock_dir(), f"drkernel-device-{index}.memory")
        os.makedirs(self.dir, exist_ok=True)
        self.capacity = int(capacity_bytes)
        self.mine = os.path.join(self.dir, str(os.getpid()))

    def _others(self) -> int:
        """Bytes promised to other live processes (files of dead ones are removed)."""
        total = 0
        for name in os.listdir(self.dir):
            if not name.isdigit() or int(name) == os.getpid():
                continue
            try:
                os.kill(int(name), 0)
                with open(os.path.join(self.dir, name)) as fh:
                    total += int(fh.read() or 0)
            except ProcessLookupError:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.dir, name))
            except (OSError, ValueError):
                continue
        return total

    def fits(self, nbytes: int) -> bool:
        """Whether `nbytes` fit now beside what the others hold (always, when nobody holds any)."""
        others = self._others()
        return others == 0 or others + nbytes <= self.capacity

    def reserve(self, nbytes: int, wait: bool = True, poll_s: float = 0.05) -> float | None:
        """Wait until `nbytes` fit beside what the others hold; returns the seconds waited, or
        None at once when they do not fit and `wait` is False."""
        t0 = time.monotonic()
        guard = os.open(self.dir + ".lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            while True:
                fcntl.flock(guard, fcntl.LOCK_EX)
                try:
                    if self.fits(nbytes):
                        with open(self.mine, "w") as fh:
                            fh.write(str(int(nbytes)))
                        return time.monotonic() - t0
                finally:
                    fcntl.flock(guard, fcntl.LOCK_UN)
                if not wait:
                    return None
                time.sleep(poll_s)
        finally:
            os.close(guard)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.mine)


@contextlib.contextmanager
def device_lock(index: int | str, timeout_s: float | None = None) -> Iterator[str]:
    """Hold GPU ``index`` alone (see `DeviceLock`); TimeoutError past ``timeout_s``."""
    lock = DeviceLock(index, timeout_s)
    try:
        with lock.alone():
            yield lock.path
    finally:
        lock.close()


@dataclasses.dataclass(frozen=True)
class CorePlan:
    """Where the sandboxes' processes run. `timing[gpu]` is the core that GPU's timed processes
    (reference twin and candidate runner, one job at a time: the GPU is held alone) move to while
    measured; `work` is every other core, where all sandbox processes run otherwise. `work` is
    None when too few cores would be left to reserve any: then the timed processes are still
    pinned together, but share their core."""
    timing: dict[int, int]
    work: frozenset[int] | None


def _cpu_list(text: str) -> set[int]:
    """The cores of a sysfs CPU list such as "3,11" or "0-3,8"."""
    cores: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        low, _, high = part.partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return cores


def cpu_siblings(core: int) -> set[int]:
    """`core` and the hardware threads of the same physical core (SMT), as sysfs lists them: a
    busy sibling slows a timed thread as much as a process on the core itself."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{core}/topology/thread_siblings_list") as fh:
            return {core} | _cpu_list(fh.read())
    except (OSError, ValueError):
        return {core}


# fewer free cores than this for everything else, and no core is reserved
MIN_WORK_CORES = 4


def plan_cores(gpus: list[int], cores: set[int], siblings=cpu_siblings) -> CorePlan:
    """One timing core per GPU (GPU 0 the highest-numbered core, GPU 1 the next, ...), each on a
    physical core of its own; the rest (their SMT siblings left out) for all other sandbox work.
    The same GPUs and cores give the same plan in every process."""
    ordered = sorted(cores, reverse=True)
    if len(ordered) < 2 or not gpus:
        return CorePlan({}, None)
    timing: dict[int, int] = {}
    reserved: set[int] = set()
    for gpu in sorted(set(gpus)):
        core = next((c for c in ordered if c not in reserved), ordered[len(timing) % len(ordered)])
        timing[gpu] = core
        reserved |= siblings(core) & set(ordered)
    work = set(ordered) - reserved
    return CorePlan(timing, frozenset(work) if len(work) >= MIN_WORK_CORES else None)
