"""Evaluation throughput: a candidate set through `Evaluator.evaluate_many` for each worker count,
every difference from 1 worker, then the same set again through the cache.

The sets (`bench/candidates.py`, `--set`): `full` (the default) is our solutions and their
corrupted variants (wrong, crashing, slower, torch fallbacks) at real KernelBench sizes, `--size`
of them; `rl` is an RL step's batch, 16 candidates for each of 8 problems (one reference per
group of candidates); `mixed` adds the hack, legit and fault fixtures on the bundled tiny tasks
(the set of the H200 runs 1-12 in docs/benchmarks.md had this composition at `--size 48`). Each
worker count gets a fresh Evaluator and a fresh, empty cache directory (so every pass pays for
every evaluation, whatever the cache's default); the 1-worker pass is the reference
(`--baseline`: an earlier run's, not run again). Then a warm pass with the fastest worker count
reads the cache the first pass run here filled: its speed-up factor and hit rate. Candidates per
minute count `evaluate_many` alone; starting the workers is reported apart (`startup_s`).

Printed: candidates per minute per worker count; every verdict or hack code that differs from
1 worker, every speedup more than 3 % off (`!!` beyond 10 %); candidates whose verdict is not
the one expected. JSON with every result: `--json` (default `$OUT/eval_throughput.json`).

Also printed: seconds per judge phase summed over each pass's candidates, the same seconds by
kind of work (`details.split_s`: making inputs, candidate calls, reference runs, comparisons), the
seconds spent waiting for the GPU lock (shared and alone) and for GPU memory, how many results
were re-run alone, the seconds the judge held the GPU alone and the ceiling that sets on
candidates a minute (`alone_ceiling`), and each large task's memory estimate against its peaks.

    python bench/eval_throughput.py --kernelbench .bench_data/kernelbench --set full --workers 1,6  # GPU
    python bench/eval_throughput.py --kernelbench .bench_data/kernelbench --set rl --workers 6     # GPU
    python bench/eval_throughput.py --device cpu --shrink --set mixed --workers 1,2 --size 12 \\
        --trials 2 --cpu-perf-trials 1 --warmup 1                                           # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.candidates import (Candidate, all_candidates, bundled_task, composition, full_size_set,  # noqa: E402
                              mixed_set, rl_batch)
from bench.entry import InputError, check_outputs, exit_status  # noqa: E402
from bench.evaluator import reference_as_candidate  # noqa: E402
from bench.jsonfile import save_json  # noqa: E402
from drkernel.config import int_list  # noqa: E402
from drkernel.evalcache import fingerprint  # noqa: E402
from drkernel.evaluator import EvalConfig, EvalResult, Evaluator, resolve_device  # noqa: E402

SPEEDUP_TOLERANCE = 0.03  # a speedup further than this from 1 worker's is listed
SPEEDUP_FLAG = 0.10  # and flagged beyond this
DETAILS = ("phase_s", "split_s", "lock_wait_s", "memory_wait_s", "overhead_s", "retried_alone", "preflight",
           "timed_calls", "memory_estimate_gib", "memory_peak_gib", "memory_peak_gib_by_phase", "clock_extra_ms",
           "clock_overhead_ms", "warm_up_s", "gpu_alone_s", "group_gpu_alone_s")  # kept per result


@dataclasses.dataclass
class Pass:
    workers: int
    cache: str  # "cold": an empty cache directory; "warm": the one the 1-worker pass filled
    startup_s: float
    wall_s: float
    results: list[EvalResult]

    @property
    def per_minute(self) -> float:
        return 60.0 * len(self.results) / max(self.wall_s, 1e-9)

    @property
    def hit_rate(self) -> float:
        return sum(bool(r.details.get("cached")) for r in self.results) / max(1, len(self.results))

    @property
    def label(self) -> str:
        return f"{self.workers} worker{'s' if self.workers > 1 else ''}" + (", cached" if self.cache == "warm" else "")


@dataclasses.dataclass
class Difference:
    candidate: str
    kind: str  # the candidate's kind: mask corruptions read and write out of bounds (undefined)
    run: str  # the pass that differs from 1 worker, e.g. "4 workers"
    what: str  # verdict | hacks | speedup
    reference: object  # the 1-worker value
    value: object
    flagged: bool = False  # a speedup more than SPEEDUP_FLAG off
    precise: bool = True  # the 1-worker speedup's own 95 % interval is narrower than SPEEDUP_TOLERANCE


# ----------------------------------------------------------------------------- running

def warm_up(ev: Evaluator, workers: int) -> None:
    """One quick job per worker, so that starting the workers (importing torch and triton) is
    not counted as evaluation: the bundled ReLU reference as a torch-only candidate, stopped as
    `no_triton_kernel` in its first trial. The copies differ (a comment), so that no dedupe
    folds them into one job."""
    task = bundled_task("1_ReLU.py")
    ev.evaluate_many([(task.code, reference_as_candidate(task.code) + f"# warm-up {i}\n") for i in range(workers)])


def evaluate_pass(cfg: EvalConfig, workers: int, pairs: list[tuple[str, str]], cache_dir: Path, label: str) -> Pass:
    """One Evaluator with `workers` workers over `pairs`, through the cache in `cache_dir`."""
    cfg = dataclasses.replace(cfg, cache_dir=str(cache_dir))
    t0 = time.perf_counter()
    with Evaluator(cfg, workers=workers) as ev:
        warm_up(ev, workers)
        startup = time.perf_counter() - t0
        t0 = time.perf_counter()
        results = ev.evaluate_many(pairs)
        wall = time.perf_counter() - t0
    return Pass(workers, label, startup, wall, results)


def baseline_pass(path: str, candidates: list[Candidate]) -> Pass:
    """The 1-worker cold pass of an earlier run's JSON (same candidate set), as the reference; an
    InputError for a file that is not one."""
    try:
        data = json.loads(Path(path).read_text())
        names = [c["name"] for c in data["candidates"]]
        p = next(p for p in data["passes"] if p["workers"] == 1 and p["cache"] == "cold")
        results = [EvalResult(verdict=r["verdict"], hacks=r["hacks"], speedup=r["speedup"],
                              speedup_interval=r.get("speedup_interval"), wall_s=r["wall_s"],
                              details={k: r.get(k) for k in DETAILS}) for r in p["results"]]
        done = Pass(1, "cold", p["startup_s"], p["wall_s"], results)
    except (ValueError, KeyError, TypeError, AttributeError, StopIteration) as exc:
        raise InputError(f"--baseline {path}: not a JSON of this script with a 1-worker cold pass "
                         f"({type(exc).__name__}: {exc})") from None
    if names != [c.name for c in candidates]:
        raise InputError(f"--baseline {path}: its candidate set differs from this one")
    return done


def compare(reference: Pass, other: Pass, candidates: list[Candidate]) -> list[Difference]:
    """Every verdict, hack code set or speedup (beyond SPEEDUP_TOLERANCE) that differs."""
    out = []
    for c, a, b in zip(candidates, reference.results, other.results):
        if a.verdict != b.verdict:
            out.append(Difference(c.name, c.kind, other.label, "verdict", a.verdict, b.verdict))
        if sorted(a.hacks) != sorted(b.hacks):
            out.append(Difference(c.name, c.kind, other.label, "hacks", sorted(a.hacks), sorted(b.hacks)))
        if a.speedup and b.speedup:
            off = abs(b.speedup - a.speedup) / a.speedup
            if off > SPEEDUP_TOLERANCE:
                out.append(Difference(c.name, c.kind, other.label, "speedup", a.speedup, b.speedup,
                                      off > SPEEDUP_FLAG, precise(a)))
    return out


def precise(r: EvalResult) -> bool:
    """Whether a speedup is measured finely enough to be compared at SPEEDUP_TOLERANCE: a launch-bound
    microsecond kernel's median moves with host and clock state from one serial run to the next,
    and its bootstrap interval says so."""
    if not r.speedup or not r.speedup_interval:
        return False
    lo, hi = r.speedup_interval
    return (hi - lo) / r.speedup <= SPEEDUP_TOLERANCE


def unexpected(candidates: list[Candidate], results: list[EvalResult]) -> list[tuple[str, str, str]]:
    """(name, expected, got) where a known expectation was not met."""
    out = []
    for c, r in zip(candidates, results):
        if c.expected_verdict is None:
            continue
        if r.verdict != c.expected_verdict or not set(c.expected_hacks) <= set(r.hacks):
            expected = " ".join([c.expected_verdict, *c.expected_hacks])
            out.append((c.name, expected, " ".join([r.verdict, *r.hacks])))
    return out


# ----------------------------------------------------------------------------- report

def print_report(passes: list[Pass], diffs: list[Difference], surprises: list[tuple[str, str, str]]) -> None:
    base = passes[0]
    print(f"\n{'workers':>8} {'cache':>6} {'startup s':>10} {'wall s':>9} {'cand/min':>9} {'vs 1':>6} {'hit rate':>9}")
    for p in passes:
        print(f"{p.workers:>8} {p.cache:>6} {p.startup_s:>10.1f} {p.wall_s:>9.2f} {p.per_minute:>9.1f} "
              f"{base.wall_s / max(p.wall_s, 1e-9):>5.1f}x {p.hit_rate:>9.2f}")
    print(f"\ndifferences from 1 worker ({len(diffs)}):" if diffs
          else "\nno verdict, hack or speedup differs from 1 worker")
    for d in diffs:
        value = f"{d.reference:.4g} -> {d.value:.4g}" if d.what == "speedup" else f"{d.reference} -> {d.value}"
        note = "" if d.precise else "  (imprecise at 1 worker: its interval is wider than the tolerance)"
        print(f"  {'!!' if d.flagged else '  '} {d.run}: {d.candidate} [{d.kind}] {d.what} {value}{note}")
    compared = [r for r in base.results if r.speedup]
    print(f"speedups: {len(compared)} at 1 worker, {sum(map(precise, compared))} of them precise to "
          f"{SPEEDUP_TOLERANCE:.0%}; precise ones off by more than that in another pass: "
          f"{sum(d.what == 'speedup' and d.precise for d in diffs)}, by more than {SPEEDUP_FLAG:.0%}: "
          f"{sum(d.what == 'speedup' and d.precise and d.flagged for d in diffs)}")
    print(f"\nnot as expected with 1 worker ({len(surprises)}):" if surprises else "\nevery known expectation met")
    for name, expected, got in surprises:
        print(f"  {name}: expected {expected}, got {got}")


def _summed(results: list[EvalResult], key: str) -> dict[str, float]:
    total: dict[str, float] = {}
    for r in results:
        for k, v in (r.details.get(key) or {}).items():
            total[k] = total.get(k, 0.0) + v
    return total


def alone_ceiling(results: list[EvalResult]) -> tuple[float, float | None]:
    """(seconds the GPU was held alone, candidates a minute that allows): the judge holds its GPU
    alone for timing, profiling and, once per group, calibration and the reference's own timing,
    so no number of runners judges more than this many a minute on one GPU. None without holds."""
    held = 0.0
    for r in results:
        d = r.details
        group = (d.get("overhead_s") or {}).get("group") or 1  # the group's holds, shared by its results
        held += (d.get("gpu_alone_s") or 0.0) + (d.get("group_gpu_alone_s") or 0.0) / group
    return held, (60.0 * len(results) / held if held > 0 else None)


def print_time_split(passes: list[Pass]) -> None:
    """Where each uncached pass's job-seconds went."""
    for p in passes:
        if p.cache != "cold":
            continue
        phases = ", ".join(f"{k} {v:.1f}" for k, v in _summed(p.results, "phase_s").items())
        split = ", ".join(f"{k} {v:.1f}" for k, v in _summed(p.results, "split_s").items())
        waits = ", ".join(f"{k} {v:.1f}" for k, v in _summed(p.results, "lock_wait_s").items())
        memory = sum(r.details.get("memory_wait_s") or 0.0 for r in p.results)
        outside = ", ".join(f"{k} {v:.1f}" for k, v in _summed(p.results, "overhead_s").items())
        retried = sum(bool(r.details.get("retried_alone")) for r in p.results)
        warm = sum(r.details.get("warm_up_s") or 0.0 for r in p.results)
        held, ceiling = alone_ceiling(p.results)
        limit = f"at most {ceiling:.1f} candidates a minute on one GPU" if ceiling else "no holds"
        print(f"{p.label}: job seconds by phase: {phases}\n  by kind of work: {split}\n  waiting for the GPU "
              f"lock: {waits}; for memory: {memory:.1f}; re-run alone: {retried}\n  pre-flight and sandbox "
              f"job seconds: {outside}; comparison kernels' warm-up (no lock held): {warm:.1f}\n"
              f"  the GPU held alone: {held:.1f} s, so {limit}, whatever the runners")


