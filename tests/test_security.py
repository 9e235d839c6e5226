"""The trust boundary on CPU: attack families against the judge/runner split and the runner's
confinement (docs/security.md). Each attack fixture (tests/fixtures/attacks) must come back as
its header expects, leave nothing behind and reach no listener, and the evaluator must keep
working afterwards."""

import array
import ctypes
import dataclasses
import errno
import fcntl
import os
import platform
import socket
import subprocess
import textwrap
import threading
import time

import pytest

from drkernel import confine, judge
from drkernel.evaluator import EvalConfig, EvalResult, Evaluator, _map_status
from drkernel.sandbox import SandboxResult
from tests.fixtures.attacks import harness
from tests.test_evaluator import LEGIT_RELU, TASKS, cfg, relu_candidate


@pytest.fixture(scope="module")
def evaluator():
    with Evaluator(cfg(cpu_perf_trials=3)) as ev:
        yield ev


@dataclasses.dataclass
class AttackRun:
    result: EvalResult
    token: str  # the fixture's unique marker
    marker_dir: str


@pytest.fixture(scope="module")
def attack_runs(evaluator, tmp_path_factory) -> tuple[dict[str, AttackRun], list[str]]:
    """Every attack fixture judged in one `evaluate_many` (grouped by task, as in training) under
    one listener: what each run left, and what reached the listener from any of them."""
    with harness.Listener() as listener:
        prepared = []
        for path in harness.fixtures():
            marker_dir = str(tmp_path_factory.mktemp(path.stem))
            code, token = harness.prepare(path, marker_dir, listener.port)
            prepared.append((path, code, token, marker_dir))
        results = evaluator.evaluate_many([((TASKS / harness.headers(path)["task"]).read_text(), code)
                                           for path, code, _, _ in prepared])
        time.sleep(0.5)  # a late packet would still arrive
    runs = {path.stem: AttackRun(r, token, d) for (path, _, token, d), r in zip(prepared, results)}
    return runs, listener.received


@pytest.mark.parametrize("path", harness.fixtures(), ids=lambda p: p.stem)
def test_attack_fixture(path, attack_runs):
    runs, received = attack_runs
    run, h = runs[path.stem], harness.headers(path)
    r = run.result
    assert harness.check(h["expect"], r), (h["expect"], r.verdict, r.hacks, r.candidate_ms, r.error)
    assert received == [], received
    assert harness.leftovers(run.token, run.marker_dir) == []
    assert r.details.get("confinement", {}).get("complete") or r.verdict != "correct"


def test_evaluator_unharmed_after_the_attacks(evaluator):
    r = evaluator.evaluate((TASKS / "1_ReLU.py").read_text(), LEGIT_RELU)
    assert r.verdict == "correct" and not r.hacks, (r.verdict, r.hacks, r.error)
    assert r.details["confinement"]["complete"], r.details["confinement"]


def _in_a_child(fn, *args) -> str:
    """repr of what `fn(*args)` returns, run in a forked child (confinement cannot be undone, so this
    process stays free); the child reports through a pipe."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        os.close(rfd)
        try:
            got = repr(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - any failure is the answer
            got = f"raised {exc!r}"
        os.write(wfd, got.encode())
        os._exit(0)
    os.close(wfd)
    got = os.read(rfd, 1000).decode()
    os.waitpid(pid, 0)
    os.close(rfd)
    return got


def _succeeds(action) -> bool:
    """Whether `action()` runs without an OSError."""
    try:
        action()
        return True
    except OSError:
        return False


def _confined_file_and_network_access(job, outside, port: int) -> list[bool]:
    """Confined to `job`: [complete, write inside, write outside, TCP connect]."""
    report = confine.Confinement()
    confine.enter_network_namespace(report)
    confine.restrict(str(job), report)
    return [report.complete, _succeeds(lambda: (job / "inside.txt").write_text("x")),
            _succeeds(lambda: outside.write_text("x")),
            _succeeds(lambda: socket.create_connection(("127.0.0.1", port), timeout=1).close())]


def test_confinement_in_a_child(tmp_path):
    """The runner's confinement as a process sees it: writes only beneath its directory, no TCP,
    no capabilities."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    job, outside = tmp_path / "job", tmp_path / "outside.txt"
    job.mkdir()
    got = _in_a_child(_confined_file_and_network_access, job, outside, port)
    listener.close()
    assert got == "[True, True, False, False]", got
    assert not outside.exists()


