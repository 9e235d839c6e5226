"""One place for configuration: dataclasses, overridable from a YAML file and the command line.

Every script defines (or reuses) a dataclass whose field defaults are *the* defaults (the
library defaults). `load_config(Cls, argv, preset)` then applies, in order: those defaults, a
base file, and `--key value` / `--key=value` flags. The base file is `--config FILE` when given,
else the script's `preset` (train.py passes the preset a bare run uses); `--config none` means no
file: the library defaults alone. Unknown keys are an error, so typos never pass silently, and
every error is a one-line `ConfigError`.

A script's flat config mirrors settings of the library configs it wires together (the
evaluator's `EvalConfig`, `RewardConfig`, `LossConfig`, ...). Each such field takes its
default from the library class, and the class declares the mirror in `SHARED`, a tuple of
(library class, {field here: field there}). `compose(cfg, Target)` builds the library config
through that map, and `disagreements(Cls)` lists mirrored defaults that differ (a test keeps
it empty), so a default is written once.

The values a numeric setting accepts are declared the same way: a class's `LIMITS`
({field: Limit}), and a mirrored field obeys the library class's limit, so a rule such as
"temperature >= 0" is written once and every script that mirrors the setting checks it
(`limit_problems`).

`changed_settings` lists the settings of a config that differ from recorded ones (a checkpoint's,
a generations file's). The package's configs build on this module, so it imports no other
drkernel module, except `drkernel.tasks` when `TaskSelection` loads tasks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, Callable, Generic, Sequence, TypeVar

T = TypeVar("T")
Shared = tuple[tuple[type, dict[str, str]], ...]  # (library class, {field here: field there})

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f"}
HELP_FLAGS = ("-h", "--help")
NO_CONFIG = "none"  # `--config none`: no base file, the library defaults alone


class ConfigError(ValueError):
    """A bad key or value in a config file or on the command line."""


# --------------------------------------------------------------------------------------
# values: YAML or command-line text to the field's type
# --------------------------------------------------------------------------------------

def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _scalar(value: Any, tp: Any) -> Any:
    """`value` as a bool, int, float or str (ValueError / TypeError otherwise)."""
    if isinstance(value, (dict, list, tuple)):
        raise ValueError("expected a single value, not a list or mapping")
    if tp is bool:
        if isinstance(value, bool):
            return value
        s = str(value).strip().lower()
        if s in _TRUE or s in _FALSE:
            return s in _TRUE
        raise ValueError(f"not a boolean: {value!r}")
    if tp is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError("not a whole number")
        try:
            return int(value)
        except ValueError:
            raise ValueError("not a whole number") from None
    return float(value) if tp is float else str(value)


def coerce(value: Any, tp: Any, key: str = "?") -> Any:
    """Convert a YAML or command-line value to the field's declared type."""
    tp, optional = _unwrap_optional(tp)
    if value is None and not optional and tp in (bool, int, float, str):  # a YAML `null`: never a path or a number
        raise ConfigError(f"{key} must be {tp.__name__}, got None")
    if value is None or (optional and isinstance(value, str) and value.lower() in {"none", "null", ""}):
        if optional or value is None:
            return None
    origin = typing.get_origin(tp)
    try:
        if tp in (bool, int, float, str):
            return _scalar(value, tp)
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


