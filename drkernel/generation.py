"""Batched sampling with per-token log-probabilities of the sampled tokens.

Two backends produce the same `GenOutput`s:

- "hf": `model.generate(...)` with left padding, `output_logits=True`;
- "static": our own lean loop. Prefill the left-padded batch once, then decode one token
  per step through the model's KV cache. With a `transformers.StaticCache` every decode
  step has the same shapes, so on CUDA the step can be `torch.compile`d with
  `mode="reduce-overhead"` (CUDA graphs); on CPU it runs eagerly.

Log-probabilities (the quantity the trainer must recompute for the importance ratio):

    logprob[t] = log_softmax(logits[t] / T)[token[t]]

where `logits[t]` are the model's raw output logits for the position that predicts
response token t (in float32), and T = `cfg.temperature` (T = 1 when temperature <= 0).
Top-k / top-p truncation is used to *choose* tokens but is NOT reflected in the logprob:
it is the temperature-scaled full-vocabulary distribution. Greedy decoding reports the
same quantity (with the configured T) for the argmax token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from typing import Sequence

import torch

from drkernel.config import COUNT, SEED, UP_TO_1, Limit, OneOf

BACKENDS = ("hf", "static")


@dataclasses.dataclass
class GenerationConfig:
    # the values each setting accepts; every script config that mirrors one checks it (drkernel.config)
    LIMITS = {"max_new_tokens": COUNT, "temperature": Limit(0, why="0 = greedy"), "top_p": UP_TO_1,
              "top_k": Limit(0, why="0 = no top-k filtering"), "batch_size": COUNT, "backend": OneOf(BACKENDS),
              "seed": SEED}

    max_new_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filtering
    do_sample: bool = True
    backend: str = "hf"  # "hf" | "static"
    batch_size: int = 64  # prompts per generate call (sorted by length to limit padding)
    seed: int | None = None  # reproducible sampling when set
    ignore_eos: bool = False  # always produce max_new_tokens (benchmarks), up to the model's context
    compile: bool = False  # static backend: torch.compile the decode step (CUDA only)
    gqa_decode: bool = True  # static backend: decode attention without the K/V head expansion


@dataclasses.dataclass
class GenOutput:
    response_ids: list[int]  # stops at (and includes) the first EOS token
    logprobs: list[float]  # one per response id: log_softmax(logits / T) of the sampled token
    finished: bool  # True if the response ended with EOS (False: hit max_new_tokens)


def logprob_temperature(cfg: GenerationConfig) -> float:
    return float(cfg.temperature) if cfg.temperature and cfg.temperature > 0 else 1.0


def eos_token_ids(model, tokenizer) -> list[int]:
    ids: list[int] = []
    for src in (getattr(tokenizer, "eos_token_id", None),
                getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                getattr(getattr(model, "config", None), "eos_token_id", None)):
        if src is None:
            continue
        for i in (src if isinstance(src, (list, tuple)) else [src]):
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


def _pad_id(tokenizer, eos: list[int]) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if eos else 0
    return int(pad)


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if len(p):
            ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def _pick(logits: torch.Tensor, noise: torch.Tensor | None, temp: float, top_k: int, top_p: float,
          greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], logprobs [B]) from raw logits [B, V] and uniform noise [B, V] in [0, 1).

    Sampling is Gumbel-max: argmax(scores + Gumbel noise) is an exact draw from softmax(scores),
    and unlike `torch.multinomial` it is a few elementwise passes and one argmax that
    `torch.compile` fuses. Top-k / top-p set the dropped scores to -inf first."""
    logits = logits.float()
    scores = logits / temp
    logp = torch.log_softmax(scores, dim=-1)
    if greedy:
        tokens = logits.argmax(dim=-1)
    else:
        if top_k and 0 < top_k < scores.shape[-1]:
            kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if top_p < 1.0:
            sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            # drop a token when the tokens strictly before it already cover top_p (keeps >= 1)
            drop = (probs.cumsum(dim=-1) - probs) > top_p
            sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
            scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
        # float32 uniforms come in steps of 2**-24; the clamp keeps a 0 from becoming log(0)
        gumbel = -torch.log(-torch.log(noise.clamp_min(2.0 ** -30)))
        tokens = (scores + gumbel).argmax(dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


@functools.cache
def _compiled_pick():
    return torch.compile(_pick, dynamic=False)


def sample_next(logits: torch.Tensor, cfg: GenerationConfig, generator: torch.Generator | None = None,
                compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], logprobs [B]) from raw logits [B, V] (see the module docstring).

    `compiled`: run the token choice through `torch.compile` (CUDA decode loop), so the
    full-vocabulary passes become a few fused kernels instead of about ten."""
    greedy = not cfg.do_sample
    noise = None if greedy else torch.rand(logits.shape, generator=generator, device=logits.device)
    pick = _compiled_pick() if compiled else _pick
    return pick(logits, noise, logprob_temperature(cfg), int(cfg.top_k or 0),
                1.0 if cfg.top_p is None else float(cfg.top_p), greedy)


def _trim(row_ids: list[int], row_lp: list[float], eos: set[int]) -> GenOutput:
    for j, t in enumerate(row_ids):
        if t in eos:
            return GenOutput(row_ids[: j + 1], row_lp[: j + 1], True)
    return GenOutput(row_ids, row_lp, False)


# ----------------------------------------------------------------------------- hf backend

def _generate_hf(model, tokenizer, prompts, cfg, eos, pad_id) -> list[GenOutput]:
    from transformers import GenerationConfig as HFGenerationConfig

    device = _model_device(model)
    ids, mask = left_pad(prompts, pad_id, device)
    n_new = _room(model, ids.shape[1], int(cfg.max_new_tokens))
    if n_new == 0:  # the prompts fill the model's context
        return [_trim([], [], set()) for _ in prompts]
    kwargs = dict(max_new_tokens=n_new, do_sample=cfg.do_sample,
                  eos_token_id=eos or None, pad_token_id=pad_id,
                  return_dict_in_generate=True, output_logits=True)
    if cfg.do_sample:
        kwargs.update(temperature=logprob_temperature(cfg), top_p=cfg.top_p,
                      top_k=cfg.top_k if cfg.top_k > 0 else None)
    if cfg.ignore_eos:
        kwargs["min_new_tokens"] = n_new
    gen_cfg = HFGenerationConfig(**kwargs)  # fresh: no processors inherited from the checkpoint
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg)
    new = out.sequences[:, ids.shape[1]:]
    logits = torch.stack(list(out.logits), dim=1).float()  # [B, N, V] raw logits
    logp = torch.log_softmax(logits / logprob_temperature(cfg), dim=-1)
    lp = logp.gather(-1, new[:, : logits.shape[1], None]).squeeze(-1)
    stop = set() if cfg.ignore_eos else set(eos)
    return [_trim(new[i].tolist(), lp[i].tolist(), stop) for i in range(new.shape[0])]


# ----------------------------------------------------------------------------- static backend

def _forward_params(model) -> set[str]:
    seen = set()
    m = model
    for _ in range(4):  # unwrap peft / wrappers whose forward is (*args, **kwargs)
        try:
            params = inspect.signature(m.forward).parameters
        except (TypeError, ValueError):
            params = {}
        seen |= {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        if "input_ids" in seen:
            break
        nxt = getattr(m, "get_base_model", None)
        m = nxt() if callable(nxt) else getattr(m, "model", None)
        if m is None:
            break
    return seen


def make_static_cache(model, batch_size: int, max_cache_len: int, device, dtype):
    """A transformers StaticCache for this model, or None where this version cannot build one."""
    try:
        from transformers import StaticCache
    except ImportError:
        return None
    config = model.config
    attempts = (dict(config=config, max_cache_len=max_cache_len),  # transformers >= 4.56 / 5.x
                dict(config=config, max_batch_size=batch_size, max_cache_len=max_cache_len,
                     device=device, dtype=dtype))  # older signature
    for kw in attempts:
        try:
            return StaticCache(**kw)
        except TypeError:
            continue
    return None


_DECODE_ATTN = "drkernel_sdpa_decode"


def _decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, **kwargs):
    """SDPA for one-token decode steps of grouped-query attention without expanding K/V.

    transformers' SDPA path copies every KV head `num_key_value_groups` times per layer and step
    when compiled (profiled on the H200: about a third of a compiled 0.5B decode step). With one
    query token, the query heads that share a KV head can instead act as that head's query rows;
    the result is the same attention. Prefill and non-GQA calls use transformers' own SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    b, h, q_len, d = query.shape
    mask = attention_mask
    if q_len != 1 or groups == 1 or (mask is not None and (mask.dim() != 4 or mask.shape[1] != 1)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    hkv, kv_len = key.shape[1], key.shape[2]
    q = query.reshape(b, hkv, groups, d)  # head kv * groups + g -> (kv, row g)
    if mask is not None:
        mask = mask[:, :, :, :kv_len].expand(b, 1, groups, kv_len)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, 1, h, d), None


