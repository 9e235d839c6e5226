"""drkernel.evalcache: keys, the caching rule, the on-disk store under concurrency and corruption,
dedupe, and the fingerprint (without CUDA). No evaluator runs: results are built by hand."""

import dataclasses
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from drkernel import evalcache
from drkernel.evalcache import CacheStats, EvalCache, cache_key, cacheable, dedupe, evaluate_cached
from drkernel.evaluator import EvalConfig, EvalResult

ROOT = Path(__file__).resolve().parent.parent
REF = "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x.relu()\n"
CAND = "class ModelNew:\n    pass\n"
ENV = {"device": "cuda", "gpu": "NVIDIA H200", "driver": "580.1", "cuda": "13.0", "torch": "2.11", "triton": "3.6"}


def result(verdict="correct", **kw) -> EvalResult:
    r = EvalResult(verdict=verdict, compiled=True, correct=verdict == "correct",
                   speedup=1.5 if verdict == "correct" else None, reward=0.9, **kw)
    r.details["environment"] = dict(ENV)
    return r


def changed(value):
    """A different value of the same type, for any EvalConfig field."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1
    return value + "x"


# ---- keys ---------------------------------------------------------------------------------

def test_key_changes_with_every_verdict_setting():
    base = cache_key(REF, CAND, EvalConfig(), ENV)
    relevant = [f.name for f in dataclasses.fields(EvalConfig) if f.name not in evalcache.NON_VERDICT_FIELDS]
    assert {"trials", "seed", "atol_fp32", "require_triton", "perf_trials", "max_rss_mb"} <= set(relevant)
    for name in relevant:
        cfg = dataclasses.replace(EvalConfig(), **{name: changed(getattr(EvalConfig(), name))})
        assert cache_key(REF, CAND, cfg, ENV) != base, name


def test_key_ignores_settings_that_cannot_change_a_verdict():
    base = cache_key(REF, CAND, EvalConfig(device="auto"), ENV)
    for cfg in (EvalConfig(device="cuda"), EvalConfig(device="cuda:1"), EvalConfig(timeout=999.0),
                EvalConfig(cache_dir="/elsewhere")):
        assert cache_key(REF, CAND, cfg, ENV) == base, cfg


def test_key_changes_with_either_program_and_every_fingerprint_field():
    base = cache_key(REF, CAND, EvalConfig(), ENV)
    assert cache_key(REF + " ", CAND, EvalConfig(), ENV) != base
    assert cache_key(REF, CAND + "\n", EvalConfig(), ENV) != base
    assert cache_key(CAND, REF, EvalConfig(), ENV) != base  # the roles are not interchangeable
    for name in ENV:
        assert cache_key(REF, CAND, EvalConfig(), {**ENV, name: ENV[name] + "1"}) != base, name
    assert cache_key(REF, CAND, EvalConfig(), dict(reversed(list(ENV.items())))) == base  # order-free
    assert len(base) == 64 and int(base, 16) >= 0


def test_key_changes_with_the_judging_code(monkeypatch):
    """A verdict stored before a fix to a defence must not be served by the fixed code."""
    from drkernel import evalcache
    base = cache_key(REF, CAND, EvalConfig(), ENV)
    monkeypatch.setattr(evalcache, "judge_digest", lambda: "another judge")
    assert cache_key(REF, CAND, EvalConfig(), ENV) != base
    monkeypatch.undo()
    assert evalcache.judge_digest() == evalcache.judge_digest.__wrapped__()  # the package's sources as on disk


def test_code_with_a_lone_surrogate_is_keyed_stored_and_found(tmp_path):
    """A lone surrogate arrives inside valid JSON (an API reply, a JSONL row): hashed as it is."""
    odd = CAND + "# \udcff\n"
    keys = {cache_key(REF, CAND, EvalConfig(), ENV), cache_key(REF, odd, EvalConfig(), ENV),
            cache_key(REF + "\udcff", CAND, EvalConfig(), ENV), cache_key(REF, CAND + "# \ufffd\n", EvalConfig(), ENV)}
    assert len(keys) == 4
    fake = FakeEvaluator()
    for _ in range(2):
        cache = EvalCache(tmp_path)
        assert [r.verdict for r in evaluate_cached([(REF, odd)], EvalConfig(device="cpu"), fake, cache)] == ["correct"]
    assert len(fake.calls) == 1 and cache.stats.hits == 1


def test_key_changes_with_the_cache_version(monkeypatch):
    base = cache_key(REF, CAND, EvalConfig(), ENV)
    monkeypatch.setattr(evalcache, "CACHE_VERSION", evalcache.CACHE_VERSION + 1)
    assert cache_key(REF, CAND, EvalConfig(), ENV) != base


# ---- the caching rule ---------------------------------------------------------------------

@pytest.mark.parametrize("verdict", ["correct", "incorrect", "compile_error", "runtime_error"])
def test_deterministic_verdicts_are_cached(verdict):
    assert cacheable(result(verdict, error=None if verdict == "correct" else "SyntaxError: bad (line 3)"))


@pytest.mark.parametrize("signal", ["SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT"])
def test_crashes_by_the_candidates_own_fault_signal_are_cached(signal):
    assert cacheable(result("crashed", error=f"killed by {signal}"))


def test_hack_verdicts_cached_unless_judged_on_clocks():
    assert cacheable(result("hacked", hacks=["no_triton_kernel"]))
    assert cacheable(result("hacked", hacks=["output_cached", "input_mutated"]))
    for code in ("reference_slowed", "implausible_speedup", "side_stream"):
        assert not cacheable(result("hacked", hacks=["no_triton_kernel", code])), code


@pytest.mark.parametrize("verdict,error", [
    ("timeout", "evaluation exceeded the time limit"),
    ("crashed", "killed by SIGKILL"),
    ("crashed", "killed by SIGTERM"),
    ("crashed", "process exited without a result (os._exit?), exit code 0"),
    ("crashed", "sandbox error: broken pipe"),
    ("crashed", "out of memory (oom)"),
    ("runtime_error", "forward raised in trial 0: OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB"),
    ("runtime_error", "forward raised in trial 1: MemoryError: "),
    ("runtime_error", "CUDA requested but not available"),
    ("runtime_error", "cannot read input: [Errno 2] No such file"),
    ("incorrect", "evaluator failure: BrokenPipeError"),
    ("runtime_error", "forward raised: OSError: [Errno 28] No space left on device"),  # another job filled the disk
])
def test_infrastructure_verdicts_are_not_cached(verdict, error):
    assert not cacheable(result(verdict, error=error))


@pytest.mark.parametrize("name", ["SIGBUS", "SIGSEGV", "SIGKILL"])
def test_a_signal_that_killed_the_judge_is_never_the_candidates_fault(name):
    """The job's own process is the judge, which runs no candidate code: a signal that killed it
    (SIGBUS where a full disk faults a mapped file) is the machine's failure, not cached."""
    import signal

    from drkernel.evaluator import _map_status
    from drkernel.sandbox import SandboxResult
    r = _map_status(SandboxResult("signal", signal=int(signal.Signals[name])))
    assert r.verdict == "crashed" and f"judge was killed by {name}" in r.error, r.error
    assert not cacheable(evalcache.with_environment(r, ENV))


