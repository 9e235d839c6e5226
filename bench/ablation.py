"""A laptop-size study of three Dr. Kernel claims, trained with this project's own RL code.

    python bench/ablation.py --quick --json OUT.json     # about a minute on 2 CPU cores
    python bench/ablation.py --json bench/results/ablation_cpu.json --plots docs/img

The environment simulates multi-turn kernel writing. Each turn the policy picks one action:
`fast` (an honest Triton kernel: often wrong, high Triton share), `lazy` (correct through a
torch/cuBLAS call with a decoy-sized Triton launch: usually correct, fast, low Triton share),
`wrong` (fails the correctness check) or `hack` (caught by the evaluator). Each action draws
an outcome from a small table (verdict, speedup, Triton share), turned into an `EvalResult`
and scored by `drkernel.rewards` exactly as the evaluator's results are. The policy is a
tabular softmax over (turn, outcome of the previous turn) — small enough that its expected
reward and exact policy gradient come from dynamic programming — trained by the trainer's
own code: `trainer.update_samples` (void turns, PRS, TRLOO advantages), `mismatch_correction`
and `policy_loss`.

(a) gradients: GRPO's and TRLOO's measured policy gradients (`compute_advantages` +
    `policy_loss` + autograd over many groups) projected on the exact gradient, for several
    group sizes N: TRLOO ~ 1, GRPO ~ 1 - 1/N (`grpo_over_trloo_grad_ratio` on the same rollouts);
(b) lazy share: the share of correct turns that are lazy, trained with profiling reward + PRS
    and without them (a lazy kernel earns more reward than an honest one, so only PRS stops it);
(c) mismatch: half of the groups are sampled by a drifted rollout engine (a stale replica that
    over-samples `lazy`, logit +3) which reports its own log-probs; training with and without
    the mismatch correction, and the expected update direction (many batches at one policy)
    against the update the trainer would make from on-policy rollouts.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import platform
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.entry import check_outputs, exit_status  # noqa: E402
from bench.jsonfile import save_json  # noqa: E402
from drkernel.advantages import compute_advantages  # noqa: E402
from drkernel.evaluator import EvalResult  # noqa: E402
from drkernel.loss import LossConfig, policy_loss  # noqa: E402
from drkernel.mismatch import mismatch_correction  # noqa: E402
from drkernel.rewards import RewardConfig, compute_reward  # noqa: E402
from drkernel.rollout import TurnSample  # noqa: E402
from drkernel.trainer import TrainConfig, update_samples  # noqa: E402

DT = torch.float64
ACTIONS = ("fast", "lazy", "wrong", "hack")
LAZY = ACTIONS.index("lazy")
STATES = ("start", "failed", "correct")  # the outcome of the previous turn
# per action: (probability, verdict, speedup, Triton share)
OUTCOMES = {
    "fast": [(0.25, "correct", 1.8, 0.95), (0.30, "correct", 1.2, 0.90), (0.45, "incorrect", None, None)],
    "lazy": [(0.50, "correct", 1.5, 0.05), (0.40, "correct", 1.3, 0.15), (0.10, "incorrect", None, None)],
    "wrong": [(1.0, "incorrect", None, None)],
    "hack": [(1.0, "hacked", None, None)],
}
TURNS = 3


@dataclasses.dataclass
class Env:
    """The outcome tables as tensors, with each outcome's reward under one RewardConfig."""

    prob: torch.Tensor  # [A, K] outcome probabilities (0 where an action has fewer outcomes)
    reward: torch.Tensor  # [A, K]
    correct: torch.Tensor  # [A, K] bool
    results: list[list[EvalResult]]  # [A][K]


def result_of(verdict: str, speedup: float | None, share: float | None) -> EvalResult:
    hacks = ["decoy_kernel"] if verdict == "hacked" else []
    return EvalResult(verdict=verdict, compiled=verdict != "hacked", correct=verdict == "correct", speedup=speedup,
                      triton_time_share=share, hacks=hacks)


def make_env(rcfg: RewardConfig) -> Env:
    k = max(len(v) for v in OUTCOMES.values())
    prob = torch.zeros(len(ACTIONS), k, dtype=DT)
    reward = torch.zeros_like(prob)
    correct = torch.zeros_like(prob, dtype=torch.bool)
    results: list[list[EvalResult]] = []
    for a, name in enumerate(ACTIONS):
        row = []
        for j, (p, verdict, speedup, share) in enumerate(OUTCOMES[name]):
            res = result_of(verdict, speedup, share)
            prob[a, j], reward[a, j], correct[a, j] = p, compute_reward(res, rcfg).reward, res.correct
            row.append(res)
        results.append(row)
    return Env(prob, reward, correct, results)


