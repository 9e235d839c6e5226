"""The candidate's Triton kernels as its source text declares them, read without running anything.

The judge trusts no name the runner reports: a kernel counts as the candidate's own only if a
function of that name is decorated with `jit` (`@triton.jit`, possibly under `@triton.autotune`
or `@triton.heuristics`, or wrapped as `k = triton.jit(f)`) in the source the judge was given.
For each such kernel the parameters it may write through are found from its body: the pointer
operand of every `store` / `atomic_*` call (and of a descriptor's `.store`), followed back through
local assignments to the parameters; a parameter handed to another (helper) function may be
written too. The parameters it may read through are found the same way (`load`, `atomic_*`).
Every name a pointer expression mentions counts, so that the data flow built on it
(`drkernel.dataflow`) never misses a kernel's write.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses

from drkernel.tasks import UNPARSABLE


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    params: tuple[str, ...]
    stores: frozenset[str]  # parameters the kernel may write through
    loads: frozenset[str] = frozenset()  # parameters the kernel may read through


def jit_kernels(source: str | ast.AST) -> dict[str, Kernel]:
    """Every `jit` kernel of `source` (a text, or its parsed tree) by name; empty for text that
    does not parse."""
    try:
        tree = source if isinstance(source, ast.AST) else ast.parse(source)
    except UNPARSABLE:
        return {}
    defs: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
    for n in ast.walk(tree):  # a method named like a kernel does not hide the kernel
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                n.name not in defs or _jit_decorated(n) or not _jit_decorated(defs[n.name])):
            defs[n.name] = n
    names = {n.name: n.name for n in defs.values() if _jit_decorated(n)}
    wrapped = (_wrapped(a) for a in ast.walk(tree) if isinstance(a, ast.Call) and _is_jit(a.func))
    names |= {w.id: w.id for w in wrapped if isinstance(w, ast.Name) and w.id in defs}
    names |= _bound_to_jit(tree, defs)
    tl_names = package_aliases(tree, ("triton",)) | {"tl"}
    return {n: _kernel(defs[names[n]], tl_names) for n in sorted(names)}


def _bound_to_jit(tree: ast.AST, defs: dict) -> dict[str, str]:
    """`relu = triton.jit(_relu)`: the name bound -> the def's name."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _is_jit(node.value.func):
            fn = _wrapped(node.value)
            if isinstance(fn, ast.Name) and fn.id in defs:
                out |= {t.id: fn.id for t in node.targets if isinstance(t, ast.Name)}
    return out


def _jit_decorated(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(_is_jit(d) for d in fn.decorator_list)


def _wrapped(call: ast.Call) -> ast.AST | None:
    """The function a `jit(f)` or `jit(fn=f)` call wraps."""
    return call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "fn"), None)


