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
import builtins
import collections
import contextlib
import importlib
import linecache
import os
import sys
import types
from typing import Any

from drkernel import triton_source

try:  # numpy's scalars (a constant computed with numpy): their comparisons are numpy's own code
    import numpy
    _NUMPY_SCALARS: tuple[type, ...] = (numpy.float64, numpy.float32, numpy.float16, numpy.int64, numpy.int32,
                                        numpy.bool_)
except ImportError:
    _NUMPY_SCALARS = ()
_CONSTANTS = (int, float, bool, str, type(None), *_NUMPY_SCALARS)
# launch keywords beside a config's that leave what is compiled the text's own; the rest load the
# device code from a file (`ir_override`), link other code (`extern_libs`) or change its numerics
_SCHEDULING = frozenset({"enable_fp_fusion", "launch_pdl", "launch_cooperative_grid"})


class LaunchGuard:
    """Built before any candidate code runs, from the candidate's text as the judge sent it."""

    def __init__(self, candidate_file: str, text: str):
        import triton.language as tl

        self.file = os.path.realpath(candidate_file)
        self.lines = text.splitlines(keepends=True)
        tree = _parse(text)
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        # by (name, first line): a method named like a kernel is another def
        self.defs = {(n.name, _first_line(n)): _dump(n) for n in nodes}
        self.reads = {(n.name, _first_line(n)): triton_source.reads(n) for n in nodes}
        self.code = _judged_code(text, self.file)  # what importing the text makes of each def
        self.kernel_types = _kernel_types()
        self.rewriter_type = _attr("triton.runtime.interpreter", "FunctionRewriter")
        self.interpreted = _attr("triton.runtime.interpreter", "InterpretedFunction")
        # the names Triton's interpreter adds to a kernel's module when it runs its text again
        self.injected = {k: v for k, v in vars(_module("triton.runtime.interpreter") or types).items()
                         if not k.startswith("__")} if self.interpreted is not None else {}
        self.constexpr = tl.constexpr
        self.options = _launch_options()
        self.settings = _compile_settings()
        self.dtypes = frozenset(_triton_classes(tl.dtype))  # exact types: a candidate's subclass is no dtype
        # what each of Triton's (and math's) modules holds before the candidate: a name added later,
        # or one whose value was replaced (`math.pi` set to an object whose `__bool__` runs torch), is
        # the candidate's
        for name in _MATH_LIBRARIES:  # imported here, they are Triton's as it was before the candidate
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
        self.modules = {name: m for name, m in list(sys.modules.items())
                        if m is not None and (name == "math" or name.split(".")[0] == "triton")}
        self.module_values = {name: dict(vars(m)) for name, m in self.modules.items()}
        self.triton_dir = _package_dir("triton")
        self.libraries = (_package_dir("torch"), self.triton_dir)
        self.mine: dict[types.CodeType, bool] = {}  # per code object: from the candidate's file
        self.class_attrs = {t: frozenset(a for t2 in t.__mro__ for a in vars(t2)) for t in self.kernel_types}
        # by the kernel object's id, the object kept alive beside it (no id is reused): what its
        # launches built (`_built`), and the source text found to be the file's
        self.built: dict[int, tuple[Any, tuple]] = {}
        self.sources: dict[int, tuple[Any, Any]] = {}
        self.rewrites: set = set()  # the interpreter's rewrites made during launches (kept alive)
        self.codes_checked: dict[int, types.CodeType] = {}

    # ---- before a launch --------------------------------------------------------------------------

    def problem(self, kernel: Any, arguments: dict) -> str | None:
        """Why this launch may not run (None: it may). Kernels among its arguments (a helper handed
        in as a constant) are checked as the kernel is."""
        seen: set[int] = set()
        kernels = [kernel, *(v for v in arguments.values() if type(v) in self.kernel_types)]
        return (next(filter(None, (self._object_problem(k, seen) for k in kernels)), None)
                or self._hooks_problem() or self._built_problem(kernel) or self._looked_over(kernel))

    def _looked_over(self, kernel: Any) -> str | None:
        """Triton's interpreter looks over every global of a kernel's module inside its launch
        (`inspect.ismodule`, then `==` with its own modules): a value whose class answers
        `__class__` or every attribute read in Python, or a module of a class with a Python `==`,
        would run the candidate's Python there."""
        if self.interpreted is None or type(kernel) is not self.interpreted:
            return None
        for name, v in list(kernel.fn.__globals__.items()):
            hooks = ("__class__", "__getattribute__", "__eq__") if isinstance(v, types.ModuleType) else \
                ("__class__", "__getattribute__")
            if any(_python_slot(vars(c).get(h)) for c in type(v).__mro__ for h in hooks):
                return f"{_name(kernel)}'s module holds {name}, whose class runs Python when Triton's interpreter looks at it"
        return None

    def options_problem(self, kernel: Any, kwargs: dict) -> str | None:
        """Keywords of a launch or compile that are neither the kernel's parameters nor `self.options`."""
        code = kernel.fn.__code__
        params = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        odd = sorted(k for k in kwargs if k not in params and k not in self.options)
        return f"launch option {', '.join(odd)} of {_name(kernel)} is not one of {', '.join(sorted(self.options))}" \
            if odd else None

    def pin(self) -> list:
        """The interpreter rewrites a kernel from the lines Python keeps for its file: those are the
        text the judge read, and a rewrite no launch made is dropped (it is made again from them).
        Returns what it replaced, for the caller to let go outside the launch (a finalizer of the
        candidate's would run where the last reference goes)."""
        released = [linecache.cache.get(self.file)]
        linecache.cache[self.file] = (sum(map(len, self.lines)), None, self.lines, self.file)
        if self.interpreted is None:
            return released
        cache = self.interpreted.rewritten_fn
        for fn in [f for f, r in cache.items() if self.is_candidates(f) and r not in self.rewrites]:
            released.append(cache.pop(fn))
        return released

    # ---- after a launch ---------------------------------------------------------------------------

    def seen(self, kernel: Any) -> None:
        """Note what Triton built for this kernel in the launch (compiled kernels, rewrites). Where
        it built anything, it built it under the compile settings it had before the candidate, or
        the launch fails."""
        now = _built(kernel)
        fresh = now != self.built.get(id(kernel), (None, ()))[1]
        self.built[id(kernel)] = (kernel, now)
        if self.interpreted is not None:
            rewrites = {r for f, r in self.interpreted.rewritten_fn.items() if self.is_candidates(f)}
            fresh |= not rewrites <= self.rewrites
            self.rewrites |= rewrites
        if fresh and (changed := self._settings_problem()):
            raise RuntimeError(f"{_name(kernel)} was built under other settings: {changed}")

    def _settings_problem(self) -> str | None:
        now = _compile_settings()
        was = self.settings
        changed = sorted(k for k in now.keys() | was.keys() if now.get(k, _GONE) != was.get(k, _GONE))
        return f"Triton's {', '.join(changed[:4])} changed since before the candidate" if changed else None

    # ---- checks -----------------------------------------------------------------------------------

    def _object_problem(self, kernel: Any, seen: set[int]) -> str | None:
        """The kernel object, and every kernel it reaches through its globals, as Triton made it."""
        if id(kernel) in seen:
            return None
        seen.add(id(kernel))
        name = _name(kernel)
        if type(kernel) not in self.kernel_types:
            return f"{name} is a {type(kernel).__name__}, not Triton's own kernel type"
        if not self.is_candidates(kernel.fn):
            # Triton's own helpers are the library's; any other file is text the judge never read
            tritons = _code_file(kernel.fn).startswith(self.triton_dir)
            return None if tritons else f"{name} is defined outside the candidate's file"
        shadowing = sorted(a for a in vars(kernel) if a in self.class_attrs[type(kernel)] and callable(vars(kernel)[a]))
        if shadowing:
            return f"{name} has attributes of its own in place of Triton's: {', '.join(shadowing)}"
        hooks = vars(kernel).get("pre_run_hooks", [])
        if type(hooks) is not list or list.__len__(hooks):
            return f"{name} has pre-run hooks"
        return (self._instance_problem(kernel) or self._naming_problem(kernel) or self._code_problem(kernel)
                or self._source_problem(kernel) or self._module_problem(kernel) or self._globals_problem(kernel, seen))

    @staticmethod
    def _instance_problem(kernel: Any) -> str | None:
        """The kernel's own settings as Triton's constructor made them: the flags its launch reads
        every time (`debug`, `noinline`) plain, and its compiled-kernel caches Triton's own (a cache
        whose entries another factory makes holds kernels built outside the launch, or a binder of
        the candidate's)."""
        own, name = vars(kernel), _name(kernel)
        flags = [a for a in ("debug", "noinline") if a in own and type(own[a]) not in (bool, type(None))]
        if flags:
            return f"{name}.{flags[0]} is a {type(own[flags[0]]).__name__}, not a flag"
        caches = own.get("device_caches")
        factory = getattr(caches, "default_factory", None)
        if caches is not None and (type(caches) is not collections.defaultdict or getattr(factory, "__self__", None)
                                   is not kernel or getattr(factory, "__func__", None)
                                   is not getattr(type(kernel), "create_binder", None)):
            return f"{name}'s compiled-kernel cache is not Triton's own"
        return None

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
        if _dump(node) != self.defs.get(_def_key(kernel)):
            return f"{_name(kernel)} would compile other text than the file's"
        self.sources[id(kernel)] = (kernel, src)
        return None

    def _code_problem(self, kernel: Any) -> str | None:
        """The function's code is what importing the judged text made of that def (not code put in
        its place, nor a first line moved to other text for the interpreter to find)."""
        code = kernel.fn.__code__
        if self.codes_checked.get(id(code)) is code:
            return None
        judged = self.code.get((code.co_name, code.co_firstlineno))
        if judged is None or _code_key(judged) != _code_key(code):
            return f"{_name(kernel)}'s code is not the judged text's"
        self.codes_checked[id(code)] = code
        return None

    def _module_problem(self, kernel: Any) -> str | None:
        """Its module as Python and Triton's interpreter will run the text in it: Python's own
        builtins, and none of the names the interpreter adds defined otherwise."""
        g = kernel.fn.__globals__
        if g.get("__builtins__", builtins) not in (builtins, builtins.__dict__):
            return f"{_name(kernel)}'s module has builtins of its own"
        if type(kernel) is self.interpreted:
            for k, v in self.injected.items():
                if k in g and g[k] is not v:
                    return f"{_name(kernel)}'s module defines {k}, a name Triton's interpreter adds"
        return None

    def _globals_problem(self, kernel: Any, seen: set[int]) -> str | None:
        """What its def's text reads from outside (body, defaults, annotations): constants,
        Triton's modules and types, or kernels of the same kind (checked in turn), whether it is
        the module's or held in a closure; attributes of modules only those they had before the
        candidate. Anything else runs Python of the candidate's inside the launch (a `__bool__`,
        an `__ne__`, a function added to a module) or is not what the text says."""
        fn, name = kernel.fn, _name(kernel)
        held = {n: c.cell_contents for n, c in zip(fn.__code__.co_freevars, fn.__closure__ or ()) if filled(c)}
        r = self.reads.get(_def_key(kernel))
        if r is None:
            return f"{name} is no def of the judged text"
        for n in r.names:
            for where in (held, fn.__globals__):
                if n not in where:
                    continue
                v = where[n]
                found = (self._object_problem(v, seen) if type(v) in self.kernel_types else
                         None if self._plain(v) else f"{name} reads {n}, a {type(v).__name__}")
                if found:
                    return found
        for chain in r.chains:
            if found := self._chain_problem(name, chain, held.get(chain[0], fn.__globals__.get(chain[0]))):
                return found
        return None

    def _chain_problem(self, name: str, chain: tuple[str, ...], v: Any) -> str | None:
        for attr in chain[1:]:
            if type(v) is not types.ModuleType:
                return None
            known, inner = self.module_values.get(v.__name__), getattr(v, attr, None)
            if known is not None and not _submodule(v, attr, inner):
                if attr not in known:
                    return f"{name} reads {v.__name__}.{attr}, which that module did not have"
                if known[attr] is not inner:
                    return f"{name} reads {v.__name__}.{attr}, which was replaced"
            v = inner
        return None

    def _plain(self, v: Any) -> bool:
        """A plain constant, one of Triton's dtypes (its own classes, exactly), a constexpr of either,
        Triton's or math's modules, or an object Triton's language modules held before the candidate."""
        if type(v) in _CONSTANTS or type(v) in self.dtypes:
            return True
        if type(v) is self.constexpr:
            return type(v.value) in _CONSTANTS or type(v.value) in self.dtypes
        if type(v) is types.ModuleType:
            return self.modules.get(v.__name__) is v
        held = self.module_values.get(getattr(v, "__module__", None) or "", {})
        return str(getattr(v, "__module__", "")).startswith("triton.language") and \
            held.get(getattr(v, "__name__", None)) is v

    def _hooks_problem(self) -> str | None:
        """Triton calls its hooks around a compile, a load and every launch: one that is not
        torch's or Triton's own is the candidate's Python inside the launch."""
        foreign = [h for h in _triton_hooks() if not _code_file(h).startswith(self.libraries)]
        return f"Triton's hooks hold the candidate's {getattr(foreign[0], '__name__', 'callable')}" if foreign else None

    def _built_problem(self, kernel: Any) -> str | None:
        """What earlier launches built for this kernel is as they left it (a compiled kernel's
        launcher or binder swapped afterwards runs the candidate's Python)."""
        before, now = self.built.get(id(kernel), (None, None))[1], _built(kernel)
        if before is None:
            return f"{_name(kernel)} was compiled outside a launch" if now else None
        return None if before == now else f"{_name(kernel)}'s compiled kernels were changed after its launch"

    def is_candidates(self, fn: Any) -> bool:
        """Whether a function's code comes from the candidate's file (once per code object: this
        runs inside every timed launch)."""
        code = getattr(fn, "__code__", None)
        if code is None:
            return False
        if code not in self.mine:
            self.mine[code] = os.path.realpath(code.co_filename) == self.file
        return self.mine[code]


