"""Evaluate candidate kernels on KernelBench (or the bundled tasks) and report the paper's metrics.

    python evaluate.py                                   # the base configuration: our bundled
                                                         # Triton solutions on the bundled tasks
    python evaluate.py --tasks ../shared/kernelbench --levels 1,2 --candidates runs/my_run
    python evaluate.py --candidates generations.jsonl --output_dir outputs/eval_rl

The base configuration is the `EvaluateConfig` defaults; every `--key value` changes one setting
(`--help` lists them) and the first line printed names the base and the changes. A bad option or
value, a device this machine lacks, an unreadable candidates path or a path in --output_dir that
cannot be written (`output_problems`: results.jsonl, the report's files), or candidates of which
none is usable for the selected tasks, stop the run with one `evaluate.py: error: ...` line (exit
status 2) before anything is evaluated; once the evaluation runs the status is 0, whatever the
verdicts. Ctrl-C ends it with one line naming the results file (status 130).

Candidates: a directory in one of `drkernel.layouts`' layouts, or a `.jsonl` of generations
(`level, problem_id, sample, turn, code`, generate.py's output). Bad input stops the run only
when nothing usable is left: a line that is not a JSON object (a killed generate.py leaves a cut
last line), a row with a missing or mistyped field, a file that is not UTF-8 text, a failed
generation, a candidate for a problem that is not among the selected tasks and a result whose
verdict is `reference_error` (the reference failed, not the candidate) are skipped, and the
summary names each with its file/line, attempt and reason. Problems with a reference error are
left out of the metrics.

Which problems count: a missing attempt of a counted problem is a failure. With `--denominator
auto` (the default) a generations file counts the problems it holds generations for, unless
`--problem_ids` selects problems (then those count); a directory or the bundled solutions count
every selected problem. `--denominator selected | candidates` chooses explicitly.

Results: every row is appended to `<output_dir>/results.jsonl` (and flushed) as soon as it is
known, with the settings it was made with (`Settings`: device, baseline, timeout, the evaluator's
verdict settings such as trials, perf_trials and tolerances, and the environment fingerprint of
`drkernel.evalcache`). A rerun with `--resume true` (the default) reuses a stored row only when
each field has its declared type (`ResultRow.from_dict`; other lines are named once and dropped,
the old file kept aside as `results.<time>.jsonl.bak`), for the same candidate and reference code,
under equal settings, and when the cache would keep its verdict (`evalcache.cacheable`: not a
timeout, a crash, out of memory or an evaluator failure the machine may have caused); every other
stored attempt is evaluated again, and the run says how many were reused, evaluated again (and
why) or new. A killed run loses nothing but the chunk in flight. Then `summary.json`, plots and
`report.md` are written and the table is printed.

`--baseline compile` times the reference under `torch.compile` (compiled once per problem and
process, outside the timing; correctness is still judged against the eager reference). It needs a
GPU or a working inductor C++ toolchain; every result records its `baseline`. With
`--fast_p_interval true` (the default) the report has a second Fast@p column that counts a
speedup only when its 95 % interval clears p.

On a machine without a GPU (`--device auto` resolves to cpu) Triton runs through its
interpreter: `TRITON_INTERPRET=1` is set before anything imports triton.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import sys
import tempfile
import typing
from collections import Counter
from pathlib import Path
from typing import Any, NoReturn, Sequence

from drkernel.config import (NON_NEGATIVE, WORKERS, ConfigError, Limit, Resolved, TaskSelection, cache_dir_problem,
                             compose, create_output, interruptible, limit_problems, output_problem, script_config)
from drkernel.evalcache import cacheable, fingerprint, result_problem, verdict_settings, with_environment
from drkernel.evaltypes import VERDICTS
from drkernel.evaluator import EvalConfig, EvalResult, resolve_device
from drkernel.jsonl import JsonlWriter, backup_path, field_problem, first_reasons, iter_jsonl, rewrite_keeping_backup
from drkernel.layouts import MAX_SAMPLES, Candidate, LayoutError, Scan, Skipped, attempt_name, scan_candidates
from drkernel.report import report_problems
from drkernel.runtime import previous_run
from drkernel.tasks import Task, text_digest

PROG = "evaluate.py"
RESULTS_FILE = "results.jsonl"
FORMAT_ERROR = "format_error"  # a generation without code: recorded here, never evaluated
REFERENCE_ERROR = "reference_error"
STORED_VERDICTS = (*VERDICTS, FORMAT_ERROR)  # the verdicts a row of results.jsonl may hold
DENOMINATORS = ("auto", "selected", "candidates")
DROP_FIELDS = ("stdout", "stderr")  # kept short by the evaluator, but noise in results.jsonl
SHOWN_SKIPPED = 20  # skipped inputs printed; summary.json lists all
NO_CODE = {"verdict": FORMAT_ERROR, "error": "no code in the generation"}  # the result of a generation without code
HELP = """usage: python evaluate.py [--config file.yaml] [--key value ...]

