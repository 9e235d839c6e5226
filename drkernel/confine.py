"""Confine the runner process on Linux before any candidate code is imported.

Layers, each recorded in a `Confinement` report (the judge copies it to
`EvalResult.details["confinement"]`):

- `enter_network_namespace()`, first thing in the runner: a new, empty network namespace, so
  that nothing on this machine's loopback or network can be reached.
- `restrict(job_dir)`, after CUDA, torch and triton are initialised (Landlock applied before the
  first CUDA allocation makes `cudaGetDeviceCount` fail with error 304) and the judge's arena is
  mapped:
  * a new System V IPC namespace: a shared-memory segment or semaphore the candidate makes dies
    with the runner's namespace instead of outliving the job, and no other job's can be reached;
  * no new privileges (`PR_SET_NO_NEW_PRIVS`);
  * Landlock: every kind of file-system write (write, truncate, create, remove, rename, link)
    only beneath `job_dir` (plus writing to /dev/null and the GPU's device nodes); no reading of
    the `hidden` directories (the temporary directory that holds every job's files, the device
    lock and memory-ledger files, /dev but for `devices()`), except the job's own directory and
    the Python path; TCP bind and
    connect denied (ABI >= 4); signals and abstract Unix sockets scoped to the runner's own
    domain (ABI >= 6). A Landlock domain also cannot ptrace processes outside it, so the judge's
    memory and descriptors (`/proc/<pid>/mem`, `/proc/<pid>/fd/*`) are out of reach;
  * every capability dropped (effective, permitted, inheritable, bounding set), so even as root
    the runner cannot ptrace, mount, change namespaces back or override file permissions;
  * a seccomp filter (all threads): the calls that set another process's resource limits,
    priority, scheduling, CPU set or I/O priority (`prlimit64`, `setpriority`, `sched_set*`,
    `ioprio_set`) are refused (EPERM) unless they name this process; Landlock does not cover
    them, and a runner could otherwise blind the judge (its open-file limit) or slow the
    reference and the other candidates of its job. Signals go only to this process or its own
    group (Landlock scopes them from ABI 6 only). `io_uring_setup` is refused outright (a ring's
    queued I/O runs in kernel workers, after the runner is stopped), and so are the calls listed
    by `refused_calls`; `argument_rules` allows some calls with some arguments only (socket
    families, fcntl and ioctl commands, clone flags); a file's metadata calls do nothing and
    report success; calls newer than the table, and `clone3`, answer "no such call". Other
    architectures' calls are refused (docs/security.md says why each).

A mechanism the kernel lacks is reported as missing, never faked; `EvalConfig.require_confinement`
decides whether the evaluation then runs.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import os
import sys

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # same on x86-64 and arm64
_CLONE_NEWNET = 0x40000000
_CLONE_NEWIPC = 0x08000000
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAPBSET_DROP = 24
_RULE_PATH_BENEATH = 1

# Landlock file-system rights (include/uapi/linux/landlock.h)
_WRITE_FILE, _READ_FILE, _READ_DIR, _REMOVE_DIR, _REMOVE_FILE = 1 << 1, 1 << 2, 1 << 3, 1 << 4, 1 << 5
_MAKE = sum(1 << b for b in (6, 7, 8, 9, 10, 11, 12))  # char, dir, reg, sock, fifo, block, sym
_REFER, _TRUNCATE = 1 << 13, 1 << 14
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1 << 0, 1 << 1


@dataclasses.dataclass
class Confinement:
    """What confines this process. `complete` when every layer above is active."""
    network_namespace: bool = False
    ipc_namespace: bool = False
    no_new_privs: bool = False
    landlock_abi: int = 0
    fs_writes_confined: bool = False
    tcp_denied: bool = False
    signals_scoped: bool = False
    capabilities_dropped: bool = False
    own_process_only: bool = False  # the seccomp filter on calls that change other processes
    errors: list[str] = dataclasses.field(default_factory=list)

    @property
    def complete(self) -> bool:
        return (self.network_namespace and self.ipc_namespace and self.no_new_privs and self.fs_writes_confined
                and self.tcp_denied and self.capabilities_dropped and self.own_process_only)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "complete": self.complete}


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _errno_text(what: str) -> str:
    e = ctypes.get_errno()
    return f"{what}: {os.strerror(e)} (errno {e})"


def enter_network_namespace(report: Confinement) -> None:
    """A new network namespace with only a down loopback: no address anywhere is reachable."""
    if _libc().unshare(_CLONE_NEWNET) == 0:
        report.network_namespace = True
    else:
        report.errors.append(_errno_text("unshare(CLONE_NEWNET)"))


def landlock_abi() -> int:
    abi = _libc().syscall(_SYS_CREATE_RULESET, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    return max(0, int(abi))


def _fs_rights(abi: int) -> int:
    rights = _WRITE_FILE | _READ_FILE | _READ_DIR | _REMOVE_DIR | _REMOVE_FILE | _MAKE
    if abi >= 2:
        rights |= _REFER
    if abi >= 3:
        rights |= _TRUNCATE
    return rights


def _allow(libc, ruleset: int, path: str, rights: int) -> bool:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        attr = _PathBeneath(rights, fd)
        return libc.syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(attr), 0) == 0
    finally:
        os.close(fd)


def readable_roots(hidden: list[str]) -> set[str]:
    """Paths whose whole subtree may be read: the file system minus the `hidden` subtrees, each
    hidden path replaced, level by level, by its siblings."""
    allowed = {"/"}
    for h in sorted({os.path.realpath(p) for p in hidden}):
        for root in [r for r in allowed if h == r or h.startswith(r.rstrip("/") + "/")]:
            allowed.discard(root)
            allowed |= _siblings_along(root, h)
    return allowed


def _siblings_along(root: str, hidden: str) -> set[str]:
    out, cur = set(), root
    for part in [p for p in os.path.relpath(hidden, root).split(os.sep) if p not in ("", ".")]:
        try:
            out |= {os.path.join(cur, e) for e in os.listdir(cur) if e != part}
        except OSError:
            pass
        cur = os.path.join(cur, part)
    return out


def _allow_reading(libc, ruleset: int, hidden: list[str], gpu: bool) -> None:
    """Read rights everywhere but beneath `hidden`; the Python path and the allowed devices stay
    readable wherever they are."""
    for path in readable_roots(hidden) | python_paths(hidden) | set(devices(gpu)):
        _allow(libc, ruleset, path, _READ_FILE | (_READ_DIR if os.path.isdir(path) else 0))


def python_paths(hidden: list[str]) -> set[str]:
    """The Python path and prefixes, less any entry that is or holds a hidden path (the working
    directory `python -m` puts first may be `/` or the home directory)."""
    covered = [os.path.realpath(h) for h in hidden]
    found = {os.path.realpath(p) for p in (*sys.path, sys.prefix, sys.exec_prefix, sys.base_prefix,
                                           sys.base_exec_prefix) if p and os.path.isdir(p)}
    return {p for p in found if not any(h == p or h.startswith(p.rstrip("/") + "/") for h in covered)}


# What a runner may open of /dev (hidden otherwise: loop devices and their control node, whose
# ioctls a read-only descriptor reaches, terminals, block devices, /dev/shm): the plain character
# devices and, where it has a GPU, the driver's nodes (not the MIG configuration capabilities, nor
# the profiling tools' or the display's nodes)
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_NOT_GPU_WORK = ("/dev/nvidia-caps", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")


def gpu_nodes() -> list[str]:
    return [p for p in glob.glob("/dev/nvidia*") if p not in _NOT_GPU_WORK]


def devices(gpu: bool = True) -> list[str]:
    return [p for p in (*_DEVICES, *(gpu_nodes() if gpu else ())) if os.path.exists(p)]


def _landlock(job_dir: str, report: Confinement, hidden: list[str], gpu: bool) -> None:
    libc = _libc()
    abi = report.landlock_abi = landlock_abi()
    if abi < 1:
        report.errors.append("Landlock unavailable")
        return
    fs = _fs_rights(abi)
    attr = _RulesetAttr(fs, (_NET_BIND_TCP | _NET_CONNECT_TCP) if abi >= 4 else 0,
                        (_SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL) if abi >= 6 else 0)
    size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else (16 if abi >= 4 else 8)
    ruleset = libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        report.errors.append(_errno_text("landlock_create_ruleset"))
        return
    try:
        if not _allow(libc, ruleset, job_dir, fs):
            report.errors.append(_errno_text(f"landlock rule for {job_dir}"))
            return
        file_rights = _WRITE_FILE | (_TRUNCATE if abi >= 3 else 0)
        for dev in ["/dev/null", *(gpu_nodes() if gpu else ())]:
            _allow(libc, ruleset, dev, file_rights)
        _allow_reading(libc, ruleset, hidden, gpu)
        if libc.syscall(_SYS_RESTRICT_SELF, ruleset, 0) != 0:
            report.errors.append(_errno_text("landlock_restrict_self"))
            return
    finally:
        os.close(ruleset)
    report.fs_writes_confined = True
    report.tcp_denied = abi >= 4
    report.signals_scoped = abi >= 6


def _drop_capabilities(report: Confinement) -> None:
    libc = _libc()
    last = 63
    try:
        with open("/proc/sys/kernel/cap_last_cap") as fh:
            last = int(fh.read())
    except (OSError, ValueError):
        pass
    for cap in range(last + 1):
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)  # fails harmlessly without CAP_SETPCAP

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3, all zero
    if libc.capset(ctypes.byref(header), ctypes.byref(data)) != 0:
        report.errors.append(_errno_text("capset"))
        return
    report.capabilities_dropped = True


def restrict(job_dir: str, report: Confinement, hidden: list[str] | tuple[str, ...] = (),
             fixed_cores: bool = False, gpu: bool = True) -> None:
    """No new privileges, Landlock, no capabilities. Irreversible for this process and its children.
    Nothing beneath `hidden` can be read, except `job_dir` and the Python path. `fixed_cores`: not
    even its own CPU cores may change (a process no judge watches, which must stay off the cores
    kept for timing). `gpu`: the GPU's device nodes may be opened."""
    if _libc().unshare(_CLONE_NEWIPC) == 0:
        report.ipc_namespace = True
    else:
        report.errors.append(_errno_text("unshare(CLONE_NEWIPC)"))
    if _libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0:
        report.no_new_privs = True
    else:
        report.errors.append(_errno_text("PR_SET_NO_NEW_PRIVS"))
    _landlock(os.path.realpath(job_dir), report, list(hidden), gpu)
    _drop_capabilities(report)
    _own_process_only(report, fixed_cores)


