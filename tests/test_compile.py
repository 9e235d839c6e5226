"""`torch_compile` (regional compilation of the decoder layers and the log-prob head) and
selective activation checkpointing (`gradient_checkpointing_every`), on CPU with tiny models.

Two tests compile with inductor (C++ kernels on CPU, scalar code to keep compiling short: conftest);
the others use `DRKERNEL_COMPILE_BACKEND=aot_eager`, which traces, partitions and recomputes
exactly the same graphs without generating kernels, so they stay fast.
"""

import copy
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from drkernel import modeling, sft
from drkernel.config import ConfigError, parse_config
from drkernel.modeling import compile_decoder_layers, decoder_layers, enable_gradient_checkpointing
from drkernel.tasks import load_bundled
from drkernel.trainer import TrainConfig, Trainer, UpdateSample, _generation_mode, policy_update
from tests.tiny_lm import tiny_random_model

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own graphs: cache entries piling up across tests would reach
    dynamo's recompile limit, after which it silently runs eagerly (and the test proves nothing)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.fixture
def aot_eager(monkeypatch):
    monkeypatch.setenv("DRKERNEL_COMPILE_BACKEND", "aot_eager")


def _accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def _samples(lengths, vocab=512, seed=0):
    """(prompt, response) lengths -> samples with alternating-sign advantages."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate(lengths):
        ids = torch.randint(0, vocab, (p + r,), generator=g).tolist()
        out.append(UpdateSample(ids[:p], ids[p:], [0.0] * r, advantage=(1.0, -0.5, 0.75)[i % 3]))
    return out


def _update(model, samples, cfg):
    """One policy_update with SGD(lr=1) and no clipping: the weight change is minus the gradient."""
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    metrics = policy_update(model, opt, samples, cfg, _accelerator(), pad_id=0)
    grads = {n: before[n] - p.detach() for n, p in model.named_parameters() if n in before}
    return metrics, grads


def _assert_same_update(eager, compiled, rtol=1e-4, atol=1e-6):
    (m_e, g_e), (m_c, g_c) = eager, compiled
    for key in ("loss", "entropy", "grad_norm", "kl_ref"):
        if key in m_e:
            assert m_c[key] == pytest.approx(m_e[key], rel=1e-4, abs=1e-6), key
    assert g_e.keys() == g_c.keys()
    assert any(float(g.abs().max()) > 0 for g in g_e.values())
    for n in g_e:
        torch.testing.assert_close(g_c[n], g_e[n], rtol=rtol, atol=atol, msg=n)


def _cfg(**kw):
    base = dict(micro_batch_size=2, logprob_chunk_size=0, mismatch_correction=False, max_grad_norm=0.0,
                skip_zero_advantage=False, log_entropy=True)
    base.update(kw)
    return TrainConfig(**base)


# ------------------------------------------------------------------ the update is unchanged by compiling

def test_inductor_cpp_is_scalar_for_the_whole_run():
    """Set by conftest before inductor is imported, so no test depends on which ran first:
    inductor picks its vector ISA once per process and keeps it."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    assert config.cpp.vec_isa_ok is False
    assert not pick_vec_isa()


@pytest.mark.slow
def test_inductor_compiled_update_matches_eager():
    """The real backend (inductor, C++ on CPU): same loss, entropy and gradients as eager."""
    samples = _samples([(8, 56), (8, 56)])  # the shapes of `bench/update.py --tiny`: its compile reuses these graphs
    eager_model = tiny_random_model(seed=1)
    compiled_model = copy.deepcopy(eager_model)
    assert compile_decoder_layers(compiled_model) == 2
    eager = _update(eager_model, samples, _cfg())
    g0 = _graphs()
    compiled = _update(compiled_model, samples, _cfg(torch_compile=True))
    # one graph for both layers and one for the log-prob head, in the no-grad π_old pass and in the loss pass
    assert _graphs() - g0 == 4
    _assert_same_update(eager, compiled)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ckpt_every_2+chunks+2_iterations", "lora+kl"])
