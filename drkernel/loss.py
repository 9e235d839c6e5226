"""PPO-clip policy loss with asymmetric ("clip-higher") and dual clipping, KL and entropy terms.

Inputs are per-token tensors [N, L] (N sequences or turn-samples, L tokens). `mask` marks
the tokens that count; everything else (padding, rejected sequences, dropped samples)
leaves both the numerator and the denominator of every aggregation.
Formulas: docs/algorithm.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

LOSS_TYPES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k3", "low_var_kl")
LOG_RATIO_CLAMP = 20.0  # exp(+-20) keeps ratios finite; such tokens are clipped anyway


@dataclass
class LossConfig:
    epsilon: float = 0.2  # lower clip: ratio >= 1 - epsilon
    epsilon_high: float = 0.28  # upper clip: ratio <= 1 + epsilon_high (clip-higher)
    dual_clip_c: Optional[float] = 3.0  # for A < 0 cap the loss at -A * c; None or 0 disables
    loss_type: str = "seq-mean-token-sum-norm"  # the paper's "seq-mean-token-sum / 1000"
    norm_length: float = 1000.0  # divisor of the token sum for seq-mean-token-sum-norm
    beta: float = 0.0  # KL-to-reference coefficient (off by default)
    kl_estimator: str = "low_var_kl"  # k1 | k3 | low_var_kl (k3 clamped to [-10, 10])
    entropy_coef: float = 0.0  # entropy bonus coefficient (subtracted from the loss)

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown loss_type {self.loss_type!r}; expected one of {LOSS_TYPES}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown kl_estimator {self.kl_estimator!r}; expected one of {KL_ESTIMATORS}")
        if self.dual_clip_c and self.dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1 (or None/0 to disable), got {self.dual_clip_c}")
        if self.norm_length <= 0:
            raise ValueError(f"norm_length must be > 0, got {self.norm_length}")


def aggregate(values: Tensor, mask: Tensor, loss_type: str, norm_length: float = LossConfig.norm_length) -> Tensor:
    """Reduce per-token values [N, L] to a scalar; masked tokens contribute nothing anywhere.

    token-mean:              sum_{n,l} m v / sum_{n,l} m
    seq-mean-token-mean:     mean over sequences of (sum_l m v / sum_l m)
    seq-mean-token-sum:      mean over sequences of sum_l m v
    seq-mean-token-sum-norm: mean over sequences of sum_l m v / norm_length
    Sequences with no valid token are left out of the sequence means; all-masked -> 0.
    """
    if values.shape != mask.shape:
        raise ValueError(f"values shape {tuple(values.shape)} != mask shape {tuple(mask.shape)}")
    m = mask.to(values.dtype)
    valid = m > 0
    v = torch.where(valid, values, torch.zeros((), dtype=values.dtype)) * m
    if loss_type == "token-mean":
        return v.sum() / m.sum().clamp(min=1.0)
    tokens = m.sum(dim=-1)
    has_tokens = (tokens > 0).to(values.dtype)
    n_seq = has_tokens.sum().clamp(min=1.0)
    per_seq = v.sum(dim=-1)
    if loss_type == "seq-mean-token-mean":
        per_seq = per_seq / tokens.clamp(min=1e-8)
    elif loss_type == "seq-mean-token-sum-norm":
        per_seq = per_seq / norm_length
    elif loss_type != "seq-mean-token-sum":
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
    return (per_seq * has_tokens).sum() / n_seq


def masked_mean(values: Tensor, mask: Tensor) -> float:
    """Token mean over the mask, as a Python float (for metrics)."""
    return float(aggregate(values.detach(), mask, "token-mean"))


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = LossConfig.kl_estimator) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled by pi.

    k1 = log pi - log pi_ref; k3 = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1 (>= 0,
    unbiased, low variance); low_var_kl = k3 clamped to [-10, 10] so one bad token can't blow up.
    """
    log_ratio = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if kind == "k1":
        return logp - ref_logp
    k3 = torch.exp(log_ratio) - log_ratio - 1.0
    if kind == "k3":
        return k3
    if kind == "low_var_kl":
        return k3.clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl estimator {kind!r}; expected one of {KL_ESTIMATORS}")


