"""Integrity checks used by the evaluator: static source scan, patch and global-state snapshots.

Everything here runs inside the evaluation child. A snapshot is taken before any candidate
code is imported; after each candidate call the evaluator compares the live state against
it. Identity (`is`) is compared, never equality, so a replacement with an equal-looking
wrapper is still caught.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import functools
import importlib
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from drkernel.tasks import UNPARSABLE
from drkernel.triton_source import dotted, package_aliases

# --------------------------------------------------------------------------------------
# Static scan of the candidate source
# --------------------------------------------------------------------------------------

# attribute / name / string tokens that only make sense for reaching outside the candidate
_REF_ATTRS = {
    "get_objects", "get_referrers", "get_referents", "_getframe", "currentframe",
    "getouterframes", "getinnerframes", "f_back", "f_globals", "f_locals", "f_builtins",
    "tb_frame", "gi_frame", "cr_frame", "ag_frame", "_current_frames", "stack", "trace",
    "walk_stack", "walk_tb", "getargvalues", "tb_next",
}
_REF_MODULES = {"ctypes", "gc", "_ctypes", "cffi", "importlib", "runpy", "pkgutil", "imp", "marshal", "drkernel",
                # what hands a callback the running frames (handlers, debuggers, profilers) or
                # rebuilds any object from data no scan reads (pickles)
                "signal", "_signal", "faulthandler", "bdb", "pdb", "trace", "profile", "cProfile", "_lsprof",
                "pickle", "_pickle", "copyreg", "shelve", "dill", "code", "codeop"}
# attributes that reach from an object into the interpreter's own machinery (other modules'
# globals, closures, every class): the routes to the runner's evidence and to its harness
_REACH_ATTRS = {"__globals__", "__closure__", "__subclasses__", "__code__", "cell_contents", "__bases__",
                "__mro__", "__base__", "__loader__", "__self__", "__func__", "__wrapped__", "__getattribute__",
                "getclosurevars", "getmodule", "getmembers", "getattr_static", "unwrap",
                "attrgetter", "methodcaller"}
# torch's private readers of which modes are on: how a call checked with the data-flow log (a
# dispatch mode) or profiled differs from a timed one
_MODE_READERS = {"_len_torch_dispatch_stack", "_get_dispatch_stack_at", "_get_current_dispatch_mode",
                 "_get_current_dispatch_mode_stack", "_get_dispatch_mode", "_is_torch_function_mode_enabled",
                 "_len_torch_function_stack", "_get_function_stack_at", "_is_profiler_enabled", "_profiler_enabled",
                 "_profiler_type", "_kineto_enabled", "_is_any_torch_function_mode_enabled"}
# torch's private switches that run ops past the evaluator's dispatch mode (the data-flow log,
# and the numerics flags read at every op) or past its function modes
_MODE_ESCAPES = {"_DisableTorchDispatch", "DisableTorchFunction", "DisableTorchFunctionSubclass", "_DisableFuncTorch",
                 "_ExcludeDispatchKeyGuard", "_IncludeDispatchKeyGuard", "_ForceDispatchKeyGuard",
                 "_PreserveDispatchKeyGuard", "_disable_current_modes", "_pop_mode", "_push_mode",
                 "_pop_torch_dispatch_stack", "_push_on_torch_dispatch_stack", "_set_dispatch_mode",
                 "_unset_dispatch_mode", "_DisablePythonDispatcher", "_EnablePythonDispatcher",
                 "_RestorePythonTLSSnapshot", "_AutoDispatchBelowAutograd", "_AutoDispatchBelowADInplaceOrView",
                 "_pop_torch_function_stack", "_push_on_torch_function_stack", "_EnableTorchFunction"}
_THREAD_MODULES = {"threading", "_thread", "concurrent", "multiprocessing", "asyncio", "subprocess"}
_PATCH_STRINGS = {"torch.library", "Library", "_dispatch", "impl_abstract", "register_kernel", "pre_run_hooks",
                  "add_pre_run_hook", "addaudithook",
                  "__torch_function__", "__torch_dispatch__", "settrace", "setprofile"}


def static_scan(source: str | ast.AST, reference_path: str | None = None) -> list[tuple[str, str]]:
    """Return (hack code, detail) findings for a candidate's source (a text, or its parsed tree),
    each once. Never raises on a text."""
    try:
        tree = source if isinstance(source, ast.AST) else ast.parse(source)
    except UNPARSABLE:  # the evaluator's own parse gives the verdict
        return []
    found: dict[tuple[str, str], None] = {}  # ordered and each once, in linear time
    defaults = {id(n.func) for n in ast.walk(tree) if _sets_default(n)} | _keys_held_at_default(tree)
    roots = package_aliases(tree, ("torch", "triton")) | {"tl"}  # the names torch and Triton go by
    # attributes set by a plain `a.b = value`: the value is known (numerics flags, cuDNN settings)
    plain = {id(t): n.value for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets}
    for node in ast.walk(tree):
        numerics = _numerics_findings(node) if id(node) not in defaults else []
        reach = _library_set(node, roots, plain)
        library = [("patched_function", f"{reach} (torch's or Triton's own objects changed or reached by a "
                                        "built name)")] if reach else []
        found.update(dict.fromkeys(numerics + library + _other_findings(node, reference_path)))
    return list(found)


def _other_findings(node: ast.AST, reference_path: str | None) -> list[tuple[str, str]]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return _import_findings(node)
    if isinstance(node, ast.Attribute):
        return _attribute_findings(node)
    if isinstance(node, ast.Name) and node.id in ("__builtins__", "__import__"):
        return [("reference_access" if node.id == "__import__" else "patched_function", node.id)]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _string_findings(node.value, reference_path)
    if isinstance(node, ast.Constant) and isinstance(node.value, bytes):  # data a loader turns into names
        words = re.findall(r"[A-Za-z_][A-Za-z0-9_.]*", node.value.decode("latin-1"))
        return [f for w in dict.fromkeys(words) for f in _string_findings(w, reference_path)]
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in ("__torch_function__", "__torch_dispatch__"):
        return [("patched_function", f"defines {node.name}")]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("exec", "eval", "compile"):
        return [("reference_access", f"calls {node.func.id}()")]
    if _dynamic_attribute(node):
        return [("reference_access", f"{node.func.id}() with an attribute name built at run time")]
    return []


def _import_findings(node: ast.Import | ast.ImportFrom) -> list[tuple[str, str]]:
    out = []
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    if isinstance(node, ast.ImportFrom):
        names += [f"{node.module}.{a.name}" for a in node.names]
    for n in names:
        root = n.split(".")[0]
        if root in _REF_MODULES:
            out.append(("reference_access", f"imports {n}"))
        if root in _THREAD_MODULES:
            out.append(("thread_spawned", f"imports {n}"))
        if n.startswith("torch.library") or n in ("torch.overrides", "torch.utils._python_dispatch"):
            out.append(("patched_function", f"imports {n}"))
    if isinstance(node, ast.ImportFrom):
        frames = (node.module or "").split(".")[0] in ("inspect", "traceback")
        out += [("reference_access", f"{node.module}.{a.name}") for a in node.names
                if a.name in _REACH_ATTRS or (frames and a.name in _REF_ATTRS)]
        out += [("patched_function", f"{node.module}.{a.name} (runs torch past the evaluator's dispatch mode)")
                for a in node.names if a.name in _MODE_ESCAPES]
    if isinstance(node, ast.ImportFrom) and node.module == "sys":
        for a in node.names:
            if a.name in ("modules", "_getframe", "_current_frames"):
                out.append(("reference_access", f"from sys import {a.name}"))
            elif a.name in ("settrace", "setprofile"):
                out.append(("global_state_changed", f"from sys import {a.name}"))
    return out


def _attribute_findings(node: ast.Attribute) -> list[tuple[str, str]]:
    d = dotted(node) or node.attr
    out = []
    if node.attr in _REACH_ATTRS or (node.attr in _REF_ATTRS and node.attr not in ("stack", "trace")):
        out.append(("reference_access", d))
    if (node.attr in ("stack", "trace") and d.startswith("inspect.")) or d in ("sys.modules", "sys._current_frames"):
        out.append(("reference_access", d))
    if node.attr in _MODE_READERS:
        out.append(("reference_access", f"{d} (reads the evaluator's own dispatch, function or profiler modes)"))
    if node.attr in _MODE_ESCAPES:
        out.append(("patched_function", f"{d} (runs torch past the evaluator's dispatch mode)"))
    if node.attr in ("add_pre_run_hook", "pre_run_hooks", "addaudithook", "PySys_AddAuditHook"):
        out.append(("patched_function", f"{d} (candidate Python inside Triton's launch)"))
    if d in ("sys.settrace", "sys.setprofile", "threading.settrace", "threading.setprofile"):
        out.append(("global_state_changed", d))
    if node.attr in ("fork", "_fork") and d.split(".")[-2:-1] == ["jit"]:  # a task on torch's own threads
        out.append(("thread_spawned", d))
    if d.startswith(("torch.library", "torch._C._dispatch", "torch.overrides", "torch.utils._python_dispatch",
                     "builtins.", "__builtins__")):
        out.append(("patched_function", d))
    return out


_ATEN_OP = re.compile(r"aten::[\w.]+")  # an operator's name (`aten::relu.out`), not prose that mentions one


def _string_findings(s: str, reference_path: str | None) -> list[tuple[str, str]]:
    """String constants that name what `getattr` or an import would reach."""
    out = []
    if (s in _REF_ATTRS - {"stack", "trace"} or s in ("modules", "ctypes", "gc", "importlib")
            or s in _REACH_ATTRS or "drkernel" in s):
        out.append(("reference_access", f"string {s!r}"))
    if s in _PATCH_STRINGS or s in _MODE_ESCAPES or _ATEN_OP.fullmatch(s.strip()):
        out.append(("patched_function", f"string {s!r}"))
    if reference_path and (os.path.basename(reference_path) in s or "ref_" in s and s.endswith(".py")):
        out.append(("reference_access", f"names the reference file ({s!r})"))
    return out


def _library_set(node: ast.AST, roots: set[str], plain: dict[int, ast.AST]) -> str | None:
    """`setattr`/`delattr` on torch or Triton, or one of their attributes bound or deleted in any
    way (`tl.dtype.__bool__ = f`, a tuple, `for` or `with` target), or a name read from them built
    at run time: what it reaches. A numerics flag or cuDNN setting set by a plain `a.b = value`
    (`plain`: target -> value) is judged by its value elsewhere."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2 and (
            node.func.id in ("setattr", "delattr") or (node.func.id == "getattr" and not isinstance(node.args[1], ast.Constant))):
        target = dotted(node.args[0])
        hint = (", a name not written out: write `F.gelu`, or keep a dict of functions"
                if node.func.id == "getattr" else "")
        return f"{node.func.id}({target}, ...){hint}" if target.split(".")[0] in roots else None
    if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del))
            and dotted(node).split(".")[0] in roots):
        return None
    value = plain.get(id(node))
    if value is not None and (_numerics_name(node.attr)  # `_numerics_findings` judges its value
                              or (dotted(node).endswith(_CUDNN_SETTINGS) and isinstance(value, ast.Constant))):
        return None
    return f"{'deletes' if isinstance(node.ctx, ast.Del) else 'sets'} {dotted(node)}"