# (audit arch, seccomp syscall, {syscall: (index of the pid argument, index of a `which`
# argument that must be "a process", its value)}) per architecture (asm/unistd_64.h)
_SECCOMP_ARCHES = {
    "x86_64": (0xC000003E, 317, {302: (0, None, 0), 141: (1, 0, 0), 142: (0, None, 0), 144: (0, None, 0),
                                 203: (0, None, 0), 314: (0, None, 0), 251: (1, 0, 1),
                                 # signals (kill, tkill, tgkill, rt_sigqueueinfo, rt_tgsigqueueinfo,
                                 # pidfd_open): Landlock scopes them only from its ABI 6 (Linux 6.12)
                                 62: (0, None, 0), 200: (0, None, 0), 234: (0, None, 0), 129: (0, None, 0),
                                 297: (0, None, 0), 434: (0, None, 0)}),
    "aarch64": (0xC00000B7, 277, {261: (0, None, 0), 140: (1, 0, 0), 118: (0, None, 0), 119: (0, None, 0),
                                  122: (0, None, 0), 274: (0, None, 0), 30: (1, 0, 1),
                                  129: (0, None, 0), 130: (0, None, 0), 131: (0, None, 0), 138: (0, None, 0),
                                  240: (0, None, 0), 434: (0, None, 0)}),
}
_SETAFFINITY = {"x86_64": 203, "aarch64": 122}  # sched_setaffinity
# io_uring_setup: a ring's kernel workers carry out its queued I/O after the runner is stopped and
# outside this filter. Without setup no ring exists (none is made before confinement), and
# io_uring_enter and io_uring_register act on a ring's descriptor only: refusing setup suffices
_IO_URING_SETUP = {"x86_64": 425, "aarch64": 425}
_PIDFD_SEND_SIGNAL = {"x86_64": 424, "aarch64": 424}  # a /proc/<pid> directory is a pidfd too
# Kernel objects that outlive the runner or escape its limits: keys (a user keyring is shared by
# every process of the uid, across jobs and with the host: add_key, request_key, keyctl), SysV
# shared memory (held without a mapping or a descriptor, unseen by the memory limit: shmget), new
# namespaces (unshare, setns)
_OUTLIVING = {"x86_64": (248, 249, 250, 29, 272, 308), "aarch64": (217, 218, 219, 194, 97, 268)}
# A file's mode, owner, times and extended attributes: Landlock has no right for them and they need
# only ownership, so a runner of the trainer's uid could lock every other job out of its directory
# (or of the temporary root) or set a setuid bit, anywhere. chmod, fchmod, fchmodat, fchmodat2;
# chown, fchown, lchown, fchownat; utime, utimes, futimesat, utimensat; set/remove xattr (path,
# link, descriptor, and the *at forms). They do nothing and report success: the standard library
# calls them on the candidate's own files (`shutil.copy`'s mode, `copy2`'s times, `dbm`) and
# treats a refusal as an error
_METADATA = {"x86_64": (90, 91, 268, 452, 92, 93, 94, 260, 132, 235, 261, 280,
                        188, 189, 190, 197, 198, 199, 463, 466, 469),
             "aarch64": (52, 53, 452, 55, 54, 88, 5, 6, 7, 14, 15, 16, 463, 466, 469)}  # 469: file_setattr
