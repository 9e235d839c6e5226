"""Our hand-written Triton solutions (bench/solutions/) through evaluate.py on KernelBench (issue 6).

Builds, under `<out_dir>/`, one self-contained run directory per candidate set and runs
`evaluate.py` on each:

- `triton/`: every primary solution `bench/solutions/level{L}_{id}_{TaskName}.py`, default
  evaluator settings (Triton required, every hack check on);
- `reference/`: the reference itself as a torch-only candidate (`ModelNew(Model)`) for the same
  problems, evaluated with `--require_triton false`: its speedup checks the timing path (≈ 1);
- `variants/` (`--variants true`): extra solutions of a problem (`level2_12_..._torch_gemm.py`).

Each run directory holds `tasks/data/level_N-00000-of-00001.jsonl` (the KernelBench rows of its
problems only, in the hub layout, so one `evaluate.py --levels 1,2` call sees exactly these
problems: `--problem_ids` applies to every level and would pull in unsolved problems of the other
level, which count as failures), `candidates/<level>_<problem_id>.py` (drkernel/layouts.py's flat
layout) and evaluate.py's `results.jsonl`, `summary.json` and `report.md`. A combined table is
printed and `kernelbench_eval.json` written next to the run directories.

    python bench/kernelbench_eval.py --tasks ../shared/kernelbench --device cuda     # GPU
    python bench/kernelbench_eval.py --device cpu --shrink true --problem_ids 19      # CPU smoke

`--shrink true` rewrites each problem's module-level size constants (`SHRINK`) to tiny values so
that the Triton interpreter finishes in seconds; tests/test_solutions.py uses the same helpers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.entry import InputError, check_outputs, exit_status  # noqa: E402
from bench.evaluator import reference_as_candidate  # noqa: E402
from drkernel.config import int_list, parse_config  # noqa: E402
from drkernel.jsonl import dumps, field_problem, read_jsonl  # noqa: E402
from drkernel.tasks import Task, load_kernelbench  # noqa: E402

SOLUTIONS = ROOT / "bench" / "solutions"
SOLUTION_FILE = re.compile(r"^level(\d+)_(\d+)_(.+)\.py$")

# Tiny values of each problem's module-level size constants, for CPU runs under the Triton
# interpreter. Non-powers of two and sizes above one block keep the masks and loops exercised.
SHRINK: dict[tuple[int, int], dict[str, int]] = {
    (1, 1): {"N": 40},
    (1, 19): {"batch_size": 4, "dim": 1000},
    (1, 21): {"batch_size": 4, "dim": 1000},
    (1, 22): {"batch_size": 3, "dim": 2500},  # > one 2048 block
    (1, 23): {"batch_size": 3, "dim": 9000},  # > one 4096 block: the looped path
    (1, 24): {"batch_size": 3, "dim": 9000},  # > one 4096 block: the online max/sum
    (1, 25): {"batch_size": 3, "dim": 1500},
    (1, 26): {"batch_size": 4, "dim": 1000},
    (1, 36): {"batch_size": 2, "features": 5, "dim1": 9, "dim2": 130},
    (1, 39): {"batch_size": 3, "dim": 9000},  # > one 8192 block
    (1, 47): {"batch_size": 3, "dim1": 37, "dim2": 130},
    (1, 49): {"batch_size": 3, "dim1": 37, "dim2": 130},
    (2, 9): {"batch_size": 20, "in_features": 44, "out_features": 70},
    (2, 12): {"batch_size": 20, "in_features": 40, "out_features": 70},
    (2, 76): {"batch_size": 20, "in_features": 44, "out_features": 130},  # bias_shape follows
}


@dataclasses.dataclass(frozen=True)
class Solution:
    level: int
    problem_id: int
    path: Path

    @property
    def key(self) -> tuple[int, int]:
        return self.level, self.problem_id

    def is_primary(self, task: Task) -> bool:
        """The file named after its task; anything longer is a variant of that problem."""
        return self.path.name == f"level{task.level}_{task.name}"


def solution_files(directory: str | os.PathLike = SOLUTIONS) -> list[Solution]:
    out = []
    for path in sorted(Path(directory).glob("level*_*.py")):
        m = SOLUTION_FILE.match(path.name)
        if m:
            out.append(Solution(int(m.group(1)), int(m.group(2)), path))
    return out


def shrink_code(code: str, sizes: dict[str, int]) -> str:
    """Set module-level constants `name = value` in a problem's source. Editing the text (not the
    imported module) keeps derived constants right, e.g. `bias_shape = (out_features,)`."""
    for name, value in sizes.items():
        pattern = re.compile(rf"^{re.escape(name)}\s*=.*$", re.MULTILINE)
        if len(pattern.findall(code)) != 1:
            raise ValueError(f"shrink: expected exactly one module-level `{name} = ...` line")
        code = pattern.sub(f"{name} = {value!r}  # shrunk for a CPU run", code)
    return code


def shrunk_task(task: Task) -> Task:
    sizes = SHRINK.get((task.level, task.problem_id))
    if sizes is None:
        raise KeyError(f"no SHRINK entry for level {task.level} problem {task.problem_id} ({task.name})")
    return dataclasses.replace(task, code=shrink_code(task.code, sizes), source=task.source + " (shrunk)")


def write_run_dir(run_dir: Path, tasks: list[Task], candidates: dict[tuple[int, int], list[str]]) -> Path:
    """`run_dir/tasks` (hub-layout JSONL of `tasks`) and `run_dir/candidates/<L>_<P>[_<S>].py`."""
    data = run_dir / "tasks" / "data"
    data.mkdir(parents=True, exist_ok=True)
    for old in data.glob("level_*.jsonl"):
        old.unlink()  # a rerun with fewer levels must not see stale splits
    for level in sorted({t.level for t in tasks}):
        rows = [{"code": t.code, "level": t.level, "name": t.name, "problem_id": t.problem_id}
                for t in tasks if t.level == level]
        (data / f"level_{level}-00000-of-00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cand_dir = run_dir / "candidates"
    cand_dir.mkdir(parents=True, exist_ok=True)
    for old in cand_dir.glob("*.py"):
        old.unlink()
    for (level, pid), codes in sorted(candidates.items()):
        for sample, code in enumerate(codes):
            suffix = f"_{sample}" if len(codes) > 1 else ""
            (cand_dir / f"{level}_{pid}{suffix}.py").write_text(code)
    return run_dir


@dataclasses.dataclass
class KernelBenchEvalConfig:
    tasks: str = dataclasses.field(default=str(ROOT.parent / "shared" / "kernelbench"), metadata={
        "help": "a local KernelBench copy in the hub layout (data/level_N-*.jsonl)"})
    levels: str = "1,2"
    problem_ids: str = dataclasses.field(default="", metadata={
        "help": "comma list (applied to every level); empty = every problem with a solution"})
    out_dir: str = dataclasses.field(default="", metadata={
        "help": "empty = $OUT/kernelbench_eval if $OUT is set, else outputs/kernelbench_eval"})
    device: str = "cuda"
    shrink: bool = dataclasses.field(default=False, metadata={
        "help": "tiny problem sizes (SHRINK) for CPU smoke runs"})
    references: bool = dataclasses.field(default=True, metadata={
        "help": "also evaluate each reference as a torch-only candidate (timing-path check)"})
    variants: bool = dataclasses.field(default=False, metadata={
        "help": "also evaluate extra solutions of a problem (e.g. the torch-GEMM level2_12)"})
    trials: int = 5
    perf_trials: int = 100
    timeout: float = 180.0
    workers: int = 0
    resume: bool = True
    build_only: bool = dataclasses.field(default=False, metadata={
        "help": "write the run directories and print the evaluate.py commands, run nothing"})
    replot: str = dataclasses.field(default="", metadata={
        "help": "a kernelbench_eval.json: rewrite each run's summary, plots and report.md from its rows "
                "into <out_dir>/<run>/ (for a GPU run whose plots did not come back), run nothing"})


def _out_dir(cfg: KernelBenchEvalConfig) -> Path:
    if cfg.out_dir:
        return Path(cfg.out_dir)
    return Path(os.environ["OUT"]) / "kernelbench_eval" if os.environ.get("OUT") else ROOT / "outputs" / "kernelbench_eval"


def build_runs(cfg: KernelBenchEvalConfig, out: Path) -> list[dict]:
    """Write the run directories; returns `{name, dir, require_triton, levels}` per run."""
    wanted = set(int_list(cfg.problem_ids, "problem_ids"))
    tasks = {}
    for level in int_list(cfg.levels, "levels"):
        for t in load_kernelbench(cfg.tasks, level):
            tasks[t.key] = t
    primary: dict[tuple[int, int], list[str]] = {}
    variants: dict[tuple[int, int], list[str]] = {}
    selected: dict[str, Task] = {}
    for sol in solution_files():
        task = tasks.get(f"{sol.level}_{sol.problem_id}")
        if task is None or (wanted and sol.problem_id not in wanted):
            continue
        selected[task.key] = shrunk_task(task) if cfg.shrink else task
        (primary if sol.is_primary(task) else variants).setdefault(sol.key, []).append(sol.path.read_text())
    missing = sorted(k for k in variants if k not in primary)
    if missing:
        raise SystemExit(f"kernelbench_eval: solutions {missing} are not named level<L>_<task name>.py")
    if not primary:
        raise SystemExit(f"kernelbench_eval: no solutions in {SOLUTIONS} for levels={cfg.levels} "
                         f"problem_ids={cfg.problem_ids or 'all'}")

    def task_list(keys) -> list[Task]:
        return [selected[f"{lvl}_{pid}"] for lvl, pid in sorted(keys)]

    runs = [("triton", task_list(primary), primary, True)]
    if cfg.references:
        refs = {k: [reference_as_candidate(selected[f"{k[0]}_{k[1]}"].code)] for k in primary}
        runs.append(("reference", task_list(primary), refs, False))
    if cfg.variants and variants:
        runs.append(("variants", task_list(variants), variants, True))
    return [{"name": name, "dir": write_run_dir(out / name, ts, cands), "require_triton": req,
             "levels": sorted({t.level for t in ts}), "problems": len(cands)}
            for name, ts, cands, req in runs]


def evaluate_argv(cfg: KernelBenchEvalConfig, run: dict) -> list[str]:
    d = run["dir"]
    return ["--tasks", str(d / "tasks"), "--levels", ",".join(map(str, run["levels"])),
            "--candidates", str(d / "candidates"), "--output_dir", str(d), "--device", cfg.device,
            "--trials", str(cfg.trials), "--perf_trials", str(cfg.perf_trials), "--timeout", str(cfg.timeout),
            "--workers", str(cfg.workers), "--resume", str(cfg.resume).lower(),
            "--require_triton", str(run["require_triton"]).lower()]


def combined_rows(runs: list[dict]) -> list[dict]:
    """One row per (level, problem): each run's verdict, times, speedup and hacks side by side."""
    table: dict[tuple[int, int], dict] = {}
    for run in runs:
        rows, _ = read_jsonl(run["dir"] / "results.jsonl")
        latest = {}
        for r in rows:
            latest[(r.get("level"), r.get("problem_id"), r.get("sample"))] = r
        for (level, pid, sample), r in sorted(latest.items(), key=lambda kv: tuple(v or 0 for v in kv[0])):
            entry = table.setdefault((level, pid), {"level": level, "problem_id": pid, "task": r.get("task")})
            tag = run["name"] if not sample else f"{run['name']}_{sample}"
            entry[tag] = {k: r.get(k) for k in ("verdict", "speedup", "ref_ms", "candidate_ms", "hacks",
                                                 "triton_time_share", "max_abs_err", "error", "wall_s")}
            if entry[tag]["error"]:
                entry[tag]["error"] = str(entry[tag]["error"])[:300]
    return [table[k] for k in sorted(table)]


