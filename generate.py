"""Multi-turn generation on KernelBench (or the bundled tasks), evaluated turn by turn.

    python generate.py                                       # the base configuration: SmolLM2 (offline)
                                                             # on the bundled tasks
    python generate.py --model runs/rl/final --tasks ../shared/kernelbench --levels 1,2 \\
        --samples_per_task 4 --num_turns 3 --output outputs/gen.jsonl
    python generate.py --api_base_url http://localhost:8000/v1 --api_model my-model ...  # any
                                                             # OpenAI-compatible endpoint
    python generate.py ... --stts_iterations 10 --num_turns 5 --stts_window 4   # the paper's STTS

The base configuration is the `GenerateConfig` defaults; every `--key value` changes one
setting (`--help` lists them), and the first line printed names the base, the changes and
the policy. A bad option or value stops the run with one `generate.py: error: ...` line
(exit status 2).

Every trajectory goes through `drkernel.rollout.rollout`, the same prompts, truncation,
evaluator calls and feedback messages as training; the evaluator is the sandboxed
`drkernel.evaluator.Evaluator`.

Output: one JSONL row per (task, sample, turn) with the evaluator's verdict and the reward
(columns in `make_row`). `level, problem_id, sample, turn, code` are what `evaluate.py
--candidates out.jsonl` reads, so generations can be re-evaluated elsewhere (e.g. timed
on a GPU); turns are 0-based and, with STTS, global (the round's offset + `iter_turn`; a later
round adds `num_turns - stts_window` turns (at least 1) by default, see `drkernel.stts.round_turns`).
A summary (`drkernel.metrics`, best-of-turns Fast@p; per STTS round with `drkernel.stts`)
goes to `<output stem>.summary.json` and is printed; report.md and plots to `<output stem>_report/`.

API policy: transient failures are retried (`drkernel.api_policy`, one stderr line per retry,
a progress bar over requests). A request that still fails ends its trajectory with a
failure row (verdict `generation_failed`, the reason in `generation_error`, no reward); the
other trajectories of the batch are written as usual, the failed round counts as missing
in the summary, and a rerun generates it again.

Resume: rows are appended and fsynced after each rollout call (`tasks_per_batch` tasks,
one round). On restart (`--resume true`, the default) the (task, sample, round) units
already complete in the file are skipped; rows of an incomplete unit (including one with a
failure row), malformed rows and a partial last line (a kill mid-write) are reported and
dropped by rewriting the file first, so a rerun writes only the missing rows and never
duplicates one. Before lines that are no usable row are dropped, the old file is copied aside
(`<stem>.<time>.jsonl.bak`); whenever rows are dropped, an earlier summary and report are
rewritten from the rows kept. A row is reused only when it holds every column of its declared
type (`row_problem`: `RowColumns`, the evaluator's result types, `ROW_SETTINGS`; an older row
may lack the `LATER_SETTINGS`); any other is one of the malformed rows. A file written with
another model, turn plan (the error names the option: --num_turns, --stts_window or
--stts_window_counts) or any of `ROW_SETTINGS` is refused, naming the keys; so is one with a
row that does not name the selected task of its `task_key` (`Task.row_problem`: its file name
and code digest, the rule the summary and the SFT conversion apply too), as it was written for
other tasks. A later STTS round is rebuilt from the rows.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import sys
import tempfile
import time
import typing
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence, TypedDict

from tqdm import tqdm

from drkernel import stts
from drkernel.api_policy import ApiConfig, ApiError, ChatGenerator, Failure
from drkernel.config import (COUNT, NON_NEGATIVE, SEED, WORKERS, ConfigError, ModelSelection, Resolved,
                             TaskSelection, cache_dir_problem, changed_settings, compose, create_output, interruptible,
                             limit_problems, output_problem, same_setting, script_config)
from drkernel.evalcache import result_problem
from drkernel.evaluator import EvalConfig, EvalResult, resolve_device
from drkernel.evaltypes import VERDICTS
from drkernel.generation import GenerationConfig
from drkernel.jsonl import (JsonlWriter, backup_path, field_problem, first_reasons, iter_jsonl, json_safe,
                            rewrite_jsonl, rewrite_keeping_backup, write_json)
from drkernel.prompts import FORMAT_ERROR
from drkernel.report import report_problems
from drkernel.rollout import RolloutConfig
from drkernel.tasks import TaskError, check_distinct_ids

ROW_RESULT_FIELDS = ("verdict", "compiled", "correct", "speedup", "triton_time_share", "hacks", "error",
                     "ref_ms", "candidate_ms", "max_abs_err", "max_rel_err", "kernels", "timing")
# Settings stored in every row: resuming with other values would mix two experiments in one file.
ROW_SETTINGS = ("temperature", "top_p", "top_k", "max_new_tokens", "max_prompt_tokens", "seed", "stts_ties",
                "device", "trials", "perf_trials", "timeout", "baseline")
# Recorded since a later version: an older row without one stays usable and is compared on the others
# (`changed_settings` skips a key the row lacks).
LATER_SETTINGS = ("baseline",)
ROW_COUNTS = ("sample", "turn", "iteration", "iter_turn", "level", "problem_id")  # non-negative integers
MAX_ROUNDS = 10_000  # a larger `iteration` in a resumed row is corrupt, not a plan to rebuild
GENERATION_FAILED = "generation_failed"  # the verdict of a turn whose request failed
ROW_VERDICTS = (*VERDICTS, FORMAT_ERROR, GENERATION_FAILED)  # the evaluator's, no code, a failed request
HELP = """usage: python generate.py [--config file.yaml] [--key value ...]

