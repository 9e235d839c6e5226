"""The row and table helpers of the GPU bench scripts, on made-up results (no GPU, no evaluation):
bench/neighbours.py's verdict on one honest kernel, bench/evaluator.py's row per case,
bench/ref_self.py's rows and bench/ablation.py's printed table."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import ablation, neighbours, ref_self  # noqa: E402
from bench import evaluator as evaluator_bench  # noqa: E402
from drkernel.evaluator import EvalResult  # noqa: E402


def result(verdict="correct", speedup=None, hacks=(), **kw):
    return EvalResult(verdict=verdict, speedup=speedup, hacks=list(hacks), **kw)


def test_an_honest_kernel_failing_alone_and_beside_hostile_ones_is_not_ok():
    row = neighbours.honest_row("k.py", result("runtime_error"), result("runtime_error"), 0.03)
    assert row["ok"] is False and row["speedup_drift"] is None


def test_an_honest_kernel_is_ok_only_correct_both_times_and_within_the_tolerance():
    assert neighbours.honest_row("k.py", result(speedup=1.0), result(speedup=1.02), 0.03)["ok"] is True
    assert neighbours.honest_row("k.py", result(speedup=1.0), result(speedup=1.05), 0.03)["ok"] is False
    assert neighbours.honest_row("k.py", result(speedup=1.0), result(speedup=1.0, hacks=["side_stream"]),
                                 0.03)["ok"] is False
    drift = neighbours.honest_row("k.py", result(speedup=2.0), result(speedup=1.98), 0.03)["speedup_drift"]
    assert drift == pytest.approx(0.01)


def test_evaluator_row_says_what_the_speedups_were_measured_against_and_how_precisely():
    runs = [result(speedup=1.0, baseline="compile", speedup_precise=True, wall_s=2.0),
            result(speedup=1.1, baseline="compile", speedup_precise=False, wall_s=4.0)]
    row = evaluator_bench._row("case", runs)
    assert row["baseline"] == "compile" and row["precise"] == [True, False]
    assert row["spread"] == pytest.approx(0.1) and row["median_wall_s"] == 3.0


def test_ref_self_rows_keep_why_a_reference_time_moved(capsys):
    from types import SimpleNamespace
    task = SimpleNamespace(key="3_20", name="20_MobileNetV2.py")
    timed = result(speedup=0.9, ref_ms=6.0, speedup_interval=[0.7, 1.2], speedup_precise=False,
                   details={"ref_ms_isolated": 3.2, "timing_core": 15, "idle_wait_s": 0.01, "timed_calls": 100})
    rows = ref_self.rows_of([task, task], [timed, result("crashed", error="killed")])
    assert rows[0]["diagnostics"]["ref_ms_isolated"] == 3.2 and rows[0]["diagnostics"]["timing_core"] == 15
    assert rows[1]["diagnostics"]["timing_core"] is None and rows[1]["verdict"] == "crashed"
    ref_self.print_table("t", rows, ref_self.summary(rows), 1.0)
    line = capsys.readouterr().out.splitlines()[2]
    assert "ref    6.000 ms alone    3.200 ms core 15  <-- outside" in line, line


def test_ref_self_shows_the_ratio_of_medians_beside_the_judges_paired_speedup():
    """The bench prints what the judge would say without pairing: median(ref) / median(candidate)."""
    from types import SimpleNamespace
    task = SimpleNamespace(key="3_19", name="19_MobileNetV1.py")
    timed = {"reference": [1.0, 2.0, 3.0], "candidate": [1.0, 1.0, 1.5]}
    rows = ref_self.rows_of([task], [result(speedup=1.5, details={"timed_ms": timed})])
    assert rows[0]["of_medians"] == pytest.approx(2.0)
    assert ref_self.summary(rows)["in_band_of_medians"] == 0
    assert ref_self.rows_of([task], [result("crashed")])[0]["of_medians"] is None


def test_ablation_prints_its_headline_numbers_as_a_table(capsys):
    run = {"final_J": 2.5, "mean_cosine_to_on_policy": 0.7, "mean_reject_rate": 0.25,
           "expected_update_cosine_to_on_policy": 0.99}
    ablation.print_table({"N": 4, "grpo_over_trloo_grad_ratio": 0.751, "grpo_on_true_gradient": 0.755,
                          "trloo_on_true_gradient": 1.007, "lazy_share_start": 0.62, "lazy_share_with_pr_prs": 0.35,
                          "lazy_share_without": 0.83, "mismatch": {"drift_corrected": run}, "wall_s": 9.9})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("(a) GRPO / TRLOO gradient, N=4 (1 - 1/N = 0.750)") and lines[0].endswith("0.751")
    assert next(line for line in lines if line.startswith("drift_corrected")).split()[1:] == \
        ["2.500", "0.700", "0.990", "0.250"]


@pytest.mark.parametrize("script", ["hacks.py", "evaluator.py", "ref_self.py", "profiler_after.py"])
def test_a_gpu_benchmark_on_a_machine_without_one_is_one_line_and_no_json(script, tmp_path):
    import subprocess

    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(root / "bench" / script), "--out", str(out)], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "no GPU is visible" in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert not out.exists()


# ---- bench/judge_costs.py on bad input: one line, exit status 2, no JSON ----------------------

@pytest.fixture
def one_problem_kernelbench(tmp_path):
    """A KernelBench copy in the hub's layout holding one small problem: level 1, id 1."""
    import json

    from drkernel.tasks import load_tasks

    task = min(load_tasks("bundled"), key=lambda t: len(t.code))
    split = tmp_path / "kb" / "data" / "level_1-00000-of-00001.jsonl"
    split.parent.mkdir(parents=True)
    split.write_text(json.dumps({"code": task.code, "level": 1, "name": task.name, "problem_id": 1}) + "\n")
    return split.parent.parent


