"""Evaluator verdicts on CPU (Triton interpreter): legit candidates, failures, crashes, the CLI."""

import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from drkernel.evaluator import EvalConfig, EvalResult, Evaluator

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "drkernel" / "data" / "tasks"
SOLUTIONS = ROOT / "drkernel" / "data" / "solutions"
FAST = dict(device="cpu", trials=2, cpu_perf_trials=1, warmup=1, timeout=120.0)

HEADER = textwrap.dedent('''
    import torch
    import torch.nn as nn
    import triton
    import triton.language as tl


    @triton.jit
    def relu_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m)
        tl.store(y_ptr + offs, tl.maximum(x, 0.0), mask=m)


    def launch(x):
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        relu_kernel[(triton.cdiv(n, 1024),)](x, y, n, BLOCK=1024)
        return y
''')


def relu_candidate(forward_body: str, extra: str = "", init: str = "def __init__(self):\n        super().__init__()") -> str:
    body = textwrap.indent(textwrap.dedent(forward_body).strip("\n"), " " * 8)
    return (HEADER + textwrap.dedent(extra) + "\n\nclass ModelNew(nn.Module):\n    " + init
            + "\n\n    def forward(self, x):\n" + body + "\n")


LEGIT_RELU = relu_candidate("return launch(x)")

EMBED = textwrap.dedent('''
    import torch
    import torch.nn as nn
    import triton
    import triton.language as tl


    @triton.jit
    def gather_kernel(ids_ptr, table_ptr, out_ptr, D: tl.constexpr):
        row = tl.program_id(0)
        idx = tl.load(ids_ptr + row)
        cols = tl.arange(0, D)
        vals = tl.load(table_ptr + idx * D + cols)
        tl.store(out_ptr + row * D + cols, vals)


    class ModelNew(nn.Module):
        def __init__(self, num_embeddings, dim):
            super().__init__()
            self.table = nn.Parameter(torch.randn(num_embeddings, dim))

        def forward(self, ids):
            out = torch.empty(ids.numel(), self.table.shape[1], dtype=self.table.dtype)
            gather_kernel[(ids.numel(),)](ids, self.table.detach().contiguous(), out, D=self.table.shape[1])
            return out
''')


def cfg(**kw):
    d = dict(FAST)
    d.update(kw)
    return EvalConfig(**d)


_SHARED: list[tuple[str, Evaluator]] = []  # the evaluator of the last configuration used


def shared_evaluate_many(pairs, config: EvalConfig) -> list[EvalResult]:
    """Evaluations through an Evaluator kept while the configuration stays the same: its fork
    server starts once (about 3 s here), as in training, where one Evaluator judges every turn."""
    if not _SHARED or _SHARED[0][0] != repr(config):
        if _SHARED:
            _SHARED.pop()[1].close()
        _SHARED.append((repr(config), Evaluator(config, workers=1)))
    return _SHARED[0][1].evaluate_many(pairs)


def shared_evaluate(reference, candidate, config: EvalConfig) -> EvalResult:
    return shared_evaluate_many([(reference, candidate)], config)[0]


def run(task: str, cand: str, **kw) -> EvalResult:
    return shared_evaluate(str(TASKS / task), cand, cfg(**kw))


def test_legit_relu_correct():
    r = run("1_ReLU.py", LEGIT_RELU)
    assert r.verdict == "correct", r.error
    assert r.correct and r.compiled and not r.hacks
    assert r.timing == "cpu_wall" and r.speedup is not None and r.ref_ms and r.candidate_ms
    assert r.trials_passed == r.trials >= 2
    assert "relu_kernel" in r.details["launched_kernels"]
    # the reference is timed alone (guard) and then interleaved with the candidate (the speedup)
    assert r.details["ref_ms_isolated"] > 0
    assert {"reference_alone", "correctness", "timing", "profiling"} <= set(r.details["phase_s"])
    # every timed pair's two times, in order, for studies of the timing's noise (bench/ref_self.py)
    timed = r.details["timed_ms"]
    assert len(timed["reference"]) == len(timed["candidate"]) == r.details["timed_calls"]
    assert statistics.median(timed["reference"]) == pytest.approx(r.ref_ms, rel=1e-3)


def test_integer_input_task():
    r = run("7_Embedding_Gather.py", EMBED)
    assert r.verdict == "correct", r.error