def python_calls(source: str, tree: ast.AST | None = None) -> list[str]:
    """What inside `jit` kernels would run the file's own Python or show on the device as other
    code: calls to a plain function or a module-level object (not a kernel, not decorated from
    Triton) or torch, and reads of a module-level object that is not a constant (its `__bool__`
    or `__ne__` would run); a kernel named like a library's kernel, or renamed on the device
    (`repr=`). A GPU compile refuses the Python; Triton's interpreter runs it, unseen by the
    data-flow log, which is paused inside a launch. `tree`: the text's parsed tree, where the
    caller has it."""
    try:
        tree = tree or ast.parse(source)
    except UNPARSABLE:
        return []
    kernels = set(jit_kernels(tree))
    tl_names = package_aliases(tree, ("triton",)) | {"tl"}
    body = tree.body if isinstance(tree, ast.Module) else []
    bindings = module_bindings(tree)
    python = {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
              and n.name not in kernels and not _triton_decorated(n, tl_names)}
    imports = _triton_imports(tree)
    pure = {name for name, values in bindings.items() if all(isinstance(v, ast.alias) and id(v) in imports for v in values)}
    python |= {name for name, values in bindings.items() if any(not isinstance(v, ast.alias) for v in values)
               and not all(_triton_binding(v, tl_names, imports, pure) for v in values)}
    python = (python - kernels - {"*"}) | {"torch"}
    constants = _constants(tree, bindings, tl_names)
    every_def = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    module_scope = {id(n) for n in _module_scope(tree)}
    defs = [n for n in every_def if n.name in kernels and (id(n) in module_scope or _jit_decorated(n))]
    lines = source.splitlines()
    found: dict[str, None] = dict.fromkeys(_naming_findings(tree))
    jitted = kernels | {n.name for n in every_def if _jit_decorated(n)}
    # defs that can stand for a kernel's name: the module's own and jitted ones (not a method)
    names = [n.name for n in every_def if id(n) in module_scope or _jit_decorated(n)]
    # which def a kernel's name stands for would be the reader's guess, unless it is plainly the last
    found.update(dict.fromkeys(f"{k} is defined more than once (give each kernel its own name)" for k in sorted(jitted)
                               if names.count(k) > 1 and not _drafts_before_use(tree, k)))
    module_names = python | kernels | tl_names | {a.asname or a.name.split(".")[0] for n in body
                                                   if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    for fn in defs:
        outside, read = python - _names_bound(fn), reads(fn).names
        found.update(dict.fromkeys(_call_findings(fn, outside)))
        found.update(dict.fromkeys(f"{fn.name} reads {n}, a module-level object that is no constant"
                                   for n in read & outside - constants))
        found.update(dict.fromkeys(f"{fn.name} uses the builtin {n}" for n in sorted(read - module_names)
                                   if hasattr(builtins, n) and n not in KERNEL_BUILTINS))
        if any(line.lstrip().startswith("def ") for line in lines[fn.lineno:fn.end_lineno]):
            # Triton's interpreter finds a kernel's def by its text: it would run the last one
            found[f"{fn.name} holds another line starting with 'def '"] = None
    return list(found)


def _drafts_before_use(tree: ast.AST, name: str) -> bool:
    """Every def of `name` is a statement of the module's body, and the module's own code reads the
    name only after the last of them (an earlier draft left above the final kernel): the name can
    then only stand for the last def, which is the one judged."""
    body = tree.body if isinstance(tree, ast.Module) else []
    every = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
    if not all(n in body for n in every):
        return False
    last = max(n.lineno for n in every)
    reads = (n for n in _module_scope(tree) if isinstance(n, ast.Name) and n.id == name)
    return all(n.lineno > last for n in reads)


def _triton_attribute(v: ast.AST | None, tl_names: set[str]) -> bool:
    """`_sigmoid = tl.sigmoid`: a name for one of Triton's own (what it holds at a launch is checked
    there, `launch_guard`)."""
    return isinstance(v, ast.Attribute) and isinstance(v.ctx, ast.Load) and dotted(v).split(".")[0] in tl_names


def _triton_binding(v: ast.AST | None, tl_names: set[str], imports: set[int], pure: set[str]) -> bool:
    """One binding of a name gives it one of Triton's own: an attribute of Triton's, an import from
    Triton (`imports`: their alias nodes), another name for a module only ever bound by such an
    import (`pure`: `tmath = tl`, `tl` from `import triton.language as tl` alone), or a `hasattr`
    version check between such (`import triton.language.math as tmath` in a `try`, `tmath = tl` in
    its `except`)."""
    if isinstance(v, ast.alias):
        return id(v) in imports
    if isinstance(v, ast.IfExp):  # a version check: `tl.math.erf if hasattr(tl, "math") else tl.erf`
        return (isinstance(v.test, ast.Call) and dotted(v.test.func) == "hasattr"
                and all(_triton_binding(x, tl_names, imports, pure) for x in (v.body, v.orelse)))
    return (isinstance(v, ast.Name) and v.id in pure) or _triton_attribute(v, tl_names)


def _triton_imports(tree: ast.AST) -> set[int]:
    """The alias nodes of the imports from Triton (`import triton.language as tl`, `from
    triton.language import math`)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {id(a) for a in node.names if a.name.split(".")[0] == "triton"}
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "triton":
            out |= {id(a) for a in node.names}
    return out


def _call_findings(fn: ast.FunctionDef | ast.AsyncFunctionDef, outside: set[str]) -> list[str]:
    """The calls of `fn` that reach names of `outside`: by name (`f()`, `torch.relu()`) or through
    any other expression that holds one (`[f][0]()`, `(f or g)()`); a method of a value made in
    the kernel (`(a * b).to(...)`) is fine."""
    out = []
    for call in (c for part in _launched_parts(fn) for c in ast.walk(part) if isinstance(c, ast.Call)):
        name = dotted(call.func)
        if name:
            if name.split(".")[0] in outside:
                out.append(f"{fn.name} calls {name}")
            continue
        root = call.func.value if isinstance(call.func, ast.Attribute) else call.func
        held = any(isinstance(n, ast.Name) and n.id in outside for n in ast.walk(root))
        if held or not isinstance(call.func, ast.Attribute):
            out.append(f"{fn.name} calls {ast.unparse(call.func)[:60]}")
    return out


def _naming_findings(tree: ast.AST) -> list[str]:
    """`jit` calls that rename a kernel on the device. (A kernel named like a library's needs no
    rule here: where the device runs that name more often than the candidate launched it, the
    share is not believed, `judge._launches_ran`.)"""
    calls = (c for c in ast.walk(tree) if isinstance(c, ast.Call) and _is_jit(c.func))
    return [f"a jit call renames its kernel on the device: {ast.unparse(c)[:60]}" for c in calls
            if any(k.arg == "repr" for k in c.keywords)]


@dataclasses.dataclass(frozen=True)
class _Scope:
    """What a module-level constant expression may use: Triton's module names, the names found
    constant so far, and `math` and the numeric builtins where the module does not rebind them."""
    tl_names: frozenset[str]
    known: frozenset[str] = frozenset()
    numeric_modules: frozenset[str] = frozenset()  # names of `math` or numpy, bound by their import only
    numeric: frozenset[str] = frozenset()
    imported: frozenset[str] = frozenset()  # bound by `from math import ...` (or numpy) only: `sqrt`, `pi`
    torch_names: frozenset[str] = frozenset()  # bound by `import torch` only (`torch.finfo(...).min`)


def _constants(tree: ast.AST, bindings: dict[str, list[ast.AST | None]], tl_names: set[str]) -> set[str]:
    """Module-level names every binding of which is a constant expression (`_constant`), in turn
    over names found constant before (`LOG2E = 1.44`, then `C = tl.constexpr(2 * LOG2E)`)."""
    values = {name: vs for name, vs in bindings.items() if not any(isinstance(v, ast.alias) for v in vs)}
    anything = "*" in bindings  # a star import may bind any name
    scope = _Scope(frozenset(tl_names), numeric_modules=frozenset() if anything else _numeric_modules(bindings),
                   numeric=frozenset() if anything else _NUMERIC_BUILTINS - bindings.keys(),
                   imported=frozenset() if anything else frozenset(_from_numeric_modules(tree, bindings)),
                   torch_names=frozenset() if anything else frozenset(
                       name for name, vs in bindings.items() if _imported_only(vs, "torch")))
    while True:
        known = frozenset(name for name, vs in values.items() if all(_constant(v, scope) for v in vs))
        if known == scope.known:
            return set(known)
        scope = dataclasses.replace(scope, known=known)


def module_bindings(tree: ast.AST) -> dict[str, list[ast.AST | None]]:
    """Every name the module's own scope binds, with what: the value of a plain `name = value`
    (at any depth of `if`/`for`/`with`/`try` blocks), the alias of an import, the target of an
    attribute set on it (`torch.x = ...`), None for any other way (a loop or `with` target, `:=`,
    `+=`, a def or class, `global` in a function, `del`); "*" for a star import."""
    out: dict[str, list[ast.AST | None]] = {}
    for node in _module_scope(tree):
        for name, value in _bound_by(node):
            out.setdefault(name, []).append(value)
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):  # a function that rebinds a module name when it runs
            for name in node.names:
                out.setdefault(name, []).append(None)
    return out


def _module_scope(tree: ast.AST) -> list[ast.AST]:
    """The nodes run in the module's own scope: not inside a def, class or lambda body."""
    out, todo = [], list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo += [*node.decorator_list, *getattr(node, "bases", []), *(k.value for k in getattr(node, "keywords", []))]
            if not isinstance(node, ast.ClassDef):
                todo += [d for d in (*node.args.defaults, *node.args.kw_defaults) if d is not None]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):  # its targets are its own binding (`_bound_by`)
            todo += [v for v in (node.value, getattr(node, "annotation", None)) if v is not None]
        elif not isinstance(node, ast.Lambda):
            todo += list(ast.iter_child_nodes(node))
    return out


