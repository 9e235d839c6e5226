"""A call's launch pattern: which of the candidate's kernels it launched, in order, over which grid,
on tensors of which shape and role (an input, the output, a buffer of its own), with which scalars.

KernelBench draws every call's inputs with the same shapes, so an honest forward launches the same
way on every call. A candidate that can tell checked calls from the others (a call count, the input
distribution, the data-flow log's dispatch mode, the profiler) and launches less, or something else,
where it guesses nobody checks shows another pattern there. The runner records every call's launches
the same way (the launch hook runs in all of them) and describes them when the judge asks, after the
reply (outside every timed span). The judge learns the patterns of the checked calls (`Patterns`):
after the first (which may autotune, compile or cache) they must all launch alike, on uniform and
signed inputs (a forward that launches otherwise when the inputs have negative values drops work on
KernelBench's own inputs); and every warm-up, timed and profiled call must show that steady
pattern, with the scalars that were the same in all of those checked calls (a per-call seed may
change).
"""

from __future__ import annotations

import sys
import types
from typing import Any

type_name = type.__dict__["__qualname__"].__get__  # a class's name from type's own slot: no metaclass property answers
SCALAR_TYPES = (bool, int, float, str, type(None))  # exact types: a subclass may carry methods of its own
# A level-3 forward launches a few hundred; past this only the count is kept. Launching this many
# kernels to hide a switch in the rest costs a timed call tens of milliseconds of launches alone.
MAX_LAUNCHES = 16384


def describe(launches: list[tuple[str, tuple, dict]], key, input_keys: list[int], output_keys: list[int]) -> list:
    """Runner side: the wire form of `launches` ((kernel, grid, arguments by parameter) in order),
    one list of strings per launch; `key(t)` is a tensor's storage key, which tells an input or an
    output from a buffer of the candidate's own."""
    import torch
    roles = {k: f"in{i}" for i, k in enumerate(input_keys)}
    roles.update({k: f"out{i}" for i, k in enumerate(output_keys)})
    out = []
    for name, grid, args in launches[:MAX_LAUNCHES]:
        out.append([f"{name}{tuple(grid)}", *(item for p, v in args.items()
                                              for item in _arg(p, v, key, roles, (torch.Tensor, torch.nn.Parameter)))])
    if len(launches) > MAX_LAUNCHES:
        out.append([f"... {len(launches)} launches"])
    return out


def _arg(param: str, v: Any, key, roles: dict, tensors: tuple[type, ...]) -> list[str]:
    """One argument's entries; a tuple (Triton passes tuples of arguments through) gives one per
    element, a `constexpr` its value: a scalar inside either is a scalar like any other. Every other
    type a launch may take (`runner.ArgumentTypes`) is described by its value too, so that no
    argument can switch a kernel's work between calls unseen: a dtype by its name, a jitted function
    by its def, a numpy scalar as a scalar; a tensor's offset in its storage is a scalar too."""
    # strings, not nested lists: a pattern is built for every call and strings cost the collector nothing.
    # Exact types only: a subclass's own `__repr__`, `stride` or `__iter__` would describe it as it likes
    if type(v) in tensors:  # its offset in its storage as a scalar: a ring of buffers, a row picked by data
        return [f"{param}=T:{v.dtype}:{tuple(v.shape)}:{v.stride()}:{roles.get(key(v), 'own')}",
                f"{param}.offset=S:{v.storage_offset()}"]
    if type(v) in SCALAR_TYPES or type(v).__module__ == "numpy":
        return [f"{param}=S:{v!r}"]
    if issubclass(type(v), tuple):
        return [item for i, x in enumerate(tuple.__iter__(v)) for item in _arg(f"{param}.{i}", x, key, roles, tensors)]
    if type(v) is _constexpr():
        return _arg(f"{param}.value", vars(v).get("value"), key, roles, tensors)
    code = getattr(getattr(v, "fn", None), "__code__", None)
    if isinstance(code, types.CodeType):  # Triton's jitted function (a helper passed as a constexpr)
        return [f"{param}=F:{code.co_name}:{code.co_firstlineno}"]
    if type(v).__module__.partition(".")[0] in ("torch", "triton"):  # a dtype, a pointer type: by name
        return [f"{param}=O:{type_name(type(v))}:{v}"]
    return [f"{param}=O:{type_name(type(v))}"]


def _constexpr() -> type | None:
    """Triton's `constexpr` class, where Triton is loaded (the runner's launches are Triton's)."""
    language = sys.modules.get("triton.language")
    return getattr(language, "constexpr", None) if language is not None else None


def split(sig: Any) -> tuple[tuple, tuple[str, ...]]:
    """Judge side: (the pattern with its scalars blanked, the scalars in order) of the runner's
    untrusted wire form; ValueError when it is malformed."""
    if not isinstance(sig, list) or not all(isinstance(x, list) and x and all(isinstance(s, str) for s in x)
                                            for x in sig):
        raise ValueError("a launch pattern is a list of lists of strings")
    shape, scalars = [], []
    for launch in sig:
        params = [launch[0]]
        for item in launch[1:]:
            param, _, value = item.partition("=")
            if value.startswith("S:"):
                scalars.append(value)
                params.append(f"{param}=S")
            else:
                params.append(item)
        shape.append(tuple(params))
    return tuple(shape), tuple(scalars)


def kernel_counts(sig: Any) -> dict[str, int]:
    """Launches per kernel name in a (well-formed) pattern."""
    counts: dict[str, int] = {}
    for launch in sig:
        name = launch[0].split("(", 1)[0]
        counts[name] = counts.get(name, 0) + 1
    return counts


class Patterns:
    """The launch patterns of the checked calls, each with the scalar values it was seen with."""

    def __init__(self) -> None:
        self.seen: dict[tuple, list[tuple[str, ...]]] = {}
        self.steady: tuple | None = None  # the launches of the checked calls after the first
        self.calls = 0

    def learn(self, sig: Any) -> bool:
        """Keep a checked call's pattern; False when, after the first call, it launched otherwise
        than the checked calls before it (scalars aside)."""
        shape, scalars = split(sig)
        self.seen.setdefault(shape, []).append(scalars)
        self.calls += 1
        if self.calls == 1:
            return True
        self.steady = shape if self.steady is None else self.steady
        return shape == self.steady

    def allows(self, sig: Any) -> bool:
        """Whether `sig` is the steady pattern of the checked calls (the first call's, where it was
        the only one), with every scalar that was the same in all of its checked calls the same
        again. The first call's own launches (autotuning, a cache filled) are not a pattern to come
        back to: no counterfactual call and no tracked change ever follows that call."""
        shape, scalars = split(sig)
        known = self.seen.get(shape)
        if not known or shape != (self.steady or shape):
            return False
        varied = self._varied(shape)
        return all(i in varied or known[0][i] == v for i, v in enumerate(scalars))

    def same_launches(self, sig: Any, other: Any) -> bool:
        """Whether two calls on the same inputs launched alike: the same launches, with the same
        scalars but those that differed between the checked calls of that pattern (a per-call seed).
        A malformed pattern is like none."""
        try:
            (shape, scalars), (shape_b, scalars_b) = split(sig), split(other)
        except ValueError:
            return False
        varied = self._varied(shape)
        return shape == shape_b and all(i in varied or a == b for i, (a, b) in enumerate(zip(scalars, scalars_b)))

    def _varied(self, shape: tuple) -> set[int]:
        """The positions of the scalars that differed between the checked calls of `shape`."""
        known = self.seen.get(shape, [])
        return {i for i in range(len(known[0]) if known else 0) if len({s[i] for s in known}) > 1}
