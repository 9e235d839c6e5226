"""Rollout-vs-trainer mismatch correction: rejection and (optional) truncated importance sampling.

The rollout engine (vLLM, or our own sampler in another precision) and the trainer give
slightly different probabilities for the same tokens. PPO's "old" policy is the trainer's
pi_old, but the tokens were sampled from pi_rollout; w = pi_old / pi_rollout =
exp(old_logp - rollout_logp) per token. Sequences whose mismatch is too large are rejected
(left out of the loss): geometric-mean rejection, over a whole multi-turn trajectory by
default (`geo_scope`), and a per-turn token veto. That is the released Dr. Kernel recipe;
truncated importance weights (TIS, `token_is_cap` / `seq_is_cap`) are available but off
there. Formulas: docs/algorithm.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from drkernel.loss import LOG_RATIO_CLAMP

GEO_SCOPES = ("trajectory", "turn")


@dataclass
class MismatchConfig:
    enabled: bool = True  # False: weights 1, nothing rejected (metrics are still reported)
    token_is_cap: Optional[float] = None  # token-level TIS: w_t = min(ratio_t, cap); None disables
    seq_is_cap: Optional[float] = None  # sequence-level TIS: min(prod_t ratio_t, cap); None disables
    geo_low: Optional[float] = 0.999  # reject if the geometric-mean ratio < geo_low
    geo_high: Optional[float] = 1.001  # reject if the geometric-mean ratio > geo_high
    geo_scope: str = "trajectory"  # the geometric mean over a whole trajectory's turns, or per "turn"
    token_veto: Optional[float] = 1e-4  # reject a sequence (turn) if any token ratio < token_veto

    def __post_init__(self) -> None:
        if self.geo_scope not in GEO_SCOPES:
            raise ValueError(f"geo_scope must be one of {GEO_SCOPES}, not {self.geo_scope!r}")
        for name in ("token_is_cap", "seq_is_cap", "geo_low", "geo_high", "token_veto"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be > 0 or None, got {v}")
        if self.geo_low is not None and self.geo_high is not None and self.geo_low > self.geo_high:
            raise ValueError(f"geo_low {self.geo_low} > geo_high {self.geo_high}")


def mean_log_ratio(log_w: Tensor, valid: Tensor, trajectory: Tensor | None = None) -> Tensor:
    """[N] mean log-ratio over each row's valid tokens, or over all tokens of the rows that share
    a `trajectory` id (the turns of one multi-turn trajectory)."""
    fvalid = valid.to(log_w.dtype)
    sums, counts = (log_w * fvalid).sum(-1), fvalid.sum(-1)
    if trajectory is not None:
        index = torch.unique(trajectory, return_inverse=True)[1]
        sums = torch.zeros_like(sums).index_add_(0, index, sums)[index]
        counts = torch.zeros_like(counts).index_add_(0, index, counts)[index]
    return sums / counts.clamp(min=1.0)


def _is_weights(log_w: Tensor, valid: Tensor, has_tok: Tensor, cfg: MismatchConfig) -> tuple[Tensor, float, float]:
    """Truncated IS weights [N, L] (1 on invalid tokens) and the shares of valid tokens and of
    rows whose weight the token and the sequence cap cut."""
    ratio = torch.exp(log_w)
    n_seq = max(int(has_tok.sum()), 1)
    n_valid = max(float(valid.sum()), 1.0)
    weights = torch.ones_like(log_w)
    clipped_frac = seq_clipped_frac = 0.0
    if cfg.token_is_cap is not None:
        weights = weights * ratio.clamp(max=cfg.token_is_cap)
        clipped_frac = float(((ratio > cfg.token_is_cap) & valid).sum() / n_valid)
    if cfg.seq_is_cap is not None:
        seq_log_w = log_w.sum(-1)
        seq_w = torch.exp(seq_log_w.clamp(max=math.log(cfg.seq_is_cap)))
        weights = weights * seq_w[:, None]
        seq_clipped_frac = float(((seq_log_w > math.log(cfg.seq_is_cap)) & has_tok).sum() / n_seq)
    return torch.where(valid, weights, torch.ones((), dtype=weights.dtype)), clipped_frac, seq_clipped_frac


def _rejections(log_w: Tensor, valid: Tensor, has_tok: Tensor, cfg: MismatchConfig,
                trajectory: Tensor | None) -> tuple[Tensor, Tensor]:
    """[N] rows rejected by the geometric-mean bounds and by the token veto (rows without a valid
    token never are). `log_w` unclamped: the mean is clamped, not each token (KernelGYM's
    `mismatch_helper.py`), so one extreme token counts in full in a long trajectory's mean."""
    geo_reject = torch.zeros_like(has_tok)
    veto_reject = torch.zeros_like(has_tok)
    scope = trajectory if cfg.geo_scope == "trajectory" else None
    mean_log_w = mean_log_ratio(log_w, valid, scope).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if cfg.geo_low is not None:
        geo_reject |= mean_log_w < math.log(cfg.geo_low)
    if cfg.geo_high is not None:
        geo_reject |= mean_log_w > math.log(cfg.geo_high)
    if cfg.token_veto is not None:
        veto_reject = ((log_w < math.log(cfg.token_veto)) & valid).any(-1)
    return geo_reject & has_tok, veto_reject & has_tok


def mismatch_correction(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cfg: MismatchConfig,
    trajectory: Tensor | None = None,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Truncated IS weights [N, L] (detached), keep_mask [N, L] (bool) and metrics.

    Rows are turns; `trajectory` [N] (ints) says which rows are turns of one trajectory: with
    `geo_scope="trajectory"` their geometric mean is taken over all of their tokens and they are
    rejected together (None: every row is a trajectory of its own). Weights are 1 on invalid
    tokens. If both token and sequence caps are set the weights multiply (normally enable one).
    A rejected row has keep_mask all False; callers use `mask & keep_mask` as the loss mask.
    Rows with no valid token are never rejected and do not count in the reject rates.
    """
    if old_logp.dim() != 2 or rollout_logp.shape != old_logp.shape or mask.shape != old_logp.shape:
        raise ValueError(f"old_logp, rollout_logp and mask must all be [N, L]; got {tuple(old_logp.shape)}, "
                         f"{tuple(rollout_logp.shape)}, {tuple(mask.shape)}")
    with torch.no_grad():
        valid = mask.bool()
        zero = torch.zeros((), dtype=old_logp.dtype)
        raw = torch.where(valid, old_logp - rollout_logp, zero)
        log_w = raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        has_tok = valid.any(-1)
        n_seq = max(int(has_tok.sum()), 1)
        fvalid = valid.to(old_logp.dtype)
        # k3 estimate of KL(pi_rollout || pi_old) from tokens sampled by pi_rollout
        mismatch_kl = float(((torch.exp(log_w) - 1.0 - log_w) * fvalid).sum() / max(float(fvalid.sum()), 1.0))

        weights = torch.ones_like(log_w)
        clipped_frac = seq_clipped_frac = 0.0
        geo_reject = veto_reject = torch.zeros_like(has_tok)
        if cfg.enabled:
            weights, clipped_frac, seq_clipped_frac = _is_weights(log_w, valid, has_tok, cfg)
            geo_reject, veto_reject = _rejections(raw, valid, has_tok, cfg, trajectory)
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
