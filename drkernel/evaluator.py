"""Verdicts for untrusted `ModelNew` candidates against a KernelBench reference `Model`.

This module is the caller's side (`evaluate`, `Evaluator`, the CLI): it reads the two programs,
runs a cheap static scan, then starts one sandbox job made of two processes: the judge
(`drkernel.judge`), which never imports candidate code and decides the verdict, hack codes and
speedup, and the runner (`drkernel.runner`), the confined process that imports the candidate and
runs it on inputs the judge gives it. The judge's answer becomes an `EvalResult`, and the reward
is computed from it with the caller's `RewardConfig`. docs/security.md has the threat model,
docs/hacks.md every hack code and the timing protocol.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

VERDICTS = ("correct", "incorrect", "compile_error", "runtime_error", "timeout", "crashed", "hacked")
HACK_CODES = ("no_triton_kernel", "decoy_kernel", "output_cached", "output_aliases_input", "side_stream",
              "patched_function", "global_state_changed", "reference_access", "input_mutated",
              "bad_output_type", "degenerate_output", "precision_downgrade", "implausible_speedup",
              "thread_spawned", "reference_slowed")
# The job: the judge's phases in one process, the candidate in a confined runner beside it.
_JUDGE = "drkernel.judge:evaluate"
_RUNNER = {"target": "drkernel.runner:main"}


def resolve_device(device: str) -> str:
    """`auto` → `cuda` when a GPU is visible, else `cpu`; on cpu turn on Triton's interpreter
    (it must be set before anything applies @triton.jit, so scripts call this first)."""
    if device == "auto":
        import torch  # importing torch does not import triton's jit

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    return device


@dataclasses.dataclass
class EvalConfig:
    device: str = "auto"  # cpu | cuda | cuda:N | auto
    trials: int = 5
    perf_trials: int = 100
    warmup: int = 3
    timeout: float = 180.0
    atol_fp32: float = 1e-4
    rtol_fp32: float = 1e-4
    atol_half: float = 1e-2  # fp16 / bf16 outputs
    rtol_half: float = 1e-2
    rel_l2_fp32: float = 1e-3  # ||out - ref|| / ||ref||
    rel_l2_half: float = 2e-2
    loose_tol: float = 1e-2  # precision_downgrade: passes this but not the fp32 tolerance
    seed: int = 42
    second_distribution: bool = True
    l2_flush: bool = True
    profile: bool = True
    decoy_share: float = 0.05
    decoy_bytes_frac: float = 0.10
    max_speedup_recheck: float = 20.0
    cpu_perf_trials: int = 3
    # implausible if candidate_ms < factor * bytes / bandwidth, bandwidth = the larger of a 1 GiB
    # device copy and what the reference itself achieved (a 256 MB copy measured slower than
    # torch's own ReLU on the H200, which flagged the reference timed against itself)
    roofline_factor: float = 0.9
    side_stream_slack_ms: float = 0.1  # reference_slowed: absolute slack
    # The runner's time per call counts only while the judge's own clock agrees: judge time minus
    # the calibrated per-call overhead may exceed it by at most max(slack_ms, slack_frac x time)
    # (honest H200 calls measured up to 0.21 ms over); beyond, side_stream and the judge's clock.
    clock_slack_ms: float = 0.3
    clock_slack_frac: float = 0.1
    cpu_clock_slack_ms: float = 25.0  # a loaded 2-core CPU delays a process by milliseconds
    # Refuse to evaluate (runtime_error) when the kernel cannot confine the runner completely
    # (Landlock, network namespace, no capabilities); otherwise run and record what was active.
    require_confinement: bool = False
    # On-disk results keyed by both codes, these settings and the environment (drkernel.evalcache);
    # empty: no cache.
    cache_dir: str = ""
    ref_isolated_trials: int = 10  # reference alone before the candidate exists (reference_slowed guard)
    timing_block_calls: int = 10  # reference and candidate timings alternate in blocks of this many calls
    min_perf_trials: int = 20  # timing stops early once this many calls give a precise enough speedup
    speedup_precision: float = 0.01  # width of the speedup's 95 % bootstrap interval, relative
    ref_slowdown_limit: float = 1.5  # reference_slowed: interleaved reference > limit x isolated (+ slack)
    max_rss_mb: int = 0  # 0: no limit beyond the sandbox default
    max_output_chars: int = 20000
    # False only to measure torch-only candidates (baselines, the reference timed against itself):
    # then no Triton launch is required and the decoy checks are off. Never for rewards.
    require_triton: bool = True


@dataclasses.dataclass
class EvalResult:
    verdict: str = "crashed"
    compiled: bool = False
    correct: bool = False
    speedup: float | None = None
    ref_ms: float | None = None
    candidate_ms: float | None = None
    hacks: list = dataclasses.field(default_factory=list)
    error: str | None = None
    device: str | None = None
    timing: str | None = None
    trials_passed: int = 0
    trials: int = 0
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    speedup_interval: list | None = None  # 95 % bootstrap interval [low, high] of the speedup
    triton_time_share: float | None = None
    kernels: list | None = None
    reward: float | None = None
    reward_terms: dict | None = None
    wall_s: float | None = None
    stdout: str = ""
    stderr: str = ""
    details: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), default=_json_default)

    @classmethod
    def from_dict(cls, data: dict) -> "EvalResult":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return repr(o)


def _short(text: str | None, n: int = 2000) -> str:
    text = text or ""
    return text if len(text) <= n else text[: n // 2] + "\n...[truncated]...\n" + text[-n // 2:]


# ======================================================================================
# Parent side
# ======================================================================================

def _read(src: str | os.PathLike) -> tuple[str, str | None]:
    s = os.fspath(src)
    if "\n" not in s and os.path.isfile(s):
        return Path(s).read_text(), s
    return s, None


def _static_checks(ref_code: str, cand_code: str) -> EvalResult | None:
    import ast
    try:
        tree = ast.parse(cand_code)
    except SyntaxError as exc:
        return EvalResult(verdict="compile_error", error=f"SyntaxError: {exc.msg} (line {exc.lineno})")
    except (ValueError, TypeError) as exc:
        return EvalResult(verdict="compile_error", error=f"cannot parse candidate: {exc}")
    if not any(isinstance(n, ast.ClassDef) and n.name == "ModelNew" for n in ast.walk(tree)):
        return EvalResult(verdict="compile_error", error="no ModelNew defined in the candidate")
    return None


def _sandbox_env(device: str) -> dict:
    env = {}
    if device == "cpu" or (device == "auto" and not _cuda_available_parent()):
        env["TRITON_INTERPRET"] = "1"
    return env


def _cuda_available_parent() -> bool:
    # only asks when torch is already imported here; never initialises CUDA in the parent
    if "torch" in sys.modules:
        try:
            return bool(sys.modules["torch"].cuda.is_available())
        except Exception:
            return False
    return shutil.which("nvidia-smi") is not None


def _map_status(res: Any) -> EvalResult:
    status = getattr(res, "status", None)
    r = EvalResult()
    r.stdout = _short(getattr(res, "stdout", "") or "", 2000)
    r.stderr = _short(getattr(res, "stderr", "") or "", 2000)
    if status == "ok" and isinstance(getattr(res, "value", None), dict):
        v = EvalResult.from_dict(res.value)  # the judge's answer; stdout/stderr are the runner's
        if v.verdict not in VERDICTS:
            v.verdict, v.error = "crashed", f"unknown verdict {v.verdict!r}"
        return v
    if status == "timeout":
        r.verdict, r.error = "timeout", "evaluation exceeded the time limit"
    elif status == "exception":
        r.verdict = "runtime_error"
        err = getattr(res, "error", "") or ""
        r.error = _short(("CUDA error: " + err) if "CUDA error" in err or "illegal memory" in err else err, 600)
        r.details["traceback"] = _short(getattr(res, "traceback", "") or "", 2000)
    elif status == "signal":
        sig = getattr(res, "signal", None)
        try:
            import signal as _signal
            name = _signal.Signals(sig).name if sig else "a signal"
        except Exception:
            name = f"signal {sig}"
        r.verdict, r.error = "crashed", f"killed by {name}"
    elif status == "oom":
        r.verdict, r.error = "crashed", "out of memory (oom)"
    elif status == "exit_no_result":
        r.verdict, r.error = "crashed", f"process exited without a result (os._exit?), exit code {getattr(res, 'exitcode', None)}"
    elif status == "oversized_result":
        r.verdict, r.error = "crashed", "result too large (oversized_result)"
    else:
        r.verdict, r.error = "crashed", f"sandbox error: {getattr(res, 'error', '') or status}"
    return r


def _limits(cfg: EvalConfig):
    from drkernel.sandbox import SandboxLimits
    kw: dict[str, Any] = {"timeout_s": float(cfg.timeout), "max_output_chars": int(cfg.max_output_chars)}
    if cfg.max_rss_mb:
        kw["max_rss_mb"] = int(cfg.max_rss_mb)
    return SandboxLimits(**kw)


# What the fork server imports once, so that no evaluation pays for it: torch._dynamo and
# torch.profiler are imported by every child before its integrity snapshot (see step 4); the
# judge's comparison kernels are decorated once here.
_PRELOAD = ("torch", "triton", "torch._dynamo", "torch.profiler", "drkernel.compare_kernels")


class _Prepared:
    def __init__(self, reference, candidate, cfg: EvalConfig):
        self.cfg = cfg
        self.dir = tempfile.mkdtemp(prefix="drk_eval_")
        self.early: EvalResult | None = None
        try:
            ref_code, _ = _read(reference)
            cand_code, _ = _read(candidate)
        except OSError as exc:
            self.early = EvalResult(verdict="runtime_error", error=f"cannot read input: {exc}")
            return
        self.early = _static_checks(ref_code, cand_code)
        digest = hashlib.sha256(ref_code.encode()).hexdigest()[:12]
        self.ref_path = os.path.join(self.dir, f"reference_{digest}.py")
        self.cand_path = os.path.join(self.dir, "candidate_" + hashlib.sha256(cand_code.encode()).hexdigest()[:12] + ".py")
        if self.early is not None:
            return
        from drkernel import integrity
        found = integrity.static_scan(cand_code, self.ref_path)
        if found:
            codes = []
            for c, _ in found:
                if c not in codes:
                    codes.append(c)
            self.early = EvalResult(verdict="hacked", compiled=True, hacks=codes,
                                    error="static scan: " + "; ".join(f"{c}: {d}" for c, d in found[:8]),
                                    details={"static_findings": [list(f) for f in found]})
            return
        Path(self.ref_path).write_text(ref_code)
        Path(self.cand_path).write_text(cand_code)

    def kwargs(self) -> dict:
        return {"reference_path": self.ref_path, "candidate_path": self.cand_path,
                "config": dataclasses.asdict(self.cfg)}

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)


def _finish(r: EvalResult, cfg: EvalConfig, reward_config=None) -> EvalResult:
    if r.verdict != "correct":
        r.correct = False
        r.speedup = None
    if r.verdict == "hacked" and not r.hacks:
        r.hacks = ["patched_function"]
    if r.device is None:
        r.device = cfg.device
    r.wall_s = r.wall_s or 0.0  # the job's own seconds (the judge's); 0 when decided before any job
    try:
        from drkernel import rewards
        terms = rewards.compute_reward(r, reward_config or rewards.RewardConfig())
        r.reward = float(terms.reward)
        r.reward_terms = terms.to_dict()
    except Exception:
        pass
    return r


def evaluate(reference, candidate, cfg: EvalConfig | None = None, reward_config=None) -> EvalResult:
    """Evaluate one candidate (file path or source) against one reference (file path or source)
    with a sandbox of its own. `reward_config` (a `rewards.RewardConfig`, default weights when
    None) fills `reward`. For many evaluations keep one `Evaluator`."""
    with Evaluator(cfg, workers=1, reward_config=reward_config) as ev:
        return ev.evaluate(reference, candidate)


def _text(src) -> str:
    return _read(src)[0]


def _visible_gpus() -> list[str]:
    """Physical ids of the GPUs this process may use, asked without initialising CUDA here."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        return [v.strip() for v in vis.split(",") if v.strip()]
    try:
        q = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        return [str(i) for i, line in enumerate(q.stdout.splitlines()) if line.startswith("GPU")]
    except (OSError, subprocess.SubprocessError):
        return ["0"]


