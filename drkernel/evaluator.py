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
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from drkernel.evaltypes import HACK_CODES, VERDICTS, EvalConfig, EvalResult  # noqa: F401 (re-exported)
from drkernel import confine, evalcache, rewards
from drkernel.channel import cuda_fault, short
from drkernel.confine import hidden_dirs
from drkernel.gpushare import MemoryLedger, plan_cores
from drkernel.sandbox import SandboxLimits, SandboxPool
from drkernel.tasks import text_digest



def _device_problem(device: str) -> str | None:
    """Why `device` cannot be used here, or None. Checked before any work: a missing GPU would
    otherwise come back as the candidate's runtime_error."""
    if device in ("auto", "cpu"):
        return None
    index = "0" if device == "cuda" else device.removeprefix("cuda:")
    if not device.startswith("cuda") or not (index.isascii() and index.isdigit()):
        return f"bad --device {device!r}: use auto, cpu, cuda or cuda:N"
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0:
        return f"--device {device}: no GPU is visible (torch.cuda.is_available() is False); use --device cpu or auto"
    if int(index) >= visible:
        return f"--device {device}: only {visible} GPU(s) visible (cuda:0 to cuda:{visible - 1})"
    return None


class DeviceError(ValueError):
    """A device this machine cannot evaluate on (the message is for the user)."""


class ConfinementError(RuntimeError):
    """The kernel lacks a layer of the runner's confinement and `require_confinement` is on."""


def resolve_device(device: str) -> str:
    """`auto` → `cuda` when a GPU is visible, else `cpu`; on cpu turn on Triton's interpreter
    (it must be set before anything applies @triton.jit, so scripts call this first). A device
    this machine lacks raises DeviceError with a message for the user. Only asks torch whether
    CUDA is available, which leaves later forks usable."""
    problem = _device_problem(device)
    if problem:
        raise DeviceError(problem)
    if device == "auto":
        import torch  # importing torch does not import triton's jit

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    return device


# ======================================================================================
# Parent side
# ======================================================================================

def _read(src: str | os.PathLike) -> tuple[str, str | None]:
    """(text, path) of a file path, or (src, None) for source given as text. Bytes that are not
    UTF-8 become U+FFFD: outside strings and comments they fail to parse (`compile_error`)."""
    s = os.fspath(src)
    if "\n" not in s and os.path.isfile(s):
        return Path(s).read_bytes().decode("utf-8", "replace"), s
    if "\n" not in s and (os.path.isdir(s) or s.strip().endswith(".py")):  # a path, not one line of code
        raise FileNotFoundError(_not_a_file(s))
    return s, None


def _not_a_file(path: str) -> str:
    """What is wrong with a path that is not a regular file (a directory, a FIFO, a device)."""
    return f"not a regular file: {path}" if os.path.lexists(path) else f"no such file: {path}"


def _foreign_encoding(code: str) -> str | None:
    """Why the file's coding declaration is refused: Python, decoding the UTF-8 file it is written
    to by that declaration, would read other code than the text every check here reads (in UTF-7
    a comment can hold a line that runs)."""
    import io
    import tokenize
    data = code.encode("utf-8", "surrogatepass")
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        if encoding in ("utf-8", "utf-8-sig") or data.decode(encoding) == code:
            return None
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:  # LookupError: a codec not for text
        return f"coding declaration: {exc}"
    return f"coding declaration {encoding!r}: Python would read other code than this text"


def _static_checks(cand_code: str, cfg: EvalConfig, ref_path: str) -> EvalResult | None:
    """Verdicts the candidate's text alone decides: it must parse, define `ModelNew` and (where
    Triton is required) define a `@triton.jit` kernel; then the static scan. One parse serves all."""
    import ast

    from drkernel.triton_source import jit_kernels, python_calls
    if problem := _foreign_encoding(cand_code):
        return EvalResult(verdict="compile_error", error=problem)
    try:
        tree = ast.parse(cand_code)
    except SyntaxError as exc:
        return EvalResult(verdict="compile_error", error=f"SyntaxError: {exc.msg} (line {exc.lineno})")
    except (ValueError, TypeError) as exc:
        return EvalResult(verdict="compile_error", error=f"cannot parse candidate: {exc}")
    if not any(isinstance(n, ast.ClassDef) and n.name == "ModelNew" or isinstance(n, ast.Name) and n.id == "ModelNew"
               and isinstance(n.ctx, ast.Store) for n in ast.walk(tree)):  # `ModelNew = TritonReLU` too
        return EvalResult(verdict="compile_error", error="no ModelNew defined in the candidate")
    if cfg.require_triton and not jit_kernels(tree):
        return EvalResult(verdict="hacked", compiled=True, hacks=["no_triton_kernel"],
                          error="no_triton_kernel: the candidate's source defines no @triton.jit kernel")
    calls = python_calls(cand_code, tree)
    if calls:
        return EvalResult(verdict="compile_error", error=f"the @triton.jit kernels cannot be judged as written (Python "
                                                         f"Triton does not compile, or a borrowed name): {'; '.join(calls[:4])}")
    return _scan_verdict(tree, ref_path)