def test_unstamped_or_unidentified_environment_is_not_cached():
    bare = result()
    del bare.details["environment"]
    assert not cacheable(bare)
    unknown = result()
    unknown.details["environment"]["gpu"] = evalcache.UNKNOWN
    assert not cacheable(unknown)
    assert not cacheable(result("not_a_verdict"))


# ---- the store ----------------------------------------------------------------------------

def test_put_get_roundtrip_with_stats_and_reward_cleared(tmp_path):
    cache = EvalCache(tmp_path)
    key = cache_key(REF, CAND, EvalConfig(), ENV)
    assert cache.get(key) is None
    assert cache.put(key, result(hacks=[], stdout="hello"))
    got = cache.get(key)
    assert got.verdict == "correct" and got.speedup == 1.5 and got.stdout == "hello"
    assert got.details["environment"] == ENV and got.details["cached"] is True
    assert got.reward is None and got.reward_terms is None  # scored by the caller's RewardConfig
    assert (cache.stats.hits, cache.stats.misses, cache.stats.hit_rate) == (1, 1, 0.5)
    assert (tmp_path / key[:2] / f"{key}.json").is_file()
    assert not list(tmp_path.rglob("*.tmp"))


def test_put_refuses_uncacheable_results(tmp_path):
    cache = EvalCache(tmp_path)
    assert not cache.put("ab" * 32, result("timeout", error="evaluation exceeded the time limit"))
    assert not any(tmp_path.iterdir())


def test_hit_rate_without_lookups_is_zero():
    assert CacheStats().hit_rate == 0.0 and CacheStats(hits=3, misses=1).hit_rate == 0.75


