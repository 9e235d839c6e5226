"""Advantages for multi-turn group rollouts: TRLOO (Dr. Kernel), RLOO and GRPO.

Layout: `rewards[B, T]` holds one reward per (trajectory, turn); `turn_mask[B, T]` says
which turns exist; `group_ids[B]` ties together the trajectories sampled for one prompt.
All estimators are vectorised with `index_add_` over groups; the only Python loop is the
short backward loop over turns in `discounted_returns`.

Why TRLOO: GRPO's baseline is a mean that includes the sample itself, which shrinks the
expected gradient by (1 - 1/N) (badly so for the small groups multi-turn RL can afford).
A leave-one-out baseline, taken per turn over the reward-to-go, is unbiased.
See docs/algorithm.md for the formulas.
"""

from __future__ import annotations

import torch
from torch import Tensor

ESTIMATORS = ("trloo", "rloo", "grpo")
SCALES = ("none", "group")
STD_EPS = 1e-6


def _check_inputs(rewards: Tensor, turn_mask: Tensor, group_ids: Tensor | None = None) -> None:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, T], got shape {tuple(rewards.shape)}")
    if turn_mask.shape != rewards.shape:
        raise ValueError(f"turn_mask shape {tuple(turn_mask.shape)} != rewards shape {tuple(rewards.shape)}")
    if group_ids is not None:
        if group_ids.dim() != 1 or group_ids.shape[0] != rewards.shape[0]:
            raise ValueError(f"group_ids must be [B]={rewards.shape[0]}, got shape {tuple(group_ids.shape)}")
        if group_ids.is_floating_point():
            raise ValueError("group_ids must be an integer tensor")


def _float(rewards: Tensor) -> Tensor:
    return rewards if rewards.is_floating_point() else rewards.float()


def discounted_returns(rewards: Tensor, turn_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Reward-to-go G(i,t) = sum_{k>=t, k valid} gamma^(k-t) r(i,k); 0 where turn_mask is False.

    The exponent counts turn *indices*, so a missing turn in the middle still costs one
    factor of gamma. Invalid rewards are replaced by 0 before anything else, so NaN
    garbage there never leaks.
    """
    _check_inputs(rewards, turn_mask)
    mask = turn_mask.bool()
    rewards = _float(rewards)
    r = torch.where(mask, rewards, torch.zeros((), dtype=rewards.dtype))
    returns = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        running = r[:, t] + gamma * running
        returns[:, t] = running
    return torch.where(mask, returns, torch.zeros_like(returns))


def _group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary integer ids to 0..K-1 (so scatter buffers stay small)."""
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, uniq.numel()


def _group_sums(values: Tensor, mask: Tensor, index: Tensor, num_groups: int) -> tuple[Tensor, Tensor]:
    """Per-(group, turn) sum of valid values and count of valid members, gathered back to [B, T]."""
    m = mask.to(values.dtype)
    sums = torch.zeros(num_groups, values.shape[1], dtype=values.dtype).index_add_(0, index, values * m)
    counts = torch.zeros(num_groups, values.shape[1], dtype=values.dtype).index_add_(0, index, m)
    return sums[index], counts[index]


def _tied(values: Tensor, mask: Tensor, index: Tensor, num_groups: int) -> Tensor:
    """[B, T]: every valid member of the (group, turn) holds the same value. Their advantage is
    exactly 0, where float rounding of the group's sum would leave ~1 ulp (and group scaling
    would blow that up): such samples must be skipped, not pushed all one way."""
    slots = index[:, None].expand_as(values)
    hi = torch.full((num_groups, values.shape[1]), -torch.inf, dtype=values.dtype)
    lo = torch.full((num_groups, values.shape[1]), torch.inf, dtype=values.dtype)
    hi = hi.scatter_reduce(0, slots, torch.where(mask, values, -torch.inf), "amax")
    lo = lo.scatter_reduce(0, slots, torch.where(mask, values, torch.inf), "amin")
    return (hi == lo)[index]


def _leave_one_out(values: Tensor, mask: Tensor, index: Tensor, num_groups: int) -> Tensor:
    """values - mean(values of the other valid members); 0 when there is no other member or all are equal."""
    sums, counts = _group_sums(values, mask, index, num_groups)
    others = counts - 1.0
    has_others = mask & (others > 0) & ~_tied(values, mask, index, num_groups)
    baseline = (sums - values) / others.clamp(min=1.0)
    return torch.where(has_others, values - baseline, torch.zeros_like(values))


def compute_advantages(
    rewards: Tensor,
    turn_mask: Tensor,
    group_ids: Tensor,
    estimator: str = "trloo",
    gamma: float = 1.0,
    scale: str = "none",
) -> Tensor:
    """Per-turn advantages [B, T]; exactly 0 where turn_mask is False.

    - trloo: G(i,t) - mean_{j != i, valid at t, same group} G(j,t)
    - rloo:  leave-one-out on whole-trajectory returns G(i,0), broadcast to i's valid turns
             (trajectories whose turn 0 is invalid get 0)
    - grpo:  G(i,t) - mean_{j valid at t, same group, j = i included} G(j,t);
             scale="group" divides by the population std (unbiased=False) + 1e-6
    A trajectory with no other valid member at that turn, or whose valid members there all hold
    the same value, gets exactly 0 for every estimator.
    `scale` is only used by grpo ("none" for the others).
    """
    _check_inputs(rewards, turn_mask, group_ids)
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; expected one of {ESTIMATORS}")
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; expected one of {SCALES}")
    if scale != "none" and estimator != "grpo":
        raise ValueError(f"scale={scale!r} is only defined for estimator='grpo'")

    mask = turn_mask.bool()
    if not torch.isfinite(_float(rewards)[mask]).all():  # masked slots may hold garbage; valid ones may not
        raise ValueError("rewards of valid turns must be finite")
    returns = discounted_returns(rewards, mask, gamma)
    index, num_groups = _group_index(group_ids)
    zero = torch.zeros_like(returns)

    if estimator == "trloo":
        return _leave_one_out(returns, mask, index, num_groups)

    if estimator == "rloo":
        first = mask[:, :1]
        adv0 = _leave_one_out(returns[:, :1], first, index, num_groups)  # [B, 1]
        return torch.where(mask, adv0.expand_as(returns), zero)

    # grpo
    sums, counts = _group_sums(returns, mask, index, num_groups)
    mean = sums / counts.clamp(min=1.0)
    adv = returns - mean
    if scale == "group":
        sq, _ = _group_sums(adv.pow(2), mask, index, num_groups)
        std = (sq / counts.clamp(min=1.0)).sqrt()
        adv = adv / (std + STD_EPS)
    return torch.where(mask & (counts > 1) & ~_tied(returns, mask, index, num_groups), adv, zero)
