"""What crosses between the judge and the runner: framed JSON messages and one shared arena.

Messages are 8-byte big-endian length + UTF-8 JSON over a socket pair (the sandbox speaks the
same framing with its zygote, over pipes). The judge reads
whatever the runner sends as untrusted data: `recv` bounds the size and the time, and callers
validate every field (`number`). The files in a runner's directory are as untrusted: its
captured output is read only as a plain file (`read_output`).

Tensors never travel inside messages. The judge allocates one *arena* (a flat uint8 tensor)
that holds the input buffers and the output slots of one evaluation, and hands the runner a
handle to it once: a CUDA IPC handle on the GPU, a memory-mapped file in the runner's directory
on the CPU. Both sides carve the same typed views out of it from a `Layout`. On the GPU the arena
is one exclusive cudaMalloc segment (allocated right after `empty_cache`, at least 20 MiB and a
multiple of 2 MiB, so the caching allocator neither splits it nor places anything else in it):
an IPC handle exposes its whole segment, and nothing of the judge's own may live there.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import math
import os
import pickle
import select
import stat
import struct
import time
from typing import Any

_HEADER = struct.Struct(">Q")
MAX_MESSAGE = 32 * 2**20  # a few KB of numbers and names; a checked call's data-flow log up to ~16 MB
_ALIGN = 512
_MIN_ARENA = 20 * 2**20  # above the caching allocator's 10 MiB large-buffer threshold
_ROUND = 2 * 2**20


class ChannelClosed(Exception):
    """The other side closed the socket, sent garbage, or did not answer in time."""


class Malformed(ChannelClosed):
    """A frame that is not a JSON object: the runner's own sender never writes one."""


class Timeout(ChannelClosed):
    """No (whole) answer before the deadline."""


def send(fd: int, msg: dict) -> None:
    body = json.dumps(msg).encode()
    data = memoryview(_HEADER.pack(len(body)) + body)
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _read(fd: int, n: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise Timeout("no answer in time")
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise ChannelClosed("the other side closed the channel")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv(fd: int, deadline: float | None = None, limit: int = MAX_MESSAGE) -> dict:
    """One message as a dict; `ChannelClosed` on EOF or oversize (`limit` bytes), `Malformed` on
    anything but a JSON object, `Timeout` past `deadline` (monotonic)."""
    (size,) = _HEADER.unpack(_read(fd, _HEADER.size, deadline))
    if size > limit:
        raise ChannelClosed(f"message of {size} bytes (limit {limit})")
    data = _read(fd, size, deadline)
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError) as exc:  # nesting deeper than the parser's stack is garbage too
        raise Malformed(f"malformed message: {type(exc).__name__}") from None
    if not isinstance(msg, dict):
        raise Malformed("malformed message: not an object")
    return msg


def number(msg: dict, key: str, default: float | None = None) -> float | None:
    """A finite, non-negative float field of an untrusted message, else `default`."""
    v = msg.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return default
    v = float(v)
    return v if math.isfinite(v) and v >= 0 else default


# --------------------------------------------------------------------------------------
# Files a runner's directory holds
# --------------------------------------------------------------------------------------

