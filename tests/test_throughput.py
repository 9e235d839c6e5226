"""Several workers give the verdicts one worker gives, and the cache answers repeats (CPU)."""

import pytest

from drkernel.evaluator import Evaluator, default_workers_per_gpu
from tests.test_evaluator import EMBED, LEGIT_RELU, TASKS, cfg, relu_candidate

RELU = (TASKS / "1_ReLU.py").read_text()
MIXED = [
    (RELU, LEGIT_RELU),
    (RELU, relu_candidate("return launch(x) * 2.0")),  # incorrect
    (RELU, "class ModelNew(:\n"),  # compile_error
    (RELU, relu_candidate("return torch.relu(x)")),  # hacked: no_triton_kernel
    (RELU, relu_candidate("import os\nos._exit(3)")),  # crashed
    ((TASKS / "7_Embedding_Gather.py").read_text(), EMBED),
    (RELU, relu_candidate("y = launch(x)\nx.zero_()\nreturn y")),  # hacked: input_mutated
]


def _verdicts(results):
    return [(r.verdict, sorted(r.hacks)) for r in results]


def test_verdicts_do_not_depend_on_the_worker_count():
    with Evaluator(cfg(cpu_perf_trials=2)) as one:
        assert one.workers == 1
        serial = one.evaluate_many(MIXED)
    with Evaluator(cfg(cpu_perf_trials=2), workers=3) as three:
        assert three.workers == 3
        parallel = three.evaluate_many(MIXED)
    assert _verdicts(serial) == _verdicts(parallel)
    assert _verdicts(serial)[:5] == [("correct", []), ("incorrect", []), ("compile_error", []),
                                     ("hacked", ["no_triton_kernel"]), ("crashed", [])]


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


@pytest.mark.parametrize("cpus, gpus, mem, want", [(16, 1, 139, 4), (16, 8, 139, 1), (2, 1, 139, 1),
                                                   (64, 1, 40, 1), (64, 1, 80, 2)])
def test_default_workers_per_gpu(cpus, gpus, mem, want):
    assert default_workers_per_gpu(cpus, gpus, mem) == want