def print_memory(p: Pass, candidates: list[Candidate], floor_gib: float = 4.0) -> None:
    """Each task's GPU memory estimate (what admission reserves) against the peaks its jobs
    reached (the judge's and the runner's caching allocators; CUDA contexts not included)."""
    rows: dict[str, list] = {}
    for c, r in zip(candidates, p.results):
        est, phases = r.details.get("memory_estimate_gib"), r.details.get("memory_peak_gib_by_phase") or {}
        if est is None or est < floor_gib or not phases:
            continue
        row = rows.setdefault(c.task.key, [est, 0.0, 0.0, ""])
        judge = max(phases.values())
        if judge > row[1]:
            row[1], row[3] = judge, max(phases, key=phases.get)
        row[2] = max(row[2], (r.details.get("memory_peak_gib") or {}).get("runner") or 0.0)
    if rows:
        print(f"\n{p.label}: GPU memory per task (GiB), estimate vs peak reserved")
        print(f"{'task':>8} {'estimate':>9} {'judge':>7} {'runner':>7} {'sum':>7}  judge's peak phase")
    for key, (est, j, r, phase) in sorted(rows.items()):
        print(f"{key:>8} {est:>9.1f} {j:>7.1f} {r:>7.1f} {j + r:>7.1f}  {phase}{'  (over)' if j + r > est else ''}")


