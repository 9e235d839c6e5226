"""generate.py: tiny-model CLI runs, resume after a kill or from a damaged file, bad options, the
API policy against a local server (retries, failed requests, fail-fast errors), STTS end to end
with the real evaluator, and evaluate.py reading the output."""

import dataclasses
import json
import signal
import subprocess
import sys
import threading
import time
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
    scan = layouts.scan_candidates(out)
    assert len(scan.candidates) == 4 and all(c.code is None for c in scan.candidates) and not scan.skipped
    monkeypatch.setattr(evaluate, "make_evaluator", lambda cfg, device: pytest.fail("nothing to evaluate"))
    s = evaluate.main(["--candidates", str(out), "--problem_ids", "1", "--samples", "2", "--device", "cpu",
                       "--output_dir", str(tmp_path / "eval")])
    assert s["num_samples"] == 2 and s["num_missing"] == 0 and s["num_turns"] == 2
    assert s["verdict_counts"] == {"format_error": 2}


def test_resume_after_kill_writes_only_missing_rows(tmp_path, tiny_model_dir, fake_eval, monkeypatch, capsys):
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
    capsys.readouterr()
    summary = generate.main(args)
    assert "skipped 1 unusable line(s) (a killed run leaves its last line cut): line 4: not a JSON object" in \
        capsys.readouterr().err
    assert calls == [["0_2"]]  # only the missing trajectory
    lines = _lines(out)
    assert lines[:2] == full[:2]  # finished rows are never rewritten
    scan = layouts.scan_candidates(out)
    assert len(lines) == len(scan.candidates) == 4 and not scan.skipped  # no duplicate (problem, sample, turn)
    assert summary["num_missing"] == 0 and summary["generated_this_run"] == 1

    calls.clear()
    again = generate.main(args)  # nothing left to do
    assert calls == [] and _lines(out) == lines and again["num_samples"] == 2

    turns_at = args.index("--num_turns") + 1
    # another --num_turns would mix turn numbering
    assert _usage_error(capsys, args[:turns_at] + ["3"] + args[turns_at + 1:]).endswith(
        f"{out} was written with --num_turns 2, not --num_turns 3 (row 1); pass another --output or --resume false")
    assert calls == [] and _lines(out) == lines