# Calls numbered from here on came after this table: "no such call" (a library falls back), so that
# a new way to a refused effect (file_setattr came so) is closed until the table knows it
_FIRST_UNKNOWN = 470
# Watching paths (inotify, fanotify: names and activity inside the hidden directories, which need no
# read right to watch) and native AIO (io_setup: queued I/O carried out while the runner is stopped)
_WATCHES = {"x86_64": (254, 300, 301, 206), "aarch64": (27, 262, 263, 0)}


@dataclasses.dataclass(frozen=True)
class ArgRule:
    """A call allowed only as its argument `arg` (low 32 bits) says: one of `allowed` (when given),
    else none of `refused` and none of the bits of `no_bits`."""
    arg: int
    allowed: tuple[int, ...] = ()
    refused: tuple[int, ...] = ()
    no_bits: int = 0


# socket(): only internet families, which the runner's own network namespace and Landlock's TCP
# rules close. A Unix socket bound to a path on the host (a container runtime's, D-Bus, an agent's)
# is reached by connect(), which no Landlock right covers, and vsock leaves the namespace
_SOCKET = {"x86_64": 41, "aarch64": 198}
_SOCKET_RULE = ArgRule(0, allowed=(2, 10, 16))  # AF_INET, AF_INET6; AF_NETLINK (its own namespace's interfaces)
# fcntl(): no lease (it stalls whoever opens a file the runner can read, up to the lease-break time)
# and no signal owner or signal (SIGIO sent to another process): F_SETOWN, F_SETSIG, F_SETOWN_EX, F_SETLEASE
_FCNTL = {"x86_64": 72, "aarch64": 25}
_FCNTL_RULE = ArgRule(1, refused=(8, 10, 15, 1024))
# ioctl(): no inode flags (FS_IOC_SETFLAGS in both sizes, FS_IOC_FSSETXATTR, FS_IOC_SETVERSION in both
# sizes, an encryption policy, verity: metadata again, on a read-only descriptor, and inherited by new
# files), and no signal owner (FIOSETOWN, SIOCSPGRP, TIOCSPGRP: SIGIO to another process)
_IOCTL = {"x86_64": 16, "aarch64": 29}
_IOCTL_RULE = ArgRule(1, refused=(0x40086602, 0x40046602, 0x401C5820, 0x40087602, 0x40047602, 0x800C6613,
                                  0x40806685, 0x8901, 0x8902, 0x5410))