# cuDNN settings written as constants: the state they leave is judged after import and after every
# call (`Snapshot.state_changes`), where only their strict direction passes
_CUDNN_SETTINGS = ("cudnn.benchmark", "cudnn.deterministic")


def _dynamic_attribute(node: ast.AST) -> bool:
    """`getattr(x, "a" + "b")` and the like: a name assembled where the call is, which no scan
    sees (a variable or its item passes: `for name in ("weight", "bias"): setattr(self, name, ...)`; on torch
    and Triton themselves only a constant does, `_library_set`)."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "delattr", "hasattr") and len(node.args) >= 2
            and not _held_name(node.args[1]) and not _plain_built_name(node.args[1]))


def _held_name(node: ast.AST) -> bool:
    """A constant, or a name held in a variable, an attribute or an item of one (`self.names[i]`)."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str" and len(node.args) == 1:
        node = node.args[0]  # `str(i)`: the text of what a variable holds
    return isinstance(node, (ast.Constant, ast.Name, ast.Attribute))


_FORMAT_FIELD = re.compile(r"%[-+ #0-9.]*[a-z]|\{[^{}]*\}")  # `%d`, `{}`, `{0}`: filled at run time


def _plain_built_name(node: ast.AST) -> bool:
    """`f"fc{i}"`, `f"conv{i}_{j}"`, `"weight_ih_l%d" % i`, `name + "_wt"`, `"fc{}".format(i)`: text
    parts of plain identifier characters, beginning no private or dunder name, that rule out every
    frame-reaching name (as open as a name held in a variable, which passes)."""
    parts = _text_parts(node)
    if parts is None or not all(isinstance(p, str) and _FORMAT_FIELD.sub("", p).replace("_", "a").isalnum()
                                for p in parts):
        return False
    lead = _leading_text(node)
    pieces = [f for p in parts for f in _FORMAT_FIELD.split(p) if f]
    return not lead.startswith("_") and all(
        (lead and not a.startswith(lead)) or any(f not in a for f in pieces) for a in _REF_ATTRS | _REACH_ATTRS)


