"""One reference per group: the candidates of one problem judged in one job (one reference build,
reference timing and set of reference outputs) get the verdicts they get one at a time; a timing
too noisy for the precision asked says so."""

import pytest

from drkernel.evaluator import Evaluator
from tests.test_evaluator import EMBED, LEGIT_RELU, TASKS, cfg, relu_candidate, shared_evaluate, shared_evaluate_many

HACKS = TASKS.parent.parent.parent / "tests" / "fixtures" / "hacks"


def _batch() -> list[tuple[str, str]]:
    relu = str(TASKS / "1_ReLU.py")
    matmul = str(TASKS / "3_Matmul.py")
    solutions = TASKS.parent / "solutions"
    return [
        (relu, LEGIT_RELU),
        (relu, (HACKS / "decoy_sentinel_scratch.py").read_text()),
        (matmul, str(solutions / "3_Matmul.py")),
        (relu, relu_candidate("return launch(x) + 1.0")),  # incorrect
        (relu, relu_candidate("raise RuntimeError('boom')")),  # runtime_error
        (relu, relu_candidate("launch(x)\nreturn x")),  # output_aliases_input
        (relu, (HACKS / "no_triton_empty_grid.py").read_text()),
        (matmul, relu_candidate("return launch(x)")),  # wrong arity: runtime_error
        (relu, relu_candidate("y = launch(x)\nx.zero_()\nreturn y")),  # input_mutated
        (relu, "class ModelNew(:\n"),  # compile_error, decided before any job
        (relu, relu_candidate("import os\nos._exit(3)")),  # crashed
        (str(TASKS / "7_Embedding_Gather.py"), EMBED),
    ]


def test_grouped_on_one_worker_and_alone_on_three_give_the_same_verdicts():
    """Neither the group size nor the number of workers changes a verdict or a hack code."""
    batch = _batch()
    grouped = shared_evaluate_many(batch, cfg())  # one worker, groups of up to 8 (the default)
    with Evaluator(cfg(), workers=3, group_size=1) as ev:
        alone = ev.evaluate_many(batch)
    assert [(r.verdict, r.hacks) for r in grouped] == [(r.verdict, r.hacks) for r in alone]
    assert [r.verdict for r in grouped] == ["correct", "hacked", "correct", "incorrect", "runtime_error", "hacked",
                                            "hacked", "runtime_error", "hacked", "compile_error", "crashed",
                                            "correct"], [(r.verdict, r.error) for r in grouped]
    assert grouped[8].hacks == ["input_mutated"] and grouped[6].hacks == ["no_triton_kernel"], grouped[6].hacks
    sizes = [r.details.get("overhead_s", {}).get("group") for r in grouped]
    # eight ReLU candidates in one job (the syntax error is decided before any), two Matmul ones
    assert sizes[0] == 8 and sizes[2] == 2 and sizes[9] is None and sizes[11] == 1, repr(sizes)
    assert all(s in (1, None) for s in (r.details.get("overhead_s", {}).get("group") for r in alone))
    for r in grouped[3:5]:  # stopped in correctness: no phase of an earlier candidate of its job
        assert "timing" not in r.details["phase_s"] and "profiling" not in r.details["phase_s"], r.details["phase_s"]


def test_a_noisy_timing_says_it_is_imprecise():
    noisy = relu_candidate("time.sleep(random.uniform(0.0, 0.1))\nreturn launch(x)", extra="\nimport random\nimport time\n")
    with Evaluator(cfg(cpu_perf_trials=6)) as ev:
        r = ev.evaluate(str(TASKS / "1_ReLU.py"), noisy)
    assert r.verdict == "correct", r.error
    lo, hi = r.speedup_interval
    assert r.speedup_precise is False and hi > 1.5 * lo, (r.speedup_interval, r.speedup)


@pytest.mark.slow
def test_the_compile_baseline_times_a_compiled_reference_and_says_so():
    """The twin compiles the reference once, before any timing; correctness is still judged
    against the eager reference, and the result records what its speedup is measured against."""
    with Evaluator(cfg(baseline="compile")) as ev:
        r = ev.evaluate(str(TASKS / "1_ReLU.py"), LEGIT_RELU)
    assert r.verdict == "correct" and r.baseline == "compile", (r.verdict, r.error)
    assert r.details["phase_s"]["load_twin"] > r.details["phase_s"]["reference_alone"]  # the compile
    assert shared_evaluate(str(TASKS / "1_ReLU.py"), LEGIT_RELU, cfg()).baseline == "eager"


def test_the_speedup_pairs_each_timed_call_with_its_neighbour():
    """A drift both calls of a pair share (the host slower for a while, as on launch-bound models)
    cancels in each pair's own ratio: the speedup and its interval stay tight, where resampling the
    two sides apart would widen the interval by the drift."""
    from drkernel import judge
    drift = [1.0, 3.0, 1.5, 2.5] * 10
    assert judge.speedup_interval(drift, drift, seed=0) == (1.0, 1.0)
    assert judge.speedup_interval([2 * d for d in drift], drift, seed=0) == (2.0, 2.0)
    assert judge.median(judge.pair_ratios([2 * d for d in drift], drift)) == 2.0


@pytest.mark.slow
def test_a_candidate_slow_to_build_leaves_the_next_ones_their_whole_time():
    """Each turn has the whole `timeout`, the twin's calls in it too: a candidate that spends most
    of its own time building does not run the group's twin out of time on the candidates after it."""
    slow = relu_candidate("return launch(x)", init="def __init__(self):\n        super().__init__()\n"
                                                   "        time.sleep(6.0)", extra="\nimport time\n")
    relu = str(TASKS / "1_ReLU.py")  # two turns of 6 s and more: past one `timeout` of 10 s
    batch = [(relu, slow), (relu, slow + "# two\n"), (relu, LEGIT_RELU)]
    with Evaluator(cfg(timeout=10), workers=1) as ev:
        results = ev.evaluate_many(batch)
    assert [r.verdict for r in results] == ["correct"] * 3, [(r.verdict, r.error) for r in results]
    assert results[1].details["overhead_s"]["group"] == 3  # judged in one job
