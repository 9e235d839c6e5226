"""The RL loop: rollout → evaluate → rewards (+PRS) → TRLOO advantages → PPO-clip update.

`Trainer.train()` runs `Trainer.train_step()` until `max_steps`. A step is these phases, and the
sections of this file follow them in this order:

1. **tasks** (`TaskSampler`): the next `tasks_per_step` tasks of a seeded, resumable pass over the
   task set; with N processes each rank takes whole tasks (`tasks[rank::N]`), so a group is never
   split and advantages need no communication;
2. **rollout** (`Trainer._rollout` → `drkernel.rollout.rollout`): `num_generations` trajectories
   × `num_turns` turns per task, sampled by the unwrapped model in eval mode with its KV cache;
   the sampling seed is derived from (seed, step, rank), so a resumed run samples exactly what
   the original did;
3. **evaluate** (`Trainer._evaluate`): every turn's candidates in one call to the sandboxed
   `Evaluator` pool (Triton interpreter on a CPU-only machine), which scores each result with
   this run's `RewardConfig`; the evaluator's own failure becomes `EvaluatorFailure` results;
4. **rewards and PRS** (`turn_flags`): which turns count. Void turns (a failure after a success)
   and trajectories with an evaluator failure leave the baseline and the loss; PRS-rejected and
   outcome-masked turns leave only the loss, so they still count in the group baseline;
5. **advantages** (`update_samples`): `compute_advantages` (TRLOO by default) over the turns of
   the baseline;
6. **log-probs** (`old_logprobs`, `correct_mismatch`): π_old, one no-grad forward per
   micro-batch, computed from the final hidden states in chunks of tokens (a [B, L, V] fp32
   logits tensor is never built), then the rollout-vs-trainer mismatch correction over the whole
   batch (a trajectory's turns are judged together);
7. **update** (`policy_update`): per pass the PPO-clip loss and backward, gradients divided by
   the global denominator, clipped, one optimizer step (`num_iterations` passes);
8. **logging** (`step_metrics`): the step's metrics (metrics.jsonl + TensorBoard), rollout dumps
   (`<output_dir>/rollouts/step_<N>.jsonl`), checkpoints with exact resume.

After the phases: how log-probs are computed from hidden states (`response_logprobs`), the
model's set-up, then the settings (`TrainConfig`) and `main`.

Environments can be injected (`evaluate_fn`, `sample_reward_fn`, `generator`), so the loop can
be tested and studied without the evaluator (tests/test_train.py, tests/test_trainer_turns.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.utils.checkpoint

from drkernel.advantages import ESTIMATORS, SCALES, compute_advantages
from drkernel.config import (BELOW_1, COUNT, FINITE, FRACTION, NON_NEGATIVE, POSITIVE, UP_TO_1, WORKERS, ConfigError, Limit,
                             Names, OneOf, TaskSelection, cache_dir_problem, comma_items, compose)
from drkernel.evaltypes import VERDICTS, EvalConfig, EvalResult
from drkernel.generation import GenerationConfig, GenOutput, logprob_temperature
from drkernel.loss import LOSS_TYPES, LossConfig, policy_loss
from drkernel.mismatch import MismatchConfig, mismatch_correction
from drkernel.prompts import FORMAT_ERROR
from drkernel.rewards import RewardConfig, prs_keep
from drkernel.rollout import (EvaluateFn, EvaluatorFailure, RolloutConfig, TurnSample, derived_seed, rollout,
                              rollout_stats, to_training_batch)
from drkernel.runtime import (MetricsLogger, RunConfig, load_checkpoint, make_accelerator, make_optimizer,
                              option_problems, record_settings, resolve_resume, save_checkpoint, save_model,
                              start_run)
from drkernel.tasks import Task, TaskError


# ======================================================================================
# The trainer and its loop
# ======================================================================================

class Trainer:
    """Owns the model, optimizer, evaluator, sampler and logs; `train()` runs `max_steps` steps.

    Everything the environment does can be injected:
    - `evaluate_fn(list[(Task, code)]) -> list[EvalResult]` (default: the sandboxed Evaluator,
      which scores each result with this run's `RewardConfig`; results without a reward are
      scored with the same config by `rewards.score`);
    - `sample_reward_fn(TurnSample) -> float`: overrides each turn's reward after the rollout
      (scripted environments that score the response text, reward models);
    - `generator(model, tokenizer, prompt_ids, GenerationConfig) -> list[GenOutput]`.
    """

    def __init__(self, cfg: TrainConfig, model=None, tokenizer=None, tasks: Sequence[Task] | None = None,
                 evaluate_fn: EvaluateFn | None = None,
                 sample_reward_fn: Callable[[TurnSample], float] | None = None,
                 generator: Callable[..., list[GenOutput]] | None = None):
        from drkernel import modeling

        self.cfg = cfg
        self.acc = make_accelerator(cfg, dataclasses.asdict(cfg))
        self.rank, self.world = self.acc.process_index, self.acc.num_processes
        self.tasks = self._run_tasks(tasks)
        self.sampler = TaskSampler(len(self.tasks), cfg.seed, cfg.shuffle_tasks)
        self.tokenizer = tokenizer if tokenizer is not None else modeling.load_tokenizer(cfg.model, cfg.tokenizer)
        model = load_policy(cfg, model)
        self.ref_model = frozen_reference(model, cfg, self.acc.device)
        if cfg.torch_compile:  # after LoRA, checkpointing and the reference copy; before prepare
            modeling.compile_decoder_layers(model)
        self.pad_id = pad_token_id(self.tokenizer)
        self._prepare_update(model)
        self.evaluate_fn, self.sample_reward_fn = evaluate_fn, sample_reward_fn
        self._evaluator = None
        if generator is None:
            from drkernel.generation import generate as generator
        self.generator = generator
        self._warn_if_prs_rejects_every_correct_turn()
        self.step = 0
        self._resume()
        self.logger = MetricsLogger(self.acc, cfg.output_dir, self.step)

    # ---------------------------------------------------------------- the loop
    def train(self) -> list[dict]:
        """Run until `max_steps`, then save final/ and write the report (from metrics.jsonl, so also
        when a resumed run had no step left); returns the logged metrics of this process's steps."""
        from tqdm.auto import tqdm

        from drkernel.report import write_run_report

        cfg = self.cfg
        history = []
        if self.step >= cfg.max_steps:
            self._print(f"resumed at step {self.step} with max_steps {cfg.max_steps}: no step to run; "
                        f"saving final/ and writing the report")
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="rl", disable=not self.acc.is_main_process,
                   dynamic_ncols=True)
        saved_at = self.step
        try:
            while self.step < cfg.max_steps:
                metrics, rows = self.train_step()
                self.logger.log(metrics, self.step)
                self._write_rollouts(rows)
                history.append({"step": self.step, **metrics})
                if cfg.save_steps > 0 and self.step % cfg.save_steps == 0:
                    started = time.perf_counter()
                    self.save()
                    saved_at = self.step
                    self._print(f"checkpoint-{self.step} saved in {time.perf_counter() - started:.1f}s")
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.4g}", reward=f"{metrics['reward_mean']:.3f}",
                                correct=f"{metrics['correct']:.2f}")
            if saved_at != self.step:
                self.save()
            save_model(self.acc, self.model, self.tokenizer, Path(cfg.output_dir) / "final")
        finally:
            bar.close()
            self.close()
        if self.acc.is_main_process:
            write_run_report(cfg.output_dir, f"RL run: {cfg.output_dir}")
        return history

    def train_step(self) -> tuple[dict[str, Any], list[dict]]:
        """Run step `self.step + 1`; return its metrics (the same on every process) and this
        process's rollout rows (one per turn, as the rollout dump writes them)."""
        step, started = self.step + 1, time.perf_counter()
        tasks = self._next_tasks()  # 1. tasks
        seed = step_seed(self.cfg.seed, step, self.rank)
        trajectories, cost = self._rollout(tasks, seed)  # 2-3. rollout, evaluate (each result scored)
        samples, flags = update_samples(trajectories, self.cfg, random.Random(seed))  # 4-5. PRS, advantages
        update, update_s = self._update(samples)  # 6-7. log-probs, update
        self.step = step
        turns = [s for traj in trajectories for s in traj]  # 8. logging
        rows = [self._dump_row(step, s, u.advantage, f) for s, u, f in zip(turns, samples, flags)]
        report = StepReport([TurnRecord(_light_turn(s), f, u.advantage) for s, u, f in zip(turns, samples, flags)],
                            cost, update_s)
        metrics = step_metrics(self._gather(report), update, float(self.scheduler.get_last_lr()[0]))
        metrics["step_s"] = time.perf_counter() - started
        metrics["tokens_per_s"] = metrics["gen_tokens"] / max(metrics["step_s"], 1e-9)
        if self.acc.device.type == "cuda":
            metrics["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.acc.device) / 2**30
        return metrics, rows

    # ---------------------------------------------------------------- the phases, in order
    def _next_tasks(self) -> list[Task]:
        """1. This process's share of the step's tasks: whole groups, `tasks[rank::world]`."""
        picked = self.sampler.next(self.cfg.tasks_per_step)
        return [self.tasks[i] for i in picked[self.rank::self.world]]

    def _rollout(self, tasks: list[Task], seed: int) -> tuple[list[list[TurnSample]], RolloutCost]:
        """2. Trajectories of this process's tasks (sampled by the unwrapped model in eval mode with
        its KV cache; each turn's seed comes from `rollout.turn_seed`), and what they cost."""
        started = time.perf_counter()
        generate, evaluate = _Timed(self.generator), _Timed(self._evaluate)
        policy = self.acc.unwrap_model(self.model)
        with _generation_mode(policy):
            trajectories = rollout(policy, self.tokenizer, tasks, evaluate, self.cfg.rollout_config(seed),
                                   generator=generate)
        if self.sample_reward_fn is not None:
            for s in (s for traj in trajectories for s in traj):
                s.reward = float(self.sample_reward_fn(s))
        judged = [s.result for traj in trajectories for s in traj if s.code is not None]  # what went to evaluate
        return trajectories, RolloutCost(rollout_s=time.perf_counter() - started, generate_s=generate.seconds,
                                         evaluate_s=evaluate.seconds, n_evaluated=len(judged),
                                         n_cached=sum(1 for r in judged if r.details.get("cached")))

    def _evaluate(self, pairs: list[tuple[Task, str]]) -> list[EvalResult]:
        """3. The environment's results; the evaluator's own failure becomes `EvaluatorFailure`s."""
        try:
            if self.evaluate_fn is not None:
                return list(self.evaluate_fn(pairs))
            if self._evaluator is None:
                from drkernel.evaluator import Evaluator

                self._evaluator = Evaluator(self.cfg.eval_config(self._eval_device()),
                                            workers=self.cfg.eval_workers or None,
                                            reward_config=self.cfg.reward_config())
            return self._evaluator.evaluate_many([(t.code, code) for t, code in pairs])
        except Exception as exc:  # the evaluator's own failure is not the policy's fault
            self._print(f"evaluator failure ({type(exc).__name__}: {exc}); these turns leave the loss")
            return [EvaluatorFailure(error=f"evaluator failure: {type(exc).__name__}: {exc}") for _ in pairs]

    def _update(self, samples: list[UpdateSample]) -> tuple[dict[str, float], float]:
        """6-7. `policy_update` on the step's samples: its metrics and its seconds."""
        started = time.perf_counter()
        metrics = policy_update(self.model, self.optimizer, samples, self.cfg, self.acc, self.scheduler,
                                self.ref_model, self.pad_id)
        return metrics, time.perf_counter() - started

    def _gather(self, report: StepReport) -> list[StepReport]:
        """8. Every process's report of the step, in rank order."""
        if self.world == 1:
            return [report]
        from accelerate.utils import gather_object

        return gather_object([report])

    def _dump_row(self, step: int, s: TurnSample, advantage: float, f: TurnFlags) -> dict:
        """8. One turn as the rollout dump writes it."""
        r = s.result
        row = {"step": step, "rank": self.rank, "task": s.task_key, "group": s.group_id, "traj": s.traj_id,
               "turn": s.turn, "reward": s.reward, "advantage": advantage, "void": f.void,
               "failed_trajectory": f.failed_trajectory, "prs_keep": f.prs_keep, "masked": f.masked,
               "in_baseline": f.in_baseline, "in_loss": f.in_loss, "finished": s.finished,
               "response_tokens": len(s.response_ids), "verdict": r.verdict, "correct": bool(r.correct),
               "speedup": r.speedup, "triton_time_share": r.triton_time_share, "compiled": bool(r.compiled),
               "hacks": list(r.hacks or []),
               "error": str(r.error)[:500] if r.error else None,
               "response": s.response_text, "code": s.code}
        if self.cfg.dump_prompts:
            row["prompt"] = self.tokenizer.decode(s.prompt_ids)
        return row

    def _write_rollouts(self, rows: list[dict]) -> None:
        if not (self.cfg.dump_rollouts and self.acc.is_main_process):
            return
        path = Path(self.cfg.output_dir) / "rollouts" / f"step_{self.step}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as fh:
            for r in rows:
                fh.write(json.dumps(r, default=str) + "\n")

    def save(self) -> Path:
        return save_checkpoint(self.acc, self.model, self.tokenizer, self.cfg, self.step,
                               {**record_settings(self.cfg), "sampler": self.sampler.state_dict(),
                                "tasks": hashlib.sha256("\n".join(t.key + t.digest for t in self.tasks)
                                                        .encode()).hexdigest()[:16]})

    def close(self) -> None:
        if self._evaluator is not None:
            self._evaluator.close()
            self._evaluator = None
        self.logger.close()

    # ---------------------------------------------------------------- set-up
    def _run_tasks(self, tasks: Sequence[Task] | None) -> list[Task]:
        """The given tasks, else the configured selection; each process must get whole groups."""
        if self.cfg.tasks_per_step % self.world:
            raise ConfigError(f"tasks_per_step={self.cfg.tasks_per_step} must be a multiple of the number of "
                              f"processes ({self.world}): each process rolls out whole groups")
        if tasks is not None:
            return list(tasks)
        return self.cfg.selected_tasks()

    def _prepare_update(self, model) -> None:
        """The optimizer and the learning-rate schedule, and the model and optimizer prepared by Accelerate."""
        from transformers import get_scheduler

        cfg = self.cfg
        optimizer = make_optimizer(model, cfg, self.acc.device)
        # not passed through prepare(): Accelerate would step it once per process per step
        self.scheduler = get_scheduler(cfg.lr_scheduler, optimizer, num_warmup_steps=cfg.warmup_steps,
                                       num_training_steps=cfg.max_steps * cfg.num_iterations)
        self.model, self.optimizer = self.acc.prepare(model, optimizer)
        self.acc.register_for_checkpointing(self.scheduler)

    def _warn_if_prs_rejects_every_correct_turn(self) -> None:
        cfg = self.cfg
        rejects = cfg.prs and cfg.prs_missing_profile == "reject"
        if self.evaluate_fn is None and rejects and self._eval_device() == "cpu":
            self._print("PRS on CPU: no turn has a profile, so every correct turn leaves the loss "
                        "(--prs_missing_profile keep keeps them)")

    def _resume(self) -> None:
        """Continue `resume_from`: model, optimizer, schedule, RNG, step and task position."""
        path = resolve_resume(self.cfg.resume_from, self.cfg.output_dir)
        if path is None:
            return
        state = load_checkpoint(self.acc, path)
        self.step = int(state["step"])
        if not isinstance(state.get("sampler"), dict):  # e.g. an SFT checkpoint: no task position to go on from
            raise ConfigError(f"{path}: its trainer_state.json has no task-sampler position (not an RL checkpoint)")
        self.sampler.load_state_dict(state["sampler"])
        self._print(f"resumed from {path} at step {self.step}")

    def _eval_device(self) -> str:
        from drkernel.evaluator import resolve_device

        return resolve_device(self.cfg.eval_device)

    def _print(self, msg: str) -> None:
        if self.acc.is_main_process:
            print(f"[drkernel.trainer] {msg}", file=sys.stderr, flush=True)


# ======================================================================================
# 1. Tasks and seeds
# ======================================================================================

class TaskSampler:
    """Endless passes over the task indices, each pass shuffled by (seed, epoch).

    The whole state is (epoch, index), saved in every checkpoint, so a resumed run continues
    with exactly the tasks the original run would have drawn next.
    """

    def __init__(self, num_tasks: int, seed: int = 0, shuffle: bool = True):
        if num_tasks < 1:
            raise ConfigError("the task set is empty")
        self.num_tasks, self.seed, self.shuffle = num_tasks, seed, shuffle
        self.epoch, self.index = 0, 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.num_tasks))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            order = self._order(self.epoch)
            take = order[self.index:self.index + (k - len(out))]
            out.extend(take)
            self.index += len(take)
            if self.index >= self.num_tasks:
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "num_tasks": self.num_tasks, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if int(state["num_tasks"]) != self.num_tasks:
            raise ConfigError(f"the checkpoint was made with {state['num_tasks']} tasks, this run has "
                              f"{self.num_tasks}: resume with the same task set")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def step_seed(seed: int, step: int, rank: int = 0) -> int:
    """The sampling seed of one step on one rank: a pure function of (seed, step, rank)."""
    return derived_seed(seed, step, rank)