def _leading_text(node: ast.AST) -> str:
    """The literal text a built name begins with, up to its first field ("" where a field comes first)."""
    if isinstance(node, ast.JoinedStr):
        first = node.values[0] if node.values else None
        return first.value if isinstance(first, ast.Constant) else ""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = node.left
        return left.value if isinstance(left, ast.Constant) else _leading_text(left)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant):
        return _FORMAT_FIELD.split(node.left.value, 1)[0]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Constant):
        return _FORMAT_FIELD.split(node.func.value.value, 1)[0]  # "...".format(...)
    return ""


def _text_parts(node: ast.AST) -> list | None:
    """The literal parts of a name built by an f-string, `%`, `+` or `.format` (None for any other
    expression, and where a literal string fills a field; a part that is no literal adds none)."""
    if isinstance(node, ast.JoinedStr):
        fields = [v.value for v in node.values if isinstance(v, ast.FormattedValue)]
        return None if _holds_text(fields) else [v.value for v in node.values if isinstance(v, ast.Constant)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant):
        return None if _holds_text([node.right]) else [node.left.value]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        sides = [[n.value] if isinstance(n, ast.Constant) else _text_parts(n)
                 if isinstance(n, (ast.BinOp, ast.JoinedStr)) else [] for n in (node.left, node.right)]
        return None if None in sides else sides[0] + sides[1]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format"
            and isinstance(node.func.value, ast.Constant)):
        return None if _holds_text([*node.args, *(k.value for k in node.keywords)]) else [node.func.value.value]
    return None