# --------------------------------------------------------------------------------------
# exact quantities by dynamic programming over (turn, state)
# --------------------------------------------------------------------------------------

def exact(theta: torch.Tensor, env: Env) -> dict[str, torch.Tensor]:
    """Expected return J and expected counts of correct / lazy-correct turns of the policy
    softmax(theta[t, s]) (differentiable in theta)."""
    pi = torch.softmax(theta, -1)  # [T, S, A]
    p_correct = (env.prob * env.correct).sum(-1)  # [A]
    r_mean = (env.prob * env.reward).sum(-1)  # [A]
    d = torch.zeros(len(STATES), dtype=DT)
    d[0] = 1.0
    j = correct = lazy = torch.zeros((), dtype=DT)
    for t in range(TURNS):
        pa = d[:, None] * pi[t]  # [S, A] probability of (state, action) at turn t
        j = j + (pa * r_mean).sum()
        correct = correct + (pa * p_correct).sum()
        lazy = lazy + pa[:, LAZY].sum() * p_correct[LAZY]
        ok = (pa * p_correct).sum()
        d = torch.stack([torch.zeros((), dtype=DT), pa.sum() - ok, ok])
    return {"J": j, "correct": correct, "lazy": lazy}


def lazy_share(theta: torch.Tensor, env: Env) -> float:
    with torch.no_grad():
        e = exact(theta, env)
    return float(e["lazy"] / e["correct"])


def exact_gradient(theta: torch.Tensor, env: Env) -> torch.Tensor:
    th = theta.detach().clone().requires_grad_()
    (g,) = torch.autograd.grad(exact(th, env)["J"], th)
    return g


# --------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class Rollouts:
    states: torch.Tensor  # [M, T]
    actions: torch.Tensor  # [M, T]
    outcomes: torch.Tensor  # [M, T] index into the action's outcome table
    rewards: torch.Tensor  # [M, T]
    rollout_logp: torch.Tensor  # [M, T] log-prob reported by the engine that sampled the action


def sample(theta: torch.Tensor, env: Env, m: int, gen: torch.Generator,
           drift: torch.Tensor | None = None) -> Rollouts:
    """M trajectories; `drift` [M, A] is added to the logits of the engine that samples each one."""
    states = torch.zeros(m, TURNS, dtype=torch.long)
    actions, outcomes = torch.zeros_like(states), torch.zeros_like(states)
    rewards, logp = torch.zeros(m, TURNS, dtype=DT), torch.zeros(m, TURNS, dtype=DT)
    s = torch.zeros(m, dtype=torch.long)
    rows = torch.arange(m)
    with torch.no_grad():
        for t in range(TURNS):
            logits = theta[t, s]
            if drift is not None:
                logits = logits + drift
            lp = torch.log_softmax(logits, -1)
            a = torch.multinomial(lp.exp(), 1, generator=gen).squeeze(1)
            o = torch.multinomial(env.prob[a], 1, generator=gen).squeeze(1)
            states[:, t], actions[:, t], outcomes[:, t] = s, a, o
            rewards[:, t], logp[:, t] = env.reward[a, o], lp[rows, a]
            s = torch.where(env.correct[a, o], 2, 1)
    return Rollouts(states, actions, outcomes, rewards, logp)


# --------------------------------------------------------------------------------------
# (a) GRPO vs TRLOO vs the exact gradient
# --------------------------------------------------------------------------------------

def measured_gradient(theta: torch.Tensor, ro: Rollouts, groups: int, n: int, estimator: str) -> torch.Tensor:
    """The mean per-trajectory policy gradient of the PPO loss (first iteration: ratio 1)."""
    adv = compute_advantages(ro.rewards, torch.ones_like(ro.rewards, dtype=torch.bool),
                             torch.arange(groups).repeat_interleave(n), estimator)
    th = theta.detach().clone().requires_grad_()
    logp = torch.log_softmax(th, -1)[torch.arange(TURNS), ro.states, ro.actions].reshape(-1, 1)
    loss, _ = policy_loss(logp, logp.detach(), adv.reshape(-1), torch.ones_like(logp, dtype=torch.bool),
                          LossConfig(loss_type="seq-mean-token-sum"))
    (g,) = torch.autograd.grad(loss, th)
    return -g * TURNS  # the loss is a mean over M*T turns: -TURNS x its gradient is the per-trajectory mean