def _bound_by(node: ast.AST) -> list[tuple[str, ast.AST | None]]:
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return [pair for t in targets for pair in _assigned(t, node.value)]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [("*" if a.name == "*" else a.asname or a.name.split(".")[0], a) for a in node.names]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [(node.name, None)]
    if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
        return [(node.id, None)]  # loop, with, augmented, walrus, comprehension and del targets
    if isinstance(node, ast.MatchAs | ast.MatchStar) and node.name:
        return [(node.name, None)]
    return []


def _assigned(target: ast.AST, value: ast.AST | None) -> list[tuple[str, ast.AST | None]]:
    """(name, value) for each name `target = value` binds: a tuple of names unpacking a tuple of as
    many values pairs them (`BM, BN = 64, 32`); an attribute set (`math.pi = ...`) binds its root to
    the target (no constant, but still the module its import named); any other unpacking or an
    item set: the names it holds are no constants."""
    if isinstance(target, ast.Name):
        return [(target.id, value)]
    elts = getattr(target, "elts", None)
    if (elts is not None and isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(elts)
            and not any(isinstance(e, ast.Starred) for e in (*elts, *value.elts))):
        return [pair for t, v in zip(elts, value.elts) for pair in _assigned(t, v)]
    return [(n, target if isinstance(target, ast.Attribute) else None) for n in _names(target)]