def format_combined(rows: list[dict], run_names: list[str]) -> str:
    def num(v, fmt):
        return "-" if v is None else fmt % v

    tags = [t for t in dict.fromkeys(k for r in rows for k in r if k.split("_")[0] in run_names)]
    head = f"{'problem':46s} " + " ".join(f"{t + ' verdict':>18s} {'ref_ms':>8s} {'cand_ms':>8s} {'speedup':>7s}"
                                            for t in tags)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for t in tags:
            e = r.get(t) or {}
            verdict = (e.get("verdict") or "-") + ("*" if e.get("hacks") else "")
            cells.append(f"{verdict:>18s} {num(e.get('ref_ms'), '%.3f'):>8s} "
                         f"{num(e.get('candidate_ms'), '%.3f'):>8s} {num(e.get('speedup'), '%.3f'):>7s}")
        lines.append(f"{('L%s ' % r['level']) + str(r['task'])[:-3]:46.46s} " + " ".join(cells))
    lines.append("(* = hacks flagged; see the run's results.jsonl)")
    return "\n".join(lines)


def read_saved(path: str) -> dict:
    """The kernelbench_eval.json that --replot names; InputError when the file is another one (not
    JSON, a list, rows without their problem)."""
    try:
        saved = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"--replot {path}: not JSON ({exc})") from None
    if not (isinstance(saved, dict) and isinstance(saved.get("runs"), dict) and isinstance(saved.get("rows"), list)):
        raise InputError(f"--replot {path}: not a kernelbench_eval.json (an object with runs and rows)")
    for i, row in enumerate(saved["rows"]):
        problem = "not an object" if not isinstance(row, dict) else \
            field_problem(row, {"level": int, "problem_id": int}, required=("level", "problem_id"))
        if problem:
            raise InputError(f"--replot {path}: rows[{i}] {problem}")
    return saved