def check_keys(cls: type, keys: Any, source: str = "") -> None:
    """A ConfigError naming the keys that are not fields of `cls`; `source` is the file they came
    from (empty: the command line)."""
    unknown = sorted(str(k) for k in set(keys) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        where = f"{source}: unknown key(s) {', '.join(unknown)}" if source else \
            f"unknown option(s) {' '.join('--' + k for k in unknown)}"
        raise ConfigError(f"{where} (not {cls.__name__} settings; --help lists them)")


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """`cls` from a mapping of (YAML or command-line) values over its defaults."""
    check_keys(cls, data)
    types_ = _field_types(cls)
    return cls(**{k: coerce(v, types_[k], k) for k, v in data.items()})


def _repeated_key(root: Any, loader: Any) -> Any:
    """The first key node that repeats a key of its own mapping, anywhere under `root` (a node
    `loader` composed, which reads each key as the document will); None if none.
    YAML keeps a repeated key's last value silently, so one of two settings would be dropped unseen."""
    import yaml

    todo, visited = [root], set()
    while todo:
        node = todo.pop()
        if id(node) in visited:  # an alias met again (aliases may even point into themselves)
            continue
        visited.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            todo.extend(node.value)
        if not isinstance(node, yaml.MappingNode):
            continue
        names = set()
        for key, value in node.value:
            # as YAML reads the key (`yes` and `true` are one bool; 1 and 0x1 one int)
            name = loader.construct_object(key) if isinstance(key, yaml.ScalarNode) else id(key)
            if name in names:
                return key
            names.add(name)
            todo.append(value)
    return None


def load_yaml(path: str) -> dict[str, Any]:
    """The mapping a YAML config file holds; a missing, unreadable, non-YAML or non-mapping file,
    or one that gives a key twice, is a one-line ConfigError."""
    import yaml

    try:
        loader = yaml.SafeLoader(Path(path).read_text())
        try:  # one parse: the tree checked for repeated keys, then built
            root = loader.get_single_node()
            repeated = _repeated_key(root, loader)
            data = loader.construct_document(root) if root is not None else None
        finally:
            loader.dispose()
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--config {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"--config {path}: not valid YAML ({getattr(exc, 'problem', None) or 'parse error'}"
                          f"{where})") from None
    if repeated is not None:
        raise ConfigError(f"--config {path}: {repeated.value!r} is given twice (line "
                          f"{repeated.start_mark.line + 1}); keep one")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: the top level must be a mapping of key: value lines, "
                          f"not a {type(data).__name__}")
    return data


# --------------------------------------------------------------------------------------
# the command line: defaults <- base file <- flags
# --------------------------------------------------------------------------------------

def shown_path(path: str | os.PathLike) -> str:
    """`path` relative to the working directory when it lies below it (what a user would type)."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def error_line(exc: BaseException) -> str:
    """A library's exception as one line of ours: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def interruptible(main: Callable[[], Any], prog: str, resume: str) -> Any:
    """`main()`'s result; Ctrl-C ends the script with one line instead of a traceback (`resume`: where
    the finished work is and how to go on) and status 130, the shell's for an interrupt."""
    try:
        return main()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; {resume}", file=sys.stderr)
        raise SystemExit(130) from None


def output_problem(option: str, path: str, is_dir: bool = False, writable: bool = True) -> str | None:
    """Why `path` cannot be written as a file (or used as a directory), or None when it can;
    `writable=False` (a shared cache that may be read-only) checks only its kind."""
    kind = "directory" if is_dir else "file"
    if not str(path).strip():
        return f"{option} is empty (name a {kind})"
    try:
        return _path_problem(option, path, is_dir, writable)
    except OSError as exc:  # a name too long, a loop of links: what the system says of it
        return f"{option} {path}: {exc.strerror or exc}"


def _path_problem(option: str, path: str, is_dir: bool, writable: bool) -> str | None:
    kind = "directory" if is_dir else "file"
    p = Path(path)
    if p.is_symlink() and not p.exists():
        return f"{option} {path}: is a link to nothing ({os.readlink(p)})"
    if p.exists() and p.is_dir() != is_dir:
        return f"{option} {path}: is a {'directory' if p.is_dir() else 'file'}, not a {kind}"
    if p.exists() and not is_dir and not p.is_file():  # a device or a pipe: the files written beside it would land in /dev
        return f"{option} {path}: is not a regular file"
    nearest = p if p.exists() else p.parent
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    if not nearest.is_dir() and nearest != p:
        return f"{option} {path}: lies below a file ({nearest})"
    if writable and not _can_write(nearest):
        return f"{option} {path}: {nearest} is not writable"
    return None


def _can_write(place: Path) -> bool:
    """Whether an existing file can be written, or a file created in an existing folder, by trying
    (opened to append, or created and removed): the permission bits do not say it for root, a
    read-only mount or /proc."""
    try:
        if place.is_dir():
            tempfile.TemporaryFile(dir=place).close()
        else:
            open(place, "a").close()
    except OSError:
        return False
    return True


def cache_dir_problem(option: str, path: str) -> str | None:
    """Why an evaluation cache directory cannot be used, or None (also when none is given); the
    cache skips entries it cannot write, so a path that is no directory, or one that does not exist
    and cannot be made, would be silently unused. An existing one may be read-only (shared)."""
    if not path:
        return None
    return output_problem(option, path, is_dir=True, writable=not os.path.exists(path))


