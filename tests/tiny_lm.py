"""A tiny random causal LM for tests, and the log-probs its full forward pass gives (the trainer's
view of a sampled response, to check sampled log-probs against or to teacher-force an answer)."""

from typing import Sequence

import torch

from drkernel.generation import GenerationConfig, logprob_temperature


def tiny_random_model(vocab_size: int = 512, hidden: int = 64, layers: int = 2,
                      heads: int = 4, arch: str = "qwen2", seed: int = 0):
    """A random-init Qwen2/Llama small enough for CPU tests (no download)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, vocab_size=vocab_size, hidden_size=hidden,
                               intermediate_size=hidden * 2, num_hidden_layers=layers,
                               num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                               max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg)


def full_forward_logprobs(model, prompt_ids: Sequence[int], response_ids: Sequence[int],
                          cfg: GenerationConfig) -> torch.Tensor:
    """log_softmax(logits / T) of `response_ids` from one forward pass over prompt + response,
    T as generation reports it (`logprob_temperature`)."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(response_ids)], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt_ids) - 1:-1] / logprob_temperature(cfg), dim=-1)
    return logp.gather(-1, torch.tensor(list(response_ids), device=device)[:, None]).squeeze(-1)