def replot(saved: dict, out: Path) -> dict:
    """Summary, plots and report.md of every run in a saved kernelbench_eval.json, from its rows."""
    from drkernel import metrics, report

    summaries = {}
    for name in saved["runs"]:
        rows = []
        for r in saved["rows"]:
            e = r.get(name)
            if not e:
                continue
            verdict = e.get("verdict")
            rows.append({"level": r["level"], "problem_id": r["problem_id"], "sample": 0, "turn": 0,
                         "verdict": verdict, "correct": verdict == "correct",
                         "compiled": verdict not in (None, "compile_error", "format_error"),
                         "speedup": e.get("speedup"), "hacks": e.get("hacks") or [],
                         "triton_time_share": e.get("triton_time_share")})
        expected = sorted({(r["level"], r["problem_id"]) for r in saved["rows"]})
        summary = metrics.summarize(rows, expected, samples=1, turns=1)
        report.write_report(summary, rows, out / name, expected=expected, samples=1, turns=1)
        print(f"[kernelbench_eval] {name}: report and plots in {out / name}")
        print(report.format_table(summary))
        summaries[name] = summary
    return summaries


def flat_copies(runs: list[dict]) -> list[Path]:
    """Copy each run's plots and report to the top of $OUT as `<run>_<file>`: the device tool does
    not bring back files from deep or crowded folders (the run folders hold every candidate)."""
    top = os.environ.get("OUT")
    copied: list[Path] = []
    if not top:
        return copied
    for run in runs:
        for src in sorted(Path(run["dir"]).glob("*.png")) + sorted(Path(run["dir"]).glob("report.md")):
            dst = Path(top) / f"{run['name']}_{src.name}"
            shutil.copyfile(src, dst)
            copied.append(dst)
    return copied


