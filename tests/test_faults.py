"""The fault fixtures (tests/fixtures/faults/*.py): kernels that break the device, not the rules.

Each file's header names its task and the verdict expected on its device (`# device: cuda`).
What they test on a GPU (a device-side assert, an illegal address that poisons the child's CUDA
context) cannot happen on a CPU. What the CPU can check, through the Triton interpreter, is the
part that matters to training: the same file ends with a failing verdict and a zero reward, never
an exception in the judge, and the evaluator still evaluates the next candidate correctly. There
the device assert's launch fails at `torch.cuda.synchronize()` (runtime_error) and the illegal
store makes the interpreter write outside the process's memory (the child dies: crashed).
"""

import os
import re
from pathlib import Path

import pytest
import torch

from drkernel.evaluator import EvalConfig, Evaluator
from drkernel.rewards import compute_reward

ROOT = Path(__file__).resolve().parent.parent
FAULTS = sorted((ROOT / "tests" / "fixtures" / "faults").glob("*.py"))
TASKS = ROOT / "drkernel" / "data" / "tasks"
SOLUTIONS = ROOT / "drkernel" / "data" / "solutions"
CPU_VERDICTS = ("runtime_error", "crashed")  # a fault the interpreter hits: an exception, or the child dies


def headers(path: Path) -> dict[str, str]:
    found = (re.match(r"#\s*(task|expect|device)\s*:\s*(.+?)\s*$", line) for line in path.read_text().splitlines())
    return {m.group(1): m.group(2) for m in found if m}


def test_every_fault_fixture_has_a_task_and_an_expected_verdict():
    assert len(FAULTS) >= 2
    for path in FAULTS:
        h = headers(path)
        assert (TASKS / h["task"]).is_file() and h["expect"] and h["device"], (path.name, h)


@pytest.fixture(scope="module")
def cpu_results():
    """Every fault on one CPU sandbox worker, then the task's bundled solution on the same worker."""
    pairs = [(str(TASKS / headers(p)["task"]), str(p)) for p in FAULTS]
    pairs.append((str(TASKS / "1_ReLU.py"), str(SOLUTIONS / "1_ReLU.py")))
    evaluator = Evaluator(EvalConfig(device="cpu", trials=2, cpu_perf_trials=1, warmup=1, timeout=120.0), workers=1)
    try:
        return evaluator.evaluate_many(pairs)
    finally:
        evaluator.close()


@pytest.mark.parametrize("index", range(len(FAULTS)), ids=[p.stem for p in FAULTS])
def test_fault_fails_cleanly_on_cpu(cpu_results, index):
    r = cpu_results[index]
    assert r.verdict in CPU_VERDICTS, (r.verdict, r.error)
    assert not r.correct and r.speedup is None and r.error and not r.hacks
    assert compute_reward(r).reward == 0.0


def test_the_evaluator_recovers_after_the_faults(cpu_results):
    good = cpu_results[-1]
    assert good.verdict == "correct" and good.correct, good.error


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the faults' own verdicts need a CUDA device")
@pytest.mark.parametrize("path", FAULTS, ids=lambda p: p.stem)
def test_fault_verdict_on_gpu(path):
    h = headers(path)
    evaluator = Evaluator(EvalConfig(device="cuda", trials=2), workers=1)
    try:
        r, good = evaluator.evaluate_many([(str(TASKS / h["task"]), str(path)),
                                           (str(TASKS / "1_ReLU.py"), str(SOLUTIONS / "1_ReLU.py"))])
    finally:
        evaluator.close()
    assert r.verdict == h["expect"], (r.verdict, r.error)
    assert good.verdict == "correct", good.error


HANGING_REFERENCE = '''import time
import torch


class Model(torch.nn.Module):
    def forward(self, x):
        while True:
            time.sleep(0.1)


def get_inputs():
    return [torch.randn(8)]


def get_init_inputs():
    return []
'''