@pytest.mark.parametrize("args, message", [
    (["--problems", "x"], "--problems: 'x' is not level:id (e.g. 1:19), in 'x'"),
    (["--problems", "1:1,1:19:3"], "--problems: '1:19:3' is not level:id"),
    (["--problems", "1:-1"], "--problems: '1:-1' is not level:id"),
    (["--problems", ","], "--problems names no problem"),
    (["--problems", "1:1,1:9999"], "has no problem 9999"),
    (["--problems", "1:1", "--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--problems", "1:1", "--repeats", "-3"], "--repeats must be >= 1, got -3"),
])
def test_judge_costs_on_bad_input_says_one_line_and_exits_2(args, message, one_problem_kernelbench, tmp_path,
                                                             capsys):
    from bench import judge_costs
    from bench.entry import exit_status

    out = tmp_path / "judge_costs.json"
    argv = ["--device", "cpu", "--kernelbench", str(one_problem_kernelbench), "--json", str(out), *args]
    status = exit_status(lambda: judge_costs.main(argv))
    err = capsys.readouterr().err  # before the line: at most `datasets`' progress bars
    assert status == 2 and "Traceback" not in err, err
    assert ": error: " in err.strip().splitlines()[-1] and message in err.strip().splitlines()[-1], err
    assert not out.exists()


def test_judge_costs_with_zero_repeats_is_one_line_from_the_command_line(tmp_path):
    import subprocess

    out = tmp_path / "judge_costs.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "judge_costs.py"), "--repeats", "0",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["judge_costs.py: error: --repeats must be >= 1, got 0"]
    assert not out.exists()


# ---- bench/kernelbench_eval.py and bench/ref_self.py on bad input ------------------------------

@pytest.mark.parametrize("content, says", [
    ("nope", "not JSON"), ("[1, 2]", "not a kernelbench_eval.json (an object with runs and rows)"),
    ('{"runs": {}, "rows": [{"level": 1}]}', "rows[0] lacks problem_id"),
    ('{"runs": {}, "rows": [3]}', "rows[0] not an object"),
])
def test_kernelbench_eval_replot_of_another_file_is_one_line(content, says, tmp_path, capsys):
    from bench import kernelbench_eval
    from bench.entry import exit_status

    saved = tmp_path / "saved.json"
    saved.write_text(content)
    argv = ["--replot", str(saved), "--out_dir", str(tmp_path / "out")]
    assert exit_status(lambda: kernelbench_eval.main(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f": error: --replot {saved}: {says}" in err.strip().splitlines()[-1], err


@pytest.mark.parametrize("script, args, says", [
    ("kernelbench_eval.py", ["--levels", "1,x", "--build_only"], "levels must be a comma list of integers, not '1,x'"),
    ("kernelbench_eval.py", ["--problem_ids", "y", "--build_only"], "problem_ids must be a comma list of integers, not 'y'"),
    ("ref_self.py", ["--levels", "x"], "--levels must be a comma list of integers, not 'x'"),
])
def test_a_level_list_that_is_not_integers_is_one_line(script, args, says, tmp_path):
    import subprocess

    out = ["--out_dir", str(tmp_path / "out")] if script == "kernelbench_eval.py" else ["--out", str(tmp_path / "o.json")]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args, *out], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [f"{script}: error: {says}"], proc.stderr


def test_hacks_with_an_only_that_matches_nothing_keeps_the_results_file(tmp_path):
    import subprocess

    out = tmp_path / "hacks.json"
    out.write_text("[\"earlier results\"]")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "hacks.py"), "--device", "cpu", "--only", "zzzz",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--only zzzz: matches no fixture" in proc.stderr.strip().splitlines()[-1]
    assert out.read_text() == "[\"earlier results\"]"