With no options, generate.py runs its base configuration: the GenerateConfig defaults listed
below (the offline SmolLM2 policy on the bundled tasks, evaluated here). Each --key value
changes one setting; --config file.yaml changes several. --api_base_url URL --api_model NAME
makes an OpenAI-compatible endpoint the policy.
"""
_E, _G, _Ro, _A = EvalConfig, GenerationConfig, RolloutConfig, ApiConfig  # defaults come from these (SHARED)


def fail(message: str, status: int = 2) -> NoReturn:
    """One `generate.py: error: ...` line on stderr, then exit (2: bad input; 1: the endpoint failed)."""
    print(f"generate.py: error: {message}", file=sys.stderr)
    raise SystemExit(status)


@dataclasses.dataclass
class GenerateConfig(ModelSelection, TaskSelection):
    SHARED = (
        (EvalConfig, {"device": "device", "trials": "trials", "perf_trials": "perf_trials", "timeout": "timeout",
                      "eval_cache_dir": "cache_dir", "baseline": "baseline",
                      "require_confinement": "require_confinement"}),
        (GenerationConfig, {"max_new_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p",
                            "top_k": "top_k", "backend": "backend", "batch_size": "batch_size"}),
        (RolloutConfig, {"num_turns": "num_turns", "max_prompt_tokens": "max_prompt_tokens"}),
        (ApiConfig, {"api_base_url": "base_url", "api_model": "model", "api_key_env": "api_key_env",
                     "api_concurrency": "concurrency", "api_timeout": "timeout", "api_max_attempts": "max_attempts",
                     "api_backoff_s": "backoff_s"}),
    )
    # the values each setting accepts, beside those the mirrored library configs declare
    # (drkernel.config: trials, perf_trials, timeout, ... obey EvalConfig.LIMITS through SHARED)
    LIMITS = {"samples_per_task": COUNT, "num_turns": COUNT, "max_prompt_tokens": COUNT, "tasks_per_batch": COUNT,
              "workers": WORKERS, "seed": SEED, "stts_iterations": COUNT, "stts_window": NON_NEGATIVE}
    samples_per_task: int = dataclasses.field(default=1, metadata={"help": "trajectories per task (num_generations)"})
    num_turns: int = dataclasses.field(default=_Ro.num_turns, metadata={"help": "turns per trajectory (STTS: see --stts_window_counts)"})
    temperature: float = dataclasses.field(default=_G.temperature, metadata={"help": "0 = greedy"})
    top_p: float = _G.top_p
    top_k: int = _G.top_k
    max_new_tokens: int = _G.max_new_tokens
    max_prompt_tokens: int = dataclasses.field(default=_Ro.max_prompt_tokens, metadata={
        "help": "older turns are dropped to fit (API policy: estimated from characters)"})
    backend: str = dataclasses.field(default=_G.backend, metadata={"help": "hf | static (drkernel.generation)"})
    batch_size: int = dataclasses.field(default=_G.batch_size, metadata={"help": "prompts per generate call"})
    tasks_per_batch: int = dataclasses.field(default=8, metadata={
        "help": "tasks per rollout call; rows are saved after each call"})
    device: str = dataclasses.field(default=_E.device, metadata={"help": "auto | cpu | cuda (policy and evaluator)"})
    trials: int = dataclasses.field(default=_E.trials, metadata={"help": "evaluator correctness trials"})
    perf_trials: int = dataclasses.field(default=_E.perf_trials, metadata={"help": "evaluator timing repetitions"})
    timeout: float = dataclasses.field(default=_E.timeout, metadata={"help": "seconds per evaluation"})
    eval_cache_dir: str = dataclasses.field(default=_E.cache_dir, metadata={
        "help": "on-disk evaluation cache (shared with train.py and evaluate.py); empty = none"})
    baseline: str = dataclasses.field(default=_E.baseline, metadata={
        "help": "eager | compile: speedups against the reference as written or under torch.compile"})
    require_confinement: bool = dataclasses.field(default=_E.require_confinement, metadata={
        "help": "refuse to evaluate where the kernel cannot confine candidate code; false only for trusted code"})
    workers: int = dataclasses.field(default=0, metadata={"help": "evaluator sandbox workers; 0 = auto"})
    output: str = "outputs/generations.jsonl"
    resume: bool = dataclasses.field(default=True, metadata={
        "help": "skip units already in --output (false: move the old file aside)"})
    seed: int = 0
    stts_iterations: int = dataclasses.field(default=1, metadata={
        "help": "sequential test-time scaling rounds (1 = plain multi-turn)"})
    stts_window: int = dataclasses.field(default=4, metadata={
        "help": "consecutive earlier turns (best summed reward) that start each later round"})
    stts_window_counts: bool = dataclasses.field(default=True, metadata={
        "help": "the kept window counts toward --num_turns, so a later round adds num_turns - window turns "
                "(KernelGYM: 10 rounds of 5 with a window of 4 = 14 turns); false: every round adds num_turns"})
    stts_ties: str = dataclasses.field(default="earliest", metadata={
        "help": "which of equally good windows starts the next round: earliest (KernelGYM) | latest"})
    api_base_url: str = dataclasses.field(default=_A.base_url, metadata={
        "help": "OpenAI-compatible endpoint as the policy, e.g. http://localhost:8000/v1 (instead of --model)"})
    api_model: str = dataclasses.field(default=_A.model, metadata={"help": "model name served by the endpoint"})
    api_key_env: str = dataclasses.field(default=_A.api_key_env, metadata={
        "help": "environment variable holding the API key (unset: no auth header)"})
    api_concurrency: int = dataclasses.field(default=_A.concurrency, metadata={"help": "API requests in flight"})
    api_timeout: float = dataclasses.field(default=_A.timeout, metadata={
        "help": "seconds an API request waits for the server before it is retried"})
    api_max_attempts: int = dataclasses.field(default=_A.max_attempts, metadata={
        "help": "tries per API request (time-outs, resets, HTTP 429/5xx, replies that are not a chat "
                "completion); then the turn is recorded as a failed generation"})
    api_backoff_s: float = dataclasses.field(default=_A.backoff_s, metadata={
        "help": "wait before the first retry; doubles after each (with jitter, at most 60 s; Retry-After wins)"})

    def round_turns(self) -> list[int]:
        """New turns per STTS round (`drkernel.stts.round_turns`)."""
        return stts.round_turns(self.num_turns, self.stts_window, self.stts_iterations, self.stts_window_counts)


def parse_args(argv: Sequence[str]) -> Resolved[GenerateConfig]:
    """The GenerateConfig defaults <- --config <- flags; `--help` also says what a bare run does."""
    return script_config(GenerateConfig, argv, "generate.py", HELP + "\n")


def check_config(cfg: GenerateConfig) -> None:
    """Bad values stop the run before anything is loaded, with a clear message."""
    problems = limit_problems(cfg)
    if cfg.stts_ties not in stts.TIES:
        problems.append(f"--stts_ties must be one of {', '.join(stts.TIES)}, not {cfg.stts_ties!r}")
    if cfg.api_base_url and not cfg.api_model:
        problems.append("--api_base_url needs --api_model (the model name the endpoint serves)")
    if cfg.api_model and not cfg.api_base_url:
        problems.append("--api_model needs --api_base_url (the endpoint that serves it); without one the local "
                        "--model would run")
    if cfg.api_base_url and (local := _local_model_options(cfg)):
        problems.append(f"{local} would be ignored: with --api_base_url the endpoint is the policy and no local "
                        f"model loads; drop one of them")
    problems += output_problems(cfg)
    if problems:
        fail("; ".join(problems))


def _local_model_options(cfg: GenerateConfig) -> str:
    """The local-model settings (`ModelSelection`: --model, --tokenizer, --dtype) changed from their
    defaults, as `--key value` text; empty when none is."""
    changed = [f for f in dataclasses.fields(ModelSelection) if getattr(cfg, f.name) != f.default]
    return ", ".join(f"--{f.name} {getattr(cfg, f.name)}" for f in changed)


def notes(cfg: GenerateConfig) -> list[str]:
    """Settings that take effect other than as written, one line each (printed after the start line)."""
    found = []
    if cfg.stts_iterations > 1 and cfg.stts_window_counts and cfg.stts_window >= cfg.num_turns:
        found.append(f"--stts_window {cfg.stts_window} is not below --num_turns {cfg.num_turns}: each later round "
                     f"adds 1 turn (the kept window counts toward --num_turns; --stts_window_counts false adds "
                     f"--num_turns)")
    return found


def output_problems(cfg: GenerateConfig) -> list[str]:
    """Why a path generate.py writes cannot be written (`output_problem`): --output, the summary
    and the report beside it (the folder and its files: `report.report_problems`), and
    --eval_cache_dir when one is given; checked before any work, as both are written last."""
    found = [output_problem("--output", cfg.output)]
    if found[0] is None:
        found += [output_problem("the summary of --output", str(summary_path(cfg.output))),
                  *report_problems("the report of --output", report_dir(cfg.output))]
    found.append(cache_dir_problem("--eval_cache_dir", cfg.eval_cache_dir))
    return [p for p in found if p]


def start_line(run: Resolved[GenerateConfig]) -> str:
    """The one line printed at start: where the settings come from, and the policy."""
    cfg = run.cfg
    policy = (f"the endpoint {cfg.api_base_url} serving model {cfg.api_model!r}" if cfg.api_base_url
              else f"model {cfg.model}")
    return f"{run.start_line('generate.py')}; policy: {policy}"


def _resolve_device(name: str) -> str:
    """auto -> cuda or cpu (`resolve_device`); cuda without a visible GPU is a clear error."""
    try:
        return resolve_device(name)  # before anything imports triton
    except ValueError as exc:
        fail(str(exc))


# --------------------------------------------------------------------------------------
# policy and evaluator
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class Policy:
    """What `rollout()` needs to generate: a model (None for an API), a tokenizer, a generator."""

    name: str
    model: Any
    tokenizer: Any
    generator: Callable | None = None  # None: drkernel.generation.generate
    max_prompt_tokens: int = _Ro.max_prompt_tokens  # in the tokenizer's unit
    counts_tokens: bool = True  # False: response lengths are characters (API), not stored


def load_policy(cfg: GenerateConfig, device: str) -> Policy:
    if cfg.api_base_url:
        from drkernel.api_policy import make_api_policy, prompt_budget

        api = compose(cfg, ApiConfig)
        try:
            codec, generator = make_api_policy(api, seed=cfg.seed)
        except ApiError as exc:
            fail(str(exc))
        return Policy(f"api:{cfg.api_model}", None, codec, generator,
                      prompt_budget(cfg.max_prompt_tokens, api.chars_per_token), counts_tokens=False)
    from drkernel.modeling import ModelLoadError, load_model, load_tokenizer

    try:
        tokenizer = load_tokenizer(cfg.model, cfg.tokenizer)
        model = load_model(cfg.model, dtype=cfg.dtype)
    except ModelLoadError as exc:
        fail(str(exc))
    model.to(device).eval()
    return Policy(cfg.model, model, tokenizer, None, cfg.max_prompt_tokens)


def chat_generator(policy: Policy) -> ChatGenerator | None:
    """The policy's API generator (it tracks requests and failures), None for a local model."""
    return policy.generator if isinstance(policy.generator, ChatGenerator) else None