# ======================================================================================
# 2-3. Rollout and evaluation
# ======================================================================================

@dataclasses.dataclass
class RolloutCost:
    """What the rollout phase cost one process: seconds in all, generating and evaluating (the two
    interleave turn by turn), and how many candidates went to the evaluator and its cache answered."""

    rollout_s: float = 0.0
    generate_s: float = 0.0
    evaluate_s: float = 0.0
    n_evaluated: int = 0
    n_cached: int = 0


class _Timed:
    """A callable passed to `rollout` that adds the seconds spent in it to `seconds`."""

    def __init__(self, fn: Callable) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.fn(*args)
        finally:
            self.seconds += time.perf_counter() - started


@contextlib.contextmanager
def _generation_mode(model):
    """Eval mode (no dropout) and the KV cache on while sampling; back to training afterwards.

    Decoder layers compiled for the update (`torch_compile`) run eagerly here: decoding with a KV
    cache would otherwise recompile them for every cache shape and layer index. Only those layers
    are switched off (a global `force_eager` stance would also switch off `generation_compile`'s
    compiled decode step)."""
    from drkernel.modeling import decoder_layers

    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    was_training = model.training
    model.eval()
    if config is not None:
        config.use_cache = True
    compiled = [(m, m._compiled_call_impl) for m in decoder_layers(model)
                if getattr(m, "_compiled_call_impl", None) is not None]
    for m, _ in compiled:
        m._compiled_call_impl = None  # nn.Module.compile's slot: None = the plain forward
    try:
        yield model
    finally:
        for m, impl in compiled:
            m._compiled_call_impl = impl
        if config is not None and use_cache is not None:
            config.use_cache = use_cache
        model.train(was_training)