def test_a_hanging_reference_is_the_references_failure():
    """A reference that never returns ends the group's phases at the timeout as `reference_error`
    (not blamed on the candidate as a timeout), within the timeout plus start-up."""
    with Evaluator(EvalConfig(device="cpu", trials=1, cpu_perf_trials=1, warmup=1, timeout=4.0), workers=1) as ev:
        r = ev.evaluate(HANGING_REFERENCE, (SOLUTIONS / "1_ReLU.py").read_text())
    assert r.verdict == "reference_error" and "timeout" in r.error, (r.verdict, r.error)
    assert r.details["overhead_s"]["job"] < 4.0 + 3.0, r.details["overhead_s"]


# ---- one candidate's files, the disk and the reference's twin never fail the others -----------

DEEP_TREE = ROOT / "tests" / "fixtures" / "attacks" / "deep_tree.py"


def _chain(top: Path, levels: int) -> None:
    """`levels` directories nested in `top` and a file at the bottom, made as a candidate makes them:
    by relative names, so that no path used is longer than one name."""
    home = os.getcwd()
    try:
        os.chdir(top)
        for _ in range(levels):
            os.mkdir("a")
            os.chdir("a")
        Path("payload").write_bytes(b"\1" * 4096)
    finally:
        os.chdir(home)


def test_a_tree_too_deep_for_python_or_for_a_path_is_deleted_and_counted_over_the_limit(tmp_path):
    """Deleting never recurses (a chain deeper than the recursion limit, and than the longest path);
    a directory that cannot be read, nested past the longest path, is over any disk limit."""
    from drkernel import ipc
    from drkernel.sandbox import _disk_mb
    _chain(tmp_path, 2500)  # 5000 characters of path
    (tmp_path / "shut").mkdir()
    (tmp_path / "shut" / "f").write_text("x")
    (tmp_path / "shut").chmod(0)
    assert _disk_mb(str(tmp_path)) == float("inf")
    assert ipc.remove_tree(str(tmp_path)) and not tmp_path.exists()
    assert ipc.remove_tree(str(tmp_path))  # already gone


def test_a_deep_tree_left_by_a_candidate_costs_no_one_else_their_verdict(tmp_path, monkeypatch):
    """A candidate that leaves a tree deeper than Python's recursion limit in its directory is
    judged in its group like any other: its files are deleted with its turn, its group-mates keep
    their verdicts, and the job leaves no directory behind."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the fork server's jobs keep their files
    relu, solution = str(TASKS / "1_ReLU.py"), (SOLUTIONS / "1_ReLU.py").read_text()
    with Evaluator(EvalConfig(device="cpu", trials=1, cpu_perf_trials=1, warmup=1), workers=1) as ev:
        results = ev.evaluate_many([(relu, solution), (relu, DEEP_TREE.read_text()), (relu, solution + "# another\n")])
    assert [r.verdict for r in results] == ["correct"] * 3, [(r.verdict, r.error) for r in results]
    assert [r.details["overhead_s"]["group"] for r in results] == [3] * 3  # one job, never judged again
    assert not list(tmp_path.glob("drk_job_*"))


def test_the_arena_holds_its_disk_from_the_start(tmp_path, monkeypatch):
    """The CPU arena's blocks are allocated when it is made: a full disk is an error there, never a
    SIGBUS in the first process that writes a page of a sparse file."""
    import errno

    from drkernel import ipc
    layout = ipc.plan([torch.zeros(3 << 20)], [torch.zeros(3 << 20)])
    ipc.allocate(layout, torch.device("cpu"), str(tmp_path))
    assert (tmp_path / "arena.bin").stat().st_blocks * 512 >= layout.nbytes

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="No space left on device"):
        ipc.allocate(layout, torch.device("cpu"), str(tmp_path))


UNCOMPILABLE_REFERENCE = '''import torch
import torch._inductor.config

# no C++ compiler: the twin's torch.compile of Model fails at its first call, as on a full disk
torch._inductor.config.cpp.cxx = ("/nonexistent/c++",)


class Model(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(8)]


def get_init_inputs():
    return []
'''


def test_a_reference_that_fails_in_its_timing_process_is_the_references_failure():
    """With `baseline="compile"` the twin compiles the reference at its first call; a compile that
    fails there is `reference_error` for every candidate, never their `runtime_error`."""
    config = EvalConfig(device="cpu", trials=1, cpu_perf_trials=1, warmup=1, baseline="compile")
    with Evaluator(config, workers=1) as ev:
        results = ev.evaluate_many([(UNCOMPILABLE_REFERENCE, (SOLUTIONS / "1_ReLU.py").read_text()),
                                    (UNCOMPILABLE_REFERENCE, (SOLUTIONS / "1_ReLU.py").read_text() + "# another\n")])
    for r in results:
        assert r.verdict == "reference_error" and "timing process" in r.error, (r.verdict, r.error)


def test_a_reference_out_of_gpu_memory_says_where_the_judges_memory_is(monkeypatch):
    """A CUDA out-of-memory error in the reference's code (its inputs, its forward) carries what the
    judge's own process holds on the GPU, so that one run shows what took the memory."""
    from drkernel import judge

    class OutOfMemoryError(RuntimeError):  # torch's, by name: this machine has no CUDA
        pass

    monkeypatch.setattr(judge, "_memory_holders", lambda: "allocated 1.00 GiB, reserved 9.00 GiB")
    for exc, suffix in ((OutOfMemoryError("CUDA out of memory"), " [allocated 1.00 GiB, reserved 9.00 GiB]"),
                        (ValueError("bad shape"), "")):
        with pytest.raises(judge.Stop) as stop:
            with judge._reference_fails("the reference's get_inputs() failed"):
                raise exc
        assert stop.value.verdict == "reference_error" and stop.value.error.endswith(str(exc) + suffix), stop.value.error


