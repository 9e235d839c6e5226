"""Strict, resumable JSON Lines: the row files of generate.py and evaluate.py, and the summaries.

A run may be killed mid-write, so readers skip a line that is not a complete JSON object
(`read_jsonl` counts them, `iter_jsonl` reports each with its line number), and a writer that
appends to such a file first ends the cut line, so that the next row is not glued to it.
Values are written as strict JSON: NaN and ±inf become null. A reader checks a row's fields
against their declared types (`field_problem`) before it trusts them.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import shutil
import time
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping


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
    text, a bool, NaN, ±inf, an integer beyond a float's range)."""
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError, OverflowError):
        return None
    return v if math.isfinite(v) else None


_TYPE_TEXT = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list",
              dict: "an object", type(None): "null"}
_PLURAL = {bool: "booleans", int: "integers", float: "numbers", str: "strings", list: "lists", dict: "objects"}


def _members(tp: Any) -> tuple[Any, ...]:
    """The types of a union (`X | None`: X, NoneType), or `tp` alone."""
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    return typing.get_args(tp) if union else (tp,)


def is_a(value: Any, tp: Any) -> bool:
    """Whether `value`, read from JSON, has the declared type `tp`: bool, int, float (an int
    too), str, list, dict, None, a union of them, or `list[X]` (each item an X). A bool is no
    number and a number no bool. Any other hint accepts anything."""
    for t in _members(tp):
        origin = typing.get_origin(t) or t
        if t is type(None) or t is None:
            ok = value is None
        elif origin in (bool, int, float) and (origin is bool) != isinstance(value, bool):
            ok = False
        elif origin is float:
            ok = isinstance(value, (int, float))
        elif origin in (bool, int, str, dict):
            ok = isinstance(value, origin)
        elif origin is list:
            item = (typing.get_args(t) or (Any,))[0]
            ok = isinstance(value, list) and all(is_a(v, item) for v in value)
        else:
            ok = True
        if ok:
            return True
    return False


def _one_type_text(t: Any) -> str:
    origin, args = typing.get_origin(t) or t, typing.get_args(t)
    if origin is list and args:
        return f"a list of {_PLURAL.get(args[0], getattr(args[0], '__name__', 'items'))}"
    return _TYPE_TEXT.get(origin, getattr(origin, "__name__", str(origin)))


def type_text(tp: Any) -> str:
    """How an error names type `tp`: `a string or null`, `a list of objects`."""
    return " or ".join(_one_type_text(t) for t in _members(tp))


def _shown(value: Any, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def field_problem(row: Mapping[str, Any], types_: Mapping[str, Any], required: Iterable[str] = ()) -> str | None:
    """Why `row` is not a record of `types_` ({field: type hint}): the `required` fields it lacks,
    or the first field it holds with a value of another type (`is_a`); None when neither."""
    missing = [k for k in required if k not in row]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        return f"lacks {', '.join(missing[:3])}{more}"
    for name, tp in types_.items():
        if name in row and not is_a(row[name], tp):
            return f"{name} is {_shown(row[name])}, not {type_text(tp)}"
    return None


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
    except ValueError:  # Python's limit on int-string conversion (4300 digits by default)
        return JsonlLine(lineno, None, "not a JSON object (an integer with too many digits)")
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


def first_reasons(reasons: list[str], shown: int = 3, sep: str = "; ") -> str:
    """The first `shown` reasons a reader skipped lines or rows for (or names), and how many more
    ("a; b; c; and 2 more"): one stderr line however many there are."""
    more = f"{sep}and {len(reasons) - shown} more" if len(reasons) > shown else ""
    return sep.join(reasons[:shown]) + more


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
        try:
            os.fsync(self.fh.fileno())
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # EINVAL: a file that cannot be synced (/dev/null, a pipe) keeps nothing to make durable

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


def rewrite_jsonl(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> None:
    """`path` replaced atomically by `rows` (a kill leaves the old or the new file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # a killed rewrite's leftover: the writer would append to it
    with JsonlWriter(tmp, sync_each_row=False) as writer:
        for row in rows:
            writer.write(row)
    os.replace(tmp, path)


def backup_path(path: str | os.PathLike) -> Path:
    """Where an old row file is moved or copied aside, never destroyed: `<stem>.<time>.jsonl.bak` beside it."""
    path = Path(path)
    return path.with_name(f"{path.stem}.{time.strftime('%Y%m%d-%H%M%S')}.jsonl.bak")


def rewrite_keeping_backup(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> Path:
    """`path` rewritten with `rows` (`rewrite_jsonl`) once the old file is copied aside (returned): the
    lines a reader drops as unusable may be something else than cut rows, and are never destroyed."""
    backup = backup_path(path)
    shutil.copyfile(path, backup)
    rewrite_jsonl(path, rows)
    return backup
