"""Two processes (gloo on CPU through torchrun) give what one process gives: the advantages of
whole groups computed per rank and gathered, and the policy update of a batch split over ranks."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tiny_lm import tiny_random_model

SCRIPT = Path(__file__).resolve().parent / "multiproc" / "update_and_advantages.py"
ROOT = SCRIPT.parent.parent.parent


def _run(cmd, tmp_path):
    env = dict(os.environ, ACCELERATE_USE_CPU="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.slow
def test_two_ranks_equal_one_rank(tmp_path):
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    _run([sys.executable, str(SCRIPT), str(one)], tmp_path)
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
          str(SCRIPT), str(two)], tmp_path)
    a, b = torch.load(one), torch.load(two)
    assert sorted(a["advantages"]) == sorted(b["advantages"]) == list(range(12))
    for row in range(12):
        assert torch.allclose(torch.tensor(a["advantages"][row]), torch.tensor(b["advantages"][row]))
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    for name, p in a["params"].items():
        assert torch.allclose(p, b["params"][name], atol=1e-6, rtol=1e-5), name
    start = tiny_random_model(vocab_size=96, seed=0)
    moved = 0
    for name, p in start.named_parameters():
        moved += int(not torch.equal(p.detach(), a["params"][name]))
    assert moved > 0, "the update changed nothing: the comparison would be vacuous"