# ======================================================================================
# 4. Rewards and PRS: which turns enter the baseline and the loss
# ======================================================================================

@dataclasses.dataclass
class TurnFlags:
    """The trainer's decisions about one turn."""

    void: bool  # KernelGYM's void turn: reward <= 0 after a turn of its trajectory with reward > 0
    failed_trajectory: bool  # its trajectory met an evaluator failure
    prs_keep: bool  # kept by profiling-based rejection sampling
    masked: bool  # an outcome mask: truncated, a chosen verdict, an evaluator failure
    in_baseline: bool  # counts in its group's leave-one-out baseline
    in_loss: bool  # trained on (before the mismatch correction)


def void_turns(rewards: Sequence[float]) -> list[bool]:
    """After a turn with reward > 0, every later turn with reward <= 0 is void."""
    out, best = [], -math.inf
    for r in rewards:
        out.append(best > 0 and r <= 0)
        best = max(best, r)
    return out


def turn_flags(traj: Sequence[TurnSample], cfg: TrainConfig, rng: random.Random) -> list[TurnFlags]:
    """Baseline and loss membership of each turn of one trajectory.

    Void turns (`mask_void_turn`) and every turn of a trajectory with an evaluator failure
    (`drop_failed_trajectories`) leave both; PRS and the outcome masks leave only the loss, so
    those turns still count in their group's baseline."""
    rcfg, verdicts = cfg.reward_config(), set(comma_items(cfg.mask_verdicts))
    failed = any(isinstance(s.result, EvaluatorFailure) for s in traj)
    void = void_turns([s.reward for s in traj]) if cfg.mask_void_turn else [False] * len(traj)
    out = []
    for s, v in zip(traj, void):
        keep = prs_keep(s.result, rcfg, rng)
        masked = isinstance(s.result, EvaluatorFailure) or (cfg.mask_truncated and not s.finished) \
            or s.result.verdict in verdicts
        in_baseline = not v and not (failed and cfg.drop_failed_trajectories)
        out.append(TurnFlags(v, failed, keep, masked, in_baseline, in_baseline and keep and not masked))
    return out


# ======================================================================================
# 5. Advantages
# ======================================================================================