def _numeric_modules(bindings: dict[str, list[ast.AST | None]]) -> frozenset[str]:
    """Names bound only by `import math` or `import numpy [as np]`: their functions and constants
    give numbers."""
    return frozenset(name for name, values in bindings.items()
                     if _only_imports(values, "numpy") or _only_imports(values, "math"))


def _from_numeric_modules(tree: ast.AST, bindings: dict[str, list[ast.AST | None]]) -> set[str]:
    """Names bound only by `from math import ...` or `from numpy import ...` (`sqrt`, `pi`)."""
    aliases = {id(a) for n in _module_scope(tree) if isinstance(n, ast.ImportFrom) and not n.level
               and n.module in ("math", "numpy") for a in n.names}
    return {name for name, values in bindings.items() if values and all(id(v) in aliases for v in values)}


def _only_imports(values: list[ast.AST | None], module: str) -> bool:
    return bool(values) and all(isinstance(v, ast.alias) and v.name == module for v in values)


def _imported_only(values: list[ast.AST | None], module: str) -> bool:
    """Bound by `import module` only, its attributes perhaps set (`torch.backends.cudnn.benchmark =
    False`; setting torch's own functions is a finding of the scan)."""
    imports = [v for v in values if not isinstance(v, ast.Attribute)]
    return _only_imports(imports, module)