def summary(args, candidates: list[Candidate], passes: list[Pass], diffs: list[Difference],
            surprises: list[tuple[str, str, str]]) -> dict:
    cold = [p for p in passes if p.cache == "cold"]
    warm = next((p for p in passes if p.cache == "warm"), None)
    best = max(cold, key=lambda p: p.per_minute)
    return {
        "config": vars(args), "environment": fingerprint(args.device), "composition": composition(candidates),
        "candidates": [{"name": c.name, "kind": c.kind, "task": c.task.key, "expected_verdict": c.expected_verdict,
                        "expected_hacks": list(c.expected_hacks)} for c in candidates],
        "passes": [{"workers": p.workers, "cache": p.cache, "startup_s": p.startup_s, "wall_s": p.wall_s,
                    "per_minute": p.per_minute, "hit_rate": p.hit_rate,
                    "results": [{k: getattr(r, k) for k in ("verdict", "hacks", "speedup", "speedup_interval", "wall_s")}
                                | {k: r.details.get(k) for k in DETAILS} | {"error": (r.error or "")[:300]}
                                for r in p.results]} for p in passes],
        "best_workers": best.workers,
        "cache": {"workers": warm.workers, "hit_rate": warm.hit_rate, "speedup_vs_best": best.wall_s / warm.wall_s,
                  "speedup_vs_1_worker": cold[0].wall_s / warm.wall_s} if warm else None,  # None: cut short
        "differences": [dataclasses.asdict(d) for d in diffs],
        "unexpected": [{"name": n, "expected": e, "got": g} for n, e, g in surprises],
    }


