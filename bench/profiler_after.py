"""Does one torch.profiler call slow a process's later launches? (GPU only.) A KernelBench model
timed (CUDA events, median of 60 calls), then one call profiled as the judge's runners profile
(`drkernel.profiling.profile_cuda`), then timed again; each `TEARDOWN_CUPTI` setting in a fresh
process. Prints a table and writes JSON. On the device: `STAGES=profiler bash bench/gpu.sh`, or
`python bench/profiler_after.py --kernelbench .bench_data/kernelbench --problems 3:19,1:19`."""
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

from bench.entry import InputError, check_outputs, exit_status  # noqa: E402
from bench.jsonfile import save_json  # noqa: E402
from drkernel.evaluator import resolve_device  # noqa: E402
from drkernel.tasks import load_kernelbench  # noqa: E402

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


def _problems(text: str) -> list[tuple[int, int]]:
    """`3:19,1:19` as (level, problem id) pairs."""
    pairs = [part.split(":") for part in text.split(",") if part]
    if not pairs or not all(len(p) == 2 and all(x.strip().isdigit() for x in p) for p in pairs):
        raise InputError(f"--problems: {text!r} is not level:problem_id pairs (3:19,1:19)")
    return [(int(level), int(pid)) for level, pid in pairs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernelbench", default="../shared/kernelbench")
    ap.add_argument("--problems", default="3:19,3:9,1:19", help="level:problem_id, comma-separated")
    ap.add_argument("--child", default="")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "profiler_after.json"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    check_outputs(("--out", args.out, False))
    problems = _problems(args.problems)
    resolve_device("cuda")  # a GPU measurement: a machine without one is told so
    rows = []
    for level, pid in problems:
        task = next((t for t in load_kernelbench(args.kernelbench, level) if t.problem_id == pid), None)
        if task is None:
            raise InputError(f"--problems: level {level} has no problem {pid}")
        path = f"/tmp/profiler_after_{level}_{pid}.py"
        Path(path).write_text(task.code)
        rel = f"{level}:{pid}"
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
            save_json(args.out, rows)  # after each row: a run cut short keeps what it measured
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
