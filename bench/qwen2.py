"""A randomly initialised Qwen2-shaped model for the benches (no download: weights are not the point)."""

from __future__ import annotations

import torch


def random_model(shape: dict, device: str, dtype: torch.dtype):
    """`AutoModelForCausalLM` from a Qwen2 config of `shape` (config fields), seeded, on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", **shape)
    torch.manual_seed(0)
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        except TypeError:  # older transformers
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    return model.to(device=device, dtype=dtype)