# ----------------------------------------------------------------------------- main

def default_kernelbench() -> str:
    local = ROOT / ".bench_data" / "kernelbench"
    return str(local if local.is_dir() else ROOT.parent / "shared" / "kernelbench")


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernelbench", default=default_kernelbench(), help="local KernelBench copy (hub layout)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shrink", action="store_true", help="tiny KernelBench sizes (CPU smoke runs)")
    ap.add_argument("--workers", default="1,2,4", help="comma list; 1 is always run first (the reference)")
    ap.add_argument("--set", default="full", choices=("full", "rl", "mixed"), help="which candidates (see above)")
    ap.add_argument("--size", type=int, default=42, help="candidates in the full or mixed set (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    for name, kind in (("trials", int), ("perf-trials", int), ("cpu-perf-trials", int), ("warmup", int),
                       ("timeout", float)):
        ap.add_argument(f"--{name}", type=kind, help="EvalConfig field (its default when left out)")
    ap.add_argument("--baseline", default="", help="an earlier run's JSON whose 1-worker pass stands in for "
                    "running one here (same candidate set)")
    ap.add_argument("--cache-dir", default="", help="where the cache directories go (default: a temporary one)")
    default_json = Path(os.environ["OUT"]) / "eval_throughput.json" if os.environ.get("OUT") else \
        ROOT / "runs" / "bench" / "eval_throughput.json"
    ap.add_argument("--json", default=str(default_json))
    return ap.parse_args(argv)


