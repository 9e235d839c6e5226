"""Run a function in a forked child that can never take the parent down.

Why a fork server: the trainer holds a CUDA context and a lot of memory. Forking it would
hand untrusted kernels a copy of that context (CUDA does not survive fork) and a cold
``subprocess`` per job would pay ``import torch`` (seconds) every time. So a *zygote* is
started once with fork+exec (``python -m drkernel.sandbox --zygote``): it imports torch
and triton (which does not initialise CUDA), then forks one short-lived child per job.

Pieces:

* ``ForkServer`` -- owns one zygote; ``run("pkg.mod:fn", kwargs, limits)`` returns a
  ``SandboxResult``. The zygote is restarted transparently if it dies.
* ``SandboxPool`` -- several ForkServers (e.g. one per GPU) with an ordered ``map``.

Protocol (parent <-> zygote): 8-byte big-endian length + UTF-8 JSON, over the zygote's
stdin/stdout, which the zygote moves to private descriptors at start so that stray prints
cannot corrupt the stream. Per job the zygote answers ``started`` (child pid) and then
``result``. The child never talks on the pipe: it writes its return value (JSON) to a file
in its private temp dir, so a dying child can at worst leave no file.

Supervision happens in the zygote (single-threaded; it forks only from its main thread):
wall-clock timeout, RSS of every process of the job, the number of those processes and of their
threads.
The job's processes are the child's process group plus every descendant of the zygote
(the zygote is a child subreaper, so grandchildren that ``setsid`` or are orphaned still
count). Everything is killed with SIGKILL when the job ends.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import importlib
import json
import os
import queue
import resource
import select
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback as _traceback
import weakref
from typing import Any, Callable, Union

from drkernel import ipc, procfs
from drkernel.ipc import ESCAPED, kill_note, read_output

STATUSES = ("ok", "exception", "timeout", "signal", "exit_no_result", "oom", "oversized_result",
            "sandbox_error")

Target = Union[str, Callable[..., Any]]  # what a job runs: a module-level function or its "pkg.mod:fn"
DEFAULT_PRELOAD = ("torch", "triton")  # what a zygote imports once, before it forks any job
_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_POLL_S = 0.05
_DISK_CHECK_S = 0.5  # how often the runners' directories are measured
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


# ======================================================================================
# Public data types
# ======================================================================================

@dataclasses.dataclass
class SandboxLimits:
    """Per-job limits. ``address_space_mb`` (RLIMIT_AS) is off by default: CUDA reserves huge
    virtual ranges and fails under it; RSS is policed by the watchdog instead."""

    timeout_s: float = 120.0
    cpu_time_s: float | None = None  # None: 2 x timeout, at least 10 s
    max_rss_mb: int = 32768
    max_file_mb: int = 1024
    max_disk_mb: int = 16384  # all files under one runner's directory (its Triton cache included)
    max_open_files: int = 1024
    max_procs: int = 64
    max_threads: int = 1024  # over all the job's processes (torch starts one per core in each)
    max_output_chars: int = 20000
    max_result_bytes: int = 32 * 2**20
    address_space_mb: int | None = None

    def cpu_limit(self) -> int:
        cpu = self.cpu_time_s if self.cpu_time_s is not None else max(10.0, 2.0 * self.timeout_s)
        return max(1, int(cpu + 0.999))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class SandboxResult:
    """How one job ended. ``status`` is one of ``STATUSES``; ``value`` is set only for ``ok``."""

    status: str
    value: Any = None
    error: str | None = None
    traceback: str | None = None
    stdout: str = ""
    stderr: str = ""
    exitcode: int | None = None
    signal: int | None = None
    wall_s: float = 0.0
    peak_rss_mb: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _as_limits(limits: SandboxLimits | dict | None) -> SandboxLimits:
    if limits is None:
        return SandboxLimits()
    if isinstance(limits, dict):
        return SandboxLimits(**limits)
    return limits


# ======================================================================================
# Messages with the zygote (drkernel.ipc's framing)
# ======================================================================================

_send = ipc.send


def _recv(fd: int, deadline: float | None = None) -> dict | None:
    """One message; None when the other side closed the pipe or sent garbage, TimeoutError past
    `deadline` (monotonic). Results can be as large as `SandboxLimits.max_result_bytes`."""
    try:
        return ipc.recv(fd, deadline, limit=1 << 40)
    except ipc.Timeout:
        raise TimeoutError("no answer from the zygote") from None
    except ipc.ChannelClosed:
        return None


# ======================================================================================
# Process inspection (zygote side)
# ======================================================================================

def _proc_table() -> dict[int, procfs.Stat]:
    """pid -> /proc/<pid>/stat for every process."""
    return {pid: st for pid in procfs.pids() if (st := procfs.stat(pid)) is not None}


def _job_processes(root: int, pgid: int) -> dict[int, procfs.Stat]:
    """Processes of the running job: the job's process group and all descendants of ``root``
    (the zygote, which is a subreaper), minus the zygote itself."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, st in table.items():
        children.setdefault(st.ppid, []).append(pid)
    found = {pid for pid, st in table.items() if st.pgrp == pgid}
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found.add(pid)
        stack.extend(children.get(pid, []))
    found.discard(root)
    return {pid: table[pid] for pid in found if pid in table}


