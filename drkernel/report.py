"""Human-readable output of runs: tables printed to the terminal, report.md and PNG plots.

Evaluations (evaluate.py, generate.py): `write_report(summary, rows, output_dir)` writes
- `summary.json`: the `metrics.summarize` dict;
- `fast_p_curve.png`: Fast@p against p (best-of-turns attempt per unit);
- `speedup_hist.png`: the speedups of correct attempts, one histogram per level;
- `per_turn.png`: correct rate and fast_1 per turn (only informative with several turns);
- `report.md`: the headline metrics, per level, per turn, best-of-turns and hack counts,
  what was counted and the skipped inputs (`summary["counted"]`, `summary["skipped"]`, when
  the summary has them), with links to the plots.
`format_table(summary)` is the plain-text table that `evaluate.py` prints.

Training runs (RL and SFT): `write_run_report(output_dir, title)` reads the run's
`metrics.jsonl` (and, for RL, the verdicts in `rollouts/step_N.jsonl`), prints one table
row per step and writes `report.md` and `training_curves.png` (reward, compiled / correct /
fast_1 / Triton share, hack rate by code, loss, learning rate, seconds per phase) into
`output_dir`. A line of metrics.jsonl that holds no step is skipped and named on stderr, and a run
with no step to report says so there instead of writing nothing silently.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path
from typing import Iterable, Sequence

from drkernel import metrics
from drkernel.config import output_problem
from drkernel.jsonl import finite, first_reasons, iter_jsonl, read_jsonl, write_json

MAX_SKIPPED_ROWS = 100  # skipped inputs listed in report.md
REPORT_FILES = ("summary.json", "fast_p_curve.png", "speedup_hist.png", "per_turn.png", "report.md")


def _columns(summary: dict) -> list[str]:
    """Fast@p per p, each followed by its interval-counted column where the summary has one."""
    fast = [k for p in summary.get("p_values", metrics.DEFAULT_P_VALUES)
            for k in (metrics.fast_key(p), metrics.interval_key(p)) if k in summary]
    return ["compile_rate", "correct_rate", *fast, "geomean_speedup", "mean_speedup",
            "mean_triton_time_share", "num_samples", "num_missing"]


def _fmt(value, key: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if key.endswith(("_rate", "_share")) or key.startswith("fast_"):
            return f"{100 * value:.1f}%"
        return f"{value:.3f}"
    return str(value)


def _rows_for(summary: dict) -> list[tuple[str, dict]]:
    out = [("overall", summary)]
    out += [(f"level {lvl}", blk) for lvl, blk in summary.get("per_level", {}).items()]
    out += [(f"turn {t}", blk) for t, blk in summary.get("per_turn", {}).items()]
    if summary.get("num_turns", 1) > 1:
        out.append(("best of turns", summary.get("best_of_turns", summary)))
    return out


def _summary_lines(summary: dict) -> list[list[str]]:
    """The metrics table's header and one row of cells per block (overall, levels, turns)."""
    cols = _columns(summary)
    return [["scope", *cols], *([name, *(_fmt(blk.get(c), c) for c in cols)] for name, blk in _rows_for(summary))]


def format_table(summary: dict) -> str:
    """A fixed-width text table: one line per block (overall, levels, turns)."""
    text = aligned(_summary_lines(summary))
    hacks = summary.get("hack_counts") or {}
    text.append("hacks: " + (", ".join(f"{k}={v}" for k, v in hacks.items()) if hacks else "none"))
    verdicts = summary.get("verdict_counts") or {}
    if verdicts:
        text.append("verdicts: " + ", ".join(f"{k}={v}" for k, v in verdicts.items()))
    if summary.get("mean_phase_s"):
        text.append(_phase_line(summary["mean_phase_s"]))
    return "\n".join(text)