def _sandbox_env(device: str) -> dict:
    env = {}
    if device == "cpu" or (device == "auto" and not _cuda_available_parent()):
        env["TRITON_INTERPRET"] = "1"
    return env


def _cuda_available_parent() -> bool:
    # asks torch only when it is already imported here (the CLI starts its fork servers before
    # importing it); never initialises CUDA in the parent
    if "torch" in sys.modules:
        try:
            return bool(sys.modules["torch"].cuda.is_available())
        except Exception:
            return False
    return evalcache.uses_gpu("auto")


def _map_status(res: Any) -> EvalResult:
    """The verdict of a sandbox job that ended without an answer."""
    status = getattr(res, "status", None)
    r = EvalResult()
    r.stdout = short(getattr(res, "stdout", ""), 2000)
    r.stderr = short(getattr(res, "stderr", ""), 2000)
    if status == "timeout":
        r.verdict, r.error = "timeout", "evaluation exceeded the time limit"
    elif status == "exception":
        r.verdict = "runtime_error"
        err = getattr(res, "error", "") or ""
        r.error = short(("CUDA error: " + err) if cuda_fault(err) else err, 600)
        r.details["traceback"] = short(getattr(res, "traceback", ""), 2000)
    elif status == "signal":
        sig = getattr(res, "signal", None)
        try:
            import signal as _signal
            name = _signal.Signals(sig).name if sig else "a signal"
        except Exception:
            name = f"signal {sig}"
        # the job's process is the judge, which never runs candidate code: the machine's failure
        # (a full disk faults a mapped file), never the candidate's own fault signal
        r.verdict, r.error = "crashed", f"judge error: the judge was killed by {name}"
    elif status == "oom":
        r.verdict, r.error = "crashed", "out of memory (oom)"
    elif status == "exit_no_result":
        r.verdict, r.error = "crashed", f"process exited without a result (os._exit?), exit code {getattr(res, 'exitcode', None)}"
    elif status == "oversized_result":
        r.verdict, r.error = "crashed", "result too large (oversized_result)"
    else:
        r.verdict, r.error = "crashed", f"sandbox error: {getattr(res, 'error', '') or status}"
    return r


def _map_group(res: Any, n: int) -> list[EvalResult]:
    """The group job's results, one per candidate; a job that ended without them (killed, timed
    out, crashed) gives every candidate the verdict its ending maps to."""
    value = getattr(res, "value", None)
    items = value.get("results") if getattr(res, "status", None) == "ok" and isinstance(value, dict) else None
    if isinstance(items, list) and len(items) == n and all(isinstance(d, dict) for d in items):
        out = [EvalResult.from_dict(d) for d in items]
        for r in out:
            if r.verdict not in VERDICTS:
                r.verdict, r.error = "crashed", f"unknown verdict {r.verdict!r}"
        return out
    if getattr(res, "status", None) == "ok":
        return [EvalResult(verdict="crashed", error="the judge's answer was malformed") for _ in range(n)]
    return [_map_status(res) for _ in range(n)]


def _limits(cfg: EvalConfig, jobs: int = 1):
    """Sandbox limits for one job that judges `jobs` - 1 candidates after its reference set-up:
    each of them may use the whole `timeout`."""
    kw: dict[str, Any] = {"timeout_s": float(cfg.timeout) * jobs}
    if cfg.max_rss_mb:
        kw["max_rss_mb"] = int(cfg.max_rss_mb)
    return SandboxLimits(**kw)