With no options, evaluate.py runs its base configuration: the EvaluateConfig defaults listed
below (our bundled Triton solutions on the bundled tasks, on a GPU when one is visible, else on
the CPU). Each --key value changes one setting; --config file.yaml changes several. Rerun with
the same --output_dir to resume: stored results made with other settings, or whose verdict the
machine may have caused (timeout, crash, out of memory), are evaluated again.
Exit status: 0 when the evaluation ran (whatever the verdicts), 2 for a usage error, 130 when
interrupted (Ctrl-C; the finished results are kept).
"""
Key = tuple[int, int, int, int]  # (level, problem_id, sample, turn)
Problem = tuple[int, int]  # (level, problem_id)


def fail(message: str) -> NoReturn:
    """One `evaluate.py: error: ...` line on stderr, then exit status 2 (a usage error)."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


@dataclasses.dataclass
class EvaluateConfig(TaskSelection):
    SHARED = ((EvalConfig, {"device": "device", "trials": "trials", "perf_trials": "perf_trials",
                            "timeout": "timeout", "require_triton": "require_triton",
                            "cache_dir": "cache_dir", "baseline": "baseline",
                            "require_confinement": "require_confinement"}),)
    # the values each setting accepts, beside those EvalConfig.LIMITS declares for the mirrored ones
    # (drkernel.config: trials, perf_trials, timeout, ... through SHARED)
    LIMITS = {"workers": WORKERS, "samples": Limit(1, MAX_SAMPLES - 1), "chunk_size": NON_NEGATIVE}

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
    baseline: str = dataclasses.field(default=EvalConfig.baseline, metadata={
        "help": "eager | compile: speedups against the reference as written or under torch.compile "
                "(compiled once per problem, outside the timing; needs a GPU or a working inductor)"})
    require_confinement: bool = dataclasses.field(default=EvalConfig.require_confinement, metadata={
        "help": "refuse to evaluate where the kernel cannot confine candidate code; false only for trusted code"})
    fast_p_interval: bool = dataclasses.field(default=True, metadata={
        "help": "also report Fast@p counting a speedup only when its 95 % interval clears p"})
    resume: bool = dataclasses.field(default=True, metadata={
        "help": "reuse the results in results.jsonl made for the same code under the same settings"})
    samples: int = dataclasses.field(default=1, metadata={
        "help": "samples expected per problem (missing ones count as failures); more are used if present"})
    denominator: str = dataclasses.field(default="auto", metadata={
        "help": "which problems count (a missing attempt is a failure): selected (every selected task) | "
                "candidates (those with a candidate) | auto (candidates for a .jsonl of generations "
                "without --problem_ids, else selected)"})
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
# the command line
# --------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str]) -> Resolved[EvaluateConfig]:
    """The EvaluateConfig defaults <- --config <- flags; `--help` also says what a bare run does."""
    return script_config(EvaluateConfig, argv, PROG, HELP + "\n")


