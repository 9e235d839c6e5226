"""The package's layering (docs/architecture.md): every module imports only modules listed before it
here, at the top of the file or inside a function, so there is no import circle and nothing
imports upwards (the evaluator does not reach into the trainer, the judge never into the evaluator)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "drkernel"

# bottom to top
ORDER = (
    "procfs", "ipc", "jsonl", "tasks", "triton_source", "compare_kernels", "gpushare", "profiling",
    "advantages", "loss", "metrics", "config", "modeling", "evaltypes", "compare", "dataflow", "counterfactual", "launch_pattern",
    "launch_guard",
    "gpumemory",
    "confine", "channel", "integrity", "sandbox", "runner", "judge", "evalcache", "rewards", "evaluator",
    "prompts", "layouts", "report", "generation", "api_policy", "mismatch", "stts", "rollout", "runtime",
    "sft_data", "sft", "trainer",
)


def _imports(path: Path) -> set[str]:
    """The package modules `path` imports, anywhere in the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("drkernel"):
            out |= {a.name for a in node.names} if node.module == "drkernel" else {node.module.split(".")[1]}
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("drkernel.")}
    return out - {"data"}


def test_every_module_is_placed_and_imports_only_modules_below_it():
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert modules == set(ORDER), (sorted(modules - set(ORDER)), sorted(set(ORDER) - modules))
    rank = {m: i for i, m in enumerate(ORDER)}
    upward = [(m, d) for m in ORDER for d in sorted(_imports(PACKAGE / f"{m}.py") - {m}) if rank[d] > rank[m]]
    assert upward == [], upward