# What the fork server imports once, so that no evaluation pays for it: torch._dynamo and
# torch.profiler are imported by every child before its integrity snapshot (see step 4); the
# judge's comparison kernels are decorated once here. The parent names the jobs' functions
# (below) without importing them, so it never loads torch for the judge's sake.
_PRELOAD = ("torch", "triton", "torch._dynamo", "torch.profiler", "drkernel.compare_kernels",
            "drkernel.judge", "drkernel.runner")
_JUDGE, _RUNNER, _PREFLIGHT = "drkernel.judge:evaluate", "drkernel.runner:main", "drkernel.runner:preflight"


def _scan_verdict(tree: Any, ref_path: str) -> EvalResult | None:
    """`hacked` with every code the static scan of the candidate's parsed tree finds, or None."""
    from drkernel import integrity
    found = integrity.static_scan(tree, ref_path)
    if not found:
        return None
    codes = list(dict.fromkeys(c for c, _ in found))
    return EvalResult(verdict="hacked", compiled=True, hacks=codes,
                      error="static scan: " + "; ".join(f"{c}: {d}" for c, d in found[:8]),
                      details={"static_findings": [list(f) for f in found]})


class _Prepared:
    def __init__(self, ref_code: str, cand_code: str, cfg: EvalConfig):
        self.cfg = cfg
        self.dir = tempfile.mkdtemp(prefix="drk_eval_")
        self.early: EvalResult | None = None
        self.preflight_s = 0.0
        self.ref_digest = text_digest(ref_code)[:12]
        self.ref_path = os.path.join(self.dir, f"reference_{self.ref_digest}.py")
        self.cand_path = os.path.join(self.dir, "candidate_" + text_digest(cand_code)[:12] + ".py")
        try:  # whatever a hostile text makes these checks raise (nesting too deep for Python's
            # parser, say) fails its own item, never the batch
            self.early = _static_checks(cand_code, cfg, self.ref_path)
        except Exception as exc:  # noqa: BLE001
            self.early = EvalResult(verdict="compile_error", error=f"cannot analyse candidate: {type(exc).__name__}")
        if self.early is not None:
            return
        Path(self.ref_path).write_text(ref_code, encoding="utf-8")
        Path(self.cand_path).write_text(cand_code, encoding="utf-8")

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)


def _finish(r: EvalResult, cfg: EvalConfig) -> EvalResult:
    """A fresh result made consistent: no speedup without `correct`, a hacked one names a code."""
    if r.verdict != "correct":
        r.correct = False
        r.speedup = None
    if r.verdict == "hacked" and not r.hacks:
        r.hacks = ["patched_function"]
    if r.device is None:
        r.device = cfg.device
    r.wall_s = r.wall_s or 0.0  # the job's own seconds (the judge's); 0 when decided before any job
    return r


def evaluate(reference, candidate, cfg: EvalConfig | None = None, reward_config=None) -> EvalResult:
    """Evaluate one candidate (file path or source) against one reference (file path or source)
    with a sandbox of its own. `reward_config` (a `rewards.RewardConfig`, default weights when
    None) fills `reward`. For many evaluations keep one `Evaluator`."""
    with Evaluator(cfg, workers=1, reward_config=reward_config) as ev:
        return ev.evaluate(reference, candidate)


def _source(src: Any) -> tuple[str, str | None]:
    """(source text, why a path could not be read) of a path or of text, read once: a text is never
    taken for a path again (a candidate whose text names a file would be judged as that file).
    Bytes decode as UTF-8 (U+FFFD for the rest), a leading byte-order mark dropped as Python drops
    it from a file. Any other value (None: a policy that wrote no code) is no source, an empty text
    that fails the static checks like one, so that one bad item costs its own verdict, not the batch."""
    if isinstance(src, bytes):
        return src.decode("utf-8", "replace").removeprefix("\ufeff"), None
    if not isinstance(src, (str, os.PathLike)):
        return "", None
    try:
        text = _read(src)[0]
    except OSError as exc:
        return "", str(exc)
    # a lone surrogate (JSON can carry one) cannot be written or parsed: U+FFFD, as bad bytes become
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace").removeprefix("\ufeff"), None


def _pair(item: Any) -> tuple[Any, Any]:
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise TypeError(f"evaluate_many takes (reference, candidate) pairs, got {str(item)[:80]!r}")
    return item[0], item[1]


