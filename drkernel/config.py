"""One place for configuration: dataclasses, overridable from a YAML file and the command line.

Every script defines (or reuses) a dataclass whose field defaults are *the* defaults.
`parse_config(Cls, argv)` then applies, in order: the defaults, `--config file.yaml`,
and `--key value` / `--key=value` flags. Unknown keys are an error, so typos never pass
silently.

A script's flat config mirrors settings of the library configs it wires together (the
evaluator's `EvalConfig`, `RewardConfig`, `LossConfig`, ...). Each such field takes its
default from the library class, and the class declares the mirror in `SHARED`, a tuple of
(library class, {field here: field there}). `compose(cfg, Target)` builds the library config
through that map, and `disagreements(Cls)` lists mirrored defaults that differ (a test keeps
it empty), so a default is written once.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from typing import Any, Sequence, TypeVar

T = TypeVar("T")
Shared = tuple[tuple[type, dict[str, str]], ...]  # (library config class, {field here: field there})

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f"}


class ConfigError(ValueError):
    """A bad key or value in a config file or on the command line."""


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def coerce(value: Any, tp: Any, key: str = "?") -> Any:
    """Convert a YAML or command-line value to the field's declared type."""
    tp, optional = _unwrap_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in {"none", "null", ""}):
        if optional or value is None:
            return None
    origin = typing.get_origin(tp)
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in _TRUE:
                return True
            if s in _FALSE:
                return False
            raise ValueError(f"not a boolean: {value!r}")
        if tp is int:
            if isinstance(value, bool):
                raise ValueError("boolean given for an integer")
            return int(value)
        if tp is float:
            return float(value)
        if tp is str:
            return str(value)
        if origin in (list, tuple, Sequence) or tp in (list, tuple):
            (inner,) = typing.get_args(tp)[:1] or (str,)
            items = value if isinstance(value, (list, tuple)) else [v for v in str(value).split(",") if v.strip()]
            out = [coerce(v.strip() if isinstance(v, str) else v, inner, key) for v in items]
            return tuple(out) if origin is tuple or tp is tuple else out
        if origin is dict or tp is dict:
            if not isinstance(value, dict):
                raise ValueError("expected a mapping")
            return dict(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"bad value for {key}: {value!r} ({exc})") from None
    return value


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def from_dict(cls: type[T], data: dict[str, Any], base: T | None = None) -> T:
    """Build `cls` from a mapping, starting from `base` (or the defaults)."""
    types_ = _field_types(cls)
    unknown = sorted(set(data) - set(types_))
    if unknown:
        raise ConfigError(f"unknown config key(s) for {cls.__name__}: {', '.join(unknown)}")
    values = {k: coerce(v, types_[k], k) for k, v in data.items()}
    return dataclasses.replace(base, **values) if base is not None else cls(**values)


def load_yaml(path: str) -> dict[str, Any]:
    import yaml

    with open(path) as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of key: value")
    return data


def parse_config(cls: type[T], argv: Sequence[str] | None = None) -> T:
    """Defaults <- `--config file.yaml` <- `--key value` flags. `--help` lists the keys."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(describe(cls))
        raise SystemExit(0)
    flags: dict[str, Any] = {}
    config_path = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; use --key value")
        key, eq, val = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or nxt.startswith("--"):
                val = "true"  # a bare flag is a boolean switch
            else:
                val = nxt
                i += 1
        if key == "config":
            config_path = val
        else:
            flags[key] = val
        i += 1
    cfg = cls()
    if config_path:
        cfg = from_dict(cls, load_yaml(config_path), cfg)
    return from_dict(cls, flags, cfg)


def describe(cls: type) -> str:
    """A help text listing every key with its type and default."""
    lines = [f"{cls.__name__} options (--key value, or --config file.yaml):"]
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        doc = f.metadata.get("help", "")
        lines.append(f"  --{f.name} (default: {default!r}) {doc}".rstrip())
    return "\n".join(lines)


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


# --------------------------------------------------------------------------------------
# settings shared between configs
# --------------------------------------------------------------------------------------

def field_default(cls: type, name: str) -> Any:
    """The default of dataclass field `name` of `cls` (a factory is called)."""
    f = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    if f is None:
        raise KeyError(f"{cls.__name__} has no field {name!r}")
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise KeyError(f"{cls.__name__}.{name} has no default")


def shared_settings(cls: type) -> dict[type, dict[str, str]]:
    """Every (library class -> {field here: field there}) map declared in `SHARED` along the MRO."""
    out: dict[type, dict[str, str]] = {}
    for klass in reversed(cls.__mro__):
        for target, keys in vars(klass).get("SHARED", ()):
            out.setdefault(target, {}).update(keys)
    return out


def compose(cfg: Any, target: type[T], **fixed: Any) -> T:
    """`target` built from `cfg`'s mirrored fields (see `SHARED`); `fixed` sets or overrides fields."""
    keys = shared_settings(type(cfg)).get(target)
    if keys is None:
        raise KeyError(f"{type(cfg).__name__} shares no settings with {target.__name__}")
    values = {there: getattr(cfg, here) for here, there in keys.items()}
    return target(**{**values, **fixed})


def disagreements(cls: type) -> list[str]:
    """Mirrored settings whose default in `cls` differs from the library class's default."""
    out = []
    for target, keys in shared_settings(cls).items():
        for here, there in keys.items():
            mine, theirs = field_default(cls, here), field_default(target, there)
            if mine != theirs:
                out.append(f"{cls.__name__}.{here} = {mine!r} but {target.__name__}.{there} = {theirs!r}")
    return out


def int_list(text: str, name: str) -> list[int]:
    """A comma list of integers ("1, 2" -> [1, 2]); a ConfigError names the option otherwise."""
    try:
        return [int(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        raise ConfigError(f"{name} must be a comma list of integers, not {text!r}") from None


@dataclasses.dataclass
class ModelSelection:
    """The policy every script loads."""

    model: str = dataclasses.field(default="smollm2", metadata={
        "help": "HF path or hub id, .gguf file, adapter dir, or smollm2 (offline default)"})
    tokenizer: str | None = dataclasses.field(default=None, metadata={"help": "defaults to model"})
    dtype: str = dataclasses.field(default="auto", metadata={"help": "weights dtype at load: auto | bf16 | fp16 | fp32"})


@dataclasses.dataclass
class TaskSelection:
    """The problems a script runs on (train.py, generate.py, evaluate.py)."""

    tasks: str = dataclasses.field(default="bundled", metadata={
        "help": "bundled | a KernelBench path or hub id (e.g. ../shared/kernelbench) | a .py or dir of .py"})
    levels: str = dataclasses.field(default="1", metadata={"help": "comma list of KernelBench levels"})
    problem_ids: str = dataclasses.field(default="", metadata={"help": "comma list; empty = all"})

    def level_list(self) -> list[int]:
        return int_list(self.levels, "levels") or [1]

    def problem_id_list(self) -> list[int]:
        return int_list(self.problem_ids, "problem_ids")

    def load_tasks(self) -> list:
        """The selected tasks (`drkernel.tasks.load_tasks`; TaskError/OSError when unreadable)."""
        from drkernel.tasks import load_tasks

        return load_tasks(self.tasks, self.level_list(), self.problem_id_list() or None)

