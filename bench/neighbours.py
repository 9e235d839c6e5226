"""Hostile neighbours on one GPU (GPU): honest kernels evaluated alone, then beside hostile ones.

Four of our level-1 solutions at full KernelBench size are evaluated with one worker (serial), then
again with `--workers` runners on the same GPU together with hostile candidates (by default the
fixture that leaves a spin kernel running after its answers). The honest kernels must be
`correct` both times with the same hack codes, and their speedups within `--tolerance` (3 %) of
serial. Prints a table per honest kernel; writes JSON (`--out`); exits 1 unless all hold.

    python bench/neighbours.py --kernelbench ../shared/kernelbench --out $OUT/neighbours.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.candidates import headers  # noqa: E402
from bench.entry import check_outputs, exit_status, fraction  # noqa: E402
from bench.jsonfile import save_json  # noqa: E402
from drkernel.evaluator import EvalConfig, EvalResult, Evaluator, resolve_device  # noqa: E402
from drkernel.tasks import BUNDLED_DIR, load_kernelbench  # noqa: E402

HONEST = ("level1_19_ReLU.py", "level1_23_Softmax.py", "level1_21_Sigmoid.py", "level1_36_RMSNorm_.py")
HOSTILE = ("tests/fixtures/hacks/neighbour_spin_after_reply.py",)


def honest_pairs(kernelbench: str) -> list[tuple[str, str, str]]:
    """(name, reference code, candidate code) of the honest solutions."""
    tasks = {t.problem_id: t for t in load_kernelbench(kernelbench, 1)}
    out = []
    for name in HONEST:
        pid = int(name.split("_")[1])
        out.append((name, tasks[pid].code, (ROOT / "bench/solutions" / name).read_text()))
    return out


def hostile_pairs() -> list[tuple[str, str, str]]:
    out = []
    for rel in HOSTILE:
        path = ROOT / rel
        out.append((path.name, (BUNDLED_DIR / headers(path)["task"]).read_text(), path.read_text()))
    return out


def run(pairs: list[tuple[str, str, str]], workers: int) -> tuple[dict, float]:
    t0 = time.perf_counter()
    with Evaluator(EvalConfig(device=resolve_device("cuda")), workers=workers) as ev:  # GPU only
        results = ev.evaluate_many([(ref, cand) for _, ref, cand in pairs])
    return {name: r for (name, _, _), r in zip(pairs, results)}, time.perf_counter() - t0


def honest_row(name: str, alone: EvalResult, beside: EvalResult, tolerance: float) -> dict:
    """One honest kernel alone and beside the hostile ones: ok only when both are `correct` with the
    same hack codes and speedups within `tolerance` (a kernel failing both times proves nothing)."""
    drift = abs(beside.speedup / alone.speedup - 1) if alone.speedup and beside.speedup else None
    ok = (alone.verdict == beside.verdict == "correct" and alone.hacks == beside.hacks
          and drift is not None and drift <= tolerance)
    return {"file": name, "serial": [alone.verdict, alone.hacks, alone.speedup],
            "beside_hostile": [beside.verdict, beside.hacks, beside.speedup], "speedup_drift": drift, "ok": ok,
            "idle_wait_s": beside.details.get("idle_wait_s"), "retried_alone": beside.details.get("retried_alone")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernelbench", default="../shared/kernelbench")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--tolerance", type=fraction, default=0.03)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "neighbours.json"))
    args = ap.parse_args()
    check_outputs(("--out", args.out, False))
    honest = honest_pairs(args.kernelbench)
    serial, serial_s = run(honest, 1)
    mixed, mixed_s = run(hostile_pairs() + honest, args.workers)
    rows = [honest_row(name, serial[name], mixed[name], args.tolerance) for name, _, _ in honest]
    hostile = [{"file": n, "verdict": mixed[n].verdict, "hacks": mixed[n].hacks} for n, _, _ in hostile_pairs()]
    summary = {"serial_s": serial_s, "mixed_s": mixed_s, "workers": args.workers, "rows": rows, "hostile": hostile,
               "all_ok": all(r["ok"] for r in rows)}
    save_json(args.out, summary)
    print(f"{'honest kernel':28s} {'serial':>22s} {'beside hostile':>22s} {'drift':>7s} {'idle wait':>9s} ok")
    for r in rows:
        s, m = r["serial"], r["beside_hostile"]
        print(f"{r['file']:28s} {s[0]:>12s} {s[2] or 0:9.3f} {m[0]:>12s} {m[2] or 0:9.3f} "
              f"{(r['speedup_drift'] or 0) * 100:6.2f}% {r['idle_wait_s'] or 0:9.3f} {'yes' if r['ok'] else 'NO'}")
    for h in hostile:
        print(f"hostile {h['file']}: {h['verdict']} {h['hacks']}")
    print(f"serial {serial_s:.1f} s, with {args.workers} workers beside hostile {mixed_s:.1f} s; "
          f"{'all within' if summary['all_ok'] else 'NOT all within'} {args.tolerance:.0%}")
    return 0 if summary["all_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
