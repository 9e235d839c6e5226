"""Sequential test-time scaling (STTS): keep refining, restarting from the best stretch of turns.

A long multi-turn conversation outgrows the context window and drags along every failed
attempt. STTS runs `iterations` rounds for each (task, sample). Round 0 starts from the task
prompt, as in training, and runs `num_turns` turns. Every later round starts from a fresh
conversation that holds the task prompt plus the best `window` *consecutive* earlier turns
(each turn = the policy's answer and the evaluator's feedback on it), "best" meaning the
largest summed reward. The paper (KernelGYM's multi-iteration rollout) uses 10 rounds,
`num_turns` 5 and a window of 4.

Turn budget (`round_turns`): in KernelGYM the kept turns count toward `num_turns`, so a later
round that starts from k kept turns adds max(1, num_turns - k) new ones: 5 + 9 x 1 = 14 turns
in all, and no request ever holds more than num_turns - 1 earlier turns. With
`window_counts=False` every round adds `num_turns` turns (50 in all; a context of up to
window + num_turns - 1 earlier turns).

Conventions (shared with `generate.py`'s JSONL rows):
- the earlier turns of a (task, sample) are all its turns of all finished rounds, in the
  order they were generated (`turn` = the round's offset + the turn within the round,
  0-based); a window may span two rounds: each of its turns still carries its own answer and
  feedback;
- a missing or non-finite reward counts as 0 (the fail reward);
- ties go to the earliest window (KernelGYM: a later window must be strictly better), or with
  `ties="latest"` to the most recent one;
- fewer earlier turns than `window`: all of them; `window = 0`: a fresh start every round
  (independent restarts, i.e. parallel sampling spread over rounds).

Metrics per round (`iteration_metrics`): the round's last turn, the best of its turns, and
the best over every turn so far (the paper's "best candidate across all turns").
"""

from __future__ import annotations

from typing import Iterable, Sequence

from drkernel import metrics
from drkernel.jsonl import finite
from drkernel.prompts import feedback_message, first_turn_messages
from drkernel.report import aligned
from drkernel.tasks import Task

TIES = ("earliest", "latest")


def round_turns(num_turns: int, window: int, iterations: int, window_counts: bool = True) -> list[int]:
    """How many new turns each round generates (see the module docstring)."""
    out: list[int] = []
    for k in range(iterations):
        kept = min(window, sum(out)) if k else 0
        out.append(max(1, num_turns - kept) if window_counts else num_turns)
    return out


def round_offsets(turns_per_round: Sequence[int]) -> list[int]:
    """The global index of each round's first turn."""
    return [sum(turns_per_round[:k]) for k in range(len(turns_per_round))]


def best_window(rewards: Sequence[float | None], window: int, ties: str = "earliest") -> tuple[int, int]:
    """[start, end) of the `window` consecutive turns with the largest summed reward.

    Ties go to the earliest (or, `ties="latest"`, the latest) window; with fewer turns than
    `window` the whole history is kept; `window = 0` keeps nothing (`(n, n)`)."""
    if window < 0:
        raise ValueError(f"the STTS window must be >= 0, not {window}")
    if ties not in TIES:
        raise ValueError(f"ties must be one of {TIES}, not {ties!r}")
    n = len(rewards)
    if window == 0:
        return n, n
    if n <= window:
        return 0, n
    values = [finite(r) or 0.0 for r in rewards]
    sums = [sum(values[start:start + window]) for start in range(n - window + 1)]  # windows are short
    best = max(sums)
    starts = [i for i, total in enumerate(sums) if total == best]
    start = starts[0] if ties == "earliest" else starts[-1]
    return start, start + window


def context_messages(task: Task, turns: Sequence[dict], window: int, ties: str = "earliest") -> list[dict]:
    """The starting conversation of the next round: the task prompt plus the best window.

    `turns` are the earlier turns of one (task, sample) in generation order, as rows with
    `response` (the answer's text), `reward` and the evaluator's result fields (`verdict`,
    `error`, `speedup`, ...). The feedback is rendered again from those fields and numbered
    1..W, so the new conversation reads like an ordinary one of W turns."""
    start, end = best_window([t.get("reward") for t in turns], window, ties)
    messages = first_turn_messages(task)
    for k, turn in enumerate(turns[start:end], 1):
        messages.append({"role": "assistant", "content": str(turn.get("response") or "")})
        messages.append({"role": "user", "content": feedback_message(turn, k)})
    return messages


HEADLINE = ("compile_rate", "correct_rate", "geomean_speedup", "mean_speedup",
            "mean_triton_time_share", "num_samples", "num_missing")


def _headline(block: dict, p_values: Sequence[float]) -> dict:
    out = {k: block.get(k) for k in HEADLINE}
    out.update({metrics.fast_key(p): block.get(metrics.fast_key(p)) for p in p_values})
    return out


def iteration_metrics(rows: Iterable[dict], expected: Iterable[tuple[int, int]], samples: int,
                      turns_per_round: Sequence[int],
                      p_values: Sequence[float] = metrics.DEFAULT_P_VALUES) -> list[dict]:
    """Per round k: `last_turn` (its final turn), `best` (best of its turns) and
    `best_so_far` (best over every turn of rounds 0..k), each a block of headline metrics
    (`drkernel.metrics` definitions; missing attempts count as failures).

    `rows` carry `level, problem_id, sample, turn` (global, 0-based) and `iteration`;
    round k has `turns_per_round[k]` turns (`round_turns`)."""
    rows = [r for r in rows if r.get("iteration") is not None]
    expected = list(expected)
    offsets = round_offsets(turns_per_round)
    out = []
    for k, n in enumerate(turns_per_round):
        this = [dict(r, turn=int(r["turn"]) - offsets[k]) for r in rows if int(r["iteration"]) == k]
        upto = [r for r in rows if int(r["iteration"]) <= k]
        s_this = metrics.summarize(this, expected, samples=samples, turns=n, p_values=p_values)
        s_upto = metrics.summarize(upto, expected, samples=samples, turns=offsets[k] + n, p_values=p_values)
        out.append({"iteration": k,
                    "last_turn": _headline(s_this["per_turn"][n - 1], p_values),
                    "best": _headline(s_this, p_values),
                    "best_so_far": _headline(s_upto, p_values)})
    return out


def format_iterations(per_iteration: Sequence[dict],
                      p_values: Sequence[float] = metrics.DEFAULT_P_VALUES) -> str:
    """A plain-text table: one line per round and scope (last turn / round best / best so far)."""
    cols = ["correct_rate", *(metrics.fast_key(p) for p in p_values if p > 0), "geomean_speedup"]
    lines = [["round", "scope", *cols]]
    for it in per_iteration:
        for scope in ("last_turn", "best", "best_so_far"):
            blk = it[scope]
            cells = []
            for c in cols:
                v = blk.get(c)
                cells.append("-" if v is None else (f"{v:.3f}" if c == "geomean_speedup" else f"{100 * v:.1f}%"))
            lines.append([str(it["iteration"]), scope, *cells])
    return "\n".join(aligned(lines, left=2))
