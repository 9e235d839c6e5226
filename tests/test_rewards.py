"""drkernel.rewards: reward terms, failure handling, PRS."""

import random
from types import SimpleNamespace

import pytest

from drkernel.evaluator import EvalResult
from drkernel.rewards import RewardConfig, compute_reward, prs_keep, prs_keep_prob, score


def test_correct_reward_terms():
    t = compute_reward({"verdict": "correct", "correct": True, "hacks": [], "speedup": 2.0, "triton_time_share": 0.8})
    assert t.correct_term == 0.5 and t.speedup_term == 1.0 and t.profile_term == pytest.approx(0.4)
    assert t.reward == pytest.approx(1.9) and not t.failed
    d = t.to_dict()
    assert set(d) == {"reward", "correct_term", "speedup_term", "profile_term", "failed", "reason"}


def test_cap_and_missing_terms():
    t = compute_reward({"verdict": "correct", "correct": True, "speedup": 50.0, "triton_time_share": None})
    assert t.speedup_term == 1.5 and t.profile_term == 0.0 and t.reward == pytest.approx(2.0)
    t = compute_reward(SimpleNamespace(verdict="correct", correct=True, hacks=[], speedup=None, triton_time_share=None))
    assert t.reward == 0.5
    t = compute_reward({"verdict": "correct", "correct": True, "speedup": 0.01, "timing": "cpu_wall"})  # counts
    assert t.speedup_term == pytest.approx(0.005) and "cpu_wall" in t.reason


@pytest.mark.parametrize("res", [
    {"verdict": "incorrect", "speedup": 3.0},
    {"verdict": "hacked", "hacks": ["decoy_kernel"], "speedup": None},
    {"verdict": "correct", "correct": True, "hacks": ["side_stream"], "speedup": 100.0, "triton_time_share": 1.0},
    {"verdict": "timeout"},
    {},
])
def test_failures_get_fail_reward(res):
    t = compute_reward(res, RewardConfig(fail_reward=-0.1))
    assert t.failed and t.reward == -0.1
    assert t.correct_term == t.speedup_term == t.profile_term == 0.0


def test_score_computes_a_missing_reward_once_with_the_callers_config():
    cfg = RewardConfig(correct_weight=2.0)
    fresh = EvalResult(verdict="correct", correct=True, speedup=1.0, triton_time_share=0.5)
    assert score(fresh, cfg) == pytest.approx(2.0 + 0.5 + 0.25)
    assert fresh.reward == pytest.approx(2.75) and fresh.reward_terms["correct_term"] == 2.0
    scored = EvalResult(verdict="correct", correct=True, speedup=1.0, reward=0.125)  # the evaluator's
    assert score(scored, cfg) == 0.125 and scored.reward_terms is None


def test_prs_prob():
    cfg = RewardConfig()
    assert prs_keep_prob(None, cfg) == 0.0  # KernelGYM: a missing coverage reads as 0
    assert prs_keep_prob(None, RewardConfig(prs_missing_profile="keep")) == 1.0
    assert prs_keep_prob(0.1, cfg) == 0.0
    assert prs_keep_prob(0.35, cfg) == pytest.approx(0.5)
    assert prs_keep_prob(0.9, cfg) == 1.0
    assert prs_keep_prob(0.1, RewardConfig(prs_enabled=False)) == 1.0
    # KernelGYM's reward manager reads the share to two decimals
    assert prs_keep_prob(0.334, cfg) == pytest.approx(0.3) and prs_keep_prob(0.304, cfg) == 0.0
    assert prs_keep_prob(0.396, cfg) == 1.0


def test_prs_keep():
    cfg = RewardConfig()
    g = random.Random(0)
    lazy = {"verdict": "correct", "correct": True, "hacks": [], "triton_time_share": 0.05}
    assert not any(prs_keep(lazy, cfg, g) for _ in range(50))
    assert all(prs_keep({"verdict": "correct", "correct": True, "triton_time_share": 0.95}, cfg, g) for _ in range(50))
    assert all(prs_keep({"verdict": "incorrect", "triton_time_share": 0.0}, cfg, g) for _ in range(10))
    assert not prs_keep({"verdict": "correct", "correct": True, "triton_time_share": None}, cfg, g)
    assert prs_keep({"verdict": "correct", "correct": True, "triton_time_share": None}, RewardConfig(prs_missing_profile="keep"), g)
    half = {"verdict": "correct", "correct": True, "triton_time_share": 0.35}
    kept = sum(prs_keep(half, cfg, g) for _ in range(2000))
    assert 850 < kept < 1150
    with pytest.raises(ValueError, match="prs_missing_profile"):
        RewardConfig(prs_missing_profile="maybe")