def make_evaluator(cfg: GenerateConfig, device: str):
    """The real sandboxed evaluator (tests replace this factory with a fake)."""
    from drkernel.evaluator import Evaluator

    return Evaluator(compose(cfg, EvalConfig, device=device), workers=cfg.workers or None)


def make_evaluate_fn(evaluator, reference_dir: str | os.PathLike) -> Callable[[list], list[EvalResult]]:
    """`rollout()`'s evaluate_fn: (task, code) pairs -> EvalResults, one `evaluate_many` call.

    References are written once per task under `reference_dir` (the evaluator imports
    files); candidates are passed as source text."""
    return functools.partial(_evaluate_pairs, evaluator, reference_dir)


def _evaluate_pairs(evaluator, reference_dir: str | os.PathLike, pairs: list) -> list[EvalResult]:
    return list(evaluator.evaluate_many([(str(task.write(reference_dir)), code) for task, code in pairs]))


# --------------------------------------------------------------------------------------
# rows and the resumable file
# --------------------------------------------------------------------------------------

def _identity(cfg: GenerateConfig, plan: Sequence[int], task, sample: int, iteration: int, iter_turn: int,
              policy: Policy) -> dict:
    """The columns every row starts with: the task's (`Task.columns`: with evaluate.py's `level,
    problem_id`, its file name and code digest), `sample, turn` (`turn` is global: the round's
    offset in `plan`, turns per round, + the turn within it), the turn plan, the model and
    `ROW_SETTINGS`."""
    return {**task.columns(), "sample": int(sample), "turn": stts.round_offsets(plan)[iteration] + iter_turn,
            "iteration": int(iteration), "iter_turn": int(iter_turn), "num_turns": int(cfg.num_turns),
            "round_turns": int(plan[iteration]), "model": policy.name,
            "settings": {k: getattr(cfg, k) for k in ROW_SETTINGS}}