def worker_counts(text: str) -> list[int]:
    """--workers as the passes to run: 1 first (every other pass is compared with it), then the
    others in order, each at least 1."""
    counts = int_list(text, "--workers")
    if any(w < 1 for w in counts):
        raise InputError(f"--workers must list counts >= 1, got {text!r}")
    return [1] + [w for w in dict.fromkeys(counts) if w != 1]


def candidate_set(args) -> list[Candidate]:
    everything = all_candidates(args.kernelbench, args.shrink)
    if args.set == "rl":
        return rl_batch(everything, seed=args.seed)
    pool = full_size_set(everything) if args.set == "full" else everything
    return mixed_set(pool, args.size, args.seed, args.device)


def eval_config(args) -> EvalConfig:
    fields = {k: getattr(args, k) for k in ("trials", "perf_trials", "cpu_perf_trials", "warmup", "timeout")
              if getattr(args, k) is not None}
    return EvalConfig(device=args.device, **fields)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    check_outputs(("--json", args.json, False), ("--cache-dir", args.cache_dir or None, True))
    workers = worker_counts(args.workers)
    if args.size < 0:
        raise InputError(f"--size must be >= 0 (0: all), got {args.size}")
    args.device = resolve_device(args.device)  # before anything applies @triton.jit
    candidates = candidate_set(args)
    pairs = [(c.task.code, c.code) for c in candidates]
    print(f"{len(candidates)} candidates {composition(candidates)}; workers {workers}", flush=True)
    cfg = eval_config(args)
    root = Path(args.cache_dir or tempfile.mkdtemp(prefix="eval_throughput_"))
    root.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="run_", dir=root))
    try:
        passes = [baseline_pass(args.baseline, candidates)] if args.baseline else []
        for w in workers[1:] if args.baseline else workers:
            passes.append(evaluate_pass(cfg, w, pairs, run_dir / f"workers{w}", "cold"))
            print(f"  {w} worker(s): {passes[-1].wall_s:.1f} s", flush=True)
            diffs = [d for p in passes[1:] for d in compare(passes[0], p, candidates)]
            save_json(args.json, summary(args, candidates, passes, diffs, []))  # kept if cut short
        best = max(passes[1:] if args.baseline else passes, key=lambda p: p.per_minute)
        filled = run_dir / f"workers{passes[1].workers if args.baseline else 1}"
        passes.append(evaluate_pass(cfg, best.workers, pairs, filled, "warm"))
        diffs = [d for p in passes[1:] for d in compare(passes[0], p, candidates)]
        surprises = unexpected(candidates, passes[0].results)
        print_report(passes, diffs, surprises)
        print_time_split(passes)
        print_memory(passes[-2], candidates)
        result = summary(args, candidates, passes, diffs, surprises)
    finally:
        shutil.rmtree(run_dir if args.cache_dir else root, ignore_errors=True)
    out = Path(args.json)
    save_json(out, result)
    print(f"cache pass ({result['cache']['workers']} workers): {result['cache']['speedup_vs_best']:.1f}x the best "
          f"uncached pass, hit rate {result['cache']['hit_rate']:.2f}\nwrote {out}")
    return result


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
