"""Turn an evaluator verdict into a scalar reward, and profiling-based rejection sampling (PRS).

reward = 0 (fail_reward) unless the verdict is `correct` with no hacks; otherwise

    correct_weight * 1 + speedup_weight * min(speedup, speedup_cap) + profile_weight * share

- `share` is the candidate's Triton share of device time (`triton_time_share`, the paper's
  profiling reward). On CPU there is no device profile (None): the term is 0.
- `speedup` None (not timed) contributes 0. A CPU speedup (`timing == "cpu_wall"`, the Triton
  interpreter vs eager torch) still counts: it is what the CPU run measured, consistent within
  a CPU run, but it is not comparable to GPU speedups (it is usually far below 1).

One reward per result, scored in one place (`score`): the evaluator calls it on every result it
returns, fresh or cached, with its caller's config; the rollout calls it too, which computes only
for results that come without one (format errors, injected environments).

PRS: a correct turn is kept with probability clamp((share - threshold) / width, 0, 1), so that
correct-but-lazy kernels (most time in torch/cuBLAS, a decoy Triton launch) are rarely trained
on. Failures are always kept (they are the negative samples). A correct turn without a profile
(share None) counts as share 0 and is rejected, as in KernelGYM (`prs_missing_profile="reject"`;
there a missing coverage reads as 0); "keep" keeps it (no evidence either way). On CPU no turn
has a profile, so "reject" leaves no correct turn in the loss there.
"""

from __future__ import annotations

import dataclasses
import random
from typing import TYPE_CHECKING, Any

from drkernel.jsonl import finite
from drkernel.metrics import is_correct

if TYPE_CHECKING:
    from drkernel.evaltypes import EvalResult

PRS_MISSING_PROFILE = ("reject", "keep")


@dataclasses.dataclass
class RewardConfig:
    correct_weight: float = 0.5
    speedup_weight: float = 0.5
    speedup_cap: float = 3.0
    profile_weight: float = 0.5
    prs_enabled: bool = True
    prs_threshold: float = 0.3
    prs_width: float = 0.1
    prs_missing_profile: str = "reject"  # a correct turn without a profile: "reject" (share 0) | "keep"
    fail_reward: float = 0.0

    def __post_init__(self) -> None:
        if self.prs_missing_profile not in PRS_MISSING_PROFILE:
            raise ValueError(f"prs_missing_profile must be one of {PRS_MISSING_PROFILE}, "
                             f"not {self.prs_missing_profile!r}")


@dataclasses.dataclass
class RewardTerms:
    reward: float
    correct_term: float = 0.0
    speedup_term: float = 0.0
    profile_term: float = 0.0
    failed: bool = False
    reason: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _get(result: Any, key: str, default: Any = None) -> Any:
    if result is None:
        return default
    if isinstance(result, dict):
        return result.get(key, default)
    return getattr(result, key, default)


def compute_reward(result: Any, cfg: RewardConfig | None = None) -> RewardTerms:
    """`result`: an EvalResult or its dict (`verdict`, `hacks`, `speedup`, `triton_time_share`, `timing`)."""
    cfg = cfg or RewardConfig()
    verdict = _get(result, "verdict")
    hacks = _get(result, "hacks") or []
    if not is_correct(result):
        if hacks:
            reason = "hacked: " + ", ".join(map(str, hacks))
        else:
            reason = str(verdict or "no verdict") + ("" if verdict != "correct" else " (but not marked correct)")
        return RewardTerms(reward=float(cfg.fail_reward), failed=True, reason=reason)
    correct_term = cfg.correct_weight * 1.0
    speedup = finite(_get(result, "speedup"))
    speedup_term = 0.0
    notes = []
    if speedup is not None:
        speedup_term = cfg.speedup_weight * min(max(speedup, 0.0), cfg.speedup_cap)
        if _get(result, "timing") == "cpu_wall":
            notes.append("cpu_wall speedup")
    else:
        notes.append("no speedup")
    share = finite(_get(result, "triton_time_share"))
    profile_term = 0.0
    if share is not None:
        profile_term = cfg.profile_weight * min(max(share, 0.0), 1.0)
    else:
        notes.append("no profile")
    reward = correct_term + speedup_term + profile_term
    return RewardTerms(reward=reward, correct_term=correct_term, speedup_term=speedup_term,
                       profile_term=profile_term, failed=False,
                       reason="correct" + (f" ({', '.join(notes)})" if notes else ""))


def score(result: EvalResult, cfg: RewardConfig | None = None) -> float:
    """The result's reward: the one it carries (the evaluator scores every result it returns,
    with its caller's config), else computed here with `cfg` and stored on the result, so that
    each result is scored once."""
    if result.reward is None:
        terms = compute_reward(result, cfg)
        result.reward, result.reward_terms = terms.reward, terms.to_dict()
    return float(result.reward)


def prs_keep_prob(share: float | None, cfg: RewardConfig | None = None) -> float:
    """clamp((share - threshold) / width, 0, 1) for a correct turn, the share to two decimals; 1.0
    when PRS is disabled.
    A missing share reads as 0 (`prs_missing_profile="reject"`) or keeps the turn ("keep")."""
    cfg = cfg or RewardConfig()
    s = finite(share)
    if not cfg.prs_enabled:
        return 1.0
    if s is None:
        if cfg.prs_missing_profile == "keep":
            return 1.0
        s = 0.0
    s = round(s, 2)  # as KernelGYM reads it (its reward manager formats the share to two decimals)
    if cfg.prs_width <= 0:
        return 1.0 if s >= cfg.prs_threshold else 0.0
    return min(1.0, max(0.0, (s - cfg.prs_threshold) / cfg.prs_width))


def prs_keep(result: Any, cfg: RewardConfig, rng: random.Random) -> bool:
    """Keep this turn for training? Only correct turns are subject to PRS; failures are kept."""
    if not cfg.prs_enabled or not is_correct(result):
        return True
    p = prs_keep_prob(_get(result, "triton_time_share"), cfg)
    return p >= 1.0 or (p > 0.0 and rng.random() < p)