@pytest.mark.parametrize("content", [
    b"", b"{", b"\xff\xfe not utf-8", b"[1, 2]", b"null",
    b'{"version": 1, "key": "KEY", "environment": {}, "result": {"verdict": "correct", "details": []}}',
    b'{"version": 1, "key": "KEY", "environment": {}, "result": {"verdict": "great"}}',
    b'{"version": 1, "key": "KEY", "environment": {}, "result": {"verdict": "correct", "correct": "yes"}}',
    b'{"version": 1, "key": "KEY", "environment": {}, "result": {"verdict": "correct", "speedup": "9"}}',
    b'{"version": 1, "key": "KEY", "environment": {}, "result": {"verdict": "correct", "kernels": [1]}}',
    b'{"version": 1, "key": "other", "environment": {}, "result": {"verdict": "correct"}}',
    b'{"version": 0, "key": "KEY", "environment": {}, "result": {"verdict": "correct"}}',
    pytest.param(b"[" * 100000 + b"]" * 100000, id="nested-past-the-parser"),
    pytest.param(b'{"version": 1, "key": "KEY", "environment": {}, "result": {"verdict": "correct", "details": '
                 b'{"x": ' + b"[" * 600 + b"]" * 600 + b"}}}", id="nested-past-to_dict"),
])
def test_corrupted_entries_are_misses(tmp_path, content):
    cache = EvalCache(tmp_path)
    key = cache_key(REF, CAND, EvalConfig(), ENV)
    path = tmp_path / key[:2] / f"{key}.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(content.replace(b"KEY", key.encode()))
    assert cache.get(key) is None and cache.stats.misses == 1
    assert cache.put(key, result())  # a good entry replaces the bad one
    assert cache.get(key).verdict == "correct"


def test_result_problem_names_the_first_mistyped_field():
    assert evalcache.result_problem(result().to_dict()) is None
    assert evalcache.result_problem({"verdict": "correct", "speedup": 2, "trials": 3}) is None  # an int is a number
    for data, problem in (({}, "lacks verdict"), ({"verdict": 5}, "verdict is 5, not a string"),
                          ({"verdict": "format_error"}, "verdict 'format_error' is not one of correct,"),
                          ({"verdict": "correct", "correct": 1}, "correct is 1, not true or false"),
                          ({"verdict": "correct", "trials": True}, "trials is True, not an integer"),
                          ({"verdict": "correct", "hacks": None}, "hacks is None, not a list"),
                          ({"verdict": "correct", "details": []}, "details is [], not an object")):
        assert evalcache.result_problem(data).startswith(problem), data
    assert evalcache.result_problem({"verdict": "format_error"}, (*evalcache.VERDICTS, "format_error")) is None


def test_half_written_entry_is_a_miss(tmp_path):
    cache = EvalCache(tmp_path)
    key = cache_key(REF, CAND, EvalConfig(), ENV)
    assert cache.put(key, result())
    path = tmp_path / key[:2] / f"{key}.json"
    text = path.read_bytes()
    path.write_bytes(text[: len(text) // 2])
    assert cache.get(key) is None


def test_unwritable_directory_is_not_an_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert EvalCache(blocker).put("ab" * 32, result()) is False


def _writer(path: str, key: str, seed: int, n: int) -> None:
    cache = EvalCache(path)
    for i in range(n):
        r = result()
        r.speedup = float(seed * 1000 + i)
        r.stdout = "x" * (1000 * (i % 7))  # entries of different sizes: a torn write would show
        assert cache.put(key, r)


def _reader(path: str, key: str, n: int, bad) -> None:
    """Counts torn reads: once an entry exists, every read must give one writer's whole result."""
    cache = EvalCache(path)
    seen = False
    for _ in range(n):
        got = cache.get(key)
        if got is None:
            bad.value += seen
            continue
        seen = True
        if got.verdict != "correct" or len(got.stdout) != 1000 * (int(got.speedup) % 1000 % 7):
            bad.value += 1


def test_concurrent_writers_and_a_reader_on_one_key(tmp_path):
    ctx = multiprocessing.get_context("fork")
    key = cache_key(REF, CAND, EvalConfig(), ENV)
    bad = ctx.Value("i", 0)
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), key, s, 60)) for s in range(1, 4)]
    procs.append(ctx.Process(target=_reader, args=(str(tmp_path), key, 300, bad)))
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert bad.value == 0
    final = EvalCache(tmp_path).get(key)
    assert final is not None and int(final.speedup) // 1000 in (1, 2, 3)
    assert [p.name for p in (tmp_path / key[:2]).iterdir()] == [f"{key}.json"]  # no temporary left


# ---- dedupe and evaluate_cached -----------------------------------------------------------

def test_dedupe_keeps_first_seen_order_and_maps_back():
    pairs = [("r", "a"), ("r", "b"), ("r", "a"), ("s", "a"), ("r", "b")]
    unique, index = dedupe(pairs)
    assert unique == [("r", "a"), ("r", "b"), ("s", "a")]
    assert index == [0, 1, 0, 2, 1]
    assert [unique[i] for i in index] == pairs
    assert dedupe([]) == ([], [])


class FakeEvaluator:
    """Stands in for Evaluator.evaluate_many: records what it was asked."""

    def __init__(self):
        self.calls: list[list[tuple[str, str]]] = []

    def __call__(self, pairs):
        self.calls.append(list(pairs))
        out = []
        for _, cand in pairs:
            verdict = "timeout" if "sleep" in cand else "correct"
            out.append(EvalResult(verdict=verdict, correct=verdict == "correct", compiled=True,
                                  speedup=2.0 if verdict == "correct" else None, reward=123.0))
        return out


