"""Mixed candidate sets for the evaluation-throughput bench and the replay policy (issue 15).

Sources, each candidate with the verdict (and hack codes) it should get where that is known:
- `solution`: our Triton solutions, `bench/solutions/level{L}_{id}_*.py` against KernelBench
  problem (L, id) (shrunk with `shrink=True`, as `bench/kernelbench_eval.py --shrink` does) and
  `drkernel/data/solutions/<task>.py` against the bundled task of that name: `correct`;
- corrupted solutions, each made by one deterministic source transformation that must change the
  source (`CORRUPTIONS`): `syntax_error` (compile_error), `mask_off_by_one` (`a < n` -> `a <= n`
  in a kernel; unknown: a one-element overrun often lands in allocation padding),
  `mask_dropped` (every `mask=`/`other=` of the kernels' loads and stores dropped; unknown:
  harmless when the sizes are multiples of the block, out of bounds otherwise),
  `torch_fallback` (ModelNew.forward replaced by the reference's torch forward: hacked
  no_triton_kernel), `slower_tiling` (literal BLOCK* launch sizes quartered, at least 16 for
  tl.dot: correct, slower), `wrong_constant` (the first arithmetic float constant of the kernels
  plus 1: incorrect); a transformation that does not apply to a file yields nothing;
- `fixture`: tests/fixtures/{hacks,legit,faults}/*.py against the bundled task named in their
  `# task:` header, expected as their `# expect:` header says (`# device: cuda` ones only on GPU).

    python bench/candidates.py --kernelbench ../shared/kernelbench             # composition
    python bench/candidates.py --shrink --device cpu --size 40 --write /tmp/c  # files to read
"""

from __future__ import annotations

import argparse
import ast
import collections
import copy
import dataclasses
import random
import re
import sys
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.entry import InputError, check_outputs, exit_status  # noqa: E402
from bench.kernelbench_eval import shrunk_task, solution_files  # noqa: E402
from drkernel.tasks import BUNDLED_DIR, BUNDLED_SOLUTIONS_DIR, Task, load_kernelbench, load_task_file  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
FIXTURE_DIRS = ("hacks", "legit", "faults")
DEFAULT_KERNELBENCH = ROOT.parent / "shared" / "kernelbench"


@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str  # e.g. level1_19_ReLU, bundled/4_Softmax~wrong_constant, hacks/decoy_one_element
    kind: str  # one of KINDS
    task: Task  # the reference it is judged against (KernelBench rows are not files)
    code: str
    expected_verdict: str | None  # None: not known in advance
    expected_hacks: tuple[str, ...] = ()
    cuda_only: bool = False  # the trick is visible on a GPU only (side streams, device asserts)


# ======================================================================================
# Source editing helpers
# ======================================================================================

def _is_jit(fn: ast.FunctionDef) -> bool:
    """Decorated with triton.jit / jit, with or without arguments."""
    return any(ast.unparse(d.func if isinstance(d, ast.Call) else d).split(".")[-1] == "jit"
               for d in fn.decorator_list)


def _functions(tree: ast.Module) -> list[ast.FunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]


def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def _method(cls: ast.ClassDef | None, name: str) -> ast.FunctionDef | None:
    if cls is None:
        return None
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _offset(line_starts: list[int], lineno: int, col: int) -> int:
    return line_starts[lineno - 1] + col


def _splice(code: str, edits: list[tuple[ast.AST, str]]) -> str:
    """Replace each node's source span by its text. AST columns count UTF-8 bytes, so the edit
    works on bytes; spans must not overlap."""
    data = code.encode("utf-8")
    starts = [0]
    for line in data.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    spans = sorted(((_offset(starts, n.lineno, n.col_offset), _offset(starts, n.end_lineno, n.end_col_offset), text)
                    for n, text in edits), reverse=True)
    for begin, end, text in spans:
        data = data[:begin] + text.encode("utf-8") + data[end:]
    return data.decode("utf-8")


def _replace_function(code: str, old: ast.FunctionDef, new: ast.FunctionDef) -> str:
    """The `def` ... end of `old` replaced by `new` (decorators above it stay as they are)."""
    bare = copy.copy(new)
    bare.decorator_list = []
    lines = ast.unparse(bare).splitlines()
    indent = " " * old.col_offset
    return _splice(code, [(old, "\n".join([lines[0]] + [indent + line for line in lines[1:]]))])


# ======================================================================================
# Corruptions: (candidate code, reference code) -> corrupted code, or None when not applicable
# ======================================================================================

def syntax_error(code: str, reference: str) -> str | None:
    """The colon of the `class ModelNew` line removed."""
    cls = _class(ast.parse(code), "ModelNew")
    if cls is None:
        return None
    lines = code.splitlines(keepends=True)
    header = lines[cls.lineno - 1]
    if not header.rstrip().endswith(":"):
        return None
    lines[cls.lineno - 1] = header.rstrip()[:-1] + "\n"
    return "".join(lines)


