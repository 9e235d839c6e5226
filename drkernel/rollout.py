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
5. score each result with `reward_fn`, optionally mark samples for profiling-based
   rejection (`prs_fn`), and append (assistant response, feedback) to the history.

The evaluator is passed in as a callable, so this module imports neither the evaluator
nor (until a reward is needed) the rewards module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from typing import Any, Callable, Sequence

from drkernel.generation import GenerationConfig, GenOutput
from drkernel.prompts import (FORMAT_ERROR, extract_code, feedback_message, first_turn_messages,
                              format_error_result, render_prompt, truncate_history)
from drkernel.tasks import Task

EvaluateFn = Callable[[list[tuple[Task, str]]], list[dict]]


@dataclasses.dataclass
class RolloutConfig:
    num_generations: int = 4  # trajectories (samples) per task: one advantage group
    num_turns: int = 3
    max_prompt_tokens: int = 4096
    seed: int = 0  # PRS coin flips; generation seeding lives in `generation.seed` (see `turn_seed`)
    keep_messages: bool = False  # store each sample's prompt messages (debugging; heavy)
    generation: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)


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
    result: dict
    reward: float
    prs_keep: bool = True  # False: dropped by profiling-based rejection sampling
    finished: bool = True  # the response ended with EOS
    messages: list[dict] | None = None


def default_reward_fn() -> Callable[[dict], float]:
    """`drkernel.rewards.compute_reward` with its default config, imported lazily.

    Only if the rewards module is missing do we fall back to 1.0 for a correct result and
    0.0 otherwise (so rollouts work before the reward module exists).
    """
    try:
        from drkernel import rewards
    except ImportError:
        return lambda result: 1.0 if result.get("correct") else 0.0
    cfg = rewards.RewardConfig() if hasattr(rewards, "RewardConfig") else None

    def fn(result: dict) -> float:
        terms = rewards.compute_reward(result, cfg) if cfg is not None else rewards.compute_reward(result)
        return _as_float(terms)

    return fn


def _as_float(terms: Any) -> float:
    if isinstance(terms, (int, float)):
        return float(terms)
    for key in ("total", "reward", "value"):
        if isinstance(terms, dict) and key in terms:
            return float(terms[key])
        if hasattr(terms, key):
            return float(getattr(terms, key))
    return float(terms)


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn `turn` (1-based): `seed` itself for turn 1, a hash of (seed,
    turn) after it. One seed for every turn would replay turn 1's random draws in each turn."""
    if turn == 1:
        return int(seed)
    return int(hashlib.sha256(f"{int(seed)}:turn{turn}".encode()).hexdigest()[:8], 16)


def _generate_default(model, tokenizer, prompts, cfg) -> list[GenOutput]:
    from drkernel.generation import generate

    return generate(model, tokenizer, prompts, cfg)


def rollout(model, tokenizer, tasks: Sequence[Task], evaluate_fn: EvaluateFn,
            cfg: RolloutConfig | None = None, reward_fn: Callable[[dict], float] | None = None,
            prs_fn: Callable[[dict], Any] | None = None,
            generator: Callable[..., list[GenOutput]] | None = None,
            start_messages: Sequence[list[dict]] | None = None) -> list[list[TurnSample]]:
    """Trajectories, one list of TurnSamples per (task, sample), task-major order.

    - `evaluate_fn(list[(Task, code)]) -> list[result dict]`, called once per turn;
    - `reward_fn(result) -> float` (default: `default_reward_fn()`);
    - `prs_fn(result) -> bool | float`: keep the sample (bool) or its keep probability
      (float, drawn with a `random.Random(cfg.seed)`); None keeps everything;
    - `generator(model, tokenizer, prompt_ids_list, GenerationConfig) -> list[GenOutput]`
      replaces `generation.generate` (e.g. an inference engine); None uses it;
    - `start_messages`: one starting conversation per trajectory (task-major), e.g. a
      test-time-scaling context ending with a feedback message; None starts every
      trajectory from `first_turn_messages(task)`.
    """
    cfg = cfg or RolloutConfig()
    reward_fn = reward_fn or default_reward_fn()
    generator = generator or _generate_default
    rng = random.Random(cfg.seed)
    if start_messages is not None and len(start_messages) != len(tasks) * cfg.num_generations:
        raise ValueError(f"start_messages holds {len(start_messages)} conversations for "
                         f"{len(tasks) * cfg.num_generations} trajectories")

    histories: list[list[dict]] = []
    owners: list[tuple[int, Task]] = []
    for g, task in enumerate(tasks):
        for _ in range(cfg.num_generations):
            start = first_turn_messages(task) if start_messages is None else start_messages[len(histories)]
            histories.append([dict(m) for m in start])
            owners.append((g, task))
    trajectories: list[list[TurnSample]] = [[] for _ in histories]

    for turn in range(1, cfg.num_turns + 1):
        # 1. prompts
        messages = [truncate_history(h, tokenizer, cfg.max_prompt_tokens) for h in histories]
        prompt_ids = [tokenizer(render_prompt(m, tokenizer), add_special_tokens=False)["input_ids"]
                      for m in messages]
        # 2. generation (batched inside), with this turn's own sampling seed
        gen_cfg = cfg.generation
        if gen_cfg.seed is not None:
            gen_cfg = dataclasses.replace(gen_cfg, seed=turn_seed(gen_cfg.seed, turn))
        outs = generator(model, tokenizer, prompt_ids, gen_cfg)
        texts = [tokenizer.decode(o.response_ids, skip_special_tokens=True) for o in outs]
        codes = [extract_code(t) for t in texts]
        # 3-4. one evaluator call for the whole turn; format errors never reach it
        results: list[dict | None] = [None] * len(histories)
        pending = [i for i, c in enumerate(codes) if c is not None]
        if pending:
            evaluated = evaluate_fn([(owners[i][1], codes[i]) for i in pending])
            if len(evaluated) != len(pending):
                raise RuntimeError(f"evaluate_fn returned {len(evaluated)} results for {len(pending)} candidates")
            for i, res in zip(pending, evaluated):
                results[i] = dict(res)
        for i, c in enumerate(codes):
            if c is None:
                results[i] = format_error_result()
        # 5. rewards, rejection, history
        for i, (out, text, code, result) in enumerate(zip(outs, texts, codes, results)):
            assert result is not None
            reward = float(reward_fn(result))
            keep = True
            if prs_fn is not None:
                verdict = prs_fn(result)
                keep = verdict if isinstance(verdict, bool) else rng.random() < float(verdict)
            g, task = owners[i]
            trajectories[i].append(TurnSample(
                task_key=task.key, group_id=g, traj_id=i, turn=turn, prompt_ids=list(prompt_ids[i]),
                response_ids=list(out.response_ids), rollout_logprobs=list(out.logprobs),
                response_text=text, code=code, result=result, reward=reward, prs_keep=bool(keep),
                finished=bool(out.finished), messages=messages[i] if cfg.keep_messages else None))
            if turn < cfg.num_turns:
                histories[i].append({"role": "assistant", "content": text})
                answered = sum(m["role"] == "assistant" for m in histories[i])  # = turn from scratch
                histories[i].append({"role": "user", "content": feedback_message(result, answered)})
    return trajectories