@contextlib.contextmanager
def decode_attention(model):
    """Use `_decode_attention` inside the block when the model runs transformers' SDPA."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        AttentionInterface.register(_DECODE_ATTN, _decode_attention)
        AttentionMaskInterface.register(_DECODE_ATTN, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    except Exception:  # a transformers without these interfaces: keep its own SDPA
        yield
        return
    config._attn_implementation = _DECODE_ATTN
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


class _Decoder:
    """One model forward through a KV cache; keyword names adapt to the transformers version."""

    def __init__(self, model):
        self.model = model
        params = _forward_params(model)
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.pass_cache_position = "cache_position" in params
        self.keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)

    def __call__(self, input_ids, attention_mask, position_ids, cache, cache_position):
        kw = {self.cache_kw: cache, "use_cache": True}
        if self.pass_cache_position:
            kw["cache_position"] = cache_position
        if self.keep_kw:
            kw[self.keep_kw] = 1
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, **kw)
        return out.logits[:, -1, :].float()  # the cache object is updated in place


_COMPILED: dict[int, object] = {}


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _shape_buckets(prompts: list, cfg: GenerationConfig) -> list:
    """The prompts, with rows repeating prompt 0 up to a power of two when the step is compiled.

    CUDA graphs are recorded per concrete (batch, cache length), even once dynamo has compiled the
    step with dynamic sizes (after the second size it meets): a power-of-two batch and a cache in
    multiples of 256 (`_cache_len`) let the turns and steps of a run replay a few recorded graphs
    instead of recording one per prompt length."""
    if not cfg.compile:
        return prompts
    return list(prompts) + [prompts[0]] * (_pow2(len(prompts)) - len(prompts))


def _room(model, prompt_len: int, max_new_tokens: int) -> int:
    """New tokens after prompts padded to `prompt_len`: `max_new_tokens`, but never past the model's
    context (`max_position_embeddings`), for which the static backend allocates its cache and token
    buffers up front (a hundred million new tokens asked would take every gigabyte of the host)."""
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(context, int) or context <= 0:
        return max_new_tokens
    return max(0, min(max_new_tokens, context - prompt_len))


def _cache_len(total: int, cfg: GenerationConfig) -> int:
    """Cache positions for `total` tokens: a multiple of 256 when compiled (a power of two, 1024
    instead of 768, measured slower on the H200: 11.4k vs 12.8k tokens/s, since decode attention
    runs over the whole static cache)."""
    return -(-total // 256) * 256 if cfg.compile else total


def _kv_cache(model, batch_size: int, max_cache_len: int, device, dtype) -> tuple[object, bool]:
    """(cache, static): a StaticCache where this transformers can build one, else a DynamicCache."""
    cache = make_static_cache(model, batch_size, max_cache_len, device, dtype)
    if cache is not None:
        return cache, True
    from transformers import DynamicCache
    try:
        return DynamicCache(config=model.config), False
    except TypeError:
        return DynamicCache(), False


def _compiled_step(model, decoder: _Decoder):
    """The decode step compiled with CUDA graphs, once per model."""
    key = id(model)
    if key not in _COMPILED:
        # a bound method: torch.compile wraps functions and modules, not arbitrary callables
        _COMPILED[key] = torch.compile(decoder.__call__, mode="reduce-overhead", fullgraph=False)
    return _COMPILED[key]


def _sampling_generator(cfg: GenerationConfig, device) -> torch.Generator | None:
    """The seeded source of the sampling noise (None: torch's global one)."""
    if cfg.seed is None or not cfg.do_sample:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(int(cfg.seed))
    return gen


def _generate_static(model, tokenizer, prompts, cfg, eos, pad_id) -> list[GenOutput]:
    device = _model_device(model)
    n_rows = len(prompts)
    ids, mask = left_pad(_shape_buckets(prompts, cfg), pad_id, device)
    bsz, plen = ids.shape
    n_new = _room(model, plen, int(cfg.max_new_tokens))
    max_cache_len = _cache_len(plen + n_new, cfg)
    cache, static = _kv_cache(model, bsz, max_cache_len, device, next(model.parameters()).dtype)
    decoder = _Decoder(model)
    use_compile = bool(cfg.compile) and static and device.type == "cuda"
    step_fn = _compiled_step(model, decoder) if use_compile else decoder

    full_mask = torch.zeros((bsz, max_cache_len), dtype=torch.long, device=device)
    full_mask[:, :plen] = mask
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    next_pos = mask.sum(-1, keepdim=True)  # [B, 1] position of the next token of each row
    gen = _sampling_generator(cfg, device)
    tokens = torch.full((bsz, n_new), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros((bsz, n_new), dtype=torch.float32, device=device)
    done = torch.zeros(bsz, dtype=torch.bool, device=device)
    eos_t = torch.tensor(eos if (eos and not cfg.ignore_eos) else [-1], device=device)
    n_done_steps = 0

    logits = decoder(ids, full_mask if static else mask, positions, cache, torch.arange(plen, device=device))
    check_every = 8 if device.type == "cuda" else 1  # a host sync per check: rare on CUDA
    for step in range(n_new):
        tok, lp = sample_next(logits, cfg, gen, compiled=use_compile)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        tokens[:, step] = tok
        logps[:, step] = torch.where(done, torch.zeros_like(lp), lp)
        done = done | torch.isin(tok, eos_t)
        n_done_steps = step + 1
        if step + 1 == n_new:
            break
        if not cfg.ignore_eos and (step + 1) % check_every == 0 and bool(done.all()):
            break
        col = plen + step
        full_mask[:, col] = 1
        step_mask = full_mask if static else full_mask[:, : col + 1]
        cache_pos = torch.full((1,), col, dtype=torch.long, device=device)
        if use_compile:
            torch.compiler.cudagraph_mark_step_begin()
        logits = step_fn(tok[:, None], step_mask, next_pos, cache, cache_pos)
        next_pos = next_pos + 1
    rows_t = tokens[:, :n_done_steps].cpu().tolist()
    rows_l = logps[:, :n_done_steps].cpu().tolist()
    stop = set() if cfg.ignore_eos else set(eos)
    return [_trim(rows_t[i], rows_l[i], stop) for i in range(n_rows)]


# ----------------------------------------------------------------------------- entry point

@torch.inference_mode()
def generate(model, tokenizer, prompts: list[list[int]], cfg: GenerationConfig | None = None) -> list[GenOutput]:
    """Sample one response per prompt (token ids, no padding), in the prompts' order.

    Prompts are sorted by length and processed `cfg.batch_size` at a time. Responses stop
    at and include EOS (unless `ignore_eos`). `logprobs` = log_softmax(logits / T) of each
    sampled token, T = cfg.temperature; see the module docstring.
    """
    cfg = cfg or GenerationConfig()
    if not prompts:
        return []
    if cfg.backend not in BACKENDS:
        raise ValueError(f"unknown generation backend {cfg.backend!r} ({' | '.join(BACKENDS)})")
    eos = eos_token_ids(model, tokenizer)
    pad_id = _pad_id(tokenizer, eos)
    was_training = model.training
    model.eval()
    if cfg.backend == "hf" and cfg.seed is not None:
        torch.manual_seed(int(cfg.seed))
    run = _generate_hf if cfg.backend == "hf" else _generate_static
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[GenOutput | None] = [None] * len(prompts)
    attention = (decode_attention(model) if cfg.backend == "static" and cfg.gqa_decode
                 else contextlib.nullcontext())
    try:
        with attention:
            for start in range(0, len(order), max(1, cfg.batch_size)):
                idx = order[start:start + max(1, cfg.batch_size)]
                chunk_cfg = cfg
                if cfg.seed is not None and start:
                    chunk_cfg = dataclasses.replace(cfg, seed=int(cfg.seed) + start)
                for i, out in zip(idx, run(model, tokenizer, [list(prompts[i]) for i in idx],
                                           chunk_cfg, eos, pad_id)):
                    outputs[i] = out
    finally:
        if was_training:
            model.train()
    return outputs  # type: ignore[return-value]