_HELD: dict[str, int] = {}  # locks this process holds on its outputs: real path -> descriptor, until exit


def create_output(option: str, path: str, is_dir: bool = False) -> str | None:
    """Create an output now (a file left as it is, or empty), so that a path the system refuses
    (a read-only file system, /proc) is one line before a model loads, and hold it (`hold_output`);
    why not, or None."""
    folder = Path(path) if is_dir else Path(path).parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not is_dir:
            Path(path).touch()
    except OSError as exc:
        return f"{option} {path}: cannot create it ({exc.strerror or exc})"
    return hold_output(option, path)


def hold_output(option: str, path: str) -> str | None:
    """Lock an existing output for the rest of this process, so that a second run writing there is
    refused instead of interleaving its results with this one's; why not, or None. A folder is
    locked itself; a file through a hidden `.<name>.lock` beside it, since a run may replace the
    file (a backup moved aside, a rewrite) and a lock goes with the file it was taken on. The lock
    is the kernel's (flock): it ends when the last process holding it (this one, or a fork of it)
    ends, however it ends."""
    import fcntl

    folder = Path(path).is_dir()
    key = os.path.realpath(path if folder else Path(path).parent / f".{Path(path).name}.lock")
    if key in _HELD:
        return None
    try:
        fd = os.open(key, os.O_RDONLY | os.O_CLOEXEC | (0 if folder else os.O_CREAT), 0o644)
    except OSError as exc:
        return f"{option} {path}: cannot lock it ({exc.strerror or exc})"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return f"{option} {path}: another run is writing there now; wait for it to end, or choose another"
    _HELD[key] = fd
    return None


@dataclasses.dataclass(frozen=True)
class Base:
    """What a run's settings start from before its command-line options."""

    path: str | None = None  # a YAML file applied over the library defaults; None: the defaults alone
    why: str = "no --config given"

    def describe(self) -> str:
        what = f"{self.path} over the library defaults" if self.path else "the library defaults"
        return f"{what} ({self.why})"


def choose_base(config: str | None, preset: str | os.PathLike | None) -> Base:
    """`--config FILE` replaces the preset, `--config none` drops it; without --config, the preset."""
    if config is not None and config.strip().lower() == NO_CONFIG:
        return Base(None, f"--config {NO_CONFIG}")
    if config is not None:
        return Base(config, "--config")
    if preset is not None:
        return Base(shown_path(preset), f"the preset of a bare run, as no --config was given; --config FILE "
                                        f"replaces it, --config {NO_CONFIG} drops it")
    return Base()


def split_argv(argv: Sequence[str]) -> tuple[str | None, dict[str, str]]:
    """(`--config` value or None, {key: value} of the other `--key value` / `--key=value` flags)."""
    flags: dict[str, str] = {}
    config = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; use --key value")
        key, eq, val = arg[2:].partition("=")
        key = key.replace("-", "_")
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        bare = not eq and (nxt is None or nxt.startswith("--"))
        if not eq and not bare:
            val, i = nxt, i + 1
        if key != "config":
            flags[key] = "true" if bare else val  # a bare flag is a boolean switch
        elif bare or not val:
            raise ConfigError(f"--config needs a YAML file (or {NO_CONFIG})")
        else:
            config = val
        i += 1
    return config, flags


@dataclasses.dataclass
class Resolved(Generic[T]):
    """A parsed command line: the config, its base and the options given on the command line."""

    cfg: T
    base: Base
    options: dict[str, str]

    def start_line(self, prog: str) -> str:
        """One line saying where the settings come from."""
        given = ", ".join(f"{k}={v}" for k, v in self.options.items()) or "none"
        return f"{prog}: settings: {self.base.describe()}; command-line options: {given}"


