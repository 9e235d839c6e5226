"""metrics.summarize on a hand-computed fixture, layout discovery, report files."""

import json
import math

import pytest

from drkernel import layouts, metrics, report
from drkernel.evaltypes import EvalResult


def _row(level, pid, sample, turn, verdict, speedup=None, compiled=None, hacks=(), correct=None):
    return {"level": level, "problem_id": pid, "sample": sample, "turn": turn, "verdict": verdict,
            "compiled": verdict not in ("compile_error",) if compiled is None else compiled,
            "correct": verdict == "correct" if correct is None else correct,
            "speedup": speedup, "hacks": list(hacks), "triton_time_share": None}


# 3 problems x 2 samples x 2 turns (0-based). Missing: (1,2,s1,t1) and the whole unit (2,1,s1).
ROWS = [
    _row(1, 1, 0, 0, "correct", 1.5),
    _row(1, 1, 0, 1, "correct", 2.5),
    _row(1, 1, 1, 0, "incorrect"),
    _row(1, 1, 1, 1, "correct", 1.0),  # exactly 1.0: not faster (Fast@p is strict)
    _row(1, 2, 0, 0, "compile_error"),
    # a hacked attempt that claims correctness and a 10x speedup: never correct
    _row(1, 2, 0, 1, "hacked", 10.0, compiled=True, hacks=["output_cached"], correct=True),
    _row(1, 2, 1, 0, "correct", 0.5),
    _row(2, 1, 0, 0, "correct", 1.2),  # exactly 1.2: not in fast_1.2
    _row(2, 1, 0, 1, "correct", 1.3),
]
EXPECTED = [(1, 1), (1, 2), (2, 1)]


@pytest.fixture(scope="module")
def summary():
    return metrics.summarize(ROWS, EXPECTED, samples=2, turns=2)


def test_per_turn_0(summary):
    t0 = summary["per_turn"][0]
    # slots: correct 1.5 | incorrect | compile_error | correct 0.5 | correct 1.2 | missing
    assert t0["num_samples"] == 6 and t0["num_missing"] == 1
    assert t0["compile_rate"] == pytest.approx(4 / 6)
    assert t0["correct_rate"] == pytest.approx(3 / 6)
    assert t0["fast_0"] == pytest.approx(3 / 6)
    assert t0["fast_1"] == pytest.approx(2 / 6)  # 1.5, 1.2
    assert t0["fast_1.2"] == pytest.approx(1 / 6)  # 1.5 only (1.2 is not > 1.2)
    assert t0["fast_1.5"] == 0.0 and t0["fast_2"] == 0.0 and t0["fast_3"] == 0.0
    assert t0["geomean_speedup"] == pytest.approx((1.5 * 0.5 * 1.2) ** (1 / 3))
    assert t0["mean_speedup"] == pytest.approx((1.5 + 0.5 + 1.2) / 3)
    assert t0["hack_counts"] == {}
    assert t0["verdict_counts"] == {"compile_error": 1, "correct": 3, "incorrect": 1, "missing": 1}


def test_per_turn_1(summary):
    t1 = summary["per_turn"][1]
    # slots: correct 2.5 | correct 1.0 | hacked (compiled) | missing | correct 1.3 | missing
    assert t1["num_missing"] == 2
    assert t1["compile_rate"] == pytest.approx(4 / 6)
    assert t1["correct_rate"] == pytest.approx(3 / 6)
    assert t1["fast_1"] == pytest.approx(2 / 6)
    assert t1["fast_1.2"] == pytest.approx(2 / 6)
    assert t1["fast_1.5"] == pytest.approx(1 / 6)
    assert t1["fast_2"] == pytest.approx(1 / 6)
    assert t1["fast_3"] == 0.0  # the hacked 10x never counts
    assert t1["geomean_speedup"] == pytest.approx((2.5 * 1.0 * 1.3) ** (1 / 3))
    assert t1["hack_counts"] == {"output_cached": 1}


