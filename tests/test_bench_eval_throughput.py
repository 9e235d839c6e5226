"""bench/eval_throughput.py: the comparison with 1 worker, the cache pass (through
`EvalConfig.cache_dir`) and a tiny CPU run. No timed assertions."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import eval_throughput as et  # noqa: E402
from bench.candidates import Candidate, bundled_task  # noqa: E402
from drkernel.evaluator import EvalConfig, EvalResult  # noqa: E402


def cand(name, verdict=None, hacks=()):
    return Candidate(name, "solution", bundled_task("1_ReLU.py"), "code " + name, verdict, tuple(hacks))


def res(verdict="correct", speedup=None, hacks=()):
    return EvalResult(verdict=verdict, speedup=speedup, hacks=list(hacks))


def test_compare_lists_verdicts_hacks_and_speedups_beyond_three_percent():
    cands = [cand(n) for n in "abcdef"]
    one = et.Pass(1, "cold", 0.0, 10.0, [res(speedup=1.0), res(speedup=1.0), res(speedup=1.0), res(speedup=2.0),
                                         res("hacked", hacks=["a", "b"]), res("correct", speedup=1.0)])
    four = et.Pass(4, "cold", 0.0, 5.0, [res(speedup=1.02), res(speedup=1.05), res(speedup=0.8), res(speedup=2.0),
                                         res("hacked", hacks=["b"]), res("runtime_error")])
    diffs = et.compare(one, four, cands)
    got = [(d.candidate, d.what, d.flagged, d.run) for d in diffs]
    assert got == [("b", "speedup", False, "4 workers"), ("c", "speedup", True, "4 workers"),
                   ("e", "hacks", False, "4 workers"), ("f", "verdict", False, "4 workers")]
    assert et.compare(one, dataclasses.replace(one, cache="warm"), cands) == []
    assert dataclasses.replace(one, cache="warm").label == "1 worker, cached"
    assert four.per_minute == pytest.approx(72.0)


def test_unexpected_checks_known_expectations_only():
    cands = [cand("a", "correct"), cand("b", None), cand("c", "hacked", ["decoy_kernel"]), cand("d", "hacked")]
    results = [res("incorrect"), res("crashed"), res("hacked", hacks=["no_triton_kernel"]),
               res("hacked", hacks=["x"])]
    assert et.unexpected(cands, results) == [("a", "correct", "incorrect"),
                                             ("c", "hacked decoy_kernel", "hacked no_triton_kernel")]


class FakeEvaluator:
    seen: list = []

    def __init__(self, cfg, workers=None):
        self.cfg, self.reward_config = cfg, None

    def evaluate_many(self, pairs):
        FakeEvaluator.seen.append((self.cfg.cache_dir, len(pairs)))
        return [EvalResult(verdict="correct", details={"cached": True}) for _ in pairs]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_pass_hands_the_cache_dir_to_an_evaluator_that_caches(monkeypatch, tmp_path):
    monkeypatch.setattr(et, "Evaluator", FakeEvaluator)
    FakeEvaluator.seen = []
    p = et.evaluate_pass(EvalConfig(device="cpu"), 3, [("r", "c1"), ("r", "c2")], tmp_path / "c", "warm")
    assert FakeEvaluator.seen == [(str(tmp_path / "c"), 3), (str(tmp_path / "c"), 2)]  # warm-up, then the set
    assert p.hit_rate == 1.0 and p.workers == 3


@pytest.mark.slow
def test_cpu_run_with_the_cache(kernelbench_path, tmp_path, capsys):
    out = tmp_path / "et.json"
    result = et.main(["--device", "cpu", "--shrink", "--kernelbench", str(kernelbench_path), "--workers", "1",
                      "--size", "3", "--trials", "1", "--cpu-perf-trials", "1", "--warmup", "1",
                      "--cache-dir", str(tmp_path / "cache"), "--json", str(out)])
    saved = json.loads(out.read_text())
    assert [(p["workers"], p["cache"]) for p in saved["passes"]] == [(1, "cold"), (1, "warm")]
    cold, warm = saved["passes"]
    assert [r["verdict"] for r in cold["results"]] == ["correct"] * 3
    assert cold["hit_rate"] == 0.0 and warm["hit_rate"] == 1.0
    assert warm["results"] == cold["results"]  # the cache gives back what was measured
    assert saved["differences"] == [] and saved["unexpected"] == []
    assert saved["environment"]["device"] == "cpu" and result["cache"]["workers"] == 1
    assert list((tmp_path / "cache").iterdir()) == []  # the run's cache directories are removed
    # the judge reports the seconds of its phases that hold the GPU alone, its group's apart
    assert all(r["gpu_alone_s"] > 0 and r["group_gpu_alone_s"] > 0 for r in cold["results"])
    printed = capsys.readouterr().out
    assert "every known expectation met" in printed and "the GPU held alone:" in printed


def test_alone_ceiling_counts_a_groups_holds_once():
    """Two candidates of one group (each result carries the group's 3 s) and one alone: 2 + 1 + 4
    seconds of their own and 3 + 1 of their groups' make 11 s for 3 candidates: 16.4 a minute."""
    group = {"overhead_s": {"group": 2}, "group_gpu_alone_s": 3.0}
    results = [EvalResult(details={**group, "gpu_alone_s": 2.0}), EvalResult(details={**group, "gpu_alone_s": 1.0}),
               EvalResult(details={"overhead_s": {"group": 1}, "group_gpu_alone_s": 1.0, "gpu_alone_s": 4.0})]
    held, ceiling = et.alone_ceiling(results)
    assert held == pytest.approx(11.0) and ceiling == pytest.approx(60 * 3 / 11)
    assert et.alone_ceiling([EvalResult(verdict="compile_error")]) == (0.0, None)


def test_memory_table_reads_the_judges_peak_from_its_phases(capsys):
    """The judge's peak is the largest of its phases' peaks; the runner's is reported apart."""
    details = {"memory_estimate_gib": 52.0, "memory_peak_gib": {"runner": 12.0},
               "memory_peak_gib_by_phase": {"setup": 30.0, "correctness": 36.0, "timing": 36.0}}
    p = et.Pass(1, "cold", 0.0, 1.0, [EvalResult(details=details), EvalResult(details={"memory_estimate_gib": 2.0})])
    et.print_memory(p, [cand("a"), cand("b")])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("0_1")]
    assert rows == [["0_1", "52.0", "36.0", "12.0", "48.0", "correctness"]]