# ---- an output that cannot be written: one line before any work, not a lost result at the end --

UNWRITABLE = "/proc/drk_none/x.json"


def assert_refused_at_once(script: str, args: list[str], says: str, monkeypatch, capsys) -> None:
    """`bench/<script>.py ARGS` (its main, in this process: no second torch import) ends within
    seconds with exit status 2 and one line starting `<script>.py: error: <says>`."""
    import importlib
    import time

    from bench.entry import exit_status

    module = importlib.import_module(f"bench.{script}")
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *args])
    t0 = time.perf_counter()
    status = exit_status(module.main)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith(f"{script}.py: error: {says}"), err
    assert time.perf_counter() - t0 < 10, "refused only after the work"


@pytest.mark.parametrize("script, option", [
    ("ablation", "--json"), ("candidates", "--write"), ("default_run", "--out"), ("eval_throughput", "--json"),
    ("evaluator", "--out"), ("hacks", "--out"), ("judge_costs", "--json"), ("kernelbench_eval", "--out_dir"),
    ("neighbours", "--out"), ("ref_self", "--out"), ("rl_step", "--out"), ("rollout", "--out"), ("sft", "--out"),
    ("update", "--out"),
])
def test_an_output_under_proc_is_one_line_naming_the_option_before_any_work(script, option, monkeypatch, capsys):
    assert_refused_at_once(script, [option, UNWRITABLE], f"{option} {UNWRITABLE}: ", monkeypatch, capsys)


@pytest.mark.parametrize("script, option", [("ablation", "--plots"), ("eval_throughput", "--cache-dir")])
def test_a_folder_option_naming_a_file_is_one_line_before_any_work(script, option, tmp_path, monkeypatch, capsys):
    existing = tmp_path / "a_file"
    existing.write_text("")
    assert_refused_at_once(script, [option, str(existing)], f"{option} {existing}: is a file, not a directory",
                           monkeypatch, capsys)


@pytest.mark.parametrize("args, says", [
    (["--size", "-1"], "--size must be >= 0 (0: every candidate), got -1"),
    (["--device", "xx"], "bad --device 'xx': use cpu, cuda or cuda:N"),
], ids=["size", "device"])
def test_candidates_with_a_negative_size_or_an_unknown_device_is_one_line(args, says, monkeypatch, capsys):
    assert_refused_at_once("candidates", args, says, monkeypatch, capsys)


@pytest.mark.parametrize("args, says", [
    (["--workers", "x"], "--workers must be a comma list of integers, not 'x'"),
    (["--workers", "1,0"], "--workers must list counts >= 1, got '1,0'"),
    (["--size", "-1"], "--size must be >= 0 (0: all), got -1"),
], ids=["workers-text", "workers-zero", "size"])
def test_eval_throughput_with_bad_counts_is_one_line(args, says, tmp_path, monkeypatch, capsys):
    assert_refused_at_once("eval_throughput", [*args, "--device", "cpu", "--shrink", "--json",
                                               str(tmp_path / "t.json")], says, monkeypatch, capsys)


@pytest.mark.parametrize("script, args, says", [
    ("rollout.py", ["--device", "cpu", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    ("rollout.py", ["--device", "cpu", "--batch", "-1"], "argument --batch: must be in [1, 1e+06], got -1"),
    ("evaluator.py", ["--device", "cpu", "--repeats", "0"], "argument --repeats: must be in [1, 1e+06], got 0"),
    ("sft.py", ["--tiny", "--steps", "0"], "argument --steps: must be in [1, 1e+06], got 0"),
    ("update.py", ["--tiny", "--batch", "x"], "argument --batch: not a whole number: 'x'"),
    ("update.py", ["--tiny", "--variants", "mb=x"], "bad variant part 'mb=x' in 'mb=x': the value must be an integer"),
    pytest.param("eval_throughput.py", ["--device", "cpu", "--shrink", "--baseline", "{}"], "not a JSON of this script",
                 marks=pytest.mark.skipif(not (ROOT.parent / "shared" / "kernelbench").is_dir(),
                                          reason="needs ../shared/kernelbench")),
])
def test_counts_and_dtypes_a_bench_cannot_use_are_usage_errors(script, args, says, tmp_path):
    """A batch of -1 or 0 repeats, a malformed variant or baseline file was a traceback, or a JSON of
    NaN rates written with exit 0."""
    import subprocess

    (tmp_path / "{}").write_text("{}")  # a baseline file that is JSON of something else
    out = ["--json", str(tmp_path / "o.json"), "--kernelbench", str(ROOT.parent / "shared" / "kernelbench")] \
        if script == "eval_throughput.py" else ["--out", str(tmp_path / "o.json")]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args, *out],
                          cwd=tmp_path if script == "eval_throughput.py" else ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and says in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert not (tmp_path / "o.json").exists()