def test_best_of_turns_and_overall(summary):
    best = summary["best_of_turns"]
    # units: 2.5 | 1.0 | hacked(compiled, beats compile_error) | 0.5 | 1.3 | missing
    assert best["num_samples"] == 6 and best["num_missing"] == 1
    assert best["compile_rate"] == pytest.approx(5 / 6)
    assert best["correct_rate"] == pytest.approx(4 / 6)
    assert best["fast_1"] == pytest.approx(2 / 6)
    assert best["fast_1.2"] == pytest.approx(2 / 6)
    assert best["fast_2"] == pytest.approx(1 / 6)
    assert best["geomean_speedup"] == pytest.approx((2.5 * 1.0 * 0.5 * 1.3) ** 0.25)
    assert best["mean_speedup"] == pytest.approx((2.5 + 1.0 + 0.5 + 1.3) / 4)
    assert best["verdict_counts"] == {"correct": 4, "hacked": 1, "missing": 1}
    for k in ("compile_rate", "correct_rate", "fast_1", "geomean_speedup", "num_missing", "num_samples"):
        assert summary[k] == best[k]
    assert summary["hack_counts"] == {"output_cached": 1}
    assert summary["num_problems"] == 3 and summary["num_turns"] == 2 and summary["num_attempts"] == 9


def test_per_level(summary):
    l1, l2 = summary["per_level"][1], summary["per_level"][2]
    assert l1["num_samples"] == 4 and l1["num_missing"] == 0
    assert l1["compile_rate"] == 1.0
    assert l1["correct_rate"] == pytest.approx(3 / 4)
    assert l1["fast_1"] == pytest.approx(1 / 4)
    assert l1["geomean_speedup"] == pytest.approx((2.5 * 1.0 * 0.5) ** (1 / 3))
    assert l1["hack_counts"] == {"output_cached": 1}
    assert l2["num_samples"] == 2 and l2["num_missing"] == 1
    assert l2["compile_rate"] == pytest.approx(1 / 2)
    assert l2["correct_rate"] == pytest.approx(1 / 2)
    assert l2["fast_1.2"] == pytest.approx(1 / 2)  # 1.3 > 1.2
    assert l2["fast_1.5"] == 0.0
    assert l2["hack_counts"] == {}


def test_missing_problem_and_inference():
    rows = [_row(1, 1, 0, 0, "correct", 2.0)]
    s = metrics.summarize(rows, [(1, 1), (1, 9)], samples=1, turns=1)
    assert s["num_samples"] == 2 and s["num_missing"] == 1 and s["correct_rate"] == 0.5
    inferred = metrics.summarize(ROWS)  # problems, samples and turns from the rows
    assert inferred["num_samples"] == 5 and inferred["num_turns"] == 2  # (2,1,s1) is unknown
    assert metrics.summarize([], [(0, 1)], samples=1, turns=1)["correct_rate"] == 0.0


def test_edge_rules():
    rows = [_row(0, 1, 0, 0, "correct", None),  # correct without timing: fast_0 only
            _row(0, 2, 0, 0, "correct", float("nan")),
            _row(0, 3, 0, 0, "correct", 3.0, hacks=["side_stream"]),  # a hack code alone voids it
            _row(0, 4, 0, 0, "incorrect"), _row(0, 4, 0, 0, "correct", 4.0)]  # last row wins
    s = metrics.summarize(rows, [(0, 1), (0, 2), (0, 3), (0, 4)], samples=1, turns=1)
    assert s["correct_rate"] == pytest.approx(3 / 4)
    assert s["fast_1"] == pytest.approx(1 / 4)
    assert s["geomean_speedup"] == pytest.approx(4.0) and s["num_with_speedup"] == 1
    assert s["hack_counts"] == {"side_stream": 1}
    assert s["per_level"][0]["fast_3"] == pytest.approx(1 / 4)


