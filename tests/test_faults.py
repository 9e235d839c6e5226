"""The fault fixtures (tests/fixtures/faults/*.py): kernels that break the device, not the rules.

Each file's header names its task and the verdict expected on its device (`# device: cuda`).
What they test on a GPU (a device-side assert, an illegal address that poisons the child's CUDA
context) cannot happen on a CPU. What the CPU can check, through the Triton interpreter, is the
part that matters to training: the same file ends with a failing verdict and a zero reward, never
an exception in the judge, and the evaluator still evaluates the next candidate correctly. There
the device assert's launch fails at `torch.cuda.synchronize()` (runtime_error) and the illegal
store makes the interpreter write outside the process's memory (the child dies: crashed).
"""

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
