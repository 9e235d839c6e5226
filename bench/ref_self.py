"""The reference timed against itself (GPU): a copy of each KernelBench reference as a torch-only
candidate, whose speedup must come out ~1.0 on every problem, launch-bound ones included.

`--repeat` problems `--repeats` times each (default: MobileNetV1, MobileNetV2 and ResNet18, 20 times, the
launch-bound models whose numbers were noise), then every problem of `--levels` once (default all
three: 250 problems), in parts of 20 problems, the JSON rewritten after each part (and after each repeated problem). All through one `Evaluator.evaluate_many` per part,
with `--workers` runners per GPU (default: the evaluator's own choice). Prints a table per problem
and the summary the issue asks for: the median speedup, how many lie in [0.95, 1.05], the worst;
writes JSON (`--out`).

    python bench/ref_self.py --kernelbench .bench_data/kernelbench --out $OUT/ref_self.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.entry import check_outputs, exit_status, whole  # noqa: E402
from bench.evaluator import reference_as_candidate  # noqa: E402
from bench.jsonfile import save_json  # noqa: E402
from drkernel.config import int_list  # noqa: E402
from drkernel.evaluator import EvalConfig, Evaluator, resolve_device  # noqa: E402
from drkernel.tasks import load_kernelbench  # noqa: E402

BAND = (0.95, 1.05)
LAUNCH_BOUND = ("MobileNetV1", "MobileNetV2", "ResNet18")
CHUNK = 20  # problems per evaluate_many of the every-problem part


def run(tasks: list, cfg: EvalConfig, workers: int | None) -> tuple[list, float]:
    """Each task's reference against a copy of itself; the results and the wall seconds."""
    pairs = [(t.code, reference_as_candidate(t.code) + f"# copy {i}\n") for i, t in enumerate(tasks)]
    t0 = time.perf_counter()
    with Evaluator(cfg, workers=workers) as ev:
        results = ev.evaluate_many(pairs)
    return results, time.perf_counter() - t0


# what says why a launch-bound reference's own time moved: alone vs interleaved, the core it was
# timed on (None: not pinned), the waits for an idle GPU and for the lock, the clock's overhead
DIAGNOSTICS = ("ref_ms_isolated", "timing_core", "idle_wait_s", "lock_wait_s", "clock_overhead_ms",
               "reference_clock_extra_per_ms")


def rows_of(tasks: list, results: list) -> list[dict]:
    return [{"problem": t.key, "name": t.name, "verdict": r.verdict, "speedup": r.speedup,
             "of_medians": ratio_of_medians(r.details.get("timed_ms")),
             "interval": r.speedup_interval, "precise": r.speedup_precise, "ref_ms": r.ref_ms,
             "timed_calls": r.details.get("timed_calls"), "error": (r.error or "")[:200],
             "diagnostics": {k: r.details.get(k) for k in DIAGNOSTICS}, "timed_ms": r.details.get("timed_ms")}
            for t, r in zip(tasks, results)]


def ratio_of_medians(timed: dict | None) -> float | None:
    """median(reference) / median(candidate) of the same timed calls, beside the judge's median of
    each pair's own ratio: what pairing the two calls buys (a drift both share cancels in a pair)."""
    if not timed or not timed.get("candidate"):
        return None
    return statistics.median(timed["reference"]) / max(statistics.median(timed["candidate"]), 1e-9)


def summary(rows: list[dict]) -> dict:
    speedups = [r["speedup"] for r in rows if r["speedup"] is not None]
    inside = [s for s in speedups if BAND[0] <= s <= BAND[1]]
    worst = max(rows, key=lambda r: abs((r["speedup"] or 0) - 1), default=None)
    unpaired = [r["of_medians"] for r in rows if r.get("of_medians") is not None]
    return {"n": len(rows), "timed": len(speedups), "median": statistics.median(speedups) if speedups else None,
            "in_band": len(inside), "in_band_of_medians": sum(BAND[0] <= p <= BAND[1] for p in unpaired),
            "worst": worst and (worst["name"], worst["speedup"]),
            "not_correct": [(r["name"], r["verdict"], r["error"][:80]) for r in rows if r["verdict"] != "correct"]}