def test_compiled_update_matches_eager_with_checkpointing_chunks_lora(case, aot_eager):
    lengths = [(5, 30), (9, 18), (3, 41)]  # ragged: padding, and a last head chunk of another size
    if case == "lora+kl":
        from peft import LoraConfig, get_peft_model

        cfg = dict(beta=0.3, micro_batch_size=3)  # the reference pass: compiled layers, adapter off

        def make():
            base = tiny_random_model(layers=2, seed=2)
            model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
            with torch.no_grad():  # non-zero B: the adapter changes the policy, so KL to the base is > 0
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
            return model
    else:
        cfg = dict(num_iterations=2, logprob_chunk_size=16, micro_batch_size=3)

        def make():
            model = tiny_random_model(layers=3, seed=2)
            enable_gradient_checkpointing(model, every_n_layers=2)
            return model

    eager_model = make()
    compiled_model = copy.deepcopy(eager_model)
    compile_decoder_layers(compiled_model)
    eager = _update(eager_model, _samples(lengths), _cfg(**cfg))
    g0 = _graphs()
    compiled = _update(compiled_model, _samples(lengths), _cfg(torch_compile=True, **cfg))
    assert _graphs() - g0 >= 2
    if case == "lora+kl":
        assert eager[0]["kl_ref"] > 0
    _assert_same_update(eager, compiled)


def test_one_compiled_graph_serves_every_layer_and_fresh_models(aot_eager):
    """Per-layer recompiles would exhaust dynamo's cache limit (8) on a 28-layer model and silently
    fall back to eager: a fresh 3-layer model must run entirely on the graphs already compiled."""
    samples = _samples([(4, 20), (4, 20)])
    first = tiny_random_model(layers=3, seed=3)
    compile_decoder_layers(first)
    g0 = _graphs()
    _update(first, samples, _cfg(torch_compile=True))
    # the three layers share one graph, the head has another; each once without grad (π_old) and once with
    assert _graphs() - g0 == 4
    second = tiny_random_model(layers=3, seed=4)
    compile_decoder_layers(second)
    with torch._dynamo.config.patch(error_on_recompile=True):
        m, _ = _update(second, samples, _cfg(torch_compile=True))
    assert math.isfinite(m["loss"])


# ------------------------------------------------------------------ selective checkpointing, errors

def test_every_n_layers_checkpointing_and_bad_values():
    model = tiny_random_model(layers=4)
    enable_gradient_checkpointing(model, every_n_layers=2)
    assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == [True, False, True, False]
    assert model.config.use_cache is False
    enable_gradient_checkpointing(model)
    assert all(layer.gradient_checkpointing for layer in decoder_layers(model))
    with pytest.raises(ValueError, match="gradient_checkpointing_every"):
        enable_gradient_checkpointing(model, every_n_layers=0)
    with pytest.raises(ConfigError, match="gradient_checkpointing_every"):
        parse_config(TrainConfig, ["--gradient_checkpointing_every", "0"])
    with pytest.raises(ConfigError, match="gradient_checkpointing_every"):
        sft._validate(sft.SFTConfig(gradient_checkpointing_every=0))
    cfg = parse_config(TrainConfig, ["--torch_compile", "true", "--gradient_checkpointing_every", "4"])
    assert cfg.torch_compile and cfg.gradient_checkpointing_every == 4
    with pytest.raises(ValueError, match="no transformers decoder layers"):
        compile_decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


# ------------------------------------------------------------------ wiring: RL trainer and SFT

@pytest.mark.slow
def test_trainer_compiles_the_policy_not_its_reference_and_samples_eagerly(tiny_tokenizer, tmp_path, aot_eager):
    from torch._dynamo.utils import counters

    tok = tiny_tokenizer
    model = tiny_random_model(vocab_size=len(tok), seed=0)
    model.config.eos_token_id = tok.eos_token_id
    cfg = TrainConfig(model="injected", output_dir=str(tmp_path), max_steps=1, tasks_per_step=1, num_generations=2,
                      num_turns=1, max_new_tokens=4, beta=0.1, torch_compile=True, gradient_checkpointing=True,
                      gradient_checkpointing_every=2, log_with="none", save_steps=0, dump_rollouts=False)
    trainer = Trainer(cfg, model=model, tokenizer=tok, tasks=load_bundled([1]), evaluate_fn=lambda pairs: [],
                      sample_reward_fn=lambda s: float(s.traj_id))
    policy = trainer.acc.unwrap_model(trainer.model)
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(policy))
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(trainer.ref_model))
    assert [layer.gradient_checkpointing for layer in decoder_layers(policy)] == [True, False]

    # sampling runs the layers eagerly: no graph is compiled for the KV-cache decode
    eager_copy = copy.deepcopy(trainer.ref_model)
    ids = torch.tensor([[5, 6, 7, 8]])
    graphs = counters["stats"]["unique_graphs"]
    with _generation_mode(policy):
        out = policy.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                              pad_token_id=tok.pad_token_id)
    assert counters["stats"]["unique_graphs"] == graphs
    # ... while a compiled decode step (`generation_compile`) still compiles inside it
    step = torch.compile(lambda x: x * 2 + 1, backend="aot_eager")
    with _generation_mode(policy):
        step(torch.ones(3))
    assert counters["stats"]["unique_graphs"] == graphs + 1
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(policy))  # restored
    ref_out = eager_copy.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                                  pad_token_id=tok.pad_token_id)
    assert torch.equal(out, ref_out)  # the policy has not moved yet: same greedy text as its copy

    g0 = _graphs()
    history = trainer.train()
    assert _graphs() - g0 >= 2  # the update ran the compiled layers and head
    assert len(history) == 1 and math.isfinite(history[0]["loss"]) and history[0]["grad_norm"] > 0