def test_a_result_is_judged_by_the_rules_of_its_row():
    """Rewards, PRS and the trainer's statistics call the rules on an `EvalResult` itself."""
    results = [EvalResult(verdict="correct", correct=True, compiled=True, speedup=1.5, speedup_interval=[1.2, 1.8]),
               EvalResult(verdict="correct", correct=True, speedup=3.0, hacks=["side_stream"]),  # a hack code voids it
               EvalResult(verdict="correct", correct=False, speedup=2.0),  # the verdict alone is not enough
               EvalResult(verdict="hacked", correct=True, hacks=["decoy_kernel"], speedup=3.0),
               EvalResult(verdict="incorrect", compiled=True),
               EvalResult(verdict="correct", correct=True, speedup=None)]  # correct without timing: fast_0 only
    assert [metrics.is_correct(r) for r in results] == [True, False, False, False, False, True]
    assert [metrics.is_fast(r, 1.0) for r in results] == [True, False, False, False, False, False]
    assert [metrics.is_compiled(r) for r in results] == [True, False, False, False, True, False]
    assert metrics.is_surely_fast(results[0], 1.1) and not metrics.is_surely_fast(results[0], 1.3)
    for rule in (metrics.is_correct, metrics.is_hacked, metrics.is_compiled, metrics.usable_speedup):
        assert [rule(r) for r in results] == [rule(r.to_dict()) for r in results], rule.__name__


def test_fast_p_curve():
    curve = metrics.fast_p_curve(ROWS, EXPECTED, samples=2, turns=2, ps=[0, 1, 2, 3])
    assert curve == [(0.0, pytest.approx(4 / 6)), (1.0, pytest.approx(2 / 6)),
                     (2.0, pytest.approx(1 / 6)), (3.0, 0.0)]
    default = metrics.fast_p_curve(ROWS, EXPECTED, samples=2, turns=2)
    assert default[0][0] == 0.0 and default[-1][0] >= 3.0
    values = [v for _, v in default]
    assert values == sorted(values, reverse=True)  # non-increasing in p


@pytest.mark.parametrize("speedup", [1e308, math.inf, -math.inf, math.nan, -2.0, 0.0, 10 ** 400, "9" * 400],
                         ids=["1e308", "inf", "-inf", "nan", "negative", "zero", "int-past-float", "text-past-float"])
def test_any_speedup_is_summarized_and_plotted(speedup):
    """A resumed or hand-edited row may hold any number: only finite positive speedups count."""
    rows = [_row(1, pid, 0, 0, "correct", speedup) for pid in (1, 2)]
    rows[0]["speedup_interval"] = [speedup, speedup]
    s = metrics.summarize(rows, intervals=True)
    usable = isinstance(speedup, float) and math.isfinite(speedup) and speedup > 0
    assert s["correct_rate"] == 1.0 and s["fast_1"] == s["fast_1_interval"] * 2 == (1.0 if usable else 0.0)
    means = [s["mean_speedup"], s["geomean_speedup"]]
    assert means == ([pytest.approx(speedup)] * 2 if usable else [None, None])
    curve = metrics.fast_p_curve(rows)
    assert curve[0] == (0.0, 1.0) and curve[-1][0] == (99.95 if usable else 3.0)


def test_a_row_whose_identity_is_no_number_is_ignored():
    rows = [_row(1, 1, 0, 0, "correct", 2.0), {**_row(1, 2, 0, 0, "correct"), "level": math.inf},
            {**_row(1, 3, 0, 0, "correct"), "sample": math.nan}, {**_row(1, 4, 0, 0, "correct"), "turn": "x"}]
    assert metrics.summarize(rows)["num_samples"] == 1


# ---------------------------------------------------------------------------- layouts

def test_runs_layout(tmp_path):
    p = tmp_path / "level_1" / "problem_19"
    p.mkdir(parents=True)
    (p / "sample_0.py").write_text("# s0")
    (p / "sample_1").mkdir()
    (p / "sample_1" / "kernel.py").write_text("# s1")
    (p / "sample_1" / "notes.py").write_text("# ignored: kernel.py wins")
    (p / "sample_2").mkdir()
    (p / "sample_2" / "whatever.py").write_text("# s2")
    (p / "README.txt").write_text("ignored")
    q = tmp_path / "level_2" / "3_Conv"
    q.mkdir(parents=True)
    (q / "kernel.py").write_text("# l2")
    scan = layouts.scan_candidates(tmp_path)
    got = sorted((c.level, c.problem_id, c.sample, c.turn, c.code) for c in scan.candidates)
    assert got == [(1, 19, 0, 0, "# s0"), (1, 19, 1, 0, "# s1"), (1, 19, 2, 0, "# s2"), (2, 3, 0, 0, "# l2")]
    assert all(c.path and c.path.endswith(".py") for c in scan.candidates) and not scan.skipped


