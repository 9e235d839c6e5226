"""bench/ablation.py's pieces on a smaller setting than its --quick mode (seconds)."""

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ablation():
    spec = importlib.util.spec_from_file_location("bench_ablation", ROOT / "bench" / "ablation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def test_the_exact_gradient_matches_finite_differences(ablation):
    env = ablation.make_env(ablation.RewardConfig())
    theta = 0.5 * torch.randn(ablation.TURNS, 3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    g = ablation.exact_gradient(theta, env)
    e = torch.zeros_like(theta)
    e[1, 2, 0] = 1e-6
    fd = (ablation.exact(theta + e, env)["J"] - ablation.exact(theta - e, env)["J"]) / 2e-6
    assert float(g[1, 2, 0]) == pytest.approx(float(fd), rel=1e-5)


def test_grpo_is_trloo_shrunk_by_one_minus_one_over_n_and_trloo_is_unbiased(ablation):
    (row,) = ablation.gradient_study([4], 16000, seed=0)
    assert row["grpo_over_trloo_grad_ratio"] == pytest.approx(0.75, abs=1e-9)
    assert row["trloo_on_true"] == pytest.approx(1.0, abs=0.1)
    assert row["grpo_on_true"] == pytest.approx(0.75, abs=0.1)


def test_profiling_reward_and_prs_lower_the_lazy_share(ablation):
    study = ablation.lazy_study(steps=12, groups=8, n=8, seeds=[0])
    assert study["lazy_share_with_pr_prs"] < study["lazy_share_start"] < study["lazy_share_without"]


def test_drifted_groups_are_rejected_by_the_mismatch_correction(ablation):
    cfg = ablation.recipe()
    env = ablation.make_env(cfg.reward_config())
    theta = torch.zeros(ablation.TURNS, 3, 4, dtype=torch.float64)
    drift = torch.zeros(64, 4, dtype=torch.float64)
    drift[:32, ablation.LAZY] = 3.0  # the first four groups of eight
    gen = torch.Generator().manual_seed(0)
    ro = ablation.sample(theta, env, 64, gen, drift)
    _, info = ablation.update_gradient(theta, ro, env, cfg, 8, random.Random(0))
    assert 0.45 < info["reject_rate"] < 0.6
    _, info = ablation.update_gradient(theta, ablation.sample(theta, env, 64, gen), env, cfg, 8, random.Random(0))
    assert info["reject_rate"] == 0.0


def test_the_json_has_the_headline_keys(ablation, tmp_path, monkeypatch):
    fake = {"N": 4, "grpo_over_trloo_grad_ratio": 0.75, "grpo_on_true_gradient": 0.75, "trloo_on_true_gradient": 1.0,
            "lazy_share_start": 0.6, "lazy_share_with_pr_prs": 0.3, "lazy_share_without": 0.8, "mismatch": {},
            "wall_s": 0.0, "gradients": [], "lazy": {}, "mismatch_runs": {}}
    monkeypatch.setattr(ablation, "run", lambda quick, seed: dict(fake, quick=quick))
    out = tmp_path / "out.json"
    assert ablation.main(["--quick", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["quick"] and {"N", "grpo_over_trloo_grad_ratio", "lazy_share_with_pr_prs", "lazy_share_without"} <= set(data)