def test_evaluate_cached_dedupes_stamps_and_reuses(tmp_path):
    cfg = EvalConfig(device="cpu")
    fake = FakeEvaluator()
    pairs = [(REF, "a"), (REF, "b"), (REF, "a"), (REF, "sleep")]
    first = evaluate_cached(pairs, cfg, fake, EvalCache(tmp_path))
    assert fake.calls == [[(REF, "a"), (REF, "b"), (REF, "sleep")]]
    assert [r.verdict for r in first] == ["correct", "correct", "correct", "timeout"]
    env = evalcache.fingerprint("cpu")
    assert all(r.details["environment"] == env for r in first)
    first[0].details["mark"] = 1
    assert "mark" not in first[2].details  # duplicates are independent copies

    cache = EvalCache(tmp_path)
    second = evaluate_cached(pairs, cfg, fake, cache)
    assert fake.calls[1] == [(REF, "sleep")]  # the timeout is tried again, the rest is cached
    assert (cache.stats.hits, cache.stats.misses) == (2, 1)
    assert second[0].details["cached"] is True and second[0].speedup == 2.0
    assert second[0].reward is None  # stored without a reward: the caller scores every result
    assert [r.verdict for r in second] == [r.verdict for r in first]


def test_the_evaluator_scores_fresh_and_cached_results_with_its_reward_config(tmp_path, monkeypatch):
    from drkernel.evaluator import Evaluator
    from drkernel.rewards import RewardConfig
    fake = FakeEvaluator()
    monkeypatch.setattr(Evaluator, "_run", lambda self, pairs: fake(pairs))
    weights = RewardConfig(correct_weight=1.0, speedup_weight=0.25, profile_weight=0.0)
    cfg = EvalConfig(device="cpu", cache_dir=str(tmp_path), require_confinement=False)
    with Evaluator(cfg, reward_config=weights) as ev:
        fresh = ev.evaluate_many([(REF, "a")])[0]
        cached = ev.evaluate_many([(REF, "a")])[0]
    assert cached.details["cached"] and len(fake.calls) == 1
    assert fresh.reward == cached.reward == pytest.approx(1.0 + 0.25 * 2.0)  # not the fake's 123


def test_evaluate_cached_without_cache_only_dedupes():
    fake = FakeEvaluator()
    out = evaluate_cached([(REF, "a")] * 3, EvalConfig(device="cpu"), fake)
    assert len(out) == 3 and fake.calls == [[(REF, "a")]] and "cached" not in out[0].details


# ---- fingerprint --------------------------------------------------------------------------

def test_cpu_fingerprint():
    import torch

    env = evalcache.fingerprint("cpu")
    assert env["device"] == "cpu" and env["torch"] == torch.__version__
    assert env["cpu"] and env["triton"] and "gpu" not in env


def _fingerprint_in_subprocess(path_dir: Path, device: str) -> dict:
    """fingerprint() in a fresh interpreter (the nvidia-smi answer is cached per process) with
    `path_dir` first on PATH; also reports whether torch initialised CUDA."""
    code = ("import json, torch; from drkernel.evalcache import fingerprint; "
            f"a = fingerprint({device!r}); b = fingerprint({device!r}); "
            "print(json.dumps({'env': a, 'same': a == b, 'cuda_init': torch.cuda.is_initialized()}))")
    env = {**os.environ, "PATH": f"{path_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_gpu_fingerprint_from_nvidia_smi_once_without_cuda(tmp_path):
    log = tmp_path / "calls"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho called >> {log}\necho 'NVIDIA H200, 580.159.04'\n"
                   "echo 'NVIDIA H200, 580.159.04'\n")
    smi.chmod(0o755)
    out = _fingerprint_in_subprocess(tmp_path, "auto")
    import torch

    assert out["env"] == {"device": "cuda", "gpu": "NVIDIA H200", "driver": "580.159.04",
                          "cuda": torch.version.cuda or "unknown", "torch": torch.__version__,
                          "triton": out["env"]["triton"]}
    assert out["same"] and out["cuda_init"] is False
    assert log.read_text().count("called") == 1


def test_gpu_fingerprint_without_nvidia_smi_is_unknown(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexit 9\n")  # present but failing, as on a broken driver
    smi.chmod(0o755)
    out = _fingerprint_in_subprocess(tmp_path, "cuda")
    assert out["env"]["gpu"] == evalcache.UNKNOWN and out["env"]["driver"] == evalcache.UNKNOWN
    r = result()
    r.details["environment"] = out["env"]
    assert not cacheable(r)