def _holds_text(nodes: list[ast.AST]) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) for node in nodes for n in ast.walk(node))


# --------------------------------------------------------------------------------------
# Runtime snapshots
# --------------------------------------------------------------------------------------

def _watched_namespaces() -> list[tuple[str, Any, bool]]:
    """(label, object, strict) triples; strict = new attributes are also a finding."""
    import torch
    import torch.nn.functional as F

    out: list[tuple[str, Any, bool]] = []
    mods = [("torch", torch), ("torch.nn.functional", F), ("torch.nn", torch.nn), ("time", time),
            ("builtins", builtins), ("torch.cuda", torch.cuda), ("torch.testing", torch.testing),
            ("torch.linalg", torch.linalg), ("torch.fft", torch.fft), ("torch.special", torch.special),
            ("torch.nn.init", torch.nn.init), ("sys", sys), ("threading", threading)]
    try:
        import math
        mods.append(("math", math))
    except Exception:  # pragma: no cover
        pass
    import inspect
    import linecache
    mods += [("inspect", inspect), ("linecache", linecache)]  # where Triton reads a kernel's text
    try:
        import triton
        import triton.runtime.interpreter
        import triton.runtime.jit
        import triton.testing
        mods += [("triton.testing", triton.testing), ("triton", triton), ("triton.runtime.jit", triton.runtime.jit),
                 ("triton.runtime.interpreter", triton.runtime.interpreter)]  # what a launch calls
        # (not triton.language.core: the interpreter leaves its own functions there after some launches)
        with contextlib.suppress(ImportError):
            mods.append(("triton._C.libtriton.interpreter", importlib.import_module("triton._C.libtriton.interpreter")))
    except Exception:
        pass
    with contextlib.suppress(ImportError):
        import numpy
        mods.append(("numpy", numpy))  # Triton's interpreter runs a kernel with numpy's functions
    for label, m in mods:
        out.append((label, m, False))
    classes = [("torch.Tensor", torch.Tensor), ("torch.nn.Module", torch.nn.Module)]
    base = getattr(torch._C, "TensorBase", None) or getattr(torch._C, "_TensorBase", None)
    if base is not None:
        classes.append(("torch._C.TensorBase", base))
    for name in ("Event", "Stream"):
        c = getattr(torch.cuda, name, None)
        if isinstance(c, type):
            classes.append((f"torch.cuda.{name}", c))
    for name, obj in vars(torch.nn).items():
        if isinstance(obj, type) and issubclass(obj, torch.nn.Module) and obj is not torch.nn.Module:
            classes.append((f"torch.nn.{name}", obj))
    try:
        import triton.runtime.jit as tjit
        for name in ("JITFunction", "KernelInterface", "TensorWrapper"):
            if hasattr(tjit, name):
                classes.append((f"triton.runtime.jit.{name}", getattr(tjit, name)))
    except Exception:
        pass
    with contextlib.suppress(ImportError):
        import triton.runtime.interpreter as tint
        classes += [(f"{tint.__name__}.{name}", c) for name, c in vars(tint).items()
                    if isinstance(c, type) and c.__module__ == tint.__name__]  # the classes a launch runs there
    try:
        from triton.runtime.autotuner import Autotuner
        classes.append(("triton.runtime.autotuner.Autotuner", Autotuner))
    except Exception:
        pass
    classes += _triton_language_classes()
    for label, c in classes:
        out.append((label, c, True))
    return out


