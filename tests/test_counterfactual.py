"""The counterfactual launch's perturbation (`drkernel.counterfactual`), without a runner."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from drkernel.counterfactual import perturbed, scale
from drkernel.triton_source import Kernel

KERNEL = Kernel(name="k", params=("x_ptr", "t_ptr", "out_ptr", "idx_ptr"), stores=frozenset({"t_ptr", "out_ptr"}),
                loads=frozenset({"x_ptr", "t_ptr", "idx_ptr"}))


def _args():
    x = torch.randn(64)
    x[:3] = torch.tensor([-0.0, 1e-42, float("-inf")])  # a signed zero, a denormal, an infinity (a mask)
    return {"x_ptr": x, "t_ptr": torch.randn(64), "out_ptr": torch.randn(64), "idx_ptr": torch.randperm(64)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.is_floating_point() else t


def _scaled(t: torch.Tensor, phase: int) -> torch.Tensor:
    return scale(t.clone(), phase)


def test_read_storages_are_perturbed_inside_and_restored_bit_for_bit():
    args = _args()
    before = {k: v.clone() for k, v in args.items()}
    with perturbed(args, KERNEL):
        assert torch.equal(args["x_ptr"], _scaled(before["x_ptr"], 0))
        assert torch.equal(args["t_ptr"], _scaled(before["t_ptr"], 1))  # a second storage starts elsewhere
        assert torch.equal(args["idx_ptr"], before["idx_ptr"].roll(32))  # integers: the same values, moved
        assert torch.equal(args["out_ptr"], before["out_ptr"])  # only written: not the launch's input
    for k in args:
        assert torch.equal(_bits(args[k]), _bits(before[k])), k


def test_the_perturbation_is_no_uniform_scaling():
    """Scale-invariant kernels (x / |x|, a ratio of two storages) must see the change."""
    x = torch.rand(64) + 0.5
    y = _scaled(x, 0)
    assert not torch.allclose(y / y.norm(), x / x.norm()) and not torch.allclose(y.abs() / y.abs().sum(),
                                                                                 x / x.sum())


def test_a_read_and_written_storage_keeps_what_the_launch_wrote_and_nothing_else():
    args = _args()
    t0 = args["t_ptr"].clone()
    with perturbed(args, KERNEL):
        args["t_ptr"][:32] = args["t_ptr"][:32] + 1.0  # the "launch" writes half, from perturbed data
    assert torch.equal(args["t_ptr"][:32], _scaled(t0, 1)[:32] + 1.0)
    assert torch.equal(args["t_ptr"][32:], t0[32:])


def test_a_storage_passed_as_a_read_and_a_written_parameter_counts_as_written():
    t = torch.randn(16)
    args = {"x_ptr": t, "out_ptr": t}  # an in-place kernel through two parameters
    t0 = t.clone()
    with perturbed(args, KERNEL):
        t[:8] = 7.0
    assert torch.equal(t[:8], torch.full((8,), 7.0)) and torch.equal(t[8:], t0[8:])


def test_a_strided_view_is_perturbed_through_its_storage_and_restored():
    base = torch.randn(8, 8)
    view, b0 = base[:, ::2], base.clone()
    with perturbed({"x_ptr": view}, KERNEL):  # its span: elements 0 to 62 of the storage
        assert torch.equal(base.flatten()[:63], _scaled(b0.flatten()[:63], 0))
        assert torch.equal(base.flatten()[63:], b0.flatten()[63:])
    assert torch.equal(base, b0)


def test_storages_that_scaling_would_not_bring_back_have_their_bytes_rolled():
    """Two dtypes on one range, a finite value scaling would overflow, a NaN (its payload): not
    scaled but rolled as bytes inside the launch (left alone, a kernel handed its input under a
    second dtype would read it unperturbed), and back bit for bit after it."""
    raw = torch.randn(8)
    huge = torch.tensor([1.0, 3e38])
    nan = torch.tensor([1.0, float("nan")])
    saved = [raw.clone(), huge.clone(), nan.clone()]
    with perturbed({"x_ptr": raw, "idx_ptr": raw.view(torch.int32)}, KERNEL):
        assert torch.equal(raw, saved[0].roll(4))  # 32 bytes rolled by 16: four floats
    assert torch.equal(_bits(raw), _bits(saved[0]))
    for t, t0 in zip((huge, nan), saved[1:]):
        with perturbed({"x_ptr": t}, KERNEL):
            assert torch.equal(_bits(t), _bits(t0.roll(1)))
        assert torch.equal(_bits(t), _bits(t0))


def test_arguments_side_by_side_in_one_storage_are_perturbed_apart():
    """Inputs in the judge's arena share one storage, of several dtypes, with bytes between them
    that are nobody's (here NaN): each is perturbed on its own."""
    arena = torch.full((48,), float("nan"))
    a = arena[0:16]
    ids = arena[24:40].view(torch.int64)  # 8 int64 values, bytes 96 to 160
    a.copy_(torch.randn(16))
    ids.copy_(torch.arange(8))
    a0, ids0 = a.clone(), ids.clone()
    with perturbed({"x_ptr": a, "idx_ptr": ids}, Kernel(name="k", params=("x_ptr", "idx_ptr"), stores=frozenset())):
        assert torch.equal(a, _scaled(a0, 0)) and torch.equal(ids, ids0.roll(4))
        assert arena[16:24].isnan().all()
    assert torch.equal(a, a0) and torch.equal(ids, ids0)


class _Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_candidate_dispatch_mode_sees_no_perturbation():
    args = _args()
    with _Seen() as seen:
        with perturbed(args, KERNEL):
            pass
    assert seen.ops == []


def test_without_source_facts_every_argument_is_read_and_written():
    args = _args()
    out0 = args["out_ptr"].clone()
    with perturbed(args, None):
        assert torch.equal(args["out_ptr"], _scaled(out0, 2))  # the third storage of four
    assert torch.equal(args["out_ptr"], out0)