def _usage_error(capsys, argv, status=2) -> str:
    """Run generate.main(argv), expect exit `status` with one `generate.py: error:` line; return it."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        generate.main(argv)
    assert exc.value.code == status
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("generate.py: error: ")]
    assert len(errors) == 1
    return errors[0]


def test_bad_config_is_a_clear_error(capsys):
    for argv, msg in ((["--samples_per_task", "0"], "samples_per_task must be in [1, 1e+06]"),
                      (["--stts_window", "-1"], "stts_window must be >= 0"),
                      (["--api_base_url", "http://127.0.0.1:9/v1"], "--api_base_url needs --api_model"),
                      (["--api_base_url", "localhost:9", "--api_model", "m", "--device", "cpu"], "http://"),
                      (["--api_base_url", "http://127.0.0.1:9/v1", "--api_model", "m", "--model", "x", "--dtype",
                        "bf16"], "--model x, --dtype bf16 would be ignored: with --api_base_url the endpoint is the "
                                 "policy and no local model loads; drop one of them"),
                      (["--backend", "vllm"], "backend must be hf or static"),
                      (["--num_turns", "two"], "bad value for num_turns: 'two'"),
                      (["--api_timeout", "0"], "api_timeout must be > 0"),
                      (["--api_backoff_s", "nan"], "api_backoff_s must be a finite number >= 0"),
                      (["--device", "gpu"], "device must be auto, cpu, cuda or cuda:N"),
                      (["--no_such_option", "1"], "no_such_option"),
                      (["stray"], "unexpected argument 'stray'"),
                      (["--config", "/nonexistent/gen.yaml"], "/nonexistent/gen.yaml"),
                      (["--levels", "one", "--device", "cpu"], "levels must be a comma list of integers"),
                      (["--tasks", "/nonexistent/42_Nothing.py", "--device", "cpu"], "cannot load tasks")):
        assert msg in _usage_error(capsys, argv), argv


def test_unusable_output_paths_and_api_model_alone_stop_before_the_model_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(generate, "load_policy", lambda cfg, device: pytest.fail("the model must not load"))
    a_file = tmp_path / "file"
    a_file.write_text("x")
    (tmp_path / "g.summary.json").mkdir()
    (tmp_path / "h_report").write_text("x")
    ok = ["--output", str(tmp_path / "ok.jsonl")]
    for argv, msg in ((["--api_model", "m", *ok], "--api_model needs --api_base_url"),
                      (["--output", str(tmp_path / "g.jsonl")],
                       f"the summary of --output {tmp_path / 'g.summary.json'}: is a directory, not a file"),
                      (["--output", str(tmp_path / "h.jsonl")],
                       f"the report of --output {tmp_path / 'h_report'}: is a file, not a directory"),
                      (["--eval_cache_dir", str(a_file), *ok],
                       f"--eval_cache_dir {a_file}: is a file, not a directory"),
                      (["--output", "/proc/drk_none/g.jsonl"], "--output /proc/drk_none/g.jsonl: ")):
        assert msg in _usage_error(capsys, ["--problem_ids", "1", "--device", "cpu", *argv]), argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "g.summary.json", "h_report"]


def test_evaluator_settings_obey_evalconfigs_limits_before_the_model_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(generate, "load_policy", lambda cfg, device: pytest.fail("the model must not load"))
    out = ["--problem_ids", "1", "--device", "cpu", "--output", str(tmp_path / "g.jsonl")]
    for argv, msg in ((["--perf_trials", "200000"], "perf_trials must be in [1, 100000], got 200000"),
                      (["--trials", "1001"], "trials must be in [1, 1000], got 1001 (each trial is a full call")):
        assert msg in _usage_error(capsys, [*out, *argv]), argv


def test_a_report_file_of_the_wrong_kind_stops_the_run_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """The report is written after every generation: a path it cannot write is found first."""
    monkeypatch.setattr(generate, "load_policy", lambda cfg, device: pytest.fail("the model must not load"))
    (tmp_path / "g_report" / "report.md").mkdir(parents=True)
    assert _usage_error(capsys, ["--problem_ids", "1", "--device", "cpu", "--output", str(tmp_path / "g.jsonl")]) == (
        f"generate.py: error: the report of --output {tmp_path / 'g_report' / 'report.md'}: is a directory, not a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g_report"]


def test_ctrl_c_ends_the_script_with_one_line_and_status_130(tmp_path):
    """SIGINT once the start line is out (the model is loading): the shell's status for an interrupt
    and one line saying how to resume, no traceback (train.py ends the same way: `interruptible`)."""
    out = tmp_path / "g.jsonl"
    proc = subprocess.Popen([sys.executable, str(ROOT / "generate.py"), "--problem_ids", "1", "--device", "cpu",
                             "--output", str(out)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr.readline().startswith("generate.py: settings: ")
        proc.send_signal(signal.SIGINT)
        err = proc.stderr.read()
        assert proc.wait(timeout=30) == 130
    finally:
        proc.kill()
    assert "Traceback" not in err, err
    assert [line for line in err.splitlines() if "interrupted" in line] == [
        "generate.py: interrupted; the rows of finished batches are in --output; rerun the same command to resume"]


@pytest.mark.usefixtures("counting_policy")
def test_help_and_start_line_name_the_base_configuration(capsys, tmp_path, fake_eval):
    with pytest.raises(SystemExit) as exc:
        generate.main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "With no options, generate.py runs its base configuration" in out
    assert "--api_max_attempts (default: 5)" in out and "--api_timeout (default: 180.0)" in out

    generate.main(["--problem_ids", "1", "--device", "cpu", "--num_turns", "1", "--output", str(tmp_path / "g.jsonl")])
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("generate.py: settings: the library defaults") and first.endswith("; policy: model smollm2")
    assert f"problem_ids=1, device=cpu, num_turns=1, output={tmp_path / 'g.jsonl'}" in first
    # a window as long as a round leaves each later round one new turn: said on the next line
    generate.main(["--problem_ids", "1", "--device", "cpu", "--num_turns", "1", "--stts_iterations", "2",
                   "--output", str(tmp_path / "s.jsonl")])
    assert capsys.readouterr().err.splitlines()[1] == (
        "generate.py: note: --stts_window 4 is not below --num_turns 1: each later round adds 1 turn (the kept "
        "window counts toward --num_turns; --stts_window_counts false adds --num_turns)")


# ----------------------------------------------------------------------------- API policy

class _Server:
    """A tiny OpenAI-style chat server on 127.0.0.1 (bounded: daemon thread, short timeouts)."""

    def __init__(self, reply):
        self.requests = []
        # misbehaviours for the next requests, one each: an HTTP code, "not json" (a 200 whose body
        # is an HTML error page), "nested" (a 200 whose body is JSON nested past the parser's depth),
        # "hang" (no answer for `hang_s`, longer than the client waits) or "trickle" (a 200 whose
        # body comes one byte every 0.2 s, for `hang_s`, then stops short of its Content-Length)
        self.failures = []
        self.retry_after = None  # a Retry-After header on scripted HTTP failures
        self.fail_prompt = None  # conversations starting with these messages always get HTTP 500
        self.hang_s = 3.0
        self.closing = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 10

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                failure = outer.failures.pop(0) if outer.failures else None
                if outer.fail_prompt and body["messages"][:len(outer.fail_prompt)] == outer.fail_prompt:
                    failure = 500
                if failure == "not json":
                    self._send(200, None, b"<html>502 Bad Gateway</html>")
                    return
                if failure == "nested":
                    self._send(200, None, b"[" * 200000 + b"]" * 200000)
                    return
                if failure == "trickle":
                    self._trickle()
                    return
                if failure == "hang":  # the client times out first and retries
                    outer.closing.wait(outer.hang_s)
                    return
                if failure is not None:
                    self._send(failure, {"error": {"message": "scripted failure"}})
                    return
                text, reason = reply(body)
                self._send(200, {"id": "x", "object": "chat.completion", "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}]})

            def _send(self, code, payload, raw=b""):
                data = raw or json.dumps(payload).encode()
                self.send_response(code)
                if code != 200 and outer.retry_after is not None:
                    self.send_header("Retry-After", outer.retry_after)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _trickle(self):
                self.send_response(200)
                self.send_header("Content-Length", "100000")
                self.end_headers()
                for _ in range(int(outer.hang_s / 0.2)):
                    if outer.closing.wait(0.2):
                        return
                    try:
                        self.wfile.write(b" ")
                    except OSError:  # the client gave up
                        return

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.closing.set()
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

    cands = layouts.scan_candidates(out).candidates  # evaluate.py's reader
    assert sorted((c.sample, c.turn, c.code is None) for c in cands) == [
        (0, 0, False), (0, 1, True), (1, 0, False), (1, 1, True)]

    again = generate.main(args)  # complete: no request
    assert len(server.requests) == 4 and again["generated_this_run"] == 0
    generate.main(args + ["--resume", "false"])  # a fresh start moves the old file aside
    assert len(server.requests) == 8 and len(_lines(out)) == 4
    assert len(list(tmp_path.glob("api.*.jsonl.bak"))) == 1


def test_api_client_sorts_failures(server, capsys):
    def client():  # fresh: it has not seen an answer yet
        return api_policy.OpenAIChatClient(api_policy.ApiConfig(
            base_url=server.url, model="m", api_key_env="", timeout=10, max_attempts=3, backoff_s=5.0))

    gen = GenerationConfig(max_new_tokens=5, do_sample=False)
    msgs = [{"role": "user", "content": "hi"}]

    # transient, retried at once since the server says Retry-After: 0 (the backoff alone waits 2.5-5 s)
    server.failures, server.retry_after = [503, 429], "0"
    answered = client()
    c = answered.complete(msgs, gen, label="job 7")
    assert c.text == CODE_REPLY and c.finished and c.error is None and len(server.requests) == 3
    assert server.requests[-1]["auth"] is None and server.requests[-1]["body"]["temperature"] == 0.0
    err = capsys.readouterr().err.splitlines()
    assert err == ['[api] job 7: HTTP 503: {"error": {"message": "scripted failure"}} (attempt 1/3); retrying in 0.0 s',
                   '[api] job 7: HTTP 429: {"error": {"message": "scripted failure"}} (attempt 2/3); retrying in 0.0 s']

    # a wrong key, URL or model, or any 4xx before a first answer: the endpoint is unusable, no retry
    for code, msg in ((401, "HTTP 401"), (404, "HTTP 404"), (400, "refused the first request with HTTP 400")):
        server.failures = [code]
        with pytest.raises(api_policy.ApiError, match=msg):
            client().complete(msgs, gen)
        assert len(server.requests) == 3 + 1 and not server.failures
        del server.requests[3:]
    server.failures = [500, 500, 500]  # never answered: the endpoint is down
    with pytest.raises(api_policy.ApiError, match="no usable answer in 3 attempts"):
        client().complete(msgs, gen)

    # after a first answer a failure is the request's own: a Completion with the reason
    server.failures = [500, 500, 500]
    c = answered.complete(msgs, gen)
    assert c.text == "" and c.error == 'HTTP 500: {"error": {"message": "scripted failure"}} (gave up after 3 attempts)'
    n = len(server.requests)
    server.failures = [400]  # e.g. a prompt over the server's context: not retried
    assert answered.complete(msgs, gen).error.startswith("HTTP 400") and len(server.requests) == n + 1
    with pytest.raises(api_policy.ApiError, match="http"):
        api_policy.OpenAIChatClient(api_policy.ApiConfig(base_url="localhost:8000", model="m"))


def test_api_reply_nested_too_deeply_is_retried_like_any_reply_that_is_not_a_chat_completion(server, capsys):
    client = api_policy.OpenAIChatClient(api_policy.ApiConfig(
        base_url=server.url, model="m", api_key_env="", timeout=10, max_attempts=2, backoff_s=0.0))
    server.failures = ["nested"]
    c = client.complete([{"role": "user", "content": "hi"}], GenerationConfig(max_new_tokens=5), label="job 1")
    assert c.text == CODE_REPLY and c.error is None and len(server.requests) == 2
    assert "[api] job 1: the reply is not a chat completion: '[[[[" in capsys.readouterr().err


def test_api_reply_trickling_past_the_timeout_is_a_timeout(server):
    """The timeout bounds the whole request, not only each socket read: a server that sends a
    byte every 0.2 s would otherwise hold it for `hang_s` (then cut it short: another error)."""
    client = api_policy.OpenAIChatClient(api_policy.ApiConfig(
        base_url=server.url, model="m", api_key_env="", timeout=1.0, max_attempts=1))
    server.failures, server.hang_s = ["trickle"], 6.0
    start = time.monotonic()
    with pytest.raises(api_policy.ApiError, match=r"no usable answer in 1 attempts \(no reply within 1 s"):
        client.complete([{"role": "user", "content": "hi"}], GenerationConfig(max_new_tokens=5))
    assert time.monotonic() - start < 3.0


def test_chat_generator_records_a_failed_trajectory_and_stops_asking_for_it(server, capsys):
    client = api_policy.OpenAIChatClient(api_policy.ApiConfig(base_url=server.url, model="m", api_key_env="",
                                                              max_attempts=1))
    generator = api_policy.ChatGenerator(client, concurrency=1, progress=client.progress)
    codec = api_policy.MessageCodec()
    prompts = [codec(codec.apply_chat_template([{"role": "user", "content": w}]))["input_ids"] for w in ("a", "b")]
    gen = GenerationConfig(max_new_tokens=5, do_sample=False)
    generator.begin(["task A", "task B"], first_turn=3)
    server.failures = [None, 500]  # A answers, B fails
    outs = generator(None, codec, prompts, gen)
    assert codec.decode(outs[0].response_ids) == CODE_REPLY and outs[1].response_ids == []
    assert generator.failures == {1: api_policy.Failure(1, 'HTTP 500: {"error": {"message": "scripted failure"}} '
                                                           '(gave up after 1 attempts)')}
    assert "[api] task B turn 3: failed: HTTP 500" in capsys.readouterr().err
    outs = generator(None, codec, prompts, gen)  # turn 2: only A is asked
    assert len(server.requests) == 3 and outs[1].response_ids == [] and list(generator.failures) == [1]
    assert client.progress.failures == 1 and client.progress.retries == 0
    generator.begin(["task A", "task B"])  # the next rollout starts clean
    assert generator.failures == {} and len(generator(None, codec, prompts, gen)) == 2 and len(server.requests) == 5


def test_retry_after_header():
    from email.utils import format_datetime
    from datetime import datetime, timedelta, timezone

    assert api_policy.retry_after_s("7") == 7.0 and api_policy.retry_after_s(None) is None
    assert api_policy.retry_after_s("soon") is None and api_policy.retry_after_s("-3") == 0.0
    later = format_datetime(datetime.now(timezone.utc) + timedelta(seconds=30), usegmt=True)
    assert 25 < api_policy.retry_after_s(later) <= 30


def _api_args(server, out, *extra):
    return ["--api_base_url", server.url, "--api_model", "tiny-api", "--api_key_env", "DRK_TEST_NO_KEY",
            "--problem_ids", "1", "--samples_per_task", "1", "--num_turns", "2", "--max_new_tokens", "64",
            "--device", "cpu", "--api_backoff_s", "0.01", "--output", str(out), *extra]


@pytest.mark.parametrize("failure, extra, message", [
    ("not json", [], "the reply is not a chat completion: '<html>502 Bad Gateway</html>' (attempt 1/5)"),
    ("hang", ["--api_timeout", "1"], "no reply within 1 s (api_timeout) (attempt 1/5)"),
    (500, [], 'HTTP 500: {"error": {"message": "scripted failure"}} (attempt 1/5)'),
])
def test_api_transient_failure_is_retried_with_a_message(tmp_path, server, fake_eval, capsys, failure, extra,
                                                         message):
    server.failures = [failure]
    out = tmp_path / "api.jsonl"
    summary = generate.main(_api_args(server, out, *extra))
    err = capsys.readouterr().err
    assert f"[api] 0_1 sample 0 turn 0: {message}; retrying in " in err
    assert "retries=1, failed=0" in err and "2/2" in err  # the progress bar over requests
    assert len(server.requests) == 3
    rows = _rows(out)
    assert [(r["turn"], r["verdict"], r["generation_error"]) for r in rows] == [
        (0, "correct", None), (1, "format_error", None)]
    assert summary["generation_failures"] == 0 and summary["num_missing"] == 0


def test_ctrl_c_during_requests_to_a_hung_endpoint_exits_130_at_once(tmp_path, server):
    """Several requests in flight, none answered: SIGINT must not wait for them (a pool's exit joins
    its workers, up to api_timeout x api_max_attempts later)."""
    server.failures, server.hang_s = ["hang"] * 20, 120.0
    args = _api_args(server, tmp_path / "g.jsonl", "--api_timeout", "100")
    args[args.index("--samples_per_task") + 1] = "3"
    cmd = [sys.executable, str(ROOT / "generate.py"), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(server.requests) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(server.requests) == 3, proc.stderr.read() if proc.poll() is not None else "no requests"
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        assert proc.wait(timeout=15) == 130
        assert time.monotonic() - sent < 10
        err = proc.stderr.read()
    finally:
        proc.kill()
        proc.stderr.close()
    assert "Traceback" not in err, err
    assert err.splitlines()[-1] == ("generate.py: interrupted; the rows of finished batches are in --output; "
                                    "rerun the same command to resume")


def test_api_request_that_keeps_failing_is_recorded_and_retried_on_resume(tmp_path, server, fake_eval, capsys):
    task2 = load_bundled([2])[0]
    server.fail_prompt = first_turn_messages(task2)
    out = tmp_path / "api.jsonl"
    # one batch of two tasks, requests in order (task 1 answers first)
    args = _api_args(server, out, "--problem_ids", "1,2", "--api_concurrency", "1", "--api_max_attempts", "3")
    summary = generate.main(args)
    err = capsys.readouterr().err
    scripted = 'HTTP 500: {"error": {"message": "scripted failure"}}'
    assert f"[api] 0_2 sample 0 turn 0: {scripted} (attempt 2/3); retrying in " in err
    assert f"[api] 0_2 sample 0 turn 0: failed: {scripted} (gave up after 3 attempts)" in err
    assert "retries=2, failed=1" in err and "1 generation(s) failed" in err
    # task 2's trajectory stops at its failed turn: 1 + 3 requests at turn 0, 1 at turn 1
    assert len(server.requests) == 5
    rows = _rows(out)
    assert [(r["task_key"], r["turn"], r["verdict"]) for r in rows] == [
        ("0_1", 0, "correct"), ("0_1", 1, "format_error"), ("0_2", 0, "generation_failed")]
    failed = rows[2]
    assert failed["generation_error"] == f"{scripted} (gave up after 3 attempts)"
    assert failed["code"] is None and failed["reward"] is None and failed["response"] == ""
    assert summary["generation_failures"] == 1 and summary["num_missing"] == 1  # not a wrong answer

    server.fail_prompt = None  # the server recovers: a rerun generates only task 2 again
    kept = _lines(out)[:2]
    summary = generate.main(args)
    assert "1 failed generation(s): their rounds are generated again" in capsys.readouterr().err
    assert len(server.requests) == 5 + 2
    assert _lines(out)[:2] == kept
    assert [(r["task_key"], r["turn"], r["verdict"]) for r in _rows(out)] == [
        ("0_1", 0, "correct"), ("0_1", 1, "format_error"), ("0_2", 0, "correct"), ("0_2", 1, "format_error")]
    assert summary["generation_failures"] == 0 and summary["num_missing"] == 0


@pytest.mark.parametrize("code, message", [(404, "answered HTTP 404 (check api_base_url"),
                                           (400, "refused the first request with HTTP 400")])
def test_api_client_error_fails_fast(tmp_path, server, fake_eval, capsys, code, message):
    server.failures = [code]
    out = tmp_path / "api.jsonl"
    assert message in _usage_error(capsys, _api_args(server, out), status=1)
    assert len(server.requests) == 1 and _rows(out) == []


def _generated(tmp_path, problem_ids: str, num_turns: int) -> tuple[Path, list[str]]:
    """One generate.py run into tmp_path/g.jsonl (the scripted policy): the file and the options to run it again."""
    out = tmp_path / "g.jsonl"
    args = ["--problem_ids", problem_ids, "--num_turns", str(num_turns), "--device", "cpu", "--output", str(out)]
    generate.main(args)
    return out, args


def test_resume_skips_bad_lines_and_refuses_other_settings(tmp_path, fake_eval, counting_policy, capsys):
    policy = counting_policy
    out, args = _generated(tmp_path, "1", 2)
    good = _lines(out)
    bad_row = json.dumps({**json.loads(good[0]), "turn": "x"})
    out.write_text("\n".join([good[0], bad_row, "[1, 2]", good[1], good[1][:30]]))
    capsys.readouterr()
    generate.main(args)
    err = capsys.readouterr().err
    assert "skipped 3 unusable line(s) (a killed run leaves its last line cut): line 2: turn is 'x', not an integer; " \
           "line 3: not a JSON object; line 5: not a JSON object (" in err
    assert len(policy.earlier) == 2 and _lines(out) == good  # nothing to regenerate; the bad lines are gone

    msg = _usage_error(capsys, args + ["--temperature", "0.5", "--max_new_tokens", "9"])
    assert "was written with other settings (temperature 1.0 -> 0.5; max_new_tokens 1024 -> 9" in msg
    foreign = tmp_path / "other.jsonl"
    foreign.write_text('{"a": 1}\n{"b": 2}\n')
    assert "holds no generate.py row (line 1: lacks level, problem_id, task and " in _usage_error(
        capsys, args[:-1] + [str(foreign)])
    assert foreign.read_text() == '{"a": 1}\n{"b": 2}\n' and len(policy.earlier) == 2
    foreign.write_text('{"verdict": "correct"}\n')  # one whole row of another script's (evaluate.py's results)
    assert "holds no generate.py row" in _usage_error(capsys, args[:-1] + [str(foreign)])
    assert foreign.read_text() == '{"verdict": "correct"}\n'


def test_resume_refuses_rows_of_another_baseline_and_reuses_rows_that_predate_it(tmp_path, fake_eval,
                                                                                counting_policy, capsys):
    """Speedups against the eager reference and against torch.compile are two experiments."""
    out, args = _generated(tmp_path, "1", 1)
    row = _rows(out)[0]
    assert row["settings"]["baseline"] == "eager"
    assert _usage_error(capsys, args + ["--baseline", "compile"]) == (
        f"generate.py: error: {out} was written with other settings (baseline 'eager' -> 'compile': the file's "
        f"value, then this run's); pass the same values, or pass another --output or --resume false")
    del row["settings"]["baseline"]  # a file written before the baseline was recorded stays usable
    out.write_text(json.dumps(row) + "\n")
    summary = generate.main(args + ["--baseline", "compile"])
    assert len(counting_policy.earlier) == 1 and summary["generated_this_run"] == 0 and _rows(out) == [row]


@pytest.mark.parametrize("written, now, difference", [
    (["--stts_window", "1"], ["--stts_window", "1", "--stts_window_counts", "false"],
     "--stts_window_counts true (a window of 1 or more counted toward --num_turns), not --stts_window_counts false"),
    (["--stts_window", "1", "--stts_window_counts", "false"], ["--stts_window", "1"],
     "--stts_window_counts false or --stts_window 0, not --stts_window_counts true --stts_window 1"),
    (["--num_turns", "3", "--stts_window", "1"], ["--num_turns", "3", "--stts_window", "2"],
     "--stts_window 1, not --stts_window 2"),
])
def test_resume_with_another_stts_plan_names_the_option_that_differs(tmp_path, fake_eval, counting_policy, capsys,
                                                                     written, now, difference):
    """Rows record --num_turns and each round's new turns: a later round tells the STTS option apart."""
    out = tmp_path / "g.jsonl"
    base = ["--problem_ids", "1", "--num_turns", "2", "--stts_iterations", "2", "--device", "cpu", "--output", str(out)]
    generate.main(base + written)
    rows = _rows(out)
    first_of_round_1 = [r["iteration"] for r in rows].index(1) + 1  # round 0 holds --num_turns turns either way
    assert _usage_error(capsys, base + now) == (
        f"generate.py: error: {out} was written with {difference} (row {first_of_round_1}); pass another "
        f"--output or --resume false")
    assert _rows(out) == rows