@dataclasses.dataclass
class UpdateSample:
    """One turn as the update sees it."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    advantage: float
    train: bool = True  # False: out of the loss (PRS-rejected, outcome-masked), still in the baseline
    trajectory: int | None = None  # turns sharing an id form one trajectory (geometric mismatch rejection)
    in_baseline: bool = True  # False: out of the baseline too (void turns, failed trajectories)


def update_samples(trajectories: Sequence[Sequence[TurnSample]], cfg: TrainConfig,
                   rng: random.Random) -> tuple[list[UpdateSample], list[TurnFlags]]:
    """Every turn (trajectory-major) as an UpdateSample, with advantages over the turns of the
    baseline, and the flags behind it; `rng` draws the PRS coin flips."""
    flags = [f for traj in trajectories for f in turn_flags(traj, cfg, rng)]
    batch = to_training_batch(trajectories)
    baseline = torch.zeros_like(batch.turn_mask)
    for (b, t), f in zip(batch.index, flags):
        baseline[b, t] = f.in_baseline
    adv = compute_advantages(batch.rewards, batch.turn_mask & baseline, batch.group_ids, cfg.estimator, cfg.gamma,
                             cfg.scale_rewards)
    samples = [UpdateSample(s.prompt_ids, s.response_ids, s.rollout_logprobs, float(adv[b, t]), train=f.in_loss,
                            trajectory=s.traj_id, in_baseline=f.in_baseline)
               for s, (b, t), f in zip(batch.samples, batch.index, flags)]
    return samples, flags


# ======================================================================================
# 6-7. Log-probs and the update: π_old, mismatch correction, PPO loss, optimizer step
# ======================================================================================

def policy_update(model, optimizer, samples: Sequence[UpdateSample], cfg: TrainConfig, accelerator,
                  scheduler=None, ref_model=None, pad_id: int = 0) -> dict[str, float]:
    """PPO-clip update on one rollout batch: π_old log-probs, mismatch correction, then
    `cfg.num_iterations` times the PPO loss and an optimizer step.

    The loss is exactly the global aggregate over all processes' samples (`cfg.loss_type`,
    divided by `cfg.loss_denominator`): each micro-batch backpropagates its unnormalised loss and
    the summed gradients are divided by the global denominator once, before clipping.
    Returns global metrics (loss, grad_norm, clip fractions, mismatch, entropy, token counts).
    """
    sums = _Sums()
    whole = _trajectory_check(cfg)
    checked = old_logprobs(model, [s for s in samples if _needs_old_logprobs(s, cfg, whole)], cfg, accelerator,
                           ref_model, pad_id, sums)
    correct_mismatch(checked, cfg, accelerator.device, sums)
    rejected = {id(c.sample) for c in checked if not c.kept}
    in_loss = [s for s in samples if s.train and s.in_baseline and s.response_ids and id(s) not in rejected]
    trained = [c for c in checked if c.kept and c.sample.train and not _skippable(c.sample, cfg)]
    denominator = _loss_denominator(samples, in_loss, cfg, accelerator)
    has_batches = _global_max(accelerator, len(trained)) > 0
    losses, grad_norms, tokens = [], [], 0
    for it in range(cfg.num_iterations):
        total, n_tok = ppo_pass(model, trained, cfg, accelerator, pad_id, sums) if has_batches else (0.0, 0)
        tokens += n_tok
        if has_batches:
            grad_norms.append(optimizer_step(model, optimizer, scheduler, cfg, accelerator, denominator))
        else:
            grad_norms.append(0.0)
            _step_scheduler(scheduler)
        losses.append(_global_sum(accelerator, total) / denominator if denominator > 0 else 0.0)
    return {**sums.result(accelerator),
            "loss": float(sum(losses) / len(losses)),
            "loss_first_iteration": float(losses[0]) if losses else 0.0,
            "grad_norm": float(sum(grad_norms) / len(grad_norms)) if grad_norms else 0.0,
            "update_samples": _global_sum(accelerator, len(trained)),
            "update_skipped_zero_adv": _global_sum(accelerator, sum(1 for s in in_loss if _skippable(s, cfg))),
            "update_tokens": _global_sum(accelerator, tokens)}


# ---------------------------------------------------------------- 6. π_old and the mismatch correction
@dataclasses.dataclass
class _Checked:
    """A turn whose π_old was computed, after the mismatch correction."""

    sample: UpdateSample
    old_logp: torch.Tensor  # [r] π_old of its response tokens
    ref_logp: torch.Tensor | None  # [r] the initial policy's (beta > 0)
    is_weight: torch.Tensor | None = None  # [r] truncated IS weights (1 where TIS is off)
    kept: bool = True  # not rejected by the mismatch correction


@torch.no_grad()
def old_logprobs(model, samples: Sequence[UpdateSample], cfg: TrainConfig, accelerator, ref_model=None,
                 pad_id: int = 0, sums: _Sums | None = None) -> list[_Checked]:
    """π_old (the policy before this update) of every sample's response tokens, one no-grad
    forward per micro-batch (and the initial policy's when beta > 0); logs π_old's entropy."""
    temperature = logprob_temperature(cfg.generation_config())
    mbs, n_mb = _micro_batches(samples, cfg.micro_batch_size, accelerator)
    out: list[_Checked] = []
    model.train()
    for k in range(n_mb):
        real = k < len(mbs)
        batch = collate(mbs[k] if real else [_dummy(pad_id)], pad_id, accelerator.device)
        with accelerator.autocast():
            logp, ent = response_logprobs(model, batch, temperature, cfg.logprob_chunk_size,
                                          with_entropy=cfg.log_entropy, compiled=cfg.torch_compile)
            ref = _reference_logprobs(model, ref_model, batch, temperature, cfg.logprob_chunk_size) \
                if cfg.beta > 0 else None
        if not real:
            continue
        if sums is not None and ent is not None:
            sums.add("entropy", float(ent[batch.mask].float().mean()), float(batch.mask.sum()))
        for i, s in enumerate(mbs[k]):
            r = len(s.response_ids)
            out.append(_Checked(s, logp[i, :r].float(), None if ref is None else ref[i, :r].float()))
    return out


@torch.no_grad()
def _reference_logprobs(model, ref_model, batch: MicroBatch, temperature: float, chunk_size: int):
    """Log-probs under the initial policy: the adapter switched off (LoRA) or a frozen copy."""
    if ref_model is not None:
        lp, _ = response_logprobs(ref_model, batch, temperature, chunk_size)
        return lp
    inner = _inner(model)
    if hasattr(inner, "disable_adapter"):
        with inner.disable_adapter():
            lp, _ = response_logprobs(inner, batch, temperature, chunk_size)
        return lp
    raise ValueError("beta > 0 needs a reference model (or a LoRA model)")


def correct_mismatch(checked: list[_Checked], cfg: TrainConfig, device, sums: _Sums) -> None:
    """Rollout-vs-trainer mismatch correction over the whole local batch at once (a trajectory's
    turns may sit in different micro-batches): sets each turn's `kept` and `is_weight`."""
    if not checked:
        return
    old = torch.nn.utils.rnn.pad_sequence([c.old_logp for c in checked], batch_first=True)
    rollout_lp = torch.zeros_like(old)
    mask = torch.zeros_like(old, dtype=torch.bool)
    for i, c in enumerate(checked):
        r = c.old_logp.numel()
        rollout_lp[i, :r] = torch.as_tensor(c.sample.rollout_logprobs, dtype=old.dtype, device=device)
        mask[i, :r] = True
    # a turn without a trajectory id is a trajectory of its own (negative ids never collide)
    trajectory = torch.tensor([c.sample.trajectory if c.sample.trajectory is not None else -1 - i
                               for i, c in enumerate(checked)], device=device)
    weights, keep, mm = mismatch_correction(old, rollout_lp, mask, cfg.mismatch_config(), trajectory)
    for i, c in enumerate(checked):
        c.is_weight, c.kept = weights[i, :c.old_logp.numel()], bool(keep[i].any())
    n_tok, n_seq = float(mask.sum()), float(len(checked))
    for name, weight in (("mismatch_kl", n_tok), ("is_weight_clipped_frac", n_tok),
                         ("seq_is_weight_clipped_frac", n_seq),
                         ("is_weight_mean", float((mask & keep).sum()))):
        sums.add(name, mm[name], weight)
    for name in ("reject_rate", "geo_reject_rate", "veto_reject_rate"):
        sums.add("mismatch_" + name, mm[name], n_seq)


# ---------------------------------------------------------------- 7. the PPO passes and optimizer steps
def ppo_pass(model, trained: Sequence[_Checked], cfg: TrainConfig, accelerator, pad_id: int,
             sums: _Sums) -> tuple[float, int]:
    """Backward of the PPO-clip loss over every micro-batch, each scaled by its own count (so that
    dividing the summed gradients by the global denominator gives the global aggregate).
    Returns (the summed unnormalised loss, tokens forwarded)."""
    loss_cfg = cfg.loss_config()
    temperature = logprob_temperature(cfg.generation_config())
    mbs, n_mb = _micro_batches(trained, cfg.micro_batch_size, accelerator, lambda c: c.sample)
    total, tokens = 0.0, 0
    for k in range(n_mb):
        real = k < len(mbs)
        group = mbs[k] if real else []
        batch = collate([c.sample for c in group] if real else [_dummy(pad_id)], pad_id, accelerator.device)
        sync = accelerator.no_sync(model) if k < n_mb - 1 else contextlib.nullcontext()
        with sync, accelerator.autocast():
            logp, ent = response_logprobs(model, batch, temperature, cfg.logprob_chunk_size,
                                          with_entropy=loss_cfg.entropy_coef > 0, entropy_grad=True,
                                          compiled=cfg.torch_compile)
            mask = batch.mask if real else torch.zeros_like(batch.mask)
            old = _padded([c.old_logp for c in group], logp) if real else logp.detach()
            weights = _padded([c.is_weight for c in group], logp) if real else None
            ref = _padded([c.ref_logp for c in group], logp) if real and cfg.beta > 0 else None
            loss, m = policy_loss(logp, old, batch.advantages, mask, loss_cfg, ref_logp=ref, is_weights=weights,
                                  entropy=ent)
            count = _denominator(mask, loss_cfg.loss_type)
            accelerator.backward(loss * count)
        total += float(loss.detach()) * count
        tokens += int(batch.input_ids.numel()) if real else 0
        for name in ("clip_frac", "clip_frac_high", "clip_frac_low", "dual_clip_frac", "approx_kl", "kl_ref"):
            if name in m:
                sums.add(name, m[name], float(mask.sum()))
    return total, tokens


def optimizer_step(model, optimizer, scheduler, cfg: TrainConfig, accelerator, denominator: float) -> float:
    """Divide the summed gradients by the global denominator, clip, step; return the grad norm."""
    if denominator > 0:
        scale = accelerator.num_processes / denominator  # DDP averaged the gradients over processes
        torch._foreach_mul_([p.grad for p in model.parameters() if p.grad is not None], scale)
    norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"))
    if denominator > 0:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _step_scheduler(scheduler)
    return float(norm) if norm is not None else float("nan")


def _step_scheduler(scheduler) -> None:
    """The schedule follows steps, also when there was nothing to learn."""
    if scheduler is not None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*before.*optimizer.step")
            scheduler.step()


def _loss_denominator(samples: Sequence[UpdateSample], in_loss: Sequence[UpdateSample], cfg: TrainConfig,
                      accelerator) -> float:
    """The global denominator: every turn of the rollout batch ("batch": KernelGYM divides by the
    mini-batch size, tasks x samples x turns, whatever was rejected) or the turns left in the loss."""
    counted = samples if cfg.loss_denominator == "batch" else in_loss
    return _global_sum(accelerator, sum(_sample_weight(s, cfg.loss_type) for s in counted))


# ---------------------------------------------------------------- what the update counts
def _sample_weight(s: UpdateSample, loss_type: str) -> float:
    """What one sample adds to `loss.aggregate`'s denominator: its tokens (token-mean) or 1."""
    return float(len(s.response_ids)) if loss_type == "token-mean" else float(len(s.response_ids) > 0)


def _denominator(mask: torch.Tensor, loss_type: str) -> float:
    """`loss.aggregate`'s denominator of one micro-batch: valid tokens or sequences with one."""
    if loss_type == "token-mean":
        return float(mask.sum())
    return float((mask.sum(-1) > 0).sum())


def _skippable(s: UpdateSample, cfg: TrainConfig) -> bool:
    """With no KL/entropy term a zero-advantage sample adds exactly nothing to the gradient."""
    return cfg.skip_zero_advantage and cfg.beta == 0 and cfg.entropy_coef == 0 and s.advantage == 0.0


def _trajectory_check(cfg: TrainConfig) -> bool:
    """Geometric rejection over whole trajectories: every turn's tokens count in its trajectory's mean."""
    mm = cfg.mismatch_config()
    return mm.enabled and mm.geo_scope == "trajectory" and (mm.geo_low is not None or mm.geo_high is not None)


def _needs_old_logprobs(s: UpdateSample, cfg: TrainConfig, whole_trajectories: bool) -> bool:
    """The turns the update forwards for π_old: those it trains on, and with trajectory-scope
    rejection every turn of the baseline (in KernelGYM PRS and the loss-only masks come after
    the mismatch check, so their turns count in the trajectory's mean)."""
    if not s.response_ids or not s.in_baseline:
        return False
    return whole_trajectories or (s.train and not _skippable(s, cfg))


# ---------------------------------------------------------------- metrics and batches over processes
class _Sums:
    """Weighted sums of metrics, reduced over processes at the end."""

    def __init__(self):
        self.values: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, name: str, value: float, weight: float) -> None:
        if weight > 0 and value is not None and math.isfinite(value):
            self.values[name] = self.values.get(name, 0.0) + float(value) * weight
            self.weights[name] = self.weights.get(name, 0.0) + weight

    def result(self, accelerator) -> dict[str, float]:
        names = sorted(self.values)
        if not names:
            return {}
        t = torch.tensor([[self.values[n], self.weights[n]] for n in names], dtype=torch.float64,
                         device=accelerator.device)
        if accelerator.num_processes > 1:
            t = accelerator.reduce(t, reduction="sum")
        return {n: float(v / w) if w > 0 else float("nan") for n, (v, w) in zip(names, t.tolist())}


