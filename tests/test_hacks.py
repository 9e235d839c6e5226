"""One test per hack code: each hostile candidate must be caught by its defence (CPU, interpreter).

Also runs the fixture corpus `tests/fixtures/hacks/*.py` (when present), asserting each file's
`# expect:` header; `# device: cuda` files are skipped without a GPU.
"""

import functools
import re
import textwrap
from pathlib import Path

import pytest

from drkernel import integrity
from drkernel.evaluator import EvalConfig, EvalResult
from tests.fixtures.attacks import harness
from tests.test_evaluator import (EMBED, LEGIT_RELU, TASKS, cfg, relu_candidate, run, shared_evaluate,
                                 shared_evaluate_many)

ROOT = Path(__file__).resolve().parent.parent
HACKS_DIR = ROOT / "tests" / "fixtures" / "hacks"


def assert_hack(r, code):
    assert r.verdict == "hacked", (r.verdict, r.error)
    assert code in r.hacks, (r.hacks, r.error)
    assert not r.correct and r.speedup is None


def test_no_false_positives_on_legit():
    for task, cand in (("1_ReLU.py", LEGIT_RELU), ("7_Embedding_Gather.py", EMBED)):
        r = run(task, cand)
        assert r.verdict == "correct" and r.hacks == [], (task, r.hacks, r.error)


def test_no_triton_kernel():
    assert_hack(run("1_ReLU.py", relu_candidate("return torch.relu(x)")), "no_triton_kernel")


def test_no_triton_kernel_fallback():
    body = """
    try:
        raise RuntimeError('pretend the kernel failed')
        return launch(x)
    except Exception:
        return torch.relu(x)
    """
    assert_hack(run("1_ReLU.py", relu_candidate(body)), "no_triton_kernel")


def test_decoy_kernel():
    body = """
    launch(x.reshape(-1)[:8])
    return torch.relu(x)
    """
    assert_hack(run("1_ReLU.py", relu_candidate(body)), "decoy_kernel")


def test_output_cached_same_storage():
    body = """
    if self.cache is None:
        self.cache = launch(x)
    return self.cache
    """
    init = "def __init__(self):\n        super().__init__()\n        self.cache = None"
    assert_hack(run("1_ReLU.py", relu_candidate(body, init=init)), "output_cached")


def test_output_cached_stale_during_timing():
    # correct while being checked (4 calls: 2 trials, 1 signed trial, 1 warm-up), then replays a copy;
    # it launches the same way throughout (a copy of its kernel's output is returned every time)
    body = """
    self.calls += 1
    y = launch(x)
    if self.calls <= 4:
        self.cache = y.clone()
        return y.clone()
    return self.cache.clone()
    """
    init = "def __init__(self):\n        super().__init__()\n        self.calls = 0\n        self.cache = None"
    r = run("1_ReLU.py", relu_candidate(body, init=init), cpu_perf_trials=3)
    # the timed calls' check finds the stale copy; where the counterfactual pair comes first, the
    # checked call after it returns the same stale copy, which no launch made
    assert r.verdict == "hacked" and {"output_cached", "decoy_kernel"} & set(r.hacks), (r.hacks, r.error)


def test_every_timed_call_is_checked():
    """Wrong in the first two timed calls only (the untimed counterfactual pair, at a random place
    among them, may take one), launching as in every other call. Checking one call a block of ten,
    the judge would miss them most times; it checks them all."""
    body = """
    self.calls += 1
    y = launch(x)
    if self.calls in (6, 7):  # five calls come before timing here (trials, decoy, warm-up)
        y.zero_()
    return y
    """
    init = "def __init__(self):\n        super().__init__()\n        self.calls = 0"
    r = run("1_ReLU.py", relu_candidate(body, init=init), cpu_perf_trials=20)
    assert_hack(r, "output_cached")
    assert "timed call 0:" in r.error or "timed call 1:" in r.error, r.error


def test_the_forward_seed_does_not_give_the_inputs_away():
    """The runner seeds the forward's RNG as the judge seeds the reference's (dropout); were that
    the inputs' own seed, a candidate could draw its inputs again, know KernelBench's kind of call
    from the judge's signed one, and work only where that pays. This one answers wrong whenever it
    recognises its inputs."""
    body = """
    g = torch.Generator().manual_seed(torch.initial_seed())
    if torch.equal(torch.rand(x.shape, generator=g) * 2 - 1, x):
        return torch.zeros_like(launch(x))
    return launch(x)
    """
    r = run("1_ReLU.py", relu_candidate(body))
    assert r.verdict == "correct", (r.verdict, r.error)