def load_config(cls: type[T], argv: Sequence[str] | None = None,
                preset: str | os.PathLike | None = None, help_text: str = "") -> Resolved[T]:
    """Library defaults <- the base file (`choose_base`) <- `--key value` flags, validated once.
    `--help` prints `help_text` and the keys, and exits."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in HELP_FLAGS for a in argv):
        print(help_text + describe(cls))
        raise SystemExit(0)
    config, flags = split_argv(argv)
    base = choose_base(config, preset)
    data = load_yaml(base.path) if base.path else {}
    check_keys(cls, data, f"--config {base.path}")
    check_keys(cls, flags)
    return Resolved(from_dict(cls, {**data, **flags}), base, flags)


def script_config(cls: type[T], argv: Sequence[str], prog: str, help_text: str) -> Resolved[T]:
    """A script's settings (`load_config`); a bad one ends it with `prog: error: ...`, status 2."""
    try:
        return load_config(cls, argv, help_text=help_text)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def parse_config(cls: type[T], argv: Sequence[str] | None = None) -> T:
    """Defaults <- `--config file.yaml` <- `--key value` flags. `--help` lists the keys."""
    return load_config(cls, argv).cfg


def describe(cls: type) -> str:
    """A help text listing every key with its type and default."""
    lines = [f"{cls.__name__} options (--key value; the defaults shown are the library defaults):"]
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        doc = f.metadata.get("help", "")
        lines.append(f"  --{f.name} (default: {default!r}) {doc}".rstrip())
    return "\n".join(lines)


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


