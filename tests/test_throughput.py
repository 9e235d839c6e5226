"""The cache answers repeats, workers per GPU, deferred jobs, the pre-flight (CPU). Verdicts
across worker counts and group sizes: tests/test_groups.py."""

import time

import pytest

from drkernel.evaluator import EvalResult, Evaluator, _preflight_verdict, _Run, default_workers_per_gpu, rerun_alone
from drkernel.sandbox import SandboxResult
from tests.test_evaluator import LEGIT_RELU, TASKS, cfg, relu_candidate

RELU = (TASKS / "1_ReLU.py").read_text()
def _verdicts(results):
    return [(r.verdict, sorted(r.hacks)) for r in results]


def test_cache_answers_repeats_and_stamps_the_environment(tmp_path):
    pairs = [(RELU, LEGIT_RELU), (RELU, relu_candidate("return launch(x) * 2.0")), (RELU, LEGIT_RELU)]
    with Evaluator(cfg(cache_dir=str(tmp_path))) as ev:
        first = ev.evaluate_many(pairs)
        assert ev.cache.stats.misses == 2 and ev.cache.stats.hits == 0  # the duplicate ran once
        again = ev.evaluate_many(pairs)
        assert ev.cache.stats.hits == 2
    assert _verdicts(first) == _verdicts(again) == [("correct", []), ("incorrect", []), ("correct", [])]
    assert all(r.details["environment"]["device"] == "cpu" for r in first + again)
    assert all(r.details.get("cached") for r in again)
    assert again[0].reward == pytest.approx(first[0].reward)


@pytest.mark.parametrize("cpus, gpus, mem, want", [(16, 1, 139, 6), (16, 8, 139, 1), (2, 1, 139, 1),
                                                   (64, 1, 40, 2), (64, 1, 80, 4), (8, 1, 139, 4)])
def test_default_workers_per_gpu(cpus, gpus, mem, want):
    assert default_workers_per_gpu(cpus, gpus, mem) == want


def test_an_import_failure_is_decided_before_any_judge_or_gpu():
    """A module-level error in the candidate's own code ends in the GPU-less pre-flight import;
    an import that fails only for want of a GPU is left to the full job."""
    kernel = "import torch\nimport triton\n\n@triton.jit\ndef k(x_ptr):\n    pass\n\n"
    own_error = kernel + "BLOCK = UNDEFINED_SIZE\nclass ModelNew(torch.nn.Module):\n    pass\n"
    needs_gpu = kernel + "P = torch.cuda.get_device_properties(0)\nclass ModelNew(torch.nn.Module):\n    pass\n"
    with Evaluator(cfg()) as ev:
        own, gpu = ev.evaluate_many([(RELU, own_error), (RELU, needs_gpu)])
    assert own.verdict == "compile_error" and "NameError" in own.error and own.details.get("preflight")
    assert "phase_s" not in own.details  # no judge ran
    assert not gpu.details.get("preflight") and "phase_s" in gpu.details


@pytest.mark.parametrize("value, decided", [
    ({"type": "NameError", "raised_in_candidate": True, "error": "x"}, "compile_error"),
    ({"type": "ModuleNotFoundError", "raised_in_candidate": True, "error": "x"}, "compile_error"),
    ({"type": "NameError", "raised_in_candidate": False, "error": "x"}, None),  # raised inside a library
    ({"type": "RuntimeError", "raised_in_candidate": True, "error": "no CUDA GPUs"}, None),
    ({"type": "NameError", "raised_in_candidate": "yes"}, None),  # only a real True is believed
    ({"ok": True}, None),
    ("not a dict", None),
])
def test_preflight_verdict_believes_only_gpu_independent_failures(value, decided):
    res = _preflight_verdict(SandboxResult(status="ok", value=value))
    assert (res.verdict if res else None) == decided


def test_preflight_timeout_and_crash():
    assert _preflight_verdict(SandboxResult(status="timeout")).verdict == "timeout"
    assert _preflight_verdict(SandboxResult(status="signal", signal=11)) is None  # left to the full job


