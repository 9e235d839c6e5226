import pytest
import torch

from drkernel.generation import GenerationConfig, generate
from tests.tiny_lm import full_forward_logprobs


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    # The random init (std 0.02) gives near-uniform logits and a greedy output that repeats
    # one token; larger weights make greedy decoding a meaningful comparison.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m.eval()


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    texts = ["import torch\nclass Model(nn.Module):", "def forward(self, x):\n    return", "x"]
    return [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_greedy_backends_agree_with_hf_generate(model, tiny_tokenizer, prompts):
    outs = {be: generate(model, tiny_tokenizer, prompts,
                         GenerationConfig(max_new_tokens=24, do_sample=False, backend=be))
            for be in ("hf", "static")}
    for a, b in zip(outs["hf"], outs["static"]):
        assert a.response_ids == b.response_ids
        assert len(set(a.response_ids)) > 3
    # one prompt at a time, plain model.generate
    for p, o in zip(prompts, outs["static"]):
        ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=24, do_sample=False, pad_token_id=tiny_tokenizer.pad_token_id)
        ref_ids = ref[0, len(p):].tolist()
        assert o.response_ids == ref_ids[: len(o.response_ids)]


def test_compile_shape_buckets_keep_rows_and_results(model, tiny_tokenizer, prompts):
    """With `compile` the static backend pads the batch to a power of two and the cache to a multiple
    of 256, so one compiled graph serves many shapes (on CPU nothing is compiled; the padding still
    applies): the same rows come back, with the greedy results of the unpadded run."""
    plain = generate(model, tiny_tokenizer, prompts, GenerationConfig(max_new_tokens=12, do_sample=False,
                                                                      backend="static"))
    padded = generate(model, tiny_tokenizer, prompts, GenerationConfig(max_new_tokens=12, do_sample=False,
                                                                       backend="static", compile=True))
    assert len(padded) == len(prompts) == 3
    assert [o.response_ids for o in padded] == [o.response_ids for o in plain]


@pytest.mark.parametrize("backend", ["hf", "static"])
@pytest.mark.parametrize("temperature,do_sample", [(0.7, False), (1.3, True)])
def test_logprobs_match_full_forward(model, tiny_tokenizer, prompts, backend, temperature, do_sample):
    cfg = GenerationConfig(max_new_tokens=16, do_sample=do_sample, temperature=temperature,
                           top_k=50, top_p=0.95, backend=backend, seed=0)
    for p, o in zip(prompts, generate(model, tiny_tokenizer, prompts, cfg)):
        assert len(o.logprobs) == len(o.response_ids) > 0
        ref = full_forward_logprobs(model, p, o.response_ids, cfg)
        assert torch.allclose(torch.tensor(o.logprobs), ref, atol=1e-4), (o.logprobs, ref)


@pytest.mark.parametrize("backend", ["hf", "static"])
def test_eos_stops_a_row(model, tiny_tokenizer, prompts, backend):
    base = generate(model, tiny_tokenizer, prompts, GenerationConfig(max_new_tokens=20, do_sample=False))
    stop_tok = base[0].response_ids[4]
    first = base[0].response_ids.index(stop_tok)
    old = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [tiny_tokenizer.eos_token_id, stop_tok]
    try:
        outs = generate(model, tiny_tokenizer, prompts,
                        GenerationConfig(max_new_tokens=20, do_sample=False, backend=backend))
    finally:
        model.generation_config.eos_token_id = old
    assert outs[0].finished and outs[0].response_ids == base[0].response_ids[: first + 1]
    assert len(outs[0].logprobs) == first + 1
    for o, b in zip(outs, base):
        if not o.finished:
            assert stop_tok not in o.response_ids and o.response_ids == b.response_ids


