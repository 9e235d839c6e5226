"""Finding candidate kernels on disk: KernelBench run directories, flat directories, JSONL.

`scan_candidates(root)` reads every candidate it can and reports the rest: it returns a `Scan`
of `Candidate`s and one `Skipped` per entry it could not use (a line that is not a JSON object,
a row with a missing or mistyped field, a file that is not UTF-8 text, a sample directory
without one kernel, a second candidate for the same attempt), so one bad entry never costs the
good ones. Only a root that is missing, unreadable or in no known layout is a `LayoutError`.

A candidate's `path` is the file to evaluate (None for JSONL generations, whose `code` is
inline); `code` is None when a generation produced no code (the caller records a
`format_error`); `name` is the file name when the problem is known by name only (then `level`
is None); `origin` says where it was read (a file, or `file:line`). Samples and turns are 0-based.

Accepted layouts (`scan_candidates(root)` picks one and says so when none fits):

1. runs (KernelBench style):  `<root>/level_N/problem_ID/sample_K.py`, or
   `<root>/level_N/problem_ID/sample_K/` holding `kernel.py` (or exactly one `.py`), or
   `<root>/level_N/problem_ID/kernel.py` (sample 0). `problem_ID` may also be just `ID`
   or `ID_Name` (a KernelBench file stem).
2. flat: `<root>/<level>_<problem_id>.py` or `<root>/<level>_<problem_id>_<sample>.py`, and
   KernelBench's generation names `level_<L>_problem_<P>_sample_<S>[_kernel].py`.
3. named: `<root>/<problem_id>_<Name>.py`, the task file names themselves (like
   `drkernel/data/solutions/`): `level` is None and the file name identifies the task.
4. a `.jsonl` file of generations (generate.py's output): one object per line with integer
   `level` and `problem_id`, optional integer `sample` and `turn` (default 0) and `code` (a
   string, or null: a format error); a row whose `generation_error` is set records a failed
   request (`Candidate.generation_error`), not an answer.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from drkernel.jsonl import iter_jsonl

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
    """A candidates path that is missing, unreadable or in none of the accepted layouts."""


def attempt_name(level: int | None, problem_id: int, sample: int, turn: int, name: str | None = None) -> str:
    """How reports name one attempt: `level 1 problem 3 sample 0 turn 1`."""
    problem = f"problem {problem_id}" if level is None else f"level {level} problem {problem_id}"
    return f"{name or problem} sample {sample} turn {turn}"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One attempt's kernel, as found on disk."""

    level: int | None
    problem_id: int
    sample: int = 0
    turn: int = 0
    path: str | None = None
    code: str | None = None
    name: str | None = None
    origin: str = ""
    generation_error: str | None = None
    task_columns: dict = dataclasses.field(default_factory=dict)  # a generations row's `Task.columns()` it holds

    @property
    def key(self) -> tuple:
        return self.level, self.problem_id, self.sample, self.turn, self.name

    def describe(self) -> str:
        return attempt_name(self.level, self.problem_id, self.sample, self.turn, self.name)


@dataclasses.dataclass(frozen=True)
class Skipped:
    """An input that was not evaluated, and why."""

    where: str  # a file or directory, or `file:line`
    reason: str
    attempt: str = ""  # the attempt it was for, when known (`attempt_name`)

    def __str__(self) -> str:
        return f"{self.where}: " + (f"{self.attempt}: " if self.attempt else "") + self.reason


