"""Which of the candidate's Triton launches did work that its output needs.

A decoy candidate launches a kernel (it may be heavy: read the whole input, loop, write a scratch
buffer or even the output buffer) and computes the answer with torch. It can tell a skipped
launch from a real one (a sentinel its kernel writes, Triton's own pre-run hooks), so a no-op run
alone cannot catch it. Data flow does not ask the candidate anything: during ordinary checked
calls the runner logs every aten op (what it read, what it wrote) and every Triton launch (its
tensor arguments by parameter), and the judge replays the log: a launch is *needed* when the
output's storages were last written by it, or by ops that (transitively) read what it wrote.
Which parameters a kernel writes through comes from its source text (`drkernel.triton_source`),
read by the judge. A torch op that overwrites a whole buffer (`copy_`, `fill_`, an `out=`
argument) cuts what was written there before.

Where the judge asks (the signed-input trials, on which no op of a KernelBench problem is an
identity), each launch also says which of its tensor arguments' storages it *changed*, and where
(`block_sums` before and after it): a store of the values already there (a kernel that "touches"
an output torch computed) is no write, and a write that misses the output's bytes (a word just
past the view torch filled) does not make the output need it.

Inside a launch the log is paused (Triton's interpreter moves the arguments with torch ops there),
but an op that is none of those moves is noted (`FlowLog.inside`): torch's work there would count as
the launch's, and the runner refuses the launch.

Runner side: `FlowLog` (a TorchDispatchMode), `HostReads` beside it, and `Event`s; judge side:
`needed_launches`.
Storages are keyed by their data pointer (views share their base's key); tensors inside the
judge's arena (the inputs) are keyed by their own start, one key per input.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from drkernel.compare import tensors

_BLOCK_WORDS = 1024  # 4 KiB blocks of 32-bit words: where a launch changed a storage, to this grain
_CHUNK_BLOCKS = 4096  # blocks weighted at once (a 16 MiB temporary, whatever the storage's size)
# a level-3 forward logs thousands, a recurrence written with torch ops at KernelBench's length (512
# steps, 6 layers, 2 directions) about 80,000; past this the log is marked truncated (no evidence)
MAX_EVENTS = 200_000

# The values a call read back to the host (`item()`, `float(t)`, `tolist()`, `numpy()`): one
# pseudo-storage every such read writes into, keeping the earlier ones (a partial write). Ops that
# make a tensor out of a host value read it, so a loss a kernel summed in parts, finished in Python
# and wrapped by `torch.tensor`, is made of that kernel's work (no real storage has a negative key).
HOST = -1
_HOST_READ = "_local_scalar_dense"
# reads to the host that run no aten op (the values are copied, or shared, below the dispatcher)
_HOST_METHODS = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy", torch.Tensor.__array__: "__array__"}
_FROM_HOST = frozenset({"lift_fresh_copy", "scalar_tensor", "full", "fill_"})
_LIFTED = "aten::lift_fresh"  # torch.tensor(): an alias of a tensor made outside every mode

# in-place ops that overwrite their first argument without reading it
_OVERWRITES = frozenset({"copy_", "fill_", "zero_", "normal_", "uniform_", "random_", "bernoulli_",
                         "exponential_", "geometric_", "cauchy_", "log_normal_", "set_"})


@dataclasses.dataclass
class Event:
    """One op or launch. `reads`: keys read; `fresh`/`over`: keys whose whole storage it wrote
    (new, or overwritten); `partial`: keys it wrote only in part or after reading them. A launch
    has `kernel` set and `args` (parameter, key) for its tensor arguments instead, and, where
    changes were tracked, `changed`: (parameter, first byte, end byte) of each argument whose
    storage it changed (None: not tracked)."""
    name: str
    reads: list[int] = dataclasses.field(default_factory=list)
    fresh: list[int] = dataclasses.field(default_factory=list)
    over: list[int] = dataclasses.field(default_factory=list)
    partial: list[int] = dataclasses.field(default_factory=list)
    kernel: str | None = None
    args: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    changed: list[tuple[str, int, int]] | None = None

    def to_list(self) -> list:
        """The wire form (a log may hold tens of thousands of events)."""
        return [self.name, self.reads, self.fresh, self.over, self.partial, self.kernel, self.args, self.changed]

    @classmethod
    def from_list(cls, item) -> "Event":
        """An event from the runner's untrusted wire form; ValueError when it is malformed."""
        if not isinstance(item, list) or len(item) != 8:
            raise ValueError("malformed data-flow event")
        name, reads, fresh, over, partial, kernel, args, changed = item
        keys = [_ints(x) for x in (reads, fresh, over, partial)]
        pairs = [(str(p), int(k)) for p, k in args] if isinstance(args, list) else []
        spans = None if changed is None else [(str(p), int(lo), int(hi)) for p, lo, hi in changed]
        return cls(str(name), *keys, kernel=str(kernel) if kernel is not None else None, args=pairs, changed=spans)


def _ints(xs) -> list[int]:
    if not isinstance(xs, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in xs):
        raise ValueError("malformed data-flow keys")
    return xs


