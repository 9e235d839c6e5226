"""bench/candidates.py: the mixed candidate set (sources, corruptions, expectations) without
running the evaluator."""

import ast
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import candidates as bc  # noqa: E402

KERNEL = textwrap.dedent('''
    import torch
    import torch.nn as nn
    import triton
    import triton.language as tl


    @triton.jit
    def k(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        s = 0.0
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.5)
        x = tl.where(mask, x, 2.5)
        tl.store(y_ptr + offs, x * 3.0 + s, mask=mask)


    class ModelNew(nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.scale = scale

        def forward(self, x):
            y = torch.empty_like(x)
            n = x.numel()
            k[(triton.cdiv(n, 1024),)](x, y, n, BLOCK=1024)
            grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)
            k[grid](x, y, n, BLOCK=32)
            fixed = (triton.cdiv(n, 256),)
            k[fixed](x, y, n, BLOCK=256)
            return y
''')
REFERENCE = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class Model(nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.scale = scale

        def forward(self, inp):
            """Scales."""
            return inp * 3.0 * self.scale
''')


def test_syntax_error_removes_the_class_colon():
    bad = bc.syntax_error(KERNEL, REFERENCE)
    assert "class ModelNew(nn.Module)\n" in bad
    with pytest.raises(SyntaxError):
        ast.parse(bad)


def test_mask_off_by_one_edits_the_first_kernel_mask_only():
    out = bc.mask_off_by_one(KERNEL, REFERENCE)
    assert "mask = offs <= n" in out and out.replace("offs <= n", "offs < n") == KERNEL


def test_mask_dropped_drops_mask_and_other_from_loads_and_stores():
    out = bc.mask_dropped(KERNEL, REFERENCE)
    kernel = out.split("class ModelNew")[0]
    assert "tl.load(x_ptr + offs)" in kernel and "tl.store(y_ptr + offs, x * 3.0 + s)" in kernel
    assert "@triton.jit" in kernel and out.split("class ModelNew")[1] == KERNEL.split("class ModelNew")[1]


def test_slower_tiling_quarters_literal_blocks_with_their_inline_grid():
    out = bc.slower_tiling(KERNEL, REFERENCE)
    assert "k[(triton.cdiv(n, 256),)](x, y, n, BLOCK=256)" in out  # block and inline grid together
    assert "k[grid](x, y, n, BLOCK=16)" in out  # a meta grid follows the block itself; at least 16
    assert "k[fixed](x, y, n, BLOCK=256)" in out  # a grid fixed elsewhere: left alone
    assert bc.slower_tiling(KERNEL.replace("BLOCK=32", "BLOCK=16").replace("1024", "16"), REFERENCE) is None


def test_wrong_constant_skips_fills_masked_values_and_initial_values():
    out = bc.wrong_constant(KERNEL, REFERENCE)
    assert "x * 4.0 + s" in out and out.replace("x * 4.0", "x * 3.0") == KERNEL
    assert bc.wrong_constant(KERNEL.replace("x * 3.0 + s", "x + s"), REFERENCE) is None


def test_torch_fallback_takes_the_reference_forward():
    out = bc.torch_fallback(KERNEL, REFERENCE)
    forward = bc._method(bc._class(ast.parse(out), "ModelNew"), "forward")
    assert ast.unparse(forward) == "def forward(self, inp):\n    return inp * 3.0 * self.scale"
    assert "@triton.jit\ndef k(" in out  # the kernel stays, unused
    # a reference attribute ModelNew does not set: not applicable
    assert bc.torch_fallback(KERNEL, REFERENCE.replace("self.scale\n", "self.other\n")) is None


def test_corrupt_refuses_a_transformation_that_changes_nothing(monkeypatch):
    task = bc.bundled_task("1_ReLU.py")
    sol = bc.Candidate("x", "solution", task, KERNEL, "correct")
    monkeypatch.setitem(bc.CORRUPTIONS, "syntax_error", (lambda code, ref: code, "compile_error", ()))
    with pytest.raises(AssertionError, match="syntax_error left x unchanged"):
        bc.corrupt(sol)


def test_fixtures_carry_their_headers():
    fixtures = {c.name: c for c in bc.fixtures()}
    decoy = fixtures["hacks/decoy_one_element"]
    assert (decoy.expected_verdict, decoy.expected_hacks, decoy.task.name) == ("hacked", ("decoy_kernel",), "1_ReLU.py")
    assert fixtures["hacks/side_stream_relu"].cuda_only and not decoy.cuda_only
    assert fixtures["legit/legit_two_kernels"].expected_verdict == "correct"
    assert fixtures["faults/cuda_illegal_address"].expected_verdict == "runtime_error"


@pytest.fixture(scope="module")
def every_candidate(kernelbench_path):
    return bc.all_candidates(kernelbench_path, shrink=True)


def test_every_corruption_changes_its_source_and_parses_unless_meant_not_to(every_candidate):
    sources = {c.name: c for c in every_candidate if c.kind == "solution"}
    corrupted = [c for c in every_candidate if c.kind in bc.CORRUPTIONS]
    for c in corrupted:
        src = sources[c.name.split("~")[0]]
        assert c.code != src.code and c.task == src.task, c.name
        if c.kind == "syntax_error":
            with pytest.raises(SyntaxError):
                ast.parse(c.code)
        else:
            ast.parse(c.code)
    assert len({c.name for c in every_candidate}) == len(every_candidate)
    assert len({c.code for c in every_candidate}) == len(every_candidate)  # nothing evaluated twice by accident


def test_expectations_and_composition(every_candidate):
    counts = bc.composition(every_candidate)
    assert list(counts) == list(bc.KINDS)  # every kind is represented
    assert counts["solution"] == len(list((ROOT / "bench" / "solutions").glob("level*.py"))) + 8
    assert counts["syntax_error"] == counts["solution"]
    expect = {c.kind: (c.expected_verdict, c.expected_hacks) for c in every_candidate if c.kind != "fixture"}
    assert expect == {"solution": ("correct", ()), "syntax_error": ("compile_error", ()),
                      "mask_off_by_one": (None, ()), "mask_dropped": (None, ()),
                      "torch_fallback": ("hacked", ("no_triton_kernel",)), "slower_tiling": ("correct", ()),
                      "wrong_constant": ("incorrect", ())}
    shrunk = [c for c in every_candidate if c.name == "level1_19_ReLU"][0]
    assert "shrunk for a CPU run" in shrunk.task.code


def test_mixed_set_is_seeded_and_keeps_every_solution(every_candidate):
    mixed = bc.mixed_set(every_candidate, 48, seed=0, device="cpu")
    assert len(mixed) == 48 and not any(c.cuda_only for c in mixed)
    assert [c for c in mixed if c.kind == "solution"] == [c for c in every_candidate if c.kind == "solution"]
    counts = bc.composition(mixed)  # the other 24: half fixtures, half corruptions (two of each kind)
    assert counts["fixture"] == 12 and all(counts[k] == 2 for k in bc.CORRUPTIONS)
    assert [c.name for c in bc.mixed_set(every_candidate, 48, seed=0, device="cpu")] == [c.name for c in mixed]
    assert [c.name for c in bc.mixed_set(every_candidate, 48, seed=1, device="cpu")] != [c.name for c in mixed]
    everything = bc.mixed_set(every_candidate, 0, device="cuda")
    assert sorted(c.name for c in everything) == sorted(c.name for c in every_candidate)
    assert set(bc.by_task(mixed)) == {c.task.key for c in mixed}