def test_resume_with_fewer_stts_rounds_says_the_summary_counts_only_those(tmp_path, fake_eval, counting_policy,
                                                                         capsys):
    out = tmp_path / "g.jsonl"
    base = ["--problem_ids", "1", "--num_turns", "1", "--device", "cpu", "--output", str(out)]
    generate.main(base + ["--stts_iterations", "3"])
    rows = _rows(out)
    capsys.readouterr()
    summary = generate.main(base + ["--stts_iterations", "2"])
    assert f"holds 3 STTS rounds, this run asks for 2 (--stts_iterations): the summary counts the first 2" \
           in capsys.readouterr().err
    assert [r["iteration"] for r in summary["stts"]] == [0, 1] and _rows(out) == rows


class DownPolicy:
    """An endpoint that fails every request: the run stops (status 1)."""

    def complete(self, messages, cfg, seed=None, label="request"):
        raise api_policy.ApiError("the endpoint is down")


def test_a_resume_that_fails_after_dropping_rows_leaves_no_stale_summary(tmp_path, fake_eval, counting_policy, capsys,
                                                                         monkeypatch):
    out, args = _generated(tmp_path, "1,2", 1)
    lines = _lines(out)
    report_summary = generate.report_dir(out) / "summary.json"
    for path in (generate.summary_path(out), report_summary):
        assert json.loads(path.read_text())["num_missing"] == 0
    out.write_text(lines[0] + "\n" + lines[1][:30])  # killed while writing task 2's row
    monkeypatch.setattr(generate, "load_policy", lambda cfg, device: _scripted_policy(DownPolicy()))
    assert "the endpoint is down" in _usage_error(capsys, args, status=1)
    assert _lines(out) == lines[:1]
    for path in (generate.summary_path(out), report_summary):  # what the file holds now: task 2 is missing
        summary = json.loads(path.read_text())
        assert summary["num_missing"] == 1 and summary["num_samples"] == 2, path