def _confined_metadata_and_sockets(path: str, unix_path: str) -> list[bool]:
    """Under the seccomp layer alone: [installed, chmod, chown, utime, setxattr of a file this uid
    owns, connect to a Unix socket's path, make a vsock socket, make a TCP socket, a stream
    socketpair, a datagram one (it could send to a path), set the file's inode flags]."""
    report = confine.Confinement()
    confine._own_process_only(report)

    def unix_connect():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1)
            s.connect(unix_path)
            s.sendall(b"reached")

    return [report.own_process_only, _succeeds(lambda: os.chmod(path, 0o4777)),
            _succeeds(lambda: os.chown(path, os.getuid(), os.getgid())),
            _succeeds(lambda: os.utime(path, (0, 0))),
            _succeeds(lambda: os.setxattr(path, "user.drk", b"x")),
            _succeeds(unix_connect),
            _succeeds(lambda: socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).close()),
            _succeeds(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()),
            _succeeds(lambda: [s.close() for s in socket.socketpair()]),
            _succeeds(lambda: [s.close() for s in socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)]),
            _succeeds(lambda: _set_inode_flags(path))]


def _set_inode_flags(path: str) -> None:
    """FS_IOC_SETFLAGS with the flags the file has (no change) on a read-only descriptor."""
    fd = os.open(path, os.O_RDONLY)
    try:
        flags = array.array("l", [0])
        fcntl.ioctl(fd, 0x80086601, flags)  # FS_IOC_GETFLAGS
        fcntl.ioctl(fd, 0x40086602, flags)  # FS_IOC_SETFLAGS
    finally:
        os.close(fd)


def test_a_confined_process_changes_no_files_metadata_and_reaches_no_unix_socket(tmp_path):
    """Landlock has no right for a file's mode, owner, times or extended attributes (they need only
    ownership: a runner of the trainer's uid could lock the other jobs out of their directories or
    set a setuid bit anywhere), nor for connect() to a Unix socket's path on the host: the seccomp
    layer skips the metadata calls (reporting success, as the standard library expects on the
    candidate's own files) and refuses every socket family but the internet ones and netlink."""
    if platform.machine() != "x86_64":
        pytest.skip("AF_VSOCK and the probe's calls are checked on x86_64")
    path = tmp_path / "owned.txt"
    path.write_text("x")
    os.chmod(path, 0o644)
    before = os.stat(path)
    unix_path = str(tmp_path / "agent.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(unix_path)
        listener.listen(1)
        listener.settimeout(0.2)
        got = _in_a_child(_confined_metadata_and_sockets, str(path), unix_path)
        with pytest.raises(TimeoutError):
            listener.accept()
    assert got == "[True, True, True, True, True, False, False, True, True, False, False]", got
    after = os.stat(path)  # the metadata calls reported success (the standard library needs it) and did nothing
    assert (after.st_mode, after.st_mtime_ns) == (before.st_mode, before.st_mtime_ns)
    with pytest.raises(OSError):
        os.getxattr(path, "user.drk")


def _confined_namespaces_leases_and_watches(path: str) -> list:
    """Under the seccomp layer alone: [installed, clone(CLONE_NEWUSER) errno, clone3 errno, a thread
    and a fork still work, F_SETLEASE and F_GETFL on a file, inotify_add_watch]."""
    libc = ctypes.CDLL(None, use_errno=True)
    report = confine.Confinement()
    confine._own_process_only(report)
    out: list = [report.own_process_only]
    pid = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)  # clone(CLONE_NEWUSER | SIGCHLD)
    if pid == 0:  # pragma: no cover - a child made despite the filter
        os._exit(0)
    out.append(ctypes.get_errno() if pid < 0 else 0)
    args = ctypes.create_string_buffer(88)
    out.append(ctypes.get_errno() if libc.syscall(435, args, 88) < 0 else 0)
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
    child = os.fork()
    if child == 0:  # pragma: no cover - the forked child only exits
        os._exit(7)
    out.append(os.waitpid(child, 0)[1] >> 8)
    fd = os.open(path, os.O_RDONLY)
    out.append(_succeeds(lambda: fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)))
    out.append(_succeeds(lambda: fcntl.fcntl(fd, fcntl.F_GETFL)))
    ifd = libc.inotify_init1(0)
    out.append(libc.inotify_add_watch(ifd, os.path.dirname(path).encode(), 0xFFF) >= 0)
    return out


def test_a_confined_process_makes_no_namespace_lease_or_watch(tmp_path):
    """clone() with a namespace flag (a user namespace gives a root runner every capability over
    its own: the kernel's widest surface; only unshare was refused), clone3 (its flags cannot be
    read: "no such call", and the C library falls back to clone), a lease on a file it can read (the
    trainer's next open of it stalls up to the lease-break time) and a watch on a directory it may
    not read (inotify needs no read right) are refused; threads and fork still work."""
    if platform.machine() != "x86_64":
        pytest.skip("the probe uses x86_64 call numbers")
    path = tmp_path / "metrics.jsonl"
    path.write_text("{}\n")
    got = _in_a_child(_confined_namespaces_leases_and_watches, str(path))
    assert got == f"[True, {errno.EPERM}, {errno.ENOSYS}, 7, False, True, False]", got