def _first_line(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The line a def's code object starts at (its first decorator's)."""
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def _def_key(kernel: Any) -> tuple[str, int]:
    code = kernel.fn.__code__
    return code.co_name, code.co_firstlineno


def _triton_classes(base: type) -> list[type]:
    """`base` and its subclasses that Triton's own modules define (read before any candidate code)."""
    found, todo = [], [base]
    while todo:
        cls = todo.pop()
        if cls.__module__.split(".")[0] == "triton" and cls not in found:
            found.append(cls)
            todo += cls.__subclasses__()
    return found


def _python_slot(v: Any) -> bool:
    """A class attribute Python code stands behind (not one of the interpreter's own C slots)."""
    return v is not None and not isinstance(v, (types.WrapperDescriptorType, types.MethodDescriptorType,
                                                types.GetSetDescriptorType, types.MemberDescriptorType,
                                                types.BuiltinFunctionType))


# Triton's math libraries a kernel may call (`libdevice.erf`), which nothing imports before the
# candidate does
_MATH_LIBRARIES = ("triton.language.extra.libdevice", "triton.language.extra.cuda.libdevice",
                   "triton.language.extra.hip.libdevice")


def _submodule(module: types.ModuleType, name: str, value: Any) -> bool:
    """A submodule imported since (Triton's compile imports some of its own)."""
    full = f"{module.__name__}.{name}"
    return type(value) is types.ModuleType and value.__name__ == full and sys.modules.get(full) is value