def _first_lt(fn: ast.FunctionDef) -> ast.Compare | None:
    """The first `a < b` assigned to a name or passed as `mask=` in a kernel, in source order."""
    found = [n.value for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.keyword))
             and (isinstance(n, ast.Assign) or n.arg == "mask") and isinstance(n.value, ast.Compare)
             and len(n.value.ops) == 1 and isinstance(n.value.ops[0], ast.Lt)]
    return min(found, key=lambda c: (c.lineno, c.col_offset), default=None)


def mask_off_by_one(code: str, reference: str) -> str | None:
    for fn in filter(_is_jit, _functions(ast.parse(code))):
        cmp = _first_lt(fn)
        if cmp is not None:
            wrong = ast.Compare(left=cmp.left, ops=[ast.LtE()], comparators=cmp.comparators)
            return _splice(code, [(cmp, ast.unparse(wrong))])
    return None


def _drop_masks(fn: ast.FunctionDef) -> ast.FunctionDef | None:
    new = copy.deepcopy(fn)
    changed = False
    for call in (n for n in ast.walk(new) if isinstance(n, ast.Call)):
        if isinstance(call.func, ast.Attribute) and call.func.attr in ("load", "store"):
            kept = [k for k in call.keywords if k.arg not in ("mask", "other")]
            changed |= len(kept) != len(call.keywords)
            call.keywords = kept
    return new if changed else None


def mask_dropped(code: str, reference: str) -> str | None:
    tree = ast.parse(code)
    edits = [(fn, new) for fn in filter(_is_jit, _functions(tree)) if (new := _drop_masks(fn)) is not None]
    for old, new in sorted(edits, key=lambda e: e[0].lineno, reverse=True):  # bottom-up keeps lines valid
        code = _replace_function(code, old, new)
    return code if edits else None


def _self_attrs(node: ast.AST, store: bool) -> set[str]:
    ctx = ast.Store if store else ast.Load
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ctx)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}


def torch_fallback(code: str, reference: str) -> str | None:
    """ModelNew.forward takes the reference's arguments and torch body, when every `self.x` that
    body reads is also set by ModelNew (else the fallback would only raise AttributeError)."""
    tree = ast.parse(code)
    cls = _class(tree, "ModelNew")
    forward = _method(cls, "forward")
    ref_forward = _method(_class(ast.parse(reference), "Model"), "forward")
    if forward is None or ref_forward is None or not _self_attrs(ref_forward, False) <= _self_attrs(cls, True):
        return None
    body = ref_forward.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and len(body) > 1:
        body = body[1:]  # the docstring: unparsed, its lines would be indented twice
    new = copy.deepcopy(forward)
    new.args, new.body, new.returns = ref_forward.args, body, ref_forward.returns
    return _replace_function(code, forward, new)


def _block_kwargs(launch: ast.Call) -> list[ast.Constant]:
    return [k.value for k in launch.keywords if k.arg and k.arg.startswith("BLOCK")
            and isinstance(k.value, ast.Constant) and type(k.value.value) is int]


def _grid_literals(launch: ast.Call, scope: ast.FunctionDef, values: set[int]) -> list[ast.Constant] | None:
    """Literals of `values` in the launch grid that must shrink with the block, [] for a
    `lambda meta:` grid, None when the grid cannot be followed (then the launch is left alone)."""
    grid = launch.func.slice  # type: ignore[attr-defined]
    if isinstance(grid, ast.Name):
        bound = [n.value for n in ast.walk(scope) if isinstance(n, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == grid.id for t in n.targets)]
        return [] if len(bound) == 1 and isinstance(bound[0], ast.Lambda) else None
    if isinstance(grid, ast.Lambda):
        return []
    return [n for n in ast.walk(grid) if isinstance(n, ast.Constant) and n.value in values]


