"""The one writer of the bench scripts' result JSON files."""

from __future__ import annotations

import json
from pathlib import Path


def save_json(path: str | Path, obj) -> None:
    """`obj`, the result JSON of a bench script, at `path`: parent folders made, values JSON
    cannot hold written as text."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=1, default=str))
