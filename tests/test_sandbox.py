"""drkernel.sandbox: every way a job can end is classified, and the parent always survives.

One module-scoped ForkServer (with torch and triton preloaded) serves most tests; every
hostile job is followed by a normal one on the same server. Targets live in
tests/fixtures/sandbox/sbx_targets.py, reached through PYTHONPATH in the zygote's env.
"""

import os
import signal
import time
from pathlib import Path

import pytest

from drkernel.gpushare import device_lock
from drkernel.sandbox import ForkServer, SandboxLimits, SandboxPool, SandboxResult

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "sandbox"
ENV = {"PYTHONPATH": str(FIXTURES)}
T = "sbx_targets:"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _pids(path: Path) -> list[int]:
    return [int(p) for p in path.read_text().split()] if path.exists() else []


@pytest.fixture(scope="module")
def server():
    with ForkServer(env=ENV) as s:
        yield s


def assert_healthy(server):
    r = server.run(T + "ok", {"x": 7})
    assert r.status == "ok", r
    assert r.value["x"] == 7


def test_ok_private_dir_and_own_group(server):
    r = server.run(T + "ok", {"x": 3})
    assert isinstance(r, SandboxResult) and r.ok
    v = r.value
    assert v["x"] == 3 and v["pid"] != os.getpid()
    assert v["pgid"] == v["pid"]  # setsid: its own process group
    assert v["cwd"] == v["tmpdir"] and "drk_job_" in v["cwd"]
    assert not os.path.exists(v["cwd"])  # the private dir is removed afterwards
    assert r.exitcode == 0 and r.signal is None
    # the kernel's OOM killer takes a job before the trainer: memory no limit here sees (a mapped
    # memfd where /proc/<pid>/map_files is closed to this user) must not cost the host its biggest process
    assert v["oom_score_adj"] == 1000
    assert set(r.to_dict()) >= {"status", "value", "error", "traceback", "stdout", "stderr",
                                "exitcode", "signal", "wall_s"}


def test_torch_in_child_no_cuda_init_and_fast(server):
    server.run(T + "torch_add")  # warm-up
    t0 = time.perf_counter()
    r = server.run(T + "torch_add", {"n": 4})
    elapsed = time.perf_counter() - t0
    assert r.ok and r.value == {"sum": 12.0, "cuda_initialized": False}
    assert elapsed < 0.5, f"a trivial job took {elapsed:.2f} s: a cold import per job?"
    assert server.info["cuda_initialized"] is False and not server.info["preload_errors"]


def test_env_per_job(server):
    r = server.run(T + "echo_env", {"name": "DRK_SBX_TEST"}, env={"DRK_SBX_TEST": "hello"})
    assert r.ok and r.value == {"value": "hello"}
    r = server.run(T + "echo_env", {"name": "DRK_SBX_TEST"})
    assert r.ok and r.value == {"value": None}  # it does not leak into the next job


def test_exception_with_traceback(server):
    r = server.run(T + "raises")
    assert r.status == "exception"
    assert r.error == "ValueError: bad kernel"
    assert "inner" in r.traceback and "bad kernel" in r.traceback
    assert_healthy(server)


def test_import_error_is_exception(server):
    r = server.run("sbx_no_such_module:f")
    assert r.status == "exception" and r.error.startswith("ModuleNotFoundError")
    r = server.run(T + "no_such_function")
    assert r.status == "exception" and r.error.startswith("AttributeError")
    with pytest.raises(ValueError):
        server.run("no_colon_here")


def test_timeout_kills_group(server, tmp_path):
    pid_file = tmp_path / "pid"
    r = server.run(T + "sleep_forever", {"pid_file": str(pid_file)}, limits=SandboxLimits(timeout_s=1.5))
    assert r.status == "timeout" and r.signal == signal.SIGKILL
    assert 1.4 < r.wall_s < 5
    (grandchild,) = _pids(pid_file)
    assert not _alive(grandchild)
    assert_healthy(server)


def test_busy_loop_timeout(server):
    r = server.run(T + "busy_loop", limits={"timeout_s": 1.0})
    assert r.status == "timeout"
    assert_healthy(server)


