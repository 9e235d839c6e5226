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
on a GPU); turns are 0-based and, with STTS, global (`iteration * num_turns + iter_turn`).
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

from drkernel.config import parse_config
from drkernel.evaluator import resolve_device
from drkernel.jsonl import JsonlWriter, json_safe, read_jsonl, write_json

ROW_RESULT_FIELDS = ("verdict", "compiled", "correct", "speedup", "triton_time_share", "hacks", "error",
                     "ref_ms", "candidate_ms", "max_abs_err", "max_rel_err", "kernels", "timing")


@dataclasses.dataclass
class GenerateConfig:
    model: str = dataclasses.field(default="smollm2", metadata={
        "help": "HF path or hub id, .gguf file, adapter dir, or smollm2 (offline default)"})
    tokenizer: str | None = dataclasses.field(default=None, metadata={"help": "defaults to model"})
    dtype: str = dataclasses.field(default="auto", metadata={"help": "auto | bf16 | fp16 | fp32"})
    tasks: str = dataclasses.field(default="bundled", metadata={
        "help": "bundled | a KernelBench path or hub id (e.g. ../shared/kernelbench) | a .py or dir of .py"})
    levels: str = dataclasses.field(default="1", metadata={"help": "comma list of KernelBench levels"})
    problem_ids: str = dataclasses.field(default="", metadata={"help": "comma list; empty = all"})
    samples_per_task: int = dataclasses.field(default=1, metadata={"help": "trajectories per task (num_generations)"})
    num_turns: int = dataclasses.field(default=3, metadata={"help": "turns per trajectory (per STTS round)"})
    temperature: float = dataclasses.field(default=1.0, metadata={"help": "0 = greedy"})
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 1024
    max_prompt_tokens: int = dataclasses.field(default=4096, metadata={
        "help": "older turns are dropped to fit (API policy: estimated from characters)"})
    backend: str = dataclasses.field(default="hf", metadata={"help": "hf | static (drkernel.generation)"})
    batch_size: int = dataclasses.field(default=64, metadata={"help": "prompts per generate call"})
    tasks_per_batch: int = dataclasses.field(default=8, metadata={
        "help": "tasks per rollout call; rows are saved after each call"})
    device: str = dataclasses.field(default="auto", metadata={"help": "auto | cpu | cuda (policy and evaluator)"})
    trials: int = dataclasses.field(default=5, metadata={"help": "evaluator correctness trials"})
    perf_trials: int = dataclasses.field(default=100, metadata={"help": "evaluator timing repetitions"})
    timeout: float = dataclasses.field(default=180.0, metadata={"help": "seconds per evaluation"})
    workers: int = dataclasses.field(default=0, metadata={"help": "evaluator sandbox workers; 0 = auto"})
    output: str = "outputs/generations.jsonl"
    resume: bool = dataclasses.field(default=True, metadata={
        "help": "skip units already in --output (false: move the old file aside)"})
    seed: int = 0
    stts_iterations: int = dataclasses.field(default=1, metadata={
        "help": "sequential test-time scaling rounds (1 = plain multi-turn)"})
    stts_window: int = dataclasses.field(default=4, metadata={
        "help": "consecutive earlier turns (best summed reward) that start each later round"})
    api_base_url: str = dataclasses.field(default="", metadata={
        "help": "OpenAI-compatible endpoint as the policy, e.g. http://localhost:8000/v1 (replaces --model)"})
    api_model: str = dataclasses.field(default="", metadata={"help": "model name served by the endpoint"})
    api_key_env: str = dataclasses.field(default="OPENAI_API_KEY", metadata={
        "help": "environment variable holding the API key (unset: no auth header)"})
    api_concurrency: int = dataclasses.field(default=8, metadata={"help": "API requests in flight"})
    api_timeout: float = dataclasses.field(default=600.0, metadata={"help": "seconds per API request"})


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        raise SystemExit(f"generate.py: expected a comma list of integers, not {text!r}") from None


def check_config(cfg: GenerateConfig) -> None:
    """Bad values stop the run before anything is loaded, with a clear message."""
    problems = []
    for name in ("samples_per_task", "num_turns", "stts_iterations", "tasks_per_batch", "batch_size",
                 "max_new_tokens", "max_prompt_tokens"):
        if getattr(cfg, name) < 1:
            problems.append(f"--{name} must be >= 1 (got {getattr(cfg, name)})")
    if cfg.stts_window < 0:
        problems.append(f"--stts_window must be >= 0 (got {cfg.stts_window})")
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
    from drkernel.evaluator import EvalConfig, Evaluator

    ecfg = EvalConfig(device=device, trials=cfg.trials, perf_trials=cfg.perf_trials, timeout=cfg.timeout)
    return Evaluator(ecfg, workers=cfg.workers or None)


