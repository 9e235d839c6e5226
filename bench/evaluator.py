"""Evaluator benchmark (GPU): wall time per evaluation, speedup and its spread over repeats.

Candidates: our Triton solutions in bench/solutions/ (level{L}_{id}_*.py) and, for the first
`--n-ref` level-1/2 problems, the reference itself as a torch-only candidate (hack checks that
require Triton are switched off for those, so we measure the timing path: the speedup of a
reference against itself must land in [0.95, 1.05]).

    python bench/evaluator.py --kernelbench ../shared/kernelbench --repeats 3 --out out.json
    python bench/evaluator.py --workers 4 ...   # each repeat evaluates every case at once, side by side
    python bench/evaluator.py --baseline compile ...   # speedups against the torch.compile'd reference
    python bench/evaluator.py --device cpu --only ref_self_L2_12 --repeats 1 --trials 1 \
        --out /tmp/evaluator.json                # CPU smoke (about a minute)

With `--workers N` > 1 the cases of a repeat run together on N runners per GPU (one Evaluator
without the Triton requirement, so solutions and references share the GPU), which is how the
reference-against-itself figures are checked next to neighbours; `wall_s` is then each job's own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.entry import check_outputs, count, exit_status  # noqa: E402
from bench.jsonfile import save_json  # noqa: E402
from drkernel.evaluator import EvalConfig, Evaluator, resolve_device  # noqa: E402
from drkernel.tasks import load_kernelbench  # noqa: E402

SOLUTIONS = Path(__file__).resolve().parent / "solutions"


def reference_as_candidate(code: str) -> str:
    return code + "\n\nclass ModelNew(Model):\n    pass\n"


def _row(label: str, results: list) -> dict:
    """One case's repeats as a table row."""
    last = results[-1]
    speedups = [r.speedup for r in results if r.speedup is not None]
    walls = [r.wall_s for r in results]
    return dict(case=label, verdict=last.verdict, verdicts=[r.verdict for r in results], hacks=last.hacks,
                error=last.error or "", baseline=last.baseline, ref_ms=last.ref_ms,
                candidate_ms=last.candidate_ms, ref_ms_isolated=last.details.get("ref_ms_isolated"),
                speedups=speedups, precise=[r.speedup_precise for r in results], wall_s=walls,
                median_wall_s=statistics.median(walls), triton_time_share=last.triton_time_share,
                phase_s=last.details.get("phase_s"), split_s=last.details.get("split_s"),
                memory_gib_by_phase=last.details.get("memory_peak_gib_by_phase"),
                spread=(max(speedups) / min(speedups) - 1) if len(speedups) > 1 else None)


def one_at_a_time(cases: list, base: dict, repeats: int, out: str) -> list[dict]:
    """Each case alone on the GPU, `repeats` times (wall: the caller's clock around one evaluation);
    the JSON is rewritten after each case, so a run cut short keeps what it measured."""
    rows = []
    with Evaluator(EvalConfig(**base)) as strict, Evaluator(EvalConfig(**base, require_triton=False)) as loose:
        for label, task, code, allow_torch in cases:
            ev = loose if allow_torch else strict
            results = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                results.append(ev.evaluate(task.code, code))
                results[-1].wall_s = time.perf_counter() - t0
            rows.append(_row(label, results))
            print(json.dumps(rows[-1]), flush=True)
            save_json(out, rows)
    return rows


def side_by_side(cases: list, cfg: EvalConfig, workers: int, repeats: int) -> list[dict]:
    """Every case of a repeat in one `evaluate_many` on `workers` runners per GPU."""
    per_case: list[list] = [[] for _ in cases]
    with Evaluator(cfg, workers=workers) as ev:
        for _ in range(repeats):
            for results, res in zip(per_case, ev.evaluate_many([(task.code, code) for _, task, code, _ in cases])):
                results.append(res)
    rows = [_row(label, results) for (label, *_), results in zip(cases, per_case)]
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernelbench", default="../shared/kernelbench")
    ap.add_argument("--repeats", type=count, default=3)
    ap.add_argument("--n-ref", type=int, default=10)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--perf-trials", type=int, default=100)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--baseline", default="eager", help="eager | compile: what the speedups are measured against")
    ap.add_argument("--workers", type=int, default=1, help="runners per GPU (>1: each repeat's cases together)")
    ap.add_argument("--only", default="", help="comma-separated substrings: run only matching cases")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "evaluator.json"))
    args = ap.parse_args()
    check_outputs(("--out", args.out, False))

    tasks = {(t.level, t.problem_id): t for lvl in (1, 2) for t in load_kernelbench(args.kernelbench, lvl)}
    cases = []  # (label, task, candidate code, allow_torch)
    for path in sorted(SOLUTIONS.glob("level*_*.py")):
        level, pid = int(path.name[5]), int(path.name.split("_")[1])
        cases.append((path.stem, tasks[(level, pid)], path.read_text(), False))
    ref_ids = [(1, i) for i in (19, 23, 26, 40, 47, 1, 21, 36)] + [(2, i) for i in (12, 9)]
    for level, pid in ref_ids[: args.n_ref]:
        t = tasks[(level, pid)]
        cases.append((f"ref_self_L{level}_{t.name[:-3]}", t, reference_as_candidate(t.code), True))

    if args.only:
        keys = [k for k in args.only.split(",") if k]
        cases = [c for c in cases if any(k in c[0] for k in keys)]
    base = dict(device=resolve_device(args.device), trials=args.trials, perf_trials=args.perf_trials, baseline=args.baseline)
    if args.workers > 1:
        rows = side_by_side(cases, EvalConfig(**base, require_triton=False), args.workers, args.repeats)
    else:
        rows = one_at_a_time(cases, base, args.repeats, args.out)
    save_json(args.out, rows)
    print(f"\n{'case':58s} {'verdict':9s} {'ref_ms':>8s} {'cand_ms':>8s} {'speedup':>8s} {'spread':>7s} "
          f"{'share':>6s} {'wall_s':>7s}")
    for r in rows:
        sp = statistics.median(r["speedups"]) if r["speedups"] else None
        f = lambda v, fmt: (fmt % v) if v is not None else "-"  # noqa: E731
        print(f"{r['case'][:58]:58s} {r['verdict']:9s} {f(r['ref_ms'], '%.3f'):>8s} "
              f"{f(r['candidate_ms'], '%.3f'):>8s} {f(sp, '%.3f'):>8s} {f(r['spread'], '%.3f'):>7s} "
              f"{f(r['triton_time_share'], '%.2f'):>6s} {r['median_wall_s']:7.2f}")
    print(f"median wall per evaluation: {statistics.median(w for r in rows for w in r['wall_s']):.2f} s")
    phases = {}
    for r in rows:
        for k, v in (r["phase_s"] or {}).items():
            phases.setdefault(k, []).append(v)
    print("median seconds per phase (last repeat of each case): "
          + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in phases.items()))


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
