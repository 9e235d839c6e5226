"""The README's default run, timed from a clean model cache, with the first-ten-minutes checks.

    python bench/default_run.py   # `accelerate launch train.py`'s quick config, in a temp output dir

Prints a table (wall time, per-step reward and loss, the checks) and writes
bench/results/default_run_cpu.json. The model cache is a fresh temporary directory, so the
time includes the first-use download and conversion of the offline default model.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.entry import check_outputs, exit_status  # noqa: E402
from bench.jsonfile import save_json  # noqa: E402

LIMIT_S = 600.0  # the "under 10 minutes on a 2-core CPU"


def run_default(output_dir: Path, cache: Path) -> float:
    """`accelerate launch train.py` as with no options (its quick config) but writing to
    `output_dir`; returns wall seconds."""
    env = {**os.environ, "DRKERNEL_CACHE": str(cache)}
    cmd = ["accelerate", "launch", "train.py", "--config", "configs/cpu_quick.yaml", "--output_dir", str(output_dir)]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    return time.perf_counter() - t0


def checks(output_dir: Path, wall_s: float) -> dict[str, bool]:
    """What the issue asks of the default run."""
    steps = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {
        "under_10_min": wall_s < LIMIT_S,
        "a_step_with_reward_and_loss": any(s.get("reward_mean", 0) > 0 and s.get("loss", 0) != 0 for s in steps),
        "plots_written": any(output_dir.glob("*.png")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "default_run_cpu.json"))
    args = ap.parse_args()
    check_outputs(("--out", args.out, False))
    with tempfile.TemporaryDirectory(prefix="drk_default_") as tmp:
        output_dir, cache = Path(tmp) / "rl", Path(tmp) / "cache"
        wall_s = run_default(output_dir, cache)
        steps = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line]
        ok = checks(output_dir, wall_s)
    print(f"\n{'step':>4} {'reward_mean':>11} {'loss':>10} {'step_s':>7}")
    for s in steps:
        print(f"{s['step']:>4} {s.get('reward_mean', 0):>11.4f} {s.get('loss', 0):>10.3g} {s.get('step_s', 0):>7.1f}")
    print(f"wall (clean cache, incl. model download): {wall_s:.0f} s")
    for name, passed in ok.items():
        print(f"{name:<28} {'yes' if passed else 'NO'}")
    record = {"machine": f"{platform.node()} ({os.cpu_count()} cores, no GPU)", "wall_s": wall_s,
              "checks": ok, "steps": steps}
    save_json(args.out, record)
    print(f"wrote {args.out}")
    sys.exit(0 if all(ok.values()) else 1)


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