def _triton_language_classes() -> list[tuple[str, type]]:
    """The classes of Triton's language (tensor, constexpr, the dtypes, ...): a method set on one
    (`tl.dtype.__bool__`) runs the candidate's Python wherever Triton handles a kernel's values.
    Triton's interpreter patches a few of `tensor`'s during a launch and puts them back after it."""
    try:
        import triton.language.core as core
    except Exception:  # pragma: no cover
        return []
    return [(f"triton.language.core.{name}", obj) for name, obj in vars(core).items()
            if isinstance(obj, type) and obj.__module__ == core.__name__]


_MODULE_NAMES = ("torch", "torch.nn", "torch.nn.functional", "time", "builtins", "triton",
                 "triton.language", "triton.testing", "numpy", "torch.cuda")
_IGNORED_KEYS = {"__dict__", "__weakref__", "__doc__", "_abc_impl", "__annotations__", "__slotnames__",
                 "__parameters__", "__orig_bases__"}
_VOLATILE = {"sys": {"last_type", "last_value", "last_traceback", "last_exc", "stdout", "stderr",
                     "stdin", "ps1", "ps2", "exc_info", "_git", "path_importer_cache", "meta_path",
                     "path", "path_hooks", "modules", "flags", "argv"},
             "threading": {"_active", "_limbo", "_dangling", "_shutdown_locks", "_counter"},
             # Triton's interpreter sets these on its tensor class for each launch, then puts back
             # what it read (an inherited one becomes the class's own)
             "triton.language.core.tensor": {"__index__", "__bool__", "__repr__", "__str__", "T"}}