def _solutions():
    return sorted(SOLUTIONS.glob("*.py")) if SOLUTIONS.is_dir() else []


@pytest.mark.parametrize("sol", _solutions(), ids=lambda p: p.name)
def test_bundled_solutions_correct_no_hacks(sol):
    task = TASKS / sol.name
    if not task.is_file():
        pytest.skip("no matching task")
    r = shared_evaluate(str(task), str(sol), cfg())
    assert r.verdict == "correct", (r.verdict, r.hacks, r.error)
    assert r.hacks == []


def test_syntax_error():
    r = run("1_ReLU.py", "import torch\nclass ModelNew(:\n    pass\n")
    assert r.verdict == "compile_error" and "line 2" in r.error


def test_missing_modelnew():
    r = run("1_ReLU.py", HEADER + "\nclass Other(nn.Module):\n    pass\n")
    assert r.verdict == "compile_error" and "ModelNew" in r.error


def test_import_error_is_compile_error():
    r = run("1_ReLU.py", "import does_not_exist_xyz\n" + LEGIT_RELU)
    assert r.verdict == "compile_error"


def test_exception_in_forward():
    r = run("1_ReLU.py", relu_candidate("raise ValueError('boom')"))
    assert r.verdict == "runtime_error" and "boom" in r.error


def test_wrong_result():
    r = run("1_ReLU.py", relu_candidate("return launch(x) + 0.5"))
    assert r.verdict == "incorrect" and not r.correct and r.speedup is None
    assert "trial" in r.error


def test_wrong_constructor():
    r = run("1_ReLU.py", relu_candidate("return launch(x)", init="def __init__(self, a, b):\n        super().__init__()"))
    assert r.verdict == "runtime_error" and "constructor" in r.error


def test_hang_times_out():
    r = run("1_ReLU.py", relu_candidate("while True:\n    pass"), timeout=5.0)
    assert r.verdict == "timeout"


def test_os_exit_crashes():
    r = run("1_ReLU.py", relu_candidate("import os\nos._exit(0)"))
    assert r.verdict == "crashed" and "without a result" in r.error


def test_segfault_crashes():
    # ctypes is flagged by the static scan, so reach it through a runtime import name
    r = run("1_ReLU.py", relu_candidate("import os\nos.kill(os.getpid(), 11)  # SIGSEGV (the signal module is a static finding)"))
    assert r.verdict == "crashed" and "SIGSEGV" in r.error


def test_memory_hog_crashes():
    r = run("1_ReLU.py", relu_candidate("big = [bytearray(64 * 1024 * 1024) for _ in range(200)]\nreturn launch(x)"),
            max_rss_mb=3000)
    assert r.verdict in ("crashed", "runtime_error"), r.verdict
    if r.verdict == "crashed":
        assert "oom" in r.error or "memory" in r.error.lower() or "killed" in r.error


def test_huge_stdout_still_verdict():
    r = run("1_ReLU.py", relu_candidate("print('x' * 5_000_000)\nreturn launch(x)"))
    assert r.verdict == "correct", r.error
    assert len(r.stdout) < 100_000


def test_next_evaluation_after_bad_case_is_correct():
    run("1_ReLU.py", relu_candidate("import os\nos._exit(3)"))
    assert run("1_ReLU.py", LEGIT_RELU).verdict == "correct"


def test_result_roundtrip():
    r = EvalResult(verdict="hacked", hacks=["output_cached"], speedup=None, details={"a": [1, 2]}, kernels=[{"n": 1}])
    back = EvalResult.from_dict(json.loads(r.to_json()))
    assert back == r


def _cli(*args):
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-m", "drkernel.evaluator", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)