def make_row(cfg: GenerateConfig, plan: Sequence[int], task, sample: int, iteration: int, turn_sample,
             policy: Policy) -> dict:
    """One JSONL row: identity (`_identity`), the response, the evaluator's result and the reward."""
    result = turn_sample.result
    row = _identity(cfg, plan, task, sample, iteration, int(turn_sample.turn) - 1, policy)  # rollout counts from 1
    row.update({"response": turn_sample.response_text, "code": turn_sample.code,
                "finished": bool(turn_sample.finished),
                "response_tokens": len(turn_sample.response_ids) if policy.counts_tokens else None,
                "reward": float(turn_sample.reward), "generation_error": None})
    row.update({k: getattr(result, k) for k in ROW_RESULT_FIELDS})
    row["correct"] = bool(result.correct) and result.verdict == "correct"
    row["hacks"] = list(result.hacks or [])
    return json_safe(row)


def failure_row(cfg: GenerateConfig, plan: Sequence[int], task, sample: int, iteration: int, failure: Failure,
                policy: Policy) -> dict:
    """The row of a turn whose request failed: no answer, no verdict of the evaluator, no reward."""
    row = _identity(cfg, plan, task, sample, iteration, failure.turn - 1, policy)
    row.update({"response": "", "code": None, "finished": False, "response_tokens": None, "reward": None,
                "generation_error": failure.error})
    row.update({k: None for k in ROW_RESULT_FIELDS})
    row.update({"verdict": GENERATION_FAILED, "compiled": False, "correct": False, "hacks": [],
                "error": f"generation failed: {failure.error}"})
    return json_safe(row)


class RowColumns(TypedDict):
    """The columns of every row beside the evaluator's `ROW_RESULT_FIELDS` (`_identity`, `make_row`,
    `failure_row`), with the types a resumed row must hold."""

    level: int
    problem_id: int
    task: str
    task_key: str
    sample: int
    turn: int
    iteration: int
    iter_turn: int
    num_turns: int
    round_turns: int
    model: str
    settings: dict
    response: str
    code: str | None
    finished: bool
    response_tokens: int | None
    reward: float | None
    generation_error: str | None


