"""generate.py: tiny-model CLI runs, resume after a kill, the API policy against a local server,
STTS end to end with the real evaluator, and evaluate.py reading the output."""

import dataclasses
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import evaluate  # noqa: E402
import generate  # noqa: E402
from drkernel import api_policy, layouts  # noqa: E402
from drkernel.evaluator import EvalResult  # noqa: E402
from drkernel.generation import GenerationConfig  # noqa: E402
from drkernel.prompts import extract_code, feedback_message, first_turn_messages  # noqa: E402
from drkernel.tasks import bundled_solution, load_bundled  # noqa: E402

CODE_REPLY = "Sure.\n```python\nimport torch\nclass ModelNew(torch.nn.Module):\n    pass\n```\n"


class FakeEvaluator:
    """Correct at 1.5x with a 0.9 Triton share for any candidate; records what it saw."""

    def __init__(self):
        self.pairs = []
        self.closed = False

    def evaluate_many(self, pairs):
        pairs = list(pairs)
        self.pairs.extend(pairs)
        for ref, code in pairs:
            assert Path(ref).is_file() and "class Model" in Path(ref).read_text() and "ModelNew" in code
        return [EvalResult(verdict="correct", compiled=True, correct=True, speedup=1.5, ref_ms=1.5, candidate_ms=1.0,
                           triton_time_share=0.9, kernels=[], stdout="noise") for _ in pairs]

    def close(self):
        self.closed = True


@pytest.fixture
def fake_eval(monkeypatch):
    holder = {}

    def factory(cfg, device):
        holder["ev"] = FakeEvaluator()
        return holder["ev"]

    monkeypatch.setattr(generate, "make_evaluator", factory)
    return holder


def _lines(path):
    return Path(path).read_text().splitlines()


def _rows(path):
    return [json.loads(line) for line in _lines(path)]


def _tiny_args(model_dir, out, *extra, problem_ids="1", samples=2):
    return ["--model", str(model_dir), "--problem_ids", problem_ids, "--samples_per_task", str(samples), "--num_turns", "2",
            "--max_new_tokens", "6", "--max_prompt_tokens", "4000", "--device", "cpu", "--backend", "static",
            "--tasks_per_batch", "1", "--output", str(out), *extra]


def test_tiny_model_cli_writes_rows_that_evaluate_py_reads(tmp_path, tiny_model_dir, fake_eval, monkeypatch):
    out = tmp_path / "gen.jsonl"
    summary = generate.main(_tiny_args(tiny_model_dir, out))
    rows = _rows(out)
    assert len(rows) == 2 * 2  # samples x turns
    assert sorted((r["problem_id"], r["sample"], r["turn"]) for r in rows) == [
        (1, s, t) for s in (0, 1) for t in (0, 1)]
    for r in rows:
        assert r["level"] == 0 and r["task_key"] == f"0_{r['problem_id']}" and r["task"].startswith(f"{r['problem_id']}_")
        assert r["iteration"] == 0 and r["iter_turn"] == r["turn"] and r["num_turns"] == 2
        assert r["model"] == str(tiny_model_dir)
        assert isinstance(r["response"], str) and 1 <= r["response_tokens"] <= 6
        # six random tokens hold no ```python block: a format error that never reaches the evaluator
        assert r["code"] is None and r["verdict"] == "format_error" and r["correct"] is False
        assert r["reward"] == 0.0 and r["hacks"] == [] and r["error"]
        assert "triton_time_share" in r and "speedup" in r
    assert fake_eval["ev"].pairs == [] and fake_eval["ev"].closed
    assert summary["num_samples"] == 2 and summary["correct_rate"] == 0.0 and summary["num_turns"] == 2
    assert summary["verdict_counts"] == {"format_error": 2} and summary["generated_this_run"] == 2
    assert json.loads(generate.summary_path(out).read_text())["num_samples"] == 2

    # evaluate.py reads the generations: one candidate per row, no code -> format errors
    cands = layouts.load_generations(out)
    assert len(cands) == 4 and all(c["code"] is None for c in cands)
    monkeypatch.setattr(evaluate, "make_evaluator", lambda cfg, device: pytest.fail("nothing to evaluate"))
    s = evaluate.main(["--candidates", str(out), "--problem_ids", "1", "--samples", "2", "--device", "cpu",
                       "--output_dir", str(tmp_path / "eval")])
    assert s["num_samples"] == 2 and s["num_missing"] == 0 and s["num_turns"] == 2
    assert s["verdict_counts"] == {"format_error": 2}