def test_timed_calls_held_for_verification_keep_no_inputs(monkeypatch):
    """Small outputs are verified a block at a time; the candidate calls held until then must not
    keep their inputs (8 GiB each on level 1's reductions: five of them ran the judge out of GPU
    memory)."""
    import types

    from drkernel import judge
    held_inputs = []
    monkeypatch.setattr(judge, "_twin_ms", lambda r, seed, keep=False: judge.Call(
        reply={}, wall_ms=1.0, inputs=[object()], seed=seed, output="ref", ms=1.0))
    monkeypatch.setattr(judge, "_candidate_ms", lambda j, seed, label: judge.Call(
        reply={}, wall_ms=1.0, inputs=[object()], seed=seed, output="out", ms=1.0))
    monkeypatch.setattr(judge, "_verify_held", lambda j, held: (held_inputs.extend(c.inputs for c, _, _ in held),
                                                                held.clear()))
    monkeypatch.setattr(judge, "_precise_enough", lambda j, ref_ms, cand_ms: False)
    monkeypatch.setattr(judge, "_unwatched_probe", lambda j: None)
    ref = types.SimpleNamespace(perf_n=6, out_views=[])
    j = types.SimpleNamespace(ref=ref, cfg=types.SimpleNamespace(timing_block_calls=3))
    ref_ms, _, events, _ = judge._timed_pairs(j)
    assert len(ref_ms) == len(events) == 6 and len(held_inputs) == 6
    assert all(inputs == [] for inputs in held_inputs)


def test_the_unwatched_counterfactual_pair_runs_with_no_timed_call_held(monkeypatch):
    """The extra pair draws full-size inputs and keeps two outputs, as a timed pair does: nothing of
    the timed calls before it may still be alive then (RMSNorm and L2Norm ran out of GPU memory)."""
    import gc
    import types
    import weakref

    from drkernel import judge
    made, alive_at_probe = [], []

    def call(*args, **kwargs):
        c = judge.Call(reply={}, wall_ms=1.0, inputs=[object()], seed=0, output=object(), ms=1.0)
        made.append(weakref.ref(c))
        return c

    def probe(j, kernel, label):
        gc.collect()
        alive_at_probe.append(sum(r() is not None for r in made))

    monkeypatch.setattr(judge, "_twin_ms", call)
    monkeypatch.setattr(judge, "_candidate_ms", call)
    monkeypatch.setattr(judge, "_verify_held", lambda j, held: held.clear())
    monkeypatch.setattr(judge, "_precise_enough", lambda j, ref_ms, cand_ms: False)
    monkeypatch.setattr(judge, "_unwatched_probe", lambda j: "kernel")
    monkeypatch.setattr(judge, "_unwatched_counterfactual", probe)
    for _ in range(4):  # the pair's place is drawn at random
        made.clear()
        judge._timed_pairs(types.SimpleNamespace(ref=types.SimpleNamespace(perf_n=5, out_views=[]),
                                                 cfg=types.SimpleNamespace(timing_block_calls=5)))
    assert alive_at_probe == [0, 0, 0, 0]


