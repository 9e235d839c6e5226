"""PPO-clip loss: aggregations, clip branches, masks, KL estimators and metrics, by hand."""

import math

import pytest
import torch

from drkernel.advantages import compute_advantages
from drkernel.loss import LossConfig, aggregate, kl_penalty, policy_loss

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
VMASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize("loss_type,expected", [
    ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3
    ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2; the empty row is not a sequence
    ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2
    ("seq-mean-token-sum-norm", 0.35),  # (3/10 + 4/10) / 2 with norm_length = 10
])
def test_aggregations_by_hand(loss_type, expected):
    assert aggregate(VALUES, VMASK, loss_type, norm_length=10.0).item() == pytest.approx(expected)


@pytest.mark.parametrize("loss_type", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                       "seq-mean-token-sum-norm"])
def test_all_masked_is_zero_not_nan(loss_type):
    v = torch.full((2, 3), float("nan"), requires_grad=True)
    out = aggregate(v, torch.zeros(2, 3, dtype=torch.bool), loss_type)
    out.backward()
    assert out.item() == 0.0
    assert not torch.isnan(v.grad).any()


def test_unknown_loss_type():
    with pytest.raises(ValueError):
        aggregate(VALUES, VMASK, "sum")
    with pytest.raises(ValueError):
        LossConfig(loss_type="sum")


def one_token(adv: float, ratio: float, cfg: LossConfig):
    """Loss and d loss / d logp for a single token with the given advantage and ratio."""
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    loss, metrics = policy_loss(logp, old, torch.tensor([adv], dtype=torch.float64),
                                torch.ones(1, 1, dtype=torch.bool), cfg)
    loss.backward()
    return loss.item(), logp.grad.item(), metrics


CFG = LossConfig(epsilon=0.2, epsilon_high=0.28, dual_clip_c=3.0, loss_type="token-mean")


def test_positive_advantage_clipped_high():
    # ratio 1.5 > 1.28: max(-1.5, -1.28) = -1.28, constant -> no gradient
    loss, grad, m = one_token(1.0, 1.5, CFG)
    assert loss == pytest.approx(-1.28)
    assert grad == 0.0
    assert m["clip_frac"] == 1.0 and m["clip_frac_high"] == 1.0 and m["clip_frac_low"] == 0.0


def test_positive_advantage_low_ratio_not_clipped():
    # ratio 0.5: max(-0.5, -0.8) = -0.5 -> unclipped, d/dlogp (-A r) = -0.5
    loss, grad, m = one_token(1.0, 0.5, CFG)
    assert loss == pytest.approx(-0.5)
    assert grad == pytest.approx(-0.5)
    assert m["clip_frac"] == 0.0


def test_negative_advantage_clipped_low():
    # ratio 0.5 < 0.8: max(0.5, 0.8) = 0.8, no gradient
    loss, grad, m = one_token(-1.0, 0.5, CFG)
    assert loss == pytest.approx(0.8)
    assert grad == 0.0
    assert m["clip_frac_low"] == 1.0 and m["clip_frac_high"] == 0.0


def test_negative_advantage_dual_clip():
    # ratio 5: max(5, 1.28) = 5, dual-clip min(5, 3 * 1) = 3, no gradient
    loss, grad, m = one_token(-1.0, 5.0, CFG)
    assert loss == pytest.approx(3.0)
    assert grad == 0.0
    assert m["dual_clip_frac"] == 1.0 and m["clip_frac"] == 0.0
    # disabled: the unbounded PPO loss comes back
    loss, grad, m = one_token(-1.0, 5.0, LossConfig(dual_clip_c=None, loss_type="token-mean"))
    assert loss == pytest.approx(5.0) and grad == pytest.approx(5.0) and m["dual_clip_frac"] == 0.0


def test_negative_advantage_below_dual_bound():
    # A = -2, ratio 2: max(4, 2.56) = 4 < 6 = -A c, so the plain branch with gradient -A r = 4
    loss, grad, m = one_token(-2.0, 2.0, CFG)
    assert loss == pytest.approx(4.0)
    assert grad == pytest.approx(4.0)
    assert m["dual_clip_frac"] == 0.0


def test_bad_dual_clip():
    with pytest.raises(ValueError):
        LossConfig(dual_clip_c=0.5)


def test_metrics_over_batch():
    ratios = torch.tensor([[1.5, 0.5, 0.5, 1.2, 5.0, 2.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0, -2.0]], dtype=torch.float64)
    logp = ratios.log().requires_grad_()
    loss, m = policy_loss(logp, torch.zeros_like(logp), adv, torch.ones_like(logp, dtype=torch.bool), CFG)
    # per-token losses from the single-token tests: -1.28, -0.5, 0.8, 1.2, 3, 4
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 1.2 + 3.0 + 4.0) / 6)
    assert m["pg_loss"] == pytest.approx(loss.item())
    assert m["clip_frac"] == pytest.approx(2 / 6)
    assert m["clip_frac_high"] == pytest.approx(1 / 6)
    assert m["clip_frac_low"] == pytest.approx(1 / 6)
    assert m["dual_clip_frac"] == pytest.approx(1 / 6)
    r = ratios[0]
    assert m["approx_kl"] == pytest.approx(float((r - 1 - r.log()).mean()))