# socketpair(): stream sockets only (with their non-blocking and close-on-exec flags): a datagram one
# can still send to a Unix socket's path on the host (journald, systemd's notify socket)
_SOCKETPAIR = {"x86_64": 53, "aarch64": 199}
_SOCKETPAIR_RULE = ArgRule(1, allowed=(1, 0x801, 0x80001, 0x80801))
# madvise(): no MADV_REMOVE, which frees the blocks behind a shared file mapping: the judge's arena,
# whose blocks are reserved so that a full disk is an error and not a SIGBUS in the judge
_MADVISE = {"x86_64": 28, "aarch64": 233}
_MADVISE_RULE = ArgRule(2, refused=(9,))
# clone() makes no namespace (CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET): a
# user namespace gives a root runner every capability over its own, the kernel's widest surface.
# clone3's flags sit in memory a filter cannot read: it answers "no such call" and the C library
# falls back to clone()
_CLONE = {"x86_64": 56, "aarch64": 220}
_CLONE_RULE = ArgRule(0, no_bits=0x7E020000)
_CLONE3 = {"x86_64": 435, "aarch64": 435}
# SECCOMP_RET_ALLOW; SECCOMP_RET_ERRNO with EPERM, ENOSYS, or 0 (the call does nothing and reports success)
_ALLOW, _EPERM, _ENOSYS, _PRETEND = 0x7FFF0000, 0x00050001, 0x00050026, 0x00050000
_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, |JGE|K, |JSET|K, BPF_RET|K


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def _own_process_program(arch: int, guarded: dict[int, tuple], pid: int, denied: tuple[int, ...] = (),
                         ruled: dict[int, ArgRule] | None = None, missing: tuple[int, ...] = (),
                         pretended: tuple[int, ...] = ()) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) (a jump's offsets count from the next instruction): another
    architecture's calls and x32 ones refused; `missing` calls, and those from `_FIRST_UNKNOWN` on,
    answered "no such call"; `pretended` calls skipped with success; `denied`
    calls refused; each guarded call allowed only when its `which` argument (if any) says a process
    and its pid argument is 0 or `pid`; each call in `ruled` allowed as its `ArgRule` says;
    everything else allowed. Arguments are read by their low 32 bits (offset 16 + 8 i of
    `struct seccomp_data`)."""
    head = [(_LD, 0, 0, 4), (_JEQ, 1, 0, arch), (_RET, 0, 0, _EPERM),
            (_LD, 0, 0, 0), (_JGE, 0, 1, 0x40000000), (_RET, 0, 0, _EPERM),
            (_JGE, 0, 1, _FIRST_UNKNOWN), (_RET, 0, 0, _ENOSYS)]
    head += [i for nr in missing for i in ((_JEQ, 0, 1, nr), (_RET, 0, 0, _ENOSYS))]
    head += [i for nr in pretended for i in ((_JEQ, 0, 1, nr), (_RET, 0, 0, _PRETEND))]
    checks = [_pid_check(pid, *rule) for rule in guarded.values()]
    checks += [_arg_check(rule) for rule in (ruled or {}).values()]
    calls = [*guarded, *(ruled or {})]
    # first: each denied call jumps past the rest of them, the dispatch and the final allow, to the
    # refusal after it
    refuse = [(_JEQ, len(denied) - k + len(calls), 0, nr) for k, nr in enumerate(denied)]
    # from the j-th dispatch jump past the rest of them, the final allow, the refusal and the checks before its own
    dispatch = [(_JEQ, len(calls) - j + 1 + sum(map(len, checks[:j])), 0, nr) for j, nr in enumerate(calls)]
    return head + refuse + dispatch + [(_RET, 0, 0, _ALLOW), (_RET, 0, 0, _EPERM)] + [i for c in checks for i in c]


def _pid_check(pid: int, pid_arg: int, which_arg: int | None, which: int) -> list[tuple[int, int, int, int]]:
    """Allow when the `which` argument (if any) says a process and the pid argument is 0 or `pid`."""
    block = [(_LD, 0, 0, 16 + 8 * which_arg), (_JEQ, 0, 3, which)] if which_arg is not None else []
    return block + [(_LD, 0, 0, 16 + 8 * pid_arg), (_JEQ, 2, 0, 0), (_JEQ, 1, 0, pid),
                    (_RET, 0, 0, _EPERM), (_RET, 0, 0, _ALLOW)]


def _arg_check(rule: ArgRule) -> list[tuple[int, int, int, int]]:
    """Load the argument, test it against the rule's values or bits, then the two endings: what
    falls through (a refusal for an allowlist, an allowance otherwise) first."""
    steps = [(True, _JEQ, v) for v in rule.allowed] + [(False, _JEQ, v) for v in rule.refused]
    steps += [(False, _JSET, rule.no_bits)] if rule.no_bits else []
    allow_at = len(steps) + (2 if rule.allowed else 1)  # index of each ending (the load is index 0)
    deny_at = len(steps) + (1 if rule.allowed else 2)
    body = [(code, (allow_at if allow else deny_at) - i - 1, 0, k) for i, (allow, code, k) in enumerate(steps, 1)]
    ends = [(_RET, 0, 0, _EPERM), (_RET, 0, 0, _ALLOW)] if rule.allowed else [(_RET, 0, 0, _ALLOW), (_RET, 0, 0, _EPERM)]
    return [(_LD, 0, 0, 16 + 8 * rule.arg), *body, *ends]


def refused_calls(machine: str, fixed_cores: bool = False) -> tuple[int, ...]:
    """The calls the filter refuses outright on `machine`."""
    return (_IO_URING_SETUP[machine], _PIDFD_SEND_SIGNAL[machine], *_OUTLIVING[machine],
            *_WATCHES[machine], *((_SETAFFINITY[machine],) if fixed_cores else ()))


def argument_rules(machine: str) -> dict[int, ArgRule]:
    """The calls the filter allows with some argument values only."""
    return {_SOCKET[machine]: _SOCKET_RULE, _FCNTL[machine]: _FCNTL_RULE, _CLONE[machine]: _CLONE_RULE,
            _IOCTL[machine]: _IOCTL_RULE, _SOCKETPAIR[machine]: _SOCKETPAIR_RULE, _MADVISE[machine]: _MADVISE_RULE}


def _own_process_only(report: Confinement, fixed_cores: bool = False) -> None:
    import platform
    machine = platform.machine()
    arch = _SECCOMP_ARCHES.get(machine)
    if arch is None:
        report.errors.append(f"seccomp: no syscall table for {machine}")
        return
    audit, sys_seccomp, guarded = arch
    prog = _own_process_program(audit, guarded, os.getpid(), refused_calls(machine, fixed_cores),
                                argument_rules(machine), (_CLONE3[machine],), _METADATA[machine])
    filters = (_SockFilter * len(prog))(*[_SockFilter(c, jt, jf, k) for c, jt, jf, k in prog])
    fprog = _SockFprog(len(prog), filters)
    # SECCOMP_SET_MODE_FILTER (1) with SECCOMP_FILTER_FLAG_TSYNC (1): every thread of the process
    if _libc().syscall(sys_seccomp, 1, 1, ctypes.byref(fprog)) != 0:
        report.errors.append(_errno_text("seccomp"))
        return
    report.own_process_only = True


# the host's secrets a root runner could otherwise read (capabilities dropped, it is still uid 0)
_HOST_SECRETS = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/sudoers", "/etc/sudoers.d",
                 "/etc/ssh")


def hidden_dirs(workdir: str | None = None) -> list[str]:
    """What a runner may not read: every job's files (the temporary directory they live in, the
    parent of `workdir`), the GPU lock directory, the user's home (tokens, keys, other runs; the
    Python path beneath it stays readable), /dev but for `devices()`, and the host's secrets."""
    import tempfile

    from drkernel.gpushare import lock_dir
    hidden = [os.path.dirname(os.path.realpath(workdir)) if workdir else tempfile.gettempdir(), lock_dir()]
    home = os.path.realpath(os.path.expanduser("~"))
    if home != "/" and os.path.isdir(home):
        hidden.append(home)
    return hidden + ["/dev"] + [p for p in _HOST_SECRETS if os.path.lexists(p)]


def probe() -> dict:
    """A sandbox target: the runner's confinement applied to this process, reported."""
    report = Confinement()
    enter_network_namespace(report)
    restrict(os.getcwd(), report)
    return report.to_dict()


def point_caches_at(job_dir: str) -> None:
    """Everything that writes scratch files (the Triton and inductor caches, tempfile) goes beneath `job_dir`."""
    import tempfile
    for name in ("TRITON_CACHE_DIR", "TRITON_HOME", "TRITON_DUMP_DIR", "TORCHINDUCTOR_CACHE_DIR", "TMPDIR", "HOME"):
        path = os.path.join(job_dir, name.lower())
        os.makedirs(path, exist_ok=True)
        os.environ[name] = path
    tempfile.tempdir = os.environ["TMPDIR"]
    # the Triton cache is the job's own and empty: a compiled kernel found there was put there by
    # the candidate (under its own text's key), so Triton compiles every kernel it builds
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