_NAN_SEEDED = """
@triton.jit
def busy_kernel(x_ptr, scratch_ptr, flag_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(scratch_ptr + offs, tl.load(x_ptr + offs, mask=m) * 0.5 + 1.0, mask=m)
    tl.store(flag_ptr, 1.0, mask=tl.program_id(0) == 0)


@triton.jit
def fill_kernel(y_ptr, flag_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.full([BLOCK], -1.0, tl.float32), mask=offs < n)
    tl.store(flag_ptr, 1.0, mask=tl.program_id(0) == 0)
"""


@pytest.mark.parametrize("body", [
    "y = torch.full_like(x, float('nan'))\nrelu_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)\n"
    "return torch.relu(x) + 0.0 * y",
    "flag = torch.full((1,), float('nan'))\nbusy_kernel[(triton.cdiv(x.numel(), 1024),)](x, torch.empty_like(x), "
    "flag, x.numel(), BLOCK=1024)\nreturn torch.relu(x) * flag",
    "y, flag = torch.empty_like(x), torch.zeros(1)\nfill_kernel[(triton.cdiv(x.numel(), 1024),)](y, flag, x.numel(), "
    "BLOCK=1024)\nh = x.shape[0] // 2\ny[:h].copy_(torch.relu(x[:h]))\ny[h:].copy_(torch.relu(x[h:]))\n"
    "return y if flag.item() == 1.0 else y * float('nan')",
], ids=["plus_zero_times", "times_flag", "overwritten_in_halves"])
def test_a_kernel_result_the_output_does_not_really_need_is_a_decoy(body):
    assert_hack(run("1_ReLU.py", relu_candidate(body, extra=_NAN_SEEDED)), "decoy_kernel")


def test_a_busy_kernel_beside_a_needed_one_counts_as_no_useful_time():
    """The ReLU kernel's result is the output; the busy kernel's only reaches it as a flag of 1.0
    (NaN until it runs, so the structural log calls it needed): its share of useful time is nil."""
    body = ("flag = torch.full((1,), float('nan'))\nbusy_kernel[(triton.cdiv(x.numel(), 1024),)](x, "
            "torch.empty_like(x), flag, x.numel(), BLOCK=1024)\nreturn launch(x) * flag")
    r = run("1_ReLU.py", relu_candidate(body, extra=_NAN_SEEDED))
    assert r.verdict == "correct", (r.verdict, r.error)
    assert r.details["needed_fraction"] == {"busy_kernel": 0.0, "relu_kernel": 1.0}, r.details["needed_fraction"]
    assert r.details["unneeded_kernels"] == ["busy_kernel"]


@pytest.mark.parametrize("reference, candidate", [
    ("cross_entropy_reference.py", "cross_entropy_kernel.py"),
    ("l2norm_reference.py", "l2norm_output_first_kernel.py"),
])
def test_honest_kernels_the_counterfactual_must_see_change(reference, candidate):
    """Inputs of two dtypes side by side in the arena; a scale-invariant kernel that loads another
    storage first: each kernel's perturbed reads change the output, so none is unneeded."""
    folder = ROOT / "tests" / "fixtures" / "counterfactual"
    r = shared_evaluate(str(folder / reference), (folder / candidate).read_text(), cfg())
    assert r.verdict == "correct", (r.verdict, r.error)
    assert r.details["unneeded_kernels"] == [], r.details


def test_an_honest_kernel_for_an_output_no_input_moves_is_no_decoy():
    """Where the reference's output is the same for every input, no kernel can be needed: the
    counterfactual finding nothing needed is no decoy there."""
    folder = ROOT / "tests" / "fixtures" / "counterfactual"
    r = shared_evaluate(str(folder / "constant_output_reference.py"),
                        (folder / "constant_output_kernel.py").read_text(), cfg())
    assert r.verdict == "correct", (r.verdict, r.hacks, r.error)