def test_resume_after_kill_writes_only_missing_rows(tmp_path, tiny_model_dir, fake_eval, monkeypatch):
    import drkernel.rollout as rollout_mod

    out = tmp_path / "gen.jsonl"
    args = _tiny_args(tiny_model_dir, out, problem_ids="1,2", samples=1)
    generate.main(args)
    full = _lines(out)
    assert len(full) == 4
    # killed mid-write: task 1 is complete, task 2 has its turn 0 and a cut line
    out.write_text("\n".join(full[:3]) + "\n" + full[3][:25])

    calls = []
    real = rollout_mod.rollout

    def spy(model, tokenizer, tasks, *a, **kw):
        calls.append([t.key for t in tasks])
        return real(model, tokenizer, tasks, *a, **kw)

    monkeypatch.setattr(rollout_mod, "rollout", spy)
    summary = generate.main(args)
    assert calls == [["0_2"]]  # only the missing trajectory
    lines = _lines(out)
    assert lines[:2] == full[:2]  # finished rows are never rewritten
    assert len(lines) == 4 and len(layouts.load_generations(out)) == 4  # no duplicate (problem, sample, turn)
    assert summary["num_missing"] == 0 and summary["generated_this_run"] == 1

    calls.clear()
    again = generate.main(args)  # nothing left to do
    assert calls == [] and _lines(out) == lines and again["num_samples"] == 2

    turns_at = args.index("--num_turns") + 1
    with pytest.raises(SystemExit, match="num_turns"):  # another --num_turns would mix turn numbering
        generate.main(args[:turns_at] + ["3"] + args[turns_at + 1:])
    assert calls == [] and _lines(out) == lines


def test_bad_config_is_a_clear_error():
    for argv, msg in ((["--samples_per_task", "0"], "samples_per_task"),
                      (["--stts_window", "-1"], "stts_window"),
                      (["--api_base_url", "http://127.0.0.1:9/v1"], "api_model"),
                      (["--backend", "vllm"], "backend"),
                      (["--tasks", "/nonexistent/42_Nothing.py", "--device", "cpu"], "cannot load tasks")):
        with pytest.raises(SystemExit, match=msg):
            generate.main(argv)


# ----------------------------------------------------------------------------- API policy