def _signal_job(root: int, pgid: int) -> dict:
    """SIGKILL the job's group and every live descendant once (no reaping). Returns what was seen."""
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)
    procs = _job_processes(root, pgid)
    for pid in procs:  # zombies too: one whose main thread exited may still run others
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return procs


def _kill_job(root: int, pgid: int) -> None:
    """After the child was reaped: kill and reap every leftover until none is seen."""
    for _ in range(200):
        procs = _signal_job(root, pgid)
        _reap_all()
        if not procs:
            return
        time.sleep(0.005)


def _reap_all() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _prctl(option: int, arg: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, arg, 0, 0, 0) == 0
    except Exception:
        return False


# ======================================================================================
# The child (runs in the forked process; never returns)
# ======================================================================================

def _set_limit(kind: int, value: int) -> None:
    """Set soft = hard = value, never above the current hard limit (raising it needs privileges)."""
    hard = resource.getrlimit(kind)[1]
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(kind, (value, value))


_OOM_SCORE_ADJ = 1000  # the most: chosen before every process with a lower score


def _apply_limits(lim: SandboxLimits) -> None:
    cpu = lim.cpu_limit()
    soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    cpu_hard = cpu + 5 if hard == resource.RLIM_INFINITY else min(cpu + 5, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (min(cpu, cpu_hard), cpu_hard))  # SIGXCPU, then SIGKILL
    _set_limit(resource.RLIMIT_FSIZE, int(lim.max_file_mb) * 2**20)
    _set_limit(resource.RLIMIT_NOFILE, int(lim.max_open_files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if lim.address_space_mb:
        _set_limit(resource.RLIMIT_AS, int(lim.address_space_mb) * 2**20)
    _first_to_kill()


def _first_to_kill() -> None:
    """The kernel's OOM killer takes this process before any outside a sandbox. Memory no limit
    here sees (a memfd or deleted file kept only by a mapping, where /proc/<pid>/map_files is not
    readable; descriptors in flight over a socket) would otherwise make it kill the biggest
    process on the host: the trainer. Raising one's own score needs no privilege."""
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as fh:
        fh.write(str(_OOM_SCORE_ADJ))


def _short_error(exc: BaseException) -> str:
    try:
        msg = str(exc)
    except Exception:
        msg = "<unprintable message>"
    return f"{type(exc).__name__}: {msg}"[:2000]


def _format_tb(exc: BaseException) -> str:
    try:
        return "".join(_traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:]
    except Exception:
        return ""


def _write_result(path: str, payload: dict, max_bytes: int) -> None:
    """Write atomically (tmp + rename) so that a half-written file is never read as a result."""
    data = json.dumps(payload).encode()
    if len(data) > max_bytes:
        data = json.dumps({"__oversized__": len(data)}).encode()
    tmp = path + ".part"
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def _child_main(job: dict, workdir: str, result_path: str, pipe_fds: tuple[int, int]) -> None:
    """Set the child up, call the target, write the result file, ``os._exit``.
    SystemExit is deliberately *not* a result: the job ends as ``exit_no_result``."""
    code = 0
    try:
        lim = _enter_job(job, workdir, pipe_fds)
        code, payload = _call_target(job)
        if payload is not None:
            try:
                _write_result(result_path, payload, lim.max_result_bytes)
            except MemoryError:
                _write_result(result_path, {"__exception__": "MemoryError", "traceback": "", "oom": True},
                              lim.max_result_bytes)
    except BaseException:
        code = 70  # our own setup failed; no result file means exit_no_result
        with contextlib.suppress(BaseException):
            _traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code & 0xFF)


def _enter_job(job: dict, workdir: str, pipe_fds: tuple[int, int]) -> SandboxLimits:
    """The child's own session, output files, limits, environment and working directory."""
    for fd in pipe_fds:  # untrusted code must not reach the zygote's pipe
        with contextlib.suppress(OSError):
            os.close(fd)
    os.setsid()
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        out = os.open(os.path.join(workdir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, fd)
        os.close(out)
    lim = SandboxLimits(**job["limits"])
    _apply_limits(lim)
    os.environ["TMPDIR"] = workdir
    tempfile.tempdir = workdir
    for key, val in (job.get("env") or {}).items():
        os.environ[str(key)] = str(val)
        if key == "PYTHONPATH":  # sys.path was fixed at zygote start; honour it here too
            sys.path[:0] = [p for p in str(val).split(os.pathsep) if p]
    os.chdir(job.get("cwd") or workdir)
    if job.get("cwd"):
        sys.path.insert(0, job["cwd"])
    importlib.invalidate_caches()
    return lim


def _call_target(job: dict) -> tuple[int, dict | None]:
    """(exit code, the result file's payload; None: write none) of the job's function."""
    try:
        module_name, func_name = job["target"].split(":", 1)
        value = getattr(importlib.import_module(module_name), func_name)(**job["kwargs"])
        try:
            payload = {"value": value}
            json.dumps(payload)
        except (TypeError, ValueError, RecursionError) as exc:
            payload = {"__exception__": "return value is not JSON-serialisable: " + _short_error(exc), "traceback": ""}
        return 0, payload
    except SystemExit as exc:
        if not isinstance(exc.code, (int, type(None))):
            with contextlib.suppress(BaseException):
                print(exc.code, file=sys.stderr)
        return (exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)), None
    except MemoryError as exc:
        return 0, {"__exception__": _short_error(exc), "traceback": _format_tb(exc), "oom": True}
    except BaseException as exc:
        return 0, {"__exception__": _short_error(exc), "traceback": _format_tb(exc)}


# ======================================================================================
# The zygote
# ======================================================================================

def _supervise(pid: int, lim: SandboxLimits, t0: float,
               runners: list[tuple[str, int]]) -> tuple[int, str | None, float]:
    """Wait for the child while policing time, memory, disk, processes and threads. Over a limit,
    the process tree that holds the most besides the child's (a runner's, or those re-parented to
    the zygote) is killed alone and the child goes on with the job's other runners; only when the
    child's own tree is over the limit does the whole job end (`_police`). A runner whose directory
    outgrows `max_disk_mb` is killed alone. Returns (wait status, kill reason or None, peak RSS in MB)."""
    root = os.getpid()
    parent = os.getppid()
    pidfd = None
    with contextlib.suppress(Exception):
        pidfd = os.pidfd_open(pid)
    deadline = t0 + lim.timeout_s
    reason, peak, wait, disk_checked = None, 0.0, 0.002, 0.0
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done == pid:
                return status, reason, peak
            if reason is None:
                trees, over = _police(root, pid, runners, lim)
                peak = max(peak, sum(t.rss_bytes for t in trees.values()) / 2**20)
                if time.monotonic() > deadline:
                    reason = "timeout"
                elif os.getppid() != parent:  # the trainer is gone: stop everything
                    reason = "orphaned"
                else:
                    reason = over
            if reason is None and time.monotonic() - disk_checked > _DISK_CHECK_S:
                disk_checked = time.monotonic()
                _kill_runners_over_disk(runners, lim.max_disk_mb)
            if reason is not None:
                _signal_job(root, pid)  # again each round: a fork bomb may still be spawning
            if pidfd is not None:
                select.select([pidfd], [], [], _POLL_S)
            else:
                time.sleep(wait)
                wait = min(_POLL_S, wait * 2)
    finally:
        if pidfd is not None:
            os.close(pidfd)


@dataclasses.dataclass
class _Tree:
    """The processes that descend from one child of the zygote, and what they hold."""
    pids: list[int] = dataclasses.field(default_factory=list)
    procs: int = 0  # zombies included: each holds a pid until reaped
    threads: int = 0
    rss_bytes: int = 0

    def add(self, other: "_Tree") -> None:
        self.pids += other.pids
        self.procs, self.threads = self.procs + other.procs, self.threads + other.threads
        self.rss_bytes += other.rss_bytes


# (limit, its unit, the _Tree field it bounds, the reason that ends the whole job, why a tree is killed)
_LIMITS = (("max_rss_mb", 2**20, "rss_bytes", "oom", "it used more memory than the job allows"),
           ("max_procs", 1, "procs", "procs", "it started more processes than the job allows"),
           ("max_threads", 1, "threads", "threads", "it started more threads than the job allows"))


def _police(root: int, child: int, runners: list[tuple[str, int]],
            lim: SandboxLimits) -> tuple[dict[int, _Tree], str | None]:
    """The job's process trees (by the zygote's child each descends from; every process that left
    its runner, re-parented to the zygote, under `ESCAPED`), after reaping the dead re-parented
    to the zygote, and the reason to end the whole job, if any. Over a limit, the heaviest tree
    besides the child's is killed here (the next round sees it gone); only when the child's own
    tree is over the limit alone does the whole job end."""
    table = _job_processes(root, child)
    known = {child, *(p for _, p in runners)}
    for pid, st in list(table.items()):
        if st.ppid == root and pid not in known and st.state == "Z" and not procfs.alive(pid):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    del table[pid]
    trees = _trees(table, root, known)
    for limit, unit, field, reason, why in _LIMITS:
        cap = getattr(lim, limit) * unit
        if sum(getattr(t, field) for t in trees.values()) > cap:
            heaviest = _heaviest(trees, field, child)
            if heaviest is None or getattr(trees.get(child, _Tree()), field) > cap:
                return trees, reason
            _kill_tree(trees[heaviest], heaviest, runners, why)
            break  # the next round measures again without it
    return trees, None


def _heaviest(trees: dict[int, _Tree], field: str, child: int) -> int | None:
    """The head of the tree holding the most of `field` besides the child's, among those that still
    run a thread (a dead runner's zombie is nothing to kill); None when none holds any."""
    most, head = max(((getattr(t, field), h) for h, t in trees.items() if h != child and t.threads),
                     default=(0, None))
    return head if most > 0 else None


def _trees(table: dict[int, procfs.Stat], root: int, known: set[int]) -> dict[int, _Tree]:
    """The processes of `table` grouped by the child of `root` (the zygote) they descend from;
    those under a head that is not `known` (the child, the runners) under `ESCAPED`. A process
    whose parent is outside the table heads its own tree; one that reads as a zombie counts the
    threads it still runs."""
    head: dict[int, int] = {}
    for start in table:
        chain, pid = [], start
        while pid not in head:
            chain.append(pid)
            parent = table[pid].ppid
            if parent == root or parent not in table or parent in chain:  # a cycle: a pid reused mid-read
                head[pid] = pid if pid in known else ESCAPED
                break
            pid = parent
        for p in chain:
            head[p] = head[pid]
    trees: dict[int, _Tree] = {}
    for pid, st in table.items():
        trees.setdefault(head[pid], _Tree()).add(_holding(pid, st))
    return trees


def _holding(pid: int, st: procfs.Stat) -> _Tree:
    """What one process holds: its pid, and the threads and memory of those of its threads that run."""
    if st.state not in ("Z", "X"):
        return _Tree(pids=[pid], procs=1, threads=st.threads, rss_bytes=st.rss_bytes)
    live = procfs.live_tasks(pid)
    return _Tree(pids=[pid], procs=1, threads=len(live), rss_bytes=live[0].rss_bytes if live else 0)


def _kill_tree(tree: _Tree, head: int, runners: list[tuple[str, int]], why: str) -> None:
    """Kill a process tree. A runner's gets a note saying `why`; processes that left their runner
    leave one for whichever candidate's turn it is (`kill_note(..., ESCAPED)`)."""
    runner_dir = dict((pid, d) for d, pid in runners).get(head)
    if runner_dir is not None:
        _kill_runner(runner_dir, head, why)
    elif head == ESCAPED and runners and (live := [p for p in tree.pids if procfs.alive(p)]):
        with contextlib.suppress(OSError), open(kill_note(runners[0][0], ESCAPED), "w") as fh:
            fh.write(f"{len(live)} process(es) that left the candidate's runner: {why}")
    for pid in tree.pids:  # members that left the runner's group too
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _kill_runner(runner_dir: str, group: int, why: str) -> None:
    """SIGKILL a runner's process group, leaving the judge a note that says why."""
    with contextlib.suppress(OSError), open(kill_note(runner_dir, group), "w") as fh:
        fh.write(why)
    with contextlib.suppress(OSError):
        os.killpg(group, signal.SIGKILL)


def _kill_runners_over_disk(runners: list[tuple[str, int]], limit_mb: int) -> None:
    """A runner whose files (those in its directory, and those its processes hold open with no name
    left: deleted files, memfds) take more than `limit_mb` is killed."""
    for runner_dir, runner_pid in runners:
        if os.path.exists(kill_note(runner_dir, runner_pid)):
            continue
        unnamed = procfs.unnamed_file_bytes([runner_pid, *procfs.descendants(runner_pid)]) / 2**20
        if _disk_mb(runner_dir) + unnamed > limit_mb:
            _kill_runner(runner_dir, runner_pid, f"its files took more than {limit_mb} MB or could not be measured")


def _disk_mb(top: str, max_entries: int = 20000) -> float:
    """MB of disk under `top` (allocated blocks, so a sparse or preallocated file counts as it
    is), walked with a stack, never recursing; a tree of more than `max_entries` files, or with a
    directory that cannot be read (nested past the longest path, made unreadable), counts as over
    any limit: what it holds is unknown."""
    total, seen, todo = 0, 0, [top]
    while todo:
        try:
            with os.scandir(todo.pop()) as it:
                for entry in it:
                    seen += 1
                    if seen > max_entries:
                        return float("inf")
                    size, is_dir = _entry_size(entry)
                    total += size
                    if is_dir:
                        todo.append(entry.path)
        except FileNotFoundError:  # deleted meanwhile: a temporary directory, or its turn ended
            continue
        except OSError:
            return float("inf")
    return total / 2**20


def _entry_size(entry: os.DirEntry) -> tuple[int, bool]:
    """(bytes allocated, is a directory) of one entry; (0, False) once it is deleted."""
    try:
        st = entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return 0, False
    return st.st_blocks * 512, stat.S_ISDIR(st.st_mode)


def _classify(status: int, reason: str | None, result_path: str, lim: SandboxLimits) -> dict:
    out: dict[str, Any] = {"exitcode": None, "signal": None}
    if os.WIFSIGNALED(status):
        out["signal"] = os.WTERMSIG(status)
    elif os.WIFEXITED(status):
        out["exitcode"] = os.WEXITSTATUS(status)
    if reason == "timeout":
        return {**out, "status": "timeout", "error": f"wall-clock timeout after {lim.timeout_s:g} s"}
    if reason == "oom":
        return {**out, "status": "oom", "error": f"memory over {lim.max_rss_mb} MB (RSS of the job)"}
    if reason == "procs":
        return {**out, "status": "exception", "error": f"too many processes (more than {lim.max_procs})"}
    if reason == "threads":
        return {**out, "status": "exception", "error": f"too many threads (more than {lim.max_threads})"}
    if reason == "orphaned":
        return {**out, "status": "sandbox_error", "error": "the parent process went away"}
    if out["signal"] is not None:
        sig = out["signal"]
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        if sig == signal.SIGXCPU:
            return {**out, "status": "timeout", "error": f"CPU time limit ({lim.cpu_limit()} s) exceeded (SIGXCPU)"}
        if sig == signal.SIGXFSZ:
            return {**out, "status": "signal", "error": f"file size limit ({lim.max_file_mb} MB) exceeded (SIGXFSZ)"}
        return {**out, "status": "signal", "error": f"killed by {name}"}
    if not os.path.exists(result_path):
        return {**out, "status": "exit_no_result",
                "error": f"the process exited (code {out['exitcode']}) without writing a result"}
    size = os.path.getsize(result_path)
    if size > lim.max_result_bytes:
        return {**out, "status": "oversized_result", "error": f"result is {size} bytes (> {lim.max_result_bytes})"}
    try:
        with open(result_path, "rb") as fh:
            payload = json.loads(fh.read())
    except (OSError, ValueError) as exc:
        return {**out, "status": "exit_no_result", "error": f"unreadable result file: {exc}"}
    if not isinstance(payload, dict):
        return {**out, "status": "exit_no_result", "error": "malformed result file"}
    if "__oversized__" in payload:
        return {**out, "status": "oversized_result",
                "error": f"result is {payload['__oversized__']} bytes (> {lim.max_result_bytes})"}
    if "__exception__" in payload:
        return {**out, "status": "oom" if payload.get("oom") else "exception",
                "error": str(payload["__exception__"]), "traceback": str(payload.get("traceback") or "")}
    if "value" not in payload:
        return {**out, "status": "exit_no_result", "error": "malformed result file"}
    return {**out, "status": "ok", "value": payload["value"]}


def target_name(target: Target) -> str:
    """"pkg.module:function" of a module-level function (the child imports it by that name)."""
    if callable(target):
        name = f"{target.__module__}:{target.__qualname__}"
    else:
        name = target
    if not isinstance(name, str) or ":" not in name or "<" in name:
        raise ValueError(f"target must be a module-level function or 'package.module:function', got {target!r}")
    return name


def _fork_runners(job: dict, workdir: str, pipe_fds: tuple[int, int]) -> list[socket.socket]:
    """Fork the job's runners (each gets one end of a socket pair, the judge the other) before the
    judge's result path exists, so that not even a copy of it is in their memory. A runner keeps
    no end of another runner's socket."""
    mine: list[socket.socket] = []
    fds, pids, dirs = [], [], []
    for k, target in enumerate(job.get("runners") or []):
        runner_dir = os.path.join(workdir, f"runner{k}")
        os.mkdir(runner_dir, 0o700)
        judge_end, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            for sock in (*mine, judge_end):
                sock.close()
            _child_main({**job, "target": target, "kwargs": {"sock_fd": theirs.fileno(), "job_dir": runner_dir}},
                        runner_dir, os.path.join(runner_dir, ".unused"), pipe_fds)
        theirs.close()
        mine.append(judge_end)
        fds.append(judge_end.fileno())
        pids.append(pid)
        dirs.append(runner_dir)
    if mine:
        job["kwargs"] = {**job["kwargs"], "runner_fds": fds, "runner_pids": pids, "runner_dirs": dirs}
    return mine


def _zygote_job(job: dict, pipe_fds: tuple[int, int]) -> dict:
    lim = SandboxLimits(**job["limits"])
    workdir = tempfile.mkdtemp(prefix="drk_job_")
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    t0 = time.monotonic()
    socks = _fork_runners(job, workdir, pipe_fds)
    result_path = os.path.join(workdir, f".result-{os.urandom(8).hex()}.json")
    pid = os.fork()
    if pid == 0:
        _child_main(job, workdir, result_path, pipe_fds)  # never returns
    for sock in socks:
        sock.close()
    try:
        _send(pipe_fds[1], {"op": "started", "pid": pid, "workdir": workdir})
        kw = job.get("kwargs") or {}
        status, reason, peak = _supervise(pid, lim, t0, list(zip(kw.get("runner_dirs", []), kw.get("runner_pids", []))))
        wall = time.monotonic() - t0
        _kill_job(os.getpid(), pid)  # leftovers: grandchildren, daemons
        res = _classify(status, reason, result_path, lim)
        res["wall_s"] = wall
        res["peak_rss_mb"] = round(peak, 1)
        res["stdout"] = read_output(os.path.join(workdir, "stdout"), lim.max_output_chars)
        res["stderr"] = read_output(os.path.join(workdir, "stderr"), lim.max_output_chars)
        return res
    finally:
        ipc.remove_tree(workdir)  # never raises: a tree it cannot delete must not cost the job its answer


# What of the caller's environment the fork server, and so every job and its candidate code, gets:
# what Python, the C compiler, CUDA, Triton and torch read; never the rest (API keys, tokens).
_ENV_NAMES = frozenset({"PATH", "HOME", "USER", "LOGNAME", "LANG", "TZ", "TMPDIR", "TERM", "CC", "CXX",
                        "VIRTUAL_ENV", "CONDA_PREFIX", "LIBRARY_PATH", "CPATH", "C_INCLUDE_PATH", "XDG_CACHE_HOME"})
_ENV_PREFIXES = ("PYTHON", "LC_", "LD_", "CUDA_", "NVIDIA_", "TRITON_", "TORCH_", "TORCHINDUCTOR_", "PYTORCH_", "OMP_",
                 "MKL_", "KMP_", "OPENBLAS_", "CUBLAS_", "CUDNN_", "NCCL_", "HIP_", "ROCR_", "HSA_", "ROCM_")


def _inherited_environment(environ) -> dict[str, str]:
    """The variables of `environ` a sandbox inherits (`_ENV_NAMES`, `_ENV_PREFIXES`)."""
    return {k: v for k, v in environ.items() if k in _ENV_NAMES or k.startswith(_ENV_PREFIXES)}


def _zygote_main() -> None:
    """Entry of ``python -m drkernel.sandbox --zygote``: preload, then serve jobs until EOF."""
    rfd, wfd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)  # prints from imports go to the log, never into the protocol
    for extra in filter(None, os.environ.pop("DRKERNEL_SANDBOX_SYSPATH", "").split(os.pathsep)):
        if extra not in sys.path:
            sys.path.append(extra)
    if cores := os.environ.pop("DRKERNEL_SANDBOX_CORES", ""):  # before any thread: all inherit it
        with contextlib.suppress(OSError, ValueError):
            os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
    errors = {}
    for name in filter(None, os.environ.pop("DRKERNEL_SANDBOX_PRELOAD", "").split(",")):
        try:
            importlib.import_module(name)
        except Exception as exc:
            errors[name] = _short_error(exc)
    cuda_init = False
    if "torch" in sys.modules:
        with contextlib.suppress(Exception):
            cuda_init = bool(sys.modules["torch"].cuda.is_initialized())
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    _send(wfd, {"op": "ready", "pid": os.getpid(), "preload_errors": errors, "cuda_initialized": cuda_init,
                "threads": len(os.listdir("/proc/self/task"))})
    while True:
        msg = _recv(rfd)
        if msg is None or msg.get("op") == "exit":
            sys.stderr.flush()
            os._exit(0)  # no interpreter teardown: torch's and triton's exit hooks cost half a second
        if msg.get("op") == "ping":
            _send(wfd, {"op": "pong"})
            continue
        try:
            res = _zygote_job(msg, (rfd, wfd))
        except Exception as exc:
            res = {"status": "sandbox_error", "error": "zygote: " + _short_error(exc),
                   "traceback": _format_tb(exc)}
        res["op"] = "result"
        try:
            _send(wfd, res)
        except (TypeError, ValueError) as exc:  # e.g. NaN-free but odd values; never die here
            _send(wfd, {"op": "result", "status": "sandbox_error", "error": "zygote: " + _short_error(exc)})