ROW_TYPES: dict[str, Any] = typing.get_type_hints(RowColumns)
SETTING_TYPES: dict[str, Any] = {k: typing.get_type_hints(GenerateConfig)[k] for k in ROW_SETTINGS}


def is_failure(row: dict) -> bool:
    return row.get("verdict") == GENERATION_FAILED


def _unit(row: dict) -> tuple[str, int]:
    return str(row["task_key"]), int(row["sample"])


def row_problem(row: dict) -> str | None:
    """Why a row read back from the output file cannot be reused (None: it can): a column it
    lacks or holds with another type (`RowColumns`, the evaluator's `RESULT_TYPES`), a verdict
    that is none of `ROW_VERDICTS`, a negative count, or settings without `ROW_SETTINGS` (`LATER_SETTINGS`
    may be absent) of their types."""
    problem = (field_problem(row, ROW_TYPES, required=(*ROW_TYPES, *ROW_RESULT_FIELDS))
               or result_problem(row, ROW_VERDICTS))
    if problem:
        return problem
    negative = [k for k in ROW_COUNTS if row[k] < 0]
    if negative:
        return f"{negative[0]} is {row[negative[0]]}, not a count"
    if row["iteration"] >= MAX_ROUNDS:
        return f"iteration {row['iteration']} is beyond {MAX_ROUNDS} rounds"
    required = [k for k in ROW_SETTINGS if k not in LATER_SETTINGS]
    problem = field_problem(row["settings"], SETTING_TYPES, required=required)
    return None if problem is None else f"settings: {problem}"


def _changed_settings(rows: list[dict], cfg: GenerateConfig) -> list[str]:
    """`ROW_SETTINGS` the rows hold with another value than `cfg` ("key old -> new"), once per key."""
    distinct = {json.dumps(r["settings"], sort_keys=True): r["settings"] for r in rows}  # one run's: one
    changes: dict[str, str] = {}
    for settings in distinct.values():
        for change in changed_settings(settings, cfg):
            changes.setdefault(change.key, str(change))
    return list(changes.values())


def _plan_difference(row: dict, cfg: GenerateConfig, plan: list[int]) -> str | None:
    """How the turn plan `row` was written with differs from this run's `plan` (None: it fits): the
    option that differs (--num_turns, or the STTS one of `_stts_difference`), or a row at odds with itself."""
    k, t = row["iteration"], row["iter_turn"]
    if row["num_turns"] != cfg.num_turns:
        return f"--num_turns {row['num_turns']}, not --num_turns {cfg.num_turns}"
    if k > 0 and row["round_turns"] != plan[k]:  # round 0 has --num_turns turns under every STTS option
        return _stts_difference(row["round_turns"], cfg)
    if row["round_turns"] != plan[k] or t >= plan[k] or row["turn"] != stts.round_offsets(plan)[k] + t:
        return f"another turn plan (turn {row['turn']} is not turn {t} of round {k}, a round of {plan[k]} turns)"
    return None


def _stts_difference(round_turns: int, cfg: GenerateConfig) -> str:
    """The STTS option that differs, told from the new turns a later round of the file has: rows
    record --num_turns, and `stts.round_turns` gives a later round --num_turns new turns with
    --stts_window_counts false (or --stts_window 0), else --num_turns - --stts_window (at least 1)."""
    n = cfg.num_turns
    if not 1 <= round_turns <= n:
        return f"later rounds of {round_turns} new turns, which no STTS window gives with --num_turns {n}"
    if round_turns == n:  # this run counts a window of 1 or more toward --num_turns, the file did not
        return (f"--stts_window_counts false or --stts_window 0, not --stts_window_counts true "
                f"--stts_window {cfg.stts_window}")
    window = f"{n - round_turns}{' or more' if round_turns == 1 else ''}"
    if not cfg.stts_window_counts:
        return (f"--stts_window_counts true (a window of {window} counted toward --num_turns), not "
                f"--stts_window_counts false")
    return f"--stts_window {window}, not --stts_window {cfg.stts_window}"


def _check_rows(path: Path, rows: list[dict], cfg: GenerateConfig, plan: list[int], policy_name: str) -> None:
    """Rows of another model, --num_turns, STTS turn budget or setting stop the run: mixing them
    would corrupt the metrics."""
    again = "pass another --output or --resume false"
    for i, r in enumerate(rows):
        if difference := _plan_difference(r, cfg, plan):
            fail(f"{path} was written with {difference} (row {i + 1}); {again}")
        if not same_setting(r["model"], policy_name):
            fail(f"{path} holds generations of {r['model']!r}, not {policy_name!r}; {again}")
    changed = _changed_settings(rows, cfg)
    if changed:
        fail(f"{path} was written with other settings ({'; '.join(changed)}: the file's value, then this "
             f"run's); pass the same values, or {again}")


def _keyed(rows: list[dict], tasks: Sequence) -> list[tuple[dict, str | None]]:
    """Each row keyed (`task_key`) to one of `tasks`, with why it does not answer that task
    (`Task.row_problem`: a file written for another task set, or a row at odds with itself; None: it does)."""
    by_key = {t.key: t for t in tasks}
    return [(r, by_key[r["task_key"]].row_problem(r)) for r in rows if r["task_key"] in by_key]


