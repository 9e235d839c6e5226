"""Multi-turn generation on KernelBench (or the bundled tasks), evaluated turn by turn.

    python generate.py                                       # SmolLM2 (offline) on the bundled tasks
    python generate.py --model runs/rl/final --tasks ../shared/kernelbench --levels 1,2 \\
        --samples_per_task 4 --num_turns 3 --output outputs/gen.jsonl
    python generate.py --api_base_url http://localhost:8000/v1 --api_model my-model ...  # any
                                                             # OpenAI-compatible endpoint
    python generate.py ... --stts_iterations 10 --num_turns 5 --stts_window 4   # the paper's STTS

Every trajectory goes through `drkernel.rollout.rollout`, the same prompts, truncation,
evaluator calls and feedback messages as training; the evaluator is the sandboxed
`drkernel.evaluator.Evaluator`.

Output: one JSONL row per (task, sample, turn) with the evaluator's verdict and the reward
(columns in `make_row`). `level, problem_id, sample, turn, code` are what `evaluate.py
--candidates out.jsonl` reads, so generations can be re-evaluated elsewhere (e.g. timed
on a GPU); turns are 0-based and, with STTS, global (the round's offset + `iter_turn`; a later
round adds `num_turns - stts_window` turns by default, see `drkernel.stts.round_turns`).
A summary (`drkernel.metrics`, best-of-turns Fast@p; per STTS round with `drkernel.stts`)
goes to `<output stem>.summary.json` and is printed; report.md and plots to `<output stem>_report/`.

Resume: rows are appended and fsynced after each rollout call (`tasks_per_batch` tasks,
one round). On restart (`--resume true`, the default) the (task, sample, round) units
already complete in the file are skipped; rows of an incomplete unit and a partial last
line (a kill mid-write) are dropped by rewriting the file first, so a rerun writes only
the missing rows and never duplicates one. A later STTS round is rebuilt from the rows.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from drkernel import stts
from drkernel.config import ConfigError, ModelSelection, TaskSelection, compose, parse_config
from drkernel.evaluator import EvalConfig, EvalResult, resolve_device
from drkernel.generation import GenerationConfig
from drkernel.jsonl import JsonlWriter, json_safe, read_jsonl, write_json
from drkernel.rollout import RolloutConfig

ROW_RESULT_FIELDS = ("verdict", "compiled", "correct", "speedup", "triton_time_share", "hacks", "error",
                     "ref_ms", "candidate_ms", "max_abs_err", "max_rel_err", "kernels", "timing")
_E, _G, _Ro = EvalConfig, GenerationConfig, RolloutConfig  # defaults come from these (drkernel.config: SHARED)


@dataclasses.dataclass
class GenerateConfig(ModelSelection, TaskSelection):
    SHARED = (
        (EvalConfig, {"device": "device", "trials": "trials", "perf_trials": "perf_trials", "timeout": "timeout",
                      "eval_cache_dir": "cache_dir"}),
        (GenerationConfig, {"max_new_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p",
                            "top_k": "top_k", "backend": "backend", "batch_size": "batch_size"}),
        (RolloutConfig, {"num_turns": "num_turns", "max_prompt_tokens": "max_prompt_tokens"}),
    )

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
    api_base_url: str = dataclasses.field(default="", metadata={
        "help": "OpenAI-compatible endpoint as the policy, e.g. http://localhost:8000/v1 (replaces --model)"})
    api_model: str = dataclasses.field(default="", metadata={"help": "model name served by the endpoint"})
    api_key_env: str = dataclasses.field(default="OPENAI_API_KEY", metadata={
        "help": "environment variable holding the API key (unset: no auth header)"})
    api_concurrency: int = dataclasses.field(default=8, metadata={"help": "API requests in flight"})
    api_timeout: float = dataclasses.field(default=600.0, metadata={"help": "seconds per API request"})

    def round_turns(self) -> list[int]:
        """New turns per STTS round (`drkernel.stts.round_turns`)."""
        return stts.round_turns(self.num_turns, self.stts_window, self.stts_iterations, self.stts_window_counts)


def check_config(cfg: GenerateConfig) -> None:
    """Bad values stop the run before anything is loaded, with a clear message."""
    problems = []
    for name in ("samples_per_task", "num_turns", "stts_iterations", "tasks_per_batch", "batch_size",
                 "max_new_tokens", "max_prompt_tokens"):
        if getattr(cfg, name) < 1:
            problems.append(f"--{name} must be >= 1 (got {getattr(cfg, name)})")
    if cfg.stts_window < 0:
        problems.append(f"--stts_window must be >= 0 (got {cfg.stts_window})")
    if cfg.stts_ties not in stts.TIES:
        problems.append(f"--stts_ties must be one of {', '.join(stts.TIES)}, not {cfg.stts_ties!r}")
    if cfg.temperature < 0 or not 0 < cfg.top_p <= 1:
        problems.append("--temperature must be >= 0 and --top_p in (0, 1]")
    if cfg.backend not in ("hf", "static"):
        problems.append(f"--backend must be hf or static, not {cfg.backend!r}")
    if cfg.api_base_url and not cfg.api_model:
        problems.append("--api_base_url needs --api_model (the model name the endpoint serves)")
    if problems:
        raise SystemExit("generate.py: " + "; ".join(problems))


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
    max_prompt_tokens: int = 4096  # in the tokenizer's unit
    counts_tokens: bool = True  # False: response lengths are characters (API), not stored


def load_policy(cfg: GenerateConfig, device: str) -> Policy:
    if cfg.api_base_url:
        from drkernel.api_policy import ApiConfig, make_api_policy, prompt_budget

        api = ApiConfig(base_url=cfg.api_base_url, model=cfg.api_model, api_key_env=cfg.api_key_env,
                        timeout=cfg.api_timeout, concurrency=cfg.api_concurrency)
        codec, generator = make_api_policy(api, seed=cfg.seed)
        return Policy(f"api:{cfg.api_model}", None, codec, generator,
                      prompt_budget(cfg.max_prompt_tokens, api.chars_per_token), counts_tokens=False)
    from drkernel.modeling import load_model, load_tokenizer

    tokenizer = load_tokenizer(cfg.model, cfg.tokenizer)
    model = load_model(cfg.model, dtype=cfg.dtype)
    model.to(device).eval()
    return Policy(cfg.model, model, tokenizer, None, cfg.max_prompt_tokens)


def make_evaluator(cfg: GenerateConfig, device: str):
    """The real sandboxed evaluator (tests replace this factory with a fake)."""
    from drkernel.evaluator import Evaluator

    return Evaluator(compose(cfg, EvalConfig, device=device), workers=cfg.workers or None)


def make_evaluate_fn(evaluator, reference_dir: str | os.PathLike) -> Callable[[list], list[EvalResult]]:
    """`rollout()`'s evaluate_fn: (task, code) pairs -> EvalResults, one `evaluate_many` call.

    References are written once per task under `reference_dir` (the evaluator imports
    files); candidates are passed as source text."""

    def evaluate_fn(pairs: list) -> list[EvalResult]:
        return list(evaluator.evaluate_many([(str(task.write(reference_dir)), code) for task, code in pairs]))

    return evaluate_fn


# --------------------------------------------------------------------------------------
# rows and the resumable file
# --------------------------------------------------------------------------------------

def make_row(task, sample: int, iteration: int, plan: Sequence[int], num_turns: int, turn_sample,
             policy: Policy) -> dict:
    """One JSONL row: identity (evaluate.py's `level, problem_id, sample, turn, code`; `turn` is
    global: the round's offset in `plan` (turns per round) + the turn within it), the response,
    the evaluator's result and the reward."""
    result = turn_sample.result
    iter_turn = int(turn_sample.turn) - 1  # rollout counts turns from 1
    row = {"level": task.level, "problem_id": task.problem_id, "task": task.name, "task_key": task.key,
           "sample": int(sample), "turn": stts.round_offsets(plan)[iteration] + iter_turn,
           "iteration": int(iteration), "iter_turn": iter_turn, "num_turns": int(num_turns),
           "round_turns": int(plan[iteration]), "model": policy.name,
           "response": turn_sample.response_text,
           "code": turn_sample.code, "finished": bool(turn_sample.finished),
           "response_tokens": len(turn_sample.response_ids) if policy.counts_tokens else None,
           "reward": float(turn_sample.reward)}
    row.update({k: getattr(result, k) for k in ROW_RESULT_FIELDS})
    row["correct"] = bool(result.correct) and result.verdict == "correct"
    row["hacks"] = list(result.hacks or [])
    return json_safe(row)


def _unit(row: dict) -> tuple[str, int]:
    return str(row["task_key"]), int(row["sample"])


def _check_rows(path: Path, rows: list[dict], cfg: GenerateConfig, plan: list[int], policy_name: str) -> None:
    """Rows of another model, --num_turns or STTS turn budget stop the run: mixing them would
    corrupt the metrics."""
    offsets = stts.round_offsets(plan)
    needed = ("task_key", "sample", "turn", "iteration", "iter_turn", "level", "problem_id")
    for i, r in enumerate(rows):
        missing = [k for k in needed if r.get(k) is None]
        if missing:
            raise SystemExit(f"generate.py: {path} row {i + 1} lacks {', '.join(missing)}: not a generate.py "
                             f"output; pass another --output or --resume false")
        k, t = int(r["iteration"]), int(r["iter_turn"])
        if r.get("num_turns", cfg.num_turns) != cfg.num_turns or r.get("round_turns", plan[k]) != plan[k] \
                or t >= plan[k] or int(r["turn"]) != offsets[k] + t:
            raise SystemExit(f"generate.py: {path} was written with --num_turns {r.get('num_turns', '?')} or "
                             f"another STTS window, not --num_turns {cfg.num_turns} --stts_window {cfg.stts_window} "
                             f"(row {i + 1}); pass another --output or --resume false")
        if r.get("model") not in (None, policy_name):
            raise SystemExit(f"generate.py: {path} holds generations of {r.get('model')!r}, not {policy_name!r}; "
                             f"pass another --output or --resume false")


def resume_rows(path: Path, cfg: GenerateConfig, policy_name: str) -> tuple[list[dict], int]:
    """The rows to keep from a previous run, and how many lines were dropped.

    A (task, sample) keeps its rounds 0..k-1 where each has all of its turns (`round_turns`);
    later rounds, partial rounds and unreadable lines are dropped, and the file is rewritten
    (atomically) when anything was dropped."""
    rows, bad = read_jsonl(path)
    rounds = max([cfg.stts_iterations] + [int(r.get("iteration") or 0) + 1 for r in rows])
    plan = stts.round_turns(cfg.num_turns, cfg.stts_window, rounds, cfg.stts_window_counts)
    _check_rows(path, rows, cfg, plan, policy_name)
    offsets = stts.round_offsets(plan)
    by_key: dict[tuple, tuple[int, dict]] = {}
    for pos, r in enumerate(rows):
        by_key[(*_unit(r), int(r["turn"]))] = (pos, r)  # a duplicate key: the last row wins
    turns: dict[tuple, set] = {}
    for (key, sample, turn) in by_key:
        turns.setdefault((key, sample), set()).add(turn)
    keep_rounds: dict[tuple, int] = {}
    for unit, ts in turns.items():
        k = 0
        while k < len(plan) and all(offsets[k] + t in ts for t in range(plan[k])):
            k += 1
        keep_rounds[unit] = k
    kept = [r for _, r in sorted(by_key.values(), key=lambda pr: pr[0])
            if int(r["iteration"]) < keep_rounds[_unit(r)]]
    dropped = len(rows) - len(kept) + bad
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.unlink(missing_ok=True)
        with JsonlWriter(tmp, sync_each_row=False) as fh:
            for r in kept:
                fh.write(r)
        os.replace(tmp, path)
    return kept, dropped


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
    """Generate (and evaluate) every missing (task, sample, round); return the summary."""
    from tqdm import tqdm

    out = Path(cfg.output)
    rows = _previous_rows(out, cfg, policy)
    done = {(*_unit(r), int(r["iteration"])) for r in rows}
    todo = [(t, s, k) for t in tasks for s in range(cfg.samples_per_task) for k in range(cfg.stts_iterations)
            if (t.key, s, k) not in done]
    # Seed once: a per-call seed (GenerationConfig.seed) would replay the same random draws
    # at every turn and make a trajectory's turns needlessly alike.
    if policy.model is not None:
        import torch

        torch.manual_seed(cfg.seed)
    with JsonlWriter(out, sync_each_row=False) as writer, \
            tqdm(total=len(todo), desc="generate", unit="traj", file=sys.stderr) as bar:
        for start in range(0, len(tasks), cfg.tasks_per_batch):
            batch = tasks[start:start + cfg.tasks_per_batch]
            for k in range(cfg.stts_iterations):
                pending = [(t, s) for t in batch for s in range(cfg.samples_per_task) if (t.key, s, k) not in done]
                if pending:
                    new = _run_round(cfg, policy, evaluate_fn, pending, k, rows)
                    for row in new:
                        writer.write(row)
                    writer.flush()
                    rows.extend(new)
                    done.update((t.key, s, k) for t, s in pending)
                    bar.update(len(pending))
    return _summary(cfg, tasks, rows, len(todo))


def _previous_rows(out: Path, cfg: GenerateConfig, policy: Policy) -> list[dict]:
    """The finished rows of an earlier run (`resume_rows`); `--resume false` moves the file aside."""
    if not cfg.resume and out.exists() and out.stat().st_size:
        backup = out.with_name(f"{out.stem}.{time.strftime('%Y%m%d-%H%M%S')}.jsonl.bak")
        os.replace(out, backup)  # a fresh start never destroys finished generations
        print(f"[generate] --resume false: moved the old generations to {backup}", file=sys.stderr)
    rows, dropped = resume_rows(out, cfg, policy.name) if out.exists() else ([], 0)
    if dropped:
        print(f"[generate] dropped {dropped} line(s) of unfinished trajectories from {out}; they are regenerated",
              file=sys.stderr)
    if rows:
        print(f"[generate] resuming: {len({(*_unit(r), r['iteration']) for r in rows})} (task, sample, round) "
              f"unit(s) already in {out}", file=sys.stderr)
    return rows


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
    # one trajectory per pending (task, sample): the task repeats, num_generations = 1
    trajs = rollout(policy.model, policy.tokenizer, [t for t, _ in pending], evaluate_fn, rcfg,
                    generator=policy.generator, start_messages=starts)
    return [make_row(task, s, k, plan, cfg.num_turns, turn_sample, policy)
            for (task, s), traj in zip(pending, trajs) for turn_sample in traj]


def _earlier_turns(rows: list[dict], task_key: str, sample: int) -> list[dict]:
    return sorted((r for r in rows if _unit(r) == (task_key, sample)), key=lambda r: int(r["turn"]))


def _summary(cfg: GenerateConfig, tasks: Sequence, rows: list[dict], generated: int) -> dict:
    """`drkernel.metrics` over every turn (best of turns), and per STTS round; the report beside it."""
    from drkernel import metrics, report

    keys = {t.key for t in tasks}
    mine = [r for r in rows if r["task_key"] in keys]
    expected = [(t.level, t.problem_id) for t in tasks]
    plan = cfg.round_turns()
    summary = metrics.summarize(mine, expected, samples=cfg.samples_per_task, turns=sum(plan))
    if cfg.stts_iterations > 1:
        summary["stts"] = stts.iteration_metrics(mine, expected, cfg.samples_per_task, plan)
    summary["config"] = dataclasses.asdict(cfg)
    summary["generated_this_run"] = generated
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


def main(argv=None) -> dict:
    cfg = parse_config(GenerateConfig, argv)
    check_config(cfg)
    device = resolve_device(cfg.device)  # before anything imports triton

    from drkernel.tasks import TaskError

    try:
        tasks = cfg.load_tasks()
    except (TaskError, OSError, ConfigError) as exc:
        raise SystemExit(f"generate.py: cannot load tasks {cfg.tasks!r}: {exc}") from None
    if not tasks:
        raise SystemExit(f"generate.py: no tasks for tasks={cfg.tasks!r} levels={cfg.levels} "
                         f"problem_ids={cfg.problem_ids or 'all'}")
    keys = [t.key for t in tasks]
    if len(set(keys)) != len(keys):  # rows are keyed by level_problemid
        dup = sorted({k for k in keys if keys.count(k) > 1})
        raise SystemExit(f"generate.py: several tasks share level_problem_id {', '.join(dup)}; select them "
                         f"apart with --problem_ids")
    t0 = time.time()
    policy = load_policy(cfg, device)
    evaluator = make_evaluator(cfg, device)
    ref_dir = tempfile.mkdtemp(prefix="drk_gen_refs_")
    try:
        summary = run(cfg, tasks, policy, make_evaluate_fn(evaluator, ref_dir))
    finally:
        close = getattr(evaluator, "close", None)
        if close:
            close()
        shutil.rmtree(ref_dir, ignore_errors=True)
    summary["wall_s"] = time.time() - t0
    path = summary_path(cfg.output)
    write_json(path, summary)
    print_summary(summary)
    print(f"[generate] generations: {cfg.output}  summary: {path}  report: {report_dir(cfg.output) / 'report.md'}  "
          f"({summary['wall_s']:.0f} s)")
    return summary


if __name__ == "__main__":
    main()