@pytest.mark.parametrize("fn, code", [("hard_exit", 0), ("sys_exit", 3), ("raise_system_exit", 1)])
def test_exit_without_result(server, fn, code):
    r = server.run(T + fn)
    assert r.status == "exit_no_result" and r.exitcode == code and r.value is None
    assert_healthy(server)


def test_segfault(server):
    r = server.run(T + "segfault")
    assert r.status == "signal" and r.signal == signal.SIGSEGV and "SIGSEGV" in r.error
    assert_healthy(server)


def test_memory_hog_is_oom(server):
    r = server.run(T + "memory_hog", {"total_mb": 2000}, limits=SandboxLimits(max_rss_mb=400, timeout_s=20))
    assert r.status == "oom", r
    assert r.peak_rss_mb is not None and r.peak_rss_mb > 400
    assert_healthy(server)


def test_memory_error_is_oom(server):
    r = server.run(T + "memory_error")
    assert r.status == "oom" and "MemoryError" in r.error
    assert_healthy(server)


def test_huge_stdout_truncated(server):
    r = server.run(T + "huge_stdout", limits=SandboxLimits(max_output_chars=1000))
    assert r.ok and r.value == {"done": True}
    assert "chars truncated" in r.stdout and len(r.stdout) < 1200
    assert r.stdout.startswith("A" * 400) and r.stdout.rstrip().endswith("B" * 400)  # head and C-level tail
    assert "to stderr at fd level" in r.stderr


def test_oversized_result(server):
    r = server.run(T + "big_result", {"n": 2 * 2**20}, limits=SandboxLimits(max_result_bytes=2**20))
    assert r.status == "oversized_result" and r.value is None
    r = server.run(T + "big_result", {"n": 1000}, limits=SandboxLimits(max_result_bytes=2**20))
    assert r.ok and len(r.value["blob"]) == 1000


def test_non_json_result(server):
    r = server.run(T + "not_json")
    assert r.status == "exception" and "JSON" in r.error
    assert_healthy(server)


def test_too_many_processes(server, tmp_path):
    pid_file = tmp_path / "pids"
    r = server.run(T + "spawn_many", {"n": 30, "pid_file": str(pid_file)},
                   limits=SandboxLimits(max_procs=8, timeout_s=20))
    assert r.status == "exception" and "too many processes" in r.error
    pids = _pids(pid_file)
    # more than 8 is the job and 8 children; the 8th may be killed before it writes its pid
    assert len(pids) >= 7 and not any(_alive(p) for p in pids)
    assert_healthy(server)


def test_too_many_threads(server):
    """Threads count against the job too: a thread bomb is stopped like a fork bomb."""
    r = server.run(T + "spawn_threads", {"n": 200}, limits=SandboxLimits(max_threads=64, timeout_s=20))
    assert r.status == "exception" and "too many threads" in r.error, (r.status, r.error)
    assert_healthy(server)


def test_zygote_killed_externally(server):
    assert_healthy(server)
    old = server.pid
    os.kill(old, signal.SIGKILL)
    time.sleep(0.2)
    assert_healthy(server)  # restarted transparently (not counted as a failed job)
    assert server.pid != old


def test_child_kills_zygote(server):
    r = server.run(T + "kill_zygote", limits=SandboxLimits(timeout_s=10))
    assert r.status == "sandbox_error"
    assert_healthy(server)


def test_pool_runs_jobs_side_by_side_on_per_worker_envs():
    from concurrent.futures import ThreadPoolExecutor

    jobs = [dict(target=T + "slow", kwargs={"i": i, "delay": 0.3 if i % 2 == 0 else 0.0}) for i in range(6)]
    jobs.append(dict(target=T + "raises", limits={"timeout_s": 5}))
    with SandboxPool(2, env=ENV, per_worker_env=[{"DRK_W": "0"}, {"DRK_W": "1"}], preload=()) as pool:
        with ThreadPoolExecutor(max_workers=2) as ex:
            results = list(ex.map(lambda job: pool.run(**job), jobs))
        seen = {pool.run(T + "echo_env", {"name": "DRK_W"}).value["value"] for _ in range(4)}
        envs = sorted(s.env["DRK_W"] for s in pool.servers)
    assert [r.value["i"] for r in results[:6]] == list(range(6))
    assert results[6].status == "exception"
    assert envs == ["0", "1"] and seen <= {"0", "1"}