def _confined_device_opens(job, shm_file: str) -> list[bool]:
    """Confined as a runner (hidden_dirs): [complete, read /dev/urandom, open /dev/null for writing,
    open /dev/loop-control, read a file in /dev/shm]."""
    report = confine.Confinement()
    confine.enter_network_namespace(report)
    confine.restrict(str(job), report, confine.hidden_dirs(str(job)))

    def read(path: str) -> None:
        with open(path, "rb") as fh:
            fh.read(1)

    return [report.complete, _succeeds(lambda: read("/dev/urandom")),
            _succeeds(lambda: open("/dev/null", "w").close()), _succeeds(lambda: read("/dev/loop-control")),
            _succeeds(lambda: read(shm_file))]


def test_a_runner_opens_no_device_but_the_plain_ones_and_the_gpus(tmp_path):
    """Read rights reach ioctls: a read-only descriptor of /dev/loop-control makes loop devices that
    outlive the job (and swap what a host's read-only loop device reads), one of a terminal turns
    its echo off; /dev/shm holds other processes' shared memory. /dev is hidden but for null, zero,
    full, the random devices and /dev/nvidia*."""
    if not os.path.exists("/dev/loop-control") or not os.path.isdir("/dev/shm"):
        pytest.skip("this host has no /dev/loop-control or /dev/shm")
    shm_file = f"/dev/shm/drk_probe_{os.getpid()}"
    with open(shm_file, "w") as fh:
        fh.write("the trainer's shared tensor")
    job = tmp_path / "job"
    job.mkdir()
    try:
        got = _in_a_child(_confined_device_opens, job, shm_file)
    finally:
        os.unlink(shm_file)
    assert got == "[True, True, True, False, False]", got


def test_a_runner_gets_the_gpu_driver_nodes_only_and_the_preflight_none(monkeypatch, tmp_path):
    """The MIG configuration capabilities, the profiling tools' and the display's nodes are no
    work of a runner's; the pre-flight import runs with no GPU at all (it would otherwise use one
    outside every lock while neighbours are timed)."""
    nodes = ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-caps",
             "/dev/nvidia-modeset"]
    monkeypatch.setattr(confine.glob, "glob", lambda pattern: nodes if pattern == "/dev/nvidia*" else [])
    monkeypatch.setattr(confine.os.path, "exists", lambda p: True)
    assert confine.gpu_nodes() == ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert not [d for d in confine.devices(gpu=False) if "nvidia" in d]
    from drkernel import runner
    asked = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(confine, "enter_network_namespace", lambda report: None)
    monkeypatch.setattr(confine, "point_caches_at", lambda job_dir: None)
    monkeypatch.setattr(confine, "restrict", lambda *args, **kwargs: asked.append(kwargs))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "cand.py").write_text("x = 1\n")
    runner.preflight(str(tmp_path / "src" / "cand.py"), [])
    assert asked and asked[0].get("gpu") is False, asked


def test_the_python_path_keeps_no_entry_that_holds_a_hidden_directory(tmp_path, monkeypatch):
    """`python -m` from `/` or from the home directory puts it first on the Python path: kept
    readable, it would undo every hidden directory; an entry inside one stays readable."""
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    (home / "project").mkdir(parents=True)
    tmp.mkdir()
    monkeypatch.setattr(confine.sys, "path", ["/", str(home), str(home / "project"), str(tmp_path)])
    kept = confine.python_paths([str(home), str(tmp)])
    assert str(home / "project") in kept
    assert not {"/", str(home), str(tmp_path)} & kept, kept


SIBLING_LOCKOUT = relu_candidate("return launch(x)", extra="""
    import os
    _job = os.path.dirname(os.getcwd())  # <job>/runner<k>: the other candidates' directories beside it
    for _name in [f"runner{k}" for k in range(8)]:
        _p = os.path.join(_job, _name)
        if _p != os.getcwd():
            try:
                os.chmod(_p, 0)
                print("LOCKED", _name)
            except OSError:
                pass
    """)


def test_a_candidate_cannot_lock_its_group_out_of_their_directories():
    """The candidates of one prompt share a job: one that made its siblings' directories unreadable
    (chmod needs only ownership) would have them fail to import, raising its own advantage."""
    with Evaluator(cfg(), workers=1) as ev:
        attack, honest = ev.evaluate_many([((TASKS / "1_ReLU.py").read_text(), SIBLING_LOCKOUT),
                                           ((TASKS / "1_ReLU.py").read_text(), LEGIT_RELU)])
    assert honest.verdict == "correct", (honest.verdict, honest.error)


def test_require_confinement_refuses_when_incomplete(monkeypatch):
    from drkernel.channel import Channel
    twin = Channel(sock=-1, pid=0, dir="")
    r = judge.Reference(cfg=EvalConfig(require_confinement=True), reference_path="", twin=twin)
    r.layout = judge.ipc.Layout(nbytes=512, inputs=[], input_values=[], outputs=[])
    r.details["output_structure"] = "T"
    monkeypatch.setattr(Channel, "receive", lambda self: {"ok": True})
    monkeypatch.setattr(Channel, "ask", lambda self, msg: {
        "ok": True, "confinement": {"complete": False, "errors": ["Landlock unavailable"]}})
    with pytest.raises(judge.Stop, match="Landlock unavailable"):
        judge.start_twin(r)
    r.cfg.require_confinement = False
    judge.start_twin(r)
    assert r.details["confinement"]["errors"] == ["Landlock unavailable"]