def check_config(cfg: EvaluateConfig) -> None:
    """Bad values stop the run before anything is loaded, all named in one line."""
    problems = limit_problems(cfg)
    if cfg.denominator not in DENOMINATORS:
        problems.append(f"--denominator must be one of {', '.join(DENOMINATORS)}, not {cfg.denominator!r}")
    if cfg.candidates and (problem := _candidates_problem(cfg.candidates)):
        problems.append(f"--candidates {cfg.candidates}: {problem}")
    problems += output_problems(cfg)
    if problems:
        fail("; ".join(problems))


def _candidates_problem(path: str) -> str | None:
    """Why `--candidates` names nothing to read (a JSONL file or a folder), or None."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return exc.strerror.lower() if exc.strerror else str(exc)
    return None if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode) else "not a regular file or a folder"


def output_problems(cfg: EvaluateConfig) -> list[str]:
    """Why a path evaluate.py writes cannot be used (`output_problem`): --output_dir with its
    results file and report, and --cache_dir when one is given; checked before any work, as the
    report is written last."""
    found = report_problems("--output_dir", cfg.output_dir)
    if not found:
        found.append(output_problem("--output_dir", str(Path(cfg.output_dir) / RESULTS_FILE)))
    if not any(found) and (run := previous_run(cfg.output_dir)):
        found.append(f"--output_dir {cfg.output_dir}: holds a training run ({first_reasons(run, sep=', ')}), whose "
                     f"report this one would replace; give evaluate.py another --output_dir")
    found.append(cache_dir_problem("--cache_dir", cfg.cache_dir))
    return [p for p in found if p]


def start_line(run: Resolved[EvaluateConfig]) -> str:
    """The line printed at start: where the settings come from, the candidates and the tasks."""
    cfg = run.cfg
    candidates = cfg.candidates or "our bundled Triton solutions"
    return f"{run.start_line(PROG)}; candidates: {candidates}; tasks: {cfg.tasks}"


def check_device(name: str) -> str:
    """The device to evaluate on (`resolve_device`); one this machine lacks is a usage error.
    Call before anything imports triton."""
    try:
        return resolve_device(name)
    except ValueError as exc:
        fail(str(exc))


def load_selected_tasks(cfg: EvaluateConfig) -> list[Task]:
    """The selected tasks; an unreadable or empty selection is a usage error."""
    try:
        return cfg.selected_tasks()
    except ConfigError as exc:
        fail(str(exc))


# --------------------------------------------------------------------------------------
# references
# --------------------------------------------------------------------------------------

# --------------------------------------------------------------------------------------
# candidates
# --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Attempt:
    """One candidate paired with its task (`reference`, whose `digest` identifies its code)."""

    candidate: Candidate
    reference: Task

    @property
    def key(self) -> Key:
        return self.reference.level, self.reference.problem_id, self.candidate.sample, self.candidate.turn

    @property
    def candidate_sha(self) -> str | None:
        code = self.candidate.code
        return None if code is None else text_digest(code)[:16]


@dataclasses.dataclass
class Inputs:
    """What the candidates gave: one attempt per key (a failed generation among them, counted
    but never evaluated) and the skipped inputs."""

    attempts: dict[Key, Attempt] = dataclasses.field(default_factory=dict)
    skipped: list[Skipped] = dataclasses.field(default_factory=list)

    def add(self, attempt: Attempt) -> None:
        """`attempt`, unless one for its key came first (then it is skipped, naming the first)."""
        c = attempt.candidate
        first = self.attempts.setdefault(attempt.key, attempt)
        if first is not attempt:
            self.skip(c, f"a second candidate for this attempt (the first: {first.candidate.origin})", attempt)
        elif c.generation_error is not None:
            self.skip(c, f"the generation failed: {c.generation_error}", attempt)

    def skip(self, c: Candidate, reason: str, attempt: Attempt | None = None) -> None:
        self.skipped.append(Skipped(c.origin, reason, attempt_name(*attempt.key) if attempt else c.describe()))

    def to_evaluate(self) -> list[Attempt]:
        return [a for a in self.attempts.values() if a.candidate.generation_error is None]


@dataclasses.dataclass
class TaskIndex:
    """Finds the task a candidate is for."""

    by_key: dict[Problem, Task]
    by_name: dict[str, Task]
    by_pid: dict[int, list[Task]]
    all_bundled: bool

    @classmethod
    def of(cls, tasks: Sequence[Task]) -> "TaskIndex":
        by_pid: dict[int, list[Task]] = {}
        for t in tasks:
            by_pid.setdefault(t.problem_id, []).append(t)
        return cls({(t.level, t.problem_id): t for t in tasks}, {t.name: t for t in tasks}, by_pid,
                   bool(tasks) and all(t.source == "bundled" for t in tasks))

    def _only(self, problem_id: int) -> Task | None:
        found = self.by_pid.get(problem_id, [])
        return found[0] if len(found) == 1 else None

    def find(self, c: Candidate) -> Task | None:
        """By (level, problem_id). A candidate known by file name only (level None) matches the
        task of that name, else the only task with its problem id; with the bundled tasks (all
        level 0) a candidate's level is ignored, so a `level_1/...` tree of them still matches."""
        if c.level is None:
            return self.by_name.get(c.name or "") or self._only(c.problem_id)
        found = self.by_key.get((c.level, c.problem_id))
        return found or (self._only(c.problem_id) if self.all_bundled else None)