def slower_tiling(code: str, reference: str) -> str | None:
    """Literal BLOCK* sizes of each kernel launch quartered (at least 16: tl.dot needs tiles of
    16), the same literals in an inline grid with them."""
    tree = ast.parse(code)
    kernels = {fn.name for fn in _functions(tree) if _is_jit(fn)}
    edits: list[tuple[ast.AST, str]] = []
    for scope in (fn for fn in _functions(tree) if not _is_jit(fn)):
        for launch in (n for n in ast.walk(scope) if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)
                       and isinstance(n.func.value, ast.Name) and n.func.value.id in kernels):
            sizes = {c.value: max(16, c.value // 4) for c in _block_kwargs(launch)}
            sizes = {old: new for old, new in sizes.items() if new != old}
            grid = _grid_literals(launch, scope, set(sizes))
            if sizes and grid is not None:
                edits += [(c, str(sizes[c.value])) for c in _block_kwargs(launch) + grid if c.value in sizes]
    return _splice(code, edits) if edits else None


def _arithmetic_floats(fn: ast.FunctionDef) -> list[ast.Constant]:
    """Float literals of a kernel that enter its arithmetic: not a load's `other=`, not the fill
    of tl.where / tl.full / tl.zeros (those only matter on masked lanes), not a whole initial
    value `s = 0.0` (an online softmax rescales it by exp(-inf) = 0)."""
    skip: set[int] = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.keyword):
            skip.update(id(c) for c in ast.walk(n.value))
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant):
            skip.add(id(n.value))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("where", "full", "zeros"):
            skip.update(id(c) for a in n.args for c in ast.walk(a))
    return [n for n in ast.walk(fn) if isinstance(n, ast.Constant) and type(n.value) is float and id(n) not in skip]


def wrong_constant(code: str, reference: str) -> str | None:
    for fn in filter(_is_jit, _functions(ast.parse(code))):
        floats = sorted(_arithmetic_floats(fn), key=lambda c: (c.lineno, c.col_offset))
        if floats:
            return _splice(code, [(floats[0], repr(floats[0].value + 1.0))])
    return None


Corruption = Callable[[str, str], "str | None"]
# name -> (transformation, expected verdict, expected hack codes)
CORRUPTIONS: dict[str, tuple[Corruption, str | None, tuple[str, ...]]] = {
    "syntax_error": (syntax_error, "compile_error", ()),
    "mask_off_by_one": (mask_off_by_one, None, ()),
    "mask_dropped": (mask_dropped, None, ()),
    "torch_fallback": (torch_fallback, "hacked", ("no_triton_kernel",)),
    "slower_tiling": (slower_tiling, "correct", ()),
    "wrong_constant": (wrong_constant, "incorrect", ()),
}
KINDS = ("solution", *CORRUPTIONS, "fixture")


def corrupt(solution: Candidate) -> list[Candidate]:
    """Every applicable corruption of `solution`; a transformation that claims to apply but
    leaves the source unchanged is a bug here, not a candidate."""
    out = []
    for kind, (transform, verdict, hacks) in CORRUPTIONS.items():
        code = transform(solution.code, solution.task.code)
        if code is None:
            continue
        if code == solution.code:
            raise AssertionError(f"{kind} left {solution.name} unchanged")
        out.append(Candidate(f"{solution.name}~{kind}", kind, solution.task, code, verdict, hacks))
    return out


# ======================================================================================
# Sources
# ======================================================================================

def bench_solutions(kernelbench: str | Path, shrink: bool) -> list[Candidate]:
    """bench/solutions/*.py against their KernelBench problems (shrunk for CPU runs)."""
    files = solution_files()
    tasks = {t.key: t for level in sorted({s.level for s in files})
             for t in load_kernelbench(str(kernelbench), level)}
    out = []
    for sol in files:
        task = tasks[f"{sol.level}_{sol.problem_id}"]
        out.append(Candidate(sol.path.stem, "solution", shrunk_task(task) if shrink else task,
                             sol.path.read_text(), "correct"))
    return out


def bundled_task(name: str) -> Task:
    return load_task_file(BUNDLED_DIR / name, level=0)


def bundled_solutions() -> list[Candidate]:
    return [Candidate(f"bundled/{p.stem}", "solution", bundled_task(p.name), p.read_text(), "correct")
            for p in sorted(BUNDLED_SOLUTIONS_DIR.glob("*.py"))]


def headers(path: Path) -> dict[str, str]:
    """`# task:`, `# expect:` and `# device:` lines of a fixture (tests/test_hacks.py reads the same), and
    `# expect_cuda:` where a GPU's verdict differs (an attack on Triton's CPU interpreter only)."""
    found = (re.match(r"#\s*(task|expect|expect_cuda|device)\s*:\s*(.+?)\s*$", line)
             for line in path.read_text().splitlines()[:30])
    return {m.group(1): m.group(2) for m in found if m}


def fixtures() -> list[Candidate]:
    out = []
    for sub in FIXTURE_DIRS:
        for path in sorted((FIXTURES / sub).glob("*.py")):
            h = headers(path)
            verdict, *hacks = h["expect"].split()
            out.append(Candidate(f"{sub}/{path.stem}", "fixture", bundled_task(h["task"]), path.read_text(),
                                 verdict, tuple(hacks), h.get("device", "cpu").startswith("cuda")))
    return out


def all_candidates(kernelbench: str | Path = DEFAULT_KERNELBENCH, shrink: bool = False) -> list[Candidate]:
    """Every solution, every applicable corruption of each, every fixture."""
    solutions = bench_solutions(kernelbench, shrink) + bundled_solutions()
    return solutions + [c for s in solutions for c in corrupt(s)] + fixtures()