def test_a_pool_given_cores_runs_every_job_on_them():
    """The cores the evaluator keeps for timing (`gpushare.CorePlan.work` leaves them out) are out
    of every job's reach unless the judge moves a process there: the zygote takes its cores
    before it starts a thread, and jobs and their threads inherit them."""
    core = min(os.sched_getaffinity(0))
    with SandboxPool(1, env=ENV, preload=(), cores=frozenset({core})) as pool:
        got = pool.run(T + "affinity").value
    assert got == {"process": [core], "thread": [core]}, got
    with SandboxPool(1, env=ENV, preload=()) as pool:  # no plan: every core
        assert pool.run(T + "affinity").value["process"] == sorted(os.sched_getaffinity(0))


def test_core_plan_keeps_one_physical_core_per_gpu_for_timing():
    from drkernel.gpushare import CorePlan, plan_cores

    def smt(core):  # two hardware threads per physical core: c and c + 8
        return {core % 8, core % 8 + 8}
    sixteen = set(range(16))
    assert plan_cores([0], sixteen, smt) == CorePlan({0: 15}, frozenset(sixteen - {7, 15}))
    assert plan_cores([0, 1], sixteen, smt) == CorePlan({0: 15, 1: 14}, frozenset(sixteen - {6, 7, 14, 15}))
    assert plan_cores([1, 0, 1], sixteen, smt) == plan_cores([0, 1], sixteen, smt)  # by GPU number, in any process
    adjacent = plan_cores([0, 1], sixteen, lambda c: {c - c % 2, c - c % 2 + 1})  # siblings 14/15
    assert adjacent == CorePlan({0: 15, 1: 13}, frozenset(sixteen - {12, 13, 14, 15}))
    few = plan_cores([0], {0, 1, 2, 3}, smt)  # three left: too few to keep one apart
    assert few.timing == {0: 3} and few.work is None
    assert plan_cores([], sixteen, smt) == CorePlan({}, None)
    assert plan_cores([0], {5}, smt) == CorePlan({}, None)


def test_every_gpu_of_the_host_gets_its_timing_core_whatever_this_process_sees(monkeypatch):
    """An evaluator that sees only GPU 3 (one per rank) still plans, and keeps free, the cores of
    all the host's GPUs, numbered as the judges know them."""
    from drkernel import evalcache, evaluator
    monkeypatch.setattr(evalcache, "_nvidia_smi", lambda: (("H100", "580"),) * 4)  # nvidia-smi lists 4
    assert evaluator._host_gpu_numbers(["3"]) == [0, 1, 2, 3]
    assert evaluator._host_gpu_numbers(["GPU-uuid"]) == [0, 1, 2, 3]
    monkeypatch.setattr(evalcache, "_nvidia_smi", lambda: None)  # no nvidia-smi
    assert evaluator._host_gpu_numbers(["2", "5"]) == [0, 2, 5]