def bundled_candidates(tasks: Sequence[Task], samples: int) -> list[Candidate]:
    """Our solution of each bundled task that has one, `samples` times."""
    from drkernel.tasks import bundled_solution

    out = []
    for t in tasks:
        path = bundled_solution(t)
        if path is not None:
            code = path.read_text()
            out += [Candidate(t.level, t.problem_id, s, 0, str(path), code, t.name, str(path)) for s in range(samples)]
    return out


def selection_text(cfg: EvaluateConfig) -> str:
    return f"tasks={cfg.tasks} levels={cfg.levels} problem_ids={cfg.problem_ids or 'all'}"


def read_candidates(cfg: EvaluateConfig, tasks: Sequence[Task]) -> Scan:
    """--candidates (an unusable path is a usage error), or our bundled solutions."""
    if cfg.candidates:
        try:
            return scan_candidates(cfg.candidates)
        except LayoutError as exc:
            fail(str(exc))
    found = bundled_candidates(tasks, cfg.samples)
    if not found:
        fail("there are no bundled solutions for these tasks; pass --candidates DIR_OR_JSONL")
    return Scan(found)


def collect_inputs(cfg: EvaluateConfig, tasks: Sequence[Task]) -> Inputs:
    """The candidates paired with their tasks; the unreadable ones, those for no selected task,
    second candidates for one attempt and failed generations are skipped."""
    scan = read_candidates(cfg, tasks)
    index = TaskIndex.of(tasks)
    inputs = Inputs(skipped=list(scan.skipped))
    for c in scan.candidates:
        task = index.find(c)
        if task is None:
            inputs.skip(c, f"no such problem among the selected tasks ({selection_text(cfg)})")
        elif problem := task.row_problem(c.task_columns, require_name=False):  # a row of another task set
            inputs.skip(c, problem)
        else:
            inputs.add(Attempt(c, task))
    if not inputs.attempts:  # nothing to evaluate or count: metrics over nothing would read as 0 %
        fail(no_candidates(cfg, inputs.skipped))
    return inputs


def no_candidates(cfg: EvaluateConfig, skipped: Sequence[Skipped]) -> str:
    """The usage error of a candidates path that held no usable candidate for the selected tasks."""
    why = first_reasons([str(s) for s in skipped]) if skipped else "it holds none"
    return (f"no usable candidates in {cfg.candidates or 'our bundled solutions'} for the selected tasks "
            f"({selection_text(cfg)}): {why}")


