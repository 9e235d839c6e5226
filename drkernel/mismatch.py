"""Rollout-vs-trainer mismatch correction: truncated importance sampling and rejection.

The rollout engine (vLLM, or our own sampler in another precision) and the trainer give
slightly different probabilities for the same tokens. PPO's "old" policy is the trainer's
pi_old, but the tokens were sampled from pi_rollout, so each token is reweighted by
w = pi_old / pi_rollout = exp(old_logp - rollout_logp), truncated at a cap (TIS), and whole
sequences whose mismatch is too large are rejected (left out of the loss and its
denominator). Formulas: docs/algorithm.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0


@dataclass
class MismatchConfig:
    enabled: bool = True  # False: weights 1, nothing rejected (metrics are still reported)
    token_is_cap: Optional[float] = 2.0  # token-level TIS: w_t = min(ratio_t, cap); None disables
    seq_is_cap: Optional[float] = None  # sequence-level TIS: min(prod_t ratio_t, cap); None disables
    geo_low: Optional[float] = 0.999  # reject a sequence if geometric-mean ratio < geo_low
    geo_high: Optional[float] = 1.001  # reject a sequence if geometric-mean ratio > geo_high
    token_veto: Optional[float] = 1e-4  # reject a sequence if any token ratio < token_veto

    def __post_init__(self) -> None:
        for name in ("token_is_cap", "seq_is_cap", "geo_low", "geo_high", "token_veto"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be > 0 or None, got {v}")
        if self.geo_low is not None and self.geo_high is not None and self.geo_low > self.geo_high:
            raise ValueError(f"geo_low {self.geo_low} > geo_high {self.geo_high}")


def mismatch_correction(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cfg: MismatchConfig
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Truncated IS weights [N, L] (detached), keep_mask [N, L] (bool) and metrics.

    Weights are 1 on invalid tokens. If both token and sequence caps are set the weights
    multiply (normally enable one). A rejected sequence has keep_mask all False; callers use
    `mask & keep_mask` as the loss mask. Sequences with no valid token are never rejected and
    do not count in the reject rates.
    """
    if old_logp.dim() != 2 or rollout_logp.shape != old_logp.shape or mask.shape != old_logp.shape:
        raise ValueError(f"old_logp, rollout_logp and mask must all be [N, L]; got {tuple(old_logp.shape)}, "
                         f"{tuple(rollout_logp.shape)}, {tuple(mask.shape)}")
    with torch.no_grad():
        valid = mask.bool()
        fvalid = valid.to(old_logp.dtype)
        zero = torch.zeros((), dtype=old_logp.dtype)
        log_w = torch.where(valid, old_logp - rollout_logp, zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = torch.exp(log_w)
        n_tok = fvalid.sum(-1)
        has_tok = n_tok > 0
        n_seq = max(int(has_tok.sum()), 1)
        n_valid = max(float(fvalid.sum()), 1.0)

        # k3 estimate of KL(pi_rollout || pi_old) from tokens sampled by pi_rollout
        mismatch_kl = float(((ratio - 1.0 - log_w) * fvalid).sum() / n_valid)

        weights = torch.ones_like(log_w)
        keep_seq = torch.ones_like(has_tok)
        geo_reject = torch.zeros_like(has_tok)
        veto_reject = torch.zeros_like(has_tok)
        clipped_frac = 0.0
        seq_clipped_frac = 0.0
        if cfg.enabled:
            if cfg.token_is_cap is not None:
                weights = weights * ratio.clamp(max=cfg.token_is_cap)
                clipped_frac = float(((ratio > cfg.token_is_cap) & valid).sum() / n_valid)
            if cfg.seq_is_cap is not None:
                seq_log_w = log_w.sum(-1)
                seq_w = torch.exp(seq_log_w.clamp(max=math.log(cfg.seq_is_cap)))
                weights = weights * seq_w[:, None]
                seq_clipped_frac = float(((seq_log_w > math.log(cfg.seq_is_cap)) & has_tok).sum() / n_seq)
            weights = torch.where(valid, weights, torch.ones((), dtype=weights.dtype))

            mean_log_w = log_w.sum(-1) / n_tok.clamp(min=1.0)
            if cfg.geo_low is not None:
                geo_reject |= mean_log_w < math.log(cfg.geo_low)
            if cfg.geo_high is not None:
                geo_reject |= mean_log_w > math.log(cfg.geo_high)
            if cfg.token_veto is not None:
                veto_reject = ((log_w < math.log(cfg.token_veto)) & valid).any(-1)
            geo_reject &= has_tok
            veto_reject &= has_tok
            keep_seq = ~(geo_reject | veto_reject)

        keep_mask = keep_seq[:, None].expand_as(valid).clone()
        kept = valid & keep_mask
        metrics = {
            "mismatch_kl": mismatch_kl,
            "geo_reject_rate": float(geo_reject.sum()) / n_seq,
            "veto_reject_rate": float(veto_reject.sum()) / n_seq,
            "reject_rate": float((~keep_seq & has_tok).sum()) / n_seq,
            "is_weight_mean": float((weights * kept).sum() / max(float(kept.sum()), 1.0)),
            "is_weight_clipped_frac": clipped_frac,
            "seq_is_weight_clipped_frac": seq_clipped_frac,
        }
    return weights.detach(), keep_mask, metrics