def _run(verdict="correct", hacks=(), start=0.0, end=1.0, error=None, **details):
    return _Run(EvalResult(verdict=verdict, hacks=list(hacks), error=error, details=details), start, end)


def test_rerun_alone_picks_what_a_neighbour_could_have_caused():
    runs = [_run(),                                                                   # 0 clean
            _run("crashed", error="torch.OutOfMemoryError: CUDA out of memory"),      # 1 OOM
            _run("timeout"),                                                          # 2 waited too long
            _run("timeout", preflight=True),                                          # 3 decided without a GPU
            _run("hacked", ["reference_slowed"]),                                     # 4 timing-based code
            _run("hacked", ["no_triton_kernel"]),                                     # 5 a code about itself
            _run("crashed", error="judge error: AcceleratorError: CUDA error: out of memory")]  # 6 OOM
    for k, run in enumerate(runs):  # one after another: no job overlaps another
        run.start, run.end = 10.0 * k, 10.0 * k + 5
    assert sorted(rerun_alone(runs)) == [1, 2, 4, 6]


def test_rerun_alone_takes_every_job_that_overlapped_an_escaping_candidate():
    runs = [_run("hacked", ["thread_spawned"], 10.0, 20.0),  # its own verdict stands
            _run("correct", (), 5.0, 11.0),                   # overlapped: re-run
            _run("incorrect", (), 19.0, 30.0),                # overlapped: re-run
            _run("correct", (), 0.0, 9.0),                    # before it: kept
            _run("correct", (), 21.0, 25.0)]                  # after it: kept
    why = rerun_alone(runs)
    assert sorted(why) == [1, 2] and "thread_spawned" in why[1]


class _Ref:
    """A reference module, as the judge imports one."""

    def __init__(self, model_cls, init, inputs):
        self.Model, self._init, self._inputs = model_cls, init, inputs

    def get_init_inputs(self):
        return self._init

    def get_inputs(self):
        return [f() for f in self._inputs]


def test_memory_estimate_counts_parameters_inputs_outputs_and_the_forward_peak_without_memory():
    import time

    import torch
    import torch._dynamo  # noqa: F401  (preloaded by the zygote; else the first meta forward imports for ~2 s)

    from drkernel.gpumemory import memory_estimate
    gib = 2**30
    linear = _Ref(torch.nn.Linear, [1024, 2048], [lambda: torch.rand(4096, 1024)])
    params, ins, outs = (1024 * 2048 + 2048) * 4, 4096 * 1024 * 4, 4096 * 2048 * 4
    fixed = 4 * gib  # three CUDA contexts and the reference outputs a group keeps
    assert memory_estimate(linear, 100 * gib) == 4 * params + 2 * ins + 5 * outs + fixed  # outs > ins; peak = the output

    class RMS(torch.nn.Module):  # x ** 2 is a full-size intermediate, freed before x / rms
        def forward(self, x):
            return x / torch.sqrt(torch.mean(x ** 2, dim=1, keepdim=True) + 1e-5)

    n = 64 * 1024 * 4
    rms = _Ref(RMS, [], [lambda: torch.rand(64, 1024)])
    assert memory_estimate(rms, 100 * gib) == 3 * n + 2 * n + 2 * (n + 64 * 4) + fixed

    class Chain(torch.nn.Module):  # three full-size tensors alive at once
        def forward(self, x):
            a = x + 1
            b = x * 2
            return (a * b).sum()

    chain = _Ref(Chain, [], [lambda: torch.rand(1024)])
    assert memory_estimate(chain, 100 * gib) == 3 * 4096 + 2 * 4 + 2 * (3 * 4096 + 4) + fixed  # a, b, a * b, the sum

    class Slow(torch.nn.Module):
        def forward(self, x):
            time.sleep(5)
            return torch.cat([x, x])

    slow = _Ref(Slow, [], [lambda: torch.rand(1 << 20)])
    t0 = time.perf_counter()
    assert memory_estimate(slow, 100 * gib) == 7 * (4 << 20) + fixed  # output and peak taken as large as the input
    assert time.perf_counter() - t0 < 3

    big = _Ref(torch.nn.ReLU, [], [lambda: torch.rand(2**29)])  # 2 GiB out: too large for the group's kept outputs
    assert memory_estimate(big, 100 * gib) == 2 * gib * (2 + 1 + 2 + 2) + 3 * gib

    class Broken(torch.nn.Module):
        def __init__(self):
            raise RuntimeError("needs a GPU")

    assert memory_estimate(_Ref(Broken, [], []), 100 * gib) == 50 * gib