# --------------------------------------------------------------------------------------
# results.jsonl: one typed row per attempt, with the settings it was made with
# --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything besides the two programs that can change a result. A stored result stands for
    an attempt only when these are equal."""

    device: str  # resolved: cpu | cuda | cuda:N
    baseline: str
    timeout: float
    evaluator: dict[str, Any]  # the EvalConfig fields that can change a verdict (evalcache.verdict_settings)
    environment: dict[str, str]  # where it ran (evalcache.fingerprint)

    @classmethod
    def of(cls, cfg: EvaluateConfig, device: str) -> "Settings":
        eval_cfg = compose(cfg, EvalConfig, device=device)
        return cls(device, cfg.baseline, float(cfg.timeout), verdict_settings(eval_cfg), fingerprint(device))

    @classmethod
    def from_dict(cls, data: Any) -> "Settings":
        """The record stored with a row (ValueError saying why when it is not one)."""
        if not isinstance(data, dict):
            raise ValueError("lacks settings" if data is None else f"settings is {type(data).__name__}, not an object")
        types_ = typing.get_type_hints(cls)
        problem = field_problem(data, types_, required=types_)
        unknown = sorted(set(data) - set(types_))
        if problem or unknown:
            raise ValueError(f"settings: {problem or 'unknown key(s) ' + ', '.join(unknown)}")
        return cls(**data)

    def flat(self) -> dict[str, Any]:
        env = {f"environment.{k}": v for k, v in self.environment.items()}
        return {"device": self.device, "baseline": self.baseline, "timeout": self.timeout, **self.evaluator, **env}

    def changes_from(self, stored: "Settings") -> list[str]:
        """`name stored -> now` for each setting that differs from `stored`'s."""
        old, new = stored.flat(), self.flat()
        return [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(old.keys() | new.keys())
                if old.get(k) != new.get(k)]


@dataclasses.dataclass(frozen=True)
class ResultRow:
    """One line of results.jsonl: the attempt, the code it evaluated, the settings, the result."""

    level: int
    problem_id: int
    sample: int
    turn: int
    task: str
    candidate: str  # where the candidate was read: a file, or `generations.jsonl:LINE`
    candidate_sha: str | None  # None: the generation held no code
    reference_sha: str
    settings: Settings
    result: EvalResult

    @classmethod
    def of(cls, attempt: Attempt, settings: Settings, result: EvalResult) -> "ResultRow":
        return cls(*attempt.key, attempt.reference.name, attempt.candidate.origin, attempt.candidate_sha,
                   attempt.reference.digest, settings, result)

    @property
    def key(self) -> Key:
        return self.level, self.problem_id, self.sample, self.turn

    def to_dict(self) -> dict:
        """The stored line: the result's fields, the identity, the settings record (and, for
        readers that filter rows, `baseline` and `require_triton` as columns)."""
        out = {k: v for k, v in self.result.to_dict().items() if k not in DROP_FIELDS}
        out.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "result"})
        out.update(settings=dataclasses.asdict(self.settings), baseline=self.settings.baseline,
                   require_triton=self.settings.evaluator.get("require_triton"))
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "ResultRow":
        """A stored line (ValueError saying why when a field is missing or of the wrong type:
        `IDENTITY_TYPES`, the result's `evalcache.result_problem`, `Settings.from_dict`)."""
        problem = (field_problem(data, IDENTITY_TYPES, required=IDENTITY_TYPES)
                   or result_problem(data, STORED_VERDICTS))
        if problem:
            raise ValueError(problem)
        return cls(*(data[k] for k in IDENTITY_TYPES), Settings.from_dict(data.get("settings")),
                   EvalResult.from_dict(data))


# the columns of a stored line before its settings and result, with their types
IDENTITY_TYPES: dict[str, Any] = {k: v for k, v in typing.get_type_hints(ResultRow).items()
                                  if k not in ("settings", "result")}


KEY_TYPES = {k: IDENTITY_TYPES[k] for k in ("level", "problem_id", "sample", "turn")}


@dataclasses.dataclass
class StoredResults:
    """What results.jsonl holds: its usable rows, each line as read (kept when the file is
    rewritten), and why each other line is not a usable row, with the attempts those lines name."""

    rows: list[ResultRow] = dataclasses.field(default_factory=list)
    lines: list[dict] = dataclasses.field(default_factory=list)
    bad: list[str] = dataclasses.field(default_factory=list)  # "line N: why"
    bad_keys: set[Key] = dataclasses.field(default_factory=set)

    def add(self, lineno: int, data: dict | None, error: str) -> None:
        """One line: a usable row, or (ValueError from `ResultRow.from_dict`) a bad one."""
        try:
            if data is None:
                raise ValueError(error)
            self.rows.append(ResultRow.from_dict(data))
            self.lines.append(data)
        except ValueError as exc:
            self.bad.append(f"line {lineno}: {exc}")
            if data is not None and not field_problem(data, KEY_TYPES, required=KEY_TYPES):
                self.bad_keys.add(tuple(data[k] for k in KEY_TYPES))


