"""The reward's evidence (docs/security.md): what the runner reports is bound to the request, frozen
at the reply, checked against the candidate's source and the judge's own observations. One test
per family; the hostile candidates are in tests/fixtures/hacks and tests/fixtures/attacks (the
corpus tests run every one of them), these tests check the mechanisms and what the fixtures leave.
"""

import json
import os
import signal
import socket
import struct
import textwrap
import threading
import time
from pathlib import Path

import pytest

from drkernel import integrity, ipc, judge, procfs
from drkernel.channel import Channel, Hacked, Stop
from drkernel.evaluator import ConfinementError, EvalConfig, Evaluator
from drkernel.sandbox import SandboxResult
from tests.test_evaluator import TASKS, cfg, shared_evaluate, shared_evaluate_many

ATTACKS = Path(__file__).resolve().parent / "fixtures" / "attacks"


def _channel(sock: int, pid: int) -> Channel:
    return Channel(sock=sock, pid=pid, dir="", deadline=time.monotonic() + 30)


def _reference() -> judge.Reference:
    return judge.Reference(cfg=EvalConfig(device="cpu"), reference_path="", twin=Channel(sock=-1, pid=0, dir=""))


def _fake_runner(reply_for, after_reply=None) -> tuple[int, socket.socket, int]:
    """A forked process in its own group that answers one request with `reply_for(msg)`, then runs
    `after_reply` (what a hostile runner does once it has answered)."""
    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.setsid()
        mine.close()
        msg = ipc.recv(theirs.fileno())
        ipc.send(theirs.fileno(), reply_for(msg))
        if after_reply is not None:
            after_reply()
        time.sleep(30)
        os._exit(0)
    theirs.close()
    time.sleep(0.1)  # its setsid has happened
    return pid, mine, mine.fileno()


