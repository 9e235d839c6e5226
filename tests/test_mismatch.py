"""Rollout-vs-trainer mismatch: truncated IS weights, geometric-mean rejection, token veto."""

import math

import pytest
import torch

from drkernel.loss import LossConfig, policy_loss
from drkernel.mismatch import MismatchConfig, mismatch_correction

OFF = dict(geo_low=None, geo_high=None, token_veto=None)


def logs(*ratios_rows):
    """old_logp, rollout_logp with the given pi_old / pi_rollout ratios (rollout_logp fixed at -1)."""
    r = torch.tensor(ratios_rows, dtype=torch.float64)
    rollout = torch.full_like(r, -1.0)
    return rollout + r.log(), rollout


def test_token_truncation_cap():
    old, roll = logs([3.0, 0.5, 1.0, 2.5])
    w, keep, m = mismatch_correction(old, roll, torch.ones(1, 4, dtype=torch.bool),
                                     MismatchConfig(token_is_cap=2.0, **OFF))
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0, 2.0]], dtype=torch.float64))
    assert keep.all()
    assert m["is_weight_clipped_frac"] == pytest.approx(0.5)
    assert m["is_weight_mean"] == pytest.approx(5.5 / 4)
    assert not w.requires_grad


def test_weight_direction_is_old_over_rollout():
    # trainer thinks the token is more likely than the rollout did -> weight > 1
    w, _, _ = mismatch_correction(torch.tensor([[-1.0]]), torch.tensor([[-1.5]]), torch.ones(1, 1, dtype=torch.bool),
                                  MismatchConfig(token_is_cap=10.0, **OFF))
    assert w.item() == pytest.approx(math.exp(0.5))


