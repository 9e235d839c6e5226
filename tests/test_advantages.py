"""Advantage estimators on a hand-computed example, plus structural identities."""

import math

import pytest
import torch

from drkernel.advantages import compute_advantages, discounted_returns

NAN = float("nan")

# Group 7: three trajectories (ragged: 3, 2 and 1 turns). Group -2: two trajectories, the
# second has a gap at turn 1. Group 100: a lone trajectory. Masked rewards hold NaN garbage.
REWARDS = torch.tensor([
    [1.0, 0.0, 2.0],
    [0.0, 2.0, NAN],
    [3.0, NAN, NAN],
    [1.0, 1.0, 1.0],
    [2.0, NAN, 4.0],
    [5.0, 1.0, NAN],
])
MASK = torch.tensor([
    [1, 1, 1],
    [1, 1, 0],
    [1, 0, 0],
    [1, 1, 1],
    [1, 0, 1],
    [1, 1, 0],
], dtype=torch.bool)
GROUPS = torch.tensor([7, 7, 7, -2, -2, 100])
GAMMA = 0.5

# By hand, gamma = 0.5, exponent = k - t in turn index (the gap still costs a factor):
#   traj0: G2 = 2, G1 = 0 + .5*2 = 1, G0 = 1 + .5*1 = 1.5
#   traj1: G1 = 2, G0 = 0 + .5*2 = 1
#   traj2: G0 = 3
#   traj3: G2 = 1, G1 = 1 + .5 = 1.5, G0 = 1 + .75 = 1.75
#   traj4: G2 = 4, G0 = 2 + .25*4 = 3
#   traj5: G1 = 1, G0 = 5 + .5 = 5.5
RETURNS = torch.tensor([
    [1.5, 1.0, 2.0],
    [1.0, 2.0, 0.0],
    [3.0, 0.0, 0.0],
    [1.75, 1.5, 1.0],
    [3.0, 0.0, 4.0],
    [5.5, 1.0, 0.0],
])

# TRLOO, per turn, mean over the *other* valid members:
#   group 7, t0: 1.5-(1+3)/2=-0.5, 1-(1.5+3)/2=-1.25, 3-(1.5+1)/2=1.75; t1: 1-2=-1, 2-1=1; t2: alone -> 0
#   group -2, t0: 1.75-3=-1.25, 3-1.75=1.25; t1: alone -> 0; t2: 1-4=-3, 4-1=3
TRLOO = torch.tensor([
    [-0.5, -1.0, 0.0],
    [-1.25, 1.0, 0.0],
    [1.75, 0.0, 0.0],
    [-1.25, 0.0, -3.0],
    [1.25, 0.0, 3.0],
    [0.0, 0.0, 0.0],
])

# RLOO: the t0 leave-one-out advantage, broadcast over each trajectory's valid turns.
RLOO = torch.tensor([
    [-0.5, -0.5, -0.5],
    [-1.25, -1.25, 0.0],
    [1.75, 0.0, 0.0],
    [-1.25, -1.25, -1.25],
    [1.25, 0.0, 1.25],
    [0.0, 0.0, 0.0],
])

# GRPO (no scale), mean including self:
#   group 7, t0: mean 5.5/3 -> -1/3, -5/6, 7/6; t1: mean 1.5 -> -0.5, 0.5
#   group -2, t0: mean 2.375 -> -0.625, 0.625; t2: mean 2.5 -> -1.5, 1.5
GRPO = torch.tensor([
    [-1 / 3, -0.5, 0.0],
    [-5 / 6, 0.5, 0.0],
    [7 / 6, 0.0, 0.0],
    [-0.625, 0.0, -1.5],
    [0.625, 0.0, 1.5],
    [0.0, 0.0, 0.0],
])

# GRPO scale="group": population std. Group 7 t0: sqrt((1/9 + 25/36 + 49/36)/3) = sqrt(26)/6;
# every two-member cell has std = |deviation|.
S0 = math.sqrt(26) / 6
EPS = 1e-6
GRPO_STD = torch.tensor([
    [(-1 / 3) / (S0 + EPS), -0.5 / (0.5 + EPS), 0.0],
    [(-5 / 6) / (S0 + EPS), 0.5 / (0.5 + EPS), 0.0],
    [(7 / 6) / (S0 + EPS), 0.0, 0.0],
    [-0.625 / (0.625 + EPS), 0.0, -1.5 / (1.5 + EPS)],
    [0.625 / (0.625 + EPS), 0.0, 1.5 / (1.5 + EPS)],
    [0.0, 0.0, 0.0],
])


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_returns_by_hand():
    close(discounted_returns(REWARDS, MASK, GAMMA), RETURNS)


def test_returns_gamma_one():
    g = discounted_returns(REWARDS, MASK, 1.0)
    close(g[0], torch.tensor([3.0, 2.0, 2.0]))
    close(g[4], torch.tensor([6.0, 0.0, 4.0]))