def _ledger_holding(tmp_path, monkeypatch, nbytes: int):
    """A live neighbour (a sleeping process) that holds `nbytes` of GPU 0's memory ledger."""
    import subprocess

    monkeypatch.setenv("DRKERNEL_LOCK_DIR", str(tmp_path))
    neighbour = subprocess.Popen(["sleep", "30"])
    (tmp_path / "drkernel-device-0.memory").mkdir()
    (tmp_path / "drkernel-device-0.memory" / str(neighbour.pid)).write_text(str(nbytes))
    return neighbour


def test_a_job_whose_memory_does_not_fit_lets_the_next_one_go_first(tmp_path, monkeypatch):
    from drkernel.evaluator import _Job, _Queue
    neighbour = _ledger_holding(tmp_path, monkeypatch, 70)
    try:
        big, small, new = _Job(0, None, need=60, capacity=100), _Job(1, None, need=20, capacity=100), _Job(2, None)
        queue = _Queue([big, small, new], patience_s=0.3, poll_s=0.01)
        assert queue.take() is small  # 70 + 60 does not fit, 70 + 20 does
        assert queue.take() is new  # its need is not known yet: it asks its judge
        t0 = time.monotonic()
        assert queue.take() is big  # nothing else left: it waits, then goes and waits in its own job
        assert time.monotonic() - t0 >= 0.3
        assert queue.take() is None
    finally:
        neighbour.kill()
        neighbour.wait()


def test_a_worker_waits_for_memory_outside_any_job_until_a_neighbour_lets_go(tmp_path, monkeypatch):
    """Waiting inside a job counted against its time limit: on a full-size RL batch, jobs that
    waited for their neighbours' memory were judged `reference_error` (set-up past the timeout)."""
    import threading

    from drkernel.evaluator import _Job, _Queue
    neighbour = _ledger_holding(tmp_path, monkeypatch, 70)
    big = _Job(0, None, need=60, capacity=100)
    queue = _Queue([big], patience_s=30.0, poll_s=0.01)
    threading.Timer(0.3, lambda: (neighbour.kill(), neighbour.wait())).start()
    t0 = time.monotonic()
    try:
        assert queue.take() is big
        assert 0.3 <= time.monotonic() - t0 < 10
    finally:
        neighbour.kill()
        neighbour.wait()


def test_deferred_jobs_are_requeued_and_results_keep_their_order(monkeypatch):
    from drkernel.evaluator import _Job
    calls = []

    def fake_evaluate_group(self, preps, exclusive=False, defer=False):
        (prep,) = preps
        calls.append((prep, defer))
        if prep == "big" and defer:  # its judge gives it back: the memory is promised to others
            return [_Run(EvalResult(details={"deferred": {"memory_bytes": 10, "capacity_bytes": 100, "gpu": 0}}))]
        return [_Run(EvalResult(verdict="correct", details={"name": prep}))]

    monkeypatch.setattr(Evaluator, "_evaluate_group", fake_evaluate_group)
    with Evaluator(cfg(), workers=1) as ev:
        runs = ev._run_queue([_Job([k], [p]) for k, p in enumerate(["big", "a", "b"])], 3)
    assert [r.result.details["name"] for r in runs] == ["big", "a", "b"]
    assert calls == [("big", True), ("a", True), ("b", True), ("big", False)]  # the second time it waits