def _interleave(*queues: list[Candidate]) -> list[Candidate]:
    """One from each queue in turn, skipping emptied ones, until all are empty."""
    out: list[Candidate] = []
    for i in range(max(map(len, queues), default=0)):
        out.extend(q[i] for q in queues if i < len(q))
    return out


def mixed_set(candidates: Iterable[Candidate], size: int, seed: int = 0, device: str = "cuda") -> list[Candidate]:
    """All solutions first, then corrupted solutions and fixtures in turn (the corruption kinds
    round robin, each kind and the fixtures in a seeded order) until `size` candidates
    (`size <= 0`: all). GPU-only fixtures are left out on a CPU device."""
    usable = [c for c in candidates if device.startswith("cuda") or not c.cuda_only]
    by_kind: dict[str, list[Candidate]] = collections.defaultdict(list)
    for c in usable:
        by_kind[c.kind].append(c)
    for kind in KINDS[1:]:
        random.Random(f"{seed}:{kind}").shuffle(by_kind[kind])
    corrupted = _interleave(*(by_kind[k] for k in CORRUPTIONS))
    ordered = by_kind["solution"] + _interleave(corrupted, by_kind["fixture"])
    return ordered[:size] if size > 0 else ordered


def full_size_set(candidates: Iterable[Candidate]) -> list[Candidate]:
    """Only the candidates judged against KernelBench problems at their real sizes: our solutions
    and their corruptions (no bundled tiny task, whose figures flatter every measurement)."""
    return [c for c in candidates if c.task.level > 0 and c.kind in ("solution", *CORRUPTIONS)]


def rl_batch(candidates: Iterable[Candidate], problems: int = 8, per_problem: int = 16,
             seed: int = 0) -> list[Candidate]:
    """An RL step's evaluation batch: `per_problem` candidates for each of `problems` KernelBench
    problems, drawn in turn from the problem's solution and its corruptions (correct, slower,
    wrong, crashing, torch fallbacks), each copy made distinct by a trailing comment so that no
    cache or de-duplication shares their work."""
    pool = collections.defaultdict(list)
    for c in full_size_set(candidates):
        pool[c.task.key].append(c)
    keys = sorted(pool, key=lambda k: (-len(pool[k]), k))[:problems]
    out = []
    for key in keys:
        kinds = sorted(pool[key], key=lambda c: c.kind)
        random.Random(f"{seed}:{key}").shuffle(kinds)
        for i in range(per_problem):
            c = kinds[i % len(kinds)]
            out.append(dataclasses.replace(c, name=f"{c.name}#{i}", code=f"{c.code.rstrip()}\n# rl batch copy {i}\n"))
    return out


def composition(candidates: Iterable[Candidate]) -> dict[str, int]:
    """Candidates per kind, in KINDS order."""
    counts = collections.Counter(c.kind for c in candidates)
    return {k: counts[k] for k in KINDS if counts[k]}


def by_task(candidates: Iterable[Candidate]) -> dict[str, list[Candidate]]:
    """Candidates grouped by their task's key (`level_problemid`; bundled tasks are level 0)."""
    groups: dict[str, list[Candidate]] = collections.defaultdict(list)
    for c in candidates:
        groups[c.task.key].append(c)
    return dict(groups)


def check_args(args: argparse.Namespace) -> None:
    """InputError for a value `mixed_set` would take silently (a negative size is every candidate;
    a device other than cuda* leaves out the GPU-only fixtures) and for a --write folder that
    cannot be written, before the candidates are built."""
    if args.size < 0:
        raise InputError(f"--size must be >= 0 (0: every candidate), got {args.size}")
    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", args.device):
        raise InputError(f"bad --device {args.device!r}: use cpu, cuda or cuda:N")
    check_outputs(("--write", args.write or None, True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernelbench", default=str(DEFAULT_KERNELBENCH))
    ap.add_argument("--shrink", action="store_true", help="tiny KernelBench sizes (CPU runs)")
    ap.add_argument("--device", default="cuda", help="cpu leaves out the GPU-only fixtures")
    ap.add_argument("--size", type=int, default=0, help="a mixed set of this size (0: every candidate)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", default="", help="write each candidate to DIR/<name>.py")
    args = ap.parse_args(argv)
    check_args(args)
    cands = mixed_set(all_candidates(args.kernelbench, args.shrink), args.size, args.seed, args.device)
    for c in cands:
        expect = " ".join(filter(None, [c.expected_verdict or "?", *c.expected_hacks]))
        print(f"{c.name:64s} {c.task.key:>6s} {expect}")
        if args.write:
            path = Path(args.write) / f"{c.name.replace('/', '__')}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(c.code)
    print(f"{len(cands)} candidates: {composition(cands)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