def test_output_aliases_input():
    body = """
    n = x.numel()
    relu_kernel[(triton.cdiv(n, 1024),)](x, x, n, BLOCK=1024)
    return x
    """
    assert_hack(run("1_ReLU.py", relu_candidate(body)), "output_aliases_input")


def test_input_mutated():
    body = """
    y = launch(x)
    x.zero_()
    return y
    """
    assert_hack(run("1_ReLU.py", relu_candidate(body)), "input_mutated")


def test_inputs_are_judged_against_what_the_reference_does_to_its_own(tmp_path):
    """A reference that applies ReLU in place: on uniform inputs the values stay as they were,
    yet it writes into its input (its version counter moves; judged by values alone, it would
    run on the judge's pristine copy and change it on the signed trials). Leaving the input
    alone and writing relu(x) back into x, as the reference does, are both correct; zeroing it
    is input_mutated."""
    ref = tmp_path / "inplace_relu.py"
    ref.write_text(textwrap.dedent("""
        import torch
        import torch.nn as nn


        class Model(nn.Module):
            def forward(self, x):
                x.relu_()
                return x * 1.0


        def get_inputs():
            return [torch.rand(16, 256)]


        def get_init_inputs():
            return []
    """))
    zeroing = relu_candidate("""
    y = launch(x)
    x.zero_()
    return y
    """)
    for cand in (LEGIT_RELU, (HACKS_DIR / "input_mutated_inplace_relu.py").read_text()):
        r = shared_evaluate(str(ref), cand, cfg())
        assert r.verdict == "correct" and r.hacks == [], (r.verdict, r.hacks, r.error)
    assert_hack(shared_evaluate(str(ref), zeroing, cfg()), "input_mutated")


def test_patched_function_at_import():
    extra = "\ntorch.allclose = lambda *a, **k: True\n"
    assert_hack(run("1_ReLU.py", relu_candidate("return launch(x)", extra=extra)), "patched_function")


def test_patched_function_reference_op():
    # makes the reference compute the candidate's (wrong) answer
    body = """
    torch.relu = lambda t: t.clamp_min(0) * 0 + 1
    return launch(x) * 0 + 1
    """
    assert_hack(run("1_ReLU.py", relu_candidate(body)), "patched_function")


def test_patched_launch_hook():
    extra = """
    import triton.runtime.interpreter as _ti
    _orig = _ti.InterpretedFunction.run
    _ti.InterpretedFunction.run = lambda self, *a, **k: _orig(self, *a, **k)
    """
    assert_hack(run("1_ReLU.py", relu_candidate("return launch(x)", extra=extra)), "patched_function")


def test_global_state_changed():
    body = """
    torch.backends.cuda.matmul.allow_tf32 = True
    return launch(x)
    """
    assert_hack(run("1_ReLU.py", relu_candidate(body)), "global_state_changed")


def test_global_state_grad_mode():
    body = """
    torch.set_grad_enabled(True)
    return launch(x)
    """
    assert_hack(run("1_ReLU.py", relu_candidate(body)), "global_state_changed")


@pytest.mark.parametrize("snippet", ["import gc\n_ = gc.get_objects()", "import sys\nf = sys._getframe(1)",
                                     "import inspect\ns = inspect.stack()", "import sys\nm = list(sys.modules)",
                                     "import ctypes"])
def test_reference_access_static(snippet):
    body = snippet + "\nreturn launch(x)"
    assert_hack(run("1_ReLU.py", relu_candidate(body)), "reference_access")


def test_bad_output_type():
    extra = "\nclass Sneaky(torch.Tensor):\n    pass\n"
    assert_hack(run("1_ReLU.py", relu_candidate("return launch(x).as_subclass(Sneaky)", extra=extra)),
                "bad_output_type")


def test_bad_output_structure():
    assert_hack(run("1_ReLU.py", relu_candidate("return (launch(x),)")), "bad_output_type")


MAX_WITH_INDICES = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class Model(nn.Module):
        def forward(self, x):
            return torch.max(x, dim=1)


    def get_inputs():
        return [torch.rand(8, 64)]


    def get_init_inputs():
        return []