def _check_tasks(path: Path, rows: list[dict], tasks: Sequence) -> None:
    """A row keyed to a selected task that does not answer it stops the run (`_keyed`): reusing it
    would credit the task with another task's answer. Rows of tasks not selected stay, uncounted."""
    problems = [problem for _, problem in _keyed(rows, tasks) if problem]
    if problems:
        fail(f"{path} was written for other tasks ({len(problems)} row(s); the first {problems[0]}); "
             f"pass another --output or --resume false")


def _of_tasks(rows: list[dict], tasks: Sequence) -> list[dict]:
    """The rows that answer one of `tasks` (`_keyed`)."""
    return [r for r, problem in _keyed(rows, tasks) if problem is None]


@dataclasses.dataclass
class Resumed:
    """What `resume_rows` kept of an earlier run's file, and what it dropped."""

    rows: list[dict]
    skipped: list[str] = dataclasses.field(default_factory=list)  # "line N: why" (not JSON, or malformed)
    failed: int = 0  # failure rows: their rounds are generated again
    unfinished: int = 0  # other rows of incomplete rounds
    duplicates: int = 0  # earlier rows of a (task, sample, turn) written again
    backup: Path | None = None  # the old file, copied aside when unusable lines were dropped

    @property
    def dropped(self) -> int:
        return len(self.skipped) + self.failed + self.unfinished + self.duplicates

    @property
    def rounds(self) -> int:
        """The STTS rounds the kept rows reach."""
        return max((r["iteration"] + 1 for r in self.rows), default=0)


def _last_of_each(rows: list[dict]) -> list[dict]:
    """The rows in file order, each (task, sample, turn) by its last row only."""
    by_key = {(*_unit(r), r["turn"]): (pos, r) for pos, r in enumerate(rows)}
    return [r for _, r in sorted(by_key.values(), key=lambda pr: pr[0])]


def _complete_rounds(rows: list[dict], plan: list[int]) -> list[dict]:
    """The rows of each (task, sample)'s rounds 0..k-1 where every round has all of its turns
    and none failed (`rows` hold one row per (task, sample, turn))."""
    offsets = stts.round_offsets(plan)
    turns: dict[tuple, set] = {}
    for r in rows:
        turns.setdefault(_unit(r), set())
        if not is_failure(r):
            turns[_unit(r)].add(r["turn"])
    keep_rounds: dict[tuple, int] = {}
    for unit, ts in turns.items():
        k = 0
        while k < len(plan) and all(offsets[k] + t in ts for t in range(plan[k])):
            k += 1
        keep_rounds[unit] = k
    return [r for r in rows if r["iteration"] < keep_rounds[_unit(r)]]


def resume_rows(path: Path, cfg: GenerateConfig, policy_name: str, tasks: Sequence) -> Resumed:
    """The rows to keep from a previous run, and what was dropped (`_complete_rounds`: later
    rounds, partial or failed rounds; also lines that are not JSON or not a usable row). The file is
    rewritten (atomically) when anything was dropped, copied aside first when lines that are not
    usable rows were (`rewrite_keeping_backup`). A file without one usable row but with
    several lines, or with a whole JSON object, is not a generate.py output, and one with a row that names another task than the
    selected one of its key (`_check_tasks`) was written for other tasks: both are refused, not
    rewritten."""
    try:
        lines = list(iter_jsonl(path))
    except OSError as exc:
        fail(f"cannot read {path}: {exc}")
    problems = [(ln, ln.error if ln.row is None else row_problem(ln.row)) for ln in lines]
    good = [ln.row for ln, problem in problems if not problem]
    skipped = [f"line {ln.lineno}: {problem}" for ln, problem in problems if problem]
    whole = [ln for ln, problem in problems if problem and ln.row is not None]  # JSON, so no cut line
    if not good and (len(skipped) > 1 or whole):
        fail(f"{path} holds no generate.py row ({skipped[0]}); pass another --output or --resume false")
    rounds = max([cfg.stts_iterations] + [r["iteration"] + 1 for r in good])
    plan = stts.round_turns(cfg.num_turns, cfg.stts_window, rounds, cfg.stts_window_counts)
    _check_rows(path, good, cfg, plan, policy_name)
    _check_tasks(path, good, tasks)
    latest = _last_of_each(good)
    kept = _complete_rounds(latest, plan)
    failed = sum(map(is_failure, latest))
    res = Resumed(kept, skipped, failed, len(latest) - len(kept) - failed, len(good) - len(latest))
    if skipped:  # a line that is no usable row may be something else than a cut one: kept aside
        res.backup = rewrite_keeping_backup(path, kept)
    elif res.dropped:
        rewrite_jsonl(path, kept)
    return res


def report_resumed(path: Path, res: Resumed, rounds: int) -> None:
    """One stderr line per kind of dropped row, what is kept, and kept rounds past the `rounds` asked
    for (they stay in the file; the summary counts only the rounds asked for)."""
    say = f"[generate] {path}:"
    if res.skipped:
        print(f"{say} skipped {len(res.skipped)} unusable line(s) (a killed run leaves its last line cut): "
              f"{first_reasons(res.skipped)}; the old file is kept as {res.backup.name}", file=sys.stderr)
    if res.failed:
        print(f"{say} {res.failed} failed generation(s): their rounds are generated again", file=sys.stderr)
    if res.unfinished:
        print(f"{say} dropped {res.unfinished} row(s) of unfinished rounds; they are generated again",
              file=sys.stderr)
    if res.duplicates:
        print(f"{say} dropped {res.duplicates} duplicate row(s): the last row of each turn is kept", file=sys.stderr)
    if res.rows:
        print(f"{say} resuming: {len({(*_unit(r), r['iteration']) for r in res.rows})} (task, sample, round) "
              f"unit(s) already done", file=sys.stderr)
    if res.rounds > rounds:
        print(f"{say} holds {res.rounds} STTS rounds, this run asks for {rounds} (--stts_iterations): the "
              f"summary counts the first {rounds}; the later rows stay in the file", file=sys.stderr)