def _parse(text: str) -> ast.AST:
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError):  # a text that does not parse defines no kernel
        return ast.Module(body=[], type_ignores=[])


def _judged_code(text: str, file: str) -> dict[tuple[str, int], types.CodeType]:
    """Every function's code in the compiled text, by (name, first line)."""
    try:
        todo = [compile(text, file, "exec", dont_inherit=True)]
    except (SyntaxError, ValueError):
        return {}
    out = {}
    while todo:
        code = todo.pop()
        out[(code.co_name, code.co_firstlineno)] = code
        todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return out


def _code_key(code: types.CodeType) -> tuple:
    """What a code object does, apart from where its file and lines are."""
    consts = tuple(_code_key(c) if isinstance(c, types.CodeType) else (type(c).__name__, repr(c))
                   for c in code.co_consts)
    return (code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars, consts)


def filled(cell) -> bool:
    """Whether a closure cell holds a value yet."""
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _dump(node: ast.AST) -> str:
    bare = ast.FunctionDef(node.name, node.args, node.body, [], node.returns, getattr(node, "type_comment", None),
                           **({"type_params": node.type_params} if hasattr(node, "type_params") else {}))
    return ast.dump(bare, include_attributes=False)


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


_HOOKS = ("launch_enter_hook", "launch_exit_hook", "kernel_load_start_hook", "kernel_load_end_hook",
          "jit_cache_hook", "jit_post_compile_hook")


