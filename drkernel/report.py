"""Human-readable output of an evaluation: summary.json, PNG plots and report.md.

`write_report(summary, rows, output_dir)` writes
- `summary.json`: the `metrics.summarize` dict;
- `fast_p_curve.png`: Fast@p against p (best-of-turns attempt per unit);
- `speedup_hist.png`: the speedups of correct attempts, one histogram per level;
- `per_turn.png`: correct rate and fast_1 per turn (only informative with several turns);
- `report.md`: the headline metrics, per level, per turn, best-of-turns and hack counts,
  with links to the plots.
`format_table(summary)` is the plain-text table that `evaluate.py` prints.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Iterable

from drkernel import metrics
from drkernel.jsonl import write_json

def _columns(summary: dict) -> list[str]:
    fast = [metrics.fast_key(p) for p in summary.get("p_values", metrics.DEFAULT_P_VALUES)]
    return ["compile_rate", "correct_rate", *fast, "geomean_speedup", "mean_speedup",
            "num_samples", "num_missing"]


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
        if key.endswith("_rate") or key.startswith("fast_"):
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


def format_table(summary: dict) -> str:
    """A fixed-width text table: one line per block (overall, levels, turns)."""
    cols = _columns(summary)
    lines = [["scope", *cols]]
    for name, blk in _rows_for(summary):
        lines.append([name, *(_fmt(blk.get(c), c) for c in cols)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(cols) + 1)]
    text = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths)))
            for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    hacks = summary.get("hack_counts") or {}
    text.append("hacks: " + (", ".join(f"{k}={v}" for k, v in hacks.items()) if hacks else "none"))
    verdicts = summary.get("verdict_counts") or {}
    if verdicts:
        text.append("verdicts: " + ", ".join(f"{k}={v}" for k, v in verdicts.items()))
    return "\n".join(text)


def _markdown_table(summary: dict) -> str:
    cols = _columns(summary)
    out = ["| scope | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for name, blk in _rows_for(summary):
        out.append(f"| {name} | " + " | ".join(_fmt(blk.get(c), c) for c in cols) + " |")
    return "\n".join(out)


def _plots(summary: dict, rows: list[dict], out: Path, expected, samples, turns) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    written = []

    curve = metrics.fast_p_curve(rows, expected, samples, turns)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p for p, _ in curve], [100 * v for _, v in curve], lw=2, drawstyle="steps-post")
    ax.axvline(1.0, color="grey", ls="--", lw=1)
    ax.set_xlabel("speedup threshold p")
    ax.set_ylabel("Fast@p (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Fast@p (correct and speedup > p)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "fast_p_curve.png", dpi=100)
    plt.close(fig)
    written.append("fast_p_curve.png")

    levels = sorted(summary.get("per_level", {}))
    by_level = {lvl: [] for lvl in levels}
    wanted = {(int(l), int(p)) for l, p in expected} if expected is not None else None
    for r in rows:
        s = metrics.usable_speedup(r)
        try:
            lvl = int(r["level"])
        except (KeyError, TypeError, ValueError):
            continue
        if s is not None and lvl in by_level and (wanted is None or (lvl, int(r["problem_id"])) in wanted):
            by_level[lvl].append(s)
    fig, axes = plt.subplots(1, max(1, len(levels)), figsize=(4 * max(1, len(levels)), 3.5), squeeze=False)
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
    fig.tight_layout()
    fig.savefig(out / "speedup_hist.png", dpi=100)
    plt.close(fig)
    written.append("speedup_hist.png")

    per_turn = summary.get("per_turn", {})
    ts = sorted(int(t) for t in per_turn)
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("correct_rate", "correct"), ("fast_1", "fast_1")):
        ax.plot(ts, [100 * (per_turn[t].get(key) or 0.0) for t in ts], marker="o", label=label)
    ax.set_xlabel("turn (0-based)")
    ax.set_ylabel("% of units")
    ax.set_ylim(0, 100)
    ax.set_xticks(ts)
    ax.legend()
    ax.grid(alpha=0.3)
    ax.set_title("per-turn correctness")
    fig.tight_layout()
    fig.savefig(out / "per_turn.png", dpi=100)
    plt.close(fig)
    written.append("per_turn.png")
    return written


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
    md += ["## Metrics", "", _markdown_table(summary), ""]
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
    md += ["", "## Plots", "", "![Fast@p](fast_p_curve.png)", "", "![Speedups per level](speedup_hist.png)",
           "", "![Per-turn correctness](per_turn.png)", ""]
    (out / "report.md").write_text("\n".join(md))
    paths["report.md"] = out / "report.md"
    return paths