def _global_max(accelerator, value: int) -> int:
    if accelerator.num_processes == 1:
        return int(value)
    return int(accelerator.gather(torch.tensor([value], device=accelerator.device)).max())


def _global_sum(accelerator, value: float) -> float:
    if accelerator.num_processes == 1:
        return float(value)
    return float(accelerator.reduce(torch.tensor([value], dtype=torch.float64, device=accelerator.device),
                                    reduction="sum"))


def _micro_batches(items: Sequence, size: int, accelerator,
                   sample: Callable[[Any], UpdateSample] = lambda x: x) -> tuple[list[list], int]:
    """Length-sorted micro-batches (less padding), and how many every process runs (DDP needs the
    same number of forward passes on each; a process with fewer runs empty dummy batches)."""
    ordered = sorted(items, key=lambda x: -(len(sample(x).prompt_ids) + len(sample(x).response_ids)))
    mbs = [ordered[i:i + size] for i in range(0, len(ordered), size)]
    return mbs, _global_max(accelerator, len(mbs))


def _dummy(pad_id: int) -> UpdateSample:
    return UpdateSample([int(pad_id)], [int(pad_id)], [0.0], 0.0)


def _padded(rows: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """1-D tensors as the rows of a [b, R] tensor shaped like `like` (zeros after each row)."""
    out = torch.zeros_like(like, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, :r.numel()] = r
    return out


# ======================================================================================
# 8. Logging: the step's metrics over all processes
# ======================================================================================

@dataclasses.dataclass
class TurnRecord:
    """One turn as the step's metrics read it: a light copy of the sample (`_light_turn`), the
    trainer's flags and the turn's advantage."""

    sample: TurnSample
    flags: TurnFlags
    advantage: float


@dataclasses.dataclass
class StepReport:
    """One process's share of a step (gathered over processes for the metrics)."""

    turns: list[TurnRecord]
    rollout: RolloutCost
    update_s: float


def step_metrics(reports: Sequence[StepReport], update: dict[str, float], lr: float) -> dict[str, Any]:
    """The step's metrics over every process's report: rollout statistics, the rates of the
    trainer's decisions over all turns, each phase's seconds (the slowest process), then the
    update's own metrics."""
    turns = [t for r in reports for t in r.turns]
    flags = [t.flags for t in turns]
    costs = [r.rollout for r in reports]
    stats = rollout_stats([[t.sample] for t in turns])
    rewards = [float(t.sample.reward) for t in turns]
    n = max(1, len(turns))
    n_evaluated = sum(c.n_evaluated for c in costs)
    m: dict[str, Any] = {
        "loss": update.get("loss", 0.0),
        "reward_mean": sum(rewards) / max(1, len(rewards)),
        "reward_std": float(torch.tensor(rewards).std(unbiased=False)) if rewards else 0.0,
        "correct": stats.get("all/correct", 0.0),
        "fast_1": stats.get("all/fast_1", 0.0),
        "triton_share": stats.get("all/triton_share", 0.0),
        "advantage_abs_mean": sum(abs(t.advantage) for t in turns) / n,
        "prs_reject_rate": sum(not f.prs_keep for f in flags) / n,
        "outcome_mask_rate": sum(f.masked for f in flags) / n,
        "void_turn_rate": sum(f.void for f in flags) / n,
        "baseline_drop_rate": sum(not f.in_baseline for f in flags) / n,
        "in_loss_rate": sum(f.in_loss for f in flags) / n,
        "truncated_rate": sum(not t.sample.finished for t in turns) / n,
        "lr": lr,
        "generate_s": max(c.generate_s for c in costs),
        "evaluate_s": max(c.evaluate_s for c in costs),
        "rollout_s": max(c.rollout_s for c in costs),
        "update_s": max(r.update_s for r in reports),
        "n_evaluated": n_evaluated,
        "eval_cache_hit_rate": sum(c.n_cached for c in costs) / max(1, n_evaluated),
        "gen_tokens": sum(len(t.sample.response_ids) for t in turns),
    }
    m["gen_tokens_per_s"] = m["gen_tokens"] / max(m["generate_s"], 1e-9)
    m["update_tokens_per_s"] = update.get("update_tokens", 0.0) / max(m["update_s"], 1e-9)
    m.update({k: v for k, v in update.items() if k != "loss"})
    m.update(stats)
    return m


def _light_turn(s: TurnSample) -> TurnSample:
    """What the step's statistics read from a turn (gathered over processes): no prompt, text or code."""
    return dataclasses.replace(s, prompt_ids=[], rollout_logprobs=[], response_text="", code=None, messages=None,
                               result=_light_result(s.result))


def _light_result(result: EvalResult) -> EvalResult:
    """What the step's statistics read from a result (gathered over processes)."""
    return EvalResult(verdict=result.verdict, correct=result.correct, speedup=result.speedup, hacks=result.hacks,
                      triton_time_share=result.triton_time_share)


# ======================================================================================
# How log-probs are computed: from hidden states, in chunks
# ======================================================================================

@dataclasses.dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [b, L], right-padded (no attention mask needed, see `collate`)
    rows: torch.Tensor  # [N] row of each response token
    positions: torch.Tensor  # [N] position whose hidden state predicts it
    cols: torch.Tensor  # [N] its index in the response
    targets: torch.Tensor  # [N] the token
    mask: torch.Tensor  # [b, R] bool, response tokens
    advantages: torch.Tensor  # [b]


def collate(samples: Sequence[UpdateSample], pad_id: int, device) -> MicroBatch:
    """Right-padded prompt+response rows.

    Right padding needs no attention mask: under causal attention a real token only sees the
    tokens before it, which are all real, and positions start at 0 in every row as they did when
    sampling. Padded positions produce garbage that is never read. Without a mask SDPA can use
    its fused causal kernels (flash attention on GPU) instead of materialising [L, L] masks.
    """
    b = len(samples)
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    resp = max((len(s.response_ids) for s in samples), default=0)
    ids = torch.full((b, width), int(pad_id), dtype=torch.long)
    mask = torch.zeros((b, max(resp, 1)), dtype=torch.bool)
    rows, positions, cols = [], [], []
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        if p < 1:
            raise ValueError("every sample needs at least one prompt token")
        if len(s.rollout_logprobs) != r:
            raise ValueError(f"sample {i}: {len(s.rollout_logprobs)} rollout log-probs for {r} response tokens")
        ids[i, :p + r] = torch.as_tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long)
        mask[i, :r] = True
        rows.extend([i] * r)
        positions.extend(range(p - 1, p - 1 + r))
        cols.extend(range(r))
    rows_t = torch.as_tensor(rows, dtype=torch.long)
    pos_t = torch.as_tensor(positions, dtype=torch.long)
    return MicroBatch(
        input_ids=ids.to(device),
        rows=rows_t.to(device), positions=pos_t.to(device), cols=torch.as_tensor(cols, dtype=torch.long).to(device),
        targets=ids[rows_t, pos_t + 1].to(device), mask=mask.to(device),
        advantages=torch.tensor([float(s.advantage) for s in samples], dtype=torch.float32, device=device))