def _visible_gpus() -> list[str]:
    """Physical ids of the GPUs this process may use, asked without initialising CUDA here."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        return [v.strip() for v in vis.split(",") if v.strip()]
    host = evalcache.host_gpu_count()
    return ["0"] if host is None else [str(i) for i in range(host)]


def _host_gpu_numbers(visible: list[str]) -> list[int]:
    """Every GPU of the host by the number a judge knows it by (`judge._physical_gpu`: the
    `CUDA_VISIBLE_DEVICES` entry, or 0 for one named by UUID), so that evaluators in several
    processes (one per rank or per GPU) plan the same timing core for each GPU and keep all of
    them free."""
    return sorted({0, *range(evalcache.host_gpu_count() or 0), *(int(g) for g in visible if g.isdigit())})


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
    return r.verdict in ("runtime_error", "crashed", "reference_error") and any(
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
    """Queued candidates of one reference, judged in one sandbox job against one reference build,
    reference timing and set of reference outputs; `need` is known once its judge gave it back
    for lack of GPU memory. `index` are the candidates' places in the batch."""
    index: list[int]
    preps: list["_Prepared"]
    need: int | None = None
    capacity: int = 0
    gpu: str = "0"

    def fits(self) -> bool:
        return self.need is None or MemoryLedger(self.gpu, self.capacity).fits(self.need)


def groups(preps: list["_Prepared"], todo: list[int], size: int) -> list[_Job]:
    """The candidates to judge, by reference (first seen first), in groups of at most `size`."""
    by_ref: dict[str, list[int]] = {}
    for k, i in enumerate(todo):
        by_ref.setdefault(preps[i].ref_digest, []).append(k)
    return [_Job(index=ks[a:a + size], preps=[preps[todo[k]] for k in ks[a:a + size]])
            for ks in by_ref.values() for a in range(0, len(ks), max(1, size))]


class _Queue:
    """Jobs in order, except that a job whose GPU memory does not fit now lets the next one that
    does go first: a runner never sits waiting for memory while other work could use it. When
    none fits, the worker waits here, outside any job: a job's time limit is its own work's, and
    one that waited for its neighbours' memory inside it ran out of time before its reference
    was even built. After `patience_s` the first job goes anyway (and waits in its job). Jobs
    taken at once may together not fit (nothing is reserved until their judges ask): the later
    ones wait in their jobs, with the group's deadline paused (`judge._deadlines_paused`)."""

    def __init__(self, jobs: list[_Job], patience_s: float = 600.0, poll_s: float = 0.1):
        self._jobs = list(jobs)
        self._lock = threading.Lock()
        self.patience_s, self.poll_s = patience_s, poll_s

    def take(self) -> _Job | None:
        give_up = time.monotonic() + self.patience_s
        while True:
            with self._lock:
                if not self._jobs:
                    return None
                k = next((k for k, job in enumerate(self._jobs) if job.fits()), None)
                if k is not None or time.monotonic() > give_up:
                    return self._jobs.pop(k or 0)
            time.sleep(self.poll_s)

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
        elif r.details.get("gpu_busy"):
            why[i] = "the GPU stayed busy with other jobs' work before a measurement"
    escaped = [k for k, run in enumerate(runs) if set(run.result.hacks) & set(_ESCAPING)]
    for i, run in enumerate(runs):
        for k in escaped:
            if k != i and i not in why and run.start < runs[k].end and runs[k].start < run.end:
                why[i] = f"ran next to a candidate whose GPU work may have escaped its turn ({', '.join(runs[k].result.hacks)})"
    return why


