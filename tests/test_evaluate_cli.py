"""evaluate.py end to end with a fake evaluator (resume, JSONL, report), plus one real run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import evaluate  # noqa: E402


class FakeEvaluator:
    """Returns a verdict read from the candidate: `# fake: incorrect` etc., else `default`
    (correct at 2x)."""

    def __init__(self, fail_on_call=None, default="correct"):
        self.calls = []  # one list of (reference, candidate) per evaluate_many call
        self.references = []  # each pair's reference code, read while its scratch file exists
        self.fail_on_call = fail_on_call
        self.default = default
        self.closed = False

    def evaluate_many(self, pairs):
        pairs = list(pairs)
        if self.fail_on_call is not None and len(self.calls) == self.fail_on_call:
            raise KeyboardInterrupt("simulated kill")
        self.calls.append(pairs)
        out = []
        for ref, cand in pairs:
            assert os.path.isfile(ref) and "class Model" in Path(ref).read_text()
            self.references.append(Path(ref).read_text())
            code = Path(cand).read_text() if "\n" not in cand and os.path.isfile(cand) else cand
            verdict = self.default
            if "# fake: " in code:
                verdict = code.split("# fake: ")[1].split()[0]
            ok = verdict == "correct"
            out.append({"verdict": verdict, "compiled": verdict != "compile_error", "correct": ok,
                        "speedup": 2.0 if ok else None, "hacks": ["output_cached"] if verdict == "hacked" else [],
                        "error": None if ok else f"fake {verdict}", "triton_time_share": 0.9 if ok else None, "stdout": "noise"})
        return out

    def close(self):
        self.closed = True

    @property
    def evaluated(self):
        return [p for call in self.calls for p in call]


@pytest.fixture
def fake(monkeypatch):
    holder = {"ev": FakeEvaluator()}
    monkeypatch.setattr(evaluate, "make_evaluator", lambda cfg, device: holder["ev"])
    return holder


def _results(out):
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]


def test_bundled_defaults_with_fake(tmp_path, fake, capsys):
    out = tmp_path / "eval"
    summary = evaluate.main(["--problem_ids", "1,2,3", "--output_dir", str(out), "--device", "cpu"])
    assert os.environ["TRITON_INTERPRET"] == "1"
    assert len(fake["ev"].evaluated) == 3 and fake["ev"].closed
    assert summary["num_samples"] == 3 and summary["num_missing"] == 0
    assert summary["correct_rate"] == 1.0 and summary["fast_1"] == 1.0 and summary["fast_2"] == 0.0
    assert summary["geomean_speedup"] == pytest.approx(2.0)
    assert set(summary["per_level"]) == {0}
    rows = _results(out)
    assert [(r["level"], r["problem_id"], r["sample"], r["turn"]) for r in rows] == [
        (0, 1, 0, 0), (0, 2, 0, 0), (0, 3, 0, 0)]
    assert "stdout" not in rows[0] and rows[0]["task"] == "1_ReLU.py"
    for name in ("summary.json", "report.md", "fast_p_curve.png", "speedup_hist.png", "per_turn.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0
    printed = capsys.readouterr().out
    assert "overall" in printed and "fast_1" in printed


def test_resume_after_kill(tmp_path, fake):
    out = tmp_path / "eval"
    args = ["--problem_ids", "1,2,3,4", "--output_dir", str(out), "--device", "cpu", "--chunk_size", "1"]
    # a kill while the third chunk is in flight: the first two rows are already on disk
    fake["ev"] = FakeEvaluator(fail_on_call=2)
    with pytest.raises(KeyboardInterrupt):
        evaluate.main(args)
    assert [r["problem_id"] for r in _results(out)] == [1, 2]

    # the file is then cut to one row plus a partial line, as if killed mid-write
    first = (out / "results.jsonl").read_text().splitlines()[0]
    (out / "results.jsonl").write_text(first + "\n" + '{"level": 0, "problem_id": 2, "sam')
    fake["ev"] = FakeEvaluator()
    summary = evaluate.main(args)
    assert sorted(Path(c).name for _, c in fake["ev"].evaluated) == ["2_Add_Scale.py", "3_Matmul.py",
                                                                    "4_Softmax.py"]
    assert summary["num_missing"] == 0 and summary["correct_rate"] == 1.0
    assert summary["skipped_resumed"] == 1 and summary["evaluated_this_run"] == 3
    lines = (out / "results.jsonl").read_text().splitlines()
    assert lines[0] == first  # finished results are kept as written
    assert sorted(r["problem_id"] for r in _results(out)) == [1, 2, 3, 4]  # the cut line is dropped

    # nothing left to do: a third run evaluates nothing and reports the same
    fake["ev"] = FakeEvaluator()
    again = evaluate.main(args)
    assert fake["ev"].evaluated == [] and again["correct_rate"] == 1.0


def test_resume_reevaluates_changed_candidate(tmp_path, fake):
    cands = tmp_path / "cands"
    cands.mkdir()
    (cands / "0_1.py").write_text("class ModelNew: pass\n")
    out = tmp_path / "eval"
    args = ["--problem_ids", "1", "--candidates", str(cands), "--output_dir", str(out), "--device", "cpu"]
    assert evaluate.main(args)["correct_rate"] == 1.0
    (cands / "0_1.py").write_text("class ModelNew: pass\n# fake: incorrect\n")
    fake["ev"] = FakeEvaluator()
    s = evaluate.main(args)
    assert len(fake["ev"].evaluated) == 1 and s["correct_rate"] == 0.0 and s["compile_rate"] == 1.0


def test_jsonl_candidates_missing_and_format_error(tmp_path, fake):
    gen = tmp_path / "gen.jsonl"
    rows = [
        {"level": 0, "problem_id": 1, "sample": 0, "turn": 0, "code": "class ModelNew: pass\n# fake: incorrect\n"},
        {"level": 0, "problem_id": 1, "sample": 0, "turn": 1, "code": "class ModelNew: pass\n"},
        {"level": 0, "problem_id": 1, "sample": 1, "turn": 0, "code": None},
        {"level": 0, "problem_id": 2, "sample": 0, "turn": 0, "code": "class ModelNew: pass\n# fake: hacked\n"},
        {"level": 0, "problem_id": 99, "sample": 0, "turn": 0, "code": "x"},  # no such task: skipped
    ]
    gen.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "eval"
    s = evaluate.main(["--problem_ids", "1,2,3", "--candidates", str(gen), "--output_dir", str(out),
                       "--samples", "2", "--device", "cpu"])
    assert len(fake["ev"].evaluated) == 3  # the null-code generation is never evaluated
    # units: (1,s0) best turn correct | (1,s1) format_error | (2,s0) hacked | (2,s1) (3,s0) (3,s1) missing
    assert s["num_samples"] == 6 and s["num_missing"] == 3 and s["num_turns"] == 2
    assert s["correct_rate"] == pytest.approx(1 / 6)
    assert s["compile_rate"] == pytest.approx(2 / 6)
    assert s["hack_counts"] == {"output_cached": 1}
    assert s["per_turn"][0]["correct_rate"] == 0.0 and s["per_turn"][1]["correct_rate"] == pytest.approx(1 / 6)
    assert s["verdict_counts"]["format_error"] == 1
    verdicts = {(r["problem_id"], r["sample"], r["turn"]): r["verdict"] for r in _results(out)}
    assert verdicts[(1, 1, 0)] == "format_error"


def test_compile_baseline_reaches_the_evaluator_and_the_rows(tmp_path, fake, monkeypatch):
    """--baseline compile is the evaluator's own setting (the twin compiles the reference): the
    reference code is passed unchanged and every stored row says what it was timed against."""
    seen = []
    monkeypatch.setattr(evaluate, "make_evaluator", lambda cfg, device: seen.append(cfg) or fake["ev"])
    out = tmp_path / "eval"
    evaluate.main(["--problem_ids", "1", "--baseline", "compile", "--output_dir", str(out), "--device", "cpu"])
    (reference,) = fake["ev"].references
    assert "torch.compile" not in reference and seen[0].baseline == "compile"
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert rows and all(r["baseline"] == "compile" for r in rows)
    with pytest.raises(SystemExit):
        evaluate.main(["--problem_ids", "1", "--baseline", "fast", "--output_dir", str(out)])


# ---------------------------------------------------------------------------- bad input is skipped and named

def _write_jsonl(path, rows, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return path


def _gen(pid, code="class ModelNew: pass\n", **extra):
    return {"level": 0, "problem_id": pid, "sample": 0, "turn": 0, "code": code, **extra}


def _skipped(summary):
    return {(s["where"], s["attempt"]): s["reason"] for s in summary["skipped"]}


def test_cut_last_line_keeps_the_good_rows(tmp_path, fake, capsys):
    gen = _write_jsonl(tmp_path / "gen.jsonl", [_gen(1), _gen(2)], tail='{"level": 0, "problem_id": 3, "co')
    s = evaluate.main(["--candidates", str(gen), "--output_dir", str(tmp_path / "eval"), "--device", "cpu"])
    assert sorted(r["problem_id"] for r in _results(tmp_path / "eval")) == [1, 2]
    assert s["correct_rate"] == 1.0 and s["num_skipped"] == 1
    (reason,) = [r for (where, _), r in _skipped(s).items() if where == f"{gen}:3"]
    assert reason.startswith("not a JSON object")
    assert f"{gen}:3: not a JSON object" in capsys.readouterr().err
    on_disk = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert on_disk["skipped"] == s["skipped"] and f"| {gen}:3 | - | not a JSON object" in \
        (tmp_path / "eval" / "report.md").read_text()


def test_generations_of_another_task_set_are_skipped_and_named(tmp_path, fake):
    """A row that names its task answers only that task: the same ids in another task set do not."""
    from drkernel.tasks import load_bundled
    relu = next(t for t in load_bundled() if t.problem_id == 1)
    rows = [_gen(1, **relu.columns()), _gen(1, sample=1, task="1_Softmax.py"), _gen(1, sample=2, task_sha="0" * 16)]
    gen = _write_jsonl(tmp_path / "gen.jsonl", rows)
    s = evaluate.main(["--candidates", str(gen), "--problem_ids", "1", "--output_dir", str(tmp_path / "eval"),
                       "--device", "cpu"])
    assert len(fake["ev"].evaluated) == 1
    skipped = _skipped(s)
    assert "answers another task than" in skipped[(f"{gen}:2", "level 0 problem 1 sample 1 turn 0")]
    assert "task_sha" in skipped[(f"{gen}:3", "level 0 problem 1 sample 2 turn 0")]


def test_mistyped_rows_and_unknown_problems_are_skipped_and_named(tmp_path, fake):
    rows = [_gen(1), _gen(2, code=123), {**_gen(3), "level": "0"}, _gen(99),
            _gen(4, code=None, generation_error="HTTP 503")]
    gen = _write_jsonl(tmp_path / "gen.jsonl", rows)
    s = evaluate.main(["--candidates", str(gen), "--problem_ids", "1,2,3,4", "--output_dir", str(tmp_path / "eval"),
                       "--device", "cpu"])
    assert [Path(ref).name.split("_")[2] for ref, _ in fake["ev"].evaluated] == ["1"]  # only the good row
    skipped = _skipped(s)
    assert "`code` must be a string" in skipped[(f"{gen}:2", "level 0 problem 2 sample 0 turn 0")]
    assert "`level` must be a non-negative integer" in skipped[(f"{gen}:3", "")]
    assert "no such problem" in skipped[(f"{gen}:4", "level 0 problem 99 sample 0 turn 0")]
    assert "HTTP 503" in skipped[(f"{gen}:5", "level 0 problem 4 sample 0 turn 0")]
    # the four selected problems count; the skipped ones are missing, never evaluated
    assert s["num_problems"] == 4 and s["num_missing"] == 3 and s["correct_rate"] == 0.25


def test_a_row_or_file_naming_a_huge_sample_or_turn_is_skipped_not_counted(tmp_path, fake):
    """The metrics count every (problem, sample, turn) up to the largest named: `"sample": 10**9`
    in one row would fill memory counting a billion missing attempts."""
    rows = [_gen(1), _gen(1, sample=10**9), _gen(1, turn=10**9)]
    gen = _write_jsonl(tmp_path / "gen.jsonl", rows)
    s = evaluate.main(["--candidates", str(gen), "--problem_ids", "1", "--output_dir", str(tmp_path / "eval"),
                       "--device", "cpu"])
    skipped = _skipped(s)
    assert "`sample` must be below 10000" in skipped[(f"{gen}:2", "level 0 problem 1 sample 1000000000 turn 0")]
    assert "`turn` must be below 1000" in skipped[(f"{gen}:3", "level 0 problem 1 sample 0 turn 1000000000")]
    assert s["num_missing"] == 0 and len(fake["ev"].evaluated) == 1
    cands = tmp_path / "cands"
    cands.mkdir()
    (cands / "level_0_problem_1_sample_0.py").write_text("class ModelNew: pass\n")
    (cands / "level_0_problem_1_sample_123456789.py").write_text("class ModelNew: pass\n")
    s = evaluate.main(["--candidates", str(cands), "--problem_ids", "1", "--output_dir", str(tmp_path / "flat"),
                       "--device", "cpu"])
    big = cands / "level_0_problem_1_sample_123456789.py"
    assert _skipped(s)[(str(big), "level 0 problem 1 sample 123456789 turn 0")] == (
        "the sample must be below 10000, not 123456789")


def test_rows_without_a_code_field_are_skipped_and_named_not_counted_as_format_errors(tmp_path, fake):
    """evaluate.py's own results.jsonl given as --candidates: its rows hold no `code`, which a
    generations row always has (null where the response held none)."""
    gen = _write_jsonl(tmp_path / "gen.jsonl", [_gen(1), {k: v for k, v in _gen(1, sample=1).items() if k != "code"}])
    s = evaluate.main(["--candidates", str(gen), "--problem_ids", "1", "--output_dir", str(tmp_path / "eval"),
                       "--device", "cpu"])
    assert "no `code` field" in _skipped(s)[(f"{gen}:2", "level 0 problem 1 sample 1 turn 0")]
    assert len(fake["ev"].evaluated) == 1 and "format_error" not in s["verdict_counts"]


def test_a_sample_that_is_no_regular_file_is_named_in_a_runs_folder(tmp_path, fake):
    problem = tmp_path / "runs" / "level_0" / "problem_1"
    problem.mkdir(parents=True)
    (problem / "sample_0.py").write_text("class ModelNew: pass\n")
    (problem / "sample_5.py").symlink_to(tmp_path / "nowhere.py")
    os.mkfifo(problem / "sample_7.py")
    s = evaluate.main(["--candidates", str(tmp_path / "runs"), "--problem_ids", "1", "--output_dir",
                       str(tmp_path / "eval"), "--device", "cpu"])
    skipped = _skipped(s)
    for k in (5, 7):
        assert "not a regular file" in skipped[(str(problem / f"sample_{k}.py"), f"level 0 problem 1 sample {k} turn 0")]


def test_unknown_and_undecodable_candidate_files_are_named(tmp_path, fake):
    cands = tmp_path / "cands"
    cands.mkdir()
    (cands / "0_1.py").write_text("class ModelNew: pass\n")
    (cands / "0_2.py").write_bytes(b"class ModelNew: pass\n\xff\xfe\x00binary")
    (cands / "0_77.py").write_text("class ModelNew: pass\n")
    (cands / "1_1.py").write_text("class ModelNew: pass\n")  # bundled tasks ignore the level: problem 1 again
    (cands / "0_3.py").symlink_to(tmp_path / "nowhere.py")  # a link to nothing
    os.mkfifo(cands / "0_4.py")  # reading it would wait forever
    s = evaluate.main(["--candidates", str(cands), "--problem_ids", "1,2,3,4", "--output_dir", str(tmp_path / "eval"),
                       "--device", "cpu"])
    assert [Path(c).name for _, c in fake["ev"].evaluated] == ["0_1.py"]
    skipped = _skipped(s)
    assert "not UTF-8" in skipped[(str(cands / "0_2.py"), "level 0 problem 2 sample 0 turn 0")]
    assert "no such problem" in skipped[(str(cands / "0_77.py"), "level 0 problem 77 sample 0 turn 0")]
    assert "a second candidate" in skipped[(str(cands / "1_1.py"), "level 0 problem 1 sample 0 turn 0")]
    for k in (3, 4):
        assert "not a regular file" in skipped[(str(cands / f"0_{k}.py"), f"level 0 problem {k} sample 0 turn 0")]
    assert s["num_problems"] == 4 and s["correct_rate"] == 0.25


@pytest.mark.parametrize("content, says", [
    (b"", "it holds none"),
    (b'\xff\xfe binary\n{"level": "0", "problem_id": 1, "code": "x"}\n[1, 2]\n', "not UTF-8 text"),
    (json.dumps(_gen(99)).encode() + b"\n", "no such problem among the selected tasks"),
], ids=["empty", "all_unusable", "no_selected_problem"])
def test_candidates_without_a_usable_one_are_a_usage_error(tmp_path, fake, capsys, content, says):
    """Nothing to evaluate is one error line (status 2), not a summary of 0 problems at 0 %."""
    gen = tmp_path / "gen.jsonl"
    gen.write_bytes(content)
    with pytest.raises(SystemExit) as exc:
        evaluate.main(["--candidates", str(gen), "--output_dir", str(tmp_path / "eval"), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and says in err[-1]
    assert err[-1].startswith(f"evaluate.py: error: no usable candidates in {gen} for the selected tasks")
    assert fake["ev"].calls == [] and not (tmp_path / "eval").exists()


def test_reference_error_is_counted_apart_from_the_candidates(tmp_path, fake):
    gen = _write_jsonl(tmp_path / "gen.jsonl", [_gen(1), _gen(2, code="class ModelNew: pass\n# fake: reference_error\n"),
                                                _gen(3, code="class ModelNew: pass\n# fake: incorrect\n")])
    s = evaluate.main(["--candidates", str(gen), "--output_dir", str(tmp_path / "eval"), "--device", "cpu"])
    assert s["num_reference_errors"] == 1 and s["num_problems"] == 2  # problem 2 is not the candidate's failure
    assert s["correct_rate"] == 0.5 and "reference_error" not in s["verdict_counts"]
    assert _skipped(s)[(f"{gen}:2", "level 0 problem 2 sample 0 turn 0")] == "reference_error: fake reference_error"
    assert "whose reference failed" in s["counted"]


# ---------------------------------------------------------------------------- which problems count

def test_generations_for_one_problem_count_only_that_problem(tmp_path, fake):
    gen = _write_jsonl(tmp_path / "gen.jsonl", [_gen(1)])
    s = evaluate.main(["--candidates", str(gen), "--output_dir", str(tmp_path / "a"), "--device", "cpu"])
    assert s["num_problems"] == 1 and s["num_missing"] == 0 and s["correct_rate"] == 1.0
    # explicitly: every selected problem, or the problems --problem_ids names
    s = evaluate.main(["--candidates", str(gen), "--output_dir", str(tmp_path / "b"), "--device", "cpu",
                       "--denominator", "selected"])
    assert s["num_problems"] == 8 and s["num_missing"] == 7
    s = evaluate.main(["--candidates", str(gen), "--output_dir", str(tmp_path / "c"), "--device", "cpu",
                       "--problem_ids", "1,2"])
    assert s["num_problems"] == 2 and s["correct_rate"] == 0.5


# ---------------------------------------------------------------------------- resume keeps nothing spoiled

def test_resume_reevaluates_verdicts_the_machine_may_have_caused(tmp_path, fake, capsys):
    gen = _write_jsonl(tmp_path / "gen.jsonl", [_gen(1), _gen(2, code="class ModelNew: pass\n# fake: incorrect\n"),
                                                _gen(3)])
    args = ["--candidates", str(gen), "--problem_ids", "1,2,3", "--output_dir", str(tmp_path / "eval"),
            "--device", "cpu"]
    fake["ev"] = FakeEvaluator(default="timeout")  # what a too short --timeout left
    assert evaluate.main(args)["verdict_counts"] == {"incorrect": 1, "timeout": 2}
    fake["ev"] = FakeEvaluator()
    s = evaluate.main(args)
    assert sorted(Path(ref).name.split("_")[2] for ref, _ in fake["ev"].evaluated) == ["1", "3"]
    assert s["evaluated_again"] == 2 and s["skipped_resumed"] == 1  # the incorrect verdict stands
    assert s["verdict_counts"] == {"correct": 2, "incorrect": 1}
    assert "2 x its verdict (timeout) may have been caused by the machine" in capsys.readouterr().err


def test_resume_reevaluates_mistyped_rows_and_names_them(tmp_path, fake, capsys):
    out = tmp_path / "eval"
    args = ["--problem_ids", "1,2,3,4", "--output_dir", str(out), "--device", "cpu"]
    fake["ev"] = FakeEvaluator(default="incorrect")
    evaluate.main(args)
    rows = _results(out)
    rows[0]["correct"] = "yes"  # with verdict correct, trusted, it would count as a correct attempt
    rows[0]["verdict"] = "correct"
    rows[1]["speedup"] = "9"
    rows[2]["settings"]["timeout"] = "180"
    del rows[3]["candidate"]
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    fake["ev"] = FakeEvaluator(default="incorrect")
    s = evaluate.main(args)
    assert len(fake["ev"].evaluated) == 4 and s["skipped_resumed"] == 0 and s["correct_rate"] == 0.0
    err = capsys.readouterr().err
    assert "dropped 4 line(s) that are not usable results (the old file is kept as results." in err
    assert "line 1: correct is 'yes', not true or false; line 2: speedup is '9', not a number or null; line 3: " \
           "settings: timeout is '180', not a number; and 1 more" in err
    assert "resume: 0 stored result(s) reused, 4 evaluated again, 0 new" in err


def test_resume_counts_true_and_unusable_lines_dropped_once(tmp_path, fake, capsys):
    """Bad lines of results.jsonl: the attempts they name are evaluated again, those of lines that
    name none are new, and the file is rewritten without them (kept aside), so the next run is clean."""
    out = tmp_path / "eval"
    args = ["--output_dir", str(out), "--device", "cpu"]  # the 8 bundled problems
    evaluate.main(args)
    path = out / "results.jsonl"
    lines = path.read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    rows[0]["speedup"] = "9"  # a wrong type: attempt known, evaluated again
    del rows[1]["settings"]  # no settings: evaluated again
    damaged = [json.dumps(rows[0]), json.dumps(rows[1]), "garbage", *lines[3:7], lines[7][:40]]  # 2 lines name none
    original = ("\n".join(damaged) + "\n").encode() + b"\xff\xfe binary\n"
    path.write_bytes(original)
    capsys.readouterr()
    fake["ev"] = FakeEvaluator()
    s = evaluate.main(args)
    err = capsys.readouterr().err
    assert "dropped 5 line(s) that are not usable results" in err
    assert "resume: 4 stored result(s) reused, 2 evaluated again, 2 new" in err
    assert "2 x its stored line is not a usable result" in err
    assert len(fake["ev"].evaluated) == 4
    assert (s["skipped_resumed"], s["evaluated_again"], s["evaluated_new"]) == (4, 2, 2)
    (backup,) = out.glob("results.*.jsonl.bak")
    assert backup.read_bytes() == original
    kept = path.read_text().splitlines()
    assert kept[:4] == lines[3:7] and len(kept) == 8  # the good lines as written, then the 4 new ones
    assert evaluate.read_results(path).bad == []

    fake["ev"] = FakeEvaluator()
    s = evaluate.main(args)
    err = capsys.readouterr().err
    assert "not usable" not in err and fake["ev"].evaluated == [] and s["skipped_resumed"] == 8


def _edit_stored_settings(path, **changes):
    """Rewrite the settings record of every stored row (`section__name` for a nested field)."""
    rows = _results(path.parent)
    for r in rows:
        for key, value in changes.items():
            section, _, name = key.rpartition("__")
            target = r["settings"][section] if section else r["settings"]
            target[name] = value
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("flags, stored", [
    (["--trials", "2"], {}),
    (["--timeout", "60"], {}),
    (["--require_triton", "false"], {}),
    ([], {"device": "cuda"}),  # results.jsonl made on a GPU
    ([], {"environment__cpu": "another CPU"}),
    ([], {"evaluator__atol_fp32": 0.5}),
], ids=["trials", "timeout", "require_triton", "device", "environment", "tolerance"])
def test_resume_reevaluates_results_of_other_settings(tmp_path, fake, capsys, flags, stored):
    out = tmp_path / "eval"
    args = ["--problem_ids", "1,2", "--output_dir", str(out), "--device", "cpu"]
    evaluate.main(args)
    _edit_stored_settings(out / "results.jsonl", **stored)
    fake["ev"] = FakeEvaluator()
    s = evaluate.main(args + flags)
    assert len(fake["ev"].evaluated) == 2 and s["evaluated_again"] == 2 and s["skipped_resumed"] == 0
    assert "2 x made with other settings" in capsys.readouterr().err
    fake["ev"] = FakeEvaluator()
    assert evaluate.main(args + flags)["skipped_resumed"] == 2 and fake["ev"].evaluated == []


# ---------------------------------------------------------------------------- usage errors

@pytest.mark.parametrize("flags, message", [
    (["--device", "tpu"], "device must be auto, cpu, cuda or cuda:N"),
    (["--timeout", "0"], "timeout must be in (0, 604800]"),
    (["--trials", "0"], "trials must be in [1, 1000]"),
    (["--perf_trials", "0"], "perf_trials must be in [1, 100000], got 0"),  # EvalConfig's limit, not another
    (["--perf_trials", "200000"], "perf_trials must be in [1, 100000], got 200000"),
    (["--candidates", "no/such/dir"], "no/such/dir: no such file or directory"),
    (["--candidates", "/dev/null"], "/dev/null: not a regular file or a folder"),
    (["--denominator", "some"], "--denominator must be one of"),
    (["--no_such_option", "1"], "unknown option(s) --no_such_option"),
], ids=["device", "timeout", "trials", "perf_trials_0", "perf_trials_huge", "candidates", "candidates_device",
        "denominator", "unknown"])
def test_usage_errors_exit_2_with_one_line(tmp_path, fake, capsys, flags, message):
    with pytest.raises(SystemExit) as exc:
        evaluate.main(["--output_dir", str(tmp_path / "eval")] + flags)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("evaluate.py: error: ") and message in err[-1]
    assert fake["ev"].calls == [] and not (tmp_path / "eval").exists()


def test_unusable_output_paths_are_usage_errors(tmp_path, fake, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an empty --output_dir once wrote into the working directory
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for flags, message in ((["--output_dir", str(a_file)], f"--output_dir {a_file}: is a file, not a directory"),
                           (["--output_dir", ""], "--output_dir is empty (name a directory)"),
                           (["--output_dir", str(a_file / "eval")], f"--output_dir {a_file / 'eval'}: lies below a file"),
                           (["--output_dir", "/proc/drk_none/eval"], "--output_dir /proc/drk_none/eval: "),
                           (["--cache_dir", str(a_file)], f"--cache_dir {a_file}: is a file, not a directory")):
        with pytest.raises(SystemExit) as exc:
            evaluate.main(["--output_dir", str(tmp_path / "eval"), "--problem_ids", "1", "--device", "cpu"] + flags)
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and err[-1].startswith("evaluate.py: error: ") and message in err[-1], flags
        assert "Traceback" not in "".join(err)
    assert fake["ev"].calls == [] and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("name", ["results.jsonl", "summary.json", "report.md", "fast_p_curve.png"])
def test_an_output_file_of_the_wrong_kind_stops_the_run_before_any_work(tmp_path, fake, capsys, name):
    """The results are appended as they come and the report is written last: a path either cannot
    write is found before anything is evaluated."""
    out = tmp_path / "eval"
    (out / name).mkdir(parents=True)
    with pytest.raises(SystemExit) as exc:
        evaluate.main(["--output_dir", str(out), "--problem_ids", "1", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and err[-1] == f"evaluate.py: error: --output_dir {out / name}: is a directory, not a file"
    assert fake["ev"].calls == [] and [p.name for p in out.iterdir()] == [name]


def test_an_output_dir_holding_a_training_run_is_refused(tmp_path, fake, capsys):
    """evaluate.py's report.md would replace the training run's own."""
    out = tmp_path / "rl"
    (out / "checkpoint-3").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 3}\n')
    with pytest.raises(SystemExit) as exc:
        evaluate.main(["--output_dir", str(out), "--problem_ids", "1", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and err[-1] == (f"evaluate.py: error: --output_dir {out}: holds a training run "
                                               f"(checkpoint-3, metrics.jsonl), whose report this one would replace; "
                                               f"give evaluate.py another --output_dir")
    assert fake["ev"].calls == [] and sorted(p.name for p in out.iterdir()) == ["checkpoint-3", "metrics.jsonl"]


def test_a_second_evaluate_py_on_one_output_dir_is_refused_while_the_first_runs(tmp_path, fake, capsys):
    """Two runs would interleave their rows in one results.jsonl: the second stops before any work."""
    out = tmp_path / "eval"
    holder = ("import sys, time\nfrom drkernel.config import create_output\n"
              "print(create_output('--output_dir', sys.argv[1], is_dir=True), flush=True)\ntime.sleep(120)\n")
    first = subprocess.Popen([sys.executable, "-c", holder, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "None"
        with pytest.raises(SystemExit) as exc:
            evaluate.main(["--output_dir", str(out), "--problem_ids", "1", "--device", "cpu"])
    finally:
        first.kill()
        first.wait()
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and err[-1] == (f"evaluate.py: error: --output_dir {out}: another run is writing "
                                               f"there now; wait for it to end, or choose another")
    assert fake["ev"].calls == [] and list(out.iterdir()) == []


@pytest.mark.parametrize("kind", ["file", "dangling symlink"])
def test_references_are_scratch_files_outside_the_output_dir(tmp_path, fake, kind):
    out = tmp_path / "eval"
    out.mkdir()
    if kind == "file":
        (out / "references").write_text("mine")
    else:
        (out / "references").symlink_to(tmp_path / "gone")
    summary = evaluate.main(["--output_dir", str(out), "--problem_ids", "1", "--device", "cpu"])
    assert summary["correct_rate"] == 1.0 and len(fake["ev"].evaluated) == 1
    assert not Path(fake["ev"].evaluated[0][0]).exists()  # the reference's scratch copy is gone
    assert (out / "references").is_symlink() if kind != "file" else (out / "references").read_text() == "mine"


def test_cuda_without_a_gpu_is_a_usage_error(tmp_path, fake, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as exc:
        evaluate.main(["--output_dir", str(tmp_path / "eval"), "--device", "cuda"])
    assert exc.value.code == 2 and "no GPU is visible" in capsys.readouterr().err


def test_help_and_start_line_name_the_base(tmp_path, fake, capsys):
    with pytest.raises(SystemExit) as exc:
        evaluate.main(["--help"])
    assert exc.value.code == 0 and "base configuration: the EvaluateConfig defaults" in capsys.readouterr().out
    evaluate.main(["--problem_ids", "1", "--output_dir", str(tmp_path / "eval"), "--device", "cpu"])
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("evaluate.py: settings: the library defaults") and "problem_ids=1" in first


def _real_evaluator_usable():
    try:
        from drkernel.evaluator import Evaluator  # noqa: F401
    except Exception:
        return False
    return os.environ.get("DRKERNEL_SKIP_E2E") != "1"


@pytest.mark.slow
@pytest.mark.skipif(not _real_evaluator_usable(), reason="drkernel.evaluator unavailable or DRKERNEL_SKIP_E2E=1")
def test_ctrl_c_ends_with_one_line_and_keeps_the_finished_results(tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) once the first result is saved:
    status 130, one line naming the results file, no traceback."""
    out, err = tmp_path / "eval", tmp_path / "stderr.txt"
    cmd = [sys.executable, str(ROOT / "evaluate.py"), "--output_dir", str(out), "--device", "cpu", "--trials", "1",
           "--perf_trials", "3", "--chunk_size", "1", "--workers", "1"]  # one evaluation in flight at a time
    with open(err, "w") as fh:  # a file, not a pipe: nothing has to drain it while the run goes on
        # SIGINT restored to its default: a shell's background job (this test's, maybe) inherits it ignored
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=fh, start_new_session=True,
                                env={**os.environ, "TRITON_INTERPRET": "1"},
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 60
        while not (out / "results.jsonl").is_file() or not (out / "results.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    text = err.read_text()
    assert "Traceback" not in text and 0 < len(_results(out)) < 8
    (line,) = [ln for ln in text.splitlines() if "interrupted" in ln]
    assert line == (f"evaluate.py: interrupted; the finished results are in {out / 'results.jsonl'}; run the same "
                    f"command again (with --resume true, the default) to evaluate only the rest")


@pytest.mark.skipif(not _real_evaluator_usable(), reason="drkernel.evaluator unavailable or DRKERNEL_SKIP_E2E=1")
def test_real_evaluator_bundled_relu(tmp_path):
    """The real sandboxed evaluator on CPU (Triton interpreter): bundled 1_ReLU is correct."""
    out = tmp_path / "eval"
    s = evaluate.main(["--problem_ids", "1", "--trials", "1", "--perf_trials", "3", "--output_dir", str(out)])
    (row,) = _results(out)
    assert row["verdict"] == "correct", row.get("error")
    assert s["correct_rate"] == 1.0 and s["num_missing"] == 0 and s["compile_rate"] == 1.0