def _constant(v: ast.AST | None, scope: _Scope) -> bool:
    """A literal, arithmetic over constants (names found constant, `math`'s or numpy's constants and
    functions, `torch.pi`, Triton's `next_power_of_2`/`cdiv`, `float("inf")`, `max(16, N)`, a dtype's
    limits), `constexpr(...)` of one, or an attribute of Triton's
    (`tl.float32`). What it evaluates to is checked again at each launch (`launch_guard`): a plain
    number or Triton's own."""
    if isinstance(v, ast.Constant):
        return True
    if isinstance(getattr(v, "ctx", None), ast.Store):  # an attribute set: the name's object changes
        return False
    if isinstance(v, ast.UnaryOp):
        return _constant(v.operand, scope)
    if isinstance(v, ast.BinOp):
        return _constant(v.left, scope) and _constant(v.right, scope)
    if isinstance(v, ast.Name):
        return v.id in scope.known or v.id in scope.imported
    if isinstance(v, ast.IfExp):  # `tl.float64 if FP64 else tl.float32`
        return all(_constant(x, scope) for x in (v.test, v.body, v.orelse))
    if isinstance(v, ast.Compare):
        return all(_constant(x, scope) for x in (v.left, *v.comparators))
    if isinstance(v, ast.BoolOp):
        return all(_constant(x, scope) for x in v.values)
    if isinstance(v, ast.Call) and not v.keywords:
        callee = dotted(v.func)
        if callee.rsplit(".", 1)[-1] == "constexpr" and len(v.args) == 1:
            return _constant(v.args[0], scope)
        parts = callee.split(".")
        numeric = callee in scope.numeric | scope.imported or (len(parts) == 2 and (
            parts[0] in scope.numeric_modules or (parts[0] in scope.tl_names and parts[1] in _TRITON_ARITHMETIC)))
        return numeric and all(_constant(a, scope) for a in v.args)
    if isinstance(v, ast.Attribute):
        root = dotted(v).split(".")[0]
        return (root in scope.tl_names or (root in scope.numeric_modules and isinstance(v.value, ast.Name))
                or (root in scope.torch_names and v.attr in _TORCH_NUMBERS and isinstance(v.value, ast.Name))
                or _dtype_limit(v, scope))
    return False


_NUMERIC_BUILTINS = frozenset({"float", "int", "abs", "max", "min", "round"})  # numbers of numbers
_TRITON_ARITHMETIC = frozenset({"next_power_of_2", "cdiv"})  # `triton.next_power_of_2(300)`: a plain int
_TORCH_NUMBERS = frozenset({"pi", "e", "inf", "nan"})  # `torch.pi`: plain floats
_DTYPE_LIMITS = {"finfo": {"min", "max", "eps", "tiny", "smallest_normal", "resolution", "bits"},
                 "iinfo": {"min", "max", "bits"}}


def _dtype_limit(v: ast.Attribute, scope: _Scope) -> bool:
    """`torch.finfo(torch.float32).min`, `np.finfo(np.float32).min` and the like: a number of one of
    torch's or numpy's dtypes."""
    call = v.value
    if not (isinstance(call, ast.Call) and len(call.args) == 1 and not call.keywords):
        return False
    fn, dtype = dotted(call.func).split("."), dotted(call.args[0]).split(".")
    modules = scope.torch_names | scope.numeric_modules
    return (len(fn) == 2 and fn[0] in modules and v.attr in _DTYPE_LIMITS.get(fn[1], ())
            and len(dtype) == 2 and dtype[0] == fn[0])


@dataclasses.dataclass(frozen=True)
class Reads:
    """What a kernel's def reads from outside itself when Triton's interpreter runs its text again:
    names (its body, its defaults and annotations; not its decorators, which no launch runs) and
    the attribute chains rooted at them (`tl.math.exp`: ("tl", "math", "exp"))."""
    names: frozenset[str]
    chains: frozenset[tuple[str, ...]]


def _launched_parts(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.AST]:
    """What of a kernel's def a launch runs: its body, defaults and annotations; not its decorators
    (autotune configs, heuristics), which run at import or before the launch, as plain Python."""
    args = fn.args
    # `x_ptr: torch.Tensor` reads one class of torch's, which Triton ignores as a parameter's type
    notes = [a.annotation for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)
             if a.annotation is not None and dotted(a.annotation) != "torch.Tensor"]
    return [*fn.body, *args.defaults, *(d for d in args.kw_defaults if d is not None), *notes]


