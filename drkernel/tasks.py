"""Kernel-writing tasks: KernelBench problems (hub id or local path), single files, bundled set.

A task is a reference PyTorch program in KernelBench format: `class Model(nn.Module)`,
`get_inputs()` and `get_init_inputs()`. The policy must write `ModelNew` with the same
constructor and forward signatures. Everything downstream (prompts, evaluator, rewards)
only needs `Task.code`, so every source is turned into the same small dataclass.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

DEFAULT_HUB_ID = "ScalingIntelligence/KernelBench"
BUNDLED_DIR = Path(__file__).parent / "data" / "tasks"
BUNDLED_SOLUTIONS_DIR = Path(__file__).parent / "data" / "solutions"
REQUIRED_NAMES = ("Model", "get_inputs", "get_init_inputs")
# what `ast.parse` (or a recursive walk of its tree) raises on text it cannot take: a syntax error,
# a NUL byte (ValueError), nesting deeper than the parser or the recursion limit allows
UNPARSABLE = (SyntaxError, ValueError, MemoryError, RecursionError)


def text_digest(text: str) -> str:
    """sha256 (hex) of `text`'s UTF-8 bytes; a lone surrogate (JSON can carry one) is hashed as
    its own bytes, so no text raises here."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class TaskError(ValueError):
    """A task file or dataset row that is not a valid KernelBench problem."""


@dataclasses.dataclass(frozen=True)
class Task:
    name: str  # e.g. "19_ReLU.py" (KernelBench's file name)
    level: int
    problem_id: int
    code: str
    source: str = ""  # where it came from (dataset path, file, "bundled")

    @property
    def key(self) -> str:
        """A stable id used in result files: `level_problemid`."""
        return f"{self.level}_{self.problem_id}"

    @property
    def digest(self) -> str:
        return text_digest(self.code)[:16]

    def columns(self) -> dict[str, Any]:
        """The columns of a result row that say which task it answers: level, problem id, file
        name, `key` and the digest of the code."""
        return {"level": self.level, "problem_id": self.problem_id, "task": self.name, "task_key": self.key,
                "task_sha": self.digest}

    def row_problem(self, row: Mapping[str, Any], require_name: bool = True) -> str | None:
        """Why `row` is no answer to this task (None: it is one): each of `columns()` it holds must
        be this task's (ids alone match the same problem number of another task set: another file,
        other code), and with `require_name` it must name the file."""
        if require_name and "task" not in row:
            return f"names no task (no `task` column): it may answer another task than {self.name}"
        mine = self.columns()
        differ = [f"{k} {row[k]!r} (not {mine[k]!r})" for k in mine if k in row and row[k] != mine[k]]
        return f"answers another task than {self.name}: {', '.join(differ)}" if differ else None

    def write(self, directory: str | os.PathLike) -> Path:
        """Write the reference to a real file (the evaluator imports files, never `exec`s strings)."""
        path = Path(directory) / f"ref_{self.level}_{self.problem_id}_{self.digest}.py"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(self.code)
            os.replace(tmp, path)
        return path


def validate_code(code: str, where: str = "task") -> None:
    """Check that the source parses and defines Model, get_inputs and get_init_inputs."""
    if not isinstance(code, str):
        raise TaskError(f"{where}: its code is a {type(code).__name__}, not text")
    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        raise TaskError(f"{where}: not valid Python ({exc.msg}, line {exc.lineno})") from None
    except UNPARSABLE as exc:
        raise TaskError(f"{where}: not valid Python ({type(exc).__name__}: {exc})") from None
    defined = {
        node.name for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))
    } | {
        t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
        if isinstance(t, ast.Name)
    }
    missing = [n for n in REQUIRED_NAMES if n not in defined]
    if missing:
        raise TaskError(f"{where}: missing {', '.join(missing)} (a KernelBench problem needs all of "
                        f"{', '.join(REQUIRED_NAMES)})")


def _parse_name(name: str) -> tuple[int | None, str]:
    m = re.match(r"^(\d+)_", Path(name).name)
    return (int(m.group(1)) if m else None), Path(name).name


def load_task_file(path: str | os.PathLike, level: int = 0, problem_id: int | None = None) -> Task:
    """One problem file. The problem id defaults to the file name's leading number."""
    path = Path(path)
    if not path.is_file():
        raise TaskError(f"{path}: no such task file")
    try:
        code = path.read_text(encoding="utf-8-sig")  # a byte-order mark, as Python reads a file
    except UnicodeDecodeError as exc:
        raise TaskError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    validate_code(code, str(path))
    pid, name = _parse_name(path.name)
    if problem_id is None:
        problem_id = pid if pid is not None else 0
    return Task(name=name, level=level, problem_id=problem_id, code=code, source=str(path))


def load_bundled(problem_ids: Sequence[int] | None = None) -> list[Task]:
    """Our own tiny problems (level 0) for CPU tests and the offline defaults."""
    tasks = [load_task_file(p, level=0) for p in sorted(BUNDLED_DIR.glob("*.py"))]
    tasks.sort(key=lambda t: t.problem_id)
    if problem_ids:
        wanted = set(problem_ids)
        tasks = [t for t in tasks if t.problem_id in wanted]
    for t in tasks:
        object.__setattr__(t, "source", "bundled")
    return tasks


def bundled_solution(task: Task) -> Path | None:
    """Our reference Triton solution for a bundled task, if we wrote one."""
    path = BUNDLED_SOLUTIONS_DIR / task.name
    return path if path.is_file() else None