class Keys:
    """Storage keys of tensors, with the judge's arena split into one key per tensor."""

    def __init__(self, arena: torch.Tensor | None = None):
        self.arena = (arena.data_ptr(), arena.data_ptr() + arena.numel()) if arena is not None else None

    def key(self, t: torch.Tensor) -> int:
        try:
            base = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # no storage of its own (sparse, nested): a value apart
            return id(t)
        if self.arena is not None and self.arena[0] <= base < self.arena[1]:
            return t.data_ptr()
        return base

    def whole(self, t: torch.Tensor) -> bool:
        """Whether `t` spans its whole storage (a write to it leaves nothing older there)."""
        st = t.untyped_storage()
        return t.storage_offset() == 0 and t.numel() * t.element_size() >= st.nbytes() and t.is_contiguous()


def _mutated(func, args, kwargs) -> list[tuple[torch.Tensor, bool]]:
    """(tensor, is an out= argument) for each argument the op's schema marks as written."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = kwargs.get(arg.name) if arg.kwarg_only or arg.name in kwargs else (args[i] if i < len(args) else None)
        out += [(t, arg.kwarg_only) for t in tensors(value)]
    return out


# what Triton's interpreter does to a launch's arguments: host views of their storages, and storage
# copies there and back (bytes to bytes); a compiled launch runs no torch op at all
_MOVES = frozenset({"aten::empty", "aten::new_empty", "aten::set_", "aten::detach", "aten::slice"})


def _argument_move(func, args) -> bool:
    """Whether an op run inside a launch is one of the interpreter's argument moves."""
    name = func._schema.name
    if name == "aten::copy_":
        return all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 for t in args[:2])
    return name in _MOVES


def _is_view(func) -> bool:
    """A view (its output shares its input's storage, nothing read or written): storages are keyed
    by base, so it changes no dependency and is not logged."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class FlowLog(TorchDispatchMode):
    """Logs every aten op run under it as an `Event`; `launch` adds a Triton launch in order."""

    def __init__(self, keys: Keys, watch: Callable[[], list[str]] | None = None):
        super().__init__()
        self.keys = keys
        self.events: list[Event] = []
        self.truncated = False
        self.paused = 0  # inside a launch (Triton's interpreter copies its arguments with torch ops)
        self.inside: list[str] = []  # ops inside a launch that are no such copy: torch's work credited to it
        self.watch = watch  # asked before every op: what differs from how the evaluator set things
        self.changed: list[str] = []  # its first answer that named something

    def _add(self, event: Event) -> None:
        if len(self.events) >= MAX_EVENTS:
            self.truncated = True
            return
        self.events.append(event)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.watch is not None and not self.changed:
            self.changed = self.watch()
        out = func(*args, **kwargs)
        if self.paused:
            if not _argument_move(func, args):
                self.inside.append(func._schema.name)
            return out
        if func._schema.name == _LIFTED:  # its tensor was made from host values
            self._add(Event(name="lift_fresh", reads=[HOST], fresh=[self.keys.key(t) for t in tensors(out)]))
        elif not _is_view(func):
            self._add(self._event(func, args, kwargs, out))
        return out

    def _event(self, func, args, kwargs, out) -> Event:
        name = func._schema.name.split("::")[-1]
        mutated = _mutated(func, args, kwargs)
        written = {id(t) for t, _ in mutated}
        inputs = [t for t in tensors([args, kwargs]) if id(t) not in written]
        ev = Event(name=name, reads=sorted({self.keys.key(t) for t in inputs}))
        for t, is_out in mutated:
            overwrite = is_out or name in _OVERWRITES
            key = self.keys.key(t)
            if overwrite and self.keys.whole(t):
                ev.over.append(key)
            else:
                ev.partial.append(key)
                if not overwrite:
                    ev.reads.append(key)
        if name == _HOST_READ:
            ev.partial.append(HOST)
        elif name in _FROM_HOST:
            ev.reads.append(HOST)
        known = set(ev.reads) | set(ev.over) | set(ev.partial)
        ev.fresh = sorted({k for k in (self.keys.key(t) for t in tensors(out)) if k not in known})
        return ev

    def host_read(self, name: str, t: torch.Tensor) -> None:
        if not self.paused:
            self._add(Event(name=name, reads=[self.keys.key(t)], partial=[HOST]))

    def launch(self, kernel: str, args: list[tuple[str, torch.Tensor]],
               changed: list[tuple[str, int, int]] | None = None) -> None:
        self._add(Event(name=kernel, kernel=kernel, args=[(p, self.keys.key(t)) for p, t in args], changed=changed))


class HostReads(TorchFunctionMode):
    """Beside a `FlowLog`: notes the host reads no dispatch mode sees (`_HOST_METHODS`)."""

    def __init__(self, flow: FlowLog):
        super().__init__()
        self.flow = flow

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = _HOST_METHODS.get(func)
        if name is not None and args and isinstance(args[0], torch.Tensor):
            self.flow.host_read(name, args[0])
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def unobserved() -> Iterator[None]:
    """Torch ops run inside are seen by no dispatch mode and no tensor subclass of the candidate's."""
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