@dataclasses.dataclass
class Scan:
    """What a candidates path held: the usable candidates and the skipped entries."""

    candidates: list[Candidate] = dataclasses.field(default_factory=list)
    skipped: list[Skipped] = dataclasses.field(default_factory=list)

    def add_file(self, path: Path, level: int | None, problem_id: int, sample: int = 0,
                 name: str | None = None) -> None:
        """The candidate in `path`, or a skipped entry when it cannot be read as UTF-8 text."""
        if sample >= MAX_SAMPLES:
            self.skip(path, f"the sample must be below {MAX_SAMPLES}, not {sample}",
                      attempt_name(level, problem_id, sample, 0, name))
            return
        if not path.is_file():  # reading a FIFO or /dev/zero would never end
            self.skip(path, "not a regular file (a link to nothing, a FIFO, a device or a directory)",
                      attempt_name(level, problem_id, sample, 0, name))
            return
        try:
            code = path.read_bytes().decode("utf-8-sig")  # a byte-order mark, as Python reads a file
        except UnicodeDecodeError as exc:
            reason = f"not UTF-8 text (byte {exc.start + 1}): not a Python source file"
        except OSError as exc:
            reason = f"cannot read it ({exc.strerror or exc})"
        else:
            self.candidates.append(Candidate(level, problem_id, sample, 0, str(path), code, name, str(path)))
            return
        self.skip(path, reason, attempt_name(level, problem_id, sample, 0, name))

    def skip(self, where: str | Path, reason: str, attempt: str = "") -> None:
        self.skipped.append(Skipped(str(where), reason, attempt))


# --------------------------------------------------------------------------------------
# directories
# --------------------------------------------------------------------------------------

def _pick_py(directory: Path) -> Path:
    kernel = directory / "kernel.py"
    if kernel.is_file():
        return kernel
    files = sorted(p for p in directory.glob("*.py") if p.is_file())
    if len(files) == 1:
        return files[0]
    raise LayoutError(f"expected kernel.py or exactly one .py file, found {len(files)} "
                      f"({', '.join(p.name for p in files[:5])})")


def _numbered_dirs(parent: Path, pattern: re.Pattern) -> list[tuple[int, Path]]:
    """(number, directory) of the subdirectories of `parent` whose name `pattern` matches."""
    found = [(pattern.match(p.name), p) for p in sorted(parent.iterdir()) if p.is_dir()]
    return [(int(m.group(1)), p) for m, p in found if m]


def _sample_of(entry: Path) -> int | None:
    """The sample a problem directory's entry holds: `sample_K.py`, `sample_K/`, `kernel.py` (0)."""
    if entry.is_dir():
        m = RUNS_SAMPLE.match(entry.name)
    elif entry.suffix == ".py":  # a link to nothing or a FIFO too: `Scan.add_file` names it
        m = RUNS_SAMPLE.match(entry.stem)
        if not m and entry.name == "kernel.py":
            return 0
    else:
        return None
    return int(m.group(1)) if m else None


def _scan_runs(root: Path, scan: Scan) -> None:
    for level, level_dir in _numbered_dirs(root, RUNS_LEVEL):
        for pid, prob_dir in _numbered_dirs(level_dir, RUNS_PROBLEM):
            for entry in sorted(prob_dir.iterdir()):
                sample = _sample_of(entry)
                if sample is None:
                    continue
                try:
                    path = _pick_py(entry) if entry.is_dir() else entry
                except LayoutError as exc:
                    scan.skip(entry, str(exc), attempt_name(level, pid, sample, 0))
                    continue
                scan.add_file(path, level, pid, sample)


def _scan_flat(root: Path, scan: Scan) -> None:
    numeric, named = [], []
    for p in sorted(root.glob("*.py")):  # whatever the entry is: `Scan.add_file` names what it cannot read
        m = FLAT.match(p.name) or FLAT_KB.match(p.name)
        if m:
            numeric.append((p, m))
        elif NAMED.match(p.name):
            named.append(p)
    if numeric and named:
        raise LayoutError(f"{root}: mixes <level>_<problem_id>.py files with task-named files "
                          f"({named[0].name}); keep one layout per directory")
    for p, m in numeric:
        scan.add_file(p, int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))
    for p in named:
        scan.add_file(p, None, int(NAMED.match(p.name).group(1)), name=p.name)


def _scan_directory(root: Path) -> Scan:
    scan = Scan()
    if any(p.is_dir() and RUNS_LEVEL.match(p.name) for p in root.iterdir()):
        _scan_runs(root, scan)
        if not scan.candidates and not scan.skipped:
            raise LayoutError(f"{root}: level_N directories hold no problem_ID/sample_K.py files. {LAYOUT_HELP}")
        return scan
    _scan_flat(root, scan)
    if not scan.candidates and not scan.skipped:
        raise LayoutError(f"{root}: no candidates found in a known layout. {LAYOUT_HELP}")
    return scan