def aligned(lines: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """Fixed-width text rows: the first `left` columns left-aligned, the others right-aligned, a
    rule under the header."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    text = ["  ".join(cell.ljust(w) if i < left else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
            for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return text


def _phase_line(phase_s: dict[str, float]) -> str:
    return "seconds per evaluation by phase: " + ", ".join(f"{k}={v:.2f}" for k, v in phase_s.items())


def _pyplot():
    """matplotlib's pyplot on the Agg backend: files only, never a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)


def _plot_fast_p(curve: list[tuple[float, float]], path: Path) -> None:
    fig, ax = _pyplot().subplots(figsize=(6, 4))
    ax.plot([p for p, _ in curve], [100 * v for _, v in curve], lw=2, drawstyle="steps-post")
    ax.axvline(1.0, color="grey", ls="--", lw=1)
    ax.set_xlabel("speedup threshold p")
    ax.set_ylabel("Fast@p (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Fast@p (correct and speedup > p)")
    ax.grid(alpha=0.3)
    _save(fig, path)


def _speedups_by_level(levels: list[int], rows: list[dict], expected) -> dict[int, list[float]]:
    """The usable speedups of the rows of each level (of the expected problems, when given)."""
    by_level: dict[int, list[float]] = {lvl: [] for lvl in levels}
    wanted = {(int(l), int(p)) for l, p in expected} if expected is not None else None
    for r in rows:
        s = metrics.usable_speedup(r)
        try:
            lvl = int(r["level"])
        except (KeyError, TypeError, ValueError):
            continue
        if s is not None and lvl in by_level and (wanted is None or (lvl, int(r["problem_id"])) in wanted):
            by_level[lvl].append(s)
    return by_level


def _plot_speedup_hist(by_level: dict[int, list[float]], path: Path) -> None:
    levels = list(by_level)
    fig, axes = _pyplot().subplots(1, max(1, len(levels)), figsize=(4 * max(1, len(levels)), 3.5), squeeze=False)
    for ax, lvl in zip(axes[0], levels or [None]):
        vals = by_level.get(lvl, [])
        if vals:
            ax.hist(vals, bins=min(30, max(5, len(vals))), color="tab:blue", alpha=0.8)
        else:
            ax.text(0.5, 0.5, "no correct attempts", ha="center", va="center", transform=ax.transAxes)
        ax.axvline(1.0, color="grey", ls="--", lw=1)
        ax.set_title(f"level {lvl}" if lvl is not None else "no levels")
        ax.set_xlabel("speedup (correct attempts)")
        ax.set_ylabel("count")
    _save(fig, path)


def _plot_per_turn(per_turn: dict, path: Path) -> None:
    ts = sorted(int(t) for t in per_turn)
    fig, ax = _pyplot().subplots(figsize=(6, 4))
    for key, label in (("correct_rate", "correct"), ("fast_1", "fast_1")):
        ax.plot(ts, [100 * (per_turn[t].get(key) or 0.0) for t in ts], marker="o", label=label)
    ax.set_xlabel("turn (0-based)")
    ax.set_ylabel("% of units")
    ax.set_ylim(0, 100)
    ax.set_xticks(ts)
    ax.legend()
    ax.grid(alpha=0.3)
    ax.set_title("per-turn correctness")
    _save(fig, path)


def _plots(summary: dict, rows: list[dict], out: Path, expected, samples, turns) -> list[str]:
    """The evaluation's three plots, written into `out`; their file names."""
    _plot_fast_p(metrics.fast_p_curve(rows, expected, samples, turns), out / "fast_p_curve.png")
    levels = sorted(summary.get("per_level", {}))
    _plot_speedup_hist(_speedups_by_level(levels, rows, expected), out / "speedup_hist.png")
    _plot_per_turn(summary.get("per_turn", {}), out / "per_turn.png")
    return ["fast_p_curve.png", "speedup_hist.png", "per_turn.png"]


def _skipped_section(summary: dict) -> list[str]:
    """report.md's lines on what was counted and which inputs were skipped (evaluate.py)."""
    md = ["", "## Counted", "", f"Problems counted: {summary['counted']}."] if summary.get("counted") else []
    skipped = summary.get("skipped") or []
    if skipped:
        md += ["", "## Skipped inputs", "", f"{len(skipped)} input(s) were not evaluated "
               f"(the first {min(len(skipped), MAX_SKIPPED_ROWS)} below, all in summary.json).", "",
               "| where | attempt | reason |", "|---|---|---|"]
        for entry in skipped[:MAX_SKIPPED_ROWS]:
            cells = (entry["where"], entry["attempt"] or "-", entry["reason"])
            md.append("| " + " | ".join(" ".join(str(c).split()).replace("|", "\\|") for c in cells) + " |")
    return md


def report_problems(option: str, directory: str | os.PathLike) -> list[str]:
    """Why `write_report` could not write into `directory` (`config.output_problem`): the
    directory, then each of its `REPORT_FILES`; checked before a run's work, as the report comes last."""
    found = output_problem(option, str(directory), is_dir=True)
    if found:
        return [found]
    files = (output_problem(option, str(Path(directory) / name)) for name in REPORT_FILES)
    return [p for p in files if p]


def write_report(summary: dict, rows: Iterable[dict], output_dir: str | os.PathLike,
                 expected=None, samples: int | None = None, turns: int | None = None) -> dict[str, Path]:
    """Write summary.json, the plots and report.md; returns {name: path}.

    `expected`/`samples`/`turns` should be what `summary` was computed with, so that the
    Fast@p curve counts missing samples the same way (default: inferred from the rows)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = list(rows)
    if turns is None:
        turns = summary.get("num_turns")
    paths = {}

    write_json(out / "summary.json", summary)
    paths["summary.json"] = out / "summary.json"

    for name in _plots(summary, rows, out, expected, samples, turns):
        paths[name] = out / name

    md = ["# KernelBench evaluation", ""]
    md.append(f"{summary.get('num_problems', '?')} problems, {summary.get('num_samples', '?')} units "
              f"(problem × sample), {summary.get('num_turns', 1)} turn(s), "
              f"{summary.get('num_missing', 0)} missing (counted as failures), "
              f"{summary.get('num_attempts', '?')} evaluated attempts.")
    md += ["", "Fast@p = share of units that are correct with speedup > p (strict, as in KernelBench); "
           "fast_0 = correct rate. Overall and per-level rows use each unit's best turn.", ""]
    md += ["## Metrics", "", *_markdown(_summary_lines(summary)), ""]
    md += ["## Hack counts", ""]
    hacks = summary.get("hack_counts") or {}
    if hacks:
        md += ["| hack | attempts |", "|---|---|"] + [f"| {k} | {v} |" for k, v in hacks.items()]
    else:
        md.append("No hacks flagged.")
    verdicts = summary.get("verdict_counts") or {}
    if verdicts:
        md += ["", "## Verdicts (best turn per unit)", "", "| verdict | units |", "|---|---|"]
        md += [f"| {k} | {v} |" for k, v in verdicts.items()]
    if summary.get("mean_phase_s"):
        md += ["", "## Time", "", _phase_line(summary["mean_phase_s"]) + "."]
    md += _skipped_section(summary)
    md += ["", "## Plots", "", "![Fast@p](fast_p_curve.png)", "", "![Speedups per level](speedup_hist.png)",
           "", "![Per-turn correctness](per_turn.png)", ""]
    (out / "report.md").write_text("\n".join(md))
    paths["report.md"] = out / "report.md"
    return paths


# ======================================================================================
# Training runs: one row per optimiser step
# ======================================================================================

RUN_PLOT = "training_curves.png"
METRICS = "metrics.jsonl"  # what a training run logs, one row per step (drkernel.runtime.MetricsLogger)
MAX_TABLE_ROWS = 20  # longer runs show evenly spaced steps (all of them are in metrics.jsonl)
COMPILED = "compiled"  # share of turns whose code compiled (from the rollout dump)
HACKED = "hacked"  # share of turns flagged with any hack code
HACK_PREFIX = "hack:"  # share of turns flagged with one code: "hack:<code>"


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of the step table: a key of the step record, its header and its unit."""

    key: str
    header: str
    kind: str = "num"  # num | rate (shown in %) | s (seconds)


@dataclasses.dataclass(frozen=True)
class Panel:
    """One plot of training_curves.png: the keys drawn against the step."""

    title: str
    keys: tuple[str, ...]  # a key ending in ":" stands for every key with that prefix
    ylabel: str
    rate: bool = False  # values in [0, 1], drawn in %
    stacked: bool = False  # stacked bars (seconds per phase) instead of lines


QUALITY_COLUMNS = (Column("reward_mean", "reward"), Column(COMPILED, "compiled", "rate"),
                   Column("correct", "correct", "rate"), Column("fast_1", "fast_1", "rate"),
                   Column("triton_share", "triton", "rate"), Column("all/format_error", "format_err", "rate"),
                   Column(HACKED, "hacked", "rate"))
LOSS_COLUMNS = (Column("loss", "loss"),)
TIME_COLUMNS = (Column("generate_s", "generate_s", "s"), Column("evaluate_s", "evaluate_s", "s"),
                Column("update_s", "update_s", "s"), Column("step_time_s", "step_s", "s"))
LABELS = {c.key: c.header for c in (*QUALITY_COLUMNS, *LOSS_COLUMNS, *TIME_COLUMNS)}
PANELS = (
    Panel("reward", ("reward_mean",), "mean reward per turn"),
    Panel("correctness", (COMPILED, "correct", "fast_1", "triton_share", "all/format_error"), "% of turns", rate=True),
    Panel("hack rate by code", (HACKED, HACK_PREFIX), "% of turns", rate=True),
    Panel("loss", ("loss",), "loss"),
    Panel("learning rate", ("lr",), "lr"),
    Panel("time per phase", ("generate_s", "evaluate_s", "update_s", "step_time_s"), "seconds", stacked=True),
)


@dataclasses.dataclass
class RunHistory:
    """A run's logged values per step, column-wise: `series[key][i]` belongs to `steps[i]`
    (None where that step did not log the key)."""

    steps: list[int]
    series: dict[str, list[float | None]]
    skipped: list[str] = dataclasses.field(default_factory=list)  # "line N: why" per metrics.jsonl line not read

    def has(self, key: str) -> bool:
        return any(v is not None for v in self.series.get(key, ()))

    def keys(self, pattern: str) -> list[str]:
        """`pattern` itself, or every logged key starting with it when it ends in ":"."""
        if pattern.endswith(":"):
            return sorted(k for k in self.series if k.startswith(pattern) and self.has(k))
        return [pattern] if self.has(pattern) else []


def _turn_rates(rollout_rows: list[dict]) -> dict[str, float]:
    """Share of a step's turns that compiled, that were flagged with each hack code, and with any
    (`hacked`)."""
    n = len(rollout_rows)
    if not n:
        return {}
    rates = {HACK_PREFIX + code: count / n for code, count in metrics.hack_counts(rollout_rows).items()}
    rates[HACKED] = sum(metrics.is_hacked(r) for r in rollout_rows) / n
    if all(COMPILED in r for r in rollout_rows):
        rates[COMPILED] = sum(bool(r[COMPILED]) for r in rollout_rows) / n
    return rates


def _step_rows(path: Path) -> tuple[dict[int, dict], list[str]]:
    """{step: its row} of a metrics.jsonl (a step logged twice, by a resumed run, keeps its last
    row), and "line N: why" for each line that is not a step's row."""
    by_step: dict[int, dict] = {}
    skipped = []
    for line in iter_jsonl(path):
        if line.row is None:
            skipped.append(f"line {line.lineno}: {line.error}")
        elif finite(line.row.get("step")) is None:
            skipped.append(f"line {line.lineno}: no step number")
        else:
            by_step[int(line.row["step"])] = line.row
    return by_step, skipped


def load_run_history(output_dir: str | os.PathLike) -> RunHistory:
    """metrics.jsonl (`_step_rows`) plus the compile and hack rates of each step's rollout dump
    (RL with `dump_rollouts`)."""
    out = Path(output_dir)
    by_step, skipped = _step_rows(out / METRICS)
    steps = sorted(by_step)
    records = []
    for step in steps:
        record = {k: finite(v) for k, v in by_step[step].items() if k != "step"}
        record.update(_turn_rates(read_jsonl(out / "rollouts" / f"step_{step}.jsonl")[0]))
        records.append(record)
    keys = dict.fromkeys(k for r in records for k in r)
    return RunHistory(steps, {k: [_value(r, k) for r in records] for k in keys}, skipped)


def _value(record: dict, key: str) -> float | None:
    if key.startswith(HACK_PREFIX) and HACKED in record:  # the step's turns are known: not flagged = 0
        return record.get(key, 0.0)
    return record.get(key)


def _run_columns(history: RunHistory) -> list[Column]:
    hacks = [Column(k, k[len(HACK_PREFIX):], "rate") for k in history.keys(HACK_PREFIX)]
    columns = [*QUALITY_COLUMNS, *hacks, *LOSS_COLUMNS, *TIME_COLUMNS]
    return [c for c in columns if history.has(c.key)]


def _cell(value: float | None, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "rate":
        return f"{100 * value:.0f}%"
    if kind == "s":
        return f"{value:.1f}"
    return f"{value:.4g}"


def _table_rows(history: RunHistory) -> list[int]:
    """Indices of the steps in the table: all of them, or MAX_TABLE_ROWS evenly spaced ones
    with the first and the last."""
    n = len(history.steps)
    if n <= MAX_TABLE_ROWS:
        return list(range(n))
    return sorted({round(i * (n - 1) / (MAX_TABLE_ROWS - 1)) for i in range(MAX_TABLE_ROWS)})


def run_table(history: RunHistory) -> list[list[str]]:
    """Header and one row of cells per shown step."""
    columns = _run_columns(history)
    lines = [["step", *(c.header for c in columns)]]
    for i in _table_rows(history):
        lines.append([str(history.steps[i]), *(_cell(history.series[c.key][i], c.kind) for c in columns)])
    return lines


def _plot_run(history: RunHistory, title: str, path: Path) -> None:
    from matplotlib.ticker import MaxNLocator

    panels = [(p, keys) for p in PANELS if (keys := [k for pat in p.keys for k in history.keys(pat)])]
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = _pyplot().subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (panel, keys) in zip(axes.flat, panels):
        scale = 100.0 if panel.rate else 1.0
        bottom = [0.0] * len(history.steps)
        for key in keys:
            ys = [scale * (v or 0.0) if panel.stacked else (None if v is None else scale * v)
                  for v in history.series[key]]
            label = key[len(HACK_PREFIX):] if key.startswith(HACK_PREFIX) else LABELS.get(key, key)
            if panel.stacked:
                ax.bar(history.steps, ys, bottom=bottom, label=label, width=0.8)
                bottom = [b + y for b, y in zip(bottom, ys)]
            else:
                xs = [s for s, y in zip(history.steps, ys) if y is not None]
                ax.plot(xs, [y for y in ys if y is not None], marker="o" if len(xs) <= 40 else None, ms=3,
                        label=label)
        if panel.rate:
            ax.set_ylim(-2, 102)
        elif panel.stacked:
            ax.set_ylim(0, 1.35 * max(bottom + [1e-9]))  # room for the legend above the bars
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    _save(fig, path)


def _markdown(lines: Sequence[Sequence[str]]) -> list[str]:
    head, *body = lines
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in body]


def write_run_report(output_dir: str | os.PathLike, title: str) -> dict[str, Path]:
    """Print the step table of a training run and write report.md and training_curves.png next
    to its metrics.jsonl; returns {name: path} (empty when no step was logged, said on stderr)."""
    out = Path(output_dir)
    history = load_run_history(out)
    if history.skipped:
        _warn(unread_lines(out, history))
    if not history.steps:
        _warn(f"no report written in {out}: {_no_steps(out / METRICS)}")
        return {}
    lines = run_table(history)
    _plot_run(history, title, out / RUN_PLOT)
    shown = "" if len(lines) - 1 == len(history.steps) else f" ({len(lines) - 1} of {len(history.steps)} steps)"
    md = [f"# {title}", "", f"Per step{shown}; every step is in metrics.jsonl and TensorBoard (logs/).", "",
          *_markdown(lines), "", f"![training curves]({RUN_PLOT})", ""]
    (out / "report.md").write_text("\n".join(md))
    print("\n".join([f"{title}{shown}:", *aligned(lines),
                     f"report: {out / 'report.md'}  plots: {out / RUN_PLOT}"]), flush=True)
    return {"report.md": out / "report.md", RUN_PLOT: out / RUN_PLOT}


def unread_lines(output_dir: Path, history: RunHistory) -> str:
    """The line naming the lines of `output_dir`'s metrics.jsonl that `history` skipped."""
    return (f"{output_dir / METRICS}: skipped {len(history.skipped)} line(s) that hold no step: "
            f"{first_reasons(history.skipped)}")


def _no_steps(path: Path) -> str:
    """Why a run's metrics file gives no step to report."""
    if not path.is_file():
        return f"there is no {path.name}"
    return f"{path.name} holds no step's row"


def _warn(line: str) -> None:
    print(f"[report] warning: {line}", file=sys.stderr, flush=True)