def test_a_one_line_output_that_is_no_row_is_kept_aside_not_destroyed(tmp_path, fake_eval, counting_policy, capsys):
    out = tmp_path / "g.jsonl"
    garbage = bytes(range(256)).replace(b"\n", b"").replace(b"\r", b"")
    out.write_bytes(garbage)
    generate.main(["--problem_ids", "1", "--num_turns", "1", "--device", "cpu", "--output", str(out)])
    (backup,) = tmp_path.glob("g.*.jsonl.bak")
    assert backup.read_bytes() == garbage
    assert f"skipped 1 unusable line(s) (a killed run leaves its last line cut): line 1: not UTF-8 text (byte 127); " \
           f"the old file is kept as {backup.name}" in capsys.readouterr().err
    assert [r["task_key"] for r in _rows(out)] == ["0_1"]


def test_resume_keeps_the_last_row_of_a_duplicated_turn_and_says_so(tmp_path, fake_eval, counting_policy, capsys):
    out, args = _generated(tmp_path, "1", 2)
    good = _lines(out)
    again = json.dumps({**json.loads(good[0]), "reward": 0.25})  # the same turn, written again later
    out.write_text("\n".join([good[0], good[1], again]) + "\n")
    capsys.readouterr()
    generate.main(args)
    err = capsys.readouterr().err
    assert "dropped 1 duplicate row(s): the last row of each turn is kept" in err and "unfinished" not in err
    assert len(counting_policy.earlier) == 2 and _lines(out) == [good[1], again]  # nothing generated again