def print_table(title: str, rows: list[dict], s: dict, wall: float) -> None:
    print(f"\n== {title}: {s['n']} evaluations in {wall:.0f} s")
    for r in rows:
        sp, iv = r["speedup"], r["interval"] or [None, None]
        flag = "" if sp is not None and BAND[0] <= sp <= BAND[1] else "  <-- outside"
        print(f"{r['problem']:>7} {r['name'][:44]:44s} {r['verdict']:>12s} {sp or 0:7.3f} "
              f"[{iv[0] or 0:.3f}, {iv[1] or 0:.3f}] {'precise' if r['precise'] else 'ROUGH':>7s} "
              f"of medians {r.get('of_medians') or 0:6.3f} "
              f"ref {r['ref_ms'] or 0:8.3f} ms alone {r['diagnostics']['ref_ms_isolated'] or 0:8.3f} ms "
              f"core {r['diagnostics']['timing_core']}{flag}")
    med = s["median"]
    print(f"median {med:.4f}, {s['in_band']}/{s['timed']} in {list(BAND)} ({s['in_band_of_medians']} by the "
          f"ratio of medians), worst {s['worst']}; "
          f"not correct: {len(s['not_correct'])}" if med else "no speedups", flush=True)


def run_repeats(picked: list, args: argparse.Namespace, cfg: EvalConfig, out: dict) -> None:
    """`args.repeats` evaluations of each picked problem, one problem at a time, saved after each."""
    rows, wall = [], 0.0
    for task in picked:
        results, task_wall = run([task] * args.repeats, cfg, args.workers or None)
        rows, wall = rows + rows_of([task] * args.repeats, results), wall + task_wall
        names = dict.fromkeys(r["name"] for r in rows)
        out["repeats"] = {"rows": rows, "wall_s": wall,
                          "per_problem": {n: summary([r for r in rows if r["name"] == n]) for n in names}}
        s = out["repeats"]["per_problem"][task.name]
        print(f"{task.name}: {s['in_band']}/{s['timed']} in {list(BAND)}, median {s['median']}, "
              f"worst {s['worst']}, {task_wall:.0f} s", flush=True)
        save_json(args.out, out)
    print_table(f"{args.repeats} repeats of {', '.join(t.name for t in picked)}", rows, summary(rows), wall)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernelbench", default="../shared/kernelbench")
    ap.add_argument("--levels", default="1,2,3", help="levels whose every problem runs once; none: only the repeats")
    ap.add_argument("--limit", type=whole, default=0, help="at most this many problems per level (0: all)")
    ap.add_argument("--skip", type=whole, default=0, help="leave out each level's first this many problems "
                    "(to go on from a run cut short, whose JSON says how far it came)")
    ap.add_argument("--repeat", default=",".join(LAUNCH_BOUND), help="name substrings of problems to repeat")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--workers", type=int, default=0, help="runners per GPU (0: the evaluator's default)")
    ap.add_argument("--baseline", default="eager")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "ref_self.json"))
    args = ap.parse_args()
    check_outputs(("--out", args.out, False))
    levels = [] if args.levels == "none" else int_list(args.levels, "--levels")
    out = {"config": vars(args)}
    keys = [k for k in args.repeat.split(",") if k]
    every = [t for lvl in (1, 2, 3) for t in load_kernelbench(args.kernelbench, lvl)]
    cfg = EvalConfig(device=resolve_device("cuda"), require_triton=False, baseline=args.baseline)  # GPU only
    picked = [next(t for t in every if k in t.name) for k in keys]
    if picked and args.repeats:  # first: the launch-bound models are where timing was noise
        run_repeats(picked, args, cfg, out)
    rows, wall = [], 0.0
    for level in levels:  # in parts of CHUNK problems, saved after each, so a cut run keeps what it measured
        tasks = load_kernelbench(args.kernelbench, level)[args.skip:][: args.limit or None]
        for start in range(0, len(tasks), CHUNK):
            part = tasks[start:start + CHUNK]
            results, part_wall = run(part, cfg, args.workers or None)
            rows, wall = rows + rows_of(part, results), wall + part_wall
            out["all"] = {"rows": rows, "summary": summary(rows), "wall_s": wall}
            first = args.skip + start + 1
            print_table(f"level {level}, problems {first}-{first + len(part) - 1}", rows_of(part, results),
                        summary(rows_of(part, results)), part_wall)
            save_json(args.out, out)
    if rows:
        print_table("every problem once", rows, out["all"]["summary"], wall)
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
