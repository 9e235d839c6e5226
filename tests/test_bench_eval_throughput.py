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
    assert "every known expectation met" in capsys.readouterr().out
