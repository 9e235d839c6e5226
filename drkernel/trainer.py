"""The RL loop: rollout → evaluate → rewards (+PRS) → TRLOO advantages → PPO-clip update.

One `Trainer.step()`:

1. **tasks**: the next `tasks_per_step` tasks from a seeded, resumable `TaskSampler`; with N
   processes each rank takes whole tasks (`tasks[rank::N]`), so a group is never split and
   advantages need no communication;
2. **rollout** (`drkernel.rollout.rollout`): `num_generations` trajectories × `num_turns` turns
   per task, sampled by the unwrapped model in eval mode with its KV cache; the sampling seed
   is derived from (seed, step, rank), so a resumed run samples exactly what the original did;
3. **evaluate**: every turn's candidates in one call to the sandboxed `Evaluator` pool (Triton
   interpreter on a CPU-only machine); **rewards** from `drkernel.rewards` and PRS coin flips;
4. **advantages** (`compute_advantages`, TRLOO by default) over *all* turns; PRS-rejected and
   outcome-masked turns are dropped only afterwards, so they still count in the group baseline;
5. **update** (`policy_update`): per micro-batch one forward pass gives the log-probs of the
   response tokens, computed from the final hidden states in chunks of tokens (a [B, L, V] fp32
   logits tensor is never built); on the first pass these are also π_old (the policy that was
   current when the batch was collected), then the rollout-vs-trainer mismatch correction, the
   PPO-clip loss and backward; gradients are normalised globally, clipped, one optimizer step
   per pass over the batch (`num_iterations` passes);
6. **logging** (`MetricsLogger`: metrics.jsonl + TensorBoard), rollout dumps
   (`<output_dir>/rollouts/step_<N>.jsonl`), checkpoints with exact resume.

Environments can be injected (`evaluate_fn`, `reward_fn`, `sample_reward_fn`, `generator`), so
the loop can be tested and studied without the evaluator (see tests/test_train.py).
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
from drkernel.config import ConfigError, parse_config
from drkernel.generation import GenerationConfig, GenOutput, logprob_temperature
from drkernel.loss import LOSS_TYPES, LossConfig, policy_loss
from drkernel.mismatch import MismatchConfig, mismatch_correction
from drkernel.rewards import RewardConfig
from drkernel.rollout import RolloutConfig, TurnSample, rollout, rollout_stats, to_training_batch
from drkernel.runtime import RunConfig
from drkernel.tasks import Task, TaskError

_L, _M, _R = LossConfig, MismatchConfig, RewardConfig  # defaults come from these, in one place


@dataclasses.dataclass
class TrainConfig(RunConfig):
    """RL options (TRL GRPO names where they exist). The defaults run a short real CPU run."""

    output_dir: str = "runs/rl"
    save_total_limit: int = 2
    # --- tasks
    tasks: str = dataclasses.field(default="bundled", metadata={
        "help": "bundled | KernelBench path or hub id | a .py file or a directory of .py"})
    levels: str = dataclasses.field(default="1", metadata={"help": "comma list of KernelBench levels"})
    problem_ids: str = dataclasses.field(default="", metadata={"help": "comma list; empty = all"})
    tasks_per_step: int = dataclasses.field(default=2, metadata={
        "help": "tasks (groups) per step over all processes; a multiple of the process count"})
    shuffle_tasks: bool = True
    # --- rollout / generation
    num_generations: int = dataclasses.field(default=2, metadata={"help": "trajectories per task (group size)"})
    num_turns: int = 2
    max_prompt_tokens: int = 4096
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    generation_backend: str = dataclasses.field(default="hf", metadata={"help": "hf | static"})
    generation_batch_size: int = 64
    generation_compile: bool = dataclasses.field(default=False, metadata={
        "help": "static backend on CUDA: torch.compile + CUDA graphs for the decode step (bench/rollout.py)"})
    # --- evaluator
    eval_device: str = dataclasses.field(default="auto", metadata={"help": "auto | cpu | cuda | cuda:N"})
    eval_trials: int = 3
    eval_perf_trials: int = 100
    eval_timeout: float = 120.0
    eval_workers: int = dataclasses.field(default=0, metadata={"help": "sandbox workers; 0 = auto"})
    # --- rewards, PRS, outcome masks
    correct_weight: float = _R.correct_weight
    speedup_weight: float = _R.speedup_weight
    speedup_cap: float = _R.speedup_cap
    profile_weight: float = _R.profile_weight
    prs: bool = dataclasses.field(default=_R.prs_enabled, metadata={"help": "profiling-based rejection sampling"})
    prs_threshold: float = _R.prs_threshold
    prs_width: float = _R.prs_width
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
    beta: float = dataclasses.field(default=_L.beta, metadata={"help": "KL to the initial model; > 0 keeps a reference"})
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
    token_veto: float | None = _M.token_veto
    # --- output
    dump_rollouts: bool = True
    dump_prompts: bool = dataclasses.field(default=False, metadata={"help": "include prompt text in rollout dumps"})

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(self.estimator in ESTIMATORS, f"estimator must be one of {ESTIMATORS}, not {self.estimator!r}")
        need(self.scale_rewards in SCALES, f"scale_rewards must be one of {SCALES}, not {self.scale_rewards!r}")
        need(self.scale_rewards == "none" or self.estimator == "grpo", "scale_rewards=group needs estimator=grpo")
        need(self.loss_type in LOSS_TYPES, f"loss_type must be one of {LOSS_TYPES}, not {self.loss_type!r}")
        need(self.num_generations >= 2, "num_generations must be >= 2 (a group needs another member for its baseline)")
        for name in ("num_turns", "tasks_per_step", "micro_batch_size", "num_iterations", "max_new_tokens",
                     "max_steps", "generation_batch_size"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        need(self.logprob_chunk_size >= 0, "logprob_chunk_size must be >= 0")
        need(self.gradient_checkpointing_every >= 1,
             f"gradient_checkpointing_every must be >= 1, got {self.gradient_checkpointing_every}")
        need(self.generation_backend in ("hf", "static"), "generation_backend must be hf or static")
        need(self.gradient_accumulation_steps == 1,
             "the RL update accumulates over micro-batches itself (micro_batch_size); "
             "leave gradient_accumulation_steps at 1")
        need(0.0 < self.gamma <= 1.0, f"gamma must be in (0, 1], got {self.gamma}")
        need(self.eval_device == "auto" or self.eval_device == "cpu" or self.eval_device.startswith("cuda"),
             f"eval_device must be auto, cpu or cuda[:N], not {self.eval_device!r}")
        try:
            self.loss_config()
            self.mismatch_config()
            self.level_list()
            self.problem_id_list()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    # sub-configs of the modules the loop wires together
    def loss_config(self) -> LossConfig:
        return LossConfig(epsilon=self.epsilon, epsilon_high=self.epsilon_high, dual_clip_c=self.dual_clip_c,
                          loss_type=self.loss_type, norm_length=self.norm_length, beta=self.beta,
                          kl_estimator=self.kl_estimator, entropy_coef=self.entropy_coef)

    def mismatch_config(self) -> MismatchConfig:
        return MismatchConfig(enabled=self.mismatch_correction, token_is_cap=self.token_is_cap,
                              seq_is_cap=self.seq_is_cap, geo_low=self.geo_low, geo_high=self.geo_high,
                              token_veto=self.token_veto)

    def reward_config(self) -> RewardConfig:
        return RewardConfig(correct_weight=self.correct_weight, speedup_weight=self.speedup_weight,
                            speedup_cap=self.speedup_cap, profile_weight=self.profile_weight,
                            prs_enabled=self.prs, prs_threshold=self.prs_threshold, prs_width=self.prs_width)

    def generation_config(self, seed: int | None = None) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                top_p=self.top_p, top_k=self.top_k, do_sample=True,
                                backend=self.generation_backend, batch_size=self.generation_batch_size,
                                compile=self.generation_compile, seed=seed)

    def rollout_config(self, seed: int) -> RolloutConfig:
        return RolloutConfig(num_generations=self.num_generations, num_turns=self.num_turns,
                             max_prompt_tokens=self.max_prompt_tokens, seed=seed,
                             generation=self.generation_config(seed))

    def level_list(self) -> list[int]:
        return _int_list(self.levels, "levels")

    def problem_id_list(self) -> list[int]:
        return _int_list(self.problem_ids, "problem_ids")


def _int_list(text: str, name: str) -> list[int]:
    try:
        return [int(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"{name} must be a comma list of integers, not {text!r}") from None


# ======================================================================================
# Task sampling and seeds
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
    return int(hashlib.sha256(f"{seed}:{step}:{rank}".encode()).hexdigest()[:8], 16)


# ======================================================================================
# Log-probabilities from hidden states, in chunks
# ======================================================================================

@dataclasses.dataclass
class UpdateSample:
    """One turn as the update sees it."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    advantage: float
    train: bool = True  # False: PRS-rejected / outcome-masked (already counted in the baseline)


