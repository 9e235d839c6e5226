"""The report at the end of every run: the step table and training_curves.png of RL and SFT runs
(drkernel.report.write_run_report), the RL trainer writing it, generate.py's report directory and
the evaluation table's Triton share and seconds per phase."""

import json
import sys
from pathlib import Path

import pytest

from drkernel import metrics, report

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PNG = b"\x89PNG\r\n\x1a\n"


def write_rl_run(out: Path, steps: int, dumps: bool = True) -> None:
    """metrics.jsonl of `steps` RL steps (step 2 logged twice, as a resumed run does) and rollout
    dumps of 4 turns per step, one of them not compiled: step s flags `output_cached` on s % 2 turns,
    step 3 also `decoy_kernel`."""
    (out / "rollouts").mkdir(parents=True)
    rows = [{"step": s, "loss": 0.01 * s, "reward_mean": 0.25 * s, "correct": 0.25, "fast_1": 0.0,
             "triton_share": 0.5, "all/format_error": 0.25, "lr": 1e-6, "generate_s": 10.0, "evaluate_s": 2.0,
             "update_s": 5.0, "step_s": 17.5} for s in range(1, steps + 1)]
    rows.insert(1, dict(rows[1], loss=-1.0))  # step 2 of the first attempt, redone after a resume
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for s in range(1, steps + 1) if dumps else ():
        turns = [{"verdict": "correct", "compiled": True, "hacks": []} for _ in range(3)]
        turns.append({"verdict": "compile_error", "compiled": False, "hacks": []})
        for t in range(s % 2):
            turns[t] = {"verdict": "hacked", "compiled": True, "hacks": ["output_cached"]}
        if s == 3:
            turns[2] = {"verdict": "hacked", "compiled": True, "hacks": ["decoy_kernel", "output_cached"]}
        (out / "rollouts" / f"step_{s}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in turns))


def test_rl_history_merges_metrics_and_hack_rates(tmp_path):
    write_rl_run(tmp_path, 3)
    (tmp_path / "rollouts" / "step_2.jsonl").unlink()  # a step without its dump: hack rates unknown
    history = report.load_run_history(tmp_path)
    assert history.steps == [1, 2, 3]
    assert history.series["loss"] == [0.01, 0.02, 0.03]  # a step logged twice keeps its last row
    assert history.series[report.HACKED] == [0.25, None, 0.5]
    assert history.series[report.COMPILED] == [0.75, None, 0.75]
    assert history.series["hack:output_cached"] == [0.25, None, 0.5]
    assert history.series["hack:decoy_kernel"] == [0.0, None, 0.25]
    assert history.keys("hack:") == ["hack:decoy_kernel", "hack:output_cached"]


def test_rl_run_report_table_markdown_and_plot(tmp_path, capsys):
    write_rl_run(tmp_path, 3)
    paths = report.write_run_report(tmp_path, "RL run: test")
    printed = capsys.readouterr().out
    header, rule, *rows = printed.splitlines()[1:6]
    assert header.split() == ["step", "reward", "compiled", "correct", "fast_1", "triton", "format_err", "hacked",
                              "decoy_kernel", "output_cached", "loss", "generate_s", "evaluate_s", "update_s"]
    assert rows[2].split() == ["3", "0.75", "75%", "25%", "0%", "50%", "25%", "50%", "25%", "50%", "0.03", "10.0",
                               "2.0", "5.0"]
    md = paths["report.md"].read_text()
    assert md.startswith("# RL run: test") and "| 2 | 0.5 | 75% | 25% |" in md and "training_curves.png" in md
    png = paths[report.RUN_PLOT]
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 20_000


def test_long_runs_show_evenly_spaced_steps_with_the_first_and_last(tmp_path, capsys):
    write_rl_run(tmp_path, 57, dumps=False)
    report.write_run_report(tmp_path, "long")
    printed = capsys.readouterr().out
    assert printed.startswith(f"long ({report.MAX_TABLE_ROWS} of 57 steps):")
    steps = [int(line.split()[0]) for line in printed.splitlines()[3:3 + report.MAX_TABLE_ROWS]]
    assert steps[0] == 1 and steps[-1] == 57 and steps == sorted(set(steps))
    assert "hacked" not in printed.splitlines()[1]  # no rollout dumps: no hack columns


def test_sft_run_report_has_the_columns_sft_logs(tmp_path, capsys):
    rows = [{"step": s, "loss": 2.0 / s, "lr": 1e-3, "tokens_per_s": 90.0, "step_time_s": 20.0} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report.write_run_report(tmp_path, "SFT run")
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["step", "loss", "step_s"] and lines[4].split() == ["2", "1", "20.0"]
    assert (tmp_path / report.RUN_PLOT).read_bytes()[:8] == PNG


def test_no_steps_no_report_and_it_says_why(tmp_path, capsys):
    assert report.write_run_report(tmp_path, "empty") == {}
    assert f"no report written in {tmp_path}: there is no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": null}\n{"step": 1, "loss"')  # the only step's row cut
    assert report.write_run_report(tmp_path, "cut") == {}
    err = capsys.readouterr().err
    assert "skipped 2 line(s) that hold no step: line 1: no step number; line 2: not a JSON object" in err
    assert f"no report written in {tmp_path}: metrics.jsonl holds no step's row" in err
    assert not (tmp_path / "report.md").exists()


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_rl_trainer_writes_the_report_with_hack_codes(tiny_tokenizer, tmp_path, capsys):
    """Every turn answers with code; the scripted environment flags every other one as a hack."""
    from drkernel.generation import GenOutput
    from drkernel.tasks import load_bundled
    from drkernel.trainer import TrainConfig, Trainer
    from tests.tiny_lm import full_forward_logprobs, tiny_random_model

    tok = tiny_tokenizer
    model = tiny_random_model(vocab_size=len(tok), seed=0)
    # answers of two lengths: with two members the advantages are +a and -a, so the token-mean
    # loss is non-zero only when their lengths differ
    answers = [tok(f"```python\nclass ModelNew(nn.Module):\n{body}```\n", add_special_tokens=False)["input_ids"]
               for body in ("", "    pass\n")]

    def generator(model, tokenizer, prompts, gcfg):
        return [GenOutput(a, full_forward_logprobs(model, p, a, gcfg).tolist(), True)
                for p, a in zip(prompts, answers)]

    def evaluate_fn(pairs):
        from drkernel.evaluator import EvalResult
        return [EvalResult(verdict="hacked", hacks=["output_cached"], correct=False) if i % 2 else
                EvalResult(verdict="correct", correct=True, compiled=True, speedup=0.5 + i, hacks=[])
                for i in range(len(pairs))]

    cfg = TrainConfig(model="injected", output_dir=str(tmp_path), max_steps=2, tasks_per_step=1, num_generations=2,
                      num_turns=1, max_new_tokens=8, log_with="none", save_steps=0, seed=0)
    Trainer(cfg, model=model, tokenizer=tok, tasks=load_bundled([1]), evaluate_fn=evaluate_fn,
            generator=generator).train()
    printed = capsys.readouterr().out
    assert f"RL run: {tmp_path}:" in printed and "output_cached" in printed
    history = report.load_run_history(tmp_path)
    assert history.steps == [1, 2] and history.series["hack:output_cached"] == [0.5, 0.5]
    assert history.series["correct"] == [0.5, 0.5] and all(history.series["loss"])
    assert history.series[report.COMPILED] == [0.5, 0.5]  # the hacked answers were not reported compiled
    assert (tmp_path / report.RUN_PLOT).read_bytes()[:8] == PNG


def test_generate_writes_a_report_directory(tmp_path, tiny_model_dir, monkeypatch):
    import generate
    from tests.test_generate import FakeEvaluator, _tiny_args

    monkeypatch.setattr(generate, "make_evaluator", lambda cfg, device: FakeEvaluator())
    out = tmp_path / "gen.jsonl"
    generate.main(_tiny_args(tiny_model_dir, out, samples=1))
    folder = tmp_path / "gen_report"
    assert generate.report_dir(out) == folder
    for name in ("report.md", "summary.json", "fast_p_curve.png", "per_turn.png"):
        assert (folder / name).is_file(), name
    assert "| turn 1 |" in (folder / "report.md").read_text()


def test_evaluation_table_shows_triton_share_and_seconds_per_phase():
    rows = [{"level": 1, "problem_id": 1, "verdict": "correct", "correct": True, "compiled": True, "speedup": 2.0,
             "triton_time_share": 0.8, "details": {"phase_s": {"import": 1.0, "timing": 3.0}}},
            {"level": 1, "problem_id": 2, "verdict": "incorrect", "compiled": True, "correct": False,
             "details": {"phase_s": {"import": 2.0}}}]
    summary = metrics.summarize(rows)
    assert summary["mean_phase_s"] == {"import": 1.5, "timing": 3.0}
    table = report.format_table(summary)
    assert "mean_triton_time_share" in table.splitlines()[0]
    assert "80.0%" in table.splitlines()[2]
    assert table.splitlines()[-1] == "seconds per evaluation by phase: import=1.50, timing=3.00"