def test_resume_regenerates_mistyped_rows_and_names_them(tmp_path, fake_eval, counting_policy, capsys):
    policy = counting_policy
    out, args = _generated(tmp_path, "1,2,3,4,5", 1)
    rows = _rows(out)
    assert len(rows) == len(policy.earlier) == 5 and rows[0]["verdict"] == "correct"
    flaws = [{"verdict": 5}, {"correct": "yes"}, {"settings": None}, {"hacks": 5}]
    rows[0] |= flaws[0]
    rows[1] |= flaws[1]
    del rows[2]["settings"]
    rows[3] |= flaws[3]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    summary = generate.main(args)
    err = capsys.readouterr().err
    assert "skipped 4 unusable line(s) (a killed run leaves its last line cut): line 1: verdict is 5, not a string; " \
           "line 2: correct is 'yes', not true or false; line 3: lacks settings; and 1 more" in err
    assert len(policy.earlier) == 5 + 4  # their units were generated again, the good one reused
    again = _rows(out)
    assert [generate.row_problem(r) for r in again] == [None] * 5 and again[0] == rows[4]
    assert summary["verdict_counts"] == {"correct": 5} and summary["generated_this_run"] == 4
    for problem, flaw in (("settings: lacks temperature", {"settings": {"seed": 0}}),
                          ("settings: seed is '0', not an integer", {"settings": {**rows[4]["settings"], "seed": "0"}}),
                          ("kernels is [1], not a list of objects or null", {"kernels": [1]}),
                          ("verdict 'great' is not one of correct,", {"verdict": "great"}),
                          ("speedup is '9', not a number or null", {"speedup": "9"})):
        assert generate.row_problem({**rows[4], **flaw}).startswith(problem)


