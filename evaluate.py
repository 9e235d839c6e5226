"""Evaluate candidate kernels on KernelBench (or the bundled tasks) and report the paper's metrics.

    python evaluate.py                                   # bundled Triton solutions on bundled tasks
    python evaluate.py --tasks ../shared/kernelbench --levels 1,2 --candidates runs/my_run
    python evaluate.py --candidates generations.jsonl --output_dir outputs/eval_rl

Candidates: a directory in one of `drkernel.layouts`' layouts, or a `.jsonl` of generations
(`level, problem_id, sample, turn, code`). Every result row is appended to
`<output_dir>/results.jsonl` (and flushed) as soon as it is known; a rerun with
`--resume true` (the default) skips the attempts already there, so a killed run loses
nothing but the chunk in flight. Missing attempts count as failures in the metrics.
Then `summary.json`, plots and `report.md` are written and the table is printed.

`--baseline compile` times the reference under `torch.compile`: the reference file is
rewritten so that its `Model.forward` is compiled (needs a GPU or a working inductor C++
toolchain; on CPU without one every reference fails and so does every attempt).

On a machine without a GPU (`--device auto` resolves to cpu) Triton runs through its
interpreter: `TRITON_INTERPRET=1` is set before anything imports triton.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import time
from pathlib import Path

from drkernel.config import TaskSelection, compose, parse_config
from drkernel.evaluator import EvalConfig, resolve_device
from drkernel.jsonl import JsonlWriter, read_jsonl

RESULTS_FILE = "results.jsonl"
KEY_FIELDS = ("level", "problem_id", "sample", "turn")
DROP_FIELDS = ("stdout", "stderr")  # kept short by the evaluator, but noise in results.jsonl


@dataclasses.dataclass
class EvaluateConfig(TaskSelection):
    SHARED = ((EvalConfig, {"device": "device", "trials": "trials", "perf_trials": "perf_trials",
                            "timeout": "timeout", "require_triton": "require_triton",
                            "cache_dir": "cache_dir"}),)

    candidates: str = dataclasses.field(default="", metadata={
        "help": "directory (see drkernel/layouts.py) or .jsonl of generations; empty = bundled solutions"})
    output_dir: str = "outputs/eval"
    device: str = dataclasses.field(default=EvalConfig.device, metadata={"help": "auto | cpu | cuda | cuda:N"})
    trials: int = dataclasses.field(default=EvalConfig.trials, metadata={"help": "correctness trials (random inputs)"})
    perf_trials: int = dataclasses.field(default=EvalConfig.perf_trials, metadata={"help": "timing repetitions"})
    timeout: float = dataclasses.field(default=EvalConfig.timeout, metadata={"help": "seconds per evaluation"})
    cache_dir: str = dataclasses.field(default=EvalConfig.cache_dir, metadata={
        "help": "on-disk evaluation cache (shared with train.py and generate.py); empty = none"})
    workers: int = dataclasses.field(default=0, metadata={"help": "sandbox workers; 0 = auto"})
    baseline: str = dataclasses.field(default="eager", metadata={
        "help": "eager | compile (reference under torch.compile; needs a GPU/working inductor)"})
    resume: bool = dataclasses.field(default=True, metadata={"help": "skip attempts already in results.jsonl"})
    samples: int = dataclasses.field(default=1, metadata={
        "help": "samples expected per problem (missing ones count as failures); more are used if present"})
    chunk_size: int = dataclasses.field(default=0, metadata={
        "help": "evaluations per evaluate_many call (results are saved per chunk); 0 = 2 x workers, at least 4"})
    require_triton: bool = dataclasses.field(default=EvalConfig.require_triton, metadata={
        "help": "false only to time torch-only candidates (e.g. the reference against itself): no Triton "
                "launch required, decoy checks off; never for rewards"})


def make_evaluator(cfg: EvaluateConfig, device: str):
    """The real evaluator (tests replace this factory with a fake)."""
    from drkernel.evaluator import Evaluator

    return Evaluator(compose(cfg, EvalConfig, device=device), workers=cfg.workers or None)


# --------------------------------------------------------------------------------------
# references
# --------------------------------------------------------------------------------------

COMPILE_WRAPPER = '''

# ---- added by drkernel evaluate.py --baseline compile: time Model under torch.compile ----
import torch as _drk_torch

_DrkEagerModel = Model


class Model(_DrkEagerModel):
    """The original Model (same constructor, parameters and init order) with forward compiled."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._drk_compiled_forward = _drk_torch.compile(super().forward)

    def forward(self, *args, **kwargs):
        return self._drk_compiled_forward(*args, **kwargs)
