"""One reference per group: the candidates of one problem judged in one job (one reference build,
reference timing and set of reference outputs) get the verdicts they get one at a time; a timing
too noisy for the precision asked says so."""

from drkernel.evaluator import Evaluator
from tests.test_evaluator import LEGIT_RELU, TASKS, cfg, relu_candidate

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
    ]


def test_grouped_and_one_at_a_time_give_the_same_verdicts():
    batch = _batch()
    with Evaluator(cfg(), group_size=8) as ev:
        grouped = ev.evaluate_many(batch)
    with Evaluator(cfg(), group_size=1) as ev:
        alone = ev.evaluate_many(batch)
    assert [(r.verdict, r.hacks) for r in grouped] == [(r.verdict, r.hacks) for r in alone]
    assert [r.verdict for r in grouped] == ["correct", "hacked", "correct", "incorrect", "runtime_error",
                                            "hacked", "hacked", "runtime_error"], [(r.verdict, r.error) for r in grouped]
    sizes = [r.details.get("overhead_s", {}).get("group") for r in grouped]
    assert sizes[0] == 6 and sizes[2] == 2, sizes  # six ReLU candidates judged in one job, two Matmul ones
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


def test_the_compile_baseline_times_a_compiled_reference_and_says_so():
    """The twin compiles the reference once, before any timing; correctness is still judged
    against the eager reference, and the result records what its speedup is measured against."""
    with Evaluator(cfg(baseline="compile")) as ev:
        r = ev.evaluate(str(TASKS / "1_ReLU.py"), LEGIT_RELU)
    assert r.verdict == "correct" and r.baseline == "compile", (r.verdict, r.error)
    assert r.details["phase_s"]["load_twin"] > r.details["phase_s"]["reference_alone"]  # the compile
    with Evaluator(cfg()) as ev:
        assert ev.evaluate(str(TASKS / "1_ReLU.py"), LEGIT_RELU).baseline == "eager"
