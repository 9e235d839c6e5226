"""Multi-turn rollouts: generate, evaluate, feed back, repeat; every turn is a training sample.

For each task we sample `num_generations` trajectories (one group per task). A trajectory
runs for exactly `num_turns` turns, also after a correct answer, because later turns are
asked to make a correct kernel faster. Per turn:

1. render every trajectory's conversation (history truncated to `max_prompt_tokens`);
2. generate all responses of the turn (batched by `generation.generate`);
3. extract the code; a response without a ```python block defining ModelNew gets a
   `format_error` result and never reaches the evaluator;
4. call `evaluate_fn` ONCE with all of the turn's (task, code) pairs, so the evaluator's
   pool can run them in parallel;
5. take each result's reward (`rewards.score`: the evaluator's, computed with the same
   `RewardConfig`, or computed here for results that come without one) and append
   (assistant response, feedback) to the history.

Which turns are trained on (PRS, outcome masks) is the trainer's decision, not the rollout's.
The evaluator is passed in as a callable, so this module does not import it at run time.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING, Callable, Sequence

from drkernel.evaltypes import EvalResult
from drkernel.generation import GenerationConfig, GenOutput
from drkernel.prompts import (FORMAT_ERROR, extract_code, feedback_message, first_turn_messages, format_error_result,
                              render_prompt, truncate_history)
from drkernel.rewards import RewardConfig, score
from drkernel.tasks import Task

if TYPE_CHECKING:
    import torch

EvaluateFn = Callable[[list[tuple[Task, str]]], list[EvalResult]]


@dataclasses.dataclass
class EvaluatorFailure(EvalResult):
    """The result of a candidate the evaluator could not judge (its own failure, not the
    policy's): the trainer keeps such turns out of the loss and, by default, out of the baseline."""


@dataclasses.dataclass
class RolloutConfig:
    num_generations: int = 2  # trajectories (samples) per task: one advantage group
    num_turns: int = 3
    max_prompt_tokens: int = 4096
    keep_messages: bool = False  # store each sample's prompt messages (debugging; heavy)
    generation: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)  # for results without a reward


@dataclasses.dataclass
class TurnSample:
    task_key: str
    group_id: int  # index of the task in this rollout batch; equal for all of its samples
    traj_id: int  # index of the trajectory in this rollout batch
    turn: int  # 1-based
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]  # log_softmax(logits / T) of each response token at sampling
    response_text: str
    code: str | None
    result: EvalResult
    reward: float
    finished: bool = True  # the response ended with EOS
    messages: list[dict] | None = None


def derived_seed(*parts) -> int:
    """A 32-bit seed that is a pure function of `parts` (the run's seed and where it is used),
    the same on every process and Python version, unlike `hash()`."""
    return int(hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:8], 16)


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn `turn` (1-based): `seed` itself for turn 1, a hash of (seed,
    turn) after it. One seed for every turn would replay turn 1's random draws in each turn."""
    if turn == 1:
        return int(seed)
    return derived_seed(int(seed), f"turn{turn}")


def rollout(model, tokenizer, tasks: Sequence[Task], evaluate_fn: EvaluateFn,
            cfg: RolloutConfig | None = None, generator: Callable[..., list[GenOutput]] | None = None,
            start_messages: Sequence[list[dict]] | None = None) -> list[list[TurnSample]]:
    """Trajectories, one list of TurnSamples per (task, sample), task-major order.

    - `evaluate_fn(list[(Task, code)]) -> list[EvalResult]`, called once per turn;
    - `generator(model, tokenizer, prompt_ids_list, GenerationConfig) -> list[GenOutput]`
      replaces `generation.generate` (e.g. an inference engine); None uses it;
    - `start_messages`: one starting conversation per trajectory (task-major), e.g. a
      test-time-scaling context ending with a feedback message; None starts every
      trajectory from `first_turn_messages(task)`.
    """
    cfg = cfg or RolloutConfig()
    if generator is None:
        from drkernel.generation import generate as generator
    owners = [(g, task) for g, task in enumerate(tasks) for _ in range(cfg.num_generations)]
    if start_messages is not None and len(start_messages) != len(owners):
        raise ValueError(f"start_messages holds {len(start_messages)} conversations for {len(owners)} trajectories")
    histories = [[dict(m) for m in (first_turn_messages(task) if start_messages is None else start_messages[i])]
                 for i, (_, task) in enumerate(owners)]
    trajectories: list[list[TurnSample]] = [[] for _ in histories]
    for turn in range(1, cfg.num_turns + 1):
        messages = [truncate_history(h, tokenizer, cfg.max_prompt_tokens) for h in histories]
        prompt_ids = [tokenizer(render_prompt(m, tokenizer), add_special_tokens=False)["input_ids"]
                      for m in messages]
        outs = generator(model, tokenizer, prompt_ids, _turn_generation(cfg.generation, turn))
        texts = [tokenizer.decode(o.response_ids, skip_special_tokens=True) for o in outs]
        codes = [extract_code(t) for t in texts]
        results = _evaluate_turn(evaluate_fn, [task for _, task in owners], codes)
        for i, (out, text, code, result) in enumerate(zip(outs, texts, codes, results)):
            g, task = owners[i]
            trajectories[i].append(TurnSample(
                task_key=task.key, group_id=g, traj_id=i, turn=turn, prompt_ids=list(prompt_ids[i]),
                response_ids=list(out.response_ids), rollout_logprobs=list(out.logprobs),
                response_text=text, code=code, result=result, reward=score(result, cfg.reward),
                finished=bool(out.finished), messages=messages[i] if cfg.keep_messages else None))
            if turn < cfg.num_turns:
                _append_feedback(histories[i], text, result)
    return trajectories