@pytest.mark.parametrize("unwatched, watched, needed, flagged, launches", [
    ("right", "right", True, False, "k(4,)"),  # an honest kernel whose perturbation this draw does not show
    ("wrong", "wrong", True, False, "k(4,)"),  # an honest kernel: the perturbation shows alike in both
    ("wrong", "fails", True, True, "k(4,)"),  # the re-check repeats the pair's inputs: failing there alone is a tell
    ("wrong", "wrong", False, True, "k(4,)"),  # one torch-made wrong answer in both: made by no launch
    ("right", "wrong", True, True, "k(4,)"),  # torch answers unwatched, the kernel when watched
    ("right", "fails", True, True, "k(4,)"),
    ("wrong", "wrong elsewhere", True, True, "k(4,)"),  # the kernel's work reaches a sliver of the output unwatched
    ("right", "right", False, True, "k(4,)"),  # an idle launch beside torch: right in both, nothing changed
    ("right", "right", True, True, "k(8,)"),  # a repeated input known: launched otherwise where checked
])
def test_an_unwatched_counterfactual_is_a_decoy_only_where_a_watched_one_on_its_inputs_disagrees(
        monkeypatch, unwatched, watched, needed, flagged, launches):
    """The pair among the timed calls perturbs a kernel whose checked counterfactual moved the
    output; a checked call on the same inputs and perturbation follows. A kernel that does its work
    in every call answers both alike (and, where right, its launches changed the output); one that
    works only when watched does not. Both calls are on uniform inputs, like the timed ones, and the
    checked one tracks what each launch changed."""
    import types

    from drkernel import compare, judge, launch_pattern
    asked = []

    def candidate(j, seed, mode, signed=False, keep=False, perturb=(), changes=False):
        asked.append((mode, signed, changes))
        out = unwatched if mode == "time" else watched
        if out == "fails":
            raise judge.Stop("runtime_error", "raised on perturbed data")
        return judge.Call(reply={"kernels": ["k"], "flow": {}}, wall_ms=1.0, inputs=[], seed=seed, output=out,
                          pattern=[["k(4,)" if mode == "time" else launches, "n=S:4"]])

    monkeypatch.setattr(judge, "call", lambda *a, **k: judge.Call(reply={}, wall_ms=1.0, inputs=[], seed=0,
                                                                  output="ref"))
    monkeypatch.setattr(judge, "call_candidate", candidate)
    monkeypatch.setattr(judge, "_check_left_idle", lambda j, label: None)
    monkeypatch.setattr(judge, "_own_kernels", lambda j, names: set(names or ()))
    monkeypatch.setattr(judge, "_launch_needs", lambda j, label, flow, tracked=True: ([], [], [("k", needed)]))
    monkeypatch.setattr(compare, "compare", lambda out, ref, cfg, **kw: compare.Match(
        out == "right" if ref == "ref" else out == ref, ""))
    hacks = []
    j = types.SimpleNamespace(ref=types.SimpleNamespace(twin=None), cfg=None, patterns=launch_pattern.Patterns(),
                              hack=lambda code, detail, stop=True: hacks.append(code))
    judge._unwatched_counterfactual(j, "k", "the pair")
    assert hacks == (["decoy_kernel"] if flagged else [])
    assert asked == [("time", False, False), ("check", False, True)]


