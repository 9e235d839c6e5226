"""What each of the judge's per-call steps costs on real KernelBench sizes (GPU; issue 15).

No candidate and no runner: the judge's own helpers (`drkernel.judge`, `drkernel.compare`) run
in this process on a reference, with the reference's output standing in for a candidate's, so
the cost of a correctness trial and of a verified timed call can be split into its parts:
fresh inputs, the signed-normal redraw, cloning inputs, a reference forward, `compare` and
`degenerate` (Triton kernels, `drkernel.compare_kernels`), the input-mutation check, the
copy-bandwidth probe. Each step is timed `--repeats` times with a device synchronisation
around it; the table shows the median milliseconds. Also: the first and second call of a
comparison kernel in a fresh process (what each judge, one process per job, pays for Triton).

    python bench/judge_costs.py --kernelbench .bench_data/kernelbench --problems 1:19,1:23,2:12
    python bench/judge_costs.py --device cpu --kernelbench ../shared/kernelbench --problems 2:12 \
        --repeats 1 --json /tmp/judge_costs.json                     # CPU smoke (Triton interpreter)
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.entry import InputError, check_outputs, exit_status  # noqa: E402
from bench.jsonfile import save_json  # noqa: E402
from drkernel import compare, judge  # noqa: E402
from drkernel.channel import Channel  # noqa: E402
from drkernel.evaluator import EvalConfig, resolve_device  # noqa: E402
from drkernel.runner import import_file  # noqa: E402
from drkernel.tasks import Task, TaskError, load_kernelbench  # noqa: E402


def _timed(fn, device, repeats: int) -> float:
    """Median milliseconds of `fn()` between two device synchronisations."""
    times = []
    for _ in range(repeats):
        judge._sync(device)
        t0 = time.perf_counter()
        fn()
        judge._sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _reference_for(code: str, device, workdir: str) -> judge.Reference:
    path = os.path.join(workdir, "reference.py")
    Path(path).write_text(code)
    r = judge.Reference(cfg=EvalConfig(), reference_path=path, twin=Channel(sock=-1, pid=0, dir=workdir))
    r.device, r.seed = device, r.cfg.seed
    r.ref_mod = import_file(path, "_drk_costs_reference")
    r.template = judge._build_reference(r)
    return r


def costs(code: str, device, repeats: int) -> dict[str, float]:
    """Milliseconds per step for one problem."""
    with tempfile.TemporaryDirectory() as workdir:
        j = _reference_for(code, device, workdir)
        cfg = j.cfg
        inputs = judge.gen_inputs(j, j.seed)
        out = judge.run_reference(j, judge._clone(inputs), j.seed)
        ref = judge.run_reference(j, judge._clone(inputs), j.seed)
        row = {
            "io_gb": (compare.nbytes(compare.tensors(inputs)) + compare.nbytes(compare.tensors(out))) / 1e9,
            "gen_inputs": _timed(lambda: judge.gen_inputs(j, j.seed + 1), device, repeats),
            "gen_signed": _timed(lambda: judge.gen_inputs(j, j.seed + 2, signed=True), device, repeats),
            "clone_inputs": _timed(lambda: judge._clone(inputs), device, repeats),
            "new_reference": _timed(lambda: copy.deepcopy(j.template), device, repeats),
            "reference_forward": _timed(lambda: judge.run_reference(j, judge._clone(inputs), j.seed), device, repeats),
            "compare": _timed(lambda: compare.compare(out, ref, cfg), device, repeats),
            "degenerate": _timed(lambda: compare.degenerate(out, ref, inputs, cfg), device, repeats),
            "same_values": _timed(lambda: [compare.same_values(a, a) for a in compare.tensors(inputs)], device,
                                  repeats),
        }
        if device.type == "cuda":
            row["copy_bandwidth"] = _timed(lambda: judge._copy_bandwidth(device), device, 2)
    return row


_FIRST_CALL = """
import time, torch
from drkernel import compare
x = torch.rand(4096, device="cuda")
t0 = time.perf_counter(); compare.same_values(x, x); torch.cuda.synchronize(); t1 = time.perf_counter()
compare.same_values(x, x); torch.cuda.synchronize(); t2 = time.perf_counter()
print((t1 - t0) * 1e3, (t2 - t1) * 1e3)
"""


def first_call_ms() -> list[list[float]]:
    """[first, second] milliseconds of a comparison kernel in two fresh processes: a judge is a
    fresh process per job, so each pays Triton's start (the second process finds the compiled
    kernel in Triton's disk cache)."""
    import subprocess
    out = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", _FIRST_CALL], capture_output=True, text=True, cwd=ROOT)
        out.append([float(v) for v in r.stdout.split()] if r.returncode == 0 else [float("nan")] * 2)
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernelbench", default=str(ROOT / ".bench_data" / "kernelbench"))
    p.add_argument("--problems", default="1:19,1:23,1:36,1:1,2:12", help="level:id, comma separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT", "bench/results"), "judge_costs.json"))
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise InputError(f"--repeats must be >= 1, got {args.repeats}")
    check_outputs(("--json", args.json, False))
    return args


def parse_problems(spec: str) -> list[tuple[int, int]]:
    """The (level, problem id) pairs of `--problems` ("1:19,2:12"); InputError on anything else."""
    wanted = []
    for item in filter(None, spec.replace(" ", "").split(",")):
        parts = item.split(":")
        if len(parts) != 2 or not all(x.isascii() and x.isdigit() for x in parts):
            raise InputError(f"--problems: {item!r} is not level:id (e.g. 1:19), in {spec!r}")
        wanted.append((int(parts[0]), int(parts[1])))
    if not wanted:
        raise InputError(f"--problems names no problem: {spec!r} (level:id, comma separated)")
    return wanted


def find_task(kernelbench: str, level: int, pid: int) -> Task:
    """Problem `pid` of KernelBench level `level`; TaskError when the copy has no such problem."""
    tasks = load_kernelbench(kernelbench, level, [pid])
    if not tasks:
        raise TaskError(f"KernelBench level_{level} in {kernelbench!r} has no problem {pid}")
    return tasks[0]


def main(argv=None) -> dict:
    import torch
    args = parse_args(argv)
    wanted = parse_problems(args.problems)
    device = torch.device(resolve_device(args.device))  # on cpu: Triton's interpreter, before any kernel
    torch.backends.cuda.matmul.allow_tf32 = False
    tasks = [find_task(args.kernelbench, level, pid) for level, pid in wanted]  # all found before any timing
    rows = {}
    for task in tasks:
        rows[task.name] = costs(task.code, device, args.repeats)
        torch.cuda.empty_cache() if device.type == "cuda" else None
    steps = list(next(iter(rows.values())).keys())
    print(f"{'problem':42s} " + " ".join(f"{s[:12]:>12s}" for s in steps))
    for name, row in rows.items():
        print(f"{name[:42]:42s} " + " ".join(f"{row.get(s, float('nan')):12.2f}" for s in steps))
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "unit": "ms (io_gb: GB)", "rows": rows}
    if device.type == "cuda":
        result["first_call_ms"] = first_call_ms()
        print("comparison kernel in a fresh process, first and second call (ms):", result["first_call_ms"])
    save_json(args.json, result)
    return result


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
