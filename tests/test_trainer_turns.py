"""Which turns the trainer trains on, in a scripted environment: void turns, failed trajectories,
PRS, outcome masks, non-default advantage and reward settings, the evaluator wiring, and
`--resume_from auto` with checkpoint rotation, a cut metrics.jsonl and no step left. Every answer
is code; the environment scripts each (trajectory, turn)'s verdict, so no real evaluation runs."""

import dataclasses
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from drkernel import report
from drkernel.advantages import compute_advantages
from drkernel.evaluator import EvalResult
from drkernel.generation import GenOutput
from drkernel.rewards import score
from drkernel.rollout import EvaluatorFailure, TurnSample
from drkernel.tasks import load_bundled
from drkernel.trainer import (RolloutCost, StepReport, TrainConfig, Trainer, TurnFlags, TurnRecord, step_metrics,
                              update_samples, void_turns)
from tests.tiny_lm import tiny_random_model

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")
CODE = "```python\nclass ModelNew(nn.Module):\n    pass\n```"


def ok(share=None, speedup=None):
    return EvalResult(verdict="correct", compiled=True, correct=True, speedup=speedup, triton_time_share=share)


def bad():
    return EvalResult(verdict="incorrect", compiled=True, error="wrong values")


class ScriptedEnv:
    """Answers with code (`finished[traj]`; log-probs 0, so the runs switch the mismatch correction
    off); `script[turn][traj]` is the verdict, or an exception the evaluator raises for the turn."""

    def __init__(self, tokenizer, script, finished=None):
        self.tok, self.script, self.finished, self.turn = tokenizer, script, finished, -1

    def generate(self, model, tok, prompts, gcfg):
        self.turn += 1
        ids = tok(CODE, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        done = self.finished or [True] * len(prompts)
        return [GenOutput(ids, [0.0] * len(ids), done[i]) for i in range(len(prompts))]

    def evaluate(self, pairs):
        verdicts = self.script[self.turn % len(self.script)]
        if isinstance(verdicts, Exception):
            raise verdicts
        assert len(pairs) == len(verdicts)
        return [v() if callable(v) else v for v in verdicts]


def run_step(tokenizer, tmp_path, script, *, finished=None, **kw):
    """One training step; returns (metrics, dump rows ordered by trajectory then turn)."""
    model = tiny_random_model(vocab_size=len(tokenizer), seed=0)
    model.config.eos_token_id = tokenizer.eos_token_id
    base = dict(model="injected", output_dir=str(tmp_path), max_steps=1, tasks_per_step=1,
                num_generations=len(script[0]) if isinstance(script[0], list) else 3, num_turns=len(script),
                log_with="none", save_steps=0, prs=False, mismatch_correction=False, seed=0)
    env = ScriptedEnv(tokenizer, script, finished)
    trainer = Trainer(TrainConfig(**{**base, **kw}), model=model, tokenizer=tokenizer, tasks=load_bundled([1]),
                      evaluate_fn=env.evaluate, generator=env.generate)
    metrics = trainer.train()[0]
    rows = [json.loads(line) for line in (Path(tmp_path) / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    return metrics, sorted(rows, key=lambda r: (r["traj"], r["turn"]))


def decide(script, **kw):
    """The trainer's decisions for a scripted rollout of one group, without a model: each
    result scored with the run's reward config, as the rollout does. Returns (samples, flags)
    trajectory-major, and a grid helper for them."""
    cfg = TrainConfig(**{"prs": False, "num_generations": len(script[0]), "num_turns": len(script), **kw})
    trajectories = []
    for b in range(len(script[0])):
        traj = []
        for t, verdicts in enumerate(script):
            v = verdicts[b]
            result = v() if callable(v) else v
            traj.append(TurnSample("0_1", 0, b, t + 1, [1], [2, 3], [0.0, 0.0], "", CODE, result,
                                   score(result, cfg.reward_config())))
        trajectories.append(traj)
    samples, flags = update_samples(trajectories, cfg, random.Random(0))
    rows = [{"traj": s.traj_id, "turn": s.turn, "reward": s.reward, "advantage": u.advantage,
             **dataclasses.asdict(f)} for s, u, f in zip([s for t in trajectories for s in t], samples, flags)]
    return samples, rows


def grid(rows, key):
    """A per-(trajectory, turn) field as [[turn 1, turn 2, ...] per trajectory]."""
    out = {}
    for r in rows:
        out.setdefault(r["traj"], []).append(r[key])
    return [out[t] for t in sorted(out)]


def flat(nested):
    return [x for row in nested for x in row]


def test_void_turns_by_hand():
    assert void_turns([0.5, 0.0, 0.5]) == [False, True, False]
    assert void_turns([0.0, -1.0, 0.5, 0.0]) == [False, False, False, True]  # only after a success
    assert void_turns([0.5, 0.5, -0.1]) == [False, False, True]


# rewards 0.5 (correct, no speedup, no profile) and 0 (failure), per trajectory:
#   traj 0: 0.5, 0, 0.5 (turn 2 is void)    traj 1: 0, 0, 0.5    traj 2: 0.5, 0.5, 0 (turn 3 is void)
VOID_SCRIPT = [[ok, bad, ok], [bad, bad, ok], [ok, ok, bad]]


def test_void_turns_leave_the_baseline_and_the_loss():
    samples, rows = decide(VOID_SCRIPT)
    assert grid(rows, "reward") == [[0.5, 0.0, 0.5], [0.0, 0.0, 0.5], [0.5, 0.5, 0.0]]
    assert grid(rows, "void") == [[False, True, False], [False, False, False], [False, False, True]]
    assert grid(rows, "in_baseline") == grid(rows, "in_loss") == [[True, False, True], [True] * 3, [True, True, False]]
    # reward-to-go over the baseline's turns (void rewards count 0): traj 0 [1.0, -, 0.5],
    # traj 1 [0.5, 0.5, 0.5], traj 2 [1.0, 0.5, -]; leave-one-out per turn among the members
    assert flat(grid(rows, "advantage")) == pytest.approx([0.25, 0.0, 0.0, -0.5, 0.0, 0.0, 0.25, 0.0, 0.0])
    assert [s.in_baseline for s in samples] == flat(grid(rows, "in_baseline"))
    assert [s.trajectory for s in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_without_void_masking_every_turn_counts():
    _, rows = decide(VOID_SCRIPT, mask_void_turn=False)
    assert grid(rows, "in_baseline") == [[True] * 3] * 3 and not any(r["void"] for r in rows)
    # turn 3: returns 0.5, 0.5, 0 -> leave-one-out 0.25, 0.25, -0.5
    assert [a[2] for a in grid(rows, "advantage")] == pytest.approx([0.25, 0.25, -0.5])


def test_a_trajectory_with_an_evaluator_failure_leaves_the_baseline_and_the_loss():
    script = [[ok, ok, bad], [bad, lambda: EvaluatorFailure(error="worker lost"), ok]]  # [turn][trajectory]
    _, rows = decide(script, mask_void_turn=False)
    assert grid(rows, "failed_trajectory") == [[False] * 2, [True] * 2, [False] * 2]
    assert grid(rows, "in_baseline") == grid(rows, "in_loss") == [[True] * 2, [False] * 2, [True] * 2]
    # returns: trajectory 0 [0.5, 0], trajectory 2 [0.5, 0.5]; trajectory 1 is nobody's baseline
    assert flat(grid(rows, "advantage")) == pytest.approx([0.0, -0.5, 0.0, 0.0, 0.0, 0.5])

    # the older rule: only the failed turn leaves the loss, every turn stays in the baseline
    _, rows = decide(script, mask_void_turn=False, drop_failed_trajectories=False)
    assert grid(rows, "in_baseline") == [[True] * 2] * 3
    assert grid(rows, "in_loss") == [[True] * 2, [True, False], [True] * 2]
    assert grid(rows, "masked")[1] == [False, True]


def test_an_evaluator_that_raises_becomes_evaluator_failures(tiny_tokenizer, tmp_path):
    script = [[ok, bad], RuntimeError("sandbox pool died")]
    metrics, rows = run_step(tiny_tokenizer, tmp_path, script, num_generations=2)
    assert all(r["verdict"] == "crashed" and "sandbox pool died" in r["error"] for r in rows if r["turn"] == 2)
    assert not any(r["in_baseline"] or r["in_loss"] for r in rows)  # every trajectory met the failure
    assert metrics["update_samples"] == 0 and metrics["grad_norm"] == 0.0


def test_prs_drops_lazy_correct_turns_from_the_loss_only(tiny_tokenizer, tmp_path):
    # shares 0.9 (kept), 0.1 (p = 0), none (a missing profile reads as 0), 0.9
    script = [[lambda: ok(0.9), lambda: ok(0.1), lambda: ok(None), lambda: ok(0.9)]]
    metrics, rows = run_step(tiny_tokenizer, tmp_path / "reject", script, prs=True)
    assert [r["prs_keep"] for r in rows] == [r["in_loss"] for r in rows] == [True, False, False, True]
    assert all(r["in_baseline"] for r in rows)
    rewards = [r["reward"] for r in rows]
    assert rewards == pytest.approx([0.95, 0.55, 0.5, 0.95])
    for i, r in enumerate(rows):  # leave-one-out over all four members, rejected or not
        assert r["advantage"] == pytest.approx(rewards[i] - (sum(rewards) - rewards[i]) / 3)
    assert metrics["prs_reject_rate"] == 0.5 and metrics["update_samples"] == 2

    _, rows = decide(script, prs=True, prs_missing_profile="keep")
    assert [r["in_loss"] for r in rows] == [True, False, True, True]


def test_truncated_turns_and_chosen_verdicts_leave_only_the_loss(tiny_tokenizer, tmp_path):
    script = [[ok, ok, bad, ok]]
    metrics, rows = run_step(tiny_tokenizer, tmp_path, script, finished=[True, False, True, True],
                             mask_truncated=True, mask_verdicts="incorrect")
    assert [r["masked"] for r in rows] == [False, True, True, False]
    assert [r["in_loss"] for r in rows] == [True, False, False, True] and all(r["in_baseline"] for r in rows)
    assert [r["advantage"] for r in rows] == pytest.approx([0.5 - 1 / 3, 0.5 - 1 / 3, -0.5, 0.5 - 1 / 3])
    assert metrics["outcome_mask_rate"] == 0.5 and metrics["truncated_rate"] == 0.25


def test_estimator_gamma_scaling_and_reward_weights_reach_the_step():
    script = [[lambda: ok(speedup=2.0), bad, lambda: ok(speedup=1.0)], [bad, lambda: ok(speedup=4.0), bad]]
    kw = dict(estimator="grpo", scale_rewards="group", gamma=0.5, correct_weight=2.0, speedup_cap=2.5,
              mask_void_turn=False)
    cfg = TrainConfig(**kw)
    assert cfg.rollout_config(seed=1).reward == cfg.reward_config()  # the rollout scores with these weights
    _, rows = decide(script, **kw)
    # 2 + 0.5 * min(speedup, 2.5) for a correct turn
    assert flat(grid(rows, "reward")) == pytest.approx([3.0, 0.0, 0.0, 3.25, 2.5, 0.0])
    rewards = torch.tensor(grid(rows, "reward"))
    mask, groups = torch.ones_like(rewards, dtype=torch.bool), torch.zeros(3, dtype=torch.long)
    expected = compute_advantages(rewards, mask, groups, "grpo", 0.5, "group").flatten().tolist()
    assert flat(grid(rows, "advantage")) == pytest.approx(expected, abs=1e-6)
    assert expected != pytest.approx(compute_advantages(rewards, mask, groups).flatten().tolist(), abs=1e-3)


class RecordingEvaluator:
    """Stands in for drkernel.evaluator.Evaluator: records its configuration."""

    made = []

    def __init__(self, cfg, workers=None, reward_config=None):
        self.cfg, self.workers, self.reward_config = cfg, workers, reward_config
        RecordingEvaluator.made.append(self)

    def evaluate_many(self, pairs):
        if self.cfg.seed == -1:
            raise OSError("no sandbox")
        return [EvalResult(verdict="correct", correct=True, reward=7.0) for _ in pairs]

    def close(self):
        pass


def test_the_trainer_hands_its_settings_to_the_evaluator_and_keeps_its_reward(tiny_tokenizer, tmp_path, monkeypatch):
    import drkernel.evaluator

    monkeypatch.setattr(drkernel.evaluator, "Evaluator", RecordingEvaluator)
    cfg = TrainConfig(model="injected", output_dir=str(tmp_path), tasks_per_step=1, log_with="none", save_steps=0,
                      eval_device="cpu", eval_trials=2, eval_perf_trials=7, eval_timeout=33.0,
                      eval_max_speedup_recheck=3.0, eval_workers=3, correct_weight=2.0, prs_threshold=0.5)
    trainer = Trainer(cfg, model=tiny_random_model(vocab_size=len(tiny_tokenizer)), tokenizer=tiny_tokenizer,
                      tasks=load_bundled([1]))
    task = trainer.tasks[0]
    results = trainer._evaluate([(task, CODE), (task, CODE)])
    ev = RecordingEvaluator.made[-1]
    assert (ev.cfg.device, ev.cfg.trials, ev.cfg.perf_trials, ev.cfg.timeout, ev.cfg.max_speedup_recheck) == \
        ("cpu", 2, 7, 33.0, 3.0)
    assert ev.workers == 3 and ev.reward_config == cfg.reward_config() and ev.reward_config.correct_weight == 2.0
    assert [r.reward for r in results] == [7.0, 7.0]  # the evaluator's reward, not a second one

    ev.cfg.seed = -1  # the evaluator itself fails: not the policy's fault
    failed = trainer._evaluate([(task, CODE)])
    assert isinstance(failed[0], EvaluatorFailure) and "OSError: no sandbox" in failed[0].error
    trainer.close()


def test_resume_auto_continues_the_newest_checkpoint_and_old_ones_rotate_out(tiny_tokenizer, tmp_path):
    def trainer(max_steps, resume_from=None):
        env = ScriptedEnv(tiny_tokenizer, [[ok, bad]])
        cfg = TrainConfig(model="injected", output_dir=str(tmp_path), max_steps=max_steps, tasks_per_step=1,
                          num_generations=2, num_turns=1, log_with="none", save_steps=1, save_total_limit=2,
                          dump_rollouts=False, resume_from=resume_from, prs=False, mismatch_correction=False, seed=0)
        model = tiny_random_model(vocab_size=len(tiny_tokenizer), seed=0)
        return Trainer(cfg, model=model, tokenizer=tiny_tokenizer, tasks=load_bundled([1, 2]),
                       evaluate_fn=env.evaluate, generator=env.generate)

    def checkpoints():
        return sorted(p.name for p in tmp_path.glob("checkpoint-*"))

    first = trainer(3)
    first.train()
    assert checkpoints() == ["checkpoint-2", "checkpoint-3"]
    again = trainer(4, resume_from="auto")
    assert again.step == 3 and again.sampler.state_dict()["epoch"] == 1 and again.sampler.state_dict()["index"] == 1
    assert [h["step"] for h in again.train()] == [4]
    assert checkpoints() == ["checkpoint-3", "checkpoint-4"]
    fresh = trainer(4, resume_from=None)  # no resume: a fresh start at step 0
    assert fresh.step == 0
    fresh.close()


def scripted_trainer(tokenizer, out: Path, max_steps: int, resume_from: str | None = None) -> Trainer:
    """A two-answer, one-turn run in `out` that saves a checkpoint after every step."""
    env = ScriptedEnv(tokenizer, [[ok, bad]])
    cfg = TrainConfig(model="injected", output_dir=str(out), max_steps=max_steps, tasks_per_step=1, num_generations=2,
                      num_turns=1, log_with="none", save_steps=1, resume_from=resume_from, prs=False,
                      mismatch_correction=False, seed=0)
    return Trainer(cfg, model=tiny_random_model(vocab_size=len(tokenizer), seed=0), tokenizer=tokenizer,
                   tasks=load_bundled([1]), evaluate_fn=env.evaluate, generator=env.generate)


def remove_run_ending(out: Path) -> None:
    """What a run killed before its end lacks: final/, report.md and the plot."""
    shutil.rmtree(out / "final")
    (out / "report.md").unlink()
    (out / report.RUN_PLOT).unlink()


def test_a_resumed_run_drops_the_cut_last_line_of_its_metrics(tiny_tokenizer, tmp_path, capsys):
    """A kill while step 2's row was written, before checkpoint-2: resuming drops the cut line (kept
    in a .bak, said on stderr), so step 2's new row has a line of its own and the report shows both steps."""
    scripted_trainer(tiny_tokenizer, tmp_path, max_steps=2).train()
    metrics = tmp_path / "metrics.jsonl"
    first, second = metrics.read_text().splitlines()
    cut = first + "\n" + second[:40]
    metrics.write_text(cut)
    shutil.rmtree(tmp_path / "checkpoint-2")
    remove_run_ending(tmp_path)
    capsys.readouterr()

    assert [h["step"] for h in scripted_trainer(tiny_tokenizer, tmp_path, 2, resume_from="auto").train()] == [2]
    err = capsys.readouterr().err
    assert report.load_run_history(tmp_path).steps == [1, 2]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]
    (backup,) = tmp_path.glob("metrics.*.jsonl.bak")
    assert backup.read_text() == cut
    assert "dropped 1 line(s)" in err and backup.name in err and "line 2: not a JSON object" in err
    assert "| 2 |" in (tmp_path / "report.md").read_text() and (tmp_path / "final").is_dir()


@pytest.mark.parametrize("kept_checkpoint", (1, 0))
def test_a_resumed_run_drops_the_rows_logged_after_its_checkpoint(tiny_tokenizer, tmp_path, capsys, kept_checkpoint):
    """Killed after step 2's row, before checkpoint-2 was complete: the rows after the checkpoint it
    resumes from are dropped (kept in a .bak), so no old row stands for a step the run has not redone.
    With no complete checkpoint at all, `--resume_from auto` starts anew and keeps no old row."""
    scripted_trainer(tiny_tokenizer, tmp_path, max_steps=2).train()
    metrics = tmp_path / "metrics.jsonl"
    old = metrics.read_text()
    (tmp_path / "checkpoint-2" / "trainer_state.json").unlink()
    if not kept_checkpoint:  # cut off in a way that leaves its state a folder: the new save replaces all of it
        (tmp_path / "checkpoint-1" / "trainer_state.json").unlink()
        (tmp_path / "checkpoint-1" / "trainer_state.json").mkdir()
    remove_run_ending(tmp_path)
    capsys.readouterr()

    scripted_trainer(tiny_tokenizer, tmp_path, 1, resume_from="auto").train()
    err = capsys.readouterr().err
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    assert (rows[0] == json.loads(old.splitlines()[0])) == bool(kept_checkpoint)  # step 1 redone only when fresh
    (backup,) = tmp_path.glob("metrics.*.jsonl.bak")
    assert backup.read_text() == old
    assert f"dropped {2 - kept_checkpoint} line(s)" in err and f"after step {kept_checkpoint} this run starts" in err
    assert json.loads((tmp_path / "checkpoint-1" / "trainer_state.json").read_text())["step"] == 1


def test_a_resumed_run_with_no_step_left_saves_final_and_writes_the_report(tiny_tokenizer, tmp_path, capsys):
    """Killed after its last checkpoint, before final/ and the report: resumed with the same max_steps, it
    says there is no step to run, saves final/ (the checkpoint's weights) and reports the logged steps."""
    from safetensors.torch import load_file

    scripted_trainer(tiny_tokenizer, tmp_path, max_steps=1).train()
    remove_run_ending(tmp_path)
    capsys.readouterr()

    assert scripted_trainer(tiny_tokenizer, tmp_path, max_steps=1, resume_from="auto").train() == []
    captured = capsys.readouterr()
    assert "resumed at step 1 with max_steps 1: no step to run" in captured.err
    final = load_file(str(tmp_path / "final" / "model.safetensors"))
    saved = load_file(str(tmp_path / "checkpoint-1" / "model" / "model.safetensors"))
    assert final.keys() == saved.keys() and all(torch.equal(final[k], saved[k]) for k in final)
    assert f"RL run: {tmp_path}:" in captured.out and "| 1 |" in (tmp_path / "report.md").read_text()
    assert (tmp_path / report.RUN_PLOT).is_file()


def test_the_step_metrics_count_every_process_turn_and_the_slowest_phase():
    """Rates over the turns of every process's report, each phase's seconds from the slowest
    process, counts summed; then the update's own metrics."""
    def turn(reward, result, finished=True):
        return TurnSample("0_1", 0, 0, 1, [], [5, 6, 7], [], "", None, result, reward, finished)

    kept = TurnFlags(void=False, failed_trajectory=False, prs_keep=True, masked=False, in_baseline=True, in_loss=True)
    rank0 = StepReport([TurnRecord(turn(1.0, ok(speedup=2.0)), kept, 0.5),
                        TurnRecord(turn(0.0, bad(), finished=False),
                                   dataclasses.replace(kept, prs_keep=False, in_loss=False), -0.5)],
                       RolloutCost(rollout_s=3.0, generate_s=2.0, evaluate_s=1.0, n_evaluated=2, n_cached=1),
                       update_s=4.0)
    rank1 = StepReport([TurnRecord(turn(0.0, bad()), dataclasses.replace(kept, void=True, in_baseline=False,
                                                                         in_loss=False), 0.0)],
                       RolloutCost(rollout_s=5.0, generate_s=1.0, evaluate_s=3.0, n_evaluated=2, n_cached=0),
                       update_s=2.0)
    m = step_metrics([rank0, rank1], {"loss": 0.25, "update_tokens": 80.0, "grad_norm": 1.0}, lr=1e-6)
    third = pytest.approx(1 / 3)
    assert m["reward_mean"] == third and m["correct"] == third and m["fast_1"] == third
    assert m["prs_reject_rate"] == m["void_turn_rate"] == m["baseline_drop_rate"] == m["truncated_rate"] == third
    assert m["in_loss_rate"] == third and m["advantage_abs_mean"] == third and m["outcome_mask_rate"] == 0.0
    assert (m["generate_s"], m["evaluate_s"], m["rollout_s"], m["update_s"]) == (2.0, 3.0, 5.0, 4.0)
    assert m["n_evaluated"] == 4 and m["eval_cache_hit_rate"] == 0.25 and m["gen_tokens"] == 9
    assert m["update_tokens_per_s"] == 20.0 and (m["loss"], m["grad_norm"], m["lr"]) == (0.25, 1.0, 1e-6)