def own_attribute(owner: Any, attr: str) -> Any:
    """`owner`'s own entry for `attr`, as stored (a classmethod stays one object; `getattr` would
    make a new bound method each time)."""
    d = getattr(owner, "__dict__", None)
    return d.get(attr) if isinstance(d, Mapping) else getattr(owner, attr, None)


def _vars(obj: Any) -> dict:
    try:
        return dict(vars(obj))
    except TypeError:
        return {}


class IntegritySnapshot:
    """Identities of everything the evaluator and reference rely on, plus global flags."""

    def __init__(self, extra: dict[str, tuple[Any, str]] | None = None):
        self.namespaces: list[tuple[str, Any, bool, dict]] = []
        for label, obj, strict in _watched_namespaces():
            self.namespaces.append((label, obj, strict, _vars(obj)))
        self.modules = {n: sys.modules.get(n) for n in _MODULE_NAMES}
        self.builtins_obj = builtins.__dict__
        self.extra = dict(extra or {})  # name -> (owner, attr): e.g. our launch hook
        self.extra_ids = {k: own_attribute(o, a) for k, (o, a) in self.extra.items()}
        self.state = global_state()
        self.hooks = _global_hook_counts()

    def patched(self) -> list[str]:
        found: list[str] = []
        for label, obj, strict, saved in self.namespaces:
            now = _vars(obj)
            skip = _VOLATILE.get(label, set())
            for k, v in saved.items():
                if k in _IGNORED_KEYS or k in skip:
                    continue
                if not strict and isinstance(v, (int, float, str, bytes, bool, type(None))):
                    continue  # module-level scalars (counters, init flags) change legitimately
                if k not in now:
                    found.append(f"{label}.{k} deleted")
                elif now[k] is not v:
                    found.append(f"{label}.{k} replaced")
            if strict:
                for k in now:
                    if k not in saved and k not in _IGNORED_KEYS and k not in skip:
                        found.append(f"{label}.{k} added")
        for n, m in self.modules.items():
            if sys.modules.get(n) is not m:
                found.append(f"sys.modules[{n!r}] replaced")
        for k, (o, a) in self.extra.items():
            if own_attribute(o, a) is not self.extra_ids[k]:
                found.append(f"{k} replaced")
        hooks = _global_hook_counts()
        for k, v in hooks.items():
            if v != self.hooks.get(k):
                found.append(f"global nn.Module {k} registered")
        return found

    def state_changes(self) -> list[str]:
        now = global_state()
        return [f"{k}: {self.state.get(k)!r} -> {v!r}" for k, v in now.items()
                if _loosened(k, self.state.get(k), v)]


def _global_hook_counts() -> dict[str, int]:
    try:
        import torch.nn.modules.module as mm
    except Exception:
        return {}
    out = {}
    for name in dir(mm):
        if name.startswith("_global_") and name.endswith("hooks"):
            try:
                out[name] = len(getattr(mm, name))
            except TypeError:
                pass
    return out


def _dispatch_modes() -> int:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    return len(_get_current_dispatch_mode_stack())


# Flags that trade precision for speed (TF32, reduced-precision reductions, fp16 accumulation) or
# let cuDNN pick faster algorithms: the reference is timed with each at its default, so a candidate
# may not turn one on, not even inside a call (`NumericsWatch`), and its source may not set one
# name -> torch's own getter of the flag (and its arguments): read straight from torch._C, a few
# microseconds for them all, since a checked call reads them before every op
_NUMERICS = {
    "cuda.matmul.allow_tf32": ("_get_cublas_allow_tf32",),
    "cuda.matmul.fp16_reduced": ("_get_cublas_allow_fp16_reduced_precision_reduction",),
    "cuda.matmul.bf16_reduced": ("_get_cublas_allow_bf16_reduced_precision_reduction",),
    "cuda.matmul.fp16_accumulation": ("_get_cublas_allow_fp16_accumulation",),
    "cudnn.allow_tf32": ("_get_cudnn_allow_tf32",),
    "cudnn.benchmark": ("_get_cudnn_benchmark",),
    "float32_matmul_precision": ("_get_float32_matmul_precision",),
    # torch.backends[...].fp32_precision: "tf32" or "bf16" for a backend's float32 work
    **{f"fp32_precision {b}.{op}": ("_get_fp32_precision_getter", b, op) for b, op in (
        ("generic", "all"), ("cuda", "matmul"), ("cuda", "all"), ("cuda", "conv"), ("cuda", "rnn"),
        ("mkldnn", "all"), ("mkldnn", "matmul"), ("mkldnn", "conv"), ("mkldnn", "rnn"))},
}
_NUMERICS_FLAGS = {"allow_tf32", "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction",
                   "allow_fp16_accumulation", "fp32_precision", "set_float32_matmul_precision", "set_flush_denormal"}