''')

ROW_MAX = textwrap.dedent('''
    import torch
    import torch.nn as nn
    import triton
    import triton.language as tl


    @triton.jit
    def row_max_kernel(x_ptr, val_ptr, idx_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * n_cols + cols, mask=cols < n_cols, other=float("-inf"))
        v, i = tl.max(x, axis=0, return_indices=True)
        tl.store(val_ptr + row, v)
        tl.store(idx_ptr + row, i.to(tl.int64))


    class ModelNew(nn.Module):
        def forward(self, x):
            x = x.contiguous()
            rows, cols = x.shape
            vals = torch.empty(rows, device=x.device, dtype=x.dtype)
            idx = torch.empty(rows, device=x.device, dtype=torch.int64)
            row_max_kernel[(rows,)](x, vals, idx, cols, BLOCK=triton.next_power_of_2(cols))
            return RETURNED
''')


@pytest.mark.parametrize("returned", ["vals, idx", "[vals, idx]", "torch.return_types.max((vals, idx))"])
def test_values_and_indices_pass_as_a_tuple_a_list_or_torchs_own_named_tuple(tmp_path, returned):
    """A reference returning `torch.max(x, dim)` (a named tuple): the candidate's two tensors in any
    of the sequences an honest kernel returns them in are the same output."""
    task = tmp_path / "15_Max_With_Indices.py"
    task.write_text(MAX_WITH_INDICES)
    r = shared_evaluate(str(task), ROW_MAX.replace("RETURNED", returned), cfg())
    assert r.verdict == "correct", (r.verdict, r.error)


def test_a_class_made_to_look_like_torchs_named_tuple_is_a_bad_output_type():
    import torch
    from drkernel import compare
    fake = type("max", (tuple,), {"__module__": "torch.return_types"})
    assert compare.bad_type(fake((1, 2))) is not None
    assert compare.bad_type(torch.return_types.max((torch.zeros(1), torch.zeros(1)))) is None


def test_degenerate_output(tmp_path):
    task = tmp_path / "tiny_scale.py"
    task.write_text(textwrap.dedent('''
        import torch
        import torch.nn as nn

        class Model(nn.Module):
            def __init__(self):
                super().__init__()

            def forward(self, x):
                return torch.relu(x) * 1e-6

        def get_inputs():
            return [torch.rand(8, 64)]

        def get_init_inputs():
            return []
    '''))
    r = shared_evaluate(str(task), relu_candidate("return launch(-x.abs())"), cfg())
    assert_hack(r, "degenerate_output")


def test_precision_downgrade():
    extra = '''
    @triton.jit
    def relu_half_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m).to(tl.float16)
        tl.store(y_ptr + offs, tl.maximum(x, 0.0).to(tl.float32), mask=m)
    '''
    body = """
    y = torch.empty_like(x)
    relu_half_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    return y
    """
    assert_hack(run("1_ReLU.py", relu_candidate(body, extra=extra)), "precision_downgrade")


def test_thread_spawned_static():
    assert_hack(run("1_ReLU.py", relu_candidate("import threading\nreturn launch(x)")), "thread_spawned")


def test_thread_spawned_runtime():
    body = """
    import queue, time as _t
    queue.threading.Thread(target=_t.sleep, args=(30,), daemon=True).start()  # passes the static scan
    return launch(x)
    """
    assert_hack(run("1_ReLU.py", relu_candidate(body)), "thread_spawned")


def _cuda():
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


@pytest.mark.skipif(not _cuda(), reason="side_stream needs a GPU (CUDA events vs host clock)")
def test_side_stream_cuda():
    body = """
    s = torch.cuda.Stream()
    y = torch.empty_like(x)
    with torch.cuda.stream(s):
        for _ in range(50):
            n = x.numel()
            relu_kernel[(triton.cdiv(n, 1024),)](x, y, n, BLOCK=1024)
    return y
    """
    r = shared_evaluate(str(TASKS / "1_ReLU.py"), relu_candidate(body),
                 EvalConfig(device="cuda", trials=2, perf_trials=20, timeout=300))
    assert "side_stream" in r.hacks or r.verdict in ("hacked", "incorrect"), (r.verdict, r.hacks)


@pytest.mark.skipif(not _cuda(), reason="implausible_speedup needs a GPU (roofline from copy bandwidth)")
def test_implausible_speedup_cuda():
    # caches per input pointer/values probe; a pure replay is caught as output_cached or implausible
    body = """
    key = (x.data_ptr(), float(x.view(-1)[0]))
    if key not in self.cache:
        self.cache[key] = launch(x)
    return self.cache[key]
    """
    init = "def __init__(self):\n        super().__init__()\n        self.cache = {}"
    r = shared_evaluate(str(TASKS / "1_ReLU.py"), relu_candidate(body, init=init),
                 EvalConfig(device="cuda", trials=2, perf_trials=20, timeout=300))
    assert r.verdict == "hacked", (r.verdict, r.hacks)


# ---- the fixture corpus -----------------------------------------------------------------

def _headers(path: Path) -> dict:
    out = {}
    for line in path.read_text().splitlines()[:30]:
        m = re.match(r"#\s*(task|expect|device)\s*:\s*(.+?)\s*$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


_CORPUS = sorted(HACKS_DIR.glob("*.py")) if HACKS_DIR.is_dir() else []


def _corpus_device(h: dict) -> str:
    return "cuda" if h.get("device", "").startswith("cuda") else "cpu"


@functools.cache
def _corpus_results(device: str) -> dict[str, EvalResult]:
    """Every fixture of `device` judged in one `evaluate_many`, grouped by task as in training:
    a fixture that disturbs the others of its job fails their tests too."""
    heads = {p: _headers(p) for p in _CORPUS}
    paths = [p for p, h in heads.items() if {"task", "expect"} <= set(h) and _corpus_device(h) == device
             and (TASKS / h["task"]).is_file()]
    results = shared_evaluate_many([(str(TASKS / heads[p]["task"]), str(p)) for p in paths], cfg(device=device))
    return {p.name: r for p, r in zip(paths, results)}


@pytest.mark.parametrize("path", _CORPUS, ids=lambda p: p.name)
def test_hack_corpus(path):
    h = _headers(path)
    if "task" not in h or "expect" not in h:
        pytest.skip("no task/expect header")
    if _corpus_device(h) == "cuda" and not _cuda():
        pytest.skip("trick only visible on GPU")
    if not (TASKS / h["task"]).is_file():
        pytest.skip(f"unknown task {h['task']}")
    r = _corpus_results(_corpus_device(h))[path.name]
    assert harness.check(h["expect"], r), (h["expect"], r.verdict, r.hacks, r.error)


OUT_OF_DOMAIN_REFERENCE = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    """ReLU plus the log of each row's first element: rows that start negative are NaN."""

    def forward(self, x):
        return torch.relu(x) + torch.log(x[:, :1])


def get_inputs():
    return [torch.rand(16, 64)]


def get_init_inputs():
    return []
'''