def response_logprobs(model, mb: MicroBatch, temperature: float, chunk_size: int,
                      with_entropy: bool = False, entropy_grad: bool = False, compiled: bool = False):
    """Log-probs [b, R] (and entropies [b, R]) of every response token of a micro-batch.

    One forward pass returns the final hidden states (the head is bypassed); only the positions
    that predict response tokens are gathered and turned into log-probs chunk by chunk.
    """
    inner = _inner(model)
    softcap = getattr(getattr(inner, "config", None), "final_logit_softcapping", None)
    with _hidden_states_out(model) as head:
        out = model(input_ids=mb.input_ids, use_cache=False)
    hidden = out.logits
    hidden_size = getattr(getattr(inner, "config", None), "hidden_size", None)
    if hidden_size is not None and hidden.shape[-1] != hidden_size:
        raise RuntimeError(f"expected hidden states of width {hidden_size} from the bypassed head, "
                           f"got {hidden.shape[-1]}: this model's forward post-processes its logits")
    h = hidden[mb.rows, mb.positions]
    lp, ent = chunked_token_logprobs(head, h, mb.targets, temperature, chunk_size, softcap,
                                     with_entropy, entropy_grad, compiled)
    logp = torch.zeros(mb.mask.shape, dtype=lp.dtype, device=lp.device).index_put((mb.rows, mb.cols), lp)
    entropy = None
    if with_entropy:
        entropy = torch.zeros(mb.mask.shape, dtype=ent.dtype, device=ent.device).index_put((mb.rows, mb.cols), ent)
    return logp, entropy


def chunked_token_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                           chunk_size: int, softcap: float | None = None,
                           with_entropy: bool = False, entropy_grad: bool = False, compiled: bool = False):
    """Log-probs (and entropies) of `targets` [N] from hidden states [N, H], `chunk_size` tokens
    at a time. Under autograd each chunk is checkpointed: only its hidden states are kept and its
    [chunk, V] logits are rebuilt in backward, so memory is O(chunk · V) instead of O(N · V).
    `compiled` runs each chunk through torch.compile (see `_compiled_chunk_logprobs`)."""
    n = hidden.shape[0]
    size = chunk_size if chunk_size and chunk_size > 0 else max(n, 1)
    grad = torch.is_grad_enabled() and hidden.requires_grad
    fn = _compiled_chunk_logprobs() if compiled else _chunk_logprobs
    lps, ents = [], []
    for s in range(0, n, size):
        h, y = hidden[s:s + size], targets[s:s + size]
        if grad and size < n:
            lp, ent = torch.utils.checkpoint.checkpoint(
                fn, head, h, y, temperature, softcap, with_entropy, entropy_grad, use_reentrant=False)
        else:
            lp, ent = fn(head, h, y, temperature, softcap, with_entropy, entropy_grad)
        if with_entropy and not entropy_grad:
            ent = ent.detach()
        lps.append(lp)
        ents.append(ent)
    if not lps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(lps), torch.cat(ents)