def main(argv=None) -> dict:
    cfg = parse_config(KernelBenchEvalConfig, argv)
    out = _out_dir(cfg)
    check_outputs(("--out_dir", out, True))
    out.mkdir(parents=True, exist_ok=True)
    if cfg.replot:
        return replot(read_saved(cfg.replot), out)
    runs = build_runs(cfg, out)
    for run in runs:
        print(f"[kernelbench_eval] {run['name']}: {run['problems']} problem(s) in {run['dir']}\n"
              f"  python evaluate.py {' '.join(evaluate_argv(cfg, run))}", flush=True)
    result = {"config": dataclasses.asdict(cfg), "out_dir": str(out), "runs": {}, "rows": []}
    if cfg.build_only:
        return result

    import evaluate  # repo root; sets TRITON_INTERPRET itself when --device cpu

    failed = []
    for run in runs:
        print(f"\n[kernelbench_eval] ===== {run['name']} =====", flush=True)
        try:
            summary = evaluate.main(evaluate_argv(cfg, run))
        except Exception as exc:  # e.g. the report's plots; the rows in results.jsonl still count
            failed.append(run["name"])
            print(f"[kernelbench_eval] evaluate.py failed for {run['name']}: {exc!r}", file=sys.stderr, flush=True)
            result["runs"][run["name"]] = {"error": repr(exc)}
            continue
        result["runs"][run["name"]] = {k: v for k, v in summary.items() if k not in ("per_turn", "best_of_turns")}
    result["rows"] = combined_rows(runs)
    flat_copies(runs)
    print("\n" + format_combined(result["rows"], [r["name"] for r in runs]))
    path = out / "kernelbench_eval.json"
    path.write_text(dumps(result, indent=1))
    print(f"[kernelbench_eval] wrote {path}")
    if failed:
        raise SystemExit(f"kernelbench_eval: evaluate.py failed for {', '.join(failed)} (see above)")
    return result


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
