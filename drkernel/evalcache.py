"""Evaluation cache: a verdict measured once is reused wherever the same question is asked again.

A result is keyed by a sha256 of the reference code, the candidate code, the evaluation settings
that can change a verdict, `CACHE_VERSION`, a digest of this package's sources and an environment fingerprint (GPU name, driver, CUDA,
torch and triton versions; on CPU the CPU model instead of GPU and driver). The store is a
directory of JSON files, one per key in 256 shard folders, written atomically (temporary file +
`os.replace`), so several processes and ranks may share one directory; an unreadable,
half-written or foreign entry is a miss, never an error. `result_problem` is the one check of a
stored result (a cache entry's, a row of generate.py or evaluate.py) before it is trusted.

Every result that leaves `evaluate_cached`, fresh or cached, carries its fingerprint in
`details["environment"]`: every reward says where it was measured.

The evaluator's side (the parent) never initialises CUDA: the fingerprint comes from
`nvidia-smi` (asked once per process), `torch.version.cuda` and package metadata.

    env = fingerprint(cfg.device)
    results = evaluate_cached(pairs, cfg, evaluate_uncached, EvalCache(dir))
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import importlib.metadata
import json
import os
import platform
import subprocess
import tempfile
import typing
from pathlib import Path
from typing import Any, Callable, Collection, Hashable, Mapping, Sequence, TypeVar

from drkernel.evaltypes import VERDICTS, EvalConfig, EvalResult
from drkernel.jsonl import field_problem
from drkernel.tasks import text_digest

# Bump when the key's recipe or the meaning of a stored result changes: old entries then miss.
CACHE_VERSION = 1

# EvalConfig fields left out of the key because they cannot change a verdict:
# - device: `auto` and `cuda` (or `cuda:0` and `cuda:1` of one GPU model) resolve to the same
#   hardware; which hardware ran the evaluation is the fingerprint's part of the key;
# - timeout: an evaluation that finished did not reach its limit, and timeouts are never cached;
# - cache_dir: where results are stored never changes them.
# Every other field, including any added later, is part of the key: a new setting is assumed to
# matter until someone argues here that it does not.
NON_VERDICT_FIELDS = frozenset({"device", "timeout", "cache_dir"})

# Verdicts and hack codes that depend on the machine's state rather than on the two programs.
UNCACHED_VERDICTS = frozenset({"timeout", "crashed"})
# ... except a crash by a fault signal the candidate's own code raised (the evaluator's error text
# `killed by SIGSEGV`): no neighbour sends those; SIGKILL (the OOM killer, a limit) is not one.
_OWN_FAULTS = tuple(f"killed by sig{name}" for name in ("segv", "bus", "ill", "fpe", "abrt"))  # vs lower-cased errors
TIMING_HACKS = frozenset({"reference_slowed", "implausible_speedup", "side_stream"})
_INFRA_ERRORS = ("out of memory", "memoryerror", "cuda requested but not available", "cannot read input",
                 "evaluator error", "evaluator failure", "sandbox error", "judge error", "no space left on device")
UNKNOWN = "unknown"
# What each field of a stored result holds (EvalResult's declarations); the feedback reads each
# of `kernels` as an object.
RESULT_TYPES: dict[str, Any] = {**typing.get_type_hints(EvalResult), "kernels": list[dict] | None}

Pair = TypeVar("Pair", bound=Hashable)


# ======================================================================================
# Environment fingerprint
# ======================================================================================

@functools.cache
def _nvidia_smi() -> tuple[tuple[str, str], ...] | None:
    """(GPU name, driver version) per GPU on this host; None when nvidia-smi is absent or fails.
    Asked once per process: one call costs ~50 ms and the answer does not change while we run."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [tuple(part.strip() for part in line.split(",", 1)) for line in out.splitlines() if "," in line]
    return tuple((name, driver) for name, driver in rows)


def host_gpu_count() -> int | None:
    """How many GPUs this host has, whatever `CUDA_VISIBLE_DEVICES` says (nvidia-smi lists them
    all); None when nvidia-smi is absent or fails."""
    rows = _nvidia_smi()
    return None if rows is None else len(rows)


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or UNKNOWN


def uses_gpu(device: str) -> bool:
    """`auto` as the evaluator's child resolves it, decided without touching CUDA: a GPU when
    nvidia-smi lists one, or when NVIDIA device files exist without nvidia-smi (then the GPU
    stays `unknown` and nothing is cached)."""
    if device != "auto":
        return device.startswith("cuda")
    rows = _nvidia_smi()
    return bool(rows) if rows is not None else bool(glob.glob("/dev/nvidia[0-9]*"))