def gradient_study(n_values: list[int], trajectories: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    theta = 0.7 * torch.randn(TURNS, len(STATES), len(ACTIONS), generator=gen, dtype=DT)
    env = make_env(RewardConfig())
    true = exact_gradient(theta, env)
    out = []
    for n in n_values:
        groups = trajectories // n
        ro = sample(theta, env, groups * n, gen)
        g = {est: measured_gradient(theta, ro, groups, n, est) for est in ("trloo", "grpo")}
        proj = {est: float((v * true).sum() / (true * true).sum()) for est, v in g.items()}
        out.append({"N": n, "groups": groups, "one_minus_one_over_n": 1 - 1 / n,
                    "grpo_over_trloo_grad_ratio": float((g["grpo"] * g["trloo"]).sum() / (g["trloo"] ** 2).sum()),
                    "trloo_on_true": proj["trloo"], "grpo_on_true": proj["grpo"],
                    "trloo_cosine_to_true": float(torch.nn.functional.cosine_similarity(g["trloo"].flatten(),
                                                                                         true.flatten(), 0))})
    return out


# --------------------------------------------------------------------------------------
# (b), (c) training with the trainer's own turn decisions, mismatch correction and loss
# --------------------------------------------------------------------------------------

def turn_samples(ro: Rollouts, env: Env, n: int) -> list[list[TurnSample]]:
    """The rollouts as the trainer sees them: one TurnSample per turn, its result an EvalResult."""
    trajectories = []
    for b in range(ro.actions.shape[0]):
        traj = []
        for t in range(TURNS):
            a, o = int(ro.actions[b, t]), int(ro.outcomes[b, t])
            res = dataclasses.replace(env.results[a][o], reward=float(ro.rewards[b, t]))
            traj.append(TurnSample(task_key=str(b // n), group_id=b // n, traj_id=b, turn=t + 1, prompt_ids=[0],
                                   response_ids=[a], rollout_logprobs=[float(ro.rollout_logp[b, t])],
                                   response_text=ACTIONS[a], code=None, result=res, reward=float(ro.rewards[b, t])))
        trajectories.append(traj)
    return trajectories


def update_gradient(theta: torch.Tensor, ro: Rollouts, env: Env, cfg: TrainConfig, n: int,
                    rng: random.Random) -> tuple[torch.Tensor, dict]:
    """The gradient of one policy update, as `trainer.policy_update` computes it: turn flags and
    advantages, mismatch correction over the turns of the baseline, PPO loss over the turns kept,
    divided by every turn of the batch (`loss_denominator="batch"`)."""
    samples, flags = update_samples(turn_samples(ro, env, n), cfg, rng)
    th = theta.detach().clone().requires_grad_()
    logp = torch.log_softmax(th, -1)[torch.arange(TURNS), ro.states, ro.actions].reshape(-1, 1)
    in_baseline = torch.tensor([f.in_baseline for f in flags])[:, None]
    trajectory = torch.tensor([s.trajectory for s in samples])
    weights, keep, mm = mismatch_correction(logp.detach(), ro.rollout_logp.reshape(-1, 1), in_baseline,
                                            cfg.mismatch_config(), trajectory)
    mask = torch.tensor([f.in_loss for f in flags])[:, None] & keep
    adv = torch.tensor([s.advantage for s in samples], dtype=DT)
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, cfg.loss_config(), is_weights=weights)
    loss = loss * (mask.any(-1).sum() / len(samples))  # aggregate's mean over kept turns -> over all turns
    (g,) = torch.autograd.grad(loss, th)
    return g, {"reject_rate": mm["reject_rate"], "in_loss": float(mask.float().mean())}


def train(cfg: TrainConfig, steps: int, groups: int, n: int, lr: float, seed: int, drift_rows: float = 0.0,
          drift: float = 0.0, reference_groups: int = 0) -> list[dict]:
    """Adam on the tabular policy; per step the exact expected return and lazy share, and with
    `reference_groups` the cosine between the update and the on-policy update (a large batch)."""
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    env = make_env(cfg.reward_config())
    theta = torch.zeros(TURNS, len(STATES), len(ACTIONS), dtype=DT, requires_grad=True)
    opt = torch.optim.Adam([theta], lr=lr)
    bias = torch.zeros(groups * n, len(ACTIONS), dtype=DT)
    bias[: int(drift_rows * groups) * n, LAZY] = drift  # whole groups come from the drifted engine
    history = []
    for step in range(steps):
        ro = sample(theta, env, groups * n, gen, bias)
        g, info = update_gradient(theta, ro, env, cfg, n, rng)
        row = {"step": step, "J": float(exact(theta.detach(), env)["J"]), "lazy_share": lazy_share(theta, env), **info}
        if reference_groups:
            ref = sample(theta, env, reference_groups * n, gen)
            g_ref, _ = update_gradient(theta, ref, env, cfg, n, rng)
            row["cosine_to_on_policy"] = float(torch.nn.functional.cosine_similarity(g.flatten(), g_ref.flatten(), 0))
        history.append(row)
        opt.zero_grad()
        theta.grad = g
        opt.step()
    history.append({"step": steps, "J": float(exact(theta.detach(), env)["J"]), "lazy_share": lazy_share(theta, env)})
    return history


def recipe(**kw) -> TrainConfig:
    """The released recipe's RL settings (TRLOO, void turns, PR + PRS, geometric trajectory
    rejection and token veto, no IS weights, constant denominator)."""
    return TrainConfig(**kw)


def lazy_study(steps: int, groups: int, n: int, seeds: list[int]) -> dict:
    with_pr = [train(recipe(), steps, groups, n, 0.1, s) for s in seeds]
    without = [train(recipe(prs=False, profile_weight=0.0), steps, groups, n, 0.1, s) for s in seeds]
    return {"with_pr_prs": with_pr, "without": without,
            "lazy_share_start": with_pr[0][0]["lazy_share"],
            "lazy_share_with_pr_prs": sum(h[-1]["lazy_share"] for h in with_pr) / len(seeds),
            "lazy_share_without": sum(h[-1]["lazy_share"] for h in without) / len(seeds)}


def expected_update(theta: torch.Tensor, cfg: TrainConfig, groups: int, n: int, batches: int, seed: int,
                    drift: float = 0.0) -> torch.Tensor:
    """The update direction averaged over many batches at a fixed policy (batch noise averages out,
    a bias does not); with `drift`, half of the groups come from the drifted engine."""
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    env = make_env(cfg.reward_config())
    bias = torch.zeros(groups * n, len(ACTIONS), dtype=DT)
    bias[: groups // 2 * n, LAZY] = drift
    total = torch.zeros_like(theta)
    for _ in range(batches):
        total += update_gradient(theta, sample(theta, env, groups * n, gen, bias), env, cfg, n, rng)[0]
    return total / batches


def mismatch_study(steps: int, groups: int, n: int, seed: int, drift: float, batches: int) -> dict:
    kw = dict(steps=steps, groups=groups, n=n, lr=0.1, seed=seed, reference_groups=4 * groups)
    runs = {"on_policy": train(recipe(), **kw),
            "drift_corrected": train(recipe(), drift_rows=0.5, drift=drift, **kw),
            "drift_uncorrected": train(recipe(mismatch_correction=False), drift_rows=0.5, drift=drift, **kw)}
    summary = {name: {"final_J": h[-1]["J"],
                      "mean_cosine_to_on_policy": sum(r["cosine_to_on_policy"] for r in h[:-1]) / steps,
                      "mean_reject_rate": sum(r["reject_rate"] for r in h[:-1]) / steps}
               for name, h in runs.items()}
    theta = torch.zeros(TURNS, len(STATES), len(ACTIONS), dtype=DT)  # the initial (uniform) policy
    ref = expected_update(theta, recipe(), groups, n, batches, seed + 1)
    for name, cfg in (("drift_corrected", recipe()), ("drift_uncorrected", recipe(mismatch_correction=False))):
        g = expected_update(theta, cfg, groups, n, batches, seed + 2, drift)
        summary[name]["expected_update_cosine_to_on_policy"] = float(
            torch.nn.functional.cosine_similarity(g.flatten(), ref.flatten(), 0))
    noise = expected_update(theta, recipe(), groups, n, batches, seed + 3)  # a second on-policy estimate
    summary["on_policy"]["expected_update_cosine_to_on_policy"] = float(
        torch.nn.functional.cosine_similarity(noise.flatten(), ref.flatten(), 0))
    return {"runs": runs, "summary": summary, "drift_logit": drift, "drifted_share_of_groups": 0.5}


# --------------------------------------------------------------------------------------
# plots and the command line
# --------------------------------------------------------------------------------------

def plot(result: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    grad = result["gradients"]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ns = [r["N"] for r in grad]
    ax.plot(ns, [r["trloo_on_true"] for r in grad], "o-", label="TRLOO (measured)")
    ax.plot(ns, [r["grpo_on_true"] for r in grad], "s-", label="GRPO (measured)")
    ax.plot(ns, [1 - 1 / n for n in ns], "k--", label="1 - 1/N")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("group size N")
    ax.set_ylabel("gradient along the exact gradient")
    ax.legend()
    paths.append(_save(fig, out_dir / "ablation_grpo_vs_trloo.png"))

    fig, ax = plt.subplots(figsize=(5, 3.4))
    for key, label in (("with_pr_prs", "profiling reward + PRS"), ("without", "neither")):
        for i, h in enumerate(result["lazy"][key]):
            ax.plot([r["step"] for r in h], [r["lazy_share"] for r in h], color="C0" if key == "without" else "C1",
                    alpha=0.7, label=label if i == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("lazy share of correct turns")
    ax.legend()
    paths.append(_save(fig, out_dir / "ablation_lazy_share.png"))

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for name, h in result["mismatch"]["runs"].items():
        axes[0].plot([r["step"] for r in h], [r["J"] for r in h], label=name.replace("_", " "))
        axes[1].plot([r["step"] for r in h[:-1]], [r["cosine_to_on_policy"] for r in h[:-1]],
                     label=name.replace("_", " "))
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("expected return (exact)")
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("cosine(update, on-policy update)")
    axes[0].legend()
    paths.append(_save(fig, out_dir / "ablation_mismatch.png"))
    return paths


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return str(path)


def run(quick: bool, seed: int) -> dict:
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    if quick:
        n_values, trajectories, steps, groups, n, seeds, mm_steps, batches = [2, 4, 8], 48000, 40, 16, 8, [seed], 25, 40
    else:
        n_values, trajectories, steps, groups, n, seeds, mm_steps, batches = [2, 3, 4, 8, 16], 192000, 80, 16, 8, \
            [seed, seed + 1, seed + 2], 60, 200
    grads = gradient_study(n_values, trajectories, seed)
    lazy = lazy_study(steps, groups, n, seeds)
    mm = mismatch_study(mm_steps, groups, n, seed, drift=3.0, batches=batches)
    main = next(r for r in grads if r["N"] == 4)
    return {"N": main["N"], "grpo_over_trloo_grad_ratio": main["grpo_over_trloo_grad_ratio"],
            "grpo_on_true_gradient": main["grpo_on_true"], "trloo_on_true_gradient": main["trloo_on_true"],
            "lazy_share_start": lazy["lazy_share_start"], "lazy_share_with_pr_prs": lazy["lazy_share_with_pr_prs"],
            "lazy_share_without": lazy["lazy_share_without"], "mismatch": mm["summary"],
            "gradients": grads, "lazy": lazy, "mismatch_runs": mm, "quick": quick, "seed": seed,
            "wall_s": round(time.perf_counter() - t0, 1),
            "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s), "
                       f"torch {torch.__version__}"}


def print_table(result: dict) -> None:
    """The three claims' headline numbers, then the mismatch study's runs."""
    n = result["N"]
    rows = [(f"(a) GRPO / TRLOO gradient, N={n} (1 - 1/N = {1 - 1 / n:.3f})", result["grpo_over_trloo_grad_ratio"]),
            ("(a) GRPO's gradient on the exact one", result["grpo_on_true_gradient"]),
            ("(a) TRLOO's gradient on the exact one", result["trloo_on_true_gradient"]),
            ("(b) lazy share of correct turns, start", result["lazy_share_start"]),
            ("(b) lazy share, trained with profiling reward + PRS", result["lazy_share_with_pr_prs"]),
            ("(b) lazy share, trained without", result["lazy_share_without"])]
    for name, value in rows:
        print(f"{name:58s} {value:8.3f}")
    print(f"\n{'(c) mismatch run':24s} {'final J':>8s} {'cos to on-policy':>17s} {'expected update cos':>20s} "
          f"{'reject rate':>12s}")
    for name, m in result["mismatch"].items():
        print(f"{name:24s} {m['final_J']:8.3f} {m['mean_cosine_to_on_policy']:17.3f} "
              f"{m['expected_update_cosine_to_on_policy']:20.3f} {m['mean_reject_rate']:12.3f}")
    print(f"wall {result['wall_s']} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer group sizes, steps and seeds (about a minute)")
    ap.add_argument("--json", type=Path, help="write the numbers here")
    ap.add_argument("--plots", type=Path, help="write the three plots into this folder")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    check_outputs(("--json", args.json, False), ("--plots", args.plots, True))
    result = run(args.quick, args.seed)
    if args.plots:
        result["plots"] = plot({"gradients": result["gradients"], "lazy": result["lazy"],
                                "mismatch": result["mismatch_runs"]}, args.plots)
    if args.json:
        save_json(args.json, result)
    print_table(result)
    return 0 if math.isfinite(result["grpo_over_trloo_grad_ratio"]) else 1


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
