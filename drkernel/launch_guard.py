"""What a launch of the candidate's kernel runs is what its text says, and nothing else.

Triton's launch path reads state a candidate can change after its kernels are defined: the
kernel object's own attributes (its source, its rewrite for the interpreter, its hooks, its name on
the device, its compiled kernels and their launchers), the globals its body reads, Triton's
launch hooks and the source lines Python keeps for the file. Any of it can run candidate Python
inside the launch, where the data-flow log is paused and the launch's checksums are taken, or make
the device run (or name) other code than the text the judge read. The launch hook asks this guard
before every launch of the candidate's kernels (`problem`), pins the text the interpreter will read
(`pin`), and notes what the launch itself built (`seen`), so that a later change shows.
"""

from __future__ import annotations

import ast
import dis
import importlib
import linecache
import os
import sys
import types
from typing import Any

_CONSTANTS = (int, float, bool, str, type(None))
_LANGUAGE_MODULES = ("triton.language", "triton.language.math", "triton.language.extra.libdevice")


class LaunchGuard:
    """Built before any candidate code runs, from the candidate's text as the judge sent it."""

    def __init__(self, candidate_file: str, text: str):
        import triton.language as tl

        self.file = os.path.realpath(candidate_file)
        self.lines = text.splitlines(keepends=True)
        self.defs = _defs_by_name(text)
        self.kernel_types = _kernel_types()
        self.rewriter_type = _attr("triton.runtime.interpreter", "FunctionRewriter")
        self.interpreted = _attr("triton.runtime.interpreter", "InterpretedFunction")
        self.constexpr, self.dtype = tl.constexpr, tl.dtype
        self.language = {m.__name__: (m, frozenset(vars(m))) for m in map(_module, _LANGUAGE_MODULES) if m}
        self.hooks = _launch_hooks()
        self.class_attrs = {t: frozenset(a for t2 in t.__mro__ for a in vars(t2)) for t in self.kernel_types}
        # by the kernel object's id, the object kept alive beside it (no id is reused): what its
        # launches built (`_built`), and the source text found to be the file's
        self.built: dict[int, tuple[Any, tuple]] = {}
        self.sources: dict[int, tuple[Any, Any]] = {}
        self.rewrites: set = set()  # the interpreter's rewrites made during launches (kept alive)
        self.globals_read: dict[types.CodeType, frozenset[str]] = {}

    # ---- before a launch --------------------------------------------------------------------------

    def problem(self, kernel: Any, arguments: dict) -> str | None:
        """Why this launch may not run (None: it may). Kernels among its arguments (a helper handed
        in as a constant) are checked as the kernel is."""
        seen: set[int] = set()
        kernels = [kernel, *(v for v in arguments.values() if type(v) in self.kernel_types)]
        return (next(filter(None, (self._object_problem(k, seen) for k in kernels)), None)
                or self._language_problem() or self._hooks_problem() or self._built_problem(kernel))

    def pin(self) -> None:
        """The interpreter rewrites a kernel from the lines Python keeps for its file: those are the
        text the judge read, and a rewrite no launch made is dropped (it is made again from them)."""
        linecache.cache[self.file] = (sum(map(len, self.lines)), None, self.lines, self.file)
        if self.interpreted is None:
            return
        cache = self.interpreted.rewritten_fn
        for fn in [f for f, r in cache.items() if self._is_candidates(f) and r not in self.rewrites]:
            del cache[fn]

    # ---- after a launch ---------------------------------------------------------------------------

    def seen(self, kernel: Any) -> None:
        """Note what Triton built for this kernel in the launch (compiled kernels, rewrites)."""
        self.built[id(kernel)] = (kernel, _built(kernel))
        if self.interpreted is not None:
            self.rewrites |= {r for f, r in self.interpreted.rewritten_fn.items() if self._is_candidates(f)}

    # ---- checks -----------------------------------------------------------------------------------

    def _object_problem(self, kernel: Any, seen: set[int]) -> str | None:
        """The kernel object, and every kernel it reaches through its globals, as Triton made it."""
        if id(kernel) in seen:
            return None
        seen.add(id(kernel))
        name = _name(kernel)
        if type(kernel) not in self.kernel_types:
            return f"{name} is a {type(kernel).__name__}, not Triton's own kernel type"
        if not self._is_candidates(kernel.fn):
            # Triton's own helpers are the library's; any other file is text the judge never read
            return None if _is_tritons(kernel.fn) else f"{name} is defined outside the candidate's file"
        shadowing = sorted(a for a in vars(kernel) if a in self.class_attrs[type(kernel)] and callable(vars(kernel)[a]))
        if shadowing:
            return f"{name} has attributes of its own in place of Triton's: {', '.join(shadowing)}"
        hooks = vars(kernel).get("pre_run_hooks", [])
        if type(hooks) is not list or list.__len__(hooks):
            return f"{name} has pre-run hooks"
        return self._naming_problem(kernel) or self._source_problem(kernel) or self._globals_problem(kernel, seen)

    def _naming_problem(self, kernel: Any) -> str | None:
        """The device names a kernel after its function (a `repr=` or a changed `__qualname__`
        would show another kernel's name, or a library's, on the device's trace)."""
        fn, name = kernel.fn, _name(kernel)
        if vars(kernel).get("_repr") is not None:
            return f"{name} is given another name on the device (repr=)"
        given = (fn.__name__, fn.__qualname__, vars(kernel).get("_fn_name", name))  # Triton's: the full name
        wrong = [n for n in given if not isinstance(n, str) or n.rsplit(".", 1)[-1] != name]
        if wrong:
            return f"{name} is named {wrong[0]!r} on the device"
        if self.rewriter_type is not None and "rewriter" in vars(kernel):
            rw = vars(kernel)["rewriter"]
            if type(rw) is not self.rewriter_type or rw.fn is not fn:
                return f"{name}'s interpreter rewriter is not Triton's own"
        return None

    def _source_problem(self, kernel: Any) -> str | None:
        """The text Triton compiles (`src`) is the def of that name the judge read."""
        src = vars(kernel).get("_src", vars(kernel).get("src"))
        if src is None or self.sources.get(id(kernel), (None, None))[1] is src:
            return None
        try:
            node = ast.parse(src).body[0]
        except (SyntaxError, ValueError, IndexError):
            return f"{_name(kernel)}'s source cannot be read"
        if _dump(node) not in self.defs.get(_name(kernel), ()):
            return f"{_name(kernel)} would compile other text than the file's"
        self.sources[id(kernel)] = (kernel, src)
        return None

    def _globals_problem(self, kernel: Any, seen: set[int]) -> str | None:
        """The globals its body reads: constants, Triton's modules and types, or kernels of the
        same kind (checked in turn). Anything else runs Python of the candidate's inside the
        launch (a `__bool__`, an `__ne__`) or is not what the text says."""
        fn = kernel.fn
        names = self.globals_read.get(fn.__code__)
        if names is None:
            names = self.globals_read[fn.__code__] = _globals_read(fn.__code__)
        for n in names:
            if n not in fn.__globals__:
                continue
            v = fn.__globals__[n]
            if type(v) in self.kernel_types:
                if found := self._object_problem(v, seen):
                    return found
            elif not self._plain(v):
                return f"{_name(kernel)} reads the global {n}, a {type(v).__name__}"
        return None

    def _plain(self, v: Any) -> bool:
        if type(v) in _CONSTANTS or isinstance(v, self.dtype) and type(v).__module__.startswith("triton."):
            return True
        if type(v) is self.constexpr:
            return type(v.value) in _CONSTANTS or isinstance(v.value, self.dtype)
        if type(v) is types.ModuleType:
            return v.__name__ == "math" or v.__name__.split(".")[0] == "triton"
        module = sys.modules.get(getattr(v, "__module__", None) or "")
        return bool(module) and module.__name__.startswith("triton.language") and \
            vars(module).get(getattr(v, "__name__", None)) is v

    def _language_problem(self) -> str | None:
        """Names added to Triton's language modules since before the candidate (a submodule that
        Triton's compile imports is its own)."""
        for label, (module, names) in self.language.items():
            if len(vars(module)) == len(names):
                continue
            added = sorted(k for k, v in vars(module).items() if k not in names and not _submodule(module, k, v))
            if added:
                return f"{label} was given {', '.join(added[:3])}"
        return None

    def _hooks_problem(self) -> str | None:
        return "Triton's launch hooks were set" if _launch_hooks() != self.hooks else None

    def _built_problem(self, kernel: Any) -> str | None:
        """What earlier launches built for this kernel is as they left it (a compiled kernel's
        launcher or binder swapped afterwards runs the candidate's Python)."""
        before, now = self.built.get(id(kernel), (None, None))[1], _built(kernel)
        if before is None:
            return f"{_name(kernel)} was compiled outside a launch" if now else None
        return None if before == now else f"{_name(kernel)}'s compiled kernels were changed after its launch"

    def _is_candidates(self, fn: Any) -> bool:
        code = getattr(fn, "__code__", None)
        return code is not None and os.path.realpath(code.co_filename) == self.file