def _chunk_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                    softcap: float | None, with_entropy: bool,
                    entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(head(hidden) / T)[target] (and the entropy) for a [n, H] chunk, in fp32.

    A logged-only entropy is computed without autograd, so nothing of it is kept for backward."""
    logits = head(hidden).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    else:
        ent = torch.zeros_like(logp)
    return logp, ent


_COMPILED_CHUNK: dict[str, Callable] = {}


def _compiled_chunk_logprobs() -> Callable:
    """`_chunk_logprobs` under torch.compile: the fp32 cast, log-sum-exp, gather and entropy fuse
    into a few passes over the [chunk, V] logits instead of materialising several fp32 copies
    (the largest memory-bound cost of the update at a 150k vocabulary)."""
    from drkernel.modeling import compile_backend

    backend = compile_backend()
    if backend not in _COMPILED_CHUNK:
        _COMPILED_CHUNK[backend] = torch.compile(_chunk_logprobs, backend=backend)
    return _COMPILED_CHUNK[backend]


@contextlib.contextmanager
def _hidden_states_out(model):
    """Make the model's forward return final hidden states in `.logits` (the output head is
    bypassed), and yield the original head so logits can be made a chunk at a time."""
    head = _inner(model).get_output_embeddings()
    if head is None:
        raise ValueError("the model has no output embeddings (lm_head)")
    had_own = "forward" in head.__dict__
    own = head.__dict__.get("forward")
    original = head.forward
    head.forward = lambda hidden: hidden
    try:
        yield original
    finally:
        if had_own:
            head.forward = own
        else:
            del head.forward


def _inner(model):
    """The module under DDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    for _ in range(4):
        nxt = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if nxt is None or not isinstance(nxt, torch.nn.Module):
            break
        model = nxt
    return model


# ======================================================================================
# The model's set-up
# ======================================================================================

def load_policy(cfg: TrainConfig, model=None):
    """The policy to train: `cfg.model` loaded (with LoRA and gradient checkpointing) unless a model
    is given, made saveable, dropout off."""
    from drkernel import modeling

    if model is None:
        model = modeling.load_model(cfg.model, dtype=cfg.dtype, gradient_checkpointing=cfg.gradient_checkpointing,
                                    lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                    lora_target_modules=cfg.lora_target_modules,
                                    gradient_checkpointing_every=cfg.gradient_checkpointing_every)
    elif cfg.gradient_checkpointing:
        modeling.enable_gradient_checkpointing(model, cfg.gradient_checkpointing_every)
    modeling.make_saveable(model, cfg.model)
    if cfg.disable_dropout:
        disable_dropout(model)
    return model


def frozen_reference(model, cfg: TrainConfig, device):
    """The initial policy for the KL term (beta > 0): a frozen copy of the weights, taken before any
    checkpoint is loaded; None without a KL term or with LoRA (the adapter switched off is it)."""
    if cfg.beta <= 0 or hasattr(model, "disable_adapter"):
        return None
    import copy

    return copy.deepcopy(model).eval().requires_grad_(False).to(device)


