"""The counterfactual launch's perturbation (`drkernel.counterfactual`), without a runner."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from drkernel.counterfactual import FACTORS, perturbed
from drkernel.triton_source import Kernel

KERNEL = Kernel(name="k", params=("x_ptr", "t_ptr", "out_ptr", "idx_ptr"), stores=frozenset({"t_ptr", "out_ptr"}),
                loads=frozenset({"x_ptr", "t_ptr", "idx_ptr"}))


def _args():
    x = torch.randn(64)
    x[:2] = torch.tensor([-0.0, 1e-42])  # a signed zero, a denormal
    return {"x_ptr": x, "t_ptr": torch.randn(64), "out_ptr": torch.randn(64), "idx_ptr": torch.randperm(64)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.is_floating_point() else t


def test_read_storages_are_perturbed_inside_and_restored_bit_for_bit():
    args = _args()
    before = {k: v.clone() for k, v in args.items()}
    with perturbed(args, KERNEL):
        assert torch.equal(args["x_ptr"], before["x_ptr"] * FACTORS[0])
        assert torch.equal(args["t_ptr"], before["t_ptr"] * FACTORS[1])  # a second storage, another factor
        assert torch.equal(args["idx_ptr"], before["idx_ptr"].roll(32))  # integers: the same values, moved
        assert torch.equal(args["out_ptr"], before["out_ptr"])  # only written: not the launch's input
    for k in args:
        assert torch.equal(_bits(args[k]), _bits(before[k])), k


def test_a_read_and_written_storage_keeps_what_the_launch_wrote_and_nothing_else():
    args = _args()
    t0 = args["t_ptr"].clone()
    with perturbed(args, KERNEL):
        args["t_ptr"][:32] = args["t_ptr"][:32] + 1.0  # the "launch" writes half, from perturbed data
    assert torch.equal(args["t_ptr"][:32], t0[:32] * FACTORS[1] + 1.0)
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
    with perturbed({"x_ptr": view}, KERNEL):
        assert torch.equal(base[:, ::2], b0[:, ::2] * FACTORS[0])
    assert torch.equal(base, b0)


def test_storages_that_would_not_come_back_bit_for_bit_are_left_alone():
    """Two dtypes on one storage, a value scaling would overflow, a NaN (its payload): untouched."""
    raw = torch.randn(8)
    huge = torch.tensor([1.0, 3e38])
    nan = torch.tensor([1.0, float("nan")])
    saved = [raw.clone(), huge.clone(), nan.clone()]
    with perturbed({"x_ptr": raw, "idx_ptr": raw.view(torch.int32)}, KERNEL):
        assert torch.equal(raw, saved[0])
    for t, t0 in zip((huge, nan), saved[1:]):
        with perturbed({"x_ptr": t}, KERNEL):
            assert torch.equal(_bits(t), _bits(t0))


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
        assert torch.equal(args["out_ptr"], out0 * FACTORS[0])  # the third storage of four
    assert torch.equal(args["out_ptr"], out0)


def test_two_arguments_side_by_side_in_one_storage_are_perturbed_apart():
    """Inputs in the judge's arena share one storage, with bytes between them that are nobody's
    (here NaN): each is perturbed on its own, with its own factor."""
    arena = torch.full((40,), float("nan"))
    a, b = arena[0:16], arena[24:40]
    a.copy_(torch.randn(16))
    b.copy_(torch.randn(16))
    a0, b0 = a.clone(), b.clone()
    with perturbed({"x_ptr": a, "idx_ptr": b}, Kernel(name="k", params=("x_ptr", "idx_ptr"), stores=frozenset())):
        assert torch.equal(a, a0 * FACTORS[0]) and torch.equal(b, b0 * FACTORS[1])
        assert arena[16:24].isnan().all()
    assert torch.equal(a, a0) and torch.equal(b, b0)