def test_device_lock_excludes(tmp_path, monkeypatch):
    import fcntl

    monkeypatch.setenv("DRKERNEL_LOCK_DIR", str(tmp_path))
    with device_lock(3) as path:
        assert path.endswith("drkernel-device-3.lock")
        fd = os.open(path, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        with pytest.raises(TimeoutError):
            with device_lock(3, timeout_s=0.05):
                pass
    with device_lock(3, timeout_s=0.5):
        pass


def test_memory_ledger_admits_what_fits_and_forgets_the_dead(tmp_path, monkeypatch):
    import subprocess
    import threading

    from drkernel.gpushare import MemoryLedger

    monkeypatch.setenv("DRKERNEL_LOCK_DIR", str(tmp_path))
    ledger = MemoryLedger(0, capacity_bytes=100)
    assert ledger.reserve(500) < 0.5  # alone on the GPU: admitted whatever it asks
    ledger.release()
    neighbour = subprocess.Popen(["sleep", "30"])
    try:
        (Path(ledger.dir) / str(neighbour.pid)).write_text("70")  # a live neighbour holds 70
        assert ledger.reserve(30) < 0.5  # 70 + 30 fits
        ledger.release()
        admitted = threading.Event()
        waiter = threading.Thread(target=lambda: (ledger.reserve(40, poll_s=0.01), admitted.set()))
        waiter.start()
        assert not admitted.wait(0.3)  # 70 + 40 does not
        neighbour.kill()
        neighbour.wait()
        assert admitted.wait(5)  # its share went with it
        waiter.join()
        assert not (Path(ledger.dir) / str(neighbour.pid)).exists()
        assert (Path(ledger.dir) / str(os.getpid())).read_text() == "40"
    finally:
        neighbour.kill()
        ledger.release()
    assert not (Path(ledger.dir) / str(os.getpid())).exists()


def test_cpu_time_limit(server):
    r = server.run(T + "busy_loop", limits=SandboxLimits(timeout_s=20, cpu_time_s=1))
    assert r.status == "timeout" and r.signal == signal.SIGXCPU and "CPU time" in r.error
    assert r.wall_s < 10


def test_cwd_is_honoured(server, tmp_path):
    r = server.run(T + "ok", cwd=str(tmp_path))
    assert r.ok and r.value["cwd"] == str(tmp_path) and r.value["tmpdir"] != str(tmp_path)


def test_zygote_killed_right_before_a_job(server):
    assert_healthy(server)
    os.kill(server.pid, signal.SIGKILL)  # no pause: the dead zygote is found while sending
    assert_healthy(server)


def test_memory_ledger_reserve_can_decline_instead_of_waiting(tmp_path, monkeypatch):
    import subprocess

    from drkernel.gpushare import MemoryLedger

    monkeypatch.setenv("DRKERNEL_LOCK_DIR", str(tmp_path))
    ledger = MemoryLedger(0, capacity_bytes=100)
    neighbour = subprocess.Popen(["sleep", "30"])
    try:
        (Path(ledger.dir) / str(neighbour.pid)).write_text("70")
        assert not ledger.fits(40) and ledger.fits(30)
        t0 = time.perf_counter()
        assert ledger.reserve(40, wait=False) is None
        assert time.perf_counter() - t0 < 0.5
        assert not (Path(ledger.dir) / str(os.getpid())).exists()  # nothing promised to a declined job
    finally:
        neighbour.kill()
        neighbour.wait()


def test_device_lock_writer_lets_readers_in_until_its_patience_runs_out(tmp_path, monkeypatch):
    import threading

    from drkernel.gpushare import DeviceLock

    monkeypatch.setenv("DRKERNEL_LOCK_DIR", str(tmp_path))
    first, second, late = DeviceLock(0), DeviceLock(0), DeviceLock(0)
    writer = DeviceLock(0, patience_s=0.5)
    first.acquire(alone=False)  # a reader is compiling
    got = threading.Event()
    thread = threading.Thread(target=lambda: (writer.acquire(alone=True), got.set()))
    thread.start()
    time.sleep(0.1)
    assert second.acquire(alone=False) < 0.1  # within the writer's patience readers still get in
    second.release()
    time.sleep(0.6)  # patience over: the writer holds the gate, so new readers queue behind it
    blocked = threading.Event()
    reader = threading.Thread(target=lambda: (late.acquire(alone=False), blocked.set()))
    reader.start()
    assert not blocked.wait(0.2) and not got.is_set()
    first.release()
    assert got.wait(5)
    assert not blocked.wait(0.2)  # the writer is alone
    writer.release()
    assert blocked.wait(5)
    late.release()
    thread.join()
    reader.join()
    assert writer.waited["alone"] >= 0.6 and first.waited["shared"] < 0.1
    for lock in (first, second, late, writer):
        lock.close()


def test_a_runner_whose_directory_outgrows_the_disk_limit_is_killed_alone(tmp_path):
    """Preallocated blocks count (a file of holes does not hide them) and the kill names why."""
    from drkernel import sandbox
    runner_dir = tmp_path / "runner1"
    runner_dir.mkdir()
    fd = os.open(runner_dir / "fill", os.O_CREAT | os.O_WRONLY)
    os.posix_fallocate(fd, 0, 3 * 2**20)
    os.close(fd)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the stand-in runner, in a group of its own
        os.setsid()
        time.sleep(30)
        os._exit(0)
    time.sleep(0.1)
    sandbox._kill_runners_over_disk([(str(runner_dir), pid)], limit_mb=4)
    assert os.waitpid(pid, os.WNOHANG) == (0, 0)  # under the limit: left alone
    sandbox._kill_runners_over_disk([(str(runner_dir), pid)], limit_mb=2)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert "more than 2 MB" in Path(sandbox.kill_note(str(runner_dir), pid)).read_text()


def test_files_a_runner_holds_open_with_no_name_count_toward_its_disk_limit(tmp_path):
    """A deleted file kept open, or a memfd (memory no process's RSS counts), is seen by no walk of
    the directory: both count as the runner's files."""
    from drkernel import sandbox
    runner_dir = tmp_path / "runner1"
    runner_dir.mkdir()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the stand-in runner: 2 MB deleted, 2 MB in a memfd
        os.setsid()
        fd = os.open(runner_dir / "gone", os.O_CREAT | os.O_WRONLY)
        os.posix_fallocate(fd, 0, 2 * 2**20)
        os.unlink(runner_dir / "gone")
        os.write(os.memfd_create("held"), b"x" * 2 * 2**20)
        os.write(ready_w, b"1")
        time.sleep(30)
        os._exit(0)
    os.read(ready_r, 1)
    sandbox._kill_runners_over_disk([(str(runner_dir), pid)], limit_mb=5)
    assert os.waitpid(pid, os.WNOHANG) == (0, 0)  # 4 MB: left alone
    sandbox._kill_runners_over_disk([(str(runner_dir), pid)], limit_mb=3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


@pytest.mark.skipif(not os.access("/proc/self/map_files", os.R_OK) or os.geteuid() != 0,
                    reason="/proc/<pid>/map_files needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE")
def test_a_memfd_kept_only_by_a_mapping_counts_toward_the_disk_limit(tmp_path):
    """A memfd filled, mapped read-only and closed: no descriptor, no RSS (no page touched), no
    name; only the mapping keeps it, and it counts."""
    import ctypes
    import mmap
    from drkernel import sandbox
    runner_dir = tmp_path / "runner1"
    runner_dir.mkdir()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the stand-in runner: 3 MB behind a mapping alone
        os.setsid()
        fd = os.memfd_create("hidden")
        os.posix_fallocate(fd, 0, 3 * 2**20)
        libc = ctypes.CDLL(None, use_errno=True)  # Python's mmap would keep a duplicate descriptor
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mmap(None, 4096, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)  # one page keeps all 3 MB
        os.close(fd)
        os.write(ready_w, b"1")
        time.sleep(30)
        os._exit(0)
    os.read(ready_r, 1)
    sandbox._kill_runners_over_disk([(str(runner_dir), pid)], limit_mb=4)
    assert os.waitpid(pid, os.WNOHANG) == (0, 0)  # under the limit: left alone
    sandbox._kill_runners_over_disk([(str(runner_dir), pid)], limit_mb=2)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def test_many_mappings_of_one_unnamed_file_are_looked_at_once():
    """60,000 mappings of one deleted file would cost the supervisor a stat each, every poll (half a
    second a poll, the job's limits biting late): one path per file, whatever its mappings."""
    import ctypes
    import mmap
    from drkernel import procfs
    libc = ctypes.CDLL(None, use_errno=True)  # Python's mmap objects would each keep a descriptor
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.memfd_create("mapped_often")
    os.ftruncate(fd, 2 * 4096)
    # alternate offsets so that the kernel cannot merge neighbouring mappings into one
    maps = [libc.mmap(None, 4096, mmap.PROT_READ, mmap.MAP_SHARED, fd, 4096 * (k % 2)) for k in range(300)]
    try:
        paths = [p for p in procfs._mapped_unnamed_files(os.getpid()) if "mapped_often" in os.readlink(p)]
        assert len(paths) == 1, len(paths)
    finally:
        for address in maps:
            libc.munmap(address, 4096)
        os.close(fd)