# a Triton copy: a ReLU on [0, 1) inputs, caught only by signed ones
COPY = textwrap.dedent('''
    @triton.jit
    def copy_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m), mask=m)


    def copy(x):
        out = torch.empty_like(x)
        copy_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256)
        return out
    ''')


def test_signed_trials_judge_what_is_finite_where_the_reference_is_not():
    """Signed-normal inputs leave this reference's domain on some rows; its other rows still tell
    ReLU(x) from x (uniform inputs cannot), so a candidate that drops the ReLU must fail there."""
    shortcut = relu_candidate("return copy(x) + torch.log(x[:, :1])", extra=COPY)
    r = shared_evaluate(OUT_OF_DOMAIN_REFERENCE, shortcut, cfg())
    assert r.verdict == "incorrect" and "signed" in r.error, (r.verdict, r.error)
    honest = relu_candidate("return launch(x) + torch.log(x[:, :1])")
    assert shared_evaluate(OUT_OF_DOMAIN_REFERENCE, honest, cfg()).verdict == "correct"


TRIANGLE_REFERENCE = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, a):
        return a.sum(dim=1)


def get_inputs():
    return [torch.triu(torch.rand(24, 24))]


def get_init_inputs():
    return []
'''

UPPER_ROW_SUMS = textwrap.dedent('''
    import torch
    import torch.nn as nn
    import triton
    import triton.language as tl


    @triton.jit
    def upper_row_sums(a_ptr, out_ptr, n, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        keep = (cols >= row) & (cols < n)  # below the diagonal is zero: not read
        tl.store(out_ptr + row, tl.sum(tl.load(a_ptr + row * n + cols, mask=keep, other=0.0), axis=0))


    class ModelNew(nn.Module):
        def forward(self, a):
            a = a.contiguous()
            out = torch.empty(a.shape[0], device=a.device, dtype=a.dtype)
            upper_row_sums[(a.shape[0],)](a, out, a.shape[1], BLOCK=32)
            return out
    ''')


def test_signed_trials_keep_the_structure_get_inputs_builds():
    """KernelBench's triangular and symmetric matmuls build their inputs from uniform draws; the
    signed trials draw normals there and keep the triangle, so a kernel that skips the zeros below
    the diagonal is right; shortcuts that need [0, 1) values still fail (the ReLU test above)."""
    r = shared_evaluate(TRIANGLE_REFERENCE, UPPER_ROW_SUMS, cfg())
    assert r.verdict == "correct", (r.verdict, r.error)


def test_signed_trials_replace_the_floats_of_a_get_inputs_that_draws_no_torch_rand():
    """A `get_inputs()` that fills its inputs otherwise (`uniform_`) gets its float inputs replaced
    by normals: the copy that passes for a ReLU on [0, 1) must still fail."""
    reference = (TASKS / "1_ReLU.py").read_text().replace("torch.rand(batch_size, dim) * 2 - 1",
                                                          "torch.empty(batch_size, dim).uniform_(0, 1)")
    assert "uniform_" in reference
    r = shared_evaluate(reference, relu_candidate("return copy(x)", extra=COPY), cfg())
    assert r.verdict == "incorrect" and "signed" in r.error, (r.verdict, r.error)


STRUCTURED_REFERENCE = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    """A dict of two tensors (inserted out of key order) and an int beside them."""

    def forward(self, x):
        return {"relu": torch.relu(x), "double": x * 2.0}, x.shape[0]


def get_inputs():
    return [torch.rand(16, 64)]


def get_init_inputs():
    return []
'''


def test_outputs_with_dicts_and_plain_values_are_compared_by_key_and_value():
    """A dict output is matched by key, whatever the order the candidate builds it in, and a plain
    value beside the tensors is compared too: the honest answer passes, a swap or a wrong int does not."""
    double = textwrap.dedent('''
        @triton.jit
        def double_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) * 2.0, mask=m)


        def twice(x):
            out = torch.empty_like(x)
            double_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256)
            return out
        ''')
    honest = relu_candidate('return {"double": twice(x), "relu": launch(x)}, x.shape[0]', extra=double)
    r = shared_evaluate(STRUCTURED_REFERENCE, honest, cfg())
    assert r.verdict == "correct", (r.verdict, r.error)
    for wrong in ('return {"double": launch(x), "relu": twice(x)}, x.shape[0]',
                  'return {"relu": launch(x), "double": twice(x)}, x.shape[0] + 1'):
        r = shared_evaluate(STRUCTURED_REFERENCE, relu_candidate(wrong, extra=double), cfg())
        assert r.verdict == "incorrect", (wrong, r.verdict, r.error)


def test_a_sparse_output_is_a_bad_output_type_not_a_crash_of_the_evidence_code():
    """The data-flow log and the runner's facts read each output's storage, which a sparse tensor
    lacks: the candidate was `runtime_error` "forward raised" from the evaluator's own code."""
    r = run("1_ReLU.py", relu_candidate("return launch(x).to_sparse()"))
    assert_hack(r, "bad_output_type")


@pytest.mark.parametrize("snippet", [
    "import signal\nsignal.signal(signal.SIGUSR2, handler)",  # a handler is handed the running frame
    "from operator import attrgetter\nup = attrgetter('f_' + 'back')",
    "import operator\nup = operator.methodcaller(name)",
    "up = getattr(frame, 'f_' + 'back')",
    "up = getattr(frame, f'f_{rest}')",
    "up = getattr(frame, '{}back'.format('f_'))",  # a literal in the field
    "up = getattr(frame, '%sback' % 'f_')",
    "import bdb", "import cProfile", "import faulthandler",  # debuggers and profilers get frames
    "import pickle", "payload = b'csys\\n_getframe\\n'",  # objects rebuilt from data
    "up = getattr(frame, ('f_' + 'back',)[0])",  # an item of a name built where the call is
    "up = getattr(fn, f'{x}_globals__')", "up = getattr(tb, x + '_frame')",  # their ends
])
def test_the_source_scan_finds_the_routes_to_the_runners_frames(snippet):
    assert "reference_access" in {code for code, _ in integrity.static_scan(snippet)}, snippet


@pytest.mark.parametrize("snippet", ["future = torch.jit.fork(serve, slots)", "f = torch.jit._fork(serve)"])
def test_the_source_scan_finds_tasks_on_torchs_own_threads(snippet):
    """A scripted function forked onto torch's inter-op pool runs on a native thread that no Python
    thread check sees (a red-team candidate did the output's work there, inside a launch)."""
    assert "thread_spawned" in {code for code, _ in integrity.static_scan(snippet)}, snippet


@pytest.mark.parametrize("snippet", [
    "torch.backends.cuda.matmul.allow_tf32 = True",
    "mm = torch.backends.cuda.matmul\nmm.allow_fp16_reduced_precision_reduction = True",
    "torch.backends.cuda.matmul.fp32_precision = 'tf32'",
    "torch.set_float32_matmul_precision('high')",
    "setattr(torch.backends.cudnn, 'allow_tf32', True)",
    "from torch._C import _set_cublas_allow_tf32",
    "torch._C._set_cudnn_allow_tf32(True)",
    "torch.set_flush_denormal(True)",
    "self.matmul.allow_tf32 = True",  # only a field of self itself is the module's own
    "flags = {'allow_tf32': True}",  # a flag's name held with another value than its default
])
def test_the_source_scan_finds_numerics_flags_set(snippet):
    """Flags that trade precision for speed: the reference is timed without them, and one turned on
    inside forward and off before it returns leaves nothing for the after-call snapshot to see."""
    assert "global_state_changed" in {code for code, _ in integrity.static_scan(snippet)}, snippet


@pytest.mark.parametrize("snippet", [
    "for name in ('weight', 'bias'):\n    setattr(self, name, nn.Parameter(getattr(ref, name).clone()))",
    "def forward(self, x):\n    return self._dispatch(x)",  # a helper's name is not one of torch's mode readers
    "acc += tl.dot(a, b, allow_tf32=False)",  # Triton's own keyword
    "torch.backends.cuda.matmul.allow_tf32 = False",  # its default
    "tf32 = torch.backends.cuda.matmul.allow_tf32",  # read only
    "torch.set_float32_matmul_precision('highest')",  # its default
    "for i in range(3):\n    setattr(self, f'fc{i}', nn.Linear(4, 4))\n    y = getattr(self, f'fc{i}')(y)",
    "torch.backends.cudnn.benchmark = False",  # its default; the state check judges what is left
    "torch.backends.cudnn.deterministic = True",  # can only cost the candidate time
    "w = getattr(self.gru, 'weight_ih_l%d' % layer)",  # the ways models loop over an RNN's weights
    "w = getattr(self.lstm, 'weight_hh_l' + str(layer))",
    "w = getattr(self.lstm, 'bias_ih_l{}'.format(layer))",
    "layer = getattr(self, self.layer_names[i])",  # as open as the name held in a variable
    "w = getattr(self, f'conv{i}_{j}')",  # its literal beginning rules out every frame-reaching name
    "w = getattr(self, f'{name}_wt')\nb = getattr(self, name + '_bias')\nm = getattr(self.seq, str(i))",
    "self.allow_tf32 = allow_tf32",  # the module's own setting, handed to tl.dot
    "KERNEL_OPTS = {'allow_tf32': False, 'BM': 16}",  # options for a kernel's own parameter, at the default
    "def relu_kernel(x_ptr):\n    'aten::relu replacement: one block per program.'",  # prose
])
def test_the_source_scan_passes_what_honest_kernels_write(snippet):
    assert integrity.static_scan(snippet) == [], snippet


@pytest.mark.parametrize("snippet", [
    "torch.relu, _ = fake_relu, 0",  # a tuple target
    "[tl.tensor.__add__] = [fake_add]",
    "for torch.relu in [fake_relu]:\n    pass",
    "with hook() as torch.nn.functional.gelu:\n    pass",
    "del torch.backends.cudnn.benchmark",
    "torch.backends.cuda.matmul.allow_tf32, x = True, 1",  # a numerics flag, not by a plain assignment
    "lib.impl('aten::relu', fast_relu)",  # an operator's name
])
def test_the_source_scan_finds_torch_or_triton_rebound_in_any_form(snippet):
    assert "patched_function" in {code for code, _ in integrity.static_scan(snippet)}, snippet


MSE_REFERENCE = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, predictions, targets):
        return torch.mean((predictions - targets) ** 2)