class Evaluator:
    """Sandbox workers for many evaluations: on a GPU machine `workers` per visible GPU (default
    from CPU cores and GPU memory); each job shares its GPU for correctness and holds it alone
    for every measurement (`gpushare.DeviceLock`), so verdicts do not depend on neighbours. The
    candidates of one reference are judged in one job, `group_size` at a time (one reference build,
    timing and set of outputs; verdicts as if judged one by one). A candidate whose result a
    neighbour could have caused is run again holding the GPU alone. With
    `cfg.cache_dir`, results are cached on disk (`drkernel.evalcache`) and every result carries
    the environment it was measured in (`details.environment`)."""

    def __init__(self, cfg: EvalConfig | None = None, workers: int | None = None, reward_config=None,
                 group_size: int = 8):
        from drkernel.config import ConfigError, limit_problems

        self.cfg = cfg or EvalConfig()
        if problems := limit_problems(self.cfg):  # as the scripts check it: before any process starts
            raise ConfigError("EvalConfig: " + "; ".join(problems))
        if problem := _device_problem(self.cfg.device):  # not every candidate's runtime_error
            raise DeviceError(problem)
        self.reward_config = reward_config
        self.group_size = max(1, int(group_size))
        env = _sandbox_env(self.cfg.device)
        gpus = _visible_gpus() if "TRITON_INTERPRET" not in env and _cuda_available_parent() else []
        per_gpu = workers or (default_workers_per_gpu(os.cpu_count() or 1, len(gpus), _gpu_memory_gib())
                              if gpus else 1)
        self.shared_gpu = bool(gpus) and per_gpu > 1
        n = per_gpu * max(1, len(gpus)) if workers is None else workers
        per_env = [{"CUDA_VISIBLE_DEVICES": gpus[i % len(gpus)]} for i in range(n)] if len(gpus) > 1 else None
        self.cores = plan_cores(_host_gpu_numbers(gpus) if gpus else [], os.sched_getaffinity(0))
        self.pool = SandboxPool(n, env, per_env, preload=_PRELOAD, cores=self.cores.work)
        # taken while the fork servers start (it imports torch here): the two overlap
        self.environment = evalcache.fingerprint(self.cfg.device)
        if self.cfg.require_confinement:
            self._check_confinement()
        self._ends_importer: dict[str, bool] = {}  # reference digest -> `_reference_ends_its_importer`
        self.cache = None
        if self.cfg.cache_dir:
            self.cache = evalcache.EvalCache(self.cfg.cache_dir)

    @property
    def workers(self) -> int:
        return self.pool.workers

    def _check_confinement(self) -> None:
        """Refuse at once, with a way out, where this kernel cannot confine a runner."""
        res = self.pool.run(confine.probe, {}, env={"CUDA_VISIBLE_DEVICES": ""})
        report = res.value if res.ok and isinstance(res.value, dict) else {}
        if not report.get("complete"):
            self.close()
            missing = "; ".join(map(str, report.get("errors") or [res.error or "incomplete"]))
            raise ConfinementError(
                f"this machine cannot confine the evaluator's runner ({missing}). Candidate code would run "
                "with access to the network, other jobs' files and the GPU locks. To evaluate anyway, only code "
                "you trust, set require_confinement to false (--require_confinement false).")

    def evaluate(self, reference, candidate) -> EvalResult:
        return self.evaluate_many([(reference, candidate)])[0]

    def evaluate_many(self, pairs) -> list[EvalResult]:
        """Results in the order of `pairs` ((reference, candidate): paths or source)."""
        if self.pool.closed:
            raise RuntimeError("this Evaluator is closed: make a new one")
        sources = [(_source(r), _source(c)) for r, c in map(_pair, pairs)]
        unread = [ref[1] or cand[1] for ref, cand in sources]
        texts = [(ref[0], cand[0]) for (ref, cand), why in zip(sources, unread) if why is None]
        fresh = iter(evalcache.evaluate_cached(texts, self.cfg, self._run, self.cache, self.environment))
        results = [next(fresh) if why is None else EvalResult(verdict="runtime_error", error=f"cannot read input: {why}")
                   for why in unread]
        for r in results:  # the reward, scored here once, with this caller's weights, fresh or cached
            r.reward = None
            rewards.score(r, self.reward_config)
        return results

    def _run(self, pairs: list[tuple[str, str]]) -> list[EvalResult]:
        preps = [_Prepared(r, c, self.cfg) for r, c in pairs]
        try:
            todo = [i for i, p in enumerate(preps) if p.early is None]
            out = [p.early or EvalResult() for p in preps]
            runs = self._run_queue(groups(preps, todo, self.group_size), len(todo))
            for i, run in zip(todo, runs):
                out[i] = run.result
            if self.shared_gpu:  # one at a time: a job waiting for the GPU would spend its time limit
                for k, why in sorted(rerun_alone(runs).items()):
                    i = todo[k]
                    out[i] = self._evaluate_group([preps[i]], exclusive=True)[0].result
                    out[i].details["retried_alone"] = why
            return [_finish(r, self.cfg) for r in out]
        finally:
            for p in preps:
                p.close()

    def _run_queue(self, jobs: list[_Job], n_results: int) -> list[_Run]:
        """Every group on the pool's runners; a group given back for lack of GPU memory goes to the
        back of the queue with its need known (`_Queue`). Results in the candidates' order."""
        from concurrent.futures import ThreadPoolExecutor
        queue, runs = _Queue(jobs, patience_s=float(self.cfg.timeout)), [_Run(EvalResult())] * n_results
        n = max(1, min(self.workers, len(jobs)))
        with ThreadPoolExecutor(max_workers=n) as ex:
            for f in [ex.submit(self._drain, queue, runs) for _ in range(n)]:
                f.result()
        return runs

    def _drain(self, queue: _Queue, runs: list[_Run]) -> None:
        """One worker's loop: groups from the queue until it is empty."""
        while (job := queue.take()) is not None:
            done = self._evaluate_group(job.preps, defer=job.need is None)
            deferred = next((r.result.details["deferred"] for r in done if r.result.details.get("deferred")), None)
            if deferred:
                job.need, job.capacity = int(deferred["memory_bytes"]), int(deferred["capacity_bytes"])
                job.gpu = str(deferred["gpu"])
                queue.put_back(job)
                continue
            for k, run in zip(job.index, done):
                runs[k] = run

    def _import_alone(self, path: str) -> Any:
        """The sandbox's result of importing `path` in a confined process that sees no GPU."""
        return self.pool.run(_PREFLIGHT, {"candidate_path": path, "hidden": hidden_dirs()},
                             limits=_limits(self.cfg), env={"CUDA_VISIBLE_DEVICES": ""})

    def _preflight(self, prep: "_Prepared") -> EvalResult | None:
        """The GPU-less pre-flight import; its verdict when it already decides."""
        pre = self._import_alone(prep.cand_path)
        early = _preflight_verdict(pre)
        if early is not None:
            early.wall_s = pre.wall_s
        prep.preflight_s = pre.wall_s
        return early

    def _reference_ends_its_importer(self, prep: "_Prepared") -> bool:
        """Whether importing the reference alone ends the process (the judge imports it, so its
        job would end without an answer, blamed on the candidates). Asked once per reference."""
        if prep.ref_digest not in self._ends_importer:
            pre = self._import_alone(prep.ref_path)
            self._ends_importer[prep.ref_digest] = pre.status in ("exit_no_result", "signal")
        return self._ends_importer[prep.ref_digest]

    def _evaluate_group(self, preps: list["_Prepared"], exclusive: bool = False, defer: bool = False) -> list[_Run]:
        """Each candidate's pre-flight import (no GPU), then one judge's job for those it did not
        decide (`defer`: given back at once, with `details.deferred`, when its GPU memory does not fit)."""
        early = [self._preflight(p) for p in preps]
        runs = [_Run(e) if e is not None else None for e in early]
        todo = [p for p, e in zip(preps, early) if e is None]
        judged = iter(self._judge(todo, exclusive, defer) if todo else [])
        return [run if run is not None else next(judged) for run in runs]

    def _judge(self, todo: list["_Prepared"], exclusive: bool, defer: bool) -> list[_Run]:
        """One judge's job for the candidates of `todo`. A job of several that ended without an
        answer (a limit of the whole job, a crash, an error of the sandbox itself) is done again one
        candidate a job, so that no candidate is given an ending another one caused."""
        start = time.monotonic()
        kwargs = {"reference_path": todo[0].ref_path, "candidate_paths": [p.cand_path for p in todo],
                  "config": dataclasses.asdict(self.cfg), "exclusive": exclusive, "defer": defer,
                  "timing_cores": sorted(self.cores.timing.items())}
        res = self.pool.run(_JUDGE, kwargs, runners=[_RUNNER] * (1 + len(todo)),
                            limits=_limits(self.cfg, jobs=1 + len(todo)))
        if res.status in ("exit_no_result", "signal") and self._reference_ends_its_importer(todo[0]):
            err = "the reference ends the process that imports it (os._exit or a signal at import)"
            return [_Run(EvalResult(verdict="reference_error", error=err), start, time.monotonic()) for _ in todo]
        if res.status != "ok" and len(todo) > 1:
            return [run for p in todo for run in self._judge([p], exclusive, defer)]
        runs = []
        for prep, result in zip(todo, _map_group(res, len(todo))):
            # the pre-flight's and the whole sandbox job's seconds (forks and process exits included)
            result.details["overhead_s"] = {"preflight": round(prep.preflight_s, 3), "job": round(res.wall_s, 3),
                                            "group": len(todo)}
            runs.append(_Run(result, start, time.monotonic()))
        return runs

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