def read_results(path: Path) -> StoredResults:
    """The lines of results.jsonl, usable or not (a write cut by a kill, a row without its
    settings or with a field of the wrong type)."""
    stored = StoredResults()
    for line in iter_jsonl(path):
        stored.add(line.lineno, line.row, line.error)
    return stored


def stored_results(path: Path, resume: bool) -> StoredResults:
    """The stored lines; with `resume` false the old file is moved aside, never destroyed."""
    if not resume:
        if path.exists() and path.stat().st_size:
            backup = backup_path(path)
            os.replace(path, backup)
            print(f"[evaluate] --resume false: moved the old results to {backup}", file=sys.stderr)
        return StoredResults()
    stored = read_results(path)
    if stored.bad:  # named once, not on every rerun
        backup = rewrite_keeping_backup(path, stored.lines)
        print(f"[evaluate] {path}: dropped {len(stored.bad)} line(s) that are not usable results (the old file "
              f"is kept as {backup.name}): {first_reasons(stored.bad)}", file=sys.stderr)
    return stored


def why_not_reused(row: ResultRow, attempt: Attempt, settings: Settings) -> str:
    """Why `row` cannot stand for `attempt` under `settings` ('' when it can)."""
    if (row.candidate_sha, row.reference_sha) != (attempt.candidate_sha, attempt.reference.digest):
        return "the candidate or the reference changed"
    changes = settings.changes_from(row.settings)
    if changes:
        return "made with other settings: " + ", ".join(changes)
    if row.result.verdict != FORMAT_ERROR and not cacheable(row.result):
        return f"its verdict ({row.result.verdict}) may have been caused by the machine, not the candidate"
    return ""


UNUSABLE_LINE = "its stored line is not a usable result"


@dataclasses.dataclass
class Plan:
    """Which attempts keep their stored row and which are evaluated now: again (why, per attempt
    with a stored line) or new."""

    reused: list[ResultRow] = dataclasses.field(default_factory=list)
    todo: list[Attempt] = dataclasses.field(default_factory=list)
    again: list[str] = dataclasses.field(default_factory=list)  # why, per attempt evaluated again
    new: int = 0  # attempts that no stored line names

    @classmethod
    def of(cls, attempts: Sequence[Attempt], stored: StoredResults, settings: Settings) -> "Plan":
        plan = cls()
        rows = {r.key: r for r in stored.rows}  # the last of a key wins
        for a in attempts:
            row = rows.get(a.key)
            if row is None:
                plan.evaluate(a, UNUSABLE_LINE if a.key in stored.bad_keys else "")
            elif why := why_not_reused(row, a, settings):
                plan.evaluate(a, why)
            else:
                plan.reused.append(row)
        return plan

    def evaluate(self, attempt: Attempt, again: str) -> None:
        """`attempt` is evaluated now: again for the reason `again`, or ('') as a new one."""
        self.todo.append(attempt)
        if again:
            self.again.append(again)
        else:
            self.new += 1

    def announce(self) -> None:
        if not (self.reused or self.again):
            return
        print(f"[evaluate] resume: {len(self.reused)} stored result(s) reused, {len(self.again)} evaluated again, "
              f"{self.new} new", file=sys.stderr)
        for why, n in Counter(self.again).most_common():
            print(f"[evaluate]   {n} x {why}", file=sys.stderr)


# --------------------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------------------