def fingerprint(device: str) -> dict[str, str]:
    """Where an evaluation on `device` (cpu | cuda | cuda:N | auto) runs, as a flat str dict.

    GPU: names of the host's GPUs (one name when all are the same model: the evaluator spreads
    jobs over all visible GPUs), driver, CUDA, torch, triton. CPU: the CPU model instead of GPU
    and driver. Never initialises CUDA (importing torch does not)."""
    import torch

    env = {"torch": torch.__version__, "triton": _package_version("triton")}
    if not uses_gpu(device):
        return {"device": "cpu", "cpu": _cpu_model(), **env}
    rows = _nvidia_smi() or ()
    names = sorted({name for name, _ in rows})
    drivers = sorted({driver for _, driver in rows})
    return {"device": "cuda", "gpu": " + ".join(names) or UNKNOWN, "driver": " + ".join(drivers) or UNKNOWN,
            "cuda": torch.version.cuda or UNKNOWN, **env}


def with_environment(result: EvalResult, env: Mapping[str, str]) -> EvalResult:
    """`result` with `details["environment"] = env` (in place; returned for chaining)."""
    result.details["environment"] = dict(env)
    return result


def result_problem(data: Mapping[str, Any], verdicts: Collection[str] = VERDICTS) -> str | None:
    """Why `data` is not a stored `EvalResult` (None: it is one): no verdict or one outside
    `verdicts`, or a field of another type than `RESULT_TYPES` (a field it lacks takes its default)."""
    problem = field_problem(data, RESULT_TYPES, required=("verdict",))
    if problem is None and data["verdict"] not in verdicts:
        problem = f"verdict {data['verdict']!r} is not one of {', '.join(verdicts)}"
    return problem


# ======================================================================================
# Keys and the caching rule
# ======================================================================================

def verdict_settings(cfg: EvalConfig) -> dict:
    """The EvalConfig fields that enter the key (all but NON_VERDICT_FIELDS)."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NON_VERDICT_FIELDS}




@functools.cache
def judge_digest() -> str:
    """sha256 of this package's sources: a verdict stored by other judging code (before a fix to a
    defence, say) is not this code's verdict."""
    package = os.path.dirname(os.path.abspath(__file__))
    parts = [f"{name}\0{text_digest(open(os.path.join(package, name), encoding='utf-8').read())}"
             for name in sorted(os.listdir(package)) if name.endswith(".py")]
    return text_digest("\n".join(parts))


def cache_key(reference_code: str, candidate_code: str, cfg: EvalConfig, env: Mapping[str, str]) -> str:
    """sha256 (hex) of the version, the judging code, both programs' exact text, the verdict
    settings and `env`."""
    recipe = {"version": CACHE_VERSION, "judge": judge_digest(), "reference": text_digest(reference_code),
              "candidate": text_digest(candidate_code), "settings": verdict_settings(cfg), "environment": dict(env)}
    return text_digest(json.dumps(recipe, sort_keys=True, separators=(",", ":"), default=repr))


def cacheable(result: EvalResult) -> bool:
    """Whether `result` may be stored: only verdicts that follow from the key's inputs alone.

    Not cached, because a loaded or failing machine can cause them and a retry may differ:
    - `timeout`, and `crashed` (the OOM killer, a limit, a sandbox failure) unless the error
      says `killed by SIGSEGV` / SIGBUS / SIGILL / SIGFPE / SIGABRT: the candidate's own fault;
    - any verdict whose error mentions memory or disk exhaustion (`No space left on device`) or an
      evaluator/sandbox/judge failure (a neighbour's memory or files are not the candidate's verdict);
    - `hacked` with a clock-judged code (`reference_slowed`, `implausible_speedup`,
      `side_stream`): contention moves the clocks they are judged on;
    - a result without an environment stamp or measured on an unidentified GPU.
    Cached: `correct`, `incorrect`, `compile_error`, `runtime_error`, the other hack codes and
    fault-signal crashes; they follow from the two programs, the settings and the seed (or from
    the candidate's own undefined behaviour, which a retry does not make its neighbours' fault).
    """
    env = result.details.get("environment")
    if not isinstance(env, dict) or UNKNOWN in env.values():
        return False
    if result.verdict not in VERDICTS:
        return False
    error = (result.error or "").lower()
    if result.verdict in UNCACHED_VERDICTS and not any(fault in error for fault in _OWN_FAULTS):
        return False
    if TIMING_HACKS.intersection(result.hacks or ()):
        return False
    return not any(marker in error for marker in _INFRA_ERRORS)