def _inner(model):
    """The module under DDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    for _ in range(4):
        nxt = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if nxt is None or not isinstance(nxt, torch.nn.Module):
            break
        model = nxt
    return model


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


def chunked_token_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                           chunk_size: int = 1024, softcap: float | None = None,
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


@dataclasses.dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [b, L], right-padded (no attention mask needed, see `collate`)
    rows: torch.Tensor  # [N] row of each response token
    positions: torch.Tensor  # [N] position whose hidden state predicts it
    cols: torch.Tensor  # [N] its index in the response
    targets: torch.Tensor  # [N] the token
    mask: torch.Tensor  # [b, R] bool, response tokens
    rollout_logp: torch.Tensor  # [b, R]
    advantages: torch.Tensor  # [b]
    train: torch.Tensor  # [b] bool


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
    rollout_logp = torch.zeros((b, max(resp, 1)), dtype=torch.float32)
    rows, positions, cols = [], [], []
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        if p < 1:
            raise ValueError("every sample needs at least one prompt token")
        if len(s.rollout_logprobs) != r:
            raise ValueError(f"sample {i}: {len(s.rollout_logprobs)} rollout log-probs for {r} response tokens")
        ids[i, :p + r] = torch.as_tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long)
        mask[i, :r] = True
        if r:
            rollout_logp[i, :r] = torch.as_tensor(s.rollout_logprobs, dtype=torch.float32)
        rows.extend([i] * r)
        positions.extend(range(p - 1, p - 1 + r))
        cols.extend(range(r))
    rows_t = torch.as_tensor(rows, dtype=torch.long)
    pos_t = torch.as_tensor(positions, dtype=torch.long)
    return MicroBatch(
        input_ids=ids.to(device),
        rows=rows_t.to(device), positions=pos_t.to(device), cols=torch.as_tensor(cols, dtype=torch.long).to(device),
        targets=ids[rows_t, pos_t + 1].to(device), mask=mask.to(device), rollout_logp=rollout_logp.to(device),
        advantages=torch.tensor([float(s.advantage) for s in samples], dtype=torch.float32, device=device),
        train=torch.tensor([bool(s.train) for s in samples], dtype=torch.bool, device=device))


def response_logprobs(model, mb: MicroBatch, temperature: float = 1.0, chunk_size: int = 1024,
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


# ======================================================================================
# The update
# ======================================================================================

def _denominator(mask: torch.Tensor, loss_type: str) -> float:
    """What `loss.aggregate` divides by: valid tokens (token-mean) or sequences with a valid token."""
    if loss_type == "token-mean":
        return float(mask.sum())
    return float((mask.sum(-1) > 0).sum())


def _sample_weight(s: UpdateSample, loss_type: str) -> float:
    return float(len(s.response_ids)) if loss_type == "token-mean" else float(len(s.response_ids) > 0)


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


def policy_update(model, optimizer, samples: Sequence[UpdateSample], cfg: TrainConfig, accelerator,
                  scheduler=None, ref_model=None, pad_id: int = 0) -> dict[str, float]:
    """PPO-clip update on one rollout batch: `cfg.num_iterations` optimizer steps.

    The loss is exactly the global aggregate over all processes' samples (`cfg.loss_type`): each
    micro-batch backpropagates its *unnormalised* loss (mean × its denominator), and the summed
    gradients are divided by the global denominator once, before clipping. π_old is the policy at
    the start of the update, so the first pass's log-probs (detached) are π_old: no extra forward.
    Returns global metrics (loss, grad_norm, clip fractions, mismatch, entropy, token counts).
    """
    device = accelerator.device
    loss_cfg = cfg.loss_config()
    mm_cfg = cfg.mismatch_config()
    temperature = logprob_temperature(cfg.generation_config())
    n_proc = accelerator.num_processes

    # Which samples are forwarded: dropped ones (train=False) leave the loss and its denominator;
    # with no KL/entropy term a zero-advantage sample adds exactly nothing to the gradient, so it
    # only counts in the denominator (as if kept by the mismatch check).
    plain_pg = loss_cfg.beta == 0 and loss_cfg.entropy_coef == 0
    forward, baseline_weight, n_zero = [], 0.0, 0
    for s in samples:
        if not s.train or not len(s.response_ids):
            continue
        if cfg.skip_zero_advantage and plain_pg and s.advantage == 0.0:
            baseline_weight += _sample_weight(s, loss_cfg.loss_type)
            n_zero += 1
        else:
            forward.append(s)
    forward.sort(key=lambda s: -(len(s.prompt_ids) + len(s.response_ids)))  # less padding per micro-batch
    mbs = [forward[i:i + cfg.micro_batch_size] for i in range(0, len(forward), cfg.micro_batch_size)]
    n_mb = _global_max(accelerator, len(mbs))  # every rank runs as many backward passes (DDP)
    dummy = [UpdateSample([int(pad_id)], [int(pad_id)], [0.0], 0.0, train=False)]

    sums = _Sums()
    stored: list[tuple] = []  # per micro-batch: old_logp, is-weights, keep mask, ref_logp
    metrics: dict[str, float] = {}
    tokens = 0
    losses, grad_norms = [], []
    model.train()
    for it in range(cfg.num_iterations):
        local_weight = baseline_weight
        local_loss = 0.0
        for k in range(n_mb):
            batch = collate(mbs[k] if k < len(mbs) else dummy, pad_id, device)
            tokens += int(batch.input_ids.numel()) if k < len(mbs) else 0
            need_ent = loss_cfg.entropy_coef > 0 or (it == 0 and cfg.log_entropy)
            sync = accelerator.no_sync(model) if k < n_mb - 1 else contextlib.nullcontext()
            with sync, accelerator.autocast():
                logp, ent = response_logprobs(model, batch, temperature, cfg.logprob_chunk_size,
                                              with_entropy=need_ent, entropy_grad=loss_cfg.entropy_coef > 0,
                                              compiled=cfg.torch_compile)
                valid = batch.mask & batch.train[:, None]
                if it == 0:
                    old = logp.detach()
                    weights, keep, mm = mismatch_correction(old, batch.rollout_logp, valid, mm_cfg)
                    ref = None
                    if loss_cfg.beta > 0:
                        ref = _reference_logprobs(model, ref_model, batch, temperature, cfg.logprob_chunk_size)
                    if cfg.num_iterations > 1:
                        stored.append((old, weights, keep, ref))
                    # mismatch metrics, weighted like mismatch_correction's own denominators
                    n_tok, n_seq = float(valid.sum()), float((valid.sum(-1) > 0).sum())
                    for name, weight in (("mismatch_kl", n_tok), ("is_weight_clipped_frac", n_tok),
                                         ("seq_is_weight_clipped_frac", n_seq),
                                         ("is_weight_mean", float((valid & keep).sum()))):
                        sums.add(name, mm[name], weight)
                    for name in ("reject_rate", "geo_reject_rate", "veto_reject_rate"):
                        sums.add("mismatch_" + name, mm[name], n_seq)
                else:
                    old, weights, keep, ref = stored[k]
                loss_mask = valid & keep
                loss, m = policy_loss(logp, old, batch.advantages, loss_mask, loss_cfg, ref_logp=ref,
                                      is_weights=weights, entropy=ent)
                count = _denominator(loss_mask, loss_cfg.loss_type)
                accelerator.backward(loss * count)
            local_weight += count
            local_loss += float(loss.detach()) * count
            n_valid = float(loss_mask.sum())
            for name in ("clip_frac", "clip_frac_high", "clip_frac_low", "dual_clip_frac", "approx_kl",
                         "kl_ref", "entropy"):
                if name in m and not (name == "entropy" and it > 0):
                    sums.add(name, m[name], n_valid)
        total = _global_sum(accelerator, local_weight)
        if n_mb == 0:
            losses.append(0.0)
            grad_norms.append(0.0)
        else:
            if total > 0:
                scale = n_proc / total  # DDP averaged the gradients over processes
                torch._foreach_mul_([p.grad for p in model.parameters() if p.grad is not None], scale)
            norm = accelerator.clip_grad_norm_(
                model.parameters(), cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"))
            grad_norms.append(float(norm) if norm is not None else float("nan"))
            if total > 0:
                optimizer.step()
            losses.append(_global_sum(accelerator, local_loss) / total if total > 0 else 0.0)
        if scheduler is not None:  # the schedule follows steps, also when there was nothing to learn
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*before.*optimizer.step")
                scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    metrics.update(sums.result(accelerator))
    metrics.update({
        "loss": float(sum(losses) / len(losses)),
        "loss_first_iteration": float(losses[0]) if losses else 0.0,
        "grad_norm": float(sum(grad_norms) / len(grad_norms)) if grad_norms else 0.0,
        "update_samples": _global_sum(accelerator, len(forward)),
        "update_skipped_zero_adv": _global_sum(accelerator, n_zero),
        "update_tokens": _global_sum(accelerator, tokens),
    })
    return metrics


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


def make_optimizer(model, cfg: RunConfig, device) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; the fused CUDA kernel on a GPU (one launch per step)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no trainable parameters")
    fused = {"fused": True} if torch.device(device).type == "cuda" else {}
    return torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             weight_decay=cfg.weight_decay, **fused)


def disable_dropout(model) -> None:
    """Dropout off everywhere, so train-mode forwards give the same log-probs as sampling did."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0