def load_kernelbench(path_or_id: str = DEFAULT_HUB_ID, level: int = 1,
                     problem_ids: Sequence[int] | None = None) -> list[Task]:
    """KernelBench level N through `datasets` (hub id or a local copy in the hub's layout)."""
    try:
        import datasets
    except ImportError:  # e.g. a GPU image without `datasets`: read a local copy directly
        rows = _read_local_split(path_or_id, level)
    else:
        try:
            rows = datasets.load_dataset(path_or_id, split=f"level_{level}")
        except Exception as exc:  # a missing path, an unknown split, no network for a hub id, a cut line
            why = _bad_line(path_or_id, level) or exc  # `datasets` names no file for a line it cannot parse
            raise TaskError(f"cannot load KernelBench level_{level} from {path_or_id!r}: {why}") from None
    return rows_to_tasks(rows, source=f"{path_or_id}:level_{level}", problem_ids=problem_ids)


def _read_local_split(path: str, level: int) -> list[dict]:
    """The hub layout's JSONL files of one split, without `datasets` (local copies only)."""
    files = _split_files(path, level)
    if not files:
        raise TaskError(f"`datasets` is not installed and {path} holds no level_{level}-*.jsonl files")
    return _rows_of(files)


def _split_files(path: str, level: int) -> list[Path]:
    return sorted(Path(path).glob(f"**/level_{level}-*.jsonl"))


def _rows_of(files: Sequence[Path]) -> list[dict]:
    """Every row of `files`; TaskError at the first line that is no JSON object, named `file:line`."""
    from drkernel.jsonl import iter_jsonl

    rows = []
    for f in files:
        for line in iter_jsonl(f):
            if line.row is None:
                raise TaskError(f"{f}:{line.lineno}: {line.error}")
            rows.append(line.row)
    return rows


def _bad_line(path: str, level: int) -> str | None:
    """Where a local copy's level-N files hold a line that is no JSON object, that line (`_rows_of`)."""
    if not Path(path).is_dir():
        return None
    try:
        _rows_of(_split_files(path, level))
    except TaskError as exc:
        return str(exc)
    except OSError:  # unreadable: `datasets`'s own message says more
        pass
    return None


def rows_to_tasks(rows: Iterable[dict], source: str = "",
                  problem_ids: Sequence[int] | None = None) -> list[Task]:
    """Turn dataset rows (code, level, name, problem_id) into tasks, rejecting broken rows."""
    wanted = set(problem_ids) if problem_ids else None
    tasks = []
    for i, row in enumerate(rows):
        missing = [c for c in ("code", "level", "problem_id") if c not in row or row[c] is None]
        if missing:
            raise TaskError(f"{source} row {i}: missing column(s) {', '.join(missing)}")
        pid, level = _integer(row["problem_id"], f"{source} row {i}: problem_id"), _integer(row["level"], f"{source} row {i}: level")
        if wanted is not None and pid not in wanted:
            continue
        if any(t.problem_id == pid for t in tasks):
            raise TaskError(f"{source} row {i}: problem_id {pid} appears twice")
        name = row.get("name") or f"{pid}_problem.py"
        validate_code(row["code"], f"{source} {name}")
        tasks.append(Task(name=name, level=level, problem_id=pid, code=row["code"], source=source))
    tasks.sort(key=lambda t: t.problem_id)
    return tasks


def _integer(value, what: str) -> int:
    """An integer column of a task row (an int, or text that is one); TaskError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().lstrip("-").isdigit():
        raise TaskError(f"{what} must be an integer, got {value!r}")
    return int(value)


def check_distinct_ids(tasks: Sequence[Task]) -> None:
    """TaskError naming both files when two tasks share a level and problem id: results are keyed
    by them (`Task.key`), so one task would silently hide the other."""
    first: dict[str, Task] = {}
    for task in tasks:
        if task.key in first:
            raise TaskError(f"{first[task.key].source} and {task.source} both are problem {task.problem_id} of "
                            f"level {task.level} (a file's problem id is the number its name starts with, else 0); "
                            f"results are keyed by it: renumber or remove one")
        first[task.key] = task


def is_dataset(spec: str) -> bool:
    """Whether a task-set spec names a KernelBench dataset (split into levels), not our bundled
    problems, one .py file or a folder of them."""
    path = Path(spec)
    if spec == "bundled" or path.suffix == ".py":
        return False
    return not (path.is_dir() and any(path.glob("*.py")) and not any(path.glob("**/*.jsonl"))
                and not any(path.glob("**/*.parquet")))


def load_tasks(spec: str = "bundled", levels: Sequence[int] = (1,),
               problem_ids: Sequence[int] | None = None) -> list[Task]:
    """Resolve a task-set spec used by every script.

    - "bundled": our tiny problems;
    - a `.py` file: one problem; a directory of `.py` files: each is a problem;
    - anything else: a `datasets` path or hub id holding KernelBench splits `level_N`.
    """
    if spec == "bundled":
        return load_bundled(problem_ids)
    path = Path(spec)
    if path.suffix == ".py":
        return [load_task_file(path)]
    if not is_dataset(spec):
        tasks = [load_task_file(p) for p in sorted(path.glob("*.py"))]
        if problem_ids:
            tasks = [t for t in tasks if t.problem_id in set(problem_ids)]
        check_distinct_ids(tasks)
        return tasks
    out: list[Task] = []
    for level in dict.fromkeys(levels):  # a level named twice is loaded once: its tasks would repeat
        out.extend(load_kernelbench(spec, level, problem_ids))
    return out