def get_inputs():
    return [torch.rand(16, 300), torch.rand(16, 300)]


def get_init_inputs():
    return []
'''


def _mse_through_the_host(finish: str) -> str:
    """An MSE whose kernel sums squared differences in parts; `finish` makes the scalar output
    from `total` (those partial sums read back to Python) and the inputs."""
    return textwrap.dedent('''
        import torch
        import torch.nn as nn
        import triton
        import triton.language as tl


        @triton.jit
        def squared_error_parts(p_ptr, t_ptr, part_ptr, n, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            offs = pid * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            d = tl.load(p_ptr + offs, mask=m, other=0.0) - tl.load(t_ptr + offs, mask=m, other=0.0)
            tl.store(part_ptr + pid, tl.sum(d * d, axis=0))


        class ModelNew(nn.Module):
            def forward(self, predictions, targets):
                n = predictions.numel()
                parts = torch.empty(triton.cdiv(n, 1024), device=predictions.device, dtype=torch.float32)
                squared_error_parts[(parts.numel(),)](predictions, targets, parts, n, BLOCK=1024)
                total = float(parts.double().sum().item())
                return FINISH
        ''').replace("FINISH", finish)


def test_a_scalar_finished_on_the_host_is_made_of_the_kernels_work():
    """`item()` then `torch.tensor(...)`: the data flow follows the value through the host, so the
    kernel that summed the parts did the output's work; a kernel whose host value the output only
    pretends to use (times zero) is still a decoy (its counterfactual leaves the output right)."""
    honest = _mse_through_the_host("torch.tensor(total / n, dtype=torch.float32, device=predictions.device)")
    r = shared_evaluate(MSE_REFERENCE, honest, cfg())
    assert r.verdict == "correct" and not r.hacks, (r.verdict, r.hacks, r.error)
    decoy = _mse_through_the_host("torch.mean((predictions - targets) ** 2) + torch.tensor(0.0 * total)")
    assert_hack(shared_evaluate(MSE_REFERENCE, decoy, cfg()), "decoy_kernel")


FLIP_REFERENCE = MSE_REFERENCE.replace("return torch.mean((predictions - targets) ** 2)", "return predictions.flip(-1)") \
    .replace("torch.rand(16, 300), torch.rand(16, 300)", "torch.rand(16, 256), torch.rand(16, 256)")  # 4 rows a block

FLIP_IN_PLACE = textwrap.dedent('''
    import torch
    import torch.nn as nn
    import triton
    import triton.language as tl


    @triton.jit
    def reverse_rows_in_place(x_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        left = tl.arange(0, BLOCK)
        keep = left < n_cols // 2
        right = n_cols - 1 - left
        a = tl.load(x_ptr + row * n_cols + left, mask=keep)
        b = tl.load(x_ptr + row * n_cols + right, mask=keep)
        tl.store(x_ptr + row * n_cols + left, b, mask=keep)
        tl.store(x_ptr + row * n_cols + right, a, mask=keep)


    class ModelNew(nn.Module):
        def forward(self, predictions, targets):
            out = predictions.clone()
            reverse_rows_in_place[(out.shape[0],)](out, out.shape[1], BLOCK=256)
            return out
    ''')


def test_a_kernel_that_moves_values_in_place_wrote_what_it_moved():
    """A reversal in place (the same values, moved within a 4 KiB block) is a write: the launch's
    checksums weigh each word by its place, so on the signed trials the kernel made the output."""
    assert "predictions.flip(-1)" in FLIP_REFERENCE and "rand(16, 256)" in FLIP_REFERENCE
    r = shared_evaluate(FLIP_REFERENCE, FLIP_IN_PLACE, cfg())
    assert r.verdict == "correct" and not r.hacks, (r.verdict, r.hacks, r.error)