@pytest.mark.slow
def test_sft_with_torch_compile_matches_eager(tiny_model_dir, tmp_path, aot_eager):
    data = tmp_path / "d.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"write kernel {i}"},
                          {"role": "assistant", "content": f"```python\nimport triton  # {i}\n```"}]} for i in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def run(out, *extra):
        assert sft.main(["--model", str(tiny_model_dir), "--dataset", str(data), "--output_dir", str(out),
                         "--max_steps", "2", "--per_device_train_batch_size", "2", "--learning_rate", "1e-2",
                         "--log_with", "none", "--save_steps", "0", "--gradient_checkpointing", "true",
                         "--gradient_checkpointing_every", "2", *extra]) == 0
        return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    eager = run(tmp_path / "eager")
    g0 = _graphs()
    compiled = run(tmp_path / "compiled", "--torch_compile", "true")
    assert _graphs() > g0
    assert compiled == pytest.approx(eager, rel=1e-4) and len(eager) == 2


# ------------------------------------------------------------------ the GPU benchmark's grid, on CPU

@pytest.mark.slow
def test_update_bench_compile_variants_on_cpu(tmp_path):
    """The benchmark's own compile path, with inductor."""
    spec = importlib.util.spec_from_file_location("bench_update", ROOT / "bench" / "update.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for bad in ("compile=2", "chead=1", "ckpt=-1", "mb=x"):
        with pytest.raises(ValueError):
            bench.parse_variant(bad)
    grid = [bench.parse_variant(t) for t in bench.GPU_VARIANTS.split(";")]
    assert 1 <= len(grid) <= 8 and grid[0]["compile"] == 1 and grid[-1]["plain"]
    assert bench.parse_variant("compile=1,chead=0,ckpt=4")["name"] == "compile=1,chead=0,mb=8,ckpt=4,chunk=2048"

    out = tmp_path / "update.json"
    # the shapes of the inductor test above: its compiled kernels come from inductor's disk cache
    variants = "compile=1,mb=2,ckpt=0,chunk=0;compile=1,chead=0,mb=2,ckpt=0,chunk=16;mb=2,ckpt=1,chunk=16"
    g0 = _graphs()
    assert bench.main(["--tiny", "--out", str(out), "--variants", variants]) == 0
    assert _graphs() - g0 == 4  # layers and head, each for the no-grad π_old pass and the loss pass
    data = json.loads(out.read_text())
    rows = {r["variant"]: r for r in data["results"]}
    assert list(rows) == ["compile=1,mb=2,ckpt=0,chunk=0", "compile=1,chead=0,mb=2,ckpt=0,chunk=16",
                          "mb=2,ckpt=1,chunk=16"]
    assert data["compile_backend"] == modeling.compile_backend() == "inductor"
    for r in rows.values():
        assert r["ok"], r
        assert r["tokens"] == 128 and r["tflops_attn"] > r["tflops"] > 0


def test_update_bench_skips_compiled_variants_after_a_compiler_failure(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_update", ROOT / "bench" / "update.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setenv("DRKERNEL_COMPILE_BACKEND", "no_such_backend")
    out = tmp_path / "update.json"
    variants = "compile=1,mb=2,ckpt=0,chunk=0;compile=1,chead=0,mb=2,ckpt=1,chunk=0;mb=2,ckpt=0,chunk=0"
    assert bench.main(["--tiny", "--out", str(out), "--variants", variants]) == 0
    first, second, eager = json.loads(out.read_text())["results"]
    assert not first["ok"] and first["compile_error"] and "no_such_backend" in first["error"]
    assert not second["ok"] and second["error"].startswith("skipped")
    assert eager["ok"] and eager["tokens_per_s"] > 0