_NUMERICS_SETTER_WORDS = ("tf32", "precision", "reduced", "accumulation", "denormal", "cublas", "cudnn",
                          "onednn", "mkldnn")


def _numerics_name(name: str) -> bool:
    """A flag of `_NUMERICS_FLAGS` or one of torch's private setters of such flags (`_set_cublas_...`)."""
    return name in _NUMERICS_FLAGS or (name.startswith("_set_") and any(w in name for w in _NUMERICS_SETTER_WORDS))


def _numerics_findings(node: ast.AST) -> list[tuple[str, str]]:
    """A numerics flag set by the source: assigned (except to its default), a setter named, or a
    flag's name as a string (for `setattr`). Reading a flag, and `tl.dot(..., allow_tf32=False)`, pass."""
    if isinstance(node, ast.Assign):
        default = isinstance(node.value, ast.Constant) and node.value.value in _DEFAULTS
        return [("global_state_changed", f"sets {dotted(t) or t.attr} (a numerics flag the reference is timed without)")
                for t in node.targets if isinstance(t, ast.Attribute) and _numerics_name(t.attr) and not default
                and not _own_field(t)]
    if isinstance(node, ast.Attribute) and node.attr.startswith(("set_", "_set_")) and _numerics_name(node.attr):
        return [("global_state_changed", f"{dotted(node) or node.attr} (sets a numerics flag)")]
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and _numerics_name(node.value):
        return [("global_state_changed", f"string {node.value!r} (names a numerics flag)")]
    if isinstance(node, ast.ImportFrom):
        return [("global_state_changed", f"imports {a.name} (sets a numerics flag)")
                for a in node.names if a.name.startswith(("set_", "_set_")) and _numerics_name(a.name)]
    return []


_DEFAULTS = (False, "highest", "ieee")


def _keys_held_at_default(tree: ast.AST) -> set[int]:
    """Dict keys naming a numerics flag whose value is that flag's default (`{"allow_tf32": False}`,
    options handed to a kernel's own parameter): a flag set from them is still the default."""
    return {id(k) for n in ast.walk(tree) if isinstance(n, ast.Dict) for k, v in zip(n.keys, n.values)
            if k is not None and isinstance(v, ast.Constant) and v.value in _DEFAULTS}


def _own_field(target: ast.Attribute) -> bool:
    """`self.allow_tf32 = ...`: a module's own setting (passed to `tl.dot`, say), no torch flag; a
    torch flag reached through `self` anyway is read at run time (`NumericsWatch`)."""
    return isinstance(target.value, ast.Name) and target.value.id == "self"


