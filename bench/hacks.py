"""Hack-detection benchmark (GPU): every hostile and legit fixture through the evaluator.

Reads tests/fixtures/{hacks,faults,legit}/*.py (headers `# task:`, `# expect:`, `# device:`),
evaluates each on the GPU against its bundled task, and checks the verdict and hack code; then the
attack fixtures (tests/fixtures/attacks, docs/security.md): verdict, nothing reached a local
listener, nothing left behind. Also evaluates the level-2 "GEMM in torch + Triton epilogue" solution, whose Triton time
share must stay under 0.3.

    python bench/hacks.py --kernelbench .bench_data/kernelbench --out $OUT/hacks.json      # GPU
    python bench/hacks.py --device cpu --only legit_two,output_cached,network --out /tmp/h.json  # CPU smoke

Prints one row per fixture (expected, verdict, hack codes, ok) and how many were as expected.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.candidates import headers  # noqa: E402
from bench.entry import InputError, check_outputs, exit_status  # noqa: E402
from bench.jsonfile import save_json  # noqa: E402
from drkernel.evaluator import EvalConfig, Evaluator, resolve_device  # noqa: E402
from drkernel.tasks import BUNDLED_DIR, load_kernelbench  # noqa: E402
from tests.fixtures.attacks import harness as attacks  # noqa: E402


def record(rows: list[dict], row: dict, out: str) -> None:
    """Keep one result: printed, and the JSON rewritten, so that a stage cut by its timeout keeps its rows."""
    rows.append(row)
    print(json.dumps(row), flush=True)
    save_json(out, rows)


def run_attacks(ev, only: str, rows: list[dict], out: str) -> None:
    """The attack fixtures (tests/fixtures/attacks): verdict, listener, leftovers."""
    for path in attacks.fixtures():
        if only and not any(k in path.name for k in only.split(",") if k):
            continue
        h = attacks.headers(path)
        with tempfile.TemporaryDirectory() as marker, attacks.Listener() as listener:
            code, token = attacks.prepare(path, marker, listener.port)
            res = ev.evaluate((BUNDLED_DIR / h["task"]).read_text(), code)
            time.sleep(0.5)
            left = attacks.leftovers(token, marker)
        ok = attacks.check(h["expect"], res) and not listener.received and not left
        record(rows, dict(file="attacks/" + path.name, device="cuda", expect=h["expect"], verdict=res.verdict,
                          hacks=res.hacks, ok=ok, error=(res.error or "")[:160], reached=listener.received,
                          leftovers=left, confinement=res.details.get("confinement")), out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", default="", help="comma-separated substrings of fixture names to run")
    ap.add_argument("--kernelbench", default="../shared/kernelbench")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "hacks.json"))
    args = ap.parse_args()
    check_outputs(("--out", args.out, False))
    args.device = resolve_device(args.device)  # a GPU asked for and missing: one line, not a JSON of crashes
    files = [f for d in ("hacks", "faults", "legit") for f in sorted((ROOT / "tests/fixtures" / d).glob("*.py"))]
    if args.only:
        files = [f for f in files if any(k in f.name for k in args.only.split(",") if k)]
    rows = []
    with Evaluator(EvalConfig(device=args.device, trials=3, perf_trials=30)) as ev:
        for f in files:
            h = headers(f)
            ref = (BUNDLED_DIR / h["task"]).read_text()
            res = ev.evaluate(ref, f.read_text())
            expect = h.get("expect_cuda", h["expect"]) if args.device.startswith("cuda") else h["expect"]
            record(rows, dict(file=f.name, device=h.get("device"), expect=expect, verdict=res.verdict,
                              hacks=res.hacks, ok=attacks.check(expect, res), error=(res.error or "")[:160],
                              share=res.triton_time_share), args.out)
        run_attacks(ev, args.only, rows, args.out)
        for sol in sorted((ROOT / "bench/solutions").glob("level2_*torch_gemm*.py")):
            if args.only and not any(k in sol.name for k in args.only.split(",") if k):
                continue
            pid = int(sol.name.split("_")[1])
            task = next(t for t in load_kernelbench(args.kernelbench, 2) if t.problem_id == pid)
            res = ev.evaluate(task.code, sol.read_text())
            share = res.triton_time_share
            record(rows, dict(file=sol.name, device="cuda", expect="correct, share < 0.3", verdict=res.verdict,
                              hacks=res.hacks, ok=res.verdict == "correct" and share is not None and share < 0.3,
                              error=(res.error or "")[:160], share=share, speedup=res.speedup,
                              kernels=res.kernels), args.out)
    if not rows:  # nothing was written: the last real results stay
        raise InputError(f"--only {args.only}: matches no fixture, attack or solution; {args.out} left as it was")
    print(f"\n{'file':44s} {'dev':4s} {'expect':30s} {'verdict':14s} {'hacks':30s} ok")
    for r in rows:
        print(f"{r['file'][:44]:44s} {str(r['device'])[:4]:4s} {r['expect'][:30]:30s} {r['verdict']:14s} "
              f"{','.join(r['hacks'])[:30]:30s} {'yes' if r['ok'] else 'NO'}")
    print(f"{sum(r['ok'] for r in rows)}/{len(rows)} as expected")


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