# --------------------------------------------------------------------------------------
# numeric limits
# --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Limit:
    """The values a numeric setting accepts: finite numbers from `low` to `high`, each end
    included unless open, and 0 too where `zero` says what 0 means; `why` ends the error message."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    why: str = ""
    zero: str = ""

    def text(self) -> str:
        if self.low == -math.inf:
            return "a finite number"
        if self.high == math.inf:
            span = f"{'>' if self.low_open else '>='} {self.low:g}"
        else:
            span = f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        return f"{span} or 0 ({self.zero})" if self.zero else span

    def problem(self, name: str, value: float | None) -> str | None:
        """None when `value` is allowed (or unset), else the sentence that says what is."""
        if value is None:
            return None
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        if math.isfinite(value) and (above and below or bool(self.zero) and value == 0):
            return None
        need = self.text() if math.isfinite(value) or self.low == -math.inf else f"a finite number {self.text()}"
        return f"{name} must be {need}, got {value!r}" + (f" ({self.why})" if self.why else "")


@dataclasses.dataclass(frozen=True)
class OneOf:
    """The values a text setting accepts: one of `values`, or a full match of `pattern`."""

    values: tuple[str, ...] = ()
    pattern: str = ""
    text: str = ""  # how the accepted values read in the error message

    def problem(self, name: str, value: Any) -> str | None:
        import re
        ok = value in self.values or bool(self.pattern and isinstance(value, str) and re.fullmatch(self.pattern, value))
        return None if ok else f"{name} must be {self.text or ' or '.join(self.values)}, got {value!r}"


@dataclasses.dataclass(frozen=True)
class Names:
    """The values a text setting accepts: names a library lists, given as a tuple or as a function
    that returns them (called at each check, so the library is imported only when a value is
    checked); `comma_list`: a comma list of such names (empty: none)."""

    names: tuple[str, ...] | Callable[[], Sequence[str]]
    comma_list: bool = False

    def problem(self, name: str, value: Any) -> str | None:
        allowed = tuple(self.names() if callable(self.names) else self.names)
        what = "a comma list of" if self.comma_list else "one of"
        one = OneOf(allowed, text=f"{what} {', '.join(allowed)}")
        found = (one.problem(name, v) for v in (comma_items(value) if self.comma_list else [value]))
        return next((p for p in found if p), None)


def comma_items(text: str | None) -> list[str]:
    """The stripped, non-empty items of a comma list ("a, b," -> ["a", "b"]; None -> [])."""
    return [v.strip() for v in str(text or "").split(",") if v.strip()]


COUNT = Limit(1, 10**6, why="more is a typo: a run that large would not finish")
NON_NEGATIVE = Limit(0)
POSITIVE = Limit(0, low_open=True)
FINITE = Limit()
FRACTION = Limit(0, 1)  # [0, 1]
UP_TO_1 = Limit(0, 1, low_open=True)  # (0, 1]
BELOW_1 = Limit(0, 1, high_open=True)  # [0, 1)
WORKERS = Limit(0, 64, why="0 = auto; each is a sandbox of its own")  # evaluation workers of one process
SEED = Limit(0, 2**32 - 1, why="the seeds torch, numpy and Accelerate take")

def limits(cls: type) -> dict[str, Limit | OneOf]:
    """{field: Limit} of `cls`: its own `LIMITS` along the MRO, and the library classes' limits
    of the fields it mirrors (`SHARED`)."""
    out: dict[str, Limit | OneOf] = {}
    for target, keys in shared_settings(cls).items():
        theirs = limits(target)
        out.update({here: theirs[there] for here, there in keys.items() if there in theirs})
    for klass in reversed(cls.__mro__):
        out.update(vars(klass).get("LIMITS", {}))
    return out


def limit_problems(cfg: Any) -> list[str]:
    """One sentence per setting of `cfg` of another type than its field declares (int, float,
    str, bool, each `| None`) or outside its limit (empty: all fine)."""
    hints = typing.get_type_hints(type(cfg))
    bounds = limits(type(cfg))
    found = (_type_problem(f.name, getattr(cfg, f.name), hints.get(f.name))
             or (bounds[f.name].problem(f.name, getattr(cfg, f.name)) if f.name in bounds else None)
             for f in dataclasses.fields(cfg))
    return [p for p in found if p]


def _type_problem(name: str, value: Any, hint: Any) -> str | None:
    """Why `value` is not of the type `hint` declares (int, float, str, bool, each `| None`), if it
    is not: a library caller's `trials=2.5` or `timeout="30"` is refused here, not deep in a job."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kinds = tuple(k for k in (typing.get_args(hint) if union else (hint,)) if k in (int, float, str, bool, type(None)))
    if not kinds:
        return None
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    ok = ok or (float in kinds and type(value) is int)
    names = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
    return None if ok else f"{name} must be {names}, got {value!r}"


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
    levels: str = dataclasses.field(default="1", metadata={"help": "comma list of KernelBench levels (a KernelBench dataset's splits)"})
    problem_ids: str = dataclasses.field(default="", metadata={"help": "comma list; empty = all"})

    def level_list(self) -> list[int]:
        return int_list(self.levels, "levels") or [1]

    def problem_id_list(self) -> list[int]:
        return int_list(self.problem_ids, "problem_ids")

    def selected_tasks(self) -> list:
        """The selected tasks; ConfigError when the selection cannot be read or is empty."""
        from drkernel.tasks import TaskError, is_dataset, load_tasks
        if not self.tasks.strip():
            raise ConfigError("--tasks is empty (name bundled, a KernelBench path or hub id, or a .py or dir of .py)")
        if self.level_list() != [1] and not is_dataset(self.tasks):
            raise ConfigError(f"--levels {self.levels}: levels select splits of a KernelBench dataset; "
                              f"tasks={self.tasks!r} has none (drop --levels)")
        try:
            tasks = load_tasks(self.tasks, self.level_list(), self.problem_id_list() or None)
        except (TaskError, OSError, ConfigError) as exc:
            raise ConfigError(f"cannot load tasks {self.tasks!r}: {exc}") from None
        if not tasks:
            raise ConfigError(f"no tasks for tasks={self.tasks!r} levels={self.levels} "
                              f"problem_ids={self.problem_ids or 'all'}")
        return tasks


# --------------------------------------------------------------------------------------
# settings against recorded ones
# --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Change:
    """A setting whose value differs from the one a checkpoint was made with."""

    key: str
    before: Any
    after: Any

    def __str__(self) -> str:
        return f"{self.key} {self.before!r} -> {self.after!r}"


def changed_settings(saved: dict[str, Any], cfg: Any) -> list[Change]:
    """The settings of `cfg` that differ from `saved` (compared as JSON; a key that only one side
    has is skipped; two spellings of one existing file or folder, `tiny` and `/abs/tiny/`, agree)."""
    now = json.loads(json.dumps(dataclasses.asdict(cfg)))
    return [Change(k, saved[k], v) for k, v in now.items() if k in saved and not same_setting(saved[k], v)]


def same_setting(then: Any, now: Any) -> bool:
    """Whether a recorded setting and this run's agree: equal, or two names of one existing path."""
    if then == now:
        return True
    if not (isinstance(then, str) and isinstance(now, str) and then and now):
        return False
    try:
        return os.path.samefile(then, now)
    except (OSError, ValueError):  # either names no existing path (a hub id, a number)
        return False