def as_result(answer: Any, environment: dict[str, str]) -> EvalResult:
    """A copy of the evaluator's answer (an EvalResult, or its dict from a stand-in) stamped with
    where it ran; the real evaluator stamps it itself, with the same fingerprint."""
    result = EvalResult.from_dict(answer if isinstance(answer, dict) else answer.to_dict())
    if "environment" not in result.details:
        with_environment(result, environment)
    return result


def as_source(code: str) -> str:
    """Candidate code as the evaluator's source text: a line without a newline would be read as a
    file path, so one is added."""
    return code if "\n" in code else code + "\n"


def evaluate_chunk(evaluator, part: Sequence[Attempt], settings: Settings, writer: JsonlWriter,
                   ref_dir: Path) -> list[ResultRow]:
    """Evaluate `part` in one call and save each row."""
    pairs = [(str(a.reference.write(ref_dir)), a.candidate.path or as_source(a.candidate.code or ""))
             for a in part]
    answers = evaluator.evaluate_many(pairs)
    if len(answers) != len(part):
        raise RuntimeError(f"evaluator returned {len(answers)} results for {len(part)} pairs")
    rows = [ResultRow.of(a, settings, as_result(r, settings.environment)) for a, r in zip(part, answers)]
    for row in rows:
        writer.write(row.to_dict())
    return rows


def run_evaluator(cfg: EvaluateConfig, device: str, settings: Settings, attempts: Sequence[Attempt],
                  writer: JsonlWriter, ref_dir: Path) -> list[ResultRow]:
    """Evaluate `attempts` chunk by chunk; each chunk's rows are saved before the next starts."""
    from tqdm import tqdm

    evaluator = make_evaluator(cfg, device)
    size = cfg.chunk_size or max(4, 2 * (cfg.workers or 1))
    rows: list[ResultRow] = []
    try:
        with tqdm(total=len(attempts), desc="evaluate", unit="kernel", file=sys.stderr) as bar:
            for start in range(0, len(attempts), size):
                part = attempts[start:start + size]
                rows += evaluate_chunk(evaluator, part, settings, writer, ref_dir)
                bar.update(len(part))
    finally:
        close = getattr(evaluator, "close", None)
        if close:
            close()
    return rows


def evaluate_attempts(cfg: EvaluateConfig, device: str, settings: Settings, attempts: Sequence[Attempt],
                      out_dir: Path) -> list[ResultRow]:
    """New rows for `attempts`: a generation without code is a format error, the rest are evaluated."""
    with JsonlWriter(out_dir / RESULTS_FILE) as writer:
        rows = [ResultRow.of(a, settings, as_result(NO_CODE, settings.environment))
                for a in attempts if a.candidate.code is None]
        for row in rows:
            writer.write(row.to_dict())
        todo = [a for a in attempts if a.candidate.code is not None]
        if todo:  # the references as files the evaluator imports: scratch, kept out of --output_dir
            with tempfile.TemporaryDirectory(prefix="drk_eval_refs_") as ref_dir:
                rows += run_evaluator(cfg, device, settings, todo, writer, Path(ref_dir))
    return rows


# --------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Scope:
    """What the metrics count: these problems, `samples` samples and `turns` turns each."""

    problems: list[Problem]
    samples: int
    turns: int
    description: str


def metric_scope(cfg: EvaluateConfig, tasks: Sequence[Task], inputs: Inputs, broken: set[Problem]) -> Scope:
    """The problems counted (`--denominator`), less those whose reference failed."""
    mode = cfg.denominator
    if mode == "auto":
        generations = Path(cfg.candidates).suffix == ".jsonl" and not cfg.problem_ids
        mode = "candidates" if generations else "selected"
    selected = [(t.level, t.problem_id) for t in tasks]
    if mode == "candidates":
        wanted = {key[:2] for key in inputs.attempts}
        problems = [p for p in selected if p in wanted]
        description = (f"the {len(problems)} problem(s) with candidates (--denominator selected counts all "
                       f"{len(selected)} selected)")
    else:
        problems, description = selected, f"all {len(selected)} selected problem(s)"
    if broken:
        problems = [p for p in problems if p not in broken]
        description += f", less {len(broken)} whose reference failed"
    keys = list(inputs.attempts)
    samples = max([cfg.samples] + [k[2] + 1 for k in keys])
    return Scope(problems, samples, 1 + max([k[3] for k in keys], default=0), description)