def test_default_loss_type_is_token_sum_over_1000():
    cfg = LossConfig()
    assert cfg.loss_type == "seq-mean-token-sum-norm" and cfg.norm_length == 1000.0
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    loss, _ = policy_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, -2.0]), mask, cfg)
    # ratio 1: per-token loss -A; seq sums -3 and 2; mean over 2 seqs of sum/1000
    assert loss.item() == pytest.approx((-3.0 / 1000 + 2.0 / 1000) / 2)


@pytest.mark.parametrize("loss_type", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                       "seq-mean-token-sum-norm"])
def test_masked_tokens_change_nothing(loss_type):
    cfg = LossConfig(loss_type=loss_type, beta=0.1, entropy_coef=0.01)
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 4, generator=g, dtype=torch.float64)
    old = logp + 0.3 * torch.randn(3, 4, generator=g, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(3, 4, generator=g, dtype=torch.float64)
    ent = torch.rand(3, 4, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)

    def run(lp, o, r, e, a):
        lp = lp.clone().requires_grad_()
        loss, _ = policy_loss(lp, o, a, mask, cfg, ref_logp=r, entropy=e)
        loss.backward()
        return loss.item(), lp.grad

    base_loss, base_grad = run(logp, old, ref, ent, adv)
    junk = ~mask
    bad = lambda x, v: torch.where(junk, torch.full_like(x, v), x)  # noqa: E731
    loss2, grad2 = run(bad(logp, 50.0), bad(old, float("nan")), bad(ref, -1e9), bad(ent, float("inf")),
                       bad(adv, 1e6))
    assert loss2 == pytest.approx(base_loss)
    torch.testing.assert_close(grad2, base_grad)
    assert (grad2[junk] == 0).all()
    assert (base_grad[mask] != 0).all()


def test_kl_estimators_by_hand():
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(math.log(2))
    # k3 = r - log r - 1 with r = pi_ref / pi = 0.5
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - math.log(0.5) - 1)
    assert kl_penalty(logp, ref, "low_var_kl").item() == pytest.approx(0.5 - math.log(0.5) - 1)
    far = kl_penalty(torch.tensor([0.0]), torch.tensor([5.0]), "k3").item()
    assert far == pytest.approx(math.exp(5) - 6)
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([5.0]), "low_var_kl").item() == 10.0
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "k2")


def test_kl_and_entropy_terms_added():
    logp = torch.full((1, 2), math.log(0.5))
    ref = torch.full((1, 2), math.log(0.25))
    ent = torch.tensor([[1.0, 3.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    cfg = LossConfig(loss_type="token-mean", beta=0.5, kl_estimator="k1", entropy_coef=0.1)
    loss, m = policy_loss(logp, logp, torch.tensor([1.0]), mask, cfg, ref_logp=ref, entropy=ent)
    # pg = -1 per token; kl = log 2 per token; entropy mean 2
    assert loss.item() == pytest.approx(-1.0 + 0.5 * math.log(2) - 0.1 * 2.0)
    assert m["kl_ref"] == pytest.approx(math.log(2))
    assert m["entropy"] == pytest.approx(2.0)
    assert m["pg_loss"] == pytest.approx(-1.0)
    # beta = 0: the reference is ignored
    loss0, m0 = policy_loss(logp, logp, torch.tensor([1.0]), mask, LossConfig(loss_type="token-mean"),
                            ref_logp=ref)
    assert loss0.item() == pytest.approx(-1.0) and "kl_ref" not in m0


def test_is_weights_scale_pg_loss():
    logp = torch.zeros(1, 2, requires_grad=True)
    w = torch.tensor([[2.0, 0.5]])
    loss, _ = policy_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool),
                          LossConfig(loss_type="seq-mean-token-sum"), is_weights=w)
    loss.backward()
    assert loss.item() == pytest.approx(-2.5)
    torch.testing.assert_close(logp.grad, -w)


def test_dropped_samples_keep_their_baseline_but_leave_the_loss():
    """A PRS-rejected sample counts in its group's baseline but not in the loss or its denominator."""
    rewards = torch.tensor([[1.0], [0.0], [5.0]])  # one group; sample 2 is rejected by PRS
    turn_mask = torch.ones(3, 1, dtype=torch.bool)
    adv = compute_advantages(rewards, turn_mask, torch.zeros(3, dtype=torch.long), "trloo")[:, 0]
    # baselines include the rejected sample: 1 - 2.5 = -1.5, 0 - 3 = -3
    torch.testing.assert_close(adv[:2], torch.tensor([-1.5, -3.0]))
    keep = torch.tensor([True, True, False])
    token_mask = torch.tensor([[1, 1], [1, 0], [1, 1]], dtype=torch.bool)
    loss_mask = token_mask & keep[:, None]
    assert not loss_mask[2].any()
    cfg = LossConfig(loss_type="token-mean")
    logp = torch.zeros(3, 2)
    full, _ = policy_loss(logp, logp, adv, loss_mask, cfg)
    kept_only, _ = policy_loss(logp[:2], logp[:2], adv[:2], token_mask[:2], cfg)
    assert full.item() == pytest.approx(kept_only.item())
    assert full.item() == pytest.approx((1.5 + 1.5 + 3.0) / 3)