def reads(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Reads:
    nodes = [n for part in _launched_parts(fn) for n in ast.walk(part)]
    local = _names_bound(fn)
    names = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - local
    chains = {tuple(dotted(n).split(".")) for n in nodes if isinstance(n, ast.Attribute) and dotted(n)}
    return Reads(frozenset(names), frozenset(c for c in chains if c[0] in names))


# Builtins a kernel may name: anything else (`globals`, `getattr`, `__import__`, `open`, ...) reaches
# the file's Python from inside the kernel
KERNEL_BUILTINS = frozenset({"range", "min", "max", "len", "print", "isinstance", "int", "float", "bool", "abs",
                             "tuple", "list", "enumerate", "zip", "str", "divmod", "round", "pow", "sum", "all", "any",
                             "reversed", "slice", "AssertionError", "ValueError", "RuntimeError", "NotImplementedError"})


def _triton_decorated(node: ast.AST, tl_names: set[str]) -> bool:
    return any(dotted(d.func if isinstance(d, ast.Call) else d).split(".")[0] in tl_names
               for d in getattr(node, "decorator_list", []))


def _names_bound(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The kernel's parameters and the names it assigns."""
    params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
    return params | set(_aliases(fn))


def dotted(node: ast.AST) -> str:
    """`a.b.c` of an attribute chain (empty when it does not start with a name)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _is_jit(node: ast.AST) -> bool:
    """`jit`, `x.jit` or a call of either (`@triton.jit(debug=True)`)."""
    if isinstance(node, ast.Call):
        node = node.func
    return dotted(node).rsplit(".", 1)[-1] == "jit"


def package_aliases(tree: ast.AST, packages: tuple[str, ...]) -> set[str]:
    """Names bound to one of `packages` or their modules (`import triton.language as tl`), and the
    packages' own names."""
    out = set(packages)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in packages}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in packages:
            out |= {a.asname or a.name for a in node.names}
    return out


def _names(node: ast.AST | None) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} if node is not None else set()


def _aliases(fn: ast.AST) -> dict[str, set[str]]:
    """Local name -> the names its assigned values were computed from."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
            targets, value = [node.target], node.value
        elif isinstance(node, (ast.For, ast.comprehension)):
            targets, value = [node.target], node.iter
        else:
            continue
        for target in targets:
            for name in _names(target):
                out.setdefault(name, set()).update(_names(value))
    return out


def _resolve(names: set[str], aliases: dict[str, set[str]], params: tuple[str, ...]) -> set[str]:
    """The parameters `names` were computed from, through local assignments."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(aliases.get(name, ()))
    return seen & set(params)


def _operands(call: ast.Call, tl_names: set[str], verb: str) -> list[ast.AST] | None:
    """The expressions a call may `verb` ("store" or "load") through: the pointer of a store, load
    or atomic, the object of a descriptor's `.store`/`.load`, every argument of a call to a
    non-Triton function (a helper); None for calls that touch no memory (Triton's language
    functions, builtins)."""
    name = dotted(call.func)
    last, root = name.rsplit(".", 1)[-1], name.split(".")[0]
    if last in ("store", "load") or last.startswith("atomic_") or last.endswith(("_store", "_load")):
        if last != verb and not last.endswith("_" + verb) and not last.startswith("atomic_"):
            return []
        pointer = call.args[0] if call.args else next((k.value for k in call.keywords
                                                        if k.arg in ("pointer", "ptr", "desc")), None)
        own = call.func.value if isinstance(call.func, ast.Attribute) and root not in tl_names else None
        return [x for x in (pointer, own) if x is not None]
    if root in tl_names or (name == last and hasattr(builtins, name)):
        return None
    return [*call.args, *(k.value for k in call.keywords)]


def _kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef, tl_names: set[str]) -> Kernel:
    params = tuple(a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs))
    aliases = _aliases(fn)
    found: dict[str, set[str]] = {"store": set(), "load": set()}
    for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
        for verb, params_found in found.items():
            for operand in _operands(call, tl_names, verb) or ():
                params_found |= _resolve(_names(operand), aliases, params)
    return Kernel(name=fn.name, params=params, stores=frozenset(found["store"]), loads=frozenset(found["load"]))