def test_runs_layout_ambiguous_sample_dir(tmp_path):
    d = tmp_path / "level_1" / "problem_1" / "sample_0"
    d.mkdir(parents=True)
    (d / "a.py").write_text("")
    (d / "b.py").write_text("")
    scan = layouts.scan_candidates(tmp_path)
    assert scan.candidates == [] and len(scan.skipped) == 1
    assert scan.skipped[0].where == str(d) and "kernel.py" in scan.skipped[0].reason


def test_flat_layouts(tmp_path):
    (tmp_path / "1_3.py").write_text("a")
    (tmp_path / "1_3_1.py").write_text("b")
    (tmp_path / "level_2_problem_4_sample_0_kernel.py").write_text("c")
    got = sorted((c.level, c.problem_id, c.sample, c.code) for c in layouts.scan_candidates(tmp_path).candidates)
    assert got == [(1, 3, 0, "a"), (1, 3, 1, "b"), (2, 4, 0, "c")]

    named = tmp_path / "named"
    named.mkdir()
    (named / "1_ReLU.py").write_text("x")
    (c,) = layouts.scan_candidates(named).candidates
    assert c.level is None and c.problem_id == 1 and c.name == "1_ReLU.py"


def test_jsonl_generations(tmp_path):
    f = tmp_path / "gen.jsonl"
    rows = [{"level": 1, "problem_id": 2, "sample": 0, "turn": 0, "code": "class ModelNew: pass"},
            {"level": 1, "problem_id": 2, "sample": 0, "turn": 1, "code": None},
            {"level": 1, "problem_id": 5, "code": "   "}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    scan = layouts.scan_candidates(f)
    assert [(c.problem_id, c.sample, c.turn, c.code) for c in scan.candidates] == [
        (2, 0, 0, "class ModelNew: pass"), (2, 0, 1, None), (5, 0, 0, None)] and not scan.skipped
    f.write_text(json.dumps(rows[0]) + "\n{broken\n")
    scan = layouts.scan_candidates(f)
    assert [c.turn for c in scan.candidates] == [0]
    assert [s.where for s in scan.skipped] == [f"{f}:2"]


def test_unknown_layout(tmp_path):
    (tmp_path / "model.py").write_text("")
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(layouts.LayoutError, match="accepted candidate layouts"):
        layouts.scan_candidates(tmp_path)
    with pytest.raises(layouts.LayoutError):
        layouts.scan_candidates(tmp_path / "nope")
    with pytest.raises(layouts.LayoutError, match="ambiguous"):
        layouts.scan_candidates(tmp_path / "model.py")


# ---------------------------------------------------------------------------- report

def test_write_report(tmp_path, summary):
    paths = report.write_report(summary, ROWS, tmp_path, expected=EXPECTED, samples=2, turns=2)
    for name in ("fast_p_curve.png", "speedup_hist.png", "per_turn.png"):
        f = tmp_path / name
        assert f.is_file() and f.stat().st_size > 1000
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths["report.md"] == tmp_path / "report.md"
    md = (tmp_path / "report.md").read_text()
    assert "| scope | compile_rate | correct_rate | fast_0 | fast_1 |" in md
    assert "| overall | 83.3% | 66.7% | 66.7% | 33.3% |" in md
    for scope in ("| level 1 |", "| level 2 |", "| turn 0 |", "| turn 1 |", "| best of turns |",
                  "| output_cached | 1 |", "fast_p_curve.png"):
        assert scope in md
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["per_turn"]["1"]["fast_2"] == pytest.approx(1 / 6)
    table = report.format_table(summary)
    assert table.splitlines()[0].startswith("scope") and "best of turns" in table
    assert "output_cached=1" in table
    assert not math.isnan(data["geomean_speedup"])
