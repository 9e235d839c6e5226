"""Run by tests/test_multiprocess.py, once as one process and once under
`torchrun --nproc_per_node 2` (gloo on CPU). Writes the updated parameters and the gathered
advantages to argv[1] (rank 0), for the test to compare across process counts."""

import sys

import torch
from accelerate import Accelerator

from drkernel.advantages import compute_advantages
from drkernel.trainer import TrainConfig, UpdateSample, policy_update
from tests.tiny_lm import tiny_random_model


def main(out_path: str) -> None:
    acc = Accelerator(cpu=True)
    rank, world = acc.process_index, acc.num_processes

    # advantages: 4 groups (tasks) x 3 trajectories x 2 turns; like the trainer, each rank takes
    # whole tasks (tasks[rank::world]), so no group is split and no communication is needed
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(12, 2, generator=g)
    mask = torch.rand(12, 2, generator=g) > 0.2
    groups = torch.arange(4).repeat_interleave(3)
    mine = [t for t in range(4)][rank::world]
    rows = torch.cat([torch.nonzero(groups == t).flatten() for t in mine])
    adv = compute_advantages(rewards[rows], mask[rows], groups[rows], estimator="trloo")
    gathered = acc.gather_for_metrics([(int(r), adv[i].tolist()) for i, r in enumerate(rows)],
                                      use_gather_object=True)

    # the update: the same 6 samples, each rank holding its share
    model = tiny_random_model(vocab_size=96, seed=0)
    samples = []
    for i in range(6):
        prompt = torch.randint(1, 96, (3 + i,), generator=g).tolist()
        response = torch.randint(1, 96, (2 + i % 3,), generator=g).tolist()
        samples.append(UpdateSample(prompt, response, [0.0] * len(response), advantage=float(i) - 2.5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = acc.prepare(model, optimizer)
    cfg = TrainConfig(max_grad_norm=0.0, mismatch_correction=False, micro_batch_size=2, logprob_chunk_size=4)
    metrics = policy_update(model, optimizer, samples[rank::world], cfg, acc)

    if acc.is_main_process:
        params = {n: p.detach().clone() for n, p in acc.unwrap_model(model).named_parameters()}
        torch.save({"params": params, "advantages": dict(gathered), "loss": metrics["loss"]}, out_path)
    acc.wait_for_everyone()
    acc.end_training()  # without it a rank can abort at exit ("terminate called without an active exception")


if __name__ == "__main__":
    main(sys.argv[1])