def print_skipped(skipped: Sequence[Skipped]) -> None:
    if not skipped:
        return
    print(f"[evaluate] skipped {len(skipped)} input(s) (not counted as evaluated attempts):", file=sys.stderr)
    for s in skipped[:SHOWN_SKIPPED]:
        print(f"[evaluate]   {s}", file=sys.stderr)
    if len(skipped) > SHOWN_SKIPPED:
        print(f"[evaluate]   ... and {len(skipped) - SHOWN_SKIPPED} more (all in summary.json)", file=sys.stderr)


def write_outputs(cfg: EvaluateConfig, device: str, tasks: Sequence[Task], inputs: Inputs, plan: Plan,
                  new: list[ResultRow]) -> dict:
    """Summary, report files and the printed table over the current row of every attempt."""
    from drkernel import metrics, report as reports

    rows = plan.reused + new
    failed_refs = [r for r in rows if r.result.verdict == REFERENCE_ERROR]
    scope = metric_scope(cfg, tasks, inputs, {(r.level, r.problem_id) for r in failed_refs})
    problems = set(scope.problems)
    counted = [r.to_dict() for r in rows if (r.level, r.problem_id) in problems]
    skipped = inputs.skipped + [Skipped(r.candidate, f"{REFERENCE_ERROR}: {r.result.error}", attempt_name(*r.key))
                                for r in failed_refs]
    summary = metrics.summarize(counted, scope.problems, samples=scope.samples, turns=scope.turns,
                                intervals=cfg.fast_p_interval)
    summary.update(config={**dataclasses.asdict(cfg), "device_resolved": device}, counted=scope.description,
                   evaluated_this_run=len(new), skipped_resumed=len(plan.reused), evaluated_again=len(plan.again),
                   evaluated_new=plan.new, num_reference_errors=len(failed_refs), num_skipped=len(skipped),
                   skipped=[dataclasses.asdict(s) for s in skipped])
    out_dir = Path(cfg.output_dir)
    reports.write_report(summary, counted, out_dir, expected=scope.problems, samples=scope.samples,
                         turns=scope.turns)
    print_skipped(skipped)
    print(f"[evaluate] counted: {scope.description}", file=sys.stderr)
    print(reports.format_table(summary))
    print(f"[evaluate] results: {out_dir / RESULTS_FILE}  report: {out_dir / 'report.md'}")
    return summary


def main(argv: Sequence[str] | None = None) -> dict:
    return run_evaluation(parse_args(list(sys.argv[1:] if argv is None else argv)))


def run_evaluation(run: Resolved[EvaluateConfig]) -> dict:
    """Check the settings, evaluate what results.jsonl does not hold yet, write the report."""
    cfg = run.cfg
    check_config(cfg)
    print(start_line(run), file=sys.stderr)
    device = check_device(cfg.device)  # before anything imports triton
    tasks = load_selected_tasks(cfg)
    inputs = collect_inputs(cfg, tasks)
    out_dir = Path(cfg.output_dir)
    if problem := create_output("--output_dir", cfg.output_dir, is_dir=True):
        fail(problem)
    settings = Settings.of(cfg, device)
    plan = Plan.of(inputs.to_evaluate(), stored_results(out_dir / RESULTS_FILE, cfg.resume), settings)
    plan.announce()
    new = evaluate_attempts(cfg, device, settings, plan.todo, out_dir)
    return write_outputs(cfg, device, tasks, inputs, plan, new)


def cli() -> None:
    """`python evaluate.py`: Ctrl-C ends it with one line naming the results file it resumes from
    (parsed first, as --output_dir names it)."""
    run = parse_args(sys.argv[1:])
    results = Path(run.cfg.output_dir) / RESULTS_FILE
    interruptible(lambda: run_evaluation(run), PROG,
                  f"the finished results are in {results}; run the same command again (with --resume true, "
                  f"the default) to evaluate only the rest")


if __name__ == "__main__":
    cli()