def _triton_hooks() -> list:
    """Every hook Triton would call: its knobs' (a chain of hooks, or one) and, on older versions,
    the compiled kernel's class's."""
    owners = (getattr(sys.modules.get("triton.knobs"), "runtime", None),
              getattr(sys.modules.get("triton.compiler.compiler"), "CompiledKernel", None))
    out = []
    for owner in owners:
        for name in _HOOKS:
            hook = getattr(owner, name, None)
            chained = getattr(hook, "calls", None)
            out += list(chained) if isinstance(chained, list) else [hook] if callable(hook) else []
    return out


_COMPILER_ENV = ("TRITON_", "LLVM_", "MLIR_", "PTXAS", "NVPTX", "DISABLE_LLVM", "DISABLE_PTXAS")
_GONE = object()  # a setting no longer there


def _compile_settings() -> dict[str, Any]:
    """What decides how Triton compiles and where device code may come from (its knobs: the
    override and cache directories, `TRITON_KERNEL_OVERRIDE`, `TRITON_ALWAYS_COMPILE`, ptxas and
    its options, libdevice's path, fp32 and fp-fusion defaults, ...): each knob group's own values
    and the environment variables behind its knobs, and those its compilers read themselves (LLVM's
    pass plugins, MLIR's, ptxas found on `PATH`). Read without calling any knob (some run tools)."""
    knobs = sys.modules.get("triton.knobs")
    base = getattr(knobs, "base_knobs", None)
    if base is None:
        return {}
    out = {}
    for name, group in vars(knobs).items():
        if isinstance(group, base):  # the runtime's hooks are `_hooks_problem`'s
            out.update((f"{name}.{k}", repr(v)) for k, v in vars(group).items() if k not in _HOOKS)
            out.update((d.key, os.environ.get(d.key)) for d in group.knob_descriptors.values())
    out.update((k, v) for k, v in os.environ.items() if k.startswith(_COMPILER_ENV) or k == "PATH")
    return out


def _launch_options() -> frozenset[str]:
    """What this Triton's own `Config` passes beside the kernel's parameters (its warps, stages,
    ...; never `ir_override`), and `_SCHEDULING`."""
    import inspect

    import triton
    config = set(inspect.signature(triton.Config).parameters) - {"self", "kwargs", "pre_hook", "ir_override"}
    return frozenset(config) | _SCHEDULING


def _code_file(fn: Any) -> str:
    """The file a callable's Python code comes from ('' for none: a builtin, a partial)."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None) or getattr(getattr(type(fn), "__call__", None), "__code__", None)
    return os.path.realpath(code.co_filename) if code is not None else ""


def _package_dir(name: str) -> str:
    module = _module(name)
    return os.path.dirname(os.path.realpath(module.__file__)) + os.sep if module and module.__file__ else os.sep + "\0"


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