@pytest.mark.parametrize("estimator,scale,expected", [
    ("trloo", "none", TRLOO), ("rloo", "none", RLOO), ("grpo", "none", GRPO), ("grpo", "group", GRPO_STD),
])
def test_estimators_by_hand(estimator, scale, expected):
    adv = compute_advantages(REWARDS, MASK, GROUPS, estimator=estimator, gamma=GAMMA, scale=scale)
    assert adv.shape == REWARDS.shape
    assert not torch.isnan(adv).any()
    assert (adv[~MASK] == 0).all()
    close(adv, expected)


def test_group_ids_are_labels_only():
    """Relabelling or permuting trajectories must not change anything."""
    perm = torch.tensor([5, 3, 0, 4, 2, 1])
    # ids after the permutation: traj5 -> 0, traj3 -> 1, traj0 -> 1000, traj4 -> 1, traj2 -> 1000, traj1 -> 1000
    ids = torch.tensor([0, 1, 1000, 1, 1000, 1000])
    adv = compute_advantages(REWARDS[perm], MASK[perm], ids, "trloo", GAMMA)
    close(adv, TRLOO[perm])


def test_nan_garbage_does_not_leak():
    garbage = REWARDS.clone()
    garbage[~MASK] = float("inf")
    for est in ("trloo", "rloo", "grpo"):
        a = compute_advantages(garbage, MASK, GROUPS, est, GAMMA)
        b = compute_advantages(torch.nan_to_num(REWARDS, nan=0.0), MASK, GROUPS, est, GAMMA)
        assert torch.isfinite(a).all()
        close(a, b)


def test_trloo_equals_rloo_single_turn():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(12, 1, generator=g)
    m = torch.rand(12, 1, generator=g) > 0.2
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 3, 3, 4, 4])
    close(compute_advantages(r, m, ids, "trloo"), compute_advantages(r, m, ids, "rloo"))


@pytest.mark.parametrize("n", [2, 3, 5])
def test_grpo_is_shrunk_trloo(n):
    """With all turns valid, GRPO(no scale) == (1 - 1/N) * TRLOO exactly."""
    g = torch.Generator().manual_seed(n)
    r = torch.randn(4 * n, 3, generator=g, dtype=torch.float64)
    m = torch.ones(4 * n, 3, dtype=torch.bool)
    ids = torch.arange(4).repeat_interleave(n)
    grpo = compute_advantages(r, m, ids, "grpo", gamma=0.9)
    trloo = compute_advantages(r, m, ids, "trloo", gamma=0.9)
    torch.testing.assert_close(grpo, (1 - 1 / n) * trloo, rtol=1e-12, atol=1e-12)


def test_trloo_zero_mean_per_group_turn():
    """Leave-one-out advantages of a full group sum to zero: sum_i (G_i - mean_{-i}) = 0."""
    r = torch.randn(6, 2)
    m = torch.ones(6, 2, dtype=torch.bool)
    adv = compute_advantages(r, m, torch.tensor([0, 0, 0, 1, 1, 1]), "trloo")
    close(adv.view(2, 3, 2).sum(1), torch.zeros(2, 2))


@pytest.mark.parametrize("estimator, scale", [("trloo", "none"), ("rloo", "none"), ("grpo", "none"), ("grpo", "group")])
@pytest.mark.parametrize("value", [2.2, 2.9, 1.1])
def test_a_group_whose_members_all_tie_gets_exactly_zero(estimator, scale, value):
    """Sixteen float32 rewards of 2.2 at every turn: the leave-one-out mean rounds ~1 ulp away from
    the shared return, which group scaling would blow up to +-0.6; a tie is exactly 0, so the
    trainer skips it. Where turn 0 differs, later turns still tie (their returns do)."""
    mask, groups = torch.ones(16, 3, dtype=torch.bool), torch.zeros(16, dtype=torch.long)
    rewards = torch.full((16, 3), value)
    assert (compute_advantages(rewards, mask, groups, estimator, 1.0, scale) == 0).all()
    rewards[5:, 0] = 0.5
    adv = compute_advantages(rewards, mask, groups, estimator, 1.0, scale)
    assert (adv[:, 0] != 0).all()
    if estimator != "rloo":  # rloo gives every turn the trajectory's turn-0 advantage
        assert (adv[:, 1:] == 0).all(), adv[:, 1:]


def test_bad_inputs():
    with pytest.raises(ValueError, match="estimator"):
        compute_advantages(REWARDS, MASK, GROUPS, "ppo")
    with pytest.raises(ValueError, match="turn_mask"):
        compute_advantages(REWARDS, MASK[:, :2], GROUPS)
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages(REWARDS, MASK, GROUPS[:3])
    with pytest.raises(ValueError, match="rewards"):
        compute_advantages(REWARDS[0], MASK[0], GROUPS)
    with pytest.raises(ValueError, match="scale"):
        compute_advantages(REWARDS, MASK, GROUPS, "grpo", scale="batch")
    infinite = REWARDS.clone()
    infinite[0, 0] = math.inf  # a valid turn's reward
    with pytest.raises(ValueError, match="finite"):
        compute_advantages(infinite, MASK, GROUPS)