@pytest.mark.parametrize("backend", ["hf", "static"])
def test_seeded_sampling_is_reproducible(model, tiny_tokenizer, prompts, backend):
    cfg = GenerationConfig(max_new_tokens=16, do_sample=True, backend=backend, seed=123, batch_size=2)
    a = generate(model, tiny_tokenizer, prompts, cfg)
    b = generate(model, tiny_tokenizer, prompts, cfg)
    assert [o.response_ids for o in a] == [o.response_ids for o in b]
    c = generate(model, tiny_tokenizer, prompts, GenerationConfig(max_new_tokens=16, backend=backend, seed=7))
    assert [o.response_ids for o in a] != [o.response_ids for o in c]


def test_ignore_eos_gives_full_length(model, tiny_tokenizer, prompts):
    for be in ("hf", "static"):
        outs = generate(model, tiny_tokenizer, prompts,
                        GenerationConfig(max_new_tokens=9, backend=be, ignore_eos=True, seed=0))
        assert all(len(o.response_ids) == 9 and not o.finished for o in outs)


@pytest.mark.slow
def test_bench_rollout_cpu_smoke(tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "rollout.py"
    spec = importlib.util.spec_from_file_location("bench_rollout", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "rollout.json"
    assert mod.main(["--device", "cpu", "--layers", "1", "--batch", "2", "--prompt-len", "8",
                     "--new-tokens", "4", "--repeats", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["method"] for r in data["results"]][:3] == ["hf model.generate", "ours hf (+logits)",
                                                          "ours static eager"]
    assert all(r.get("tokens_per_s", 0) > 0 for r in data["results"]), data["results"]


def test_decode_attention_matches_transformers_sdpa():
    """Query heads folded onto their shared KV head give transformers' SDPA result (GQA, one
    query token, a padding mask), without the per-step K/V expansion."""
    import types
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from drkernel.generation import _decode_attention

    g = torch.Generator().manual_seed(0)
    b, h, hkv, d, kv_len = 3, 8, 2, 16, 11
    module = types.SimpleNamespace(num_key_value_groups=h // hkv, is_causal=True, training=False)
    q = torch.randn(b, h, 1, d, generator=g)
    k, v = torch.randn(b, hkv, kv_len, d, generator=g), torch.randn(b, hkv, kv_len, d, generator=g)
    mask = torch.ones(b, 1, 1, kv_len, dtype=torch.bool)
    mask[0, :, :, :4] = False  # left padding of row 0
    mask[2, :, :, -2:] = False  # unfilled cache slots
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=d ** -0.5)
    got, _ = _decode_attention(module, q, k, v, mask, scaling=d ** -0.5)
    assert got.shape == want.shape == (b, 1, h, d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_static_backend_decodes_through_the_gqa_attention(model, tiny_tokenizer, prompts, monkeypatch):
    from drkernel import generation

    assert model.config.num_key_value_heads < model.config.num_attention_heads  # the fixture is GQA
    calls = []
    real = generation._decode_attention

    def counting(module, query, *a, **kw):
        calls.append(query.shape[2])
        return real(module, query, *a, **kw)
    monkeypatch.setattr(generation, "_decode_attention", counting)
    before = model.config._attn_implementation
    outs = generate(model, tiny_tokenizer, prompts, GenerationConfig(max_new_tokens=6, do_sample=False,
                                                                     backend="static"))
    assert model.config._attn_implementation == before  # restored after generation
    assert calls and 1 in calls, "decode steps did not go through _decode_attention"
    hf = generate(model, tiny_tokenizer, prompts, GenerationConfig(max_new_tokens=6, do_sample=False, backend="hf"))
    assert [o.response_ids for o in outs] == [o.response_ids for o in hf]


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (2, 1.0), (0, 0.7)])
def test_gumbel_sampling_draws_from_the_filtered_softmax(top_k, top_p):
    """The static backend samples by Gumbel-max: token frequencies follow softmax(logits / T)
    restricted to the top-k / top-p set, while the logprob stays the full-vocabulary one."""
    from drkernel.generation import sample_next

    temp = 0.8
    base = torch.tensor([2.0, 1.5, 0.5, 0.0, -1.0])
    n = 40000
    cfg = GenerationConfig(temperature=temp, top_k=top_k, top_p=top_p)
    gen = torch.Generator().manual_seed(0)
    tokens, logps = sample_next(base.repeat(n, 1), cfg, gen)
    full = torch.softmax(base / temp, dim=-1)
    keep = torch.ones(5, dtype=torch.bool)
    if top_k:
        keep[top_k:] = False
    if top_p < 1.0:
        keep = (full.cumsum(0) - full) <= top_p  # logits are sorted, so this is the nucleus
    want = torch.where(keep, full, torch.zeros_like(full))
    want = want / want.sum()
    freq = torch.bincount(tokens, minlength=5).double() / n
    assert keep.sum() < 5 or top_k == 0 and top_p == 1.0
    assert torch.all(freq[~keep] == 0)
    assert torch.allclose(freq, want.double(), atol=0.01), (freq, want)
    torch.testing.assert_close(logps, torch.log(full)[tokens], rtol=0, atol=1e-5)


def test_compiled_pick_matches_eager():
    """The CUDA decode loop runs the token choice through torch.compile (fullgraph here, so a
    graph break would fail): same tokens and logprobs as eager, for the given noise."""
    from drkernel.generation import _pick

    compiled = torch.compile(_pick, dynamic=False, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    x, u = torch.randn(4, 1000, generator=g), torch.rand(4, 1000, generator=g)
    for top_k, top_p, greedy in [(0, 1.0, False), (50, 0.9, False), (0, 1.0, True)]:
        want = _pick(x, None if greedy else u, 0.7, top_k, top_p, greedy)
        got = compiled(x, None if greedy else u, 0.7, top_k, top_p, greedy)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_decode_step_compiles_few_graphs_over_many_shapes(model):
    """train.py's decode step meets many (batch, cache) sizes; dynamo must switch to dynamic sizes
    rather than add a graph per size (past its recompile limit it would silently run eagerly)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from drkernel import generation as G

    torch._dynamo.reset()
    counters.clear()
    decoder = G._Decoder(model)
    step = torch.compile(decoder.__call__, backend="eager")
    shapes = [(4, 256), (4, 512), (8, 512), (4, 768), (2, 1024), (8, 1536), (16, 2048), (4, 2560),
              (4, 2816), (2, 3072)]
    assert len(shapes) > torch._dynamo.config.recompile_limit
    vocab = model.config.vocab_size
    with torch.inference_mode(), G.decode_attention(model):
        for b, length in shapes:
            cache = G.make_static_cache(model, b, length, "cpu", torch.float32)
            ids = torch.randint(0, vocab, (b, 5))
            mask = torch.zeros(b, length, dtype=torch.long)
            mask[:, :6] = 1
            decoder(ids, mask, torch.arange(5)[None].expand(b, 5), cache, torch.arange(5))
            got = step(ids[:, :1], mask, torch.full((b, 1), 5), cache, torch.tensor([5]))
            assert got.shape == (b, vocab) and torch.isfinite(got).all()
    assert counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["static", "hf"])
def test_responses_end_at_the_models_context(model, tiny_tokenizer, prompts, backend):
    """The static backend sizes its cache and token buffers up front: a hundred million new tokens
    asked took the host's memory. Both backends end responses at the context instead."""
    context = model.config.max_position_embeddings
    longest = max(map(len, prompts))
    try:
        for limit, room in ((40, 40 - longest), (longest, 0)):
            model.config.max_position_embeddings = limit
            outs = generate(model, tiny_tokenizer, prompts, GenerationConfig(max_new_tokens=200, do_sample=False,
                                                                             ignore_eos=True, backend=backend))
            assert [len(o.response_ids) for o in outs] == [room] * len(prompts)
    finally:
        model.config.max_position_embeddings = context