def disable_dropout(model) -> None:
    """Dropout off everywhere, so train-mode forwards give the same log-probs as sampling did."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad token, else its EOS token, else 0."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id or 0


# ======================================================================================
# Settings and the command line
# ======================================================================================

# defaults come from these, in one place (see drkernel.config: SHARED)
_E, _G, _L, _M, _R, _Ro = EvalConfig, GenerationConfig, LossConfig, MismatchConfig, RewardConfig, RolloutConfig
LOSS_DENOMINATORS = ("batch", "kept")
MASKABLE_VERDICTS = (*VERDICTS, FORMAT_ERROR)  # the verdicts a turn can have (the evaluator's, and no code)


@dataclasses.dataclass
class TrainConfig(RunConfig, TaskSelection):
    """RL options (TRL GRPO names where they exist).

    The field defaults are the library defaults: the released recipe's algorithm and reward at a
    small scale. A bare `train.py` runs its preset, configs/cpu_quick.yaml over them; each
    `--key value` adjusts that run; `--config FILE` replaces the preset (FILE over the library
    defaults, e.g. configs/drkernel_recipe.yaml, the released Dr. Kernel 14B recipe) and
    `--config none` drops it (the library defaults alone)."""

    SHARED = (
        (EvalConfig, {"eval_device": "device", "eval_trials": "trials", "eval_perf_trials": "perf_trials",
                      "eval_timeout": "timeout", "eval_max_speedup_recheck": "max_speedup_recheck",
                      "eval_cache_dir": "cache_dir", "eval_baseline": "baseline",
                      "require_confinement": "require_confinement"}),
        (RewardConfig, {"correct_weight": "correct_weight", "speedup_weight": "speedup_weight",
                        "speedup_cap": "speedup_cap", "profile_weight": "profile_weight", "prs": "prs_enabled",
                        "prs_threshold": "prs_threshold", "prs_width": "prs_width",
                        "prs_missing_profile": "prs_missing_profile"}),
        (RolloutConfig, {"num_generations": "num_generations", "num_turns": "num_turns",
                         "max_prompt_tokens": "max_prompt_tokens"}),
        (GenerationConfig, {"max_new_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p",
                            "top_k": "top_k", "generation_backend": "backend",
                            "generation_batch_size": "batch_size", "generation_compile": "compile"}),
        (LossConfig, {"epsilon": "epsilon", "epsilon_high": "epsilon_high", "dual_clip_c": "dual_clip_c",
                      "loss_type": "loss_type", "norm_length": "norm_length", "beta": "beta",
                      "kl_estimator": "kl_estimator", "entropy_coef": "entropy_coef"}),
        (MismatchConfig, {"mismatch_correction": "enabled", "token_is_cap": "token_is_cap",
                          "seq_is_cap": "seq_is_cap", "geo_low": "geo_low", "geo_high": "geo_high",
                          "geo_scope": "geo_scope", "token_veto": "token_veto"}),
    )
    # beside RunConfig's limits and those of the mirrored library settings
    LIMITS = {
        "tasks_per_step": COUNT,
        "num_generations": Limit(2, COUNT.high, why="a group needs another member for its baseline"),
        "num_turns": COUNT, "max_prompt_tokens": COUNT,
        "temperature": Limit(0, low_open=True, why="RL samples; at 0 every answer of a group would be alike"),
        "eval_workers": WORKERS, "correct_weight": NON_NEGATIVE, "speedup_weight": NON_NEGATIVE,
        "speedup_cap": POSITIVE, "profile_weight": NON_NEGATIVE, "prs_threshold": FRACTION, "prs_width": NON_NEGATIVE,
        "gamma": UP_TO_1, "epsilon": BELOW_1, "epsilon_high": NON_NEGATIVE, "dual_clip_c": FINITE,
        "norm_length": POSITIVE, "beta": NON_NEGATIVE, "entropy_coef": FINITE, "num_iterations": COUNT,
        "micro_batch_size": COUNT, "logprob_chunk_size": Limit(0, why="0 = one chunk per micro-batch"),
        "token_is_cap": POSITIVE, "seq_is_cap": POSITIVE, "geo_low": POSITIVE, "geo_high": POSITIVE,
        "token_veto": POSITIVE, "estimator": OneOf(ESTIMATORS), "scale_rewards": OneOf(SCALES),
        "loss_type": OneOf(LOSS_TYPES), "loss_denominator": OneOf(LOSS_DENOMINATORS),
        "mask_verdicts": Names(MASKABLE_VERDICTS, comma_list=True),
    }
    # beside RunConfig's, may change when a run is resumed: bookkeeping, and how the same rollout and
    # update are computed
    RESUME_SAFE = ("eval_workers", "eval_cache_dir", "dump_rollouts", "dump_prompts", "micro_batch_size",
                   "logprob_chunk_size", "generation_batch_size", "generation_compile", "log_entropy")

    output_dir: str = "runs/rl"
    save_total_limit: int = 2
    # --- tasks (which ones: TaskSelection)
    tasks_per_step: int = dataclasses.field(default=2, metadata={
        "help": "tasks (groups) per step over all processes; a multiple of the process count"})
    shuffle_tasks: bool = True
    # --- rollout / generation
    num_generations: int = dataclasses.field(default=_Ro.num_generations, metadata={
        "help": "trajectories per task (group size)"})
    num_turns: int = _Ro.num_turns
    max_prompt_tokens: int = _Ro.max_prompt_tokens
    max_new_tokens: int = _G.max_new_tokens
    temperature: float = _G.temperature
    top_p: float = _G.top_p
    top_k: int = _G.top_k
    generation_backend: str = dataclasses.field(default=_G.backend, metadata={"help": "hf | static"})
    generation_batch_size: int = _G.batch_size
    generation_compile: bool = dataclasses.field(default=_G.compile, metadata={
        "help": "static backend on CUDA: torch.compile + CUDA graphs for the decode step (bench/rollout.py)"})
    # --- evaluator
    eval_device: str = dataclasses.field(default=_E.device, metadata={"help": "auto | cpu | cuda | cuda:N"})
    eval_trials: int = _E.trials
    eval_perf_trials: int = _E.perf_trials
    eval_timeout: float = _E.timeout
    eval_max_speedup_recheck: float = dataclasses.field(default=_E.max_speedup_recheck, metadata={
        "help": "a speedup above this is timed again (KernelGYM re-measures above the speedup cap, 3)"})
    eval_workers: int = dataclasses.field(default=0, metadata={"help": "sandbox workers; 0 = auto"})
    eval_cache_dir: str = dataclasses.field(default=_E.cache_dir, metadata={
        "help": "on-disk evaluation cache shared by train.py, evaluate.py and generate.py; empty = none"})
    eval_baseline: str = dataclasses.field(default=_E.baseline, metadata={
        "help": "eager | compile: speedups (and the speedup reward) against the reference as written or "
                "under torch.compile"})
    require_confinement: bool = dataclasses.field(default=_E.require_confinement, metadata={
        "help": "refuse to evaluate where the kernel cannot confine candidate code; false only for trusted code"})
    # --- rewards, PRS, which turns enter the baseline and the loss
    correct_weight: float = _R.correct_weight
    speedup_weight: float = _R.speedup_weight
    speedup_cap: float = _R.speedup_cap
    profile_weight: float = _R.profile_weight
    prs: bool = dataclasses.field(default=_R.prs_enabled, metadata={"help": "profiling-based rejection sampling"})
    prs_threshold: float = _R.prs_threshold
    prs_width: float = _R.prs_width
    prs_missing_profile: str = dataclasses.field(default=_R.prs_missing_profile, metadata={
        "help": "a correct turn without a profile (always on CPU): reject (share 0, KernelGYM) | keep"})
    mask_void_turn: bool = dataclasses.field(default=True, metadata={
        "help": "a turn with reward <= 0 after a turn with reward > 0 leaves the baseline and the loss (KernelGYM)"})
    drop_failed_trajectories: bool = dataclasses.field(default=True, metadata={
        "help": "a trajectory with an evaluator failure leaves the baseline and the loss (false: only that turn "
                "leaves the loss)"})
    mask_truncated: bool = dataclasses.field(default=False, metadata={
        "help": "turns that hit max_new_tokens leave the loss (still in the baseline)"})
    mask_verdicts: str = dataclasses.field(default="", metadata={
        "help": "comma list of verdicts whose turns leave the loss, e.g. timeout,crashed"})
    # --- advantages
    estimator: str = dataclasses.field(default="trloo", metadata={"help": "trloo | rloo | grpo"})
    gamma: float = 1.0
    scale_rewards: str = dataclasses.field(default="none", metadata={"help": "none | group (grpo only)"})
    # --- loss
    epsilon: float = _L.epsilon
    epsilon_high: float = _L.epsilon_high
    dual_clip_c: float | None = _L.dual_clip_c
    loss_type: str = _L.loss_type
    norm_length: float = _L.norm_length
    loss_denominator: str = dataclasses.field(default="batch", metadata={
        "help": "batch: every turn of the rollout batch (KernelGYM's constant) | kept: the turns left in the loss"})
    beta: float = dataclasses.field(default=_L.beta, metadata={
        "help": "KL to the initial model; > 0 keeps a reference"})
    kl_estimator: str = _L.kl_estimator
    entropy_coef: float = _L.entropy_coef
    # --- update
    num_iterations: int = dataclasses.field(default=1, metadata={
        "help": "passes (one optimizer step each) over every rollout batch"})
    micro_batch_size: int = dataclasses.field(default=4, metadata={"help": "sequences per forward/backward"})
    logprob_chunk_size: int = dataclasses.field(default=1024, metadata={
        "help": "tokens per log-softmax chunk (recomputed in backward); 0 = one chunk per micro-batch"})
    skip_zero_advantage: bool = dataclasses.field(default=True, metadata={
        "help": "do not forward samples with advantage 0 when beta = entropy_coef = 0 (they add no gradient)"})
    log_entropy: bool = True
    disable_dropout: bool = True
    # --- rollout-vs-trainer mismatch (drkernel.mismatch)
    mismatch_correction: bool = _M.enabled
    token_is_cap: float | None = _M.token_is_cap
    seq_is_cap: float | None = _M.seq_is_cap
    geo_low: float | None = _M.geo_low
    geo_high: float | None = _M.geo_high
    geo_scope: str = dataclasses.field(default=_M.geo_scope, metadata={
        "help": "geometric rejection over a whole trajectory (KernelGYM) | per turn"})
    token_veto: float | None = _M.token_veto
    # --- output
    dump_rollouts: bool = True
    dump_prompts: bool = dataclasses.field(default=False, metadata={"help": "include prompt text in rollout dumps"})

    def __post_init__(self) -> None:
        problems = option_problems(self)
        if cache := cache_dir_problem("--eval_cache_dir", self.eval_cache_dir):
            problems.append(cache)
        if self.scale_rewards != "none" and self.estimator != "grpo":
            problems.append("scale_rewards=group needs estimator=grpo")
        if self.gradient_accumulation_steps != 1:
            problems.append("the RL update accumulates over micro-batches itself (micro_batch_size); "
                            "leave gradient_accumulation_steps at 1")
        if problems:
            raise ConfigError("; ".join(problems))
        try:
            self.loss_config()
            self.mismatch_config()
            self.reward_config()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.level_list()
        self.problem_id_list()

    # sub-configs of the modules the loop wires together
    def loss_config(self) -> LossConfig:
        return compose(self, LossConfig)

    def mismatch_config(self) -> MismatchConfig:
        return compose(self, MismatchConfig)

    def reward_config(self) -> RewardConfig:
        return compose(self, RewardConfig)

    def eval_config(self, device: str) -> EvalConfig:
        return compose(self, EvalConfig, device=device)

    def generation_config(self, seed: int | None = None) -> GenerationConfig:
        return compose(self, GenerationConfig, do_sample=True, seed=seed)

    def rollout_config(self, seed: int) -> RolloutConfig:
        return compose(self, RolloutConfig, generation=self.generation_config(seed), reward=self.reward_config())


def _check_eval_device(name: str) -> None:
    """A GPU asked for and missing is said at the start, not after the first rollout."""
    from drkernel.evaluator import DeviceError, resolve_device
    try:
        resolve_device(name)
    except DeviceError as exc:
        raise ConfigError(f"eval_device: {exc}") from None


def main(argv: Sequence[str] | None = None, preset: str | Path | None = None, prog: str = "train.py") -> int:
    """`accelerate launch train.py [--config FILE|none] [--key value ...]` (stage rl). The settings
    are `preset` (train.py passes configs/cpu_quick.yaml, the bare run) over the library defaults,
    adjusted by each --key value; `--config FILE` replaces the preset, `--config none` drops it."""
    from drkernel.modeling import ModelLoadError

    try:
        cfg = start_run(TrainConfig, argv, preset, prog)
        _check_eval_device(cfg.eval_device)
        trainer = Trainer(cfg)
    except (ConfigError, TaskError, FileNotFoundError, ModelLoadError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    history = trainer.train()
    if trainer.acc.is_main_process and history:
        last = history[-1]
        print(json.dumps({"steps": trainer.step, "wall_s": round(time.perf_counter() - t0, 1),
                          "loss": last["loss"], "reward_mean": last["reward_mean"],
                          "output_dir": cfg.output_dir}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