'''


def reference_code(task, baseline: str) -> str:
    if baseline == "eager":
        return task.code
    if baseline == "compile":
        return task.code.rstrip("\n") + "\n" + COMPILE_WRAPPER
    raise ValueError(f"--baseline must be eager or compile, not {baseline!r}")


# --------------------------------------------------------------------------------------
# candidates
# --------------------------------------------------------------------------------------

def bundled_candidates(tasks, samples: int) -> list[dict]:
    from drkernel.tasks import bundled_solution

    out = []
    for t in tasks:
        path = bundled_solution(t)
        if path is None:
            continue
        code = Path(path).read_text()
        out.extend({"level": t.level, "problem_id": t.problem_id, "sample": s, "turn": 0,
                    "path": str(path), "code": code, "name": t.name} for s in range(samples))
    return out


def match_candidates(cands: list[dict], tasks) -> tuple[list[tuple[dict, object]], list[dict]]:
    """Pair each candidate with its task by (level, problem_id).

    Candidates known by file name only (level None) match the task of that file name, else
    the only task with that problem id. With the bundled tasks (all level 0) a candidate's
    level is ignored, so a `level_1/...` tree of bundled solutions still matches.
    Returns (matched pairs, unmatched candidates)."""
    by_key = {(t.level, t.problem_id): t for t in tasks}
    by_name = {t.name: t for t in tasks}
    by_pid: dict[int, list] = {}
    for t in tasks:
        by_pid.setdefault(t.problem_id, []).append(t)
    all_bundled = bool(tasks) and all(getattr(t, "source", "") == "bundled" for t in tasks)
    matched, unmatched = [], []
    for c in cands:
        task = None
        if c.get("level") is None:
            task = by_name.get(c.get("name"))
            if task is None and len(by_pid.get(c["problem_id"], [])) == 1:
                task = by_pid[c["problem_id"]][0]
        else:
            task = by_key.get((c["level"], c["problem_id"]))
            if task is None and all_bundled and len(by_pid.get(c["problem_id"], [])) == 1:
                task = by_pid[c["problem_id"]][0]
        if task is None:
            unmatched.append(c)
        else:
            matched.append(({**c, "level": task.level}, task))
    return matched, unmatched


# --------------------------------------------------------------------------------------
# results.jsonl
# --------------------------------------------------------------------------------------

def row_key(row: dict) -> tuple[int, int, int, int]:
    return tuple(int(row.get(k) or 0) for k in KEY_FIELDS)  # type: ignore[return-value]


def read_results(path: Path) -> tuple[list[dict], int]:
    """Rows of results.jsonl; lines that are not complete JSON objects (a write cut by a kill)
    are skipped and counted."""
    rows, bad = [], 0
    found, unreadable = read_jsonl(path)
    for row in found:
        try:
            row_key(row)
        except (TypeError, ValueError, AttributeError):
            bad += 1
            continue
        rows.append(row)
    return rows, bad + unreadable


def _sha(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()[:16]


def _result_dict(res) -> dict:
    if isinstance(res, dict):
        d = dict(res)
    elif hasattr(res, "to_dict"):
        d = res.to_dict()
    else:
        d = dataclasses.asdict(res)
    for k in DROP_FIELDS:
        d.pop(k, None)
    return d


def _same_attempt(prev: dict | None, ident: dict) -> bool:
    """A stored row stands for this attempt only if it evaluated the same candidate code
    against the same reference and baseline, with the same Triton requirement (a row without
    these fields is trusted)."""
    return prev is not None and all(prev.get(k) in (None, ident[k])
                                    for k in ("candidate_sha", "reference_sha", "baseline", "require_triton"))


def _identity(c: dict, task, ref_sha: str, baseline: str, require_triton: bool = True) -> dict:
    return {"level": task.level, "problem_id": task.problem_id, "sample": c["sample"], "turn": c["turn"],
            "task": task.name, "candidate": c.get("path"), "candidate_sha": _sha(c.get("code")),
            "reference_sha": ref_sha, "baseline": baseline, "require_triton": require_triton}


# --------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------

def main(argv=None) -> dict:
    cfg = parse_config(EvaluateConfig, argv)
    device = resolve_device(cfg.device)  # before anything imports triton

    from tqdm import tqdm

    from drkernel import layouts, metrics, report

    if cfg.baseline not in ("eager", "compile"):
        raise SystemExit(f"evaluate.py: --baseline must be eager or compile, not {cfg.baseline!r}")
    tasks = cfg.load_tasks()
    if not tasks:
        raise SystemExit(f"evaluate.py: no tasks for tasks={cfg.tasks!r} levels={cfg.level_list()} "
                         f"problem_ids={cfg.problem_id_list() or None}")

    if cfg.candidates:
        cands = layouts.discover_candidates(cfg.candidates)
    else:
        cands = bundled_candidates(tasks, max(1, cfg.samples))
        if not cands:
            raise SystemExit("evaluate.py: there are no bundled solutions for these tasks; "
                             "pass --candidates DIR_OR_JSONL")
    matched, unmatched = match_candidates(cands, tasks)
    if unmatched:
        print(f"[evaluate] {len(unmatched)} candidate(s) match no selected task (other levels or "
              f"problem ids) and are skipped", file=sys.stderr)

    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / RESULTS_FILE
    if not cfg.resume and results_path.exists() and results_path.stat().st_size:
        backup = results_path.with_name(f"results.{time.strftime('%Y%m%d-%H%M%S')}.jsonl.bak")
        os.replace(results_path, backup)  # a fresh start never destroys finished results
        print(f"[evaluate] --resume false: moved the old results to {backup}", file=sys.stderr)
    old_rows, bad = read_results(results_path) if cfg.resume else ([], 0)
    if bad:
        print(f"[evaluate] skipped {bad} unreadable line(s) in {results_path} (a run cut mid-write)",
              file=sys.stderr)
    done = {}
    for r in old_rows:
        done[row_key(r)] = r  # the last row of a key wins

    ref_shas = {t.key: _sha(reference_code(t, cfg.baseline)) for t in tasks}
    idents = [(c, task, _identity(c, task, ref_shas[task.key], cfg.baseline, cfg.require_triton))
              for c, task in matched]
    pending = [(c, t, i) for c, t, i in idents if not _same_attempt(done.get(row_key(i)), i)]

    writer = JsonlWriter(results_path)
    new_rows = []
    try:
        todo = [(c, t, i) for c, t, i in pending if c.get("code") is not None]
        for c, t, ident in pending:
            if c.get("code") is None:  # the generation held no code block
                row = {**ident, "verdict": "format_error", "compiled": False, "correct": False,
                       "speedup": None, "hacks": [], "error": "no code in the generation"}
                writer.write(row)
                new_rows.append(row)
        if todo:
            evaluator = make_evaluator(cfg, device)
            chunk = cfg.chunk_size or max(4, 2 * (cfg.workers or 1))
            ref_dir = out_dir / "references"
            try:
                with tqdm(total=len(todo), desc="evaluate", unit="kernel", file=sys.stderr) as bar:
                    for start in range(0, len(todo), chunk):
                        part = todo[start:start + chunk]
                        pairs = []
                        for c, t, _ in part:
                            ref = reference_code(t, cfg.baseline)
                            ref_path = ref_dir / f"ref_{t.level}_{t.problem_id}_{cfg.baseline}_{_sha(ref)}.py"
                            if not ref_path.exists():
                                ref_dir.mkdir(parents=True, exist_ok=True)
                                tmp = ref_path.with_suffix(".tmp")
                                tmp.write_text(ref)
                                os.replace(tmp, ref_path)
                            pairs.append((str(ref_path), c["path"] if c.get("path") else c["code"]))
                        results = evaluator.evaluate_many(pairs)
                        if len(results) != len(part):
                            raise RuntimeError(f"evaluator returned {len(results)} results for {len(part)} pairs")
                        for (c, t, ident), res in zip(part, results):
                            row = {**ident, **_result_dict(res)}
                            row.update({k: ident[k] for k in KEY_FIELDS})
                            writer.write(row)
                            new_rows.append(row)
                        bar.update(len(part))
            finally:
                close = getattr(evaluator, "close", None)
                if close:
                    close()
    finally:
        writer.close()

    # the metrics see exactly one row per current candidate: its latest matching result
    latest = {}
    for r in read_results(results_path)[0]:
        latest[row_key(r)] = r
    all_rows = [latest[row_key(i)] for _, _, i in idents if _same_attempt(latest.get(row_key(i)), i)]
    expected = [(t.level, t.problem_id) for t in tasks]
    max_sample = max([c["sample"] for c, _ in matched], default=0)
    samples = max(cfg.samples, max_sample + 1)
    turns = 1 + max([c["turn"] for c, _ in matched], default=0)
    summary = metrics.summarize(all_rows, expected, samples=samples, turns=turns)
    summary["config"] = {**dataclasses.asdict(cfg), "device_resolved": device}
    summary["evaluated_this_run"] = len(new_rows)
    summary["skipped_resumed"] = len(matched) - len(pending)
    report.write_report(summary, all_rows, out_dir, expected=expected, samples=samples, turns=turns)
    print(report.format_table(summary))
    print(f"[evaluate] results: {results_path}  report: {out_dir / 'report.md'}")
    return summary


if __name__ == "__main__":
    main()