# --------------------------------------------------------------------------------------
# the generation loop
# --------------------------------------------------------------------------------------

def summary_path(output: str | os.PathLike) -> Path:
    out = Path(output)
    return out.with_name(out.stem + ".summary.json")


def report_dir(output: str | os.PathLike) -> Path:
    """Where the report (tables, plots) of `output`'s generations goes: `<stem>_report/` beside it."""
    out = Path(output)
    return out.with_name(out.stem + "_report")


def run(cfg: GenerateConfig, tasks: Sequence, policy: Policy, evaluate_fn: Callable) -> dict:
    """Generate (and evaluate) every missing (task, sample, round); return the summary. A
    (task, sample) whose request failed skips its later rounds (their context would be broken)."""
    out = Path(cfg.output)
    api = chat_generator(policy)
    rows = _previous_rows(out, cfg, policy, tasks)
    done = {(*_unit(r), r["iteration"]) for r in rows}
    todo = [(t, s, k) for t in tasks for s in range(cfg.samples_per_task) for k in range(cfg.stts_iterations)
            if (t.key, s, k) not in done]
    failed: set[tuple[str, int]] = set()
    # Seed once: a per-call seed (GenerationConfig.seed) would replay the same random draws
    # at every turn and make a trajectory's turns needlessly alike.
    if policy.model is not None:
        import torch

        torch.manual_seed(cfg.seed)
    with JsonlWriter(out, sync_each_row=False) as writer, _progress_bar(api, cfg.round_turns(), todo) as bar:
        for start in range(0, len(tasks), cfg.tasks_per_batch):
            batch = tasks[start:start + cfg.tasks_per_batch]
            for k in range(cfg.stts_iterations):
                pending = [(t, s) for t in batch for s in range(cfg.samples_per_task)
                           if (t.key, s, k) not in done and (t.key, s) not in failed]
                if pending:
                    new = _run_round(cfg, policy, evaluate_fn, pending, k, rows)
                    for row in new:
                        writer.write(row)
                    writer.flush()
                    rows.extend(new)
                    failed.update(_unit(r) for r in new if is_failure(r))
                    done.update((t.key, s, k) for t, s in pending if (t.key, s) not in failed)
                    if api is None:  # the API generator counts its requests itself
                        bar.update(len(pending))
    return _summary(cfg, tasks, rows, len(todo))


def _progress_bar(api: ChatGenerator | None, plan: list[int], todo: list[tuple]) -> tqdm:
    """On stderr: over API requests (with retries and failures) for an API policy, else over trajectories."""
    if api is None:
        return tqdm(total=len(todo), desc="generate", unit="traj", file=sys.stderr)
    bar = tqdm(total=sum(plan[k] for _, _, k in todo), desc="requests", unit="req", file=sys.stderr)
    api.progress.attach(bar)
    return bar


def _previous_rows(out: Path, cfg: GenerateConfig, policy: Policy, tasks: Sequence) -> list[dict]:
    """The finished rows of an earlier run (`resume_rows`); `--resume false` moves the file aside."""
    if not cfg.resume and out.exists() and out.stat().st_size:
        backup = backup_path(out)
        os.replace(out, backup)  # a fresh start never destroys finished generations
        print(f"[generate] --resume false: moved the old generations to {backup}", file=sys.stderr)
    if not out.exists():
        return []
    res = resume_rows(out, cfg, policy.name, tasks)
    report_resumed(out, res, cfg.stts_iterations)
    if res.dropped:
        _restate_summary(cfg, tasks, res.rows)
    return res.rows


def _restate_summary(cfg: GenerateConfig, tasks: Sequence, rows: list[dict]) -> None:
    """An earlier run's summary and report rewritten from the rows kept after some were dropped, so
    that a run which then fails leaves none describing rows that are gone."""
    path = summary_path(cfg.output)
    if path.exists() or report_dir(cfg.output).exists():
        write_json(path, _summary(cfg, tasks, rows, 0))


def _run_round(cfg: GenerateConfig, policy: Policy, evaluate_fn: Callable, pending: list[tuple], k: int,
               rows: list[dict]) -> list[dict]:
    """Round k of every pending (task, sample), one trajectory each; returns its rows. A later
    round starts from the best window of the unit's earlier turns (`stts.context_messages`)."""
    from drkernel.rollout import rollout

    plan = cfg.round_turns()
    starts = None
    if k > 0:
        starts = [stts.context_messages(t, _earlier_turns(rows, t.key, s), cfg.stts_window, cfg.stts_ties)
                  for t, s in pending]
    gen = compose(cfg, GenerationConfig, do_sample=cfg.temperature > 0, seed=None)
    rcfg = compose(cfg, RolloutConfig, num_generations=1, num_turns=plan[k],
                   max_prompt_tokens=policy.max_prompt_tokens, generation=gen)
    api = chat_generator(policy)
    if api is not None:
        api.begin([f"{t.key} sample {s}" for t, s in pending], first_turn=stts.round_offsets(plan)[k])
    # one trajectory per pending (task, sample): the task repeats, num_generations = 1
    trajs = rollout(policy.model, policy.tokenizer, [t for t, _ in pending], evaluate_fn, rcfg,
                    generator=policy.generator, start_messages=starts)
    failures = api.failures if api is not None else {}
    return [row for i, ((task, s), traj) in enumerate(zip(pending, trajs))
            for row in _trajectory_rows(cfg, plan, task, s, k, traj, policy, failures.get(i))]


