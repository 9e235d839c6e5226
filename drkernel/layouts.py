"""Finding candidate kernels on disk: KernelBench run directories, flat directories, JSONL.

Every reader returns candidate dicts `{level, problem_id, sample, turn, path, code, name}`:
`path` is the file to evaluate (None for JSONL generations, whose `code` is inline); `code`
is None when a generation produced no code (the caller records a `format_error`); `name`
is the file name when the problem is known by name only (then `level` is None).
Samples and turns are 0-based.

Accepted layouts (`discover_candidates(root)` picks one and says so when none fits):

1. runs (KernelBench style):  `<root>/level_N/problem_ID/sample_K.py`, or
   `<root>/level_N/problem_ID/sample_K/` holding `kernel.py` (or exactly one `.py`), or
   `<root>/level_N/problem_ID/kernel.py` (sample 0). `problem_ID` may also be just `ID`
   or `ID_Name` (a KernelBench file stem).
2. flat: `<root>/<level>_<problem_id>.py` or `<root>/<level>_<problem_id>_<sample>.py`, and
   KernelBench's generation names `level_<L>_problem_<P>_sample_<S>[_kernel].py`.
3. named: `<root>/<problem_id>_<Name>.py`, the task file names themselves (like
   `drkernel/data/solutions/`): `level` is None and the file name identifies the task.
4. a `.jsonl` file of generations: one object per line with `level`, `problem_id`,
   `sample`, `turn` and `code` (null → format error).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

RUNS_LEVEL = re.compile(r"^level_?(\d+)$")
RUNS_PROBLEM = re.compile(r"^(?:problem_?)?(\d+)(?:_.*)?$")
RUNS_SAMPLE = re.compile(r"^sample_?(\d+)$")
FLAT = re.compile(r"^(\d+)_(\d+)(?:_(\d+))?\.py$")
FLAT_KB = re.compile(r"^level_(\d+)_problem_(\d+)(?:_sample_(\d+))?(?:_kernel)?\.py$")
NAMED = re.compile(r"^(\d+)_([A-Za-z].*)\.py$")

LAYOUT_HELP = (
    "accepted candidate layouts: <root>/level_N/problem_ID/sample_K.py (or sample_K/kernel.py); "
    "<root>/<level>_<problem_id>[_<sample>].py; <root>/level_L_problem_P_sample_S_kernel.py; "
    "<root>/<problem_id>_<TaskName>.py; or a .jsonl of generations with level, problem_id, "
    "sample, turn, code")


class LayoutError(ValueError):
    """A candidates path that matches none of the accepted layouts."""


def _candidate(level, problem_id, sample=0, turn=0, path=None, code=None, name=None) -> dict:
    return {"level": None if level is None else int(level), "problem_id": int(problem_id),
            "sample": int(sample or 0), "turn": int(turn or 0),
            "path": None if path is None else str(path), "code": code, "name": name}


def _pick_py(directory: Path) -> Path:
    kernel = directory / "kernel.py"
    if kernel.is_file():
        return kernel
    files = sorted(p for p in directory.glob("*.py") if p.is_file())
    if len(files) == 1:
        return files[0]
    raise LayoutError(f"{directory}: expected kernel.py or exactly one .py file, found "
                      f"{len(files)} ({', '.join(p.name for p in files[:5])})")


def _read(path: Path) -> str:
    return path.read_text(errors="replace")


def _discover_runs(root: Path) -> list[dict]:
    out = []
    for level_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        m = RUNS_LEVEL.match(level_dir.name)
        if not m:
            continue
        level = int(m.group(1))
        for prob_dir in sorted(p for p in level_dir.iterdir() if p.is_dir()):
            pm = RUNS_PROBLEM.match(prob_dir.name)
            if not pm:
                continue
            pid = int(pm.group(1))
            for entry in sorted(prob_dir.iterdir()):
                stem = entry.stem if entry.is_file() else entry.name
                sm = RUNS_SAMPLE.match(stem)
                if entry.is_file() and entry.suffix == ".py" and sm:
                    path = entry
                elif entry.is_dir() and sm:
                    path = _pick_py(entry)
                elif entry.is_file() and entry.name == "kernel.py":
                    sm, path = None, entry
                else:
                    continue
                out.append(_candidate(level, pid, int(sm.group(1)) if sm else 0, 0, path, _read(path)))
    return out


def _discover_flat(root: Path) -> list[dict] | None:
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    numeric, named = [], []
    for p in files:
        m = FLAT.match(p.name) or FLAT_KB.match(p.name)
        if m:
            numeric.append(_candidate(m.group(1), m.group(2), m.group(3) or 0, 0, p, _read(p)))
            continue
        n = NAMED.match(p.name)
        if n:
            named.append(_candidate(None, n.group(1), 0, 0, p, _read(p), name=p.name))
    if numeric and named:
        raise LayoutError(f"{root}: mixes <level>_<problem_id>.py files with task-named files "
                          f"({named[0]['name']}); keep one layout per directory")
    return numeric or named or None


def _check_unique(cands: list[dict], where: str) -> list[dict]:
    seen: dict[tuple, str] = {}
    for c in cands:
        key = (c["level"], c["problem_id"], c["sample"], c["turn"], c["name"])
        if key in seen:
            raise LayoutError(f"{where}: two candidates for level={c['level']} problem={c['problem_id']} "
                              f"sample={c['sample']} turn={c['turn']}: {seen[key]} and {c['path'] or 'a row'}")
        seen[key] = str(c["path"] or "a row")
    return cands


def load_generations(path: str | Path) -> list[dict]:
    """Candidates from a JSONL of generations (`level, problem_id, sample, turn, code`)."""
    path = Path(path)
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LayoutError(f"{path}:{lineno}: not a JSON object ({exc.msg})") from None
        if not isinstance(row, dict):
            raise LayoutError(f"{path}:{lineno}: expected a JSON object per line")
        missing = [k for k in ("level", "problem_id") if row.get(k) is None]
        if missing:
            raise LayoutError(f"{path}:{lineno}: missing {', '.join(missing)}")
        code = row.get("code")
        if code is not None and not isinstance(code, str):
            raise LayoutError(f"{path}:{lineno}: `code` must be a string or null")
        try:
            out.append(_candidate(row["level"], row["problem_id"], row.get("sample"), row.get("turn"),
                                  None, code if code and code.strip() else None))
        except (TypeError, ValueError):
            raise LayoutError(f"{path}:{lineno}: level, problem_id, sample and turn must be integers") from None
    return _check_unique(out, str(path))


def discover_candidates(root: str | Path) -> list[dict]:
    """All candidates under `root` (a directory in one of the layouts, or a `.jsonl`)."""
    root = Path(root)
    if root.is_file():
        if root.suffix == ".jsonl":
            return load_generations(root)
        if root.suffix == ".py":
            raise LayoutError(f"{root}: a single .py is ambiguous (which problem?); put it in a "
                              f"directory as <level>_<problem_id>.py. {LAYOUT_HELP}")
        raise LayoutError(f"{root}: unknown candidates file type. {LAYOUT_HELP}")
    if not root.is_dir():
        raise LayoutError(f"{root}: no such file or directory")
    if any(p.is_dir() and RUNS_LEVEL.match(p.name) for p in root.iterdir()):
        cands = _discover_runs(root)
        if not cands:
            raise LayoutError(f"{root}: level_N directories hold no problem_ID/sample_K.py files. {LAYOUT_HELP}")
        return _check_unique(cands, str(root))
    flat = _discover_flat(root)
    if flat:
        return _check_unique(flat, str(root))
    raise LayoutError(f"{root}: no candidates found in a known layout. {LAYOUT_HELP}")