# python -m drkernel.evaluator --reference REF.py --candidate CAND.py [--json] [--key value ...]
#
# One flag per EvalConfig field a user sets, spelt like every other script (`--perf_trials`; the
# dashed `--perf-trials` is accepted too), its type and default read from the dataclass. Values
# are range-checked and the device is checked before any work, so a bad command line is a usage
# error, never a verdict. Exit status (also in `--help`): 0 when a verdict was produced, whatever
# it is; 2 for a usage error (bad flag or value, missing file, unusable device). With --json the
# last stdout line is JSON either way: the EvalResult, or {"error": "...", "usage_error": true}.

_EPILOG = """\
exit status:
  0  a verdict was produced, whatever it is (correct, incorrect, hacked, timeout, ...)
  2  usage error: bad flag or value, missing file, unusable device
With --json the last stdout line is JSON: the result, or {"error": "...", "usage_error": true}."""


class _UsageError(Exception):
    """A command line the CLI refuses: exit status 2, never a verdict."""


@dataclasses.dataclass(frozen=True)
class _Option:
    """An EvalConfig field as a flag. It is also the flag's argparse `type`: it converts the text to
    the field's type and refuses what the field's rule (`EvalConfig.LIMITS`) refuses."""

    name: str
    help: str
    aliases: tuple[str, ...] = ()
    metavar: str = ""  # empty: the type's name (INT, FLOAT, STR)

    def flags(self) -> list[str]:
        """`--perf_trials`, then `--perf-trials` and any older spelling."""
        return list(dict.fromkeys([f"--{self.name}", f"--{self.name.replace('_', '-')}", *self.aliases]))

    def field_type(self) -> Any:
        import typing

        return typing.get_type_hints(EvalConfig)[self.name]

    def __call__(self, text: str) -> Any:
        from drkernel.config import ConfigError, coerce

        try:
            value = coerce(text, self.field_type(), self.name)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        rule = EvalConfig.LIMITS.get(self.name)
        problem = rule.problem(self.name, value) if rule is not None and not isinstance(value, bool) else None
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value