def make_evaluate_fn(evaluator, reference_dir: str | os.PathLike) -> Callable[[list], list[dict]]:
    """`rollout()`'s evaluate_fn: (task, code) pairs -> result dicts, one `evaluate_many` call.

    References are written once per task under `reference_dir` (the evaluator imports
    files); candidates are passed as source text."""

    def evaluate_fn(pairs: list) -> list[dict]:
        batch = [(str(task.write(reference_dir)), code) for task, code in pairs]
        results = evaluator.evaluate_many(batch)
        out = []
        for res in results:
            d = dict(res) if isinstance(res, dict) else res.to_dict()
            for k in ("stdout", "stderr"):
                d.pop(k, None)
            out.append(d)
        return out

    return evaluate_fn


# --------------------------------------------------------------------------------------
# rows and the resumable file
# --------------------------------------------------------------------------------------

def make_row(task, sample: int, iteration: int, num_turns: int, turn_sample, policy: Policy) -> dict:
    """One JSONL row: identity (evaluate.py's `level, problem_id, sample, turn, code`),
    the response, the evaluator's result and the reward."""
    result = turn_sample.result
    iter_turn = int(turn_sample.turn) - 1  # rollout counts turns from 1
    row = {"level": task.level, "problem_id": task.problem_id, "task": task.name, "task_key": task.key,
           "sample": int(sample), "turn": iteration * num_turns + iter_turn, "iteration": int(iteration),
           "iter_turn": iter_turn, "num_turns": int(num_turns), "model": policy.name,
           "response": turn_sample.response_text,
           "code": turn_sample.code, "finished": bool(turn_sample.finished),
           "response_tokens": len(turn_sample.response_ids) if policy.counts_tokens else None,
           "reward": float(turn_sample.reward)}
    row.update({k: result.get(k) for k in ROW_RESULT_FIELDS})
    row["correct"] = bool(result.get("correct")) and result.get("verdict") == "correct"
    row["hacks"] = list(result.get("hacks") or [])
    return json_safe(row)


def _unit(row: dict) -> tuple[str, int]:
    return str(row["task_key"]), int(row["sample"])