def _gpu_memory_gib() -> float:
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
        return min(float(v) for v in q.stdout.split()) / 1024
    except (OSError, subprocess.SubprocessError, ValueError):
        return 0.0


def default_workers_per_gpu(cpus: int, gpus: int, gpu_memory_gib: float) -> int:
    """Runners per GPU: one per 2 CPU cores of its share (compiles run on the host) and per 20 GiB
    of GPU memory, at most 6 (on one H200 with 16 cores, 6 and 8 ran the mixed set equally fast;
    the memory admission already runs the multi-GB problems two at a time)."""
    return max(1, min(6, cpus // (2 * max(1, gpus)), int(gpu_memory_gib // 20)))


def _gpu_oom(r: EvalResult) -> bool:
    err = (r.error or "").lower()
    return r.verdict in ("runtime_error", "crashed") and any(
        k in err for k in ("cuda out of memory", "outofmemoryerror", "cuda error: out of memory"))


# Import failures that cannot depend on the GPU the pre-flight import does not see.
_IMPORT_FAILURES = ("SyntaxError", "IndentationError", "TabError", "ImportError", "ModuleNotFoundError",
                    "NameError")


def _preflight_verdict(res: Any) -> EvalResult | None:
    """The verdict of the GPU-less pre-flight import when it is already final, else None. The
    candidate's process reports it, so only what can cost the candidate alone is believed: an
    import error raised by the candidate's own module code, or an import that outran the time limit
    (the full job, which imports the same file later, could not finish either)."""
    if getattr(res, "status", None) == "timeout":
        return EvalResult(verdict="timeout", error="importing the candidate exceeded the time limit",
                          details={"preflight": True})
    value = res.value if getattr(res, "status", None) == "ok" and isinstance(res.value, dict) else {}
    if value.get("type") in _IMPORT_FAILURES and value.get("raised_in_candidate") is True:
        return EvalResult(verdict="compile_error", error="candidate failed to import: " + str(value.get("error"))[:1400],
                          details={"preflight": True})
    return None


# Hack codes measured against this GPU's other work: a neighbour's work can cause them.
_NEIGHBOUR_SENSITIVE = ("reference_slowed", "side_stream", "implausible_speedup")
# Hack codes of a candidate whose own GPU work may have run outside its turn on the GPU (work on
# other streams or threads, or work that slowed its own reference); patched functions and changed
# globals stay inside the candidate's process.
_ESCAPING = ("side_stream", "thread_spawned", "reference_slowed")


@dataclasses.dataclass
class _Run:
    """One job's result and when it held a runner (monotonic seconds)."""
    result: EvalResult
    start: float = 0.0
    end: float = 0.0


@dataclasses.dataclass
class _Job:
    """A queued evaluation; `need` is known once its judge gave it back for lack of GPU memory."""
    index: int
    prep: "_Prepared"
    need: int | None = None
    capacity: int = 0
    gpu: str = "0"

    def fits(self) -> bool:
        from drkernel.sandbox import MemoryLedger
        return self.need is None or MemoryLedger(self.gpu, self.capacity).fits(self.need)


class _Queue:
    """Jobs in order, except that a job whose GPU memory does not fit now lets the next one that
    does go first: a runner never sits waiting for memory while other work could use it."""

    def __init__(self, jobs: list[_Job]):
        self._jobs = list(jobs)
        self._lock = threading.Lock()

    def take(self) -> _Job | None:
        with self._lock:
            if not self._jobs:
                return None
            k = next((k for k, job in enumerate(self._jobs) if job.fits()), 0)  # none fits: wait in the job
            return self._jobs.pop(k)

    def put_back(self, job: _Job) -> None:
        with self._lock:
            self._jobs.append(job)


def rerun_alone(runs: list[_Run]) -> dict[int, str]:
    """Which results of jobs that shared a GPU are measured again with the GPU alone, and why: a
    verdict or hack code that a neighbour could have caused (out of memory, a timeout spent waiting,
    timing-based hack codes), and every job that overlapped in time with a candidate whose own GPU
    work may have escaped its turn. Re-run alone, each gets the verdict a serial run gives."""
    why: dict[int, str] = {}
    for i, run in enumerate(runs):
        r = run.result
        if _gpu_oom(r):
            why[i] = "out of memory next to other jobs"
        elif r.verdict == "timeout" and not r.details.get("preflight"):
            why[i] = "timed out next to other jobs"
        elif set(r.hacks) & set(_NEIGHBOUR_SENSITIVE):
            why[i] = "a timing-based hack code measured next to other jobs"
    escaped = [k for k, run in enumerate(runs) if set(run.result.hacks) & set(_ESCAPING)]
    for i, run in enumerate(runs):
        for k in escaped:
            if k != i and i not in why and run.start < runs[k].end and runs[k].start < run.end:
                why[i] = f"ran next to a candidate whose GPU work may have escaped its turn ({', '.join(runs[k].result.hacks)})"
    return why


class Evaluator:
    """Sandbox workers for many evaluations: on a GPU machine `workers` per visible GPU (default
    from CPU cores and GPU memory); each job shares its GPU for correctness and holds it alone
    for every measurement (`sandbox.DeviceLock`), so verdicts do not depend on neighbours. A job
    that ran out of GPU memory next to others is run again holding the GPU alone. With
    `cfg.cache_dir`, results are cached on disk (`drkernel.evalcache`) and every result carries
    the environment it was measured in (`details.environment`)."""

    def __init__(self, cfg: EvalConfig | None = None, workers: int | None = None, reward_config=None):
        from drkernel.sandbox import SandboxPool
        self.cfg = cfg or EvalConfig()
        self.reward_config = reward_config
        env = _sandbox_env(self.cfg.device)
        gpus = _visible_gpus() if "TRITON_INTERPRET" not in env and _cuda_available_parent() else []
        per_gpu = workers or (default_workers_per_gpu(os.cpu_count() or 1, len(gpus), _gpu_memory_gib())
                              if gpus else 1)
        self.shared_gpu = bool(gpus) and per_gpu > 1
        n = per_gpu * max(1, len(gpus)) if workers is None else workers
        per_env = [{"CUDA_VISIBLE_DEVICES": gpus[i % len(gpus)]} for i in range(n)] if len(gpus) > 1 else None
        self.pool = SandboxPool(n, env, per_env, preload=_PRELOAD)
        self.cache = None
        if self.cfg.cache_dir:
            from drkernel.evalcache import EvalCache
            self.cache = EvalCache(self.cfg.cache_dir)

    @property
    def workers(self) -> int:
        return self.pool.workers

    def evaluate(self, reference, candidate) -> EvalResult:
        return self.evaluate_many([(reference, candidate)])[0]

    def evaluate_many(self, pairs) -> list[EvalResult]:
        """Results in the order of `pairs` ((reference, candidate): paths or source)."""
        from drkernel import evalcache
        texts = [(_text(r), _text(c)) for r, c in pairs]
        return evalcache.evaluate_cached(texts, self.cfg, self._run, self.cache, self.reward_config)

    def _run(self, pairs: list[tuple[str, str]]) -> list[EvalResult]:
        preps = [_Prepared(r, c, self.cfg) for r, c in pairs]
        try:
            todo = [i for i, p in enumerate(preps) if p.early is None]
            out = [p.early or EvalResult() for p in preps]
            runs = self._run_queue([_Job(k, preps[i]) for k, i in enumerate(todo)])
            for i, run in zip(todo, runs):
                out[i] = run.result
            if self.shared_gpu:  # one at a time: a job waiting for the GPU would spend its time limit
                for k, why in sorted(rerun_alone(runs).items()):
                    i = todo[k]
                    out[i] = self._evaluate_one(preps[i], exclusive=True).result
                    out[i].details["retried_alone"] = why
            return [_finish(r, self.cfg, self.reward_config) for r in out]
        finally:
            for p in preps:
                p.close()

    def _run_queue(self, jobs: list[_Job]) -> list[_Run]:
        """Every job on the pool's runners; a job given back for lack of GPU memory goes to the
        back of the queue with its need known (`_Queue`). Runs in the order of `jobs`."""
        from concurrent.futures import ThreadPoolExecutor
        queue, runs = _Queue(jobs), [_Run(EvalResult())] * len(jobs)

        def work() -> None:
            while (job := queue.take()) is not None:
                run = self._evaluate_one(job.prep, defer=job.need is None)
                deferred = run.result.details.get("deferred")
                if deferred:
                    job.need, job.capacity = int(deferred["memory_bytes"]), int(deferred["capacity_bytes"])
                    job.gpu = str(deferred["gpu"])
                    queue.put_back(job)
                else:
                    runs[job.index] = run

        n = max(1, min(self.workers, len(jobs)))
        with ThreadPoolExecutor(max_workers=n) as ex:
            for f in [ex.submit(work) for _ in range(n)]:
                f.result()
        return runs

    def _evaluate_one(self, prep: "_Prepared", exclusive: bool = False, defer: bool = False) -> _Run:
        """The pre-flight import (no GPU), then, unless that already decided, the judge's job
        (`defer`: given back at once, with `details.deferred`, when its GPU memory does not fit)."""
        pre = self.pool.run("drkernel.runner:preflight", {"candidate_path": prep.cand_path},
                            limits=_limits(self.cfg), env={"CUDA_VISIBLE_DEVICES": ""})
        early = _preflight_verdict(pre)
        if early is not None:
            early.wall_s = pre.wall_s
            return _Run(early)
        start = time.monotonic()
        res = self.pool.run(_JUDGE, {**prep.kwargs(), "exclusive": exclusive, "defer": defer}, runner=_RUNNER,
                            limits=_limits(self.cfg))
        result = _map_status(res)
        # the pre-flight's and the whole sandbox job's seconds (forks and process exits included)
        result.details["overhead_s"] = {"preflight": round(pre.wall_s, 3), "job": round(res.wall_s, 3)}
        return _Run(result, start, time.monotonic())

    def close(self):
        with contextlib.suppress(Exception):
            self.pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ======================================================================================
# CLI
# ======================================================================================

class _ArgParser(argparse.ArgumentParser):
    def error(self, message):
        sys.stderr.write(f"drkernel.evaluator: error: {message}\n")
        raise SystemExit(2)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = _ArgParser(prog="python -m drkernel.evaluator", description="Evaluate a ModelNew candidate.")
    p.add_argument("--reference", required=True)
    p.add_argument("--candidate", required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--trials", type=int)
    p.add_argument("--perf-trials", type=int)
    p.add_argument("--cpu-perf-trials", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--timeout", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--atol", type=float)
    p.add_argument("--rtol", type=float)
    p.add_argument("--max-rss-mb", type=int)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--no-second-distribution", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if not (a.device in ("auto", "cpu", "cuda") or a.device.startswith("cuda:") and a.device[5:].isdigit()):
        p.error(f"bad --device {a.device!r} (cpu, cuda, cuda:N or auto)")
    for name in ("reference", "candidate"):
        if not os.path.isfile(getattr(a, name)):
            p.error(f"--{name}: no such file: {getattr(a, name)}")
    cfg = EvalConfig(device=a.device)
    if a.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    for k in ("trials", "perf_trials", "cpu_perf_trials", "warmup", "timeout", "seed", "max_rss_mb"):
        v = getattr(a, k)
        if v is not None:
            setattr(cfg, k, v)
    if a.atol is not None:
        cfg.atol_fp32 = a.atol
    if a.rtol is not None:
        cfg.rtol_fp32 = a.rtol
    if a.no_profile:
        cfg.profile = False
    if a.no_second_distribution:
        cfg.second_distribution = False
    try:
        r = evaluate(a.reference, a.candidate, cfg)
    except Exception as exc:  # the CLI never crashes on a hostile candidate
        r = EvalResult(verdict="crashed", error=f"evaluator error: {type(exc).__name__}: {exc}")
    if a.json:
        sys.stdout.write("\n" + r.to_json() + "\n")
    else:
        sp = f"{r.speedup:.3f}x" if r.speedup is not None else "-"
        print(f"verdict: {r.verdict}  speedup: {sp} ({r.timing})  ref_ms: {r.ref_ms}  candidate_ms: {r.candidate_ms}")
        if r.hacks:
            print(f"hacks: {', '.join(r.hacks)}")
        if r.error:
            print(f"error: {r.error}")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