# ---- the judge's clock rules, with synthetic numbers ---------------------------------------

def _judge(device: str = "cuda", **cfg_over) -> judge.Judge:
    import torch

    from drkernel.channel import Channel
    r = judge.Reference(cfg=EvalConfig(**cfg_over), reference_path="", twin=Channel(sock=-1, pid=0, dir=""))
    r.device = torch.device(device)
    return judge.Judge(ref=r, runner=Channel(sock=-1, pid=0, dir=""), candidate_path="")


def test_clock_rule_neutralises_a_forged_timer():
    j = _judge()
    j.ref.overhead_ms = 0.2
    honest = judge._accepted_ms(j, [2.0] * 9, [2.35] * 9)  # 0.15 ms over: within the slack
    assert honest == pytest.approx(2.0) and not j.out.hacks
    j = _judge()
    j.ref.overhead_ms = 0.2
    forged = judge._accepted_ms(j, [0.02] * 9, [2.21] * 9)  # claims 0.02 ms, the judge saw 2 ms of work
    assert forged == pytest.approx(2.01)
    assert j.out.hacks == ["side_stream"]


def test_clock_rule_allows_what_the_reference_itself_shows_on_host_bound_models():
    """Launch-bound models (MobileNetV2, ResNet18 on an H100) showed 0.35-0.9 ms per call beyond
    the null-call overhead on the reference's own copy; the reference's calls, timed beside it,
    show the same, so the copy is not a hack, while a forged short time still is."""
    j = _judge()
    j.ref.overhead_ms = 0.2
    j.honest_extra = judge._honest_extra(j.ref, [3.0] * 9, [3.0 + 0.2 + 0.6] * 9)  # 0.2 per ms of the reference
    copy = judge._accepted_ms(j, [3.0] * 9, [3.0 + 0.2 + 0.65] * 9)
    assert copy == pytest.approx(3.0) and not j.out.hacks
    forged = judge._accepted_ms(j, [1.0] * 9, [3.0 + 0.2 + 0.65] * 9)  # the same work, claiming a third
    assert j.out.hacks == ["side_stream"] and forged == pytest.approx(3.0 + 0.65 - 0.2)
    j = _judge()
    j.ref.overhead_ms = 0.2
    j.honest_extra = judge._honest_extra(j.ref, [3.0] * 9, [3.0 + 0.2 + 0.01] * 9)  # a GPU-bound reference
    judge._accepted_ms(j, [3.0] * 9, [3.0 + 0.2 + 0.65] * 9)
    assert j.out.hacks == ["side_stream"]


def test_on_a_cpu_the_clock_allows_the_references_own_excess_unscaled():
    """On a CPU the reference's torch calls take microseconds while the host adds
    milliseconds around each: per ms of its time that is a huge factor, which scaled by a
    candidate's time would allow seconds of hidden work."""
    j = _judge("cpu")
    j.ref.overhead_ms = 0.2
    j.honest_extra, j.reference_excess_ms = 168.0, 10.0  # 10 ms of host time around 0.06 ms calls
    honest = judge._accepted_ms(j, [24.0] * 9, [24.0 + 0.2 + 12.0] * 9)  # like the reference, 2 ms more
    assert honest == pytest.approx(24.0) and not j.out.hacks
    judge._accepted_ms(j, [24.0] * 9, [24.0 + 0.2 + 1000.0] * 9)  # a second after the runner's timer
    assert j.out.hacks == ["side_stream"]


@pytest.mark.parametrize("held_bytes, checks_after", [(2**30, [9, 19]), (0, list(range(20)))])
def test_every_timed_output_is_checked_small_ones_at_block_ends(monkeypatch, held_bytes, checks_after):
    """All 20 timed outputs are checked against the twin's: small ones together after each block of
    ten pairs (no work between timed calls), larger ones after their own pair."""
    import torch
    j = _judge(device="cpu", timing_block_calls=10)
    j.ref.perf_n, j.ref.out_views = 20, [torch.zeros(4)]
    monkeypatch.setattr(judge, "_HELD_OUTPUT_BYTES", held_bytes)
    log = []
    monkeypatch.setattr(judge, "_twin_ms", lambda r, seed, keep: judge.Call({}, 1.2, [], seed, output=seed, ms=1.0))
    monkeypatch.setattr(judge, "_candidate_ms",
                        lambda j, seed, label: log.append(("call", label)) or judge.Call({}, 1.2, [], seed, output=seed, ms=1.0))
    monkeypatch.setattr(judge, "verify", lambda j, c, label, ref: log.append(("check", label, c.output == ref)))
    monkeypatch.setattr(judge, "_precise_enough", lambda j, ref_ms, cand_ms: False)
    judge._timed_pairs(j)
    checked = [entry[1] for entry in log if entry[0] == "check"]
    assert checked == [f"timed call {i}" for i in range(20)] and all(e[2] for e in log if e[0] == "check")
    after = [int(log[k - 1][1].split()[-1]) for k, e in enumerate(log) if e[0] == "check" and log[k - 1][0] == "call"]
    assert after == checks_after