def _task_folder(tmp_path, name: str, like: int) -> str:
    """A --tasks folder holding one task file `name` with the code of bundled task `like`."""
    folder = tmp_path / f"tasks_{Path(name).stem}"
    folder.mkdir()
    (folder / name).write_text(load_bundled([like])[0].code)
    return str(folder)


def test_resume_refuses_rows_written_for_other_tasks(tmp_path, fake_eval, counting_policy, capsys):
    """Rows are matched to tasks by `task_key` (level_problemid): a file written for another task set
    names another file, or other code, under the same key, and a damaged row may name another
    problem than its key; reusing either would credit the selected task with another's answer."""
    out, args = _generated(tmp_path, "1", 1)  # bundled 1_ReLU.py
    row = json.loads(out.read_text())
    relu, softmax = load_bundled([1])[0], load_bundled([4])[0]
    softmax_dir = _task_folder(tmp_path, "1_Softmax.py", like=4)
    for tasks, why in ((softmax_dir, f"1_Softmax.py: task '1_ReLU.py' (not '1_Softmax.py'), task_sha '{relu.digest}' "
                                     f"(not '{softmax.digest}')"),
                       (_task_folder(tmp_path, "1_ReLU.py", like=4),  # the same file name, other code
                        f"1_ReLU.py: task_sha '{relu.digest}' (not '{softmax.digest}')")):
        assert _usage_error(capsys, args + ["--tasks", tasks]) == (
            f"generate.py: error: {out} was written for other tasks (1 row(s); the first answers another task "
            f"than {why}); pass another --output or --resume false")
    for damage, why in (({"task": "3_Matmul.py", "problem_id": 3}, "problem_id 3 (not 1), task '3_Matmul.py' (not "
                                                                   "'1_ReLU.py')"),
                        ({"level": 5}, "level 5 (not 0)")):  # keyed 0_1, but not problem 0_1's row
        out.write_text(json.dumps({**row, **damage}) + "\n")
        assert f"(1 row(s); the first answers another task than 1_ReLU.py: {why}); " in _usage_error(capsys, args)
    assert len(counting_policy.earlier) == 1  # nothing generated for a refused file

    # the summary counts a task's rows by the same rule: ReLU's answer is no Softmax answer
    cfg = generate.GenerateConfig(output=str(tmp_path / "s.jsonl"), num_turns=1)
    tasks = generate.GenerateConfig(tasks=softmax_dir).selected_tasks()
    summary = generate._summary(cfg, tasks, [row], 0)
    assert summary["num_missing"] == 1 and summary["correct_rate"] == 0.0


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

    def complete(self, messages, cfg, seed=None, label="request"):
        self.seen.append(messages)
        return api_policy.Completion(self.replies.pop(0), True)


