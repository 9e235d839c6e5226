"""How every bench script ends on bad input (a KernelBench path that holds no split, a device this
machine lacks, a file it cannot read, a malformed option): one line on stderr and exit status 2,
not a traceback."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

from drkernel.config import ConfigError
from drkernel.evaluator import DeviceError
from drkernel.tasks import TaskError


class InputError(ValueError):
    """A command-line value or input file a bench script cannot use (a malformed list, a count
    below 1, a file of the wrong format); the message is for the user."""


BAD_INPUT = (TaskError, DeviceError, ConfigError, InputError, OSError)


def exit_status(main: Callable[[], Any]) -> int:
    """`main()`'s exit status (0 unless it returns an int); 2 with the reason on bad input."""
    try:
        status = main()
    except BAD_INPUT as exc:
        print(f"{Path(sys.argv[0]).name}: error: {exc}", file=sys.stderr)
        return 2
    return status if isinstance(status, int) else 0