def test_gpu_work_left_running_after_a_timed_reply_is_a_hack(monkeypatch):
    """A kernel still running once the candidate answered would overlap the twin's timed call (and
    could write the slot the twin's output is copied from): the judge probes the GPU after every
    timed call; a short wait is tolerated, work that never drains is `side_stream`."""
    j = _judge()
    probes = iter([0.01, 3.0])
    monkeypatch.setattr(judge, "_probe_ms", lambda r: next(probes))
    waited = []
    monkeypatch.setattr(judge, "_wait_idle", lambda r: waited.append(1) or len(waited) < 2)
    judge._check_left_idle(j, "timed call 0")  # idle at once
    judge._check_left_idle(j, "timed call 1")  # busy, drained while waiting
    assert not j.out.hacks and len(waited) == 1
    monkeypatch.setattr(judge, "_probe_ms", lambda r: 3.0)
    with pytest.raises(judge.Hacked):
        judge._check_left_idle(j, "timed call 2")  # busy, never drains
    assert j.out.hacks == ["side_stream"] and "after its reply" in j.details["hack_details"][-1]


def test_reference_slowed_rule():
    """The reference calls right after a candidate call against those right after the reference's
    own, from one interleaved loop: a launch-bound reference slower in the whole loop than alone
    before the candidate existed is the host's drift, not a hack; slower only where it follows the
    candidate, it is."""
    j = _judge()
    drift = [3.6, 3.5, 3.4, 3.6, 3.5, 3.7, 3.4, 3.5]  # 1.8x a 2.0 ms time alone, both kinds alike
    judge._check_reference_slowed(j, drift)
    assert not j.out.hacks
    judge._check_reference_slowed(j, [2.0, 2.1])  # one pair: nothing to compare
    assert not j.out.hacks
    left_behind = [2.0, 3.4, 2.1, 3.5, 2.0, 3.3, 2.1, 3.6]  # slow only after the candidate's calls
    with pytest.raises(judge.Hacked):
        judge._check_reference_slowed(j, left_behind)
    assert j.out.hacks == ["reference_slowed"] and "right after the candidate" in j.details["hack_details"][-1]


def test_roofline_retimes_and_keeps_the_slower_median(monkeypatch):
    j = _judge()
    j.ref.io_bytes, j.ref.bandwidth, j.out.ref_ms, j.ref.perf_n = 4e9, 4e9, 2.0, 100  # roofline 1 ms
    j.ref.overhead_ms = 0.2
    monkeypatch.setattr(judge, "_candidate_ms", lambda j, seed, label: judge.Call({}, 1.5, [], seed, ms=1.2))
    monkeypatch.setattr(judge, "verify", lambda j, c, label: None)
    assert judge._roofline(j, 0.5) == pytest.approx(1.2)  # re-timed honestly: above the roofline
    assert not j.out.hacks
    monkeypatch.setattr(judge, "_candidate_ms", lambda j, seed, label: judge.Call({}, 0.5, [], seed, ms=0.3))
    with pytest.raises(judge.Hacked):
        judge._roofline(j, 0.3)
    assert "implausible_speedup" in j.out.hacks


# ---- sandbox outcomes that must map to one verdict -----------------------------------------

@pytest.mark.parametrize("status, verdict, words", [
    ("oom", "crashed", "out of memory"), ("oversized_result", "crashed", "result too large"),
    ("sandbox_error", "crashed", "sandbox error"), ("timeout", "timeout", "time limit"),
    ("exit_no_result", "crashed", "without a result")])
def test_sandbox_status_mapping(status, verdict, words):
    r = _map_status(SandboxResult(status, error="boom"))
    assert r.verdict == verdict and words in r.error


# ---- speed direction and size, measured on CPU with sleeps ------------------------------------

SLEEPY_TASK = textwrap.dedent('''
    import time
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def forward(self, x):
            time.sleep({ref_s})
            return torch.relu(x)

    def get_inputs():
        return [torch.rand(8, 128)]

    def get_init_inputs():
        return []
''')


@pytest.mark.parametrize("ref_s, cand_s, low, high", [(0.12, 0.0, 4.0, 1e9), (0.0, 0.12, 0.0, 0.25)])
def test_speedup_direction_and_size(tmp_path, ref_s, cand_s, low, high):
    task = tmp_path / "sleepy.py"
    task.write_text(SLEEPY_TASK.format(ref_s=ref_s))
    cand = relu_candidate(f"time.sleep({cand_s})\nreturn launch(x)", extra="\nimport time\n")
    r = Evaluator(cfg(cpu_perf_trials=3)).evaluate(str(task), cand)
    assert r.verdict == "correct", (r.verdict, r.error)
    assert low <= r.speedup <= high, (r.speedup, r.ref_ms, r.candidate_ms)