def block_sums(t: torch.Tensor) -> torch.Tensor:
    """Two checksums per 4 KiB block of `t`'s whole storage, side by side: its 32-bit words summed,
    and summed weighted by their place in the block (values moved within a block, a sort or a
    reversal in place, change that one); the tail (and its last bytes) likewise. Taken without copying the
    storage: compared before and after a launch, they say whether and where it changed the storage.
    A write of the values already there changes none."""
    with unobserved():
        st = t.untyped_storage()
        nbytes = st.nbytes()
        raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (nbytes,), (1,))
        words = raw[: nbytes // 4 * 4].view(torch.int32)
        n = words.numel() // _BLOCK_WORDS * _BLOCK_WORDS
        blocks = words[:n].view(-1, _BLOCK_WORDS).split(_CHUNK_BLOCKS)  # products of one chunk at a time
        place = torch.arange(1, _BLOCK_WORDS + 1, dtype=torch.int32, device=t.device)
        sums = [torch.stack([b.sum(1, dtype=torch.int32), (b * place).sum(1, dtype=torch.int32)], 1).flatten()
                for b in blocks]
        tail = words[n:]
        plain = tail.sum(dtype=torch.int32) + raw[nbytes // 4 * 4:].sum(dtype=torch.int32)  # and the last bytes
        return torch.cat([*sums, plain.view(1), (tail * place[: tail.numel()]).sum(dtype=torch.int32).view(1)])


def changed_span(before: torch.Tensor, after: torch.Tensor, nbytes: int) -> tuple[int, int] | None:
    """(first byte, end byte) of the blocks whose checksums differ, or None."""
    with unobserved():
        idx = (before != after).nonzero().flatten().tolist()
    if not idx:
        return None
    block = _BLOCK_WORDS * 4  # two checksums a block (`block_sums`); the tail's two map to its last block
    return min(idx[0] // 2 * block, nbytes), min((idx[-1] // 2 + 1) * block, nbytes)


def needed_launches(events: list[Event], output_keys: list[int], stores: dict[str, frozenset[str]],
                    output_spans: dict[int, tuple[int, int]] | None = None) -> list[bool]:
    """For each launch event in order: whether the output depends on what it wrote. A launch of
    a kernel not in `stores` (not the candidate's own) may write any argument; one whose changes
    were tracked wrote only what it changed, and counts for an output it wrote directly only where
    its changes meet the output's bytes (`output_spans`: key -> first and end byte in its storage).
    Each storage's writers form a chain (a partial write keeps what the writer before it left), so
    the replay is linear in the log's length."""
    last: dict[int, int] = {}  # key -> the event that last wrote it
    before: dict[tuple[int, int], int] = {}  # (event, key) -> the writer whose content a partial write kept
    deps: list[set[int]] = []
    spans: dict[tuple[int, int], tuple[int, int]] = {}  # (event, key) -> the bytes a tracked launch changed there
    for i, ev in enumerate(events):
        reads = [k for _, k in ev.args] if ev.kernel is not None else ev.reads
        dep = {last[k] for k in reads if k in last}
        for k in ev.fresh + ev.over:
            last[k] = i
        for k in _written(ev, stores, i, spans):
            if last.get(k, i) != i:
                before[(i, k)] = last[k]
                dep.add(last[k])
            last[k] = i
        deps.append(dep)
    start = set()
    for k in output_keys:
        node = last.get(k)
        while node is not None and (node, k) in spans and not _meets(spans[(node, k)], (output_spans or {}).get(k)):
            node = before.get((node, k))  # its change missed the output: what was there before stands
        if node is not None:
            start.add(node)
    needed = _ancestors(deps, start)
    return [i in needed for i, ev in enumerate(events) if ev.kernel is not None]


def _written(ev: Event, stores: dict[str, frozenset[str]], i: int, spans: dict) -> list[int]:
    """The keys event `i` wrote; a tracked launch's changed byte ranges go into `spans`."""
    if ev.kernel is None:
        return ev.partial
    if ev.changed is None:  # not tracked: every argument its source may store through
        return [k for p, k in ev.args if ev.kernel not in stores or p in stores[ev.kernel]]
    keys = dict(ev.args)
    out = []
    for p, lo, hi in ev.changed:
        k = keys.get(p)
        if k is None:
            continue
        old = spans.get((i, k), (lo, hi))
        spans[(i, k)] = (min(old[0], lo), max(old[1], hi))
        out.append(k)
    return out


def _meets(a: tuple[int, int], b: tuple[int, int] | None) -> bool:
    return b is None or (a[0] < b[1] and b[0] < a[1])


def _ancestors(deps: list[set[int]], start: set[int]) -> set[int]:
    seen, todo = set(), list(start)
    while todo:
        i = todo.pop()
        if i not in seen:
            seen.add(i)
            todo.extend(deps[i])
    return seen