def to_training_batch(trajectories: Sequence[Sequence[TurnSample]]) -> dict:
    """Tensors for `advantages.compute_advantages` plus the flat sample list.

    rewards [B, T] float32 (0 where no turn), turn_mask [B, T] bool, prs_mask [B, T] bool
    (turn exists and was kept), group_ids [B] long; `samples[k]` sits at `index[k] = (b, t)`.
    """
    import torch

    n_traj = len(trajectories)
    n_turns = max((len(t) for t in trajectories), default=0)
    rewards = torch.zeros((n_traj, n_turns), dtype=torch.float32)
    turn_mask = torch.zeros((n_traj, n_turns), dtype=torch.bool)
    prs_mask = torch.zeros((n_traj, n_turns), dtype=torch.bool)
    group_ids = torch.zeros(n_traj, dtype=torch.long)
    samples, index = [], []
    for b, traj in enumerate(trajectories):
        if traj:
            group_ids[b] = traj[0].group_id
        for t, s in enumerate(traj):
            rewards[b, t] = float(s.reward)
            turn_mask[b, t] = True
            prs_mask[b, t] = bool(s.prs_keep)
            samples.append(s)
            index.append((b, t))
    return {"rewards": rewards, "turn_mask": turn_mask, "prs_mask": prs_mask,
            "group_ids": group_ids, "samples": samples, "index": index}


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def rollout_stats(trajectories: Sequence[Sequence[TurnSample]]) -> dict:
    """Flat metrics per turn (`turn{k}/...`) and over all turns (`all/...`).

    correct: share of correct results; speedup: mean over correct results; fast_1: share of
    all samples that are correct and faster than the reference; triton_share: mean Triton
    share of device time where reported; format_error: share without usable code;
    response_len: mean response length in tokens; reward: mean reward; prs_kept: share kept.
    """
    by_turn: dict[int, list[TurnSample]] = {}
    for traj in trajectories:
        for s in traj:
            by_turn.setdefault(s.turn, []).append(s)
    stats: dict[str, float] = {}
    groups = {f"turn{k}": v for k, v in sorted(by_turn.items())}
    groups["all"] = [s for v in by_turn.values() for s in v]
    for name, ss in groups.items():
        correct = [s for s in ss if s.result.get("correct")]
        shares = [float(s.result["triton_time_share"]) for s in ss
                  if s.result.get("triton_time_share") is not None]
        n = max(1, len(ss))
        stats[f"{name}/n"] = float(len(ss))
        stats[f"{name}/correct"] = len(correct) / n
        stats[f"{name}/speedup"] = _mean([float(s.result.get("speedup") or 0.0) for s in correct])
        stats[f"{name}/fast_1"] = sum(1 for s in correct if float(s.result.get("speedup") or 0.0) > 1.0) / n
        stats[f"{name}/triton_share"] = _mean(shares)
        stats[f"{name}/format_error"] = sum(1 for s in ss if s.result.get("verdict") == FORMAT_ERROR) / n
        stats[f"{name}/response_len"] = _mean([float(len(s.response_ids)) for s in ss])
        stats[f"{name}/reward"] = _mean([float(s.reward) for s in ss])
        stats[f"{name}/prs_kept"] = sum(1 for s in ss if s.prs_keep) / n
    return stats