@pytest.mark.parametrize("failure, flagged", [("runtime_error", True), ("crashed", False)])
def test_a_pair_that_raises_on_every_draw_is_a_decoy_and_a_crash_ends_the_job(monkeypatch, failure, flagged):
    """After its launches a candidate can sense the perturbation and raise; the pair is drawn again,
    and raising on every draw (the checked counterfactual completed) is a decoy. A crash is no
    answer to draw again: it ends the job with its own verdict."""
    import types

    from drkernel import judge, launch_pattern
    asked = []

    def candidate(j, seed, mode, signed=False, keep=False, perturb=(), changes=False):
        asked.append(mode)
        raise judge.Stop(failure, "raised on perturbed data")

    monkeypatch.setattr(judge, "call", lambda *a, **k: judge.Call(reply={}, wall_ms=1.0, inputs=[], seed=0,
                                                                  output="ref"))
    monkeypatch.setattr(judge, "call_candidate", candidate)
    hacks = []
    j = types.SimpleNamespace(ref=types.SimpleNamespace(twin=None), cfg=None, patterns=launch_pattern.Patterns(),
                              hack=lambda code, detail, stop=True: hacks.append(code))
    if flagged:
        judge._unwatched_counterfactual(j, "k", "the pair")
        assert hacks == ["decoy_kernel"] and asked == ["time"] * judge._PAIR_DRAWS
    else:
        with pytest.raises(judge.Stop):
            judge._unwatched_counterfactual(j, "k", "the pair")
        assert hacks == [] and asked == ["time"]


@pytest.mark.parametrize("answers, flagged, needed", [
    ([True, False], False, True),  # right on one draw (an argmax of a few elements), wrong on the next
    ([None, None, None], True, False),  # fails on every draw: no need shown, the only kernel a decoy
    ([None, False], False, True),  # failed once, then the perturbation showed: needed
    ([True, None, True], True, False),
])
def test_a_counterfactual_that_stays_right_or_fails_is_asked_again(monkeypatch, answers, flagged, needed):
    """An honest kernel's perturbation may not show on one draw; it shows on the next, and the
    kernel is needed. A candidate can make its own perturbed calls fail (an argument of a dtype the
    perturbation cannot copy, a check of its own): such a call is asked again too, and failing on
    every draw is no evidence that the kernel's work reaches the output."""
    import types

    from drkernel import judge
    answers = iter([(a, {"k"}) for a in answers])
    monkeypatch.setattr(judge, "_right_without", lambda j, name, signed: next(answers))
    monkeypatch.setattr(judge, "_output_depends_on_inputs", lambda r: True)
    hacks = []
    j = types.SimpleNamespace(cfg=types.SimpleNamespace(require_triton=True), flow=judge.Flow(calls=[[("k", True)]]),
                              details={}, ref=None, hack=lambda code, detail, stop=True: hacks.append(code))
    judge.check_needed(j, signed=False)
    assert hacks == (["decoy_kernel"] if flagged else []) and (j.flow.moved == {"k"}) is needed
    assert (j.flow.unneeded == {"k"}) is not needed


def test_every_dtype_is_perturbed():
    """Dtypes torch has no roll or scaling for (sub-byte, 8-bit floats, unsigned wide ints) have
    their bytes rolled: none reaches a counterfactual launch unperturbed, and each is put back."""
    import torch

    from drkernel import counterfactual
    for dtype in (torch.uint4, torch.int3, torch.float8_e4m3fn, torch.uint32, torch.complex64, torch.float32):
        raw = torch.arange(64, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else torch.arange(16).to(dtype)
        before = raw.view(torch.uint8).clone()
        with counterfactual.perturbed({"t": raw}, None):
            assert not torch.equal(raw.view(torch.uint8), before), dtype
        assert torch.equal(raw.view(torch.uint8), before), dtype


def test_inputs_past_the_file_size_limit_are_the_references_failure(monkeypatch):
    """On a CPU the judge's arena is a file: a problem whose inputs and outputs are larger than the
    sandbox lets one file grow (KernelBench's full sizes, 6 GiB) is `reference_error` with one line,
    never the candidate's `crashed` with the judge's traceback."""
    from drkernel import evaluator
    from drkernel.sandbox import SandboxLimits
    monkeypatch.setattr(evaluator, "_limits", lambda cfg, jobs=1: SandboxLimits(timeout_s=60.0 * jobs, max_file_mb=1))
    big = (TASKS / "1_ReLU.py").read_text().replace("torch.rand(batch_size, dim)", "torch.rand(512, 1024)")
    with Evaluator(EvalConfig(device="cpu", trials=1, cpu_perf_trials=1, warmup=1), workers=1) as ev:
        r = ev.evaluate(big, (SOLUTIONS / "1_ReLU.py").read_text())
    assert r.verdict == "reference_error" and "arena" in r.error and "Traceback" not in r.error, (r.verdict, r.error)