def _check_shapes(logp: Tensor, named: tuple[tuple[str, Optional[Tensor]], ...]) -> None:
    """logp must be [N, L] and every given tensor the same shape (ValueError naming the one that is not)."""
    if logp.dim() != 2:
        raise ValueError(f"logp must be [N, L], got shape {tuple(logp.shape)}")
    for name, t in named:
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logp shape {tuple(logp.shape)}")


def _token_advantages(advantages: Tensor, logp: Tensor) -> Tensor:
    """Advantages as [N, L]: per-token ones as given, a per-sample [N] one repeated over its tokens."""
    if advantages.dim() == 1:
        if advantages.shape[0] != logp.shape[0]:
            raise ValueError(f"advantages [N] must have N={logp.shape[0]}, got {advantages.shape[0]}")
        return advantages[:, None].expand_as(logp)
    if advantages.shape != logp.shape:
        raise ValueError(f"advantages shape {tuple(advantages.shape)} must be [N] or {tuple(logp.shape)}")
    return advantages


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, cfg: LossConfig,
                ref_logp: Optional[Tensor] = None, is_weights: Optional[Tensor] = None,
                entropy: Optional[Tensor] = None) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip (+ dual-clip) loss, aggregated per cfg.loss_type, plus optional KL / entropy terms.

    `is_weights` (truncated rollout-vs-trainer importance weights, see mismatch.py) multiply
    the per-token policy-gradient loss. Returns (scalar loss, metrics).
    """
    _check_shapes(logp, (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp),
                         ("is_weights", is_weights), ("entropy", entropy)))
    advantages = _token_advantages(advantages, logp)

    valid = mask.to(logp.dtype) > 0
    zero = torch.zeros((), dtype=logp.dtype)
    # Sanitise masked positions first: garbage there must not reach values *or* gradients.
    log_ratio = torch.where(valid, logp - old_logp.detach(), zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    adv = torch.where(valid, advantages.detach().to(logp.dtype), zero)

    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - cfg.epsilon, 1.0 + cfg.epsilon_high)
    pg = torch.maximum(loss1, loss2)
    clipped = (loss2 > loss1) & valid
    dual = torch.zeros_like(valid)
    if cfg.dual_clip_c:
        loss3 = -adv * cfg.dual_clip_c
        dual = (adv < 0) & (loss3 < pg) & valid
        pg = torch.where(adv < 0, torch.minimum(pg, loss3), pg)
    if is_weights is not None:
        pg = pg * torch.where(valid, is_weights.detach().to(logp.dtype), zero)

    pg_loss = aggregate(pg, mask, cfg.loss_type, cfg.norm_length)
    loss = pg_loss
    f = valid.to(logp.dtype)
    metrics: dict[str, float] = {
        "pg_loss": float(pg_loss.detach()),
        "clip_frac": masked_mean(clipped.to(logp.dtype), f),
        "clip_frac_high": masked_mean((clipped & (adv > 0)).to(logp.dtype), f),
        "clip_frac_low": masked_mean((clipped & (adv < 0)).to(logp.dtype), f),
        "dual_clip_frac": masked_mean(dual.to(logp.dtype), f),
        # k3 estimate of KL(pi_old || pi) from tokens sampled by pi_old
        "approx_kl": masked_mean(torch.exp(log_ratio) - 1.0 - log_ratio, f),
    }

    if cfg.beta > 0 and ref_logp is not None:
        kl = kl_penalty(torch.where(valid, logp, zero), torch.where(valid, ref_logp.detach(), zero),
                        cfg.kl_estimator)
        kl_loss = aggregate(kl, mask, cfg.loss_type, cfg.norm_length)
        loss = loss + cfg.beta * kl_loss
        metrics["kl_ref"] = masked_mean(kl, f)
    if entropy is not None:
        ent = torch.where(valid, entropy, zero)
        metrics["entropy"] = masked_mean(ent, f)
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * aggregate(ent, mask, cfg.loss_type, cfg.norm_length)
    metrics["loss"] = float(loss.detach())
    return loss, metrics
