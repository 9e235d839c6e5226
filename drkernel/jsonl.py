"""Strict, resumable JSON Lines: the row files of generate.py and evaluate.py, and the summaries.

A run may be killed mid-write, so readers skip a line that is not a complete JSON object
(`read_jsonl` counts them, `iter_jsonl` reports each with its line number), and a writer that
appends to such a file first ends the cut line, so that the next row is not glued to it.
Values are written as strict JSON: NaN and ±inf become null.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Iterator


def json_safe(obj: Any) -> Any:
    """A copy of `obj` with NaN/±inf replaced by None (the json module would write bare NaN)."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def finite(x: Any) -> float | None:
    """A number read from a row or result as a finite float; None for anything else (missing,
    text, a bool, NaN, ±inf)."""
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def dumps(obj: Any, **kwargs) -> str:
    return json.dumps(json_safe(obj), allow_nan=False, default=repr, **kwargs)


@dataclasses.dataclass(frozen=True)
class JsonlLine:
    """One non-blank line of a JSONL file: its number (1-based) and the object it holds, or
    (`row` None) why it holds none."""

    lineno: int
    row: dict | None
    error: str = ""


def _parse_line(lineno: int, raw: bytes) -> JsonlLine:
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return JsonlLine(lineno, None, f"not UTF-8 text (byte {exc.start + 1})")
    except json.JSONDecodeError as exc:
        return JsonlLine(lineno, None, f"not a JSON object ({exc.msg}: column {exc.colno})")
    except RecursionError:  # e.g. thousands of nested brackets
        return JsonlLine(lineno, None, "not a JSON object (nested too deeply)")
    if not isinstance(row, dict):
        return JsonlLine(lineno, None, "not a JSON object")
    return JsonlLine(lineno, row)


def iter_jsonl(path: str | os.PathLike) -> Iterator[JsonlLine]:
    """Every non-blank line of `path`, good or bad, in order (nothing when the file does not
    exist; OSError when it cannot be read). Lines end at \\n, \\r\\n or \\r only, and each is
    decoded on its own, so one bad line never hides the next."""
    path = Path(path)
    if not path.exists():
        return
    for lineno, raw in enumerate(path.read_bytes().splitlines(), 1):
        if raw.strip():
            yield _parse_line(lineno, raw)


def first_reasons(reasons: list[str], shown: int = 3) -> str:
    """The first `shown` reasons a reader skipped lines or rows for, and how many more ("a; b; c;
    and 2 more"): one stderr line however many there are."""
    more = f"; and {len(reasons) - shown} more" if len(reasons) > shown else ""
    return "; ".join(reasons[:shown]) + more


def read_jsonl(path: str | os.PathLike) -> tuple[list[dict], int]:
    """(rows, unreadable lines): only JSON objects count as rows."""
    lines = list(iter_jsonl(path))
    rows = [line.row for line in lines if line.row is not None]
    return rows, len(lines) - len(rows)


class JsonlWriter:
    """Appends rows, one line each. `sync_each_row`: flush and fsync after every row (evaluation
    rows are expensive); otherwise rows become durable at `flush()` / `close()`."""

    def __init__(self, path: str | os.PathLike, sync_each_row: bool = True):
        self.path = Path(path)
        self.sync_each_row = sync_each_row
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and self.path.stat().st_size:
            with open(self.path, "rb") as fh:
                fh.seek(-1, os.SEEK_END)
                cut = fh.read(1) != b"\n"
            if cut:
                with open(self.path, "ab") as fh:
                    fh.write(b"\n")
        self.fh = open(self.path, "a", encoding="utf-8")

    def write(self, row: dict) -> None:
        self.fh.write(dumps(row) + "\n")
        if self.sync_each_row:
            self.flush()

    def flush(self) -> None:
        self.fh.flush()
        os.fsync(self.fh.fileno())

    def close(self) -> None:
        if not self.fh.closed:
            self.flush()
            self.fh.close()

    def __enter__(self) -> "JsonlWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """A whole JSON document, replaced atomically (a kill leaves the old or the new file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)