_OPTIONS = (
    _Option("device", "auto | cpu | cuda | cuda:N (auto: cuda when a GPU is visible, else cpu)", metavar="DEVICE"),
    _Option("trials", "correctness trials, each on fresh random inputs"),
    _Option("perf_trials", "timed calls per program on a GPU, at most (timing stops once the speedup is "
                           "precise enough)"),
    _Option("cpu_perf_trials", "timed calls per program on a CPU"),
    _Option("warmup", "untimed calls before timing (at least one runs)"),
    _Option("timeout", "seconds for the reference's set-up and timing, and again for the candidate"),
    _Option("seed", "seed of the random inputs and weights"),
    _Option("atol_fp32", "absolute tolerance for fp32 outputs", aliases=("--atol",)),
    _Option("rtol_fp32", "relative tolerance for fp32 outputs", aliases=("--rtol",)),
    _Option("atol_half", "absolute tolerance for fp16 / bf16 outputs"),
    _Option("rtol_half", "relative tolerance for fp16 / bf16 outputs"),
    _Option("rel_l2_fp32", "largest ||out - ref|| / ||ref|| for fp32 outputs"),
    _Option("rel_l2_half", "largest ||out - ref|| / ||ref|| for fp16 / bf16 outputs"),
    _Option("profile", "profile the candidate's kernels (Triton time share; GPU only)"),
    _Option("second_distribution", "also check correctness on signed-normal inputs"),
    _Option("require_triton", "require the candidate to launch a Triton kernel (false only to measure "
                              "torch-only candidates; never for rewards)"),
    _Option("require_confinement", "refuse to run the candidate when the runner cannot be fully confined "
                                   "(false only for code you trust)"),
    _Option("baseline", "what the speedup is measured against: eager (the reference as written) or "
                        "compile (its forward under torch.compile, compiled before any timing)", metavar="eager|compile"),
    _Option("cache_dir", "directory of cached results (empty: no cache)", metavar="DIR"),
    _Option("max_rss_mb", "memory limit in MB (0: the sandbox default)"),
)


class _ArgParser(argparse.ArgumentParser):
    """Errors print the usual message on stderr, then raise `_UsageError` so `main` can answer in JSON."""

    def error(self, message):
        self.print_usage(sys.stderr)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise _UsageError(message)


