"""The paper's evaluation metrics over evaluated samples (pure functions, no torch).

Vocabulary
----------
- A *unit* is one (level, problem_id, sample): one independent attempt at one problem.
  With multi-turn refinement a unit has several *turns*; turns are **0-based** (the first
  attempt is turn 0), and so are samples.
- A *row* is one evaluated attempt: a dict with at least `level`, `problem_id`, `sample`,
  `turn`, `verdict`, `compiled`, `correct`, `speedup`, `hacks`, `triton_time_share`
  (the fields of `EvalResult.to_dict()` plus the four keys). Missing `sample`/`turn` mean 0.
  The rules of one attempt (`is_correct`, `is_fast`, ...) also take an `EvalResult` itself, so
  the rewards, PRS and the trainer's statistics judge a result by the same rules as the reports.
- `expected` lists the (level, problem_id) pairs that *should* have been evaluated, with
  `samples` samples each and `turns` turns each. A unit (or a unit's turn) without a row is
  **missing** and counts as a failure: not compiled, not correct, no speedup. Rows for
  problems outside `expected` are ignored. When one key has several rows the last one wins
  (a re-evaluation supersedes an older result).

Definitions (all rates are shares of expected units, so missing units pull them down)
-----------
- `compile_rate`: the attempt compiled (`compiled` is true).
- `correct_rate`: verdict is `correct` and `correct` is true and no hack was flagged.
  A hacked attempt is never correct, whatever its other fields say.
- `fast_p`: Fast@p. `fast_0` is the correct rate. For p > 0 an attempt counts when it is
  correct and `speedup > p` — *strictly* faster than p, as in KernelBench's
  `fastp` (`speedup > p`), so `fast_1` means "correct and faster than the baseline".
  A correct attempt without a speedup (no timing) only counts for `fast_0`.
- `fast_p_interval`: Fast@p counted only where the speedup's 95 % interval clears p (its low end
  is above p), so that a speedup measured as noise does not count: the stricter column.
- `mean_speedup` / `geomean_speedup`: arithmetic / geometric mean of `speedup` over the
  correct attempts that have a finite positive speedup (None when there are none).
- `hack_counts`: how often each hack code was flagged, over every evaluated attempt in the
  block's scope (all turns for the overall and per-level blocks, one turn for a per-turn
  block); a `hacked` verdict with no code counts as `unspecified`.
- `verdict_counts`: verdicts of the block's chosen attempts, with `missing` for missing ones.
- `mean_phase_s` (top level only): mean seconds per evaluator phase over the attempts in scope.

Blocks
------
- `per_turn[t]`: the turn-t attempt of every expected unit (missing → failure).
- `best_of_turns`: per unit the best turn — correct beats not correct, then the higher
  speedup, then compiled beats not compiled, then the earlier turn.
- The overall (top-level) metrics and `per_level` are computed on the best-of-turns
  attempt of each unit; with a single turn that is simply the one attempt.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Iterable, Mapping, Protocol, Sequence, Union

from drkernel.jsonl import finite

DEFAULT_P_VALUES = (0, 1, 1.2, 1.5, 2, 3)
CURVE_STEP = 0.05  # the step between the p values of the default Fast@p curve
CURVE_POINTS = 2000  # at most this many of them (p up to 99.95): one absurd speedup cannot blow the curve up


class Result(Protocol):
    """The fields of an evaluated attempt that the rules read, as attributes (`EvalResult`)."""

    verdict: str
    compiled: bool
    correct: bool
    speedup: float | None
    speedup_interval: list | None
    hacks: list


Attempt = Union[Mapping[str, Any], Result]  # a row, or a result


def attempt_value(attempt: Attempt, name: str) -> Any:
    """`name` of an attempt: a row's key or a result's attribute (None when it has none)."""
    if isinstance(attempt, Mapping):
        return attempt.get(name)
    return getattr(attempt, name, None)


def fast_key(p: float) -> str:
    """`fast_0`, `fast_1`, `fast_1.2`, … (the summary's key for Fast@p)."""
    return f"fast_{float(p):g}"


def interval_key(p: float) -> str:
    """`fast_1_interval`, … (the summary's key for Fast@p counted by the speedup's interval)."""
    return f"{fast_key(p)}_interval"


def unit_key(row: dict) -> tuple[int, int, int]:
    return int(row["level"]), int(row["problem_id"]), int(row.get("sample") or 0)


def row_key(row: dict) -> tuple[int, int, int, int]:
    """The identity of one attempt: (level, problem_id, sample, turn)."""
    return (*unit_key(row), int(row.get("turn") or 0))


def is_hacked(attempt: Attempt) -> bool:
    return attempt_value(attempt, "verdict") == "hacked" or bool(attempt_value(attempt, "hacks"))


def is_correct(attempt: Attempt | None) -> bool:
    """The one rule of a correct attempt (a row or an `EvalResult`): verdict `correct`, `correct`
    true and no hack flagged. A hacked attempt is never correct, whatever its other fields say."""
    if attempt is None or is_hacked(attempt):
        return False
    return attempt_value(attempt, "verdict") == "correct" and bool(attempt_value(attempt, "correct"))


def is_compiled(attempt: Attempt | None) -> bool:
    return attempt is not None and bool(attempt_value(attempt, "compiled"))


def usable_speedup(attempt: Attempt | None) -> float | None:
    """The speedup of a correct attempt when it is a finite positive number, else None."""
    if not is_correct(attempt):
        return None
    s = finite(attempt_value(attempt, "speedup"))
    return s if s is not None and s > 0 else None


def is_fast(attempt: Attempt | None, p: float) -> bool:
    if not is_correct(attempt):
        return False
    if p <= 0:
        return True
    s = usable_speedup(attempt)
    return s is not None and s > p


def is_surely_fast(attempt: Attempt | None, p: float) -> bool:
    """Fast at p with the speedup's whole 95 % interval above p (`speedup_interval`)."""
    if not is_fast(attempt, p) or p <= 0:
        return is_fast(attempt, p)
    interval = attempt_value(attempt, "speedup_interval")
    low = finite(interval[0]) if isinstance(interval, (list, tuple)) and interval else None
    return low is not None and low > p


def _rank(row: dict | None) -> tuple:
    if row is None:
        return (False, -1.0, False, -math.inf)
    return (is_correct(row), usable_speedup(row) or 0.0, is_compiled(row), -int(row.get("turn") or 0))


def hack_counts(rows: Iterable[dict]) -> dict[str, int]:
    """How many attempts flagged each hack code (a `hacked` verdict without a code: `unspecified`)."""
    counts: Counter = Counter()
    for r in rows:
        codes = list(r.get("hacks") or [])
        if not codes and r.get("verdict") == "hacked":
            codes = ["unspecified"]
        for c in dict.fromkeys(codes):  # one count per attempt and code
            counts[str(c)] += 1
    return dict(sorted(counts.items()))


def _share(n: int, k: int) -> float:
    """k of n (0 when there are none)."""
    return k / n if n else 0.0


def _block(chosen: Sequence[dict | None], attempts: Iterable[dict],
           p_values: Sequence[float], intervals: bool = False) -> dict:
    """Metrics over one attempt per unit (`None` = missing) and the attempts in scope."""
    n = len(chosen)
    speedups = [s for s in (usable_speedup(r) for r in chosen) if s is not None]
    out = {
        "num_samples": n,
        "num_missing": sum(r is None for r in chosen),
        "compile_rate": _share(n, sum(is_compiled(r) for r in chosen)),
        "correct_rate": _share(n, sum(is_correct(r) for r in chosen)),
    }
    for p in p_values:
        out[fast_key(p)] = _share(n, sum(is_fast(r, p) for r in chosen))
        if intervals:
            out[interval_key(p)] = _share(n, sum(is_surely_fast(r, p) for r in chosen))
    # each term divided first: the sum of huge finite speedups (1e308) would overflow to inf
    out["mean_speedup"] = sum(s / len(speedups) for s in speedups) if speedups else None
    out["geomean_speedup"] = (math.exp(sum(math.log(s) for s in speedups) / len(speedups))
                              if speedups else None)
    out["num_with_speedup"] = len(speedups)
    shares = [float(r["triton_time_share"]) for r in chosen
              if is_correct(r) and isinstance(r.get("triton_time_share"), (int, float))]
    out["mean_triton_time_share"] = sum(shares) / len(shares) if shares else None
    out["hack_counts"] = hack_counts(attempts)
    out["verdict_counts"] = dict(sorted(Counter(
        "missing" if r is None else str(r.get("verdict")) for r in chosen).items()))
    return out


def mean_phase_seconds(rows: Iterable[dict]) -> dict[str, float]:
    """Mean seconds per evaluation phase over the rows whose result has `details.phase_s`
    (the evaluator's clock: where an evaluation's wall time goes)."""
    per_phase: dict[str, list[float]] = {}
    for r in rows:
        phases = (r.get("details") or {}).get("phase_s") or {}
        for name, seconds in phases.items():
            if isinstance(seconds, (int, float)):
                per_phase.setdefault(str(name), []).append(float(seconds))
    return {name: sum(v) / len(v) for name, v in per_phase.items()}


def _index(rows: Iterable[dict]) -> dict[tuple, dict]:
    by_key: dict[tuple, dict] = {}
    for r in rows:
        try:
            by_key[row_key(r)] = r  # the last row of a key wins
        except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
            continue  # a row without a usable identity cannot belong to any unit
    return by_key


def _expected_units(by_key: dict, expected, samples: int | None) -> list[tuple[int, int, int]]:
    if expected is None:
        return sorted({k[:3] for k in by_key})
    seen = {k[:3] for k in by_key}
    units = []
    for level, pid in dict.fromkeys((int(l), int(p)) for l, p in expected):
        n = samples
        if n is None:  # as many samples as the rows show for this problem, at least one
            n = 1 + max([s for (l, p, s) in seen if (l, p) == (level, pid)], default=0)
        units.extend((level, pid, s) for s in range(n))
    return units


def summarize(rows: Iterable[dict], expected: Iterable[tuple[int, int]] | None = None,
              samples: int | None = None, turns: int | None = None,
              p_values: Sequence[float] = DEFAULT_P_VALUES, intervals: bool = False) -> dict:
    """All metrics (see the module docstring) as a JSON-serialisable dict.

    `expected`: (level, problem_id) pairs; None = the problems present in `rows`.
    `samples`: samples per problem (None = what the rows show); `turns`: turns per unit
    (None = 1 + the largest turn in the rows). `intervals` adds `fast_p_interval` for every p.
    """
    by_key = _index(rows)
    units = _expected_units(by_key, expected, samples)
    unit_set = set(units)
    if turns is None:
        turns = 1 + max([k[3] for k in by_key if k[:3] in unit_set], default=0)
    in_scope = [r for k, r in sorted(by_key.items()) if k[:3] in unit_set and k[3] < turns]

    per_turn = {}
    for t in range(turns):
        chosen = [by_key.get((*u, t)) for u in units]
        per_turn[t] = _block(chosen, [r for r in in_scope if int(r.get("turn") or 0) == t], p_values, intervals)

    best: dict[tuple, dict | None] = {}
    for u in units:
        cands = [by_key.get((*u, t)) for t in range(turns)]
        best[u] = max(cands, key=_rank) if any(c is not None for c in cands) else None

    overall = _block([best[u] for u in units], in_scope, p_values, intervals)
    per_level = {}
    for level in sorted({u[0] for u in units}):
        lu = [u for u in units if u[0] == level]
        per_level[level] = _block([best[u] for u in lu], [r for r in in_scope if int(r["level"]) == level],
                                  p_values, intervals)

    summary = dict(overall)
    summary.update({
        "num_problems": len({u[:2] for u in units}),
        "num_turns": turns,
        "num_attempts": len(in_scope),
        "p_values": [float(p) for p in p_values],
        "per_level": per_level,
        "per_turn": per_turn,
        "best_of_turns": overall,
        "mean_phase_s": mean_phase_seconds(in_scope),
    })
    return summary


def fast_p_curve(rows: Iterable[dict], expected: Iterable[tuple[int, int]] | None = None,
                 samples: int | None = None, turns: int | None = None,
                 ps: Sequence[float] | None = None) -> list[tuple[float, float]]:
    """Fast@p as a function of p (best-of-turns attempt per unit), for plotting.

    `ps` defaults to 0..max(3, the largest speedup) in `CURVE_STEP` steps, `CURVE_POINTS` at most."""
    rows = list(rows)
    if ps is None:
        top = max([s for s in (usable_speedup(r) for r in rows) if s is not None] + [3.0])
        top = min(top, CURVE_STEP * CURVE_POINTS)  # before dividing: 1e308 / 0.05 is inf
        steps = min(CURVE_POINTS, math.ceil(top / CURVE_STEP) + 1)
        ps = [round(i * CURVE_STEP, 10) for i in range(steps)]
    summary = summarize(rows, expected, samples, turns, p_values=tuple(ps))
    return [(float(p), summary[fast_key(p)]) for p in ps]
