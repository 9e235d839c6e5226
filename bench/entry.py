"""How every bench script ends on bad input (a KernelBench path that holds no split, a device this
machine lacks, a file it cannot read, a malformed option): one line on stderr and exit status 2,
not a traceback."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

from drkernel.config import COUNT, FRACTION, NON_NEGATIVE, ConfigError, Limit, output_problem
from drkernel.evaluator import DeviceError
from drkernel.tasks import TaskError


class InputError(ValueError):
    """A command-line value or input file a bench script cannot use (a malformed list, a count
    below 1, a file of the wrong format); the message is for the user."""


def check_outputs(*outputs: tuple[str, str | Path | None, bool]) -> None:
    """InputError for the first (option, path, is_dir) that cannot be written (/proc, a read-only
    place, a file where a folder goes): checked before the work, whose results would otherwise be
    lost at the end. A path of None (an output not asked for) is skipped."""
    for option, path, is_dir in outputs:
        problem = None if path is None else output_problem(option, str(path), is_dir=is_dir)
        if problem:
            raise InputError(problem)


def count(text: str) -> int:
    """An argparse type: a whole number of at least 1 (a batch, a length, a number of steps or repeats)."""
    return _checked(text, int, COUNT)


def whole(text: str) -> int:
    """An argparse type: a whole number of at least 0 (a number of problems to skip or keep, 0: none or all)."""
    return _checked(text, int, NON_NEGATIVE)


def fraction(text: str) -> float:
    """An argparse type: a number in [0, 1] (a tolerance)."""
    return _checked(text, float, FRACTION)


def _checked(text: str, kind: type, limit: Limit) -> Any:
    import argparse

    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a {'whole number' if kind is int else 'number'}: {text!r}") from None
    if problem := limit.problem("", value):
        raise argparse.ArgumentTypeError(problem.strip())
    return value


BAD_INPUT = (TaskError, DeviceError, ConfigError, InputError, OSError)


def exit_status(main: Callable[[], Any]) -> int:
    """`main()`'s exit status (0 unless it returns an int); 2 with the reason on bad input."""
    try:
        status = main()
    except BAD_INPUT as exc:
        print(f"{Path(sys.argv[0]).name}: error: {exc}", file=sys.stderr)
        return 2
    return status if isinstance(status, int) else 0
