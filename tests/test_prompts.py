from drkernel import prompts as P
from drkernel.tasks import load_bundled


def test_extract_last_block_with_modelnew():
    text = ("Plan first.\n```python\nclass ModelNew: pass  # v1\n```\nthen\n"
            "```python\nclass ModelNew: pass  # v2\n```\nand a helper\n```python\nprint('no')\n```\n")
    assert "v2" in P.extract_code(text)


def test_extract_variants():
    assert "ModelNew" in P.extract_code("```py\nclass ModelNew: x = 1\n```")
    assert "ModelNew" in P.extract_code("```\nclass ModelNew: x = 1\n```")
    assert P.extract_code("```python\r\nclass ModelNew:\r\n    pass\r\n```\r\n") == "class ModelNew:\n    pass\n"
    # unterminated final fence
    code = P.extract_code("done:\n```python\nclass ModelNew:\n    pass\n")
    assert code.startswith("class ModelNew")
    # a non-python language tag is not code for us
    assert P.extract_code("```bash\necho ModelNew\n```") is None
    assert P.extract_code("```python\nclass Model: pass\n```") is None
    assert P.extract_code("no code here, just ModelNew in prose") is None
    assert P.extract_code("") is None


def test_format_error_result():
    r = P.format_error_result()
    assert r["verdict"] == "format_error" and r["compiled"] is False and r["correct"] is False
    assert "ModelNew" in r["error"]


def test_first_turn_messages_contain_task():
    task = load_bundled()[0]
    msgs = P.first_turn_messages(task)
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert task.code.strip() in msgs[1]["content"]
    assert "@triton.jit" in msgs[1]["content"] and "ModelNew" in P.SYSTEM_PROMPT


def _assert_no_reward_leak(text):
    low = text.lower()
    for bad in ("reward", "0.5·", "0.5*", "weight", "penalty", "score"):
        assert bad not in low, bad


def test_feedback_failure_and_success():
    tb = "Traceback (most recent call last):\n" + "".join(f"  line {i}\n" for i in range(50)) + \
         "ValueError: shapes do not match"
    msg = P.feedback_message({"verdict": "runtime_error", "error": tb, "reward": 0.0}, turn=1)
    assert "runtime_error" in msg and "shapes do not match" in msg and "line 2\n" not in msg
    assert "Fix" in msg
    _assert_no_reward_leak(msg)

    msg = P.feedback_message({"verdict": "incorrect", "max_abs_err": 0.25, "max_rel_err": 3.0,
                              "error": "mismatch"}, turn=2)
    assert "incorrect" in msg and "0.25" in msg and "3" in msg

    res = {"verdict": "correct", "correct": True, "compiled": True, "speedup": 1.37, "ref_ms": 0.5,
           "candidate_ms": 0.365, "triton_time_share": 0.8, "reward": 1.87,
           "kernels": [{"name": "add_kernel", "kind": "triton", "calls": 3, "total_ms": 0.2, "share": 0.8},
                       {"name": "aten::copy_", "kind": "torch", "calls": 1, "total_ms": 0.05, "share": 0.2}],
           "hacks": []}
    msg = P.feedback_message(res, turn=1)
    assert "correct" in msg and "1.37" in msg and "add_kernel" in msg and "80%" in msg
    assert "faster" in msg
    assert msg.index("add_kernel") < msg.index("aten::copy_")
    _assert_no_reward_leak(msg)

    msg = P.feedback_message({"verdict": "hacked", "hacks": ["no_triton_kernel", {"code": "odd", "detail": "x"}],
                              "error": "detected"}, turn=1)
    assert "no_triton_kernel" in msg and "launch your" in msg and "odd" in msg
    _assert_no_reward_leak(msg)


def test_render_prompt_ends_with_generation_prompt(tiny_tokenizer):
    text = P.render_prompt([{"role": "user", "content": "hi"}], tiny_tokenizer)
    assert text.endswith("<|im_start|>assistant\n")


def test_truncate_history(tiny_tokenizer):
    task = load_bundled()[0]
    head = P.first_turn_messages(task)
    base = P.count_prompt_tokens(head, tiny_tokenizer)
    msgs = list(head)
    for i in range(4):
        msgs += [{"role": "assistant", "content": f"attempt {i} " + "x = x + 1\n" * 40},
                 {"role": "user", "content": f"feedback {i}: verdict incorrect"}]
    full = P.count_prompt_tokens(msgs, tiny_tokenizer)
    assert P.truncate_history(msgs, tiny_tokenizer, full + 10) == msgs

    one_pair = P.count_prompt_tokens(head + msgs[-2:], tiny_tokenizer)
    limit = one_pair + 20
    out = P.truncate_history(msgs, tiny_tokenizer, limit)
    assert out[:2] == head and out[-1]["content"] == "feedback 3: verdict incorrect"
    assert "feedback 0" not in str(out)
    assert P.count_prompt_tokens(out, tiny_tokenizer) <= limit

    # even the latest pair is too long: its assistant content is cut in the middle
    limit = base + 80
    out = P.truncate_history(msgs, tiny_tokenizer, limit)
    assert out[:2] == head and len(out) == 4
    assert P.TRUNCATION_MARKER.strip() in out[2]["content"] and out[2]["content"].startswith("attempt 3")
    assert out[3]["content"] == "feedback 3: verdict incorrect"
    assert P.count_prompt_tokens(out, tiny_tokenizer) <= limit
