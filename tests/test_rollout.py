import pytest
import torch

from drkernel.evaluator import EvalResult
from drkernel.generation import GenerationConfig, GenOutput, generate
from drkernel.prompts import count_prompt_tokens, feedback_message, first_turn_messages, render_prompt
from drkernel.rewards import RewardConfig
from drkernel.rollout import RolloutConfig, rollout, rollout_stats, to_training_batch
from drkernel.tasks import load_bundled

CODE_REPLY = "Here it is.\n```python\nclass ModelNew(nn.Module):\n    pass\n```\n"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


class FakeEvaluator:
    """Correct with speedup 1.5 for any code (no reward filled in); records each call's batch."""

    def __init__(self):
        self.calls = []

    def __call__(self, pairs):
        self.calls.append(list(pairs))
        return [EvalResult(verdict="correct", compiled=True, correct=True, speedup=1.5, ref_ms=1.5, candidate_ms=1.0,
                           error="", triton_time_share=0.9,
                           kernels=[{"name": "my_kernel", "kind": "triton", "calls": 1, "total_ms": 0.9, "share": 0.9}])
                for _ in pairs]


def code_for_even_rows(tokenizer):
    """Real tiny-model generation, with even rows' responses replaced by a code answer."""
    code_ids = tokenizer(CODE_REPLY, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def gen(model, tok, prompts, cfg):
        outs = generate(model, tok, prompts, cfg)
        return [GenOutput(code_ids, [0.0] * len(code_ids), True) if i % 2 == 0 else o
                for i, o in enumerate(outs)]

    return gen


def _cfg(**kw):
    return RolloutConfig(num_generations=2, num_turns=2, max_prompt_tokens=8192,
                         generation=GenerationConfig(max_new_tokens=12, backend="static", seed=0), **kw)


def test_rollout_shapes_groups_history(model, tiny_tokenizer):
    tasks = load_bundled()[:2]
    ev = FakeEvaluator()
    # the caller's reward config scores every result: 1 + 0.5 * 1.5 + 0.25 * 0.9 when correct
    weights = RewardConfig(correct_weight=1.0, profile_weight=0.25, fail_reward=-1.0)
    trajs = rollout(model, tiny_tokenizer, tasks, ev, _cfg(reward=weights), generator=code_for_even_rows(tiny_tokenizer))
    assert len(trajs) == 4 and all(len(t) == 2 for t in trajs)
    assert [t[0].group_id for t in trajs] == [0, 0, 1, 1]
    assert [t[0].task_key for t in trajs] == [tasks[0].key] * 2 + [tasks[1].key] * 2
    assert [t[0].traj_id for t in trajs] == [0, 1, 2, 3]
    assert [s.turn for s in trajs[0]] == [1, 2]
    # the evaluator gets each turn's candidates in one call; no-code rows never reach it
    assert len(ev.calls) == 2 and all(len(c) == 2 for c in ev.calls)
    assert [task.key for task, _ in ev.calls[0]] == [tasks[0].key, tasks[1].key]
    for b, traj in enumerate(trajs):
        for s in traj:
            assert len(s.response_ids) == len(s.rollout_logprobs) > 0
            if b % 2 == 0:
                assert s.result.verdict == "correct" and s.reward == pytest.approx(1.975) and "ModelNew" in s.code
                assert s.result.reward_terms["profile_term"] == pytest.approx(0.225)
            else:
                assert s.code is None and s.result.verdict == "format_error" and s.reward == -1.0
        # history grows: turn 2's prompt holds turn 1's response and feedback
        t1, t2 = traj
        assert len(t2.prompt_ids) > len(t1.prompt_ids)
        prompt2 = tiny_tokenizer.decode(t2.prompt_ids)
        assert feedback_message(t1.result.to_dict(), 1) in prompt2
        assert t1.response_text in prompt2

    batch = to_training_batch(trajs)
    assert batch.rewards.shape == (4, 2) and batch.turn_mask.shape == (4, 2)
    assert batch.turn_mask.all() and batch.group_ids.tolist() == [0, 0, 1, 1]
    assert batch.rewards[0].tolist() == pytest.approx([1.975, 1.975]) and batch.rewards[1].tolist() == [-1.0, -1.0]
    assert len(batch.samples) == 8 and batch.index[3] == (1, 1)
    assert batch.samples[3] is trajs[1][1]

    stats = rollout_stats(trajs)
    assert stats["turn1/correct"] == 0.5 and stats["turn2/format_error"] == 0.5
    assert stats["all/speedup"] == 1.5 and stats["all/fast_1"] == 0.5
    assert abs(stats["all/triton_share"] - 0.9) < 1e-9


def test_rollout_plain_generation(model, tiny_tokenizer):
    """Tiny-model text has no code: every turn is a format error, scored with the fail reward,
    and the evaluator is idle."""
    tasks = load_bundled()[:1]
    ev = FakeEvaluator()
    cfg = _cfg(reward=RewardConfig(fail_reward=-0.25))
    cfg.num_turns = 1
    trajs = rollout(model, tiny_tokenizer, tasks, ev, cfg)
    assert len(trajs) == 2 and ev.calls == []
    assert all(s.result.verdict == "format_error" and s.reward == -0.25 for t in trajs for s in t)
    assert to_training_batch(trajs).rewards.tolist() == [[-0.25], [-0.25]]


def test_older_turns_leave_the_prompt_when_the_history_outgrows_it(tiny_tokenizer):
    """Turn 3's prompt keeps the task and the latest (answer, feedback) pair only."""
    task = load_bundled([1])[0]
    code_ids = tiny_tokenizer(CODE_REPLY, add_special_tokens=False)["input_ids"]
    prompts = []

    def scripted(model, tok, prompt_ids, gcfg):
        prompts.extend(tok.decode(p) for p in prompt_ids)
        return [GenOutput(code_ids, [0.0] * len(code_ids), True) for _ in prompt_ids]

    result = FakeEvaluator()([(task, "")])[0].to_dict()
    one_pair = first_turn_messages(task) + [{"role": "assistant", "content": CODE_REPLY},
                                            {"role": "user", "content": feedback_message(result, 1)}]
    budget = count_prompt_tokens(one_pair, tiny_tokenizer) + 8  # one pair fits, two do not
    cfg = RolloutConfig(num_generations=1, num_turns=3, max_prompt_tokens=budget)
    rollout(None, tiny_tokenizer, [task], FakeEvaluator(), cfg, generator=scripted)
    assert len(prompts) == 3
    assert "(turn 1)" in prompts[1] and render_prompt(first_turn_messages(task), tiny_tokenizer)[:200] in prompts[2]
    assert "(turn 2)" in prompts[2] and "(turn 1)" not in prompts[2]


def test_each_turn_samples_with_its_own_seed(model, tiny_tokenizer):
    """Turn 1 uses generation.seed, later turns a seed derived from (seed, turn): a repeated seed
    would replay turn 1's random draws. Same config, same seeds; seed None stays None."""
    from drkernel.rollout import turn_seed

    def recorder(seen):
        def gen(model, tok, prompts, cfg):
            seen.append(cfg.seed)
            return generate(model, tok, prompts, cfg)
        return gen

    tasks = load_bundled()[:1]
    cfg = _cfg()
    cfg.num_turns = 3
    runs = []
    for _ in range(2):
        seen = []
        trajs = rollout(model, tiny_tokenizer, tasks, FakeEvaluator(), cfg, generator=recorder(seen))
        runs.append((seen, [[s.response_ids for s in t] for t in trajs]))
    seen, responses = runs[0]
    assert seen == [0, turn_seed(0, 2), turn_seed(0, 3)] and len(set(seen)) == 3
    assert runs[1] == runs[0]  # reproducible
    assert cfg.generation.seed == 0  # the caller's config is not mutated
    unseeded = []
    cfg.generation.seed = None
    rollout(model, tiny_tokenizer, tasks, FakeEvaluator(), cfg, generator=recorder(unseeded))
    assert unseeded == [None, None, None]