def _add_option(p: argparse.ArgumentParser, opt: _Option) -> None:
    """The flag for `opt`, its default from EvalConfig; a boolean takes true|false (bare: true) and
    has a `--no_x` / `--no-x` alias for false."""
    from drkernel.config import field_default

    tp = opt.field_type()
    shown = f"{opt.help} (default: %(default)r)"
    if tp is bool:
        p.add_argument(*opt.flags(), type=opt, nargs="?", const=True, default=field_default(EvalConfig, opt.name),
                       metavar="true|false", help=shown)
        p.add_argument(f"--no_{opt.name}", f"--no-{opt.name.replace('_', '-')}", dest=opt.name,
                       action="store_false", default=argparse.SUPPRESS, help=f"same as --{opt.name} false")
    else:
        p.add_argument(*opt.flags(), type=opt, default=field_default(EvalConfig, opt.name),
                       metavar=opt.metavar or tp.__name__.upper(), help=shown)


def _parser() -> _ArgParser:
    p = _ArgParser(prog="python -m drkernel.evaluator", allow_abbrev=False, epilog=_EPILOG,
                   formatter_class=argparse.RawDescriptionHelpFormatter,
                   description="Evaluate one ModelNew candidate against one KernelBench reference in the sandbox.")
    p.add_argument("--reference", required=True, metavar="PATH", help="the reference program (defines Model)")
    p.add_argument("--candidate", required=True, metavar="PATH", help="the candidate program (defines ModelNew)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on the last stdout line")
    for opt in _OPTIONS:
        _add_option(p, opt)
    return p


@dataclasses.dataclass
class _Command:
    reference: str
    candidate: str
    cfg: EvalConfig
    json: bool


def _parse(argv: list[str]) -> _Command:
    """The command line, checked; `_UsageError` (its message already on stderr) when it is unusable."""
    from drkernel.config import cache_dir_problem

    p = _parser()
    a = p.parse_args(argv)
    try:  # `auto` is left to the judge, which asks torch itself: importing torch here would add
        # seconds before the fork server even starts
        device = a.device if a.device == "auto" else resolve_device(a.device)
    except ValueError as exc:
        p.error(str(exc))
    for flag, path in (("--reference", a.reference), ("--candidate", a.candidate)):
        if not os.path.isfile(path):
            p.error(f"{flag}: {_not_a_file(path)}")
        if not os.access(path, os.R_OK):
            p.error(f"{flag}: cannot read {path} (permission denied)")
    if problem := cache_dir_problem("--cache_dir", a.cache_dir):
        p.error(problem)
    cfg = EvalConfig(**{opt.name: getattr(a, opt.name) for opt in _OPTIONS})
    cfg.device = device
    return _Command(a.reference, a.candidate, cfg, a.json)


def _verdict(cmd: _Command) -> EvalResult:
    try:
        return evaluate(cmd.reference, cmd.candidate, cmd.cfg)
    except Exception as exc:  # the CLI never crashes on a hostile candidate
        return EvalResult(verdict="crashed", error=f"evaluator error: {type(exc).__name__}: {exc}")


def _print_summary(r: EvalResult) -> None:
    sp = f"{r.speedup:.3f}x" if r.speedup is not None else "-"
    print(f"verdict: {r.verdict}  speedup: {sp} ({r.timing})  ref_ms: {r.ref_ms}  candidate_ms: {r.candidate_ms}")
    if r.hacks:
        print(f"hacks: {', '.join(r.hacks)}")
    if r.error:
        print(f"error: {r.error}")


def _print_json_line(text: str) -> None:
    """`text` alone on the last stdout line, whatever was printed before it."""
    sys.stdout.write("\n" + text + "\n")


def main(argv: list[str] | None = None) -> int:
    """Evaluate one candidate from the command line; returns the exit status (see `_EPILOG`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cmd = _parse(argv)
    except _UsageError as exc:
        if "--json" in argv:
            _print_json_line(json.dumps({"error": str(exc), "usage_error": True}))
        return 2
    result = _verdict(cmd)
    if cmd.json:
        _print_json_line(result.to_json())
    else:
        _print_summary(result)
    return 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # everything is printed and every job and temporary directory is gone: skip the interpreter's
    # teardown of torch (about 0.3 s of a CLI run)
    os._exit(status)