def _scripted_policy(scripted):
    codec = api_policy.MessageCodec()
    return generate.Policy("scripted", None, codec, api_policy.ChatGenerator(scripted, 1, codec),
                           api_policy.prompt_budget(8000), counts_tokens=False)


@pytest.mark.slow
def test_stts_end_to_end_with_real_evaluator(tmp_path, capsys):
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
        with pytest.raises(SystemExit) as exc:
            generate.run(dataclasses.replace(cfg, stts_window_counts=False), [task], _scripted_policy(again),
                         generate.make_evaluate_fn(ev, ref_dir))
        assert exc.value.code == 2
        assert ("was written with --stts_window_counts true (a window of 1 counted toward --num_turns), not "
                "--stts_window_counts false (row 4)") in capsys.readouterr().err


@pytest.fixture
def counting_policy(monkeypatch) -> "CountingPolicy":
    """generate.py's policy replaced by a CountingPolicy: no model loads."""
    policy = CountingPolicy()
    monkeypatch.setattr(generate, "load_policy", lambda cfg, device: _scripted_policy(policy))
    return policy


class CountingPolicy:
    """Always answers with code; records how many earlier answers each request carried."""

    def __init__(self):
        self.earlier = []

    def complete(self, messages, cfg, seed=None, label="request"):
        self.earlier.append(sum(m["role"] == "assistant" for m in messages))
        return api_policy.Completion(CODE_REPLY, True)


@pytest.mark.parametrize("extra, requests, most_earlier", [
    ([], 14, 4),  # KernelGYM: the window counts toward the 5 turns: 5 + 9 x 1 turns, contexts of <= 5 turns
    (["--stts_window_counts", "false"], 50, 8),  # every round adds 5 turns to a 4-turn window
])
def test_paper_stts_asks_for_14_turns_and_never_more_than_4_earlier_ones(tmp_path, fake_eval, counting_policy,
                                                                       extra, requests, most_earlier):
    policy = counting_policy
    summary = generate.main(["--stts_iterations", "10", "--num_turns", "5", "--stts_window", "4", "--problem_ids", "1",
                             "--device", "cpu", "--output", str(tmp_path / "stts.jsonl"), *extra])
    assert len(policy.earlier) == requests and max(policy.earlier) == most_earlier
    assert summary["num_turns"] == requests and len(_rows(tmp_path / "stts.jsonl")) == requests
