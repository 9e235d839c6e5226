"""Does one torch.profiler call slow a process's later launches? A launch-bound KernelBench model
timed (CUDA events, median of 60 calls), then one call profiled as the judge's runners profile
(`drkernel.profiling.profile_cuda`), then timed again; each variant in a fresh process. Prints a
table and writes JSON."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {"default": {}, "TEARDOWN_CUPTI=0": {"TEARDOWN_CUPTI": "0"}, "TEARDOWN_CUPTI=1": {"TEARDOWN_CUPTI": "1"}}


def _median_ms(model, inputs, n: int = 60) -> float:
    import torch
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        model(*inputs)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def child(path: str) -> dict:
    """Times before and after one profiled call, in this process."""
    import functools

    import torch

    from drkernel.profiling import profile_cuda
    from drkernel.runner import import_file
    mod = import_file(path, "reference_under_test")
    torch.manual_seed(0)
    model = mod.Model(*mod.get_init_inputs()).cuda().eval()
    inputs = [x.cuda() if isinstance(x, torch.Tensor) else x for x in mod.get_inputs()]
    with torch.no_grad():
        for _ in range(5):
            model(*inputs)
        before = _median_ms(model, inputs)
        again = _median_ms(model, inputs)
        profile_cuda(functools.partial(model, *inputs))
        after = _median_ms(model, inputs)
        later = _median_ms(model, inputs)
    return {"before": before, "before_again": again, "after_profile": after, "after_again": later}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kernelbench", default="../shared/kernelbench")
    ap.add_argument("--problems", default="3:19,3:9,1:19", help="level:problem_id, comma-separated")
    ap.add_argument("--child", default="")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "profiler_after.json"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    rows = []
    from drkernel.tasks import load_kernelbench
    for rel in args.problems.split(","):
        level, pid = map(int, rel.split(":"))
        task = next(t for t in load_kernelbench(args.kernelbench, level) if t.problem_id == pid)
        path = f"/tmp/profiler_after_{level}_{pid}.py"
        Path(path).write_text(task.code)
        for name, env in VARIANTS.items():
            p = subprocess.run([sys.executable, __file__, "--child", path], capture_output=True, text=True,
                               env={**os.environ, **env}, timeout=300)
            if p.returncode:
                print(rel, name, "failed:", p.stderr[-400:])
                continue
            r = json.loads(p.stdout.strip().splitlines()[-1])
            rows.append({"problem": rel, "variant": name, **r})
            print(f"{rel:40s} {name:18s} before {r['before']:.3f} / {r['before_again']:.3f} ms   "
                  f"after profile {r['after_profile']:.3f} / {r['after_again']:.3f} ms   "
                  f"x{r['after_profile'] / r['before']:.3f}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