@pytest.mark.slow
def test_evaluate_many_really_runs_workers_at_once():
    """Three candidates that each print their start time and sleep 2.5 s at import: with three
    workers the three starts fall within 2.5 s of each other (serially they would be at least
    2.5 s apart, plus each evaluation)."""
    body = "return launch(x)"
    extra = "\nimport time\nprint('START', time.time(), flush=True)\ntime.sleep(2.5)\n"
    ref = (TASKS / "1_ReLU.py").read_text()
    with Evaluator(cfg(), workers=3, group_size=1) as ev:
        results = ev.evaluate_many([(ref, relu_candidate(body, extra=extra + f"# {i}\n")) for i in range(3)])
    assert all(r.verdict == "correct" for r in results), [(r.verdict, r.error) for r in results]
    starts = sorted(float(r.stdout.split("START")[1].split()[0]) for r in results)
    assert starts[-1] - starts[0] < 2.5, starts


def test_result_fields_survive_json():
    r = EvalResult(verdict="correct", speedup=1.5, details={"confinement": {"complete": True}})
    assert EvalResult.from_dict(r.to_dict()) == r


def _confined_scheduling_changes(parent: int, fixed_cores: bool = False) -> list[bool]:
    """Under the seccomp layer: [installed, then whether each change of `parent`'s limits, priority,
    affinity and of its own priority, limits and affinity succeeds]."""
    import resource
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    report = confine.Confinement()
    confine._own_process_only(report, fixed_cores)
    return [report.own_process_only,
            _succeeds(lambda: resource.prlimit(parent, resource.RLIMIT_NOFILE, nofile)),
            _succeeds(lambda: os.setpriority(os.PRIO_PROCESS, parent, 0)),
            _succeeds(lambda: os.sched_setaffinity(parent, os.sched_getaffinity(parent))),
            _succeeds(lambda: os.setpriority(os.PRIO_PROCESS, 0, 1)),
            _succeeds(lambda: resource.prlimit(0, resource.RLIMIT_NOFILE, nofile)),
            _succeeds(lambda: os.sched_setaffinity(0, os.sched_getaffinity(0)))]


def _confined_signals(parent: int) -> list[bool]:
    """Under the seccomp layer alone: [installed, whether a signal reaches `parent`, this process,
    this process's own group] (the other signal calls: the program test below)."""
    report = confine.Confinement()
    confine._own_process_only(report)
    return [report.own_process_only, _succeeds(lambda: os.kill(parent, 0)),
            _succeeds(lambda: os.kill(os.getpid(), 0)), _succeeds(lambda: os.kill(0, 0))]


def test_a_confined_process_cannot_signal_another_process():
    """Landlock scopes signals only from its ABI 6 (Linux 6.12); below it a runner could kill the
    reference's timing process (the next candidates of its group then crashed, cached). The seccomp
    layer lets signals reach only the process itself and its own group."""
    got = _in_a_child(_confined_signals, os.getpid())
    assert got == "[True, False, True, True]", got


def test_a_confined_process_cannot_change_another_process():
    """The seccomp layer: resource limits, priority and scheduling of another process (the judge,
    the reference's timing process, the other runners) cannot be changed; its own still can."""
    got = _in_a_child(_confined_scheduling_changes, os.getpid())
    assert got == "[True, False, False, False, True, True, True]", got


def _io_uring_setup() -> int:
    """The errno of `io_uring_setup(1, params)` (a zeroed `struct io_uring_params`, 120 bytes; call
    425 on x86_64 and aarch64 alike), 0 when it made a ring (closed again)."""
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)
    fd = libc.syscall(425, 1, ctypes.byref(params))
    if fd < 0:
        return ctypes.get_errno()
    os.close(fd)
    return 0


def _confined_io_uring_setup() -> tuple[bool, int]:
    """Under the seccomp layer: (installed, the errno of `io_uring_setup`)."""
    report = confine.Confinement()
    confine._own_process_only(report)
    return report.own_process_only, _io_uring_setup()


def _io_uring_unavailable() -> str | None:
    """Why this host has no io_uring even unconfined, or None when it has."""
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as fh:
            if fh.read().strip() == "2":
                return "io_uring is disabled on this host (kernel.io_uring_disabled = 2)"
    except OSError:
        pass  # older kernels have no such switch
    e = _io_uring_setup()
    return f"io_uring_setup fails unconfined here: {os.strerror(e)}" if e in (errno.ENOSYS, errno.EPERM) else None


def test_a_confined_process_cannot_set_up_io_uring():
    """A ring's queued I/O is carried out by kernel workers, after the runner is stopped and
    outside every check: a confined process cannot make one."""
    if why := _io_uring_unavailable():
        pytest.skip(why)
    got = _in_a_child(_confined_io_uring_setup)
    assert got == f"(True, {errno.EPERM})", got