def _sets_default(node: ast.AST) -> bool:
    """A numerics setter called with its default (`torch.set_float32_matmul_precision("highest")`)."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _numerics_name(node.func.attr)
            and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], ast.Constant)
            and node.args[0].value in _DEFAULTS)


def python_hooks() -> tuple:
    """What makes the interpreter call Python on its own between any two lines: the trace and
    profile functions, `sys.monitoring`'s tools (Python 3.12 on) and the signal handlers (a timer's
    runs wherever its signal lands)."""
    monitoring = getattr(sys, "monitoring", None)
    tools = tuple(monitoring.get_tool(i) for i in range(6)) if monitoring is not None else ()
    return sys.gettrace(), sys.getprofile(), tools, tuple(map(signal.getsignal, signal.valid_signals()))


class AuditHookGate:
    """The runner's own audit hook, added before any candidate code: every later hook (Python's
    `sys.addaudithook` or C's) is refused and counted. A hook of the candidate's would run inside
    any audited step of the runner (a Triton launch reads a function's `__defaults__`), where torch
    calls escape the data-flow log and their writes count as the launch's."""

    def __init__(self):
        self.refused = 0
        sys.addaudithook(self)

    def __call__(self, event: str, args: tuple) -> None:
        if event == "sys.addaudithook":
            self.refused += 1
            raise RuntimeError("audit hooks are the evaluator's")  # the new hook is then not added


class NumericsWatch:
    """The numerics flags (`_NUMERICS`) as they were before the candidate ran; `changed()` names
    those that differ now. Cheap enough to ask at every torch op of a checked call, where a flag
    turned on around one op and off again before the call returns is still on."""

    def __init__(self):
        self.readers = list(_numerics_readers().items())
        self.baseline = [_read(reader) for _, reader in self.readers]

    def changed(self) -> list[str]:
        now = [_read(reader) for _, reader in self.readers]
        return [f"{name}: {b} -> {v}" for (name, _), b, v in zip(self.readers, self.baseline, now)
                if _loosened(name, b, v)]


# flags a candidate may turn one way, and the values that way: deterministic algorithms, and no
# reduced-precision reductions in cuBLAS (torch reads those as (allowed, split-K allowed)), can
# only cost it time
_STRICTER = {"cudnn.deterministic": {True}, "deterministic_algorithms": {True},
             **{f"cuda.matmul.{kind}_reduced": {False, (False, True), (False, False)} for kind in ("fp16", "bf16")}}


def _loosened(name: str, before: Any, now: Any) -> bool:
    """A flag moved, other than to a stricter value (`_STRICTER`)."""
    return now != before and now not in _STRICTER.get(name, ())


def _flag_readers() -> dict[str, Any]:
    """Name -> a function that reads one flag that changes numerics or what the evaluator observes."""
    import torch
    readers = {
        "cudnn.enabled": lambda: torch.backends.cudnn.enabled,
        "cudnn.deterministic": lambda: torch.backends.cudnn.deterministic,
        "default_dtype": lambda: str(torch.get_default_dtype()),
        "default_device": lambda: str(torch.get_default_device()),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled,
        "grad_enabled": torch.is_grad_enabled,
        "inference_mode": torch.is_inference_mode_enabled,
        "num_threads": torch.get_num_threads,
        "torch_function_mode_stack": lambda: len(torch.overrides._get_current_function_mode_stack()),
        "dispatch_mode_stack": _dispatch_modes,
        "sys.gettrace": lambda: repr(sys.gettrace()),
        "sys.getprofile": lambda: repr(sys.getprofile()),
        "threading.trace_hook": lambda: repr(getattr(threading, "_trace_hook", None)),
        "threading.profile_hook": lambda: repr(getattr(threading, "_profile_hook", None)),
        "anomaly": torch.is_anomaly_enabled,
        "flush_denormal": _flushes_denormals,
        **_numerics_readers(),
    }
    return readers


def _numerics_readers() -> dict[str, Any]:
    """`_NUMERICS` as functions, those this torch has."""
    import torch
    getters = {name: (getattr(torch._C, getter, None), args) for name, (getter, *args) in _NUMERICS.items()}
    return {name: functools.partial(get, *args) for name, (get, args) in getters.items() if get is not None}


def _flushes_denormals() -> bool:
    """Whether the CPU flushes denormals to zero (`torch.set_flush_denormal`, which has no getter)."""
    import torch
    return float(torch.tensor(1e-38, dtype=torch.float32) * 0.5) == 0.0


def _read(reader) -> Any:
    try:
        return reader()
    except Exception:
        return "<unavailable>"


def global_state() -> dict[str, Any]:
    """Flags that change numerics or what the evaluator observes."""
    return {name: _read(reader) for name, reader in _flag_readers().items()}


def python_threads() -> set[int]:
    """Every thread that runs Python code, including those started with `_thread` (which
    `threading.enumerate` does not list)."""
    return set(sys._current_frames())