def _trajectory_rows(cfg: GenerateConfig, plan: list[int], task, sample: int, k: int, traj: list, policy: Policy,
                     failure: Failure | None) -> list[dict]:
    """A trajectory's rows; a failed request ends them with its failure row (later turns were not requested)."""
    rows = []
    for turn_sample in traj:
        if failure is not None and turn_sample.turn == failure.turn:
            rows.append(failure_row(cfg, plan, task, sample, k, failure, policy))
            break
        rows.append(make_row(cfg, plan, task, sample, k, turn_sample, policy))
    return rows


def _earlier_turns(rows: list[dict], task_key: str, sample: int) -> list[dict]:
    return sorted((r for r in rows if _unit(r) == (task_key, sample)), key=lambda r: int(r["turn"]))


def _summary(cfg: GenerateConfig, tasks: Sequence, rows: list[dict], generated: int) -> dict:
    """`drkernel.metrics` over every turn (best of turns) of the rows that answer `tasks`
    (`_of_tasks`), and per STTS round; the report beside it. Failure rows are no answers: their
    turns count as missing."""
    from drkernel import metrics, report

    ours = _of_tasks(rows, tasks)
    mine = [r for r in ours if not is_failure(r)]
    expected = [(t.level, t.problem_id) for t in tasks]
    plan = cfg.round_turns()
    summary = metrics.summarize(mine, expected, samples=cfg.samples_per_task, turns=sum(plan))
    if cfg.stts_iterations > 1:
        summary["stts"] = stts.iteration_metrics(mine, expected, cfg.samples_per_task, plan)
    summary["config"] = dataclasses.asdict(cfg)
    summary["generated_this_run"] = generated
    summary["generation_failures"] = sum(map(is_failure, ours))
    summary["output"] = cfg.output
    report.write_report(summary, mine, report_dir(Path(cfg.output)), expected, cfg.samples_per_task, sum(plan))
    return summary


def print_summary(summary: dict) -> None:
    from drkernel import metrics, report

    shown = summary
    if summary.get("stts"):  # dozens of turns: show rounds instead of every turn
        shown = {**summary, "per_turn": {}, "num_turns": 1}
    print(report.format_table(shown))
    if summary.get("stts"):
        print(stts.format_iterations(summary["stts"], summary.get("p_values", metrics.DEFAULT_P_VALUES)))


def main(argv: Sequence[str] | None = None) -> dict:
    settings = parse_args(list(sys.argv[1:] if argv is None else argv))
    cfg = settings.cfg
    check_config(cfg)
    print(start_line(settings), file=sys.stderr)
    for note in notes(cfg):
        print(f"generate.py: note: {note}", file=sys.stderr)
    # rows record the device that evaluated them, not "auto"
    cfg = dataclasses.replace(cfg, device=_resolve_device(cfg.device))
    tasks = _load_tasks(cfg)
    if problem := create_output("--output", cfg.output):
        fail(problem)
    t0 = time.time()
    policy = load_policy(cfg, cfg.device)
    evaluator = make_evaluator(cfg, cfg.device)
    ref_dir = tempfile.mkdtemp(prefix="drk_gen_refs_")
    try:
        summary = run(cfg, tasks, policy, make_evaluate_fn(evaluator, ref_dir))
    except ApiError as exc:
        fail(f"{exc} (the rows of finished batches are in {cfg.output}; rerun to resume)", status=1)
    finally:
        close = getattr(evaluator, "close", None)
        if close:
            close()
        shutil.rmtree(ref_dir, ignore_errors=True)
    summary["wall_s"] = time.time() - t0
    path = summary_path(cfg.output)
    write_json(path, summary)
    print_summary(summary)
    if summary["generation_failures"]:
        print(f"[generate] {summary['generation_failures']} generation(s) failed (verdict {GENERATION_FAILED} in "
              f"{cfg.output}; counted as missing); run the same command again to retry them", file=sys.stderr)
    print(f"[generate] generations: {cfg.output}  summary: {path}  report: {report_dir(cfg.output) / 'report.md'}  "
          f"({summary['wall_s']:.0f} s)")
    return summary


def _load_tasks(cfg: GenerateConfig) -> list:
    """The selected tasks; an unreadable, empty or ambiguous selection is a clear error."""
    try:
        tasks = cfg.selected_tasks()
        check_distinct_ids(tasks)  # rows are keyed by level and problem id
    except (ConfigError, TaskError) as exc:
        fail(str(exc))
    return tasks


if __name__ == "__main__":
    interruptible(main, "generate.py", "the rows of finished batches are in --output; rerun the same command to resume")