def resume_rows(path: Path, num_turns: int, policy_name: str) -> tuple[list[dict], int]:
    """The rows to keep from a previous run, and how many lines were dropped.

    A (task, sample) keeps its rounds 0..k-1 where each has all `num_turns` turns; later
    rounds, partial rounds and unreadable lines are dropped, and the file is rewritten
    (atomically) when anything was dropped. Rows from another model or another
    `num_turns` stop the run: mixing them would corrupt the metrics."""
    rows, bad = read_jsonl(path)
    needed = ("task_key", "sample", "turn", "iteration", "iter_turn", "level", "problem_id")
    for i, r in enumerate(rows):
        missing = [k for k in needed if r.get(k) is None]
        if missing:
            raise SystemExit(f"generate.py: {path} row {i + 1} lacks {', '.join(missing)}: not a generate.py "
                             f"output; pass another --output or --resume false")
        if r.get("num_turns", num_turns) != num_turns or int(r["iter_turn"]) >= num_turns \
                or int(r["turn"]) != int(r["iteration"]) * num_turns + int(r["iter_turn"]):
            raise SystemExit(f"generate.py: {path} was written with --num_turns {r.get('num_turns', '?')}, not "
                             f"{num_turns} (row {i + 1}); pass another --output or --resume false")
        if r.get("model") not in (None, policy_name):
            raise SystemExit(f"generate.py: {path} holds generations of {r.get('model')!r}, not {policy_name!r}; "
                             f"pass another --output or --resume false")
    by_key: dict[tuple, tuple[int, dict]] = {}
    for pos, r in enumerate(rows):
        by_key[(*_unit(r), int(r["turn"]))] = (pos, r)  # a duplicate key: the last row wins
    turns: dict[tuple, set] = {}
    for (key, sample, turn) in by_key:
        turns.setdefault((key, sample), set()).add(turn)
    keep_rounds: dict[tuple, int] = {}
    for unit, ts in turns.items():
        k = 0
        while all(k * num_turns + t in ts for t in range(num_turns)):
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

    from drkernel import metrics, report, stts
    from drkernel.generation import GenerationConfig
    from drkernel.rollout import RolloutConfig, rollout

    out = Path(cfg.output)
    if not cfg.resume and out.exists() and out.stat().st_size:
        backup = out.with_name(f"{out.stem}.{time.strftime('%Y%m%d-%H%M%S')}.jsonl.bak")
        os.replace(out, backup)  # a fresh start never destroys finished generations
        print(f"[generate] --resume false: moved the old generations to {backup}", file=sys.stderr)
    rows, dropped = resume_rows(out, cfg.num_turns, policy.name) if out.exists() else ([], 0)
    if dropped:
        print(f"[generate] dropped {dropped} line(s) of unfinished trajectories from {out}; they are regenerated",
              file=sys.stderr)
    history: dict[tuple[str, int], list[dict]] = {}
    for r in sorted(rows, key=lambda r: int(r["turn"])):
        history.setdefault(_unit(r), []).append(r)
    done = {(*_unit(r), int(r["iteration"])) for r in rows}

    iterations, samples = cfg.stts_iterations, cfg.samples_per_task
    todo = [(t, s, k) for t in tasks for s in range(samples) for k in range(iterations)
            if (t.key, s, k) not in done]
    if len(todo) < len(tasks) * samples * iterations:
        print(f"[generate] resuming: {len(tasks) * samples * iterations - len(todo)} (task, sample, round) "
              f"unit(s) already in {out}", file=sys.stderr)

    # Seed once: a per-call seed (GenerationConfig.seed) would replay the same random draws
    # at every turn and make a trajectory's turns needlessly alike.
    if policy.model is not None:
        import torch

        torch.manual_seed(cfg.seed)
    writer = JsonlWriter(out, sync_each_row=False)
    try:
        with tqdm(total=len(todo), desc="generate", unit="traj", file=sys.stderr) as bar:
            for start in range(0, len(tasks), cfg.tasks_per_batch):
                batch = tasks[start:start + cfg.tasks_per_batch]
                for k in range(iterations):
                    pending = [(t, s) for t in batch for s in range(samples) if (t.key, s, k) not in done]
                    if not pending:
                        continue
                    starts = None
                    if k > 0:
                        starts = [stts.context_messages(t, history.get((t.key, s), []), cfg.stts_window)
                                  for t, s in pending]
                    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                           top_p=cfg.top_p, top_k=cfg.top_k, do_sample=cfg.temperature > 0,
                                           backend=cfg.backend, batch_size=cfg.batch_size, seed=None)
                    rcfg = RolloutConfig(num_generations=1, num_turns=cfg.num_turns,
                                         max_prompt_tokens=policy.max_prompt_tokens, seed=cfg.seed, generation=gen)
                    # one trajectory per pending (task, sample): the task repeats, num_generations = 1
                    trajs = rollout(policy.model, policy.tokenizer, [t for t, _ in pending], evaluate_fn, rcfg,
                                    generator=policy.generator, start_messages=starts)
                    for (task, s), traj in zip(pending, trajs):
                        for turn_sample in traj:
                            row = make_row(task, s, k, cfg.num_turns, turn_sample, policy)
                            writer.write(row)
                            rows.append(row)
                            history.setdefault((task.key, s), []).append(row)
                        done.add((task.key, s, k))
                    writer.flush()
                    bar.update(len(pending))
    finally:
        writer.close()

    keys = {t.key for t in tasks}
    mine = [r for r in rows if r["task_key"] in keys]
    expected = [(t.level, t.problem_id) for t in tasks]
    summary = metrics.summarize(mine, expected, samples=samples, turns=iterations * cfg.num_turns)
    if iterations > 1:
        summary["stts"] = stts.iteration_metrics(mine, expected, samples, cfg.num_turns, iterations)
    summary["config"] = dataclasses.asdict(cfg)
    summary["generated_this_run"] = len(todo)
    summary["output"] = str(out)
    report.write_report(summary, mine, report_dir(out), expected, samples, iterations * cfg.num_turns)
    return summary


def print_summary(summary: dict) -> None:
    from drkernel import metrics, report, stts

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

    from drkernel.tasks import TaskError, load_tasks

    try:
        tasks = load_tasks(cfg.tasks, levels=_int_list(cfg.levels) or [1],
                           problem_ids=_int_list(cfg.problem_ids) or None)
    except (TaskError, OSError) as exc:
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