def test_cli_json_and_exit_codes(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(relu_candidate("return launch(x) * 2.0"))
    p = _cli("--reference", str(TASKS / "1_ReLU.py"), "--candidate", str(bad), "--device", "cpu", "--trials", "2",
             "--perf-trials", "2", "--timeout", "120", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout.strip().splitlines()[-1])
    for k in ("verdict", "compiled", "correct", "speedup", "ref_ms", "candidate_ms", "hacks", "error",
              "triton_time_share", "kernels", "reward"):
        assert k in d
    assert d["verdict"] == "incorrect"
    p2 = _cli("--reference", str(TASKS / "1_ReLU.py"), "--candidate", str(tmp_path / "missing.py"), "--json")
    assert p2.returncode == 2 and "no such file" in p2.stderr
    p3 = _cli("--reference", str(TASKS / "1_ReLU.py"), "--candidate", str(bad), "--bogus")
    assert p3.returncode == 2


def test_require_triton_off_measures_torch_candidates_only_when_asked():
    """The reference timed against itself: hacked by default (no Triton), correct when the
    caller explicitly measures torch-only candidates (`require_triton=False`)."""
    ref = (TASKS / "1_ReLU.py").read_text()
    as_candidate = ref + "\n\nclass ModelNew(Model):\n    pass\n"
    strict = shared_evaluate(ref, as_candidate, cfg())
    assert strict.verdict == "hacked" and "no_triton_kernel" in strict.hacks
    loose = shared_evaluate(ref, as_candidate, cfg(require_triton=False))
    assert loose.verdict == "correct", (loose.verdict, loose.hacks, loose.error)
    assert loose.speedup is not None and loose.speedup > 0


DROPOUT_TASK = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class Model(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.drop = nn.Dropout(p)

        def forward(self, x):
            return torch.softmax(self.drop(x * 2.0), dim=1)


    def get_inputs():
        return [torch.rand(8, 256)]


    def get_init_inputs():
        return [0.5]
''')


def test_training_mode_dropout_reference_matches_its_copy():
    """KernelBench's dropout problems run in training mode: the reference and the candidate
    draw their masks under the same per-call seed, so a copy of the reference is correct, and
    a candidate that leaves dropout out is still wrong."""
    copy = shared_evaluate(DROPOUT_TASK, DROPOUT_TASK + "\n\nclass ModelNew(Model):\n    pass\n", cfg(require_triton=False))
    assert copy.verdict == "correct", (copy.verdict, copy.hacks, copy.error)
    no_dropout = DROPOUT_TASK + textwrap.dedent('''

        class ModelNew(Model):
            def forward(self, x):
                return torch.softmax(x * 2.0, dim=1)
    ''')
    assert shared_evaluate(DROPOUT_TASK, no_dropout, cfg(require_triton=False)).verdict == "incorrect"


def test_chunked_comparison_matches_whole_tensor(monkeypatch):
    """Outputs are compared in float64 chunks (KernelBench outputs reach billions of elements);
    the verdict and the error measures must not depend on the chunk size."""
    import torch
    from drkernel import compare as ev

    g = torch.Generator().manual_seed(0)
    r = torch.randn(1000, generator=g)
    c = r + 1e-3 * torch.randn(1000, generator=g)
    c[17] = r[17] + 0.5
    whole = ev._compare_tensor(c, r, 1e-4, 1e-4, 1e-3)
    monkeypatch.setattr(ev, "_CHUNK", 64)
    chunked = ev._compare_tensor(c, r, 1e-4, 1e-4, 1e-3)
    assert chunked.ok is whole.ok is False and chunked.why == whole.why
    for k in ("max_abs", "max_rel", "rel_l2"):
        assert abs(getattr(chunked, k) - getattr(whole, k)) <= 1e-12 * max(1.0, getattr(whole, k)), k
    zeros_like_answer = torch.zeros(1000)
    tiny_ref = torch.full((1000,), 1e-6) + 1e-7 * torch.rand(1000, generator=g)
    assert ev.degenerate(zeros_like_answer, tiny_ref, [torch.rand(5)], EvalConfig()) is not None


def test_a_strided_reference_output_is_compared_element_by_element():
    """A reference that returns one column of a matrix (a 1-D view with a stride): the comparison
    kernels read memory in order, so a view must be made contiguous first, or the first 64 elements
    of row 0 would pass for the column."""
    import torch
    from drkernel import compare as ev
    m = 2 * torch.rand(64, 128)
    column = m[:, 0]
    assert ev.compare(column.clone(), column, EvalConfig()).ok
    assert not ev.compare(m.reshape(-1)[:64].clone(), column, EvalConfig()).ok
    assert ev.all_finite(column) and ev.degenerate(column.clone(), column, [m], EvalConfig()) is None


def test_fast_comparison_agrees_with_the_detailed_one(monkeypatch):
    """`_compare_tensor` decides passing outputs in one kernel pass and falls back to the detailed
    float64 pass for anything that fails or is non-finite; both must give the same verdict and the
    same error measures, whatever the kernel's grid (one block or many blocks per program) and the
    detailed pass's chunk, and for half, bf16, complex and float64 outputs."""
    import torch
    from drkernel import compare as ev
    from drkernel import compare_kernels

    g = torch.Generator().manual_seed(1)
    r = torch.randn(3000, generator=g)
    near = r + 2e-5 * torch.randn(3000, generator=g)  # inside atol=rtol=1e-4
    cases = {"pass": (near, r), "fail_one": (near.clone().index_fill_(0, torch.tensor([5]), 9.0), r)}
    nan_r = r.clone()
    nan_r[[3, 70]] = float("nan")
    nan_c = near.clone()
    nan_c[[3, 70]] = float("nan")
    cases["nan_same"] = (nan_c, nan_r)
    cases["nan_moved"] = (nan_c.roll(1), nan_r)
    inf_r = r.clone()
    inf_r[9] = float("inf")
    cases["inf_same"] = (torch.where(torch.isinf(inf_r), inf_r, near), inf_r)
    cases["inf_sign"] = (torch.where(torch.isinf(inf_r), -inf_r, near), inf_r)
    cases["fp16"] = (near.half(), r.half())
    cases["bf16"] = (near.bfloat16(), r.bfloat16())
    cases["fp64_l2"] = ((r + 5e-3 * r.abs().mean()).double(), r.double())
    cases["complex"] = (torch.complex(near, near), torch.complex(r, r))
    for chunk, programs, block in ((1 << 26, 4096, 1 << 16), (128, 3, 64)):
        monkeypatch.setattr(ev, "_CHUNK", chunk)
        monkeypatch.setattr(compare_kernels, "_PROGRAMS", programs)
        monkeypatch.setattr(compare_kernels, "_BLOCK", {"cpu": block, "cuda": block})
        for name, (c, ref) in cases.items():
            tol = 1e-2 if ref.dtype in (torch.float16, torch.bfloat16) else 1e-4
            fast = ev._compare_tensor(c, ref, tol, tol, 1e-3)
            if ref.is_complex():
                c, ref = torch.view_as_real(c), torch.view_as_real(ref)
            slow = ev._compare_tensor_slow(c, ref, tol, tol, 1e-3)
            assert fast.ok is slow.ok, (name, chunk, fast, slow)
            assert fast.why == slow.why, (name, chunk)
            for k in ("max_abs", "max_rel", "rel_l2"):
                f, w = getattr(fast, k), getattr(slow, k)
                assert abs(f - w) <= 1e-6 * max(1.0, w), (name, chunk, k, f, w)
    expected = {"pass": True, "fail_one": False, "nan_same": True, "nan_moved": False, "inf_same": True,
                "inf_sign": False, "fp16": True, "bf16": True, "fp64_l2": False, "complex": True}
    got = {n: ev._compare_tensor(c, ref, *([1e-2] * 2 if n in ("fp16", "bf16") else [1e-4] * 2), 1e-3).ok
           for n, (c, ref) in cases.items()}
    assert got == expected

    def no_slow_pass(*a):
        raise AssertionError("a passing finite output must be decided by the single kernel pass")
    monkeypatch.setattr(ev, "_compare_tensor_slow", no_slow_pass)
    assert ev._compare_tensor(near, r, 1e-4, 1e-4, 1e-3).ok


@pytest.mark.parametrize("programs,block", [(4096, 1 << 16), (3, 64)])
def test_degenerate_check_flags_trivial_answers_only(monkeypatch, programs, block):
    """A constant answer that passes because the reference barely varies is flagged; the same
    reference answered properly, and a varying reference answered with zeros, are not (with one
    block per program and with many)."""
    import torch
    from drkernel import compare as ev
    from drkernel import compare_kernels

    monkeypatch.setattr(compare_kernels, "_PROGRAMS", programs)
    monkeypatch.setattr(compare_kernels, "_BLOCK", {"cpu": block, "cuda": block})
    cfg = EvalConfig()
    g = torch.Generator().manual_seed(2)
    flat_ref = 3.0 + 1e-5 * torch.rand(4000, generator=g)  # every value within tolerance of 3.0
    assert "a constant" in (ev.degenerate(torch.full((4000,), float(flat_ref.mean())), flat_ref, [], cfg) or "")
    assert ev.degenerate(flat_ref.clone(), flat_ref, [], cfg) is None
    x = torch.randn(4000, generator=g)
    near_identity = x + 1e-6 * torch.randn(4000, generator=g)
    assert "input 0" in (ev.degenerate(x.clone(), near_identity, [x], cfg) or "")
    varied = torch.randn(4000, generator=g)
    assert ev.degenerate(varied.clone(), varied, [x], cfg) is None


def test_a_batch_item_that_is_no_source_fails_alone():
    """evaluate_many over a batch where one candidate is None (no code) or a number: that item is
    `compile_error`, its neighbours are judged, bytes are source; a malformed pair is a TypeError
    that says what the call takes."""
    ref = str(TASKS / "1_ReLU.py")
    assert shared_evaluate(ref, LEGIT_RELU, cfg()).verdict == "correct"
    evaluator = _SHARED[0][1]
    results = evaluator.evaluate_many([(ref, None), (ref, 5), (ref, LEGIT_RELU.encode()),
                                       (ref, LEGIT_RELU + "# a lone surrogate from a JSON reply: \udcff\n")])
    assert [r.verdict for r in results] == ["compile_error", "compile_error", "correct", "correct"]
    with pytest.raises(TypeError, match=r"takes \(reference, candidate\) pairs"):
        evaluator.evaluate_many([(ref,)])


@pytest.mark.parametrize("bad, says", [({"trials": 0}, r"trials must be in \[1, 1000\]"), ({"device": "tpu"}, "device must be"),
                                       ({"timeout": float("nan")}, "timeout must be a finite number"),
                                       ({"trials": 2.5}, "trials must be int, got 2.5"),
                                       ({"warmup": None}, "warmup must be int, got None"),
                                       ({"timeout": "30"}, "timeout must be float, got '30'")])
def test_an_evaluator_with_a_setting_out_of_its_limits_is_refused_before_it_starts(bad, says):
    """The limits the scripts check hold for library callers too: one clear error, not a
    `crashed` verdict from inside the sandbox for every candidate."""
    from drkernel.config import ConfigError

    with pytest.raises(ConfigError, match=f"^EvalConfig: {says}"):
        Evaluator(EvalConfig(**bad))


def test_an_evaluator_for_a_gpu_this_machine_lacks_is_refused_before_it_starts(monkeypatch):
    from drkernel.evaluator import DeviceError
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="no GPU is visible"):
        Evaluator(EvalConfig(device="cuda"))


def test_the_detailed_comparison_holds_a_few_chunks_whatever_the_output_size(monkeypatch):
    """A failing multi-GB output is compared chunk by chunk: the float64 temporaries at the peak
    are a few chunks' worth, the same for a 10x larger output (they once held 4 GiB beside a
    full-size problem's judge)."""
    import torch

    from drkernel import compare as ev
    from drkernel.gpumemory import LiveBytes

    monkeypatch.setattr(ev, "_CHUNK", 1000)
    peaks = []
    for n in (20_000, 200_000):
        r = torch.randn(n, generator=torch.Generator().manual_seed(n))
        c = r + 0.1
        with LiveBytes() as live:
            assert not ev._compare_tensor(c, r, 1e-4, 1e-4, 1e-3).ok
        peaks.append(live.peak)
    assert max(peaks) <= 8 * 1000 * 8  # float64 chunk bytes; the output alone is 800,000 bytes


def test_a_candidate_nested_too_deeply_to_parse_fails_alone():
    """Nesting past Python's parser (RecursionError, then MemoryError) is that candidate's
    compile_error; the batch goes on."""
    ref = str(TASKS / "1_ReLU.py")
    deep = [relu_candidate("return " + "-" * n + "launch(x)") for n in (5000, 100000)]
    results = shared_evaluate_many([(ref, deep[0]), (ref, LEGIT_RELU), (ref, deep[1])], cfg())
    assert [r.verdict for r in results] == ["compile_error", "correct", "compile_error"], [r.error for r in results]
    assert "RecursionError" in results[0].error and "MemoryError" in results[2].error


def test_a_coding_declaration_is_refused_only_where_python_would_read_other_code():
    """tests/fixtures/hacks/coding_cookie_hides_code.py hides a line in UTF-7; an ASCII file that
    declares Latin-1 reads the same either way."""
    from drkernel.evaluator import _foreign_encoding
    assert _foreign_encoding("# coding: latin-1\nx = 1\n") is None
    assert _foreign_encoding("#!/usr/bin/env python\n# -*- coding: utf-8 -*-\nx = 'é'\n") is None
    assert "other code" in _foreign_encoding("# coding: latin-1\nx = 'é'\n")
    assert "unknown encoding" in _foreign_encoding("# coding: nonsense\nx = 1\n")
    assert "not a text encoding" in _foreign_encoding("# coding: hex\nx = 1\n")  # raised LookupError


def test_a_candidate_file_whose_text_is_a_path_is_judged_as_that_text(tmp_path):
    """Read once: the text of a file naming another file is not read again as a path."""
    pointer = tmp_path / "pointer.py"
    pointer.write_text(str(SOLUTIONS / "1_ReLU.py"))
    r = shared_evaluate(str(TASKS / "1_ReLU.py"), str(pointer), cfg())
    assert r.verdict == "compile_error", (r.verdict, r.error)


def test_a_path_that_does_not_exist_is_its_items_error_not_source_text(tmp_path):
    """A misspelt path was read as one line of source (a SyntaxError blamed on the code)."""
    from pathlib import Path
    ok = str(TASKS / "1_ReLU.py")
    r_missing, c_missing, c_dir, good = shared_evaluate_many(
        [(Path(tmp_path / "nope.py"), LEGIT_RELU), (ok, str(tmp_path / "cand.py")), (ok, str(tmp_path)),
         (ok, LEGIT_RELU)], cfg())
    assert r_missing.verdict == c_missing.verdict == c_dir.verdict == "runtime_error"
    assert "no such file" in r_missing.error and "no such file" in c_missing.error and "not a regular file" in c_dir.error
    assert good.verdict == "correct", good.error


def test_references_that_exit_or_return_none_are_reference_errors():
    """The candidate was blamed: `crashed` for a reference that exits while imported, `hacked
    bad_output_type` for one whose forward returns None."""
    code = (TASKS / "1_ReLU.py").read_text()
    exits = "import sys\nsys.exit(3)\n" + code
    ends_process = "import os\nos._exit(3)\n" + code  # no exception: the judge's process just ends
    none = code.replace("return torch.relu(x)", "torch.relu(x)\n        return None")
    assert none != code
    # whatever its get_inputs or forward raises, SystemExit and KeyboardInterrupt included
    inputs_exit = code.replace("def get_inputs():", "def get_inputs():\n    raise SystemExit(0)")
    forward_interrupt = code.replace("return torch.relu(x)", "raise KeyboardInterrupt")
    # a batch of 0: the honest kernel launched over an empty grid was `no_triton_kernel`
    empty = code.replace("batch_size = 16", "batch_size = 0")
    assert inputs_exit != code and forward_interrupt != code and empty != code
    for ref in (exits, ends_process, none, inputs_exit, forward_interrupt, empty):
        r = shared_evaluate_many([(ref, LEGIT_RELU)], cfg())[0]
        assert r.verdict == "reference_error", (r.verdict, r.error)
    assert "output is empty ((0, 256))" in r.error


def test_a_closed_evaluator_refuses_work_instead_of_reporting_crashes():
    with Evaluator(cfg(), workers=1) as ev:
        pass
    with pytest.raises(RuntimeError, match="closed"):
        ev.evaluate(str(TASKS / "1_ReLU.py"), LEGIT_RELU)


def test_an_output_that_is_zero_in_exact_arithmetic_is_judged_by_its_tolerance_not_its_noise():
    """The mean of a group just normalised is 0: the reference holds rounding noise (~1e-8) and an
    honest kernel other noise, so their relative L2 distance is ~1 while every element is far
    inside atol. Noise below a thousandth of atol is no error; zeros for a small but real output
    (a softmax over many columns) still fail the relative L2 test."""
    import torch

    from drkernel import compare as ev

    g = torch.Generator().manual_seed(0)
    noise = torch.randn(4096, generator=g) * 1e-8
    assert ev._compare_tensor(torch.randn(4096, generator=g) * 1e-8, noise, 1e-4, 1e-4, 1e-3).ok
    small = torch.softmax(torch.randn(65536, generator=g) * 0.1, dim=0)  # every value far below atol
    why = ev._compare_tensor(torch.zeros(65536), small, 1e-4, 1e-4, 1e-3).why
    assert "relative L2" in why, why