def test_sequence_cap():
    old, roll = logs([1.5, 1.5, 0.5], [2.0, 2.0, 1.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    w, _, m = mismatch_correction(old, roll, mask, MismatchConfig(token_is_cap=None, seq_is_cap=3.0, **OFF))
    # seq 0: 1.5 * 1.5 * 0.5 = 1.125; seq 1: 2 * 2 = 4 (the masked third token is ignored) -> 3
    torch.testing.assert_close(w[0], torch.full((3,), 1.125, dtype=torch.float64))
    torch.testing.assert_close(w[1, :2], torch.full((2,), 3.0, dtype=torch.float64))
    assert w[1, 2].item() == 1.0  # invalid tokens are neutral
    assert m["seq_is_weight_clipped_frac"] == pytest.approx(0.5)


def test_geo_mean_rejection_boundary():
    lo, hi, d = math.log(0.999), math.log(1.001), 1e-5
    # each row: two tokens whose mean log-ratio sits just inside / just outside a bound
    rows = [
        [lo + d + 0.3, lo + d - 0.3],  # inside (just above low): kept, though single tokens are far off
        [lo - d + 0.3, lo - d - 0.3],  # just below low: rejected
        [hi - d, hi - d],  # just below high: kept
        [hi + d, hi + d],  # just above high: rejected
    ]
    rollout = torch.zeros(4, 2, dtype=torch.float64)
    old = torch.tensor(rows, dtype=torch.float64)
    mask = torch.ones(4, 2, dtype=torch.bool)
    _, keep, m = mismatch_correction(old, rollout, mask, MismatchConfig(token_veto=None))
    assert keep.tolist() == [[True, True], [False, False], [True, True], [False, False]]
    assert m["geo_reject_rate"] == pytest.approx(0.5)
    assert m["reject_rate"] == pytest.approx(0.5)
    assert m["veto_reject_rate"] == 0.0


def test_one_extreme_token_counts_in_full_in_a_long_trajectorys_mean():
    """KernelGYM averages the raw log-ratios and clamps the mean: one token 25 nats off in 22,000
    moves the mean to 1.14e-3 > log(1.001) (rejected); clamping it to 20 first would keep it."""
    old = torch.zeros(1, 22000, dtype=torch.float64)
    old[0, 7] = 25.0
    _, keep, _ = mismatch_correction(old, torch.zeros_like(old), torch.ones_like(old, dtype=torch.bool),
                                     MismatchConfig())
    assert not keep.any()


def test_geo_mean_ignores_masked_tokens():
    old = torch.tensor([[0.0, 0.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    _, keep, m = mismatch_correction(old, torch.zeros_like(old), mask, MismatchConfig())
    assert keep.all() and m["reject_rate"] == 0.0


def test_three_turn_trajectory_is_judged_as_a_whole_in_geometric_mode():
    """The issue's example: per-token log-ratios 0.0025 / -0.0005 / -0.0005 over three turns.
    The trajectory mean (0.0005, ratio 1.0005) is inside [0.999, 1.001]: all three turns stay;
    judged per turn, turn 0 (ratio 1.0025) is rejected."""
    old = torch.tensor([[0.0025] * 4, [-0.0005] * 4, [-0.0005] * 4], dtype=torch.float64)
    mask = torch.ones(3, 4, dtype=torch.bool)
    trajectory = torch.tensor([7, 7, 7])
    _, keep, m = mismatch_correction(old, torch.zeros_like(old), mask, MismatchConfig(), trajectory)
    assert keep.all() and m["reject_rate"] == 0.0
    _, keep, m = mismatch_correction(old, torch.zeros_like(old), mask, MismatchConfig(geo_scope="turn"), trajectory)
    assert keep[:, 0].tolist() == [False, True, True] and m["geo_reject_rate"] == pytest.approx(1 / 3)


def test_a_far_off_turn_rejects_its_whole_trajectory_and_only_it():
    old = torch.tensor([[0.01] * 2, [0.0] * 2, [0.0] * 2, [0.0] * 2], dtype=torch.float64)
    mask = torch.ones(4, 2, dtype=torch.bool)
    trajectory = torch.tensor([0, 0, 1, 1])  # rows 0-1: one trajectory, rows 2-3: another
    _, keep, m = mismatch_correction(old, torch.zeros_like(old), mask, MismatchConfig(), trajectory)
    assert keep[:, 0].tolist() == [False, False, True, True]  # mean 0.005 > log(1.001)
    assert m["reject_rate"] == pytest.approx(0.5)
    # without trajectory ids every row is its own trajectory
    _, keep, _ = mismatch_correction(old, torch.zeros_like(old), mask, MismatchConfig())
    assert keep[:, 0].tolist() == [False, True, True, True]


def test_importance_weights_are_off_in_the_released_recipe():
    old, roll = logs([3.0, 0.5])
    w, _, _ = mismatch_correction(old, roll, torch.ones(1, 2, dtype=torch.bool), MismatchConfig(**OFF))
    assert (w == 1).all()


def test_token_veto():
    veto = 1e-4
    old = torch.tensor([[0.0, math.log(veto) - 0.01, 0.0],  # one token below the veto -> reject
                        [0.0, math.log(veto) + 0.01, 0.0],  # just above -> keep
                        [0.0, math.log(veto) - 5.0, 0.0]], dtype=torch.float64)  # below, but masked -> keep
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 0, 1]], dtype=torch.bool)
    _, keep, m = mismatch_correction(old, torch.zeros_like(old), mask,
                                     MismatchConfig(token_veto=veto, geo_low=None, geo_high=None))
    assert keep[:, 0].tolist() == [False, True, True]
    assert not keep[0].any()
    assert m["veto_reject_rate"] == pytest.approx(1 / 3)
    assert m["geo_reject_rate"] == 0.0


def test_mismatch_kl_value():
    old, roll = logs([2.0, 0.5])
    _, _, m = mismatch_correction(old, roll, torch.ones(1, 2, dtype=torch.bool), MismatchConfig())
    # k3 with r = pi_old / pi_rollout: (r - 1 - log r) -> (1 - log 2) and (-0.5 + log 2); mean 0.25
    assert m["mismatch_kl"] == pytest.approx(0.25)


def test_disabled_passes_everything():
    old, roll = logs([3.0, 1e-6])
    w, keep, m = mismatch_correction(old, roll, torch.ones(1, 2, dtype=torch.bool), MismatchConfig(enabled=False))
    assert (w == 1).all() and keep.all() and m["reject_rate"] == 0.0
    assert m["mismatch_kl"] > 0


def test_empty_sequences_are_not_rejected_or_counted():
    old = torch.tensor([[9.0, 9.0], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[0, 0], [1, 1]], dtype=torch.bool)
    _, keep, m = mismatch_correction(old, torch.zeros_like(old), mask, MismatchConfig())
    assert keep.all() and m["reject_rate"] == 0.0


def test_rejected_sequences_leave_the_denominator():
    lossc = LossConfig(loss_type="token-mean")
    old = torch.tensor([[0.0, 0.0], [0.5, 0.5], [0.0, 0.0]], dtype=torch.float64)  # seq 1 is far off
    roll = torch.zeros_like(old)
    mask = torch.ones(3, 2, dtype=torch.bool)
    w, keep, m = mismatch_correction(old, roll, mask, MismatchConfig())
    assert keep.tolist() == [[True, True], [False, False], [True, True]]
    assert m["reject_rate"] == pytest.approx(1 / 3)
    adv = torch.tensor([1.0, 100.0, -3.0], dtype=torch.float64)
    loss, _ = policy_loss(old, old, adv, mask & keep, lossc, is_weights=w)
    # only seqs 0 and 2 remain, 4 tokens, ratio 1, weight 1: (-1 -1 +3 +3) / 4
    assert loss.item() == pytest.approx(1.0)
    assert m["is_weight_mean"] == pytest.approx(1.0)


def test_bad_config():
    with pytest.raises(ValueError):
        MismatchConfig(token_is_cap=0.0)
    with pytest.raises(ValueError):
        MismatchConfig(geo_low=1.1, geo_high=1.0)
    with pytest.raises(ValueError, match="geo_scope"):
        MismatchConfig(geo_scope="sequence")