class _Server:
    """A tiny OpenAI-style chat server on 127.0.0.1 (bounded: daemon thread, short timeouts)."""

    def __init__(self, reply):
        self.requests = []
        self.failures = []  # HTTP codes to answer first, one per request
        outer = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 10

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                if outer.failures:
                    self._send(outer.failures.pop(0), {"error": {"message": "scripted failure"}})
                    return
                text, reason = reply(body)
                self._send(200, {"id": "x", "object": "chat.completion", "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}]})

            def _send(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def server():
    def reply(body):  # code on the first turn, prose afterwards
        answered = sum(m["role"] == "assistant" for m in body["messages"])
        return (CODE_REPLY, "stop") if answered == 0 else ("I cannot improve it.", "length")

    s = _Server(reply)
    yield s
    s.close()


def test_api_policy_cli_runs_the_training_loop(tmp_path, server, fake_eval, monkeypatch):
    monkeypatch.setenv("DRK_TEST_API_KEY", "sekrit")
    out = tmp_path / "api.jsonl"
    args = ["--api_base_url", server.url, "--api_model", "tiny-api", "--api_key_env", "DRK_TEST_API_KEY",
            "--problem_ids", "1", "--samples_per_task", "2", "--num_turns", "2", "--max_new_tokens", "64",
            "--temperature", "0.7", "--device", "cpu", "--output", str(out)]
    summary = generate.main(args)
    task = load_bundled([1])[0]
    reqs = server.requests
    assert len(reqs) == 4 and all(r["path"] == "/v1/chat/completions" and r["auth"] == "Bearer sekrit" for r in reqs)
    assert all(r["body"]["model"] == "tiny-api" and r["body"]["max_tokens"] == 64 and r["body"]["temperature"] == 0.7
               for r in reqs)
    first, second = reqs[:2], reqs[2:]
    assert all(r["body"]["messages"] == first_turn_messages(task) for r in first)
    # a distinct seed per request: two samples share a prompt, and a repeated seed would replay draws
    assert len({r["body"]["seed"] for r in reqs}) == 4
    fake_result = FakeEvaluator().evaluate_many([(str(task.write(tmp_path)), CODE_REPLY)])[0]
    for r in second:  # the same history and feedback as training
        msgs = r["body"]["messages"]
        assert msgs[:2] == first_turn_messages(task) and msgs[2] == {"role": "assistant", "content": CODE_REPLY}
        assert msgs[3] == {"role": "user", "content": feedback_message(fake_result.to_dict(), 1)}

    rows = sorted(_rows(out), key=lambda r: (r["sample"], r["turn"]))
    assert [(r["sample"], r["turn"], r["verdict"]) for r in rows] == [
        (0, 0, "correct"), (0, 1, "format_error"), (1, 0, "correct"), (1, 1, "format_error")]
    assert rows[0]["code"] == extract_code(CODE_REPLY) and rows[0]["response"] == CODE_REPLY
    assert rows[0]["reward"] == pytest.approx(0.5 + 0.5 * 1.5 + 0.5 * 0.9) and rows[1]["reward"] == 0.0
    assert rows[0]["finished"] is True and rows[1]["finished"] is False  # finish_reason "length"
    assert rows[0]["model"] == "api:tiny-api" and rows[0]["response_tokens"] is None
    assert len(fake_eval["ev"].pairs) == 2
    assert summary["correct_rate"] == 1.0 and summary["per_turn"][1]["correct_rate"] == 0.0

    cands = layouts.load_generations(out)  # evaluate.py's reader
    assert sorted((c["sample"], c["turn"], c["code"] is None) for c in cands) == [
        (0, 0, False), (0, 1, True), (1, 0, False), (1, 1, True)]

    again = generate.main(args)  # complete: no request
    assert len(server.requests) == 4 and again["generated_this_run"] == 0
    generate.main(args + ["--resume", "false"])  # a fresh start moves the old file aside
    assert len(server.requests) == 8 and len(_lines(out)) == 4
    assert len(list(tmp_path.glob("api.*.jsonl.bak"))) == 1


def test_api_client_retries_and_errors(server):
    cfg = api_policy.ApiConfig(base_url=server.url, model="m", api_key_env="", timeout=10, max_retries=2,
                               backoff_s=0.01)
    client = api_policy.OpenAIChatClient(cfg)
    gen = GenerationConfig(max_new_tokens=5, do_sample=False)
    msgs = [{"role": "user", "content": "hi"}]

    server.failures = [503, 429]  # retried, then answered
    c = client.complete(msgs, gen)
    assert c.text == CODE_REPLY and c.finished and c.error is None and len(server.requests) == 3
    assert server.requests[-1]["auth"] is None and server.requests[-1]["body"]["temperature"] == 0.0

    server.failures = [401]
    with pytest.raises(api_policy.ApiError, match="HTTP 401"):
        client.complete(msgs, gen)

    server.failures = [400]  # e.g. a prompt over the server's context: an empty reply, the run goes on
    generator = api_policy.ChatGenerator(client, concurrency=2)
    codec = api_policy.MessageCodec()
    prompt = codec(codec.apply_chat_template(msgs))["input_ids"]
    outs = generator(None, codec, [prompt], gen)
    assert outs[0].response_ids == [] and not outs[0].finished and "HTTP 400" in generator.errors[0]

    server.failures = [500, 500, 500]
    with pytest.raises(api_policy.ApiError, match="after 3 attempts"):
        client.complete(msgs, gen)
    with pytest.raises(api_policy.ApiError, match="http"):
        api_policy.OpenAIChatClient(api_policy.ApiConfig(base_url="localhost:8000", model="m"))


def test_message_codec_round_trips_conversations():
    codec = api_policy.MessageCodec()
    msgs = [{"role": "system", "content": "ünïcode ✓ \"quotes\"\n```python\nx = 1\n```"},
            {"role": "user", "content": "🚀 " * 3}]
    ids = codec(codec.apply_chat_template(msgs), add_special_tokens=False)["input_ids"]
    assert codec.messages(ids) == msgs and codec.decode(codec.encode("é🚀")) == "é🚀"
    assert api_policy.prompt_budget(1000, 4.0) == 4000


# ----------------------------------------------------------------------------- STTS end to end

class ScriptedPolicy:
    """Replies from a script, in order; remembers every conversation it was shown."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.seen = []

    def complete(self, messages, cfg, seed=None):
        self.seen.append(messages)
        return api_policy.Completion(self.replies.pop(0), True)


def _scripted_policy(scripted):
    codec = api_policy.MessageCodec()
    return generate.Policy("scripted", None, codec, api_policy.ChatGenerator(scripted, 1, codec),
                           api_policy.prompt_budget(8000), counts_tokens=False)


def test_stts_end_to_end_with_real_evaluator(tmp_path):
    from drkernel.evaluator import EvalConfig, Evaluator

    task = load_bundled([1])[0]
    good = "Here it is.\n```python\n" + bundled_solution(task).read_text() + "```\n"
    broken = "Try this.\n```python\nclass ModelNew(:\n    pass\n```\n"  # a syntax error
    # 2 rounds of 3 turns with a 1-turn window: round 1 keeps one turn and adds 3 - 1 = 2
    cfg = generate.GenerateConfig(output=str(tmp_path / "stts.jsonl"), samples_per_task=1, num_turns=3,
                                  stts_iterations=2, stts_window=1, device="cpu")
    # round 0: correct, broken, no code; round 1 (from the best 1-turn window = the correct
    # turn 0): no code, then correct again
    scripted = ScriptedPolicy([good, broken, "No code.", "I am not sure.", good])
    ref_dir = tmp_path / "refs"
    with Evaluator(EvalConfig(device="cpu", trials=1, perf_trials=2, timeout=120)) as ev:
        summary = generate.run(cfg, [task], _scripted_policy(scripted), generate.make_evaluate_fn(ev, ref_dir))
        rows = _rows(cfg.output)
        assert [(r["turn"], r["iteration"], r["iter_turn"], r["verdict"]) for r in rows] == [
            (0, 0, 0, "correct"), (1, 0, 1, "compile_error"), (2, 0, 2, "format_error"),
            (3, 1, 0, "format_error"), (4, 1, 1, "correct")]
        assert rows[0]["reward"] > 0 and rows[1]["reward"] == 0 == rows[3]["reward"]
        assert rows[0]["code"] == extract_code(good) and rows[0]["speedup"] > 0

        # round 1 starts from the task plus the best window (turn 0, not the latest turn 2)
        start = scripted.seen[3]
        assert start[:2] == first_turn_messages(task) and len(start) == 4
        assert start[2] == {"role": "assistant", "content": good}
        assert start[3]["content"] == feedback_message(rows[0], 1) and "verdict: correct" in start[3]["content"]
        # and continues as an ordinary conversation: its next feedback is numbered turn 2
        assert len(scripted.seen[4]) == 6 and scripted.seen[4][5]["content"].startswith("Evaluation of your answer (turn 2)")

        r0, r1 = summary["stts"]
        assert r0["last_turn"]["correct_rate"] == 0.0 and r0["best"]["correct_rate"] == 1.0
        assert r1["last_turn"]["correct_rate"] == 1.0 and r1["best_so_far"]["correct_rate"] == 1.0
        assert summary["num_turns"] == 5 and summary["correct_rate"] == 1.0
        assert summary["per_turn"][3]["correct_rate"] == 0.0

        # killed during round 1: its context is rebuilt from the saved round-0 rows
        lines = _lines(cfg.output)
        Path(cfg.output).write_text("\n".join(lines[:4]) + "\n" + lines[4][:40])
        again = ScriptedPolicy(["no code here", good])
        generate.run(cfg, [task], _scripted_policy(again), generate.make_evaluate_fn(ev, ref_dir))
        assert len(again.seen) == 2 and again.seen[0] == scripted.seen[3]
        assert _lines(cfg.output)[:3] == lines[:3] and len(_lines(cfg.output)) == 5
        assert [r["verdict"] for r in _rows(cfg.output)] == ["correct", "compile_error", "format_error",
                                                            "format_error", "correct"]
        # another STTS turn budget would renumber the turns: refused
        with pytest.raises(SystemExit, match="stts_window"):
            generate.run(dataclasses.replace(cfg, stts_window_counts=False), [task], _scripted_policy(again),
                         generate.make_evaluate_fn(ev, ref_dir))


class CountingPolicy:
    """Always answers with code; records how many earlier answers each request carried."""

    def __init__(self):
        self.earlier = []

    def complete(self, messages, cfg, seed=None):
        self.earlier.append(sum(m["role"] == "assistant" for m in messages))
        return api_policy.Completion(CODE_REPLY, True)


@pytest.mark.parametrize("extra, requests, most_earlier", [
    ([], 14, 4),  # KernelGYM: the window counts toward the 5 turns: 5 + 9 x 1 turns, contexts of <= 5 turns
    (["--stts_window_counts", "false"], 50, 8),  # every round adds 5 turns to a 4-turn window
])
def test_paper_stts_asks_for_14_turns_and_never_more_than_4_earlier_ones(tmp_path, fake_eval, monkeypatch,
                                                                       extra, requests, most_earlier):
    policy = CountingPolicy()
    monkeypatch.setattr(generate, "load_policy", lambda cfg, device: _scripted_policy(policy))
    summary = generate.main(["--stts_iterations", "10", "--num_turns", "5", "--stts_window", "4", "--problem_ids", "1",
                             "--device", "cpu", "--output", str(tmp_path / "stts.jsonl"), *extra])
    assert len(policy.earlier) == requests and max(policy.earlier) == most_earlier
    assert summary["num_turns"] == requests and len(_rows(tmp_path / "stts.jsonl")) == requests