# ======================================================================================
# The trainer
# ======================================================================================

EvaluateFn = Callable[[list[tuple[Task, str]]], list[dict]]


class Trainer:
    """Owns the model, optimizer, evaluator, sampler and logs; `train()` runs `max_steps` steps.

    Everything the environment does can be injected:
    - `evaluate_fn(list[(Task, code)]) -> list[result dict]` (default: the sandboxed Evaluator);
    - `reward_fn(result) -> float` (default: `rewards.compute_reward` with the config's weights);
    - `prs_fn(result) -> bool | keep-probability` (default: `rewards.prs_keep_prob`, when `prs`);
    - `sample_reward_fn(TurnSample) -> float`: overrides each turn's reward after the rollout
      (scripted environments that score the response text, reward models);
    - `generator(model, tokenizer, prompt_ids, GenerationConfig) -> list[GenOutput]`.
    """

    def __init__(self, cfg: TrainConfig, model=None, tokenizer=None, tasks: Sequence[Task] | None = None,
                 evaluate_fn: EvaluateFn | None = None, reward_fn: Callable[[dict], float] | None = None,
                 prs_fn: Callable[[dict], Any] | None = None,
                 sample_reward_fn: Callable[[TurnSample], float] | None = None,
                 generator: Callable[..., list[GenOutput]] | None = None):
        from drkernel import runtime

        self.cfg = cfg
        self.acc = runtime.make_accelerator(cfg, dataclasses.asdict(cfg))
        self.rank, self.world = self.acc.process_index, self.acc.num_processes
        if cfg.tasks_per_step % self.world:
            raise ConfigError(f"tasks_per_step={cfg.tasks_per_step} must be a multiple of the number of "
                              f"processes ({self.world}): each process rolls out whole groups")
        self.tasks = list(tasks) if tasks is not None else self._load_tasks()
        self.sampler = TaskSampler(len(self.tasks), cfg.seed, cfg.shuffle_tasks)

        from drkernel import modeling

        self.tokenizer = tokenizer if tokenizer is not None else modeling.load_tokenizer(cfg.model, cfg.tokenizer)
        if model is None:
            dtype = cfg.dtype
            model = modeling.load_model(cfg.model, dtype=dtype, gradient_checkpointing=cfg.gradient_checkpointing,
                                        lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                        lora_target_modules=cfg.lora_target_modules,
                                        gradient_checkpointing_every=cfg.gradient_checkpointing_every)
        elif cfg.gradient_checkpointing:
            modeling.enable_gradient_checkpointing(model, cfg.gradient_checkpointing_every)
        modeling.make_saveable(model, cfg.model)
        if cfg.disable_dropout:
            disable_dropout(model)
        self.ref_model = None
        if cfg.beta > 0 and not hasattr(model, "disable_adapter"):
            import copy

            # a frozen copy of the *initial* weights, taken before any checkpoint is loaded
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False).to(self.acc.device)
        if cfg.torch_compile:  # after LoRA, checkpointing and the reference copy; before prepare
            modeling.compile_decoder_layers(model)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id or 0

        optimizer = make_optimizer(model, cfg, self.acc.device)
        from transformers import get_scheduler

        # not passed through prepare(): Accelerate would step it once per process per step
        self.scheduler = get_scheduler(cfg.lr_scheduler, optimizer, num_warmup_steps=cfg.warmup_steps,
                                       num_training_steps=cfg.max_steps * cfg.num_iterations)
        self.model, self.optimizer = self.acc.prepare(model, optimizer)
        self.acc.register_for_checkpointing(self.scheduler)

        self.evaluate_fn = evaluate_fn
        self._evaluator = None
        rcfg = cfg.reward_config()
        if reward_fn is None:
            from drkernel.rewards import compute_reward

            reward_fn = lambda result: float(compute_reward(result, rcfg).reward)  # noqa: E731
        if prs_fn is None and cfg.prs:
            from drkernel.rewards import is_correct, prs_keep_prob

            prs_fn = lambda r: prs_keep_prob(r.get("triton_time_share"), rcfg) if is_correct(r) else True  # noqa: E731
        self.reward_fn, self.prs_fn, self.sample_reward_fn = reward_fn, prs_fn, sample_reward_fn
        if generator is None:
            from drkernel.generation import generate as generator
        self.generator = generator
        self.mask_verdicts = {v.strip() for v in cfg.mask_verdicts.split(",") if v.strip()}

        self.step = 0
        self.logger = runtime.MetricsLogger(self.acc, cfg.output_dir)
        path = runtime.resolve_resume(cfg.resume_from, cfg.output_dir)
        if path is not None:
            state = runtime.load_checkpoint(self.acc, path)
            self.step = int(state["step"])
            self.sampler.load_state_dict(state["sampler"])
            self._print(f"resumed from {path} at step {self.step}")

    # ---------------------------------------------------------------- setup helpers
    def _load_tasks(self) -> list[Task]:
        from drkernel.tasks import load_tasks

        tasks = load_tasks(self.cfg.tasks, self.cfg.level_list(), self.cfg.problem_id_list() or None)
        if not tasks:
            raise ConfigError(f"no tasks found for --tasks {self.cfg.tasks} --levels {self.cfg.levels} "
                              f"--problem_ids {self.cfg.problem_ids or 'all'}")
        return tasks

    def _print(self, msg: str) -> None:
        if self.acc.is_main_process:
            print(f"[drkernel.trainer] {msg}", file=sys.stderr, flush=True)

    def _evaluate(self, pairs: list[tuple[Task, str]]) -> list[dict]:
        """The evaluator, created on first use; an infrastructure failure becomes masked results."""
        try:
            if self.evaluate_fn is not None:
                return list(self.evaluate_fn(pairs))
            if self._evaluator is None:
                from drkernel.evaluator import EvalConfig, Evaluator

                device = self.cfg.eval_device
                if device == "auto":
                    device = "cuda" if torch.cuda.is_available() else "cpu"
                ecfg = EvalConfig(device=device, trials=self.cfg.eval_trials,
                                  perf_trials=self.cfg.eval_perf_trials, timeout=self.cfg.eval_timeout)
                self._evaluator = Evaluator(ecfg, workers=self.cfg.eval_workers or None)
            return [r.to_dict() for r in self._evaluator.evaluate_many([(t.code, code) for t, code in pairs])]
        except Exception as exc:  # the evaluator's own failure is not the policy's fault
            self._print(f"evaluator failure ({type(exc).__name__}: {exc}); these turns leave the loss")
            return [{"verdict": "crashed", "compiled": False, "correct": False, "speedup": None, "hacks": [],
                     "error": f"evaluator failure: {type(exc).__name__}: {exc}", "infra_error": True}
                    for _ in pairs]

    def close(self) -> None:
        if self._evaluator is not None:
            self._evaluator.close()
            self._evaluator = None
        self.logger.close()

    # ---------------------------------------------------------------- one step
    def _masked(self, s: TurnSample) -> bool:
        """Outcome masks: the turn stays in its group's baseline but leaves the loss."""
        return bool(s.result.get("infra_error")) or (self.cfg.mask_truncated and not s.finished) \
            or s.result.get("verdict") in self.mask_verdicts

    def train_step(self) -> dict[str, Any]:
        """Run step `self.step + 1`; return its metrics (the same on every process)."""
        cfg, acc = self.cfg, self.acc
        step = self.step + 1
        t_step = time.perf_counter()
        picked = self.sampler.next(cfg.tasks_per_step)
        local_tasks = [self.tasks[i] for i in picked[self.rank::self.world]]
        seed = step_seed(cfg.seed, step, self.rank)
        times = {"generate_s": 0.0, "evaluate_s": 0.0}
        n_evaluated = [0]

        def timed_generate(model, tokenizer, prompts, gcfg):
            # the sampling seed of each turn comes from rollout.turn_seed(step seed, turn)
            t0 = time.perf_counter()
            try:
                return self.generator(model, tokenizer, prompts, gcfg)
            finally:
                times["generate_s"] += time.perf_counter() - t0

        def timed_evaluate(pairs):
            t0 = time.perf_counter()
            try:
                n_evaluated[0] += len(pairs)
                return self._evaluate(pairs)
            finally:
                times["evaluate_s"] += time.perf_counter() - t0

        # 1-3. rollout with evaluation, rewards and PRS (sampling: the unwrapped model, eval mode, KV cache)
        t0 = time.perf_counter()
        policy = acc.unwrap_model(self.model)
        with _generation_mode(policy):
            trajectories = rollout(policy, self.tokenizer, local_tasks, timed_evaluate, cfg.rollout_config(seed),
                                   reward_fn=self.reward_fn, prs_fn=self.prs_fn, generator=timed_generate)
        if self.sample_reward_fn is not None:
            for traj in trajectories:
                for s in traj:
                    s.reward = float(self.sample_reward_fn(s))
        rollout_s = time.perf_counter() - t0

        # 4. advantages over every turn, then drop PRS-rejected / masked turns from the loss only
        batch = to_training_batch(trajectories)
        adv = compute_advantages(batch["rewards"], batch["turn_mask"], batch["group_ids"],
                                 cfg.estimator, cfg.gamma, cfg.scale_rewards)
        samples: list[UpdateSample] = []
        info: list[dict] = []
        for s, (b, t) in zip(batch["samples"], batch["index"]):
            masked = self._masked(s)
            train = bool(s.prs_keep) and not masked
            a = float(adv[b, t])
            samples.append(UpdateSample(s.prompt_ids, s.response_ids, s.rollout_logprobs, a, train))
            info.append(self._dump_row(step, s, a, train, masked))

        # 5. update
        t0 = time.perf_counter()
        upd = policy_update(self.model, self.optimizer, samples, cfg, acc, self.scheduler, self.ref_model,
                            self.pad_id)
        update_s = time.perf_counter() - t0
        self.step = step

        # 6. metrics over all processes
        from accelerate.utils import gather_object

        light = [dataclasses.replace(s, prompt_ids=[], rollout_logprobs=[], response_text="", code=None,
                                     messages=None, result=_light_result(s.result))
                 for traj in trajectories for s in traj]
        rows = info
        local = {"generate_s": times["generate_s"], "evaluate_s": times["evaluate_s"], "rollout_s": rollout_s,
                 "update_s": update_s, "n_evaluated": n_evaluated[0],
                 "gen_tokens": sum(len(s.response_ids) for s in light)}
        if self.world > 1:
            light = gather_object(light)
            rows = gather_object(rows)
            per_rank = gather_object([local])
        else:
            per_rank = [local]
        metrics = self._metrics(light, rows, per_rank, upd)
        metrics["step_s"] = time.perf_counter() - t_step
        metrics["tokens_per_s"] = metrics["gen_tokens"] / max(metrics["step_s"], 1e-9)
        if acc.device.type == "cuda":
            metrics["peak_mem_gib"] = torch.cuda.max_memory_allocated(acc.device) / 2**30
        self._last_rows = rows
        return metrics

    def _dump_row(self, step: int, s: TurnSample, advantage: float, train: bool, masked: bool) -> dict:
        r = s.result
        row = {"step": step, "rank": self.rank, "task": s.task_key, "group": s.group_id, "traj": s.traj_id,
               "turn": s.turn, "reward": s.reward, "advantage": advantage, "prs_keep": s.prs_keep,
               "masked": masked, "in_loss": train, "finished": s.finished,
               "response_tokens": len(s.response_ids), "verdict": r.get("verdict"), "correct": bool(r.get("correct")),
               "speedup": r.get("speedup"), "triton_time_share": r.get("triton_time_share"),
               "hacks": list(r.get("hacks") or []),
               "error": (str(r.get("error"))[:500] if r.get("error") else None),
               "response": s.response_text, "code": s.code}
        if self.cfg.dump_prompts:
            row["prompt"] = self.tokenizer.decode(s.prompt_ids)
        return row

    def _metrics(self, light: list[TurnSample], rows: list[dict], per_rank: list[dict], upd: dict) -> dict:
        stats = rollout_stats([[s] for s in light])
        rewards = [float(s.reward) for s in light]
        n = max(1, len(rows))
        m: dict[str, Any] = {
            "loss": upd.get("loss", 0.0),
            "reward_mean": sum(rewards) / max(1, len(rewards)),
            "reward_std": float(torch.tensor(rewards).std(unbiased=False)) if rewards else 0.0,
            "correct": stats.get("all/correct", 0.0),
            "fast_1": stats.get("all/fast_1", 0.0),
            "triton_share": stats.get("all/triton_share", 0.0),
            "advantage_abs_mean": sum(abs(r["advantage"]) for r in rows) / n,
            "prs_reject_rate": sum(1 for r in rows if not r["prs_keep"]) / n,
            "outcome_mask_rate": sum(1 for r in rows if r["masked"]) / n,
            "in_loss_rate": sum(1 for r in rows if r["in_loss"]) / n,
            "truncated_rate": sum(1 for r in rows if not r["finished"]) / n,
            "lr": float(self.scheduler.get_last_lr()[0]),
            "generate_s": max(p["generate_s"] for p in per_rank),
            "evaluate_s": max(p["evaluate_s"] for p in per_rank),
            "rollout_s": max(p["rollout_s"] for p in per_rank),
            "update_s": max(p["update_s"] for p in per_rank),
            "n_evaluated": sum(p["n_evaluated"] for p in per_rank),
            "gen_tokens": sum(p["gen_tokens"] for p in per_rank),
        }
        m["gen_tokens_per_s"] = m["gen_tokens"] / max(m["generate_s"], 1e-9)
        m["update_tokens_per_s"] = upd.get("update_tokens", 0.0) / max(m["update_s"], 1e-9)
        m.update({k: v for k, v in upd.items() if k != "loss"})
        m.update(stats)
        return m

    # ---------------------------------------------------------------- the loop
    def save(self) -> Path:
        from drkernel.runtime import save_checkpoint

        return save_checkpoint(self.acc, self.model, self.tokenizer, self.cfg, self.step,
                               {"sampler": self.sampler.state_dict(),
                                "tasks": hashlib.sha256("\n".join(t.key + t.digest for t in self.tasks)
                                                        .encode()).hexdigest()[:16]})

    def _write_rollouts(self, rows: list[dict]) -> None:
        if not (self.cfg.dump_rollouts and self.acc.is_main_process):
            return
        path = Path(self.cfg.output_dir) / "rollouts" / f"step_{self.step}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as fh:
            for r in rows:
                fh.write(json.dumps(r, default=str) + "\n")

    def train(self) -> list[dict]:
        """Run until `max_steps`; returns the logged metrics of this process's steps."""
        from tqdm.auto import tqdm

        from drkernel.report import write_run_report
        from drkernel.runtime import save_model

        cfg = self.cfg
        history = []
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="rl", disable=not self.acc.is_main_process,
                   dynamic_ncols=True)
        saved_at = self.step
        try:
            while self.step < cfg.max_steps:
                metrics = self.train_step()
                self.logger.log(metrics, self.step)
                self._write_rollouts(self._last_rows)
                history.append({"step": self.step, **metrics})
                if cfg.save_steps > 0 and self.step % cfg.save_steps == 0:
                    t0 = time.perf_counter()
                    self.save()
                    saved_at = self.step
                    self._print(f"checkpoint-{self.step} saved in {time.perf_counter() - t0:.1f}s")
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.4g}", reward=f"{metrics['reward_mean']:.3f}",
                                correct=f"{metrics['correct']:.2f}")
            if saved_at != self.step:
                self.save()
            if history:
                save_model(self.acc, self.model, self.tokenizer, Path(cfg.output_dir) / "final")
        finally:
            bar.close()
            self.close()
        if history and self.acc.is_main_process:
            write_run_report(cfg.output_dir, f"RL run: {cfg.output_dir}")
        return history


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


def _light_result(result: dict) -> dict:
    keys = ("verdict", "correct", "speedup", "triton_time_share")
    return {k: result.get(k) for k in keys}


def main(argv: Sequence[str] | None = None) -> int:
    """`accelerate launch train.py [--config cfg.yaml] [--key value ...]` (stage rl)."""
    try:
        cfg = parse_config(TrainConfig, argv)
        trainer = Trainer(cfg)
    except (ConfigError, TaskError, FileNotFoundError) as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
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
