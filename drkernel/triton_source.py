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
    defs = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names = {n.name for n in defs.values() if any(_is_jit(d) for d in n.decorator_list)}
    names |= {a.args[0].id for a in ast.walk(tree) if isinstance(a, ast.Call) and _is_jit(a.func)
              and a.args and isinstance(a.args[0], ast.Name) and a.args[0].id in defs}
    tl_names = _triton_aliases(tree)
    return {n: _kernel(defs[n], tl_names) for n in sorted(names)}


def python_calls(source: str, tree: ast.AST | None = None) -> list[str]:
    """Calls inside `jit` kernels to the file's own Python: a plain function or a module-level
    object (not a kernel, not decorated from Triton), or torch. A GPU compile refuses them; Triton's
    interpreter runs them as Python, unseen by the data-flow log, which is paused inside a launch.
    `tree`: the text's parsed tree, where the caller has it."""
    try:
        tree = tree or ast.parse(source)
    except UNPARSABLE:
        return []
    kernels = set(jit_kernels(tree))
    tl_names = _triton_aliases(tree)
    body = tree.body if isinstance(tree, ast.Module) else []
    python = {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
              and n.name not in kernels and not _triton_decorated(n, tl_names)}
    python |= {name for n in body if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) for name in _names(t)}
    python = (python - kernels) | {"torch"}
    defs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in kernels]
    lines = source.splitlines()
    found: dict[str, None] = {}
    for fn in defs:
        outside = python - _names_bound(fn)
        found.update(dict.fromkeys(_call_findings(fn, outside)))
        if any(line.lstrip().startswith("def ") for line in lines[fn.lineno:fn.end_lineno]):
            # Triton's interpreter finds a kernel's def by its text: it would run the last one
            found[f"{fn.name} holds another line starting with 'def '"] = None
    return list(found)


def _call_findings(fn: ast.FunctionDef | ast.AsyncFunctionDef, outside: set[str]) -> list[str]:
    """The calls of `fn` that reach names of `outside`: by name (`f()`, `torch.relu()`) or through
    any other expression that holds one (`[f][0]()`, `(f or g)()`); a method of a value made in
    the kernel (`(a * b).to(...)`) is fine."""
    out = []
    for call in (c for c in ast.walk(fn) if isinstance(c, ast.Call)):
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


def _triton_aliases(tree: ast.AST) -> set[str]:
    """Names bound to `triton` or one of its modules (`tl`, `triton`, ...)."""
    out = {"tl", "triton"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "triton"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "triton":
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