def _confined_outliving_objects() -> list[int]:
    """Under the seccomp layer: the errno of add_key into the user keyring, of a SysV shared memory
    segment and of a new user namespace (0: made)."""
    libc = ctypes.CDLL(None, use_errno=True)
    report = confine.Confinement()
    confine._own_process_only(report)
    key = libc.syscall(248, b"user", b"drk_probe", b"x", 1, -4)  # KEY_SPEC_USER_KEYRING
    errs = [0 if key >= 0 else ctypes.get_errno()]
    if key >= 0:
        libc.syscall(250, 21, key)  # KEYCTL_INVALIDATE: the key made anyway goes
    shm = libc.syscall(29, 0, 1 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    errs.append(0 if shm >= 0 else ctypes.get_errno())
    errs.append(0 if libc.unshare(0x10000000) == 0 else ctypes.get_errno())  # CLONE_NEWUSER
    return [report.own_process_only, *errs]


def test_a_confined_process_makes_no_key_shared_memory_or_namespace():
    """A key in the user keyring outlives the job and is read by later candidates (and holds the
    host's secrets); a SysV segment holds memory no limit sees; a new namespace escapes the
    runner's. Refused under the seccomp layer."""
    if platform.machine() != "x86_64":
        pytest.skip("the probe uses x86_64 call numbers")
    got = _in_a_child(_confined_outliving_objects)
    assert got == f"[True, {errno.EPERM}, {errno.EPERM}, {errno.EPERM}]", got


def _bpf_verdict(prog: list, nr: int, args: list[int], arch: int) -> str:
    """What a classic-BPF seccomp program returns for one call (`struct seccomp_data` by offset)."""
    data = {0: nr, 4: arch, **{16 + 8 * i: a for i, a in enumerate(args)}}
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = prog[pc]
        assert max(jt, jf) < 256  # 8-bit jump offsets
        if code == confine._RET:
            return {confine._ALLOW: "allow", confine._ENOSYS: "absent", confine._PRETEND: "pretend"}.get(k, "refused")
        if code == confine._LD:
            acc, pc = data.get(k, 0), pc + 1
        else:
            taken = {confine._JEQ: acc == k, confine._JGE: acc >= k, confine._JSET: acc & k != 0}[code]
            pc += 1 + (jt if taken else jf)


@pytest.mark.parametrize("machine", sorted(confine._SECCOMP_ARCHES))
@pytest.mark.parametrize("fixed_cores", [False, True])
def test_the_seccomp_program_of_every_architecture(machine, fixed_cores):
    """The filter's jumps, read instruction by instruction for each architecture it is built for
    (only this machine's runs in the tests above): a guarded call names the process itself (0 or
    its pid) or is refused, io_uring_setup is refused outright, and with `fixed_cores` setting the
    CPU set is too."""
    audit, _, guarded = confine._SECCOMP_ARCHES[machine]
    io_uring = confine._IO_URING_SETUP[machine]
    denied = confine.refused_calls(machine, fixed_cores)
    prog = confine._own_process_program(audit, guarded, 4242, denied, confine.argument_rules(machine),
                                        (confine._CLONE3[machine],), confine._METADATA[machine])
    for nr in confine._METADATA[machine]:  # a file's mode, owner, times, extended attributes: skipped
        assert _bpf_verdict(prog, nr, [0] * 6, audit) == "pretend", nr
    for nr in confine._OUTLIVING[machine]:  # keys, SysV shared memory, namespaces
        assert _bpf_verdict(prog, nr, [0] * 6, audit) == "refused", nr
    assert _bpf_verdict(prog, confine._PIDFD_SEND_SIGNAL[machine], [3, 9], audit) == "refused"
    assert _bpf_verdict(prog, 1, [], audit + 1) == "refused"  # another architecture
    assert _bpf_verdict(prog, 0x40000001, [], audit) == "refused"  # x32
    assert _bpf_verdict(prog, 1, [], audit) == "allow"
    assert _bpf_verdict(prog, io_uring, [1], audit) == "refused"
    for family, want in ((1, "refused"), (40, "refused"), (17, "refused"), (2, "allow"), (10, "allow"), (16, "allow")):
        assert _bpf_verdict(prog, confine._SOCKET[machine], [family, 1, 0], audit) == want, family
    for cmd, want in ((1024, "refused"), (8, "refused"), (15, "refused"), (10, "refused"), (3, "allow"), (2, "allow")):
        assert _bpf_verdict(prog, confine._FCNTL[machine], [5, cmd], audit) == want, cmd  # F_SETLEASE... F_GETFL
    fork, thread = 0x01200011, 0x003D0F00  # glibc's fork(); pthread_create's flags
    for flags, want in ((fork, "allow"), (thread, "allow"), (fork | 0x10000000, "refused"), (0x40000000 | 17, "refused")):
        assert _bpf_verdict(prog, confine._CLONE[machine], [flags], audit) == want, hex(flags)
    assert _bpf_verdict(prog, confine._CLONE3[machine], [0, 88], audit) == "absent"
    assert _bpf_verdict(prog, confine._FIRST_UNKNOWN, [0] * 6, audit) == "absent"  # calls newer than the table
    for cmd, want in ((0x40086602, "refused"), (0x8902, "refused"), (0x5410, "refused"), (0xC0104629, "allow"),
                      (0x80086601, "allow")):  # inode flags and signal owners; a driver's ioctl, GETFLAGS
        assert _bpf_verdict(prog, confine._IOCTL[machine], [3, cmd], audit) == want, hex(cmd)
    for kind, want in ((0x80001, "allow"), (1, "allow"), (2, "refused"), (0x80002, "refused"), (5, "refused")):
        assert _bpf_verdict(prog, confine._SOCKETPAIR[machine], [1, kind], audit) == want, hex(kind)
    for advice, want in ((9, "refused"), (4, "allow")):  # MADV_REMOVE; MADV_DONTNEED
        assert _bpf_verdict(prog, confine._MADVISE[machine], [0, 4096, advice], audit) == want, advice
    for nr in confine._WATCHES[machine]:  # inotify, fanotify, native AIO
        assert _bpf_verdict(prog, nr, [0] * 6, audit) == "refused", nr
    for nr, (pid_arg, which_arg, which) in guarded.items():
        for pid, allowed in ((0, True), (4242, True), (77, False)):
            args = [0] * 6
            args[pid_arg] = pid
            if which_arg is not None:
                args[which_arg] = which
            want = "allow" if allowed and nr not in denied else "refused"
            assert _bpf_verdict(prog, nr, args, audit) == want, (nr, pid)


def test_a_preflight_import_cannot_move_itself_onto_the_timing_core():
    """`fixed_cores` (the pre-flight import, which no judge watches): its own CPU cores cannot
    change either, so it cannot spin on the core kept for another job's timing; everything else as
    for a runner."""
    got = _in_a_child(_confined_scheduling_changes, os.getpid(), True)
    assert got == "[True, False, False, False, True, True, False]", got


def test_a_runner_cannot_move_itself_to_another_core():
    """A runner's CPU set is the judge's to move: the candidate cannot change its own (the filter
    holds for every thread, including those the judge's scheduling check, which reads the main
    thread, would not see)."""
    probe = """
    try:
        os.sched_setaffinity(0, os.sched_getaffinity(0))
        print("MOVED")
    except OSError:
        print("REFUSED")
    """
    cand = relu_candidate("return launch(x)", extra="import os\n" + textwrap.dedent(probe))
    with Evaluator(cfg()) as ev:
        r = ev.evaluate(str(TASKS / "1_ReLU.py"), cand)
    assert r.verdict == "correct", (r.verdict, r.error)
    assert "REFUSED" in r.stdout and "MOVED" not in r.stdout, r.stdout


def test_a_candidate_reads_neither_the_callers_secrets_nor_the_hosts(monkeypatch):
    """The fork server inherits only what Python, the compilers, CUDA, Triton and torch read (no
    token in the environment, /proc/self/environ included); the user's home (beyond the Python
    path) and the host's secrets are out of the runner's reach."""
    import uuid
    token = uuid.uuid4().hex
    monkeypatch.setenv("DRK_TEST_API_TOKEN", token)
    home_file = os.path.join(os.path.realpath(os.path.expanduser("~")), f".drk_test_secret_{token}")
    with open(home_file, "w") as fh:
        fh.write(token)
    # /proc/<pid>/environ shows the environment a process started with: another process of this
    # user, started with the token, stands for the trainer
    host = subprocess.Popen(["sleep", "60"], env={**os.environ, "DRK_TEST_API_TOKEN": token})
    probe = f"""
    def _read(path):
        try:
            with open(path, "rb") as fh:
                return fh.read().decode("latin-1")
        except OSError as exc:
            return "denied " + type(exc).__name__
    print("ENV", dict(os.environ))
    print("PROC", _read("/proc/self/environ"))
    print("HOME", _read({home_file!r}))
    print("SHADOW", _read("/etc/shadow")[:40])
    print("LEAKS", [p for p in os.listdir("/proc") if p.isdigit() and {token!r} in _read(f"/proc/{{p}}/environ")])
    print("HOST", _read("/proc/{host.pid}/environ"))
    """
    cand = relu_candidate("return launch(x)", extra="import os\n" + textwrap.dedent(probe))
    try:
        with Evaluator(cfg()) as ev:
            r = ev.evaluate(str(TASKS / "1_ReLU.py"), cand)
    finally:
        os.unlink(home_file)
        host.kill()
        host.wait()
    assert r.verdict == "correct", (r.verdict, r.error)
    assert "HOST denied" in r.stdout and "LEAKS []" in r.stdout, r.stdout
    assert "ENV" in r.stdout and "PATH" in r.stdout and token not in r.stdout, r.stdout
    assert "HOME denied" in r.stdout, r.stdout
    if os.path.exists("/etc/shadow"):
        assert "SHADOW denied" in r.stdout, r.stdout