# ======================================================================================
# The on-disk store
# ======================================================================================

def _copyable(data: dict) -> bool:
    """Whether the stored result `data` survives `EvalResult.to_dict()`, which every result leaving
    `evaluate_cached` passes through: `dataclasses.asdict` recurses, and JSON that parsed may still
    nest too deeply for it."""
    try:
        EvalResult.from_dict(data).to_dict()
    except RecursionError:
        return False
    return True


@dataclasses.dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / lookups (0.0 before the first lookup)."""
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


class EvalCache:
    """One JSON file per key under `path/<key[:2]>/<key>.json`; safe to share between processes."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.stats = CacheStats()

    def _file(self, key: str) -> Path:
        return self.path / key[:2] / f"{key}.json"

    def _load(self, key: str) -> dict | None:
        """The entry stored under `key`, or None when absent, unreadable or not ours."""
        try:
            entry = json.loads(self._file(key).read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):  # missing, half-written, not UTF-8/JSON, nested too deeply
            return None
        if not (isinstance(entry, dict) and entry.get("version") == CACHE_VERSION and entry.get("key") == key
                and isinstance(entry.get("environment"), dict) and isinstance(entry.get("result"), dict)):
            return None
        return entry if result_problem(entry["result"]) is None and _copyable(entry["result"]) else None

    def get(self, key: str) -> EvalResult | None:
        """The stored result, marked `details["cached"] = True`, or None (a miss).

        Its `reward` and `reward_terms` are cleared: the reward weights are not part of the key,
        so the caller scores the result with its own RewardConfig."""
        entry = self._load(key)
        if entry is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        result = EvalResult.from_dict(entry["result"])
        result.reward = result.reward_terms = None
        result.details["cached"] = True
        return with_environment(result, entry["environment"])

    def put(self, key: str, result: EvalResult) -> bool:
        """Store `result` (stamped by `with_environment`) under `key` if `cacheable(result)`.
        Returns whether it was stored; a write error (full disk, read-only directory) returns
        False: the cache saves time and must never fail an evaluation."""
        if not cacheable(result):
            return False
        entry = {"version": CACHE_VERSION, "key": key, "environment": result.details["environment"],
                 "result": result.to_dict()}
        text = json.dumps(entry, default=repr)
        target = self._file(key)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{key[:16]}.", suffix=".tmp")
        except OSError:
            return False
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
            # atomic on POSIX: a concurrent reader sees the old file or the new one, never a mix
            os.replace(tmp, target)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return False
        return True


# ======================================================================================
# Use inside an evaluate_many
# ======================================================================================

def dedupe(pairs: Sequence[Pair]) -> tuple[list[Pair], list[int]]:
    """(unique pairs in first-seen order, index_map) with `pairs[i] == unique[index_map[i]]`."""
    unique: list[Pair] = []
    position: dict[Pair, int] = {}
    index_map = []
    for pair in pairs:
        if pair not in position:
            position[pair] = len(unique)
            unique.append(pair)
        index_map.append(position[pair])
    return unique, index_map


def evaluate_cached(pairs: Sequence[tuple[str, str]], cfg: EvalConfig,
                    evaluate_uncached: Callable[[list[tuple[str, str]]], list[EvalResult]],
                    cache: EvalCache | None = None, env: Mapping[str, str] | None = None) -> list[EvalResult]:
    """Results for (reference code, candidate code) `pairs`, in order: identical pairs are
    evaluated once, cached results are reused (stored without a reward: the caller scores every
    result), the rest go to `evaluate_uncached` in one call and are stored.
    With `cache=None` this only dedupes and stamps. Duplicates get independent copies. `env` is
    `fingerprint(cfg.device)`, taken here when not given."""
    env = env or fingerprint(cfg.device)
    unique, index_map = dedupe(list(pairs))
    keys = [cache_key(ref, cand, cfg, env) for ref, cand in unique]
    found = [cache.get(k) if cache is not None else None for k in keys]
    results = list(found)
    todo = [i for i, r in enumerate(results) if r is None]
    fresh = evaluate_uncached([unique[i] for i in todo]) if todo else []
    if len(fresh) != len(todo):
        raise RuntimeError(f"evaluate_uncached returned {len(fresh)} results for {len(todo)} pairs")
    for i, result in zip(todo, fresh):
        results[i] = with_environment(result, env)
        if cache is not None:
            cache.put(keys[i], result)
    return [EvalResult.from_dict(results[j].to_dict()) for j in index_map]  # type: ignore[union-attr]
