"""What /proc says about a process: its state, parent, group, threads, memory and children.

Read by the sandbox's supervisor (limits) and by the judge (the runner stopped between requests,
how it died, what it left running). Every reader returns None or an empty list for a process that
is gone or unreadable, never raises.
"""

from __future__ import annotations

import dataclasses
import os

_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclasses.dataclass(frozen=True)
class Stat:
    """Fields of /proc/<pid>/stat (proc(5))."""
    state: str  # R running, S sleeping, T stopped, t traced, Z zombie, X dead, ...
    ppid: int
    pgrp: int
    threads: int
    rss_bytes: int
    exit_code: int  # the wait status, readable while the process is a zombie


def stat(pid: int, tid: int | None = None) -> Stat | None:
    path = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    rest = raw[raw.rfind(b")") + 2:].split()  # the command name may hold spaces and parentheses
    try:
        return Stat(state=rest[0].decode(), ppid=int(rest[1]), pgrp=int(rest[2]), threads=int(rest[17]),
                    rss_bytes=int(rest[21]) * _PAGE, exit_code=int(rest[49]))
    except (IndexError, ValueError):
        return None


def pids() -> list[int]:
    """Every process on the machine (as far as this process may see)."""
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def tids(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task") if t.isdigit()]
    except OSError:
        return []


def children(pid: int) -> list[int]:
    """Direct children of every thread of `pid`."""
    out = []
    for tid in tids(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                out += [int(c) for c in fh.read().split()]
        except (OSError, ValueError):
            continue
    return out


def descendants(pid: int) -> list[int]:
    out, todo = [], children(pid)
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(children(child))
    return out


def unnamed_file_bytes(pids: list[int]) -> int:
    """Bytes allocated to the files `pids` hold, open or mapped, that no name leads to any more
    (memfds, deleted files), each file once: a walk of the directories never sees them, and no RSS
    counts a mapped page never touched. A mapping is measured through /proc/<pid>/map_files,
    which needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE (root has them); without, mappings go
    unmeasured, and the runners' OOM score (`sandbox`) is what keeps the memory off the host."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for pid in pids:
        for path in _open_files(pid) + _mapped_unnamed_files(pid):
            try:
                st = os.stat(path)
            except OSError:
                continue
            if st.st_nlink == 0 and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def _open_files(pid: int) -> list[str]:
    try:
        return [f"/proc/{pid}/fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return []


def _mapped_unnamed_files(pid: int) -> list[str]:
    """/proc/<pid>/map_files paths of the mappings whose file has no name left (memfds read as
    deleted too), one per file (device and inode, as the maps line gives them): tens of thousands
    of mappings of one file would otherwise cost the supervisor a stat each, every poll."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    first: dict[tuple[bytes, bytes], bytes] = {}
    for line in lines:
        if line.endswith(b" (deleted)"):
            fields = line.split(None, 5)
            first.setdefault((fields[3], fields[4]), fields[0])
    return [f"/proc/{pid}/map_files/{address.decode()}" for address in first.values()]


def live_tasks(pid: int) -> list[Stat]:
    """/proc/<pid>/task/<tid>/stat of each thread of `pid` that has not exited. A process whose
    main thread exited while another runs reads as a zombie ("Z") in /proc/<pid>/stat: it is
    alive, and this is how to tell."""
    return [st for tid in tids(pid) if (st := stat(pid, tid)) is not None and st.state not in ("Z", "X")]


def alive(pid: int) -> bool:
    """Some thread of `pid` still runs (a zombie, or a process that is gone, has none)."""
    return bool(live_tasks(pid))


def stopped(pid: int) -> bool:
    """Every thread of `pid` is stopped (or the process is gone)."""
    for tid in tids(pid):
        st = stat(pid, tid)
        if st is not None and st.state not in ("T", "t", "Z", "X"):
            return False
    return True