# ======================================================================================
# Parent side
# ======================================================================================

_LIVE: "weakref.WeakSet[ForkServer]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.close(wait=False)


class ForkServer:
    """One zygote process and a lock: jobs on one ForkServer run one at a time.

    ``env`` is merged into the zygote's environment before it imports anything, so it is
    the place for TRITON_INTERPRET and CUDA_VISIBLE_DEVICES. The zygote can import what
    the parent can (the parent's sys.path is appended to its own, and the project root is
    on PYTHONPATH); ``PYTHONPATH`` in ``env`` (or a job's env) adds more directories.
    ``cores``: the CPU cores the zygote and every process of its jobs run on (None: any).
    """

    def __init__(self, env: dict | None = None, preload: tuple[str, ...] | list[str] = DEFAULT_PRELOAD,
                 start_timeout_s: float = 600.0, grace_s: float = 60.0, cores: frozenset[int] | None = None):
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.preload = tuple(preload)
        self.cores = cores
        self.start_timeout_s = start_timeout_s
        self.grace_s = grace_s  # how long past a job's timeout before the zygote is declared hung
        self.restarts = -1
        self.info: dict = {}
        self._proc: subprocess.Popen | None = None
        self._log: Any = None
        self._ready = False
        self._lock = threading.Lock()
        self._closed = False
        self._job_pgid: int | None = None
        self._start()
        _LIVE.add(self)

    # ---- lifecycle ---------------------------------------------------------------------

    def _start(self) -> None:
        self._stop()
        env = _inherited_environment(os.environ)
        env.update(self.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (self.env.get("PYTHONPATH"), _PROJECT_ROOT,
                                                        os.environ.get("PYTHONPATH")) if p)
        env["DRKERNEL_SANDBOX_PRELOAD"] = ",".join(self.preload)
        if self.cores:
            env["DRKERNEL_SANDBOX_CORES"] = ",".join(map(str, sorted(self.cores)))
        env["DRKERNEL_SANDBOX_SYSPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        self._log = tempfile.TemporaryFile(prefix="drk_zygote_")
        self._proc = subprocess.Popen([sys.executable, "-m", "drkernel.sandbox", "--zygote"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                      env=env, bufsize=0, start_new_session=True)
        self._ready = False
        self.restarts += 1

    def _wait_ready(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        msg = _recv(self._proc.stdout.fileno(), time.monotonic() + self.start_timeout_s)
        if msg is None or msg.get("op") != "ready":
            raise RuntimeError(f"sandbox zygote failed to start: {self._log_tail()}")
        self.info = msg
        self._ready = True

    def _ensure(self) -> None:
        if self._closed:
            raise RuntimeError("ForkServer is closed")
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        if not self._ready:
            self._wait_ready()

    def _log_tail(self, n: int = 2000) -> str:
        try:
            self._log.flush()
            self._log.seek(0, 2)
            size = self._log.tell()
            self._log.seek(max(0, size - n))
            return self._log.read().decode("utf-8", "replace")
        except Exception:
            return ""

    def _kill_job_group(self) -> None:
        if self._job_pgid is not None:
            with contextlib.suppress(OSError):
                os.killpg(self._job_pgid, signal.SIGKILL)
            self._job_pgid = None

    def _stop(self, wait: bool = True) -> None:
        proc, self._proc = self._proc, None
        self._ready = False
        if proc is not None:
            if proc.poll() is None and wait:
                with contextlib.suppress(Exception):
                    _send(proc.stdin.fileno(), {"op": "exit"})
                with contextlib.suppress(Exception):
                    proc.stdin.close()
                with contextlib.suppress(Exception):
                    proc.wait(timeout=2)
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    proc.kill()
                with contextlib.suppress(Exception):
                    proc.wait(timeout=5)
            for f in (proc.stdin, proc.stdout):
                with contextlib.suppress(Exception):
                    f.close()
        self._kill_job_group()
        if self._log is not None:
            with contextlib.suppress(Exception):
                self._log.close()
            self._log = None

    def close(self, wait: bool = True) -> None:
        """Stop the zygote. If a job is running in another thread, the zygote is killed."""
        self._closed = True
        if self._lock.acquire(blocking=False):
            try:
                self._stop(wait=wait)
            finally:
                self._lock.release()
        else:
            proc = self._proc
            if proc is not None:
                with contextlib.suppress(OSError):
                    proc.kill()
            self._kill_job_group()

    def __enter__(self) -> "ForkServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close(wait=False)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ---- jobs --------------------------------------------------------------------------

    def run(self, target: Target, kwargs: dict | None = None, limits: SandboxLimits | dict | None = None,
            env: dict | None = None, cwd: str | None = None, runners: list[Target] | None = None) -> SandboxResult:
        """Run ``target`` (a module-level function, or "pkg.module:function") as
        ``function(**kwargs)`` in a fresh child. With ``runners`` one more child per entry is forked
        first and called with ``sock_fd`` and ``job_dir`` (its own directory); the first child gets
        the lists ``runner_fds``, ``runner_pids`` and ``runner_dirs``. All belong to the job:
        limits, the kill at its end.
        Never raises for anything the children do; raises only for bad arguments."""
        lim = _as_limits(limits)
        job = {"op": "run", "target": target_name(target), "kwargs": dict(kwargs or {}), "limits": lim.to_dict(),
               "env": {str(k): str(v) for k, v in (env or {}).items()}, "cwd": cwd,
               "runners": [target_name(r) for r in runners or []]}
        json.dumps(job)  # TypeError here: kwargs must be JSON-serialisable
        t0 = time.monotonic()
        with self._lock:
            for attempt in (0, 1):
                try:
                    self._ensure()
                    return self._run_once(job, lim, t0)
                except _NotStarted as exc:  # the zygote was dead before the job began: retry once
                    self._stop(wait=False)
                    if attempt == 1:
                        return SandboxResult("sandbox_error", error=str(exc), wall_s=time.monotonic() - t0)
                except Exception as exc:
                    self._stop(wait=False)
                    return SandboxResult("sandbox_error", error=f"{_short_error(exc)} {self._log_tail(500)}".strip(),
                                         wall_s=time.monotonic() - t0)
        raise AssertionError("unreachable")

    def _run_once(self, job: dict, lim: SandboxLimits, t0: float) -> SandboxResult:
        assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
        try:
            _send(self._proc.stdin.fileno(), job)
        except OSError as exc:
            raise _NotStarted(f"zygote gone: {exc}") from exc
        rfd = self._proc.stdout.fileno()
        started = _recv(rfd, time.monotonic() + self.grace_s)
        if started is None:
            raise _NotStarted("zygote exited before starting the job")
        self._job_pgid = started.get("pid")
        deadline = time.monotonic() + lim.timeout_s + self.grace_s
        try:
            msg = _recv(rfd, deadline)
        except TimeoutError:
            msg = None
            why = "the zygote did not answer in time"
        else:
            why = "the zygote died during the job"
        if msg is None:
            tail = self._log_tail(500)
            self._stop(wait=False)
            ipc.remove_tree(started.get("workdir") or "")
            return SandboxResult("sandbox_error", error=f"{why}; {tail}".strip("; "), wall_s=time.monotonic() - t0)
        self._job_pgid = None
        fields = {f.name for f in dataclasses.fields(SandboxResult)}
        res = SandboxResult(**{k: v for k, v in msg.items() if k in fields})
        res.wall_s = float(msg.get("wall_s") or time.monotonic() - t0)
        return res


class _NotStarted(Exception):
    """The zygote failed before it accepted the job, so retrying cannot repeat the job."""


class SandboxPool:
    """Several ForkServers; ``run`` (safe to call from several threads) takes any free one.
    ``per_worker_env[i]`` is merged into worker i's env (e.g. to pin
    CUDA_VISIBLE_DEVICES per worker); ``cores`` are the CPU cores every worker runs on."""

    def __init__(self, workers: int = 1, env: dict | None = None, per_worker_env: list[dict] | None = None,
                 preload: tuple[str, ...] | list[str] = DEFAULT_PRELOAD, cores: frozenset[int] | None = None):
        self.workers = max(1, int(workers))
        self.closed = False
        self.servers: list[ForkServer] = []
        self._free: queue.Queue[ForkServer] = queue.Queue()
        for i in range(self.workers):
            wenv = dict(env or {})
            if per_worker_env:
                wenv.update(per_worker_env[i % len(per_worker_env)] or {})
            server = ForkServer(env=wenv, preload=preload, cores=cores)
            self.servers.append(server)
            self._free.put(server)

    def run(self, target: Target, kwargs: dict | None = None, limits: SandboxLimits | dict | None = None,
            env: dict | None = None, cwd: str | None = None, runners: list[Target] | None = None) -> SandboxResult:
        server = self._free.get()
        try:
            return server.run(target, kwargs, limits=limits, env=env, cwd=cwd, runners=runners)
        finally:
            self._free.put(server)

    def close(self) -> None:
        for server in self.servers:
            server.close()
        self.closed = True

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            for server in self.servers:
                server.close(wait=False)


if __name__ == "__main__":
    if sys.argv[1:] == ["--zygote"]:
        from drkernel.sandbox import _zygote_main as _main  # the importable copy, not __main__

        _main()
    else:
        sys.exit("usage: python -m drkernel.sandbox --zygote  (started by ForkServer)")