def _submodule(module: types.ModuleType, name: str, value: Any) -> bool:
    full = f"{module.__name__}.{name}"
    return type(value) is types.ModuleType and value.__name__ == full and sys.modules.get(full) is value


def _is_tritons(fn: Any) -> bool:
    """A function of Triton's own package (its standard library of jitted helpers)."""
    import triton
    code = getattr(fn, "__code__", None)
    root = os.path.dirname(os.path.realpath(triton.__file__)) + os.sep
    return code is not None and os.path.realpath(code.co_filename).startswith(root)


def _defs_by_name(text: str) -> dict[str, set[str]]:
    """Every function the text defines, by name: the dump of its def without decorators."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.setdefault(node.name, set()).add(_dump(node))
    return out


def _dump(node: ast.AST) -> str:
    bare = ast.FunctionDef(node.name, node.args, node.body, [], node.returns, getattr(node, "type_comment", None),
                           **({"type_params": node.type_params} if hasattr(node, "type_params") else {}))
    return ast.dump(bare, include_attributes=False)


def _globals_read(code: types.CodeType) -> frozenset[str]:
    """The global names a function's code and its nested code load."""
    out = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _globals_read(c)
    return frozenset(out)


def _built(kernel: Any) -> tuple:
    """Identities of what Triton compiled for a kernel: its per-device caches and each compiled
    kernel's own attributes (launcher, function handle, metadata)."""
    caches = vars(kernel).get("device_caches") or {}
    out = []
    for device, entry in caches.items():
        for part in entry if isinstance(entry, tuple) else (entry,):
            out.append((device, id(part)))
            if isinstance(part, dict):
                out += [(k, id(v), tuple((a, id(x)) for a, x in vars(v).items()) if hasattr(v, "__dict__") else ())
                        for k, v in part.items()]
    return tuple(out)


def _launch_hooks() -> tuple:
    """Triton's global launch hooks (knobs, or the compiled kernel's class on older versions)."""
    runtime = getattr(sys.modules.get("triton.knobs"), "runtime", None)
    compiled = getattr(sys.modules.get("triton.compiler.compiler"), "CompiledKernel", None)
    return (id(getattr(runtime, "launch_enter_hook", None)), id(getattr(runtime, "launch_exit_hook", None)),
            id(getattr(compiled, "launch_enter_hook", None)), id(getattr(compiled, "launch_exit_hook", None)))


def _kernel_types() -> frozenset:
    return frozenset(t for t in (_attr("triton.runtime.jit", "JITFunction"),
                                 _attr("triton.runtime.interpreter", "InterpretedFunction")) if t is not None)


def _name(kernel: Any) -> str:
    return kernel.fn.__code__.co_name


def _module(name: str) -> types.ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _attr(module: str, name: str) -> Any:
    return getattr(_module(module), name, None)