def read_output(path: str, max_chars: int) -> str:
    """Head + tail of a captured stream, with a marker saying how much was dropped. The file lies
    where candidate code can replace it: anything but a plain file of one link (a FIFO would block
    the reader, a symlink or hard link would read another file into the result) reads as empty."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                return ""
            size = st.st_size
            if size <= max_chars:
                return fh.read(max_chars).decode("utf-8", "replace")
            head = fh.read(max_chars // 2)
            fh.seek(size - (max_chars - max_chars // 2))
            tail = fh.read(max_chars)
    except OSError:
        return ""
    dropped = size - len(head) - len(tail)
    return (head.decode("utf-8", "replace") + f"\n[... {dropped} chars truncated ...]\n"
            + tail.decode("utf-8", "replace"))


def remove_tree(top: str) -> bool:
    """Delete `top` and everything under it; whether it is gone. Never raises, never recurses: a
    runner's directory may nest deeper than Python's stack (`shutil.rmtree` raises RecursionError)
    or than a path may be long, and hold directories its candidate made unreadable. Each pass
    moves what lies two levels down up into `top`, so no path is longer than two names below it."""
    with contextlib.suppress(OSError):
        while _flatten(top):
            pass
        os.rmdir(top)
    return not os.path.lexists(top)


def _flatten(top: str) -> bool:
    """One pass of `remove_tree`: the files in `top` deleted, each directory's entries moved up
    into `top` (under random names) and the emptied directory deleted. Whether any was moved."""
    os.chmod(top, 0o700)  # a candidate may have taken its own rights away: it cannot take ours
    moved = False
    with os.scandir(top) as it:
        entries = list(it)
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            os.unlink(entry.path)
            continue
        os.chmod(entry.path, 0o700)
        for name in os.listdir(entry.path):
            os.rename(os.path.join(entry.path, name), os.path.join(top, f".drk_rm_{os.urandom(8).hex()}"))
            moved = True
        os.rmdir(entry.path)
    return moved


ESCAPED = 0  # `kill_note`'s pid for processes that left their runner (no process has pid 0)


def kill_note(runner_dir: str, runner_pid: int) -> str:
    """The file the supervisor leaves in the job's directory (out of every runner's reach) saying
    why it killed that runner alone (or, for `ESCAPED`, processes that had left their runner)."""
    return os.path.join(os.path.dirname(runner_dir), f"killed_{runner_pid}")


# --------------------------------------------------------------------------------------
# The shared arena
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class Slot:
    """One typed view into the arena."""
    offset: int
    dtype: str  # e.g. "torch.float32"
    shape: list[int]
    nbytes: int


@dataclasses.dataclass
class Layout:
    """Where each input tensor and each output tensor lives in the arena.

    `inputs[i]` is a Slot for a tensor input or None for a non-tensor one, whose JSON value is
    `input_values[i]`; `outputs` are the reference output's tensors in `_tensors` order."""
    nbytes: int
    inputs: list[Slot | None]
    input_values: list[Any]
    outputs: list[Slot]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        return cls(nbytes=int(d["nbytes"]), input_values=list(d["input_values"]),
                   inputs=[Slot(**s) if s else None for s in d["inputs"]],
                   outputs=[Slot(**s) for s in d["outputs"]])


def _dtype(name: str):
    import torch
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"not a dtype: {name}")
    return dt


def plan(inputs: list, outputs: list) -> Layout:
    """Lay out tensors (inputs may hold non-tensor values) one after another, aligned."""
    import torch
    off, ins, outs = 0, [], []
    for t in inputs:
        s = None
        if isinstance(t, torch.Tensor):
            s, off = _slot(t, off)
        ins.append(s)
    for t in outputs:
        s, off = _slot(t, off)
        outs.append(s)
    values = [None if isinstance(t, torch.Tensor) else t for t in inputs]
    return Layout(nbytes=max(off, _ALIGN), inputs=ins, input_values=values, outputs=outs)


def _slot(t, off: int) -> tuple[Slot, int]:
    """Tensor `t`'s slot at offset `off`, and the aligned offset after it."""
    nb = t.numel() * t.element_size()
    return Slot(offset=off, dtype=str(t.dtype), shape=list(t.shape), nbytes=nb), off + -(-max(nb, 1) // _ALIGN) * _ALIGN


def view(arena, s: Slot):
    """The typed tensor of slot `s` inside `arena` (flat uint8)."""
    return arena[s.offset:s.offset + s.nbytes].view(_dtype(s.dtype)).view(s.shape)


def allocate(layout: Layout, device, directory: str):
    """The judge's arena, and the handle (JSON-safe) that lets the runner map it."""
    import torch
    if device.type == "cuda":
        torch.cuda.empty_cache()  # no cached block may be split for the arena
        size = -(-max(layout.nbytes, _MIN_ARENA) // _ROUND) * _ROUND
        arena = torch.empty(size, dtype=torch.uint8, device=device)
        from torch.multiprocessing.reductions import reduce_tensor
        _, args = reduce_tensor(arena)
        return arena, {"cuda": base64.b64encode(pickle.dumps(args)).decode()}
    path = os.path.join(directory, "arena.bin")
    with open(path, "wb") as fh:
        # every block reserved now: on a full disk this raises ENOSPC here, where a sparse file
        # would fault (SIGBUS) the first process that writes a page of it
        os.posix_fallocate(fh.fileno(), 0, layout.nbytes)
    arena = torch.from_file(path, shared=True, size=layout.nbytes, dtype=torch.uint8)
    return arena, {"path": path, "nbytes": layout.nbytes}


def attach(handle: dict):
    """The runner's mapping of the judge's arena. (The runner trusts the judge; never the reverse.)"""
    import torch
    if "cuda" in handle:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor
        return rebuild_cuda_tensor(*pickle.loads(base64.b64decode(handle["cuda"])))
    return torch.from_file(handle["path"], shared=True, size=int(handle["nbytes"]), dtype=torch.uint8)
