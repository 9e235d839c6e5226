"""Monte-Carlo checks that the advantages give the right policy gradient, and that the loss learns.

Toy multi-turn environment: 3 actions per turn, T = 3 turns, deterministic transitions
(state = previous action), a tabular softmax policy per (turn, state), and a reward per turn
r_t = R_t[s_t, a_t]. The exact gradient of J = E[sum_t r_t] comes from autograd on the
enumerated expectation over all 27 action sequences; the estimates come from sampling
20000 groups at once with analytic per-sample scores d log softmax(theta)[a] = onehot(a) - softmax(theta).
"""

import itertools

import pytest
import torch

from drkernel.advantages import compute_advantages
from drkernel.loss import LossConfig, policy_loss

A = 3  # actions per turn
DT = torch.float64


def make_env(turns: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rewards = [torch.rand(1, A, generator=g, dtype=DT)] + [torch.rand(A, A, generator=g, dtype=DT)
                                                          for _ in range(turns - 1)]
    thetas = [0.5 * torch.randn(1, A, generator=g, dtype=DT)] + [0.5 * torch.randn(A, A, generator=g, dtype=DT)
                                                               for _ in range(turns - 1)]
    return rewards, thetas  # row 0 of turn 0 is the single start state


def exact_objective(thetas, rewards, stop_action=None):
    """J = sum over all action sequences of prob * return; after `stop_action` at turn 0 the episode ends."""
    turns = len(thetas)
    probs = [torch.softmax(th, dim=-1) for th in thetas]
    total = torch.zeros((), dtype=DT)
    for seq in itertools.product(range(A), repeat=turns):
        p, ret, state = torch.ones((), dtype=DT), torch.zeros((), dtype=DT), 0
        for t, a in enumerate(seq):
            p = p * probs[t][state, a]
            if t == 0 or stop_action is None or seq[0] != stop_action:
                ret = ret + rewards[t][state, a]
            state = a
        total = total + p * ret
    return total


def sequence_return(seq, rewards, stop_action=None) -> float:
    """Return of one action sequence; with deterministic transitions the best one is optimal."""
    ret, state = 0.0, 0
    for t, a in enumerate(seq):
        if t == 0 or stop_action is None or seq[0] != stop_action:
            ret += float(rewards[t][state, a])
        state = a
    return ret


def exact_gradient(thetas, rewards):
    params = [th.clone().requires_grad_() for th in thetas]
    grads = torch.autograd.grad(exact_objective(params, rewards), params)
    return torch.cat([g.flatten() for g in grads])


def sample(thetas, rewards, num, gen):
    """Actions [M, T], per-turn rewards [M, T] and per-sample score vectors [M, T, P] (P = #params)."""
    turns = len(thetas)
    sizes = [th.numel() for th in thetas]
    offsets = [sum(sizes[:t]) for t in range(turns)]
    actions = torch.zeros(num, turns, dtype=torch.long)
    r = torch.zeros(num, turns, dtype=DT)
    scores = torch.zeros(num, turns, sum(sizes), dtype=DT)
    state = torch.zeros(num, dtype=torch.long)
    rows = torch.arange(num)
    for t, th in enumerate(thetas):
        p = torch.softmax(th, dim=-1)[state]  # [M, A]
        a = torch.multinomial(p, 1, generator=gen).squeeze(1)
        actions[:, t], r[:, t] = a, rewards[t][state, a]
        score = torch.nn.functional.one_hot(a, A).to(DT) - p  # d log pi(a|s) / d theta_t[s, :]
        cols = offsets[t] + state[:, None] * A + torch.arange(A)
        scores[rows[:, None], t, cols] = score
        state = a
    return actions, r, scores


def gradient_estimate(thetas, rewards, estimator, groups, n, seed=0):
    """Mean and standard error of sum_t A(i,t) * score(i,t), with groups as the iid unit."""
    gen = torch.Generator().manual_seed(seed)
    _, r, scores = sample(thetas, rewards, groups * n, gen)
    ids = torch.arange(groups).repeat_interleave(n)
    adv = compute_advantages(r, torch.ones_like(r, dtype=torch.bool), ids, estimator)
    per_sample = (adv[:, :, None] * scores).sum(1)  # [M, P]
    per_group = per_sample.view(groups, n, -1).mean(1)
    return per_group.mean(0), per_group.std(0) / groups ** 0.5, adv


GROUPS, N = 20000, 4


@pytest.fixture(scope="module")
def env3():
    rewards, thetas = make_env(turns=3)
    return rewards, thetas, exact_gradient(thetas, rewards)


def test_trloo_is_unbiased(env3):
    rewards, thetas, exact = env3
    mean, se, _ = gradient_estimate(thetas, rewards, "trloo", GROUPS, N)
    z = (mean - exact) / se
    assert z.abs().max() < 3.0, z


def test_grpo_is_shrunk_by_one_minus_one_over_n(env3):
    rewards, thetas, exact = env3
    mean, se, _ = gradient_estimate(thetas, rewards, "grpo", GROUPS, N)
    z_shrunk = (mean - (1 - 1 / N) * exact) / se
    assert z_shrunk.abs().max() < 3.0, z_shrunk
    # and the test has power: the GRPO estimate is clearly not the exact gradient
    z_exact = (mean - exact) / se
    assert z_exact.abs().max() > 6.0, z_exact


def test_single_turn_trloo_equals_rloo_and_is_unbiased():
    rewards, thetas = make_env(turns=1, seed=1)
    exact = exact_gradient(thetas, rewards)
    mean_t, se_t, adv_t = gradient_estimate(thetas, rewards, "trloo", GROUPS, N, seed=3)
    mean_r, _, adv_r = gradient_estimate(thetas, rewards, "rloo", GROUPS, N, seed=3)
    torch.testing.assert_close(adv_t, adv_r)
    torch.testing.assert_close(mean_t, mean_r)
    assert ((mean_t - exact) / se_t).abs().max() < 3.0


def test_ppo_loss_with_adamw_raises_expected_reward():
    """Tabular policy, ragged episodes (action 2 at turn 0 ends the episode), TRLOO + PPO epochs."""
    torch.manual_seed(0)
    rewards, thetas = make_env(turns=3, seed=2)
    stop = 2
    params = [torch.nn.Parameter(torch.zeros_like(th)) for th in thetas]
    opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.0)
    cfg = LossConfig()  # paper default: seq-mean-token-sum / 1000, clip-higher, dual-clip
    gen = torch.Generator().manual_seed(0)
    groups, n, turns = 64, 4, len(thetas)
    ids = torch.arange(groups).repeat_interleave(n)

    def logp_of(actions):
        """log pi(a_t | s_t) for every (trajectory, turn): [M, T]."""
        out, state = [], torch.zeros(actions.shape[0], dtype=torch.long)
        for t, th in enumerate(params):
            out.append(torch.log_softmax(th, dim=-1)[state].gather(1, actions[:, t:t + 1]).squeeze(1))
            state = actions[:, t]
        return torch.stack(out, dim=1)

    with torch.no_grad():
        start = exact_objective(params, rewards, stop_action=stop).item()
    for _ in range(30):
        with torch.no_grad():
            actions, r, _ = sample([p.detach() for p in params], rewards, groups * n, gen)
            turn_mask = torch.ones_like(r, dtype=torch.bool)
            turn_mask[actions[:, 0] == stop, 1:] = False
            adv = compute_advantages(r, turn_mask, ids, "trloo")
            old = logp_of(actions)
        for _ in range(4):  # PPO epochs on the same batch; every turn is a one-token sample
            loss, _ = policy_loss(logp_of(actions).reshape(-1, 1), old.reshape(-1, 1), adv.reshape(-1),
                                  turn_mask.reshape(-1, 1), cfg)
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        end = exact_objective(params, rewards, stop_action=stop).item()
        best = max(sequence_return(seq, rewards, stop) for seq in itertools.product(range(A), repeat=turns))
    print(f"expected reward {start:.3f} -> {end:.3f} (optimum {best:.3f})")
    assert end - start > 0.5 * (best - start), (start, end, best)