# --------------------------------------------------------------------------------------
# JSONL generations
# --------------------------------------------------------------------------------------

# the most samples per problem and turns per sample an attempt may name: the metrics count every
# (problem, sample, turn) up to the largest named, so one row's `"sample": 10**9` would fill memory
MAX_SAMPLES = 10_000
MAX_TURNS = 1_000


def _count_field(row: dict, key: str, required: bool, below: int | None = None) -> int:
    """The non-negative integer `row[key]` (absent or null: 0 unless required), under `below`;
    ValueError says why not."""
    value = row.get(key)
    if value is None:
        if required:
            raise ValueError(f"missing `{key}`")
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{key}` must be a non-negative integer, not {str(value)[:40]!r}")
    if below is not None and value >= below:
        raise ValueError(f"`{key}` must be below {below}, not {value}")
    return value


def _generation(row: dict, where: str) -> Candidate:
    """The candidate of one generations row (ValueError: why the row is unusable)."""
    level, pid = _count_field(row, "level", True), _count_field(row, "problem_id", True)
    sample, turn = _count_field(row, "sample", False, MAX_SAMPLES), _count_field(row, "turn", False, MAX_TURNS)
    if "code" not in row:  # generate.py writes it on every row, null where the response held none
        raise ValueError("no `code` field: not a row of generations (evaluate.py's own results.jsonl?)")
    code = row["code"]
    if code is not None and not isinstance(code, str):
        raise ValueError(f"`code` must be a string or null, not {json.dumps(code)[:40]}")
    failed = row.get("generation_error")
    named = {k: row[k] for k in ("task", "task_key", "task_sha") if k in row}
    return Candidate(level, pid, sample, turn, None, code if code and code.strip() else None, None, where,
                     str(failed) if failed else None, named)


def _row_attempt(row: dict) -> str:
    """The attempt a bad row names, as far as its fields say (for the report)."""
    if not all(type(row.get(k)) is int for k in ("level", "problem_id")):
        return ""
    sample, turn = row.get("sample"), row.get("turn")
    return attempt_name(row["level"], row["problem_id"], sample if type(sample) is int else 0,
                        turn if type(turn) is int else 0)


def scan_generations(path: str | Path) -> Scan:
    """Candidates from a JSONL of generations; every bad line or row is a `Skipped` with its line."""
    path = Path(path)
    scan = Scan()
    try:
        for line in iter_jsonl(path):
            where = f"{path}:{line.lineno}"
            if line.row is None:
                scan.skip(where, line.error)
                continue
            try:
                scan.candidates.append(_generation(line.row, where))
            except ValueError as exc:
                scan.skip(where, str(exc), _row_attempt(line.row))
    except OSError as exc:
        raise LayoutError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    return scan


# --------------------------------------------------------------------------------------
# entry points
# --------------------------------------------------------------------------------------

def _unique(scan: Scan) -> Scan:
    """The first candidate of each attempt; a later one is skipped, naming the first."""
    first: dict[tuple, Candidate] = {}
    out = Scan(skipped=list(scan.skipped))
    for c in scan.candidates:
        kept = first.setdefault(c.key, c)
        if kept is c:
            out.candidates.append(c)
        else:
            out.skip(c.origin, f"a second candidate for this attempt (the first: {kept.origin})", c.describe())
    return out


def scan_candidates(root: str | Path) -> Scan:
    """Every candidate under `root` (a directory in one of the layouts, or a `.jsonl`), and what
    was skipped. LayoutError when `root` itself is unusable."""
    root = Path(root)
    if root.is_file():
        if root.suffix == ".jsonl":
            return _unique(scan_generations(root))
        if root.suffix == ".py":
            raise LayoutError(f"{root}: a single .py is ambiguous (which problem?); put it in a "
                              f"directory as <level>_<problem_id>.py. {LAYOUT_HELP}")
        raise LayoutError(f"{root}: unknown candidates file type. {LAYOUT_HELP}")
    if not root.is_dir():
        raise LayoutError(f"{root}: no such file or directory")
    try:
        return _unique(_scan_directory(root))
    except OSError as exc:
        raise LayoutError(f"{root}: cannot read it ({exc.strerror or exc})") from None