def _turn_generation(gen: GenerationConfig, turn: int) -> GenerationConfig:
    """This turn's generation config: its own sampling seed (see `turn_seed`)."""
    return gen if gen.seed is None else dataclasses.replace(gen, seed=turn_seed(gen.seed, turn))


def _evaluate_turn(evaluate_fn: EvaluateFn, tasks: Sequence[Task], codes: Sequence[str | None]) -> list[EvalResult]:
    """One evaluator call for the turn's candidates; a response without code is a format error."""
    pending = [i for i, c in enumerate(codes) if c is not None]
    results = [EvalResult.from_dict(format_error_result()) for _ in codes]
    if pending:
        evaluated = list(evaluate_fn([(tasks[i], codes[i]) for i in pending]))
        if len(evaluated) != len(pending):
            raise RuntimeError(f"evaluate_fn returned {len(evaluated)} results for {len(pending)} candidates")
        for i, res in zip(pending, evaluated):
            results[i] = res
    return results


def _append_feedback(history: list[dict], response: str, result: EvalResult) -> None:
    """The answer and the evaluator's feedback on it, numbered from the conversation's start."""
    history.append({"role": "assistant", "content": response})
    answered = sum(m["role"] == "assistant" for m in history)
    history.append({"role": "user", "content": feedback_message(result.to_dict(), answered)})


@dataclasses.dataclass
class TrainingBatch:
    """A rollout as tensors for `advantages.compute_advantages`, plus the flat sample list."""

    rewards: torch.Tensor  # [B, T] float32, 0 where there is no turn
    turn_mask: torch.Tensor  # [B, T] bool: the turn exists
    group_ids: torch.Tensor  # [B] long
    samples: list[TurnSample]  # samples[k] sits at index[k] = (b, t)
    index: list[tuple[int, int]]


def to_training_batch(trajectories: Sequence[Sequence[TurnSample]]) -> TrainingBatch:
    """Rewards and turn mask [B, T], group ids [B], and every sample with its (b, t)."""
    import torch

    n_turns = max((len(t) for t in trajectories), default=0)
    rewards = torch.zeros((len(trajectories), n_turns), dtype=torch.float32)
    turn_mask = torch.zeros((len(trajectories), n_turns), dtype=torch.bool)
    group_ids = torch.tensor([traj[0].group_id if traj else 0 for traj in trajectories], dtype=torch.long)
    samples, index = [], []
    for b, traj in enumerate(trajectories):
        for t, s in enumerate(traj):
            rewards[b, t] = float(s.reward)
            turn_mask[b, t] = True
            samples.append(s)
            index.append((b, t))
    return TrainingBatch(rewards, turn_mask, group_ids, samples, index)


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def rollout_stats(trajectories: Sequence[Sequence[TurnSample]]) -> dict:
    """Flat metrics per turn (`turn{k}/...`) and over all turns (`all/...`).

    correct: share of correct results; speedup: mean over correct results; fast_1: share of
    all samples that are correct and faster than the reference (`metrics.is_fast`); triton_share:
    mean Triton share of device time where reported; format_error: share without usable code;
    response_len: mean response length in tokens; reward: mean reward.
    """
    from drkernel import metrics

    by_turn: dict[int, list[TurnSample]] = {}
    for traj in trajectories:
        for s in traj:
            by_turn.setdefault(s.turn, []).append(s)
    stats: dict[str, float] = {}
    groups = {f"turn{k}": v for k, v in sorted(by_turn.items())}
    groups["all"] = [s for v in by_turn.values() for s in v]
    for name, ss in groups.items():
        results = [s.result for s in ss]
        correct = [r for r in results if metrics.is_correct(r)]
        shares = [float(r.triton_time_share) for r in results if r.triton_time_share is not None]
        n = max(1, len(ss))
        stats[f"{name}/n"] = float(len(ss))
        stats[f"{name}/correct"] = len(correct) / n
        stats[f"{name}/speedup"] = _mean([float(r.speedup or 0.0) for r in correct])
        stats[f"{name}/fast_1"] = sum(metrics.is_fast(r, 1.0) for r in results) / n
        stats[f"{name}/triton_share"] = _mean(shares)
        stats[f"{name}/format_error"] = sum(1 for s in ss if s.result.verdict == FORMAT_ERROR) / n
        stats[f"{name}/response_len"] = _mean([float(len(s.response_ids)) for s in ss])
        stats[f"{name}/reward"] = _mean([float(s.reward) for s in ss])
    return stats
