"""The two-stage hand-off: SFT writes a model (full weights or a LoRA adapter) that the RL stage
loads with `--model <sft output>/final` and trains for a step."""

import itertools
import json
from pathlib import Path

import pytest
import torch

from drkernel import sft
from drkernel.evaluator import EvalResult
from drkernel.tasks import load_bundled
from drkernel.trainer import TrainConfig, Trainer


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def _weights(directory: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    assert files, f"no safetensors in {directory}"
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("lora_r", [0, 4], ids=["full", "lora"])
def test_rl_step_from_sft_output(tiny_model_dir, tmp_path, lora_r):
    sft_out = tmp_path / "sft"
    assert sft.main(["--model", str(tiny_model_dir), "--output_dir", str(sft_out), "--max_steps", "1",
                     "--per_device_train_batch_size", "2", "--learning_rate", "1e-2",
                     "--lora_r", str(lora_r), "--log_with", "none", "--save_steps", "0"]) == 0
    final = sft_out / "final"
    assert (final / ("adapter_config.json" if lora_r else "config.json")).is_file()

    ranks = itertools.count()

    def distinct_rewards(sample):  # a cheap scripted reward: no evaluator needed for the hand-off;
        return float(next(ranks))  # a tie (every answer as long) would give every sample advantage 0

    rl_out = tmp_path / "rl"
    cfg = TrainConfig(model=str(final), output_dir=str(rl_out), max_steps=1, tasks_per_step=1,
                      num_generations=3, num_turns=1, max_new_tokens=6, learning_rate=1e-2,
                      micro_batch_size=3, log_with="none", save_steps=1, save_total_limit=0,
                      dump_rollouts=False, seed=0)
    trainer = Trainer(cfg, tasks=load_bundled([1]), evaluate_fn=lambda pairs: [EvalResult() for _ in pairs],
                      sample_reward_fn=distinct_rewards)
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    history = trainer.train()
    assert len(history) == 1 and history[0]["step"] == 1
    row = json.loads((rl_out / "metrics.jsonl").read_text().splitlines()[0])
    assert row["step"] == 1 and row["loss"] is not None
    model = trainer.acc.unwrap_model(trainer.model)
    after = dict(model.named_parameters())
    moved = [k for k, v in before.items() if not torch.equal(v, after[k].detach())]
    assert moved, "the RL step changed no trainable parameter of the SFT model"
    # the RL checkpoint is again a loadable model of the same kind (adapter stays an adapter)
    ck = rl_out / "checkpoint-1" / "model"
    assert (ck / ("adapter_config.json" if lora_r else "config.json")).is_file()
    assert _weights(ck)