def _reap(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


# ---- replies bound to requests ---------------------------------------------------------------

def test_a_reply_without_the_request_nonce_is_a_forged_reply():
    pid, sock, fd = _fake_runner(lambda msg: {"ok": True, "nonce": "guessed"})
    try:
        with pytest.raises(Hacked) as caught:
            _channel(fd, pid).ask({"op": "final"})
        assert caught.value.code == "forged_reply"
    finally:
        _reap(pid)


def test_a_frame_nested_past_the_parser_is_a_forged_reply_not_a_judge_error():
    mine, theirs = socket.socketpair()
    deep = b"[" * 200_000 + b"]" * 200_000
    theirs.sendall(struct.pack(">Q", len(deep)))
    threading.Thread(target=theirs.sendall, args=(deep,), daemon=True).start()
    with pytest.raises(Hacked) as caught:
        _channel(mine.fileno(), 0).receive()
    assert caught.value.code == "forged_reply"
    mine.close()
    theirs.close()


def test_data_after_the_reply_is_a_forged_reply():
    def two_answers(msg):
        return {"ok": True, "nonce": msg["nonce"], "pad": "x"}
    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child answers and, in the same write, adds an unasked reply
        os.setsid()
        msg = ipc.recv(theirs.fileno())
        body = json.dumps(two_answers(msg)).encode()
        os.write(theirs.fileno(), (struct.pack(">Q", len(body)) + body) * 2)
        time.sleep(30)
        os._exit(0)
    theirs.close()
    time.sleep(0.1)
    try:
        with pytest.raises(Hacked) as caught:
            _channel(mine.fileno(), pid).ask({"op": "final"})
        assert caught.value.code == "forged_reply" and "nobody asked" in caught.value.detail
    finally:
        _reap(pid)


def test_an_honest_reply_passes_and_the_runner_is_stopped_until_the_next_request():
    pid, sock, fd = _fake_runner(lambda msg: {"ok": True, "nonce": msg["nonce"]})
    try:
        reply = _channel(fd, pid).ask({"op": "final"})
        assert reply["ok"]
        assert procfs.stat(pid).state in ("T", "t")
    finally:
        _reap(pid)


# ---- what a call committed is frozen at the reply --------------------------------------------

def test_nothing_the_runner_does_after_its_reply_reaches_shared_memory(tmp_path):
    """The fake runner answers, then keeps writing a counter into a shared page: from the reply
    until the judge's next request, the page must not change."""
    import mmap
    page = mmap.mmap(-1, 8)

    def keep_writing():
        n = 0
        while True:
            n += 1
            page[:8] = n.to_bytes(8, "little")

    pid, sock, fd = _fake_runner(lambda msg: {"ok": True, "nonce": msg["nonce"]}, keep_writing)
    try:
        _channel(fd, pid).ask({"op": "final"})
        seen = bytes(page[:8])
        time.sleep(0.3)
        assert bytes(page[:8]) == seen
    finally:
        _reap(pid)


# ---- forged launch record: the evidence digest ----------------------------------------------

def test_a_patched_launch_recorder_is_caught_by_the_evidence_digest(monkeypatch):
    """The fixture reaches the launch hook's closure, patches the recorder's class to report a
    launch of its never-launched kernel and silences the runner's integrity report. With the static
    scan out of the way (an attacker may find a route it does not know), only the nonce-keyed digest
    of the runner's evidence machinery is left to catch it."""
    monkeypatch.setattr(integrity, "static_scan", lambda source, reference_path=None: [])
    code = (ATTACKS / "forge_launch_record.py").read_text()
    with Evaluator(cfg()) as ev:
        r = ev.evaluate(str(TASKS / "1_ReLU.py"), code)
    assert r.verdict == "hacked" and "patched_function" in r.hacks, (r.verdict, r.hacks, r.error)
    assert "replaced after the candidate was imported" in r.error


# ---- neighbours: a busy GPU is waited for before a measurement --------------------------------

class _FakeLock:
    mode = None
    waited = {"shared": 0.0, "alone": 0.0}

    def alone(self):
        import contextlib
        return contextlib.nullcontext()


def test_measurements_wait_until_the_gpu_is_idle(monkeypatch):
    probes = iter([5.0, 4.0, 3.0] + [0.01] * 10)  # a neighbour's kernel finishes after three probes
    r = _reference()
    r.gpu = _FakeLock()
    monkeypatch.setattr(judge, "_probe_ms", lambda r: next(probes))
    with judge._alone(r):
        pass
    assert next(probes) == 0.01 and r.details["idle_wait_s"] > 0 and "gpu_busy" not in r.details


def test_a_gpu_that_stays_busy_is_reported_and_the_job_rerun_alone(monkeypatch):
    from drkernel.evaluator import EvalResult, _Run, rerun_alone
    r = _reference()
    r.cfg.idle_wait_s = 0.05
    r.gpu = _FakeLock()
    monkeypatch.setattr(judge, "_probe_ms", lambda r: 9.0)
    with judge._alone(r):
        pass
    assert "still busy" in r.details["gpu_busy"]
    result = EvalResult(verdict="correct", details=dict(r.details))
    assert "busy" in rerun_alone([_Run(result, 0.0, 1.0)])[0]


# ---- the candidate's process holds no reference model --------------------------------------

def test_the_runner_keeps_no_reference_module():
    from tests.test_evaluator import LEGIT_RELU
    look = """
    import sys as _s
    _mods = [m for m in list(_s.modules.values()) if str(getattr(m, "__file__", "")).endswith("reference.py")]
    try:
        import _drk_runner_reference
        _mods.append(_drk_runner_reference)
    except ImportError:
        pass
    if _mods:
        raise RuntimeError(f"found the reference: {_mods}")
    """
    cand = LEGIT_RELU.replace("class ModelNew(nn.Module):", textwrap.dedent(look) + "\n\nclass ModelNew(nn.Module):")
    r = shared_evaluate(str(TASKS / "1_ReLU.py"), cand, cfg())
    assert r.verdict == "correct", (r.verdict, r.error)


# ---- what the runner leaves in its directory is read as data only -------------------------

def test_a_fifo_or_symlink_in_place_of_the_captured_output_is_read_as_nothing(tmp_path):
    """Both the pre-flight import and the runner replace their captured stdout by a FIFO (a reader
    that opens it blocks) and stderr by a symlink to a file the judge may read and they may not."""
    from tests.test_evaluator import LEGIT_RELU
    secret = tmp_path / "secret.txt"
    secret.write_text("drk-secret-0451")
    swap = f"""
    import os as _os
    _d = _os.path.dirname(_os.environ["TMPDIR"])
    for _name in ("stdout", "stderr"):
        try:
            _os.unlink(_os.path.join(_d, _name))
        except OSError:
            pass
    _os.mkfifo(_os.path.join(_d, "stdout"))
    _os.symlink({str(secret)!r}, _os.path.join(_d, "stderr"))
    """
    cand = LEGIT_RELU.replace("class ModelNew(nn.Module):", textwrap.dedent(swap) + "\n\nclass ModelNew(nn.Module):")
    t0 = time.monotonic()
    with Evaluator(cfg(timeout=60.0)) as ev:
        r = ev.evaluate(str(TASKS / "1_ReLU.py"), cand)
    assert r.verdict == "correct", (r.verdict, r.error)
    assert time.monotonic() - t0 < 45 and "drk-secret" not in (r.stdout or "") + (r.stderr or "")


def test_a_shared_memory_segment_made_by_the_candidate_does_not_outlive_its_job():
    """System V shared memory is not a file, so no job directory holds it: the runner (and the
    pre-flight import) get IPC namespaces of their own, which die with them."""
    import ctypes
    key = 0x5EED0000 + os.getpid() % 0xFFFF
    make = f"""
    import sys as _s
    _ct = _s.modules.get("".join(map(chr, (99, 116, 121, 112, 101, 115))))
    _libc = _ct.CDLL(None, use_errno=True)
    _sid = _libc.shmget({key}, 1 << 20, 0o1000 | 0o600)
    print("segment", _sid)
    """
    from tests.test_evaluator import LEGIT_RELU
    cand = LEGIT_RELU.replace("class ModelNew(nn.Module):", textwrap.dedent(make) + "\n\nclass ModelNew(nn.Module):")
    r = shared_evaluate(str(TASKS / "1_ReLU.py"), cand, cfg())
    libc = ctypes.CDLL(None, use_errno=True)
    left = libc.shmget(key, 0, 0)
    if left >= 0:
        libc.shmctl(left, 0, None)  # IPC_RMID: leave this machine as it was
    assert r.verdict == "correct" and "segment" in r.stdout, (r.verdict, r.error, r.stdout)
    assert left < 0, "the candidate's segment outlived its job"


def test_a_candidate_over_the_memory_limit_is_killed_alone_and_its_group_goes_on():
    from tests.test_evaluator import LEGIT_RELU, relu_candidate
    hog = relu_candidate("self.hold = torch.ones(800_000_000)  # 3.2 GB, every page touched\nreturn launch(x)")
    ref = str(TASKS / "1_ReLU.py")
    with Evaluator(cfg(max_rss_mb=3000)) as ev:
        results = ev.evaluate_many([(ref, LEGIT_RELU), (ref, hog), (ref, LEGIT_RELU)])
    assert [r.verdict for r in results] == ["correct", "crashed", "correct"], [(r.verdict, r.error) for r in results]
    assert "killed: it used more memory than the job allows" in results[1].error


_SLEEPERS = """
                if os.fork() == 0:
                    os.setsid()
                    time.sleep(30)
                    os._exit(0)"""
_ZOMBIES = """
                os.posix_spawn("/bin/true", ["true"], {})  # never reaped: each holds a pid"""


_ORPHANS = """
                if os.fork() == 0:  # re-parented to the zygote: each a tree of one, as the judge's own is
                    if os.fork() == 0:
                        time.sleep(30)
                    os._exit(0)
                os.wait()"""


@pytest.mark.parametrize("spawn", [_SLEEPERS, _ZOMBIES, _ORPHANS],
                         ids=["sleepers_leaving_the_group", "zombies", "orphans_of_the_zygote"])
def test_a_process_bomb_is_killed_alone_and_its_group_goes_on(spawn):
    """Over the job's process limit (zombies count: they hold pids), the tree of the runner that
    started them is killed, even the members that left its group, not the whole job with every
    candidate's result."""
    from tests.test_evaluator import LEGIT_RELU, relu_candidate
    bomb = relu_candidate(f"""
        if not hasattr(self, "forked"):
            self.forked = True
            for _ in range(70):  # over the job's 64{spawn}
            time.sleep(0.5)  # the supervisor's turn
        return launch(x)""", extra="import os\nimport time\n")
    ref = str(TASKS / "1_ReLU.py")
    results = shared_evaluate_many([(ref, LEGIT_RELU), (ref, bomb), (ref, LEGIT_RELU)], cfg())
    assert results[0].verdict == results[2].verdict == "correct", [(r.verdict, r.error) for r in results]
    assert results[0].details["overhead_s"]["group"] > 1, "the group's job ended: its candidates were judged again"
    assert results[1].verdict in ("crashed", "hacked"), (results[1].verdict, results[1].error)
    assert "it started more processes than the job allows" in results[1].error, results[1].error


_LEADER = r"""
import ctypes, os, sys, threading, time
runner = int(sys.argv[1])
def keep_forking():  # once its runner is gone, children that look like the next candidate's
    while os.path.exists(f"/proc/{runner}/task"):
        time.sleep(0.01)
    for _ in range(3000):
        if os.fork() == 0:
            if os.fork() == 0:
                time.sleep(0.5)
            os._exit(0)
        os.wait()
        time.sleep(0.02)
threading.Thread(target=keep_forking).start()
ctypes.CDLL(None).syscall(60, 0)  # the main thread exits: /proc says "Z", the thread runs on
"""


def test_a_process_that_reads_as_a_zombie_but_runs_a_thread_is_found_and_killed():
    """A process whose main thread exited reads as a zombie in /proc/<pid>/stat while its other
    threads run: it counts as alive, it is the candidate's stray, and it is killed with its turn."""
    from tests.test_evaluator import LEGIT_RELU, relu_candidate
    leader = relu_candidate(f"""
        if not hasattr(self, "planted"):
            self.planted = True
            runner = os.getpid()
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    os.execv(sys.executable, [sys.executable, "-c", {_LEADER!r}, str(runner)])
                os._exit(0)
            os.wait()
            time.sleep(0.5)
        return launch(x)""", extra="import os\nimport sys\nimport time\n")
    ref = str(TASKS / "1_ReLU.py")
    results = shared_evaluate_many([(ref, leader), (ref, LEGIT_RELU), (ref, LEGIT_RELU + "# another\n")], cfg())
    assert results[0].verdict == "hacked" and "thread_spawned" in results[0].hacks, (results[0].verdict, results[0].error)
    assert [r.verdict for r in results[1:]] == ["correct", "correct"], [(r.verdict, r.error) for r in results]


def test_what_a_candidate_leaves_running_or_unreaped_is_never_blamed_on_the_next():
    """A daemon left by a constructor that then raises, and the zombies of a killed runner's
    children, end with that candidate's turn: the next candidates are judged as if alone."""
    from tests.test_evaluator import LEGIT_RELU, relu_candidate
    leaver = relu_candidate("return launch(x)", extra="import os\nimport time\n", init="""def __init__(self):
        super().__init__()
        for _ in range(3):
            if os.fork() == 0:  # an unreaped child: a zombie once it exits
                os._exit(0)
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                while True:
                    time.sleep(0.01)
            os._exit(0)
        time.sleep(0.2)
        raise RuntimeError("constructor failed")""")
    ref = str(TASKS / "1_ReLU.py")
    results = shared_evaluate_many([(ref, leaver), (ref, LEGIT_RELU), (ref, LEGIT_RELU)], cfg())
    assert results[0].verdict == "runtime_error", (results[0].verdict, results[0].error)
    assert [r.verdict for r in results[1:]] == ["correct", "correct"], [(r.verdict, r.error) for r in results]


def test_a_candidates_files_are_gone_before_the_next_candidate_runs(tmp_path):
    """Disk held by a group is one runner's at a time: each runner's directory goes with its turn."""
    import glob
    import tempfile
    import uuid
    from tests.test_evaluator import LEGIT_RELU, relu_candidate
    tag = uuid.uuid4().hex
    first = relu_candidate("return launch(x)", extra=f"open('first_{tag}', 'w').write('x' * 4096)\n")
    second = relu_candidate("return launch(x)", extra="import time\n", init=f"""def __init__(self):
        super().__init__()
        open('second_{tag}', 'w').close()
        time.sleep(2)""")
    pattern = os.path.join(tempfile.gettempdir(), "drk_job_*", "runner*", "{}_" + tag)
    seen: list[list[str]] = []

    def watch():
        end = time.monotonic() + 120
        while not glob.glob(pattern.format("second")) and time.monotonic() < end:
            time.sleep(0.05)
        seen.append(glob.glob(pattern.format("first")))
    watcher = threading.Thread(target=watch)
    watcher.start()
    ref = str(TASKS / "1_ReLU.py")
    results = shared_evaluate_many([(ref, first), (ref, second), (ref, LEGIT_RELU)], cfg())
    watcher.join()
    assert [r.verdict for r in results] == ["correct"] * 3, [(r.verdict, r.error) for r in results]
    assert seen == [[]], "the first candidate's files were still there during the second one's turn"


@pytest.mark.parametrize("status", ["timeout", "sandbox_error"])
def test_a_job_that_ends_without_an_answer_is_judged_again_one_candidate_a_job(monkeypatch, status):
    """No candidate takes the ending of a whole group's job, a limit's or the sandbox's own error
    (one candidate's files broke its clean-up): each is judged again in its own."""
    from tests.test_evaluator import LEGIT_RELU
    with Evaluator(cfg()) as ev:
        run = ev.pool.run

        def groups_fail(target, kwargs=None, **kw):
            if len((kwargs or {}).get("candidate_paths", ())) > 1:
                return SandboxResult(status=status, error="the group's job ended without an answer")
            return run(target, kwargs, **kw)
        monkeypatch.setattr(ev.pool, "run", groups_fail)
        ref = str(TASKS / "1_ReLU.py")
        results = ev.evaluate_many([(ref, LEGIT_RELU), (ref, LEGIT_RELU + "# another text: not deduplicated\n")])
    assert [r.verdict for r in results] == ["correct", "correct"], [(r.verdict, r.error) for r in results]


# ---- the lock and memory files and other jobs' files are out of reach --------------------------

def test_a_runner_can_neither_take_a_gpu_lock_nor_list_other_jobs(monkeypatch):
    from drkernel.gpushare import DeviceLock
    lock_dir = Path("/tmp") / f"drk-test-locks-{os.getpid()}"
    monkeypatch.setenv("DRKERNEL_LOCK_DIR", str(lock_dir))
    DeviceLock(0).close()  # the lock files exist
    try:
        with Evaluator(cfg()) as ev:
            r = ev.evaluate(str(TASKS / "1_ReLU.py"), (ATTACKS / "lock_squat.py").read_text())
        assert r.verdict == "correct", (r.verdict, r.error)
        assert "squat: denied" in r.stdout and "jobs: denied" in r.stdout, r.stdout
    finally:
        for f in lock_dir.glob("*"):
            f.unlink() if f.is_file() else None
        for d in lock_dir.glob("*"):
            d.rmdir()
        lock_dir.rmdir()


# ---- threads and confinement ----------------------------------------------------------------

def test_python_threads_include_those_started_with_the_low_level_api():
    import _thread
    before = integrity.python_threads()
    started = []
    _thread.start_new_thread(lambda: (started.append(1), time.sleep(1.0)), ())
    time.sleep(0.1)
    assert started and len(integrity.python_threads() - before) == 1


def test_the_evaluator_refuses_to_start_unconfined_unless_told(monkeypatch):
    from drkernel import sandbox
    real = sandbox.SandboxPool.run

    def no_landlock(self, target, kwargs=None, **kw):
        if sandbox.target_name(target) == "drkernel.confine:probe":
            return SandboxResult("ok", value={"complete": False, "errors": ["Landlock unavailable"]})
        return real(self, target, kwargs, **kw)
    monkeypatch.setattr(sandbox.SandboxPool, "run", no_landlock)
    with pytest.raises(ConfinementError, match="Landlock unavailable.*require_confinement"):
        Evaluator(cfg())
    Evaluator(cfg(require_confinement=False)).close()


def _flow_judge() -> judge.Judge:
    from drkernel.triton_source import Kernel
    j = judge.Judge(ref=_reference(), runner=Channel(sock=-1, pid=0, dir=""), candidate_path="")
    j.kernels = {"scratch_kernel": Kernel("scratch_kernel", ("x_ptr", "out_ptr"), frozenset({"out_ptr"}))}
    return j


def test_a_data_flow_log_cut_short_is_no_evidence():
    """A launch that wrote only a scratch buffer (key 5) while torch wrote the output (key 9): a
    log marked truncated must not spare the candidate the replay's verdict."""
    log = {"events": [judge.dataflow.Event("scratch_kernel", kernel="scratch_kernel", args=[("out_ptr", 5)]).to_list(),
                      judge.dataflow.Event("relu", reads=[1], fresh=[9]).to_list()], "outputs": [9],
           "output_spans": []}
    with pytest.raises(Hacked) as err:
        judge._judge_flow(_flow_judge(), 0, {**log, "truncated": True}, {"scratch_kernel"}, 1)
    assert err.value.code == "decoy_kernel" and "cannot be told" in err.value.detail


def test_the_launch_record_must_match_the_data_flow_log():
    log = {"events": [judge.dataflow.Event("relu", reads=[1], fresh=[9]).to_list()], "outputs": [9], "output_spans": [],
           "truncated": False}
    with pytest.raises(Hacked) as err:  # a launch reported that the log never saw
        judge._judge_flow(_flow_judge(), 0, log, {"scratch_kernel"}, 1)
    assert err.value.code == "forged_reply"
    launch = judge.dataflow.Event("scratch_kernel", kernel="scratch_kernel", args=[("out_ptr", 9)]).to_list()
    judge._judge_flow(_flow_judge(), 0, {**log, "events": [launch]}, {"scratch_kernel"}, 1)  # they agree
    with pytest.raises(Hacked) as err:  # launches added to the log that the launch hook never saw
        judge._judge_flow(_flow_judge(), 0, {**log, "events": [launch] * 20}, {"scratch_kernel"}, 1)
    assert err.value.code == "forged_reply"


def test_a_launch_that_changed_nothing_or_missed_the_output_does_not_make_it_needed():
    """Changes tracked by storage checksums: a store of the values already there is no write, and
    a change past the output's bytes (same storage) does not reach the output."""
    import torch
    from drkernel import dataflow
    buf = torch.rand(5000)
    before = dataflow.block_sums(buf)
    buf[0] = buf[0].item()  # stored back as it was
    assert dataflow.changed_span(before, dataflow.block_sums(buf), buf.untyped_storage().nbytes()) is None
    buf[4999] += 1.0
    lo, hi = dataflow.changed_span(before, dataflow.block_sums(buf), buf.untyped_storage().nbytes())
    assert lo <= 4999 * 4 < hi <= 5000 * 4 and lo >= 4096
    before = dataflow.block_sums(buf)
    buf[1030:1040] = buf[1030:1040].flip(0).clone()  # the same values, moved within one block
    assert dataflow.changed_span(before, dataflow.block_sums(buf), buf.untyped_storage().nbytes()) == (4096, 8192)

    def launch(changed):
        return dataflow.Event("k", kernel="k", args=[("out_ptr", 9)], changed=changed)
    torch_op = dataflow.Event("relu", reads=[1], over=[9])
    stores = {"k": frozenset({"out_ptr"})}
    assert dataflow.needed_launches([torch_op, launch(None)], [9], stores) == [True]  # not tracked: a store counts
    assert dataflow.needed_launches([torch_op, launch([])], [9], stores) == [False]  # it changed nothing
    past = [("out_ptr", 16384, 16388)]  # the word behind an output of 16384 bytes
    assert dataflow.needed_launches([torch_op, launch(past)], [9], stores, {9: (0, 16384)}) == [False]
    assert dataflow.needed_launches([torch_op, launch([("out_ptr", 0, 4096)])], [9], stores, {9: (0, 16384)}) == [True]
    wire = launch(past).to_list()
    assert dataflow.Event.from_list(wire).changed == past


def test_the_data_flow_replay_is_linear_in_the_log():
    """Thousands of launches that each write part of one buffer (a log a candidate can make long on
    purpose, under MAX_EVENTS) replay in well under a second, not in time and memory squared."""
    from drkernel import dataflow
    events = [dataflow.Event("k", kernel="k", args=[("o", 9)]) for _ in range(8000)]
    t0 = time.perf_counter()
    assert all(dataflow.needed_launches(events, [9], {"k": frozenset({"o"})}))
    assert time.perf_counter() - t0 < 2.0


def test_launch_patterns_are_learnt_from_checked_calls_and_required_of_the_others():
    from drkernel import launch_pattern
    def sig(grid="(4,)", n="S:4096", seed="S:1", out="out0"):
        return [[f"k{grid}", "x=T:torch.float32:(8,):(1,):in0", f"y=T:torch.float32:(8,):(1,):{out}",
                 f"n={n}", f"seed={seed}"]]
    p = launch_pattern.Patterns()
    assert p.learn(sig(grid="(64,)"))  # the first checked call may autotune or cache
    assert p.learn(sig(seed="S:2")) and p.learn(sig(seed="S:3"))
    assert not p.learn(sig(grid="(1,)"))  # a later checked call launched otherwise
    assert p.allows(sig(seed="S:99"))  # a scalar that changed between checked calls may change
    assert not p.allows(sig(n="S:0"))  # one that never did may not
    assert not p.allows(sig(out="own"))  # the kernel wrote a buffer that is not the output
    assert not p.allows([])  # no launch at all
    assert not p.allows(sig(grid="(64,)"))  # the first call's own pattern: never checked again
    assert p.same_launches(sig(seed="S:7"), sig(seed="S:8"))  # two calls on the same inputs; a seed may differ
    assert not p.same_launches(sig(n="S:0"), sig())  # a scalar no checked call changed
    assert not p.same_launches(sig(out="own"), sig()) and not p.same_launches(None, sig())
    with pytest.raises(ValueError):
        p.allows([["k(4,)", 5]])
    only = launch_pattern.Patterns()
    assert only.learn(sig(grid="(64,)")) and only.allows(sig(grid="(64,)"))  # a single checked call


def test_a_launch_pattern_describes_arguments_by_their_exact_type():
    """A subclass's own repr or stride cannot make it look like the checked calls' argument."""
    import torch
    from drkernel import launch_pattern

    class Shown(int):
        def __repr__(self):
            return "4096"
    weight = torch.nn.Parameter(torch.ones(2, 3))
    (described,) = launch_pattern.describe([("k", (4,), {"n": Shown(0), "m": 4096, "w": weight})], id, [], [])
    assert described == ["k(4,)", "n=O:test_a_launch_pattern_describes_arguments_by_their_exact_type.<locals>.Shown",
                         "m=S:4096", "w=T:torch.float32:(2, 3):(3, 1):own", "w.offset=S:0"]


def test_a_switch_after_thousands_of_launches_is_another_pattern():
    """A forward that launches a few thousand tiny kernels first cannot hide a switch behind them."""
    from drkernel import launch_pattern

    def forward(last_n: int) -> list:
        launches = [("tiny", (1,), {"n": 1})] * 3000 + [("relu", (4,), {"n": last_n})]
        return launch_pattern.describe(launches, id, [], [])
    p = launch_pattern.Patterns()
    assert p.learn(forward(4096)) and p.learn(forward(4096)) and not p.allows(forward(0))


def test_dtypes_jitted_helpers_numpy_scalars_and_offsets_are_described_by_value():
    """A switch carried by any argument a launch may take is another pattern: `MODE=tl.float32`
    (work) against `tl.int8` (skip), a helper that works against one that does nothing, a numpy
    length, a view at another offset of the same buffer."""
    import numpy as np
    import torch
    import triton.language as tl

    from drkernel import launch_pattern

    def work():
        pass

    def idle():
        pass

    class Jitted:  # Triton's JITFunction keeps the def it wraps as `fn`
        def __init__(self, fn):
            self.fn = fn

    buf = torch.zeros(8)
    switches = [(tl.float32, tl.int8), (torch.float32, torch.int8), (Jitted(work), Jitted(idle)),
                (np.int64(4), np.int64(0)), (buf[:4], buf[4:])]
    for checked, timed in switches:
        a, b = (launch_pattern.describe([("k", (4,), {"v": v})], id, [], []) for v in (checked, timed))
        assert a != b, (checked, timed, a)
        p = launch_pattern.Patterns()
        assert p.learn(a) and p.learn(a) and not p.allows(b)
    # an offset that moved between checked calls may move (a ring of buffers, a row picked by data)
    ring = [launch_pattern.describe([("k", (4,), {"v": buf[i:i + 4]})], id, [], []) for i in (0, 4, 0)]
    p = launch_pattern.Patterns()
    assert p.learn(ring[0]) and p.learn(ring[1]) and p.learn(ring[2]) and p.allows(ring[1])


def test_scalars_inside_tuples_and_constexprs_are_part_of_the_pattern():
    """Triton passes tuples of arguments through; a length hidden in `(n,)` or a `constexpr` is a
    scalar like any other: `(0,)` in the timed calls (every lane masked off) is another pattern."""
    import triton.language as tl

    from drkernel import launch_pattern
    (described,) = launch_pattern.describe([("k", (4,), {"n": (4096, (2, "a")), "B": tl.constexpr(64)})], id, [], [])
    assert described == ["k(4,)", "n.0=S:4096", "n.1.0=S:2", "n.1.1=S:'a'", "B.value=S:64"]
    checked, timed = (launch_pattern.describe([("k", (4,), {"n": (n,)})], id, [], []) for n in (4096, 0))
    p = launch_pattern.Patterns()
    assert p.learn(checked) and p.learn(checked) and not p.allows(timed)


def test_launch_arguments_are_of_exact_known_types_all_the_way_down():
    """Nothing Triton asks of an argument inside the launch may be the candidate's Python."""
    import types

    import torch
    import triton.language as tl

    from drkernel import runner
    allowed = runner._launch_argument_types()
    t = torch.ones(3)

    class Shown(int):
        pass
    shadowed = torch.ones(3)
    shadowed.data_ptr = lambda: 0
    assert [allowed.foreign(v) for v in (t, torch.nn.Parameter(t), (t, 3, tl.constexpr(4)), tl.float16, None, "x",
                                         t.shape)] == [None] * 7
    assert allowed.foreign(Shown(1)).endswith("Shown")
    assert allowed.foreign(tl.constexpr(Shown(1))).endswith("Shown")  # what a constexpr holds
    assert allowed.foreign((t, (Shown(1),))).endswith("Shown")
    assert "attributes of its own" in allowed.foreign(shadowed)
    assert allowed.foreign(types.SimpleNamespace(data_ptr=t.data_ptr, dtype=t.dtype)) == "SimpleNamespace"
    import triton
    assert allowed.foreign(triton.reinterpret(t, tl.int32)) is None  # Triton's own view of a tensor
    assert allowed.foreign(triton.reinterpret(shadowed, tl.int32)).endswith("attributes of its own")
    forged = triton.reinterpret(t, tl.int32)
    forged.data_ptr = lambda: 0
    assert "fields of its own" in allowed.foreign(forged)
    moved = triton.reinterpret(t, tl.int32)
    moved.shape = (1 << 20,)
    assert "fields of its own" in allowed.foreign(moved)


def test_recorded_launches_the_device_never_ran_are_a_forged_record():
    j = _flow_judge()
    j.last_launches = {"scratch_kernel": 2, "helper": 1}
    judge._launches_ran(j, [("scratch_kernel", 2, 40.0), ("ampere_sgemm", 1, 9.0)], 0)  # both ran
    judge._launches_ran(j, [], 0)  # no trace (the profiler failed): nothing to hold it against
    with pytest.raises(Hacked) as err:
        judge._launches_ran(j, [(" scratch_kernel", 1, 40.0)], 1)
    assert err.value.code == "forged_reply" and "2 launch(es) of scratch_kernel recorded, 1 ran" in err.value.detail


def test_device_kernels_that_borrow_a_candidate_kernels_name_void_the_share():
    """A kernel of the candidate's named exactly like a library's kernel (cuBLAS's, or one torch.compile
    generates): in a profiled call the device runs that name more often than the candidate launched
    it, and the library's time would count as the candidate's. The share is not believed; the name
    itself is no offence (an honest kernel may be called anything)."""
    j = _flow_judge()
    j.flow.calls = [[("scratch_kernel", True)]]
    j.last_launches = {"scratch_kernel": 1}
    j.kernels["ampere_sgemm_128x64_nn"] = j.kernels["scratch_kernel"]
    calls = judge._PROFILED_CALLS
    for i in range(calls):  # its own launch, then cuBLAS's kernel of the same name
        judge._launches_ran(j, [("scratch_kernel", 1, 5.0), ("ampere_sgemm_128x64_nn", 1, 900.0)], i)
    rows = [("scratch_kernel", calls, 5.0 * calls), ("ampere_sgemm_128x64_nn", calls, 900.0 * calls)]
    summary = judge.profiling.summarize_kernels(rows, set(j.kernels))
    assert "ampere_sgemm_128x64_nn ran more often" in judge._profile_doubt(j, summary, rows, wall_ms=10.0 * calls)
    j.borrowed.clear()
    judge._launches_ran(j, [("scratch_kernel", 1, 5.0)], 0)
    assert judge._profile_doubt(j, summary, rows[:1], wall_ms=10.0 * calls) is None


def test_a_profile_that_disagrees_with_the_checked_calls_is_not_believed():
    """Profiled calls are verified like checked ones; what their traces claim must also fit what
    the judge saw: no more launches a call than a checked call made, no more kernel time than a
    whole timed call took."""
    j = _flow_judge()
    j.flow.calls = [[("scratch_kernel", True)]]
    j.out.candidate_ms = 1.0
    calls = judge._PROFILED_CALLS
    honest = [("scratch_kernel", calls, 900.0 * calls), ("ampere_sgemm", calls, 50.0)]
    summary = judge.profiling.summarize_kernels(honest, set(j.kernels))
    assert judge._profile_doubt(j, summary, honest, wall_ms=10.0 * calls) is None
    busier = [("scratch_kernel", 50 * calls, 900.0 * calls)]
    assert "launched" in judge._profile_doubt(j, summary, busier, wall_ms=10.0 * calls)
    assert "claim" in judge._profile_doubt(j, summary, honest, wall_ms=0.5)


def test_own_kernels_busier_a_profiled_call_than_a_whole_timed_call_mean_the_timed_calls_ran_less():
    """A candidate that runs its kernels where it is checked or profiled and something faster where
    it is timed: its profiled kernel time cannot fit in its timed calls."""
    j = _flow_judge()
    j.out.candidate_ms = 1.0
    calls = judge._PROFILED_CALLS
    judge._timed_calls_ran_them(j, [900.0] * calls)
    assert j.out.hacks == []  # its own kernels fit
    judge._timed_calls_ran_them(j, [5000.0] * calls)
    assert j.out.hacks == ["launch_pattern_changed"] and "timed calls" in j.details["hack_details"][0]


def _profile_with(monkeypatch, own_us, works: bool = True) -> judge.Judge:
    """`judge.profile` where each profiled call's trace holds `own_us(signed)` µs of the candidate's
    kernel and 50 µs of torch's (`own_us` may raise instead, or give None: no trace); the kinds asked are kept in
    `j.details["asked"]`; `works`: whether the twin's profiled call gave a trace."""
    j = _flow_judge()
    j.flow.calls = [[("scratch_kernel", True)]]
    j.out.candidate_ms = 10.0
    j.ref.profiler_works = works

    def profiled(j_, seed, mode, signed=False, keep=False):
        j.details.setdefault("asked", []).append(signed)
        j.last_launches = {"scratch_kernel": 1}  # what the recorder saw the call launch
        us = own_us(signed)
        reply = {} if us is None else {"profile": {"rows": [["scratch_kernel", 1, us], ["ampere_sgemm", 1, 50.0]]}}
        return judge.Call(reply=reply, wall_ms=10.0, inputs=[], seed=seed, signed=signed)

    monkeypatch.setattr(judge.Reference, "cuda", property(lambda self: True))
    monkeypatch.setattr(judge, "call_candidate", profiled)
    monkeypatch.setattr(judge, "verify", lambda j_, c, label: None)
    judge.profile(j)
    return j


def test_own_kernels_must_do_the_same_work_on_both_kinds_of_inputs(monkeypatch):
    """A candidate that can tell KernelBench's uniform inputs from signed normals lets torch answer
    on the kind the data flow does not follow closely and runs its kernel for show (a guard against
    the counterfactual's perturbed reads), its real work only on the other kind: one profiled call
    of the three, at a random place, gets signed inputs, and its own kernels' time must match."""
    honest = _profile_with(monkeypatch, lambda signed: 3000.0)
    assert honest.details["asked"].count(True) == 1 and honest.out.hacks == []
    assert honest.out.triton_time_share == pytest.approx(3000 / 3050)
    places = {_profile_with(monkeypatch, lambda signed: 3000.0).details["asked"].index(True) for _ in range(40)}
    assert places == set(range(judge._PROFILED_CALLS))  # the candidate cannot know which call it is
    skips = _profile_with(monkeypatch, lambda signed: 3000.0 if signed else 4.0)
    assert skips.out.hacks == ["launch_pattern_changed"] and "one kind of inputs" in skips.details["hack_details"][0]
    # microsecond kernels move by microseconds
    assert _profile_with(monkeypatch, lambda signed: 9.0 if signed else 4.0).out.hacks == []


def test_a_profiled_call_that_fails_where_the_profiler_works_fails_the_candidate(monkeypatch):
    """Raising in a profiled call (or sending no trace) would skip every check that only the profile
    makes (the kinds' work, the timed calls' margin): once the twin's profiled call has shown that
    the profiler works here, that failure is the candidate's verdict. Where it does not work, the
    candidate has no share and keeps its verdict."""
    def raises(signed):
        if signed:
            raise Stop("runtime_error", "forward raised RuntimeError: CUPTI_ERROR_NOT_INITIALIZED")
        return 4.0
    with pytest.raises(Stop) as err:
        _profile_with(monkeypatch, raises)
    assert err.value.verdict == "runtime_error" and "CUPTI" in err.value.error
    broken = _profile_with(monkeypatch, raises, works=False)
    assert "CUPTI" in broken.details["profile_error"] and broken.out.triton_time_share is None
    with pytest.raises(Stop) as err:
        _profile_with(monkeypatch, lambda signed: None)
    assert "no kernel trace" in err.value.error


def test_the_profiler_probe_trusts_only_a_trace_of_the_twin(monkeypatch):
    r = _reference()
    monkeypatch.setattr(judge.Reference, "cuda", property(lambda self: True))
    for reply, works in (({"profile": {"rows": [["ampere_sgemm", 1, 9.0]]}}, True), ({}, False)):
        monkeypatch.setattr(judge, "call", lambda *a, reply=reply: judge.Call(reply=reply, wall_ms=1.0, inputs=[], seed=0))
        judge.probe_profiler(r)
        assert r.profiler_works is works and r.details["profiler_works"] is works

    def fails(*a):
        raise Stop("runtime_error", "the profiler failed")
    monkeypatch.setattr(judge, "call", fails)
    judge.probe_profiler(r)  # a failing profiler is the machine's: no candidate is blamed
    assert r.profiler_works is False


def test_a_changed_scheduling_of_the_twin_is_caught_and_undone():
    """Where the seccomp layer is missing, a runner that renices the reference's timing process
    during its call is caught after it, and the nice value is put back."""
    import subprocess
    procs = [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
    try:
        j = judge.Judge(ref=judge.Reference(cfg=EvalConfig(device="cpu"), reference_path="",
                                            twin=Channel(sock=-1, pid=procs[1].pid, dir="")),
                        runner=Channel(sock=-1, pid=procs[0].pid, dir=""), candidate_path="")
        j.sched = judge._scheduling(j)
        before = judge._scheduling(j)
        judge._check_scheduling(j, before)  # nothing changed
        os.setpriority(os.PRIO_PROCESS, procs[1].pid, 19)
        with pytest.raises(Hacked) as err:
            judge._check_scheduling(j, before)
        assert err.value.code == "reference_slowed"
        assert os.getpriority(os.PRIO_PROCESS, procs[1].pid) == before[procs[1].pid][1]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_runner_stays_on_the_timing_core_for_its_whole_hold_of_the_gpu():
    """Pinned only while timed, a runner reading its CPU set (or the core it runs on) would know its
    timed calls from its profiled ones and work only where the profile looks: the timed and the
    profiled calls share one hold of the GPU, and the twin and runner stay pinned for all of it."""
    import subprocess
    procs = [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
    try:
        j = judge.Judge(ref=judge.Reference(cfg=EvalConfig(device="cpu"), reference_path="",
                                            twin=Channel(sock=-1, pid=procs[1].pid, dir="")),
                        runner=Channel(sock=-1, pid=procs[0].pid, dir=""), candidate_path="")
        wide, j.ref.core = os.sched_getaffinity(procs[0].pid), max(os.sched_getaffinity(0))
        seen = []

        def look(j_):
            seen.append((os.sched_getaffinity(procs[0].pid), os.sched_getaffinity(procs[1].pid)))
        judge._run((look, (look, look), look), j, j.ref, "gpu_alone_s")
        pinned = ({j.ref.core}, {j.ref.core})
        assert seen == [(wide, wide), pinned, pinned, (wide, wide)]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_turn_ends_only_once_its_strays_are_gone(monkeypatch):
    """A killed child that held gigabytes stays in /proc for a while (its memory is freed first):
    ended sooner, the turn leaves it to be found in the next candidate's and blamed on it
    (`thread_spawned`, cached). A stray here stays for 0.4 s after the runner is gone."""
    import subprocess

    from drkernel import channel
    runner = subprocess.Popen(["sleep", "30"], start_new_session=True)
    gone_at = time.monotonic() + 0.4
    ghost = next(p for p in range(4_000_000, 4_100_000) if not os.path.exists(f"/proc/{p}"))
    monkeypatch.setattr(channel.Channel, "strays", lambda self: [ghost] if time.monotonic() < gone_at else [])
    try:
        Channel(sock=-1, pid=runner.pid, dir="").kill()
        assert time.monotonic() >= gone_at
    finally:
        runner.kill()
        runner.wait()


def test_each_profiled_call_frees_its_buffers_before_the_next(monkeypatch):
    """At full KernelBench sizes one more input/output pair is more than a GPU holds (level 1's
    L1Norm on an 80 GB card): a profiled call's inputs and output copy die before the next call
    draws new ones."""
    import weakref

    import torch

    j, held = _flow_judge(), []

    def profiled(j_, seed, mode, signed=False, keep=False):
        assert all(ref() is None for ref in held), "an earlier profiled call's output is still held"
        output = torch.zeros(4)
        held.append(weakref.ref(output))
        return judge.Call(reply={}, wall_ms=1.0, inputs=[torch.zeros(4)], seed=seed, output=output)

    monkeypatch.setattr(judge.Reference, "cuda", property(lambda self: True))
    monkeypatch.setattr(judge, "call_candidate", profiled)
    monkeypatch.setattr(judge, "verify", lambda j_, c, label: None)
    judge.profile(j)
    assert len(held) == judge._PROFILED_CALLS and "profile_error" not in j.details


def test_the_calibration_stand_in_is_made_once_so_no_null_call_pays_its_copy(monkeypatch, tmp_path):
    """The judge's clock allowance is what a null call costs beyond the runner's own time; a null
    call that also cloned an output-sized tensor made it larger than any real call's (about 4 ms
    on a 6 GiB output: room for a forged timer). The stand-in's tensors are made once."""
    import torch

    from drkernel import compare, confine, runner

    made = []

    class Counted(runner._NullForward):
        def __init__(self, slots):
            made.append(1)
            super().__init__(slots)

    monkeypatch.setattr(runner, "_NullForward", Counted)
    r = runner.Runner(str(tmp_path), confine.Confinement())
    r.torch, r.device, r.recorder = torch, torch.device("cpu"), runner.LaunchRecorder(str(tmp_path / "c.py"))
    r.inputs, r.slots, r.keys = [torch.ones(8)], [torch.zeros(8)], runner.dataflow.Keys()
    r.numerics = integrity.NumericsWatch()
    r.structure = json.loads(json.dumps(compare.structure(torch.zeros(8)), default=str))
    for seed in range(3):
        reply = r.call({"op": "call", "mode": "null", "seed": seed})
        assert "error" not in reply and "mismatch" not in reply, reply
    assert len(made) == 1


def test_a_launch_on_host_memory_is_refused_on_a_gpu_run(tmp_path):
    """A GPU kernel can read and write pinned host memory: kernels that only copy to and from it
    would be all the device trace shows (a share of 1.0) while torch computes on the CPU."""
    import types

    import torch

    from drkernel import runner
    kernel = types.SimpleNamespace(pre_run_hooks=[])
    for device_type, refused in (("cpu", False), ("cuda", True)):
        rec = runner.LaunchRecorder(str(tmp_path / "c.py"), device_type)
        rec.argument_types = runner._launch_argument_types()
        rec.guard.problem = lambda kernel, arguments: None  # the kernel object's own checks: test_launch_guard.py
        rec.guard.options_problem = lambda kernel, kwargs: None
        why = rec._refused(kernel, {"x_ptr": torch.ones(4), "n": 4}, {})
        assert (why is not None) == refused, why
    assert "x_ptr is a tensor on cpu, not on the run's cuda" in rec._refused(kernel, {"x_ptr": (torch.ones(2),)}, {})


def test_the_runner_keeps_no_checked_output_alive_but_still_sees_a_cached_one(tmp_path):
    """A checked call's output is not held until the next call (a 6 GiB output held twice kept
    jobs from sharing a GPU); a storage the candidate itself keeps and returns again is still
    `reuses_previous_output`, one it let go is not."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    from drkernel import compare, confine, dataflow, runner

    class Model:
        kept = None
        cache = False
        dlpack = False

        def __call__(self, x):
            out = Model.kept if Model.cache and Model.kept is not None else x * 2
            Model.kept = out if Model.cache else None
            if Model.dlpack:  # a new storage object over the same kept memory each call
                out = torch.from_dlpack(out)
            Model.last = StorageWeakRef(out.untyped_storage())
            return out

    r = runner.Runner(str(tmp_path), confine.Confinement())
    r.torch, r.device, r.recorder = torch, torch.device("cpu"), runner.LaunchRecorder(str(tmp_path / "c.py"))
    r.inputs, r.slots, r.model = [torch.ones(8)], [torch.zeros(8)], Model()
    r.structure = json.loads(json.dumps(compare.structure(torch.zeros(8)), default=str))
    r.keys, r.numerics = dataflow.Keys(), integrity.NumericsWatch()
    r.integrity = lambda where: []
    for cache in (False, True):
        Model.cache = cache
        replies = [r.call({"op": "call", "mode": "check", "seed": s}) for s in range(2)]
        assert Model.last.expired() != cache
        assert replies[1]["reuses_previous_output"] is cache, replies[1]
    Model.dlpack, Model.kept = True, None
    replies = [r.call({"op": "call", "mode": "check", "seed": s}) for s in range(2)]
    assert replies[1]["reuses_previous_output"] is True, replies[1]


def test_a_numerics_flag_turned_on_inside_a_call_is_seen(tmp_path):
    """TF32 turned on around torch's matmul and off before forward returns: nothing is left for the
    after-call snapshot, so a checked call asks at every torch op; a flag left on after a call of
    any kind (a timed one too) is a finding of that call."""
    import torch

    from drkernel import compare, confine, dataflow, runner

    class Model(torch.nn.Module):
        restore = True

        def forward(self, x):
            mm = torch.backends.cuda.matmul
            old, mm.allow_tf32 = mm.allow_tf32, True
            y = x * 2
            if Model.restore:
                mm.allow_tf32 = old
            return y

    r = runner.Runner(str(tmp_path), confine.Confinement())
    r.torch, r.device, r.recorder = torch, torch.device("cpu"), runner.LaunchRecorder(str(tmp_path / "c.py"))
    r.inputs, r.slots, r.model = [torch.ones(8)], [torch.zeros(8)], Model()
    r.structure = json.loads(json.dumps(compare.structure(torch.zeros(8)), default=str))
    r.keys, r.integrity = dataflow.Keys(), lambda where: []
    torch.backends.cuda.matmul.allow_tf32 = False  # as the runner's init leaves it
    r.numerics = integrity.NumericsWatch()
    try:
        assert r.call({"op": "call", "mode": "time", "seed": 0}).get("findings") is None
        found = r.call({"op": "call", "mode": "check", "seed": 0})["findings"]
        assert found[0][0] == "global_state_changed" and "inside a checked call" in found[0][1], found
        Model.restore = False
        found = r.call({"op": "call", "mode": "time", "seed": 1})["findings"]
        assert found[0][0] == "global_state_changed" and "after a time call" in found[0][1], found
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


def test_waiting_for_other_jobs_memory_does_not_use_up_the_references_time():
    """A job that waited for its neighbours' GPU memory had its reference judged too slow: the
    group's alarm pauses while it waits, and the twin's deadline moves on by the wait; the memory
    estimate's own short alarm gives the group's back (it once cancelled it)."""
    import signal

    import torch

    from drkernel.gpumemory import memory_estimate

    class Ref:
        Model = torch.nn.ReLU

        @staticmethod
        def get_init_inputs():
            return []

        @staticmethod
        def get_inputs():
            return [torch.rand(8)]

    r = judge.Reference(cfg=EvalConfig(), reference_path="", twin=Channel(sock=None, pid=0, dir=""))
    r.twin.deadline = 100.0
    with judge._reference_deadline(60.0):
        with judge._deadlines_paused(r):
            time.sleep(0.3)
        paused, _ = signal.getitimer(signal.ITIMER_REAL)
        memory_estimate(Ref, 2**40)
        left, _ = signal.getitimer(signal.ITIMER_REAL)
    assert 59.9 < paused <= 60.0
    assert 50.0 < left < paused
    assert 100.3 <= r.twin.deadline < 110.0
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0


def test_a_recurrence_in_torch_at_kernelbench_length_fits_the_data_flow_log():
    """KernelBench's level-3 GRU/LSTM problems run 512 steps, 6 layers, 2 directions: an honest
    candidate with Triton input projections and the recurrence in torch ops (13 a step) logs about
    80,000 events. The log must hold them (a cut log is `decoy_kernel`) and its wire form fit a
    runner message."""
    import torch

    from drkernel import dataflow
    log = dataflow.FlowLog(dataflow.Keys())
    h, w, b = torch.zeros(2, 8), torch.randn(8, 24), torch.randn(24)
    gi, out = torch.randn(512, 2, 24), torch.empty(512, 2, 16)
    with torch.no_grad(), log:
        for d in range(12):  # layers x directions
            for t in range(512):
                i_r, i_z, i_n = gi[t].chunk(3, 1)
                h_r, h_z, h_n = torch.addmm(b, h, w).chunk(3, 1)
                r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
                h = (1 - z) * torch.tanh(i_n + r * h_n) + z * h
                out[t, :, d % 2 * 8:(d % 2 + 1) * 8] = h
    assert len(log.events) > 75_000 and not log.truncated
    assert len(json.dumps([e.to_list() for e in log.events])) < ipc.MAX_MESSAGE // 2
