"""Cold-start SFT: assistant-only labels, packing, the chunked loss, the training loop,
resume, the SFT -> RL hand-off, and generations -> SFT data."""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import pytest
import torch

from drkernel import sft, sft_data
from drkernel.prompts import feedback_message, first_turn_messages
from drkernel.sft_data import IGNORE_INDEX, SFTDataError
from drkernel.tasks import bundled_solution, load_bundled

ROOT = Path(__file__).resolve().parent.parent
CODE = "```python\nimport triton\n@triton.jit\ndef kernel(x_ptr, n):\n    pid = tl.program_id(0)\n```"


def conversation(i: int) -> list[dict]:
    return [
        {"role": "system", "content": "You write Triton kernels."},
        {"role": "user", "content": f"Task {i}: write ModelNew for relu."},
        {"role": "assistant", "content": f"First try {i}.\n\n```python\nclass ModelNew(nn.Module):\n    pass\n```"},
        {"role": "user", "content": "Evaluation of your answer (turn 1):\n- verdict: incorrect (wrong output)"},
        {"role": "assistant", "content": f"Fixed {i}.\n\n" + CODE},
    ]


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sft_data") / "small.jsonl"
    path.write_text("".join(json.dumps({"messages": conversation(i)}) + "\n" for i in range(6)))
    return path


# ----------------------------------------------------------------------------- labels

def content_token_sets(tokenizer, messages, ids):
    """Independent of sft_data: tokens overlapping each message's content in the rendered text."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert list(enc["input_ids"]) == list(ids), "labels must index the rendered conversation's tokens"
    pos, per_message = 0, []
    for m in messages:
        at = text.index(m["content"], pos)
        pos = at + len(m["content"])
        toks = {k for k, (a, b) in enumerate(enc["offset_mapping"]) if a < pos and b > at and b > a}
        per_message.append((m, toks, max(toks) + 1))
    return per_message


def check_labels(tokenizer, messages, ex):
    ids, labels = ex["input_ids"], ex["labels"]
    unmasked = {k for k, t in enumerate(labels) if t != IGNORE_INDEX}
    assert all(labels[k] == ids[k] for k in unmasked)
    allowed = set()
    for m, toks, after in content_token_sets(tokenizer, messages, ids):
        if m["role"] == "assistant" and m.get("weight", 1):
            assert toks <= unmasked, "an assistant content token is masked"
            allowed |= toks
            if after < len(ids) and ids[after] == tokenizer.eos_token_id:
                allowed.add(after)  # the end-of-turn token is trained (the model must learn to stop)
        else:
            assert not (toks & unmasked), f"a {m['role']} token enters the loss"
    assert unmasked <= allowed, f"tokens outside assistant content are trained: {sorted(unmasked - allowed)[:10]}"
    return unmasked


def test_only_assistant_tokens_are_trained(tiny_tokenizer):
    msgs = conversation(0)
    ex = sft_data.tokenize_conversation(msgs, tiny_tokenizer)
    assert ex["method"] == "prefix"
    unmasked = check_labels(tiny_tokenizer, msgs, ex)
    eos = [k for k in unmasked if ex["input_ids"][k] == tiny_tokenizer.eos_token_id]
    assert len(eos) == 2  # each assistant turn ends with its trained <|im_end|>


def test_bundled_conversations_labels(tiny_tokenizer):
    rows = sft_data.load_conversations(None)
    for row in rows:
        ex = sft_data.tokenize_conversation(row["messages"], tiny_tokenizer)
        check_labels(tiny_tokenizer, row["messages"], ex)


def test_weight_zero_assistant_is_context(tiny_tokenizer):
    msgs = conversation(1)
    msgs[2] = dict(msgs[2], weight=0)
    ex = sft_data.tokenize_conversation(msgs, tiny_tokenizer)
    check_labels(tiny_tokenizer, msgs, ex)
    first = content_token_sets(tiny_tokenizer, msgs, ex["input_ids"])[2][1]
    assert all(ex["labels"][k] == IGNORE_INDEX for k in first)


def test_non_prefix_template_falls_back_to_offsets(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    # earlier assistant turns are rendered with a suffix: rendering a prefix is not a prefix of the whole
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "{% if m['role'] == 'assistant' and not loop.last %} [earlier]{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    msgs = conversation(2)
    ex = sft_data.tokenize_conversation(msgs, tok)
    assert ex["method"] == "offsets"
    check_labels(tok, msgs, ex)  # " [earlier]" and every non-assistant token stay masked

    # not prefix-consistent and the content is rewritten: no way to locate it, a clear error
    tok.chat_template = tok.chat_template.replace("m['content'] }}", "m['content'] | upper }}")
    with pytest.raises(SFTDataError, match="does not appear verbatim"):
        sft_data.tokenize_conversation(msgs, tok)
    tok.chat_template = None
    with pytest.raises(SFTDataError, match="no chat template"):
        sft_data.tokenize_conversation(msgs, tok)


def test_overlong_truncate_or_drop(tiny_tokenizer):
    rows = [{"messages": conversation(i)} for i in range(3)]
    full = len(sft_data.tokenize_conversation(rows[0]["messages"], tiny_tokenizer)["input_ids"])
    limit = full - 5  # the end of the last assistant turn does not fit
    ex, st = sft_data.tokenize_dataset(rows, tiny_tokenizer, limit, "truncate")
    assert (st.truncated, st.dropped, st.sequences) == (3, 0, 3)
    assert all(len(e["input_ids"]) == limit for e in ex)
    ex, st = sft_data.tokenize_dataset(rows, tiny_tokenizer, limit, "drop")
    assert (st.truncated, st.dropped, st.sequences) == (0, 3, 0)
    # cut before any assistant token: nothing to train, dropped even when truncating
    ex, st = sft_data.tokenize_dataset(rows, tiny_tokenizer, 8, "truncate")
    assert (st.dropped, st.sequences) == (3, 0)
    with pytest.raises(SFTDataError):
        sft_data.tokenize_dataset(rows, tiny_tokenizer, limit, "wrap")


def test_invalid_conversations_are_clear_errors(tiny_tokenizer):
    with pytest.raises(SFTDataError, match="no `messages`"):
        sft_data.validate_messages(None)
    with pytest.raises(SFTDataError, match="unknown role"):
        sft_data.validate_messages([{"role": "robot", "content": "x"}])
    with pytest.raises(SFTDataError, match="no assistant"):
        sft_data.validate_messages([{"role": "user", "content": "x"}])


def test_load_conversations_from_files(tmp_path):
    rows = [{"messages": conversation(i), "extra": i} for i in range(3)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "b.json").write_text(json.dumps(rows))
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "c.parquet"))
    for name in ("a.jsonl", "b.json", "c.parquet"):
        got = sft_data.load_conversations(str(tmp_path / name))
        assert [r["messages"][1]["content"] for r in got] == [r["messages"][1]["content"] for r in rows]
    d = tmp_path / "dir"
    d.mkdir()
    (d / "train.jsonl").write_text((tmp_path / "a.jsonl").read_text())
    assert len(sft_data.load_conversations(str(d))) == 3
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "no messages"}) + "\n")
    with pytest.raises(SFTDataError, match="messages"):
        sft_data.load_conversations(str(tmp_path / "bad.jsonl"))
    with pytest.raises(SFTDataError, match="no such file"):
        sft_data.load_conversations(str(tmp_path / "missing.jsonl"))


def test_bundled_set_is_multi_turn_with_our_solutions():
    rows = sft_data.load_conversations(None)
    assert 8 <= len(rows) <= 12
    tasks = {t.name: t for t in load_bundled()}
    assert {r["task"] for r in rows} == set(tasks)
    for row in rows:
        msgs, task = row["messages"], tasks[row["task"]]
        assert msgs[:2] == first_turn_messages(task)
        roles = [m["role"] for m in msgs[2:]]
        assert roles[-1] == "assistant" and roles.count("assistant") >= 2
        assert roles == ["assistant", "user"] * (len(roles) // 2) + ["assistant"]
        for m in msgs[3:-1:2]:
            assert m["content"].startswith("Evaluation of your answer (turn ")
        final = msgs[-1]["content"]
        assert bundled_solution(task).read_text().strip() in final
        assert "ModelNew" in msgs[2]["content"] and msgs[2]["content"] != final


# ----------------------------------------------------------------------------- loss and packing

@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).float().eval()


def test_chunked_loss_matches_full_logits(tiny_lm, tiny_tokenizer):
    convs = [{"messages": conversation(i)} for i in range(2)]
    ex, _ = sft_data.tokenize_dataset(convs, tiny_tokenizer, 4096, "truncate")
    batch = sft_data.collate(ex, tiny_tokenizer.pad_token_id)
    n_ref = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    hf = tiny_lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    grads = []
    for chunk in (0, 7):
        tiny_lm.zero_grad()
        s, n = sft.SFTLoss(chunk)(tiny_lm, batch)
        assert n == n_ref
        torch.testing.assert_close(s / n, hf, rtol=1e-5, atol=1e-5)
        s.backward()
        grads.append(torch.cat([p.grad.flatten() for p in tiny_lm.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_loss_falls_back_when_logits_are_not_a_plain_projection():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gemma2", vocab_size=128, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=16, final_logit_softcapping=0.5)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 128, (2, 12))
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids), "num_tokens": 24}
    loss = sft.SFTLoss(4)
    s, n = loss(model, batch)
    assert loss.chunk_size == 0
    ref = model(input_ids=ids, attention_mask=batch["attention_mask"], labels=ids).loss
    torch.testing.assert_close(s / n, ref, rtol=1e-5, atol=1e-5)


def test_packing_keeps_sequences_apart(tiny_lm, tiny_tokenizer):
    convs = [{"messages": conversation(i)} for i in range(3)]
    ex, _ = sft_data.tokenize_dataset(convs, tiny_tokenizer, 4096, "truncate")
    rows = sft_data.pack_sequences(ex, max_length=sum(len(e["input_ids"]) for e in ex[:2]) + 3)
    assert [len(r["input_ids"]) for r in rows] == [len(ex[0]["input_ids"]) + len(ex[1]["input_ids"]),
                                                     len(ex[2]["input_ids"])]
    n0 = len(ex[0]["input_ids"])
    assert rows[0]["position_ids"][n0] == 0 and rows[0]["labels"][n0] == IGNORE_INDEX
    packed = sft_data.collate(rows, tiny_tokenizer.pad_token_id)
    assert packed["attention_mask"] is None
    with torch.no_grad():
        logits = tiny_lm(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits
        alone = tiny_lm(input_ids=torch.tensor([ex[1]["input_ids"]])).logits
    # the second sequence of the packed row sees nothing of the first
    torch.testing.assert_close(logits[0, n0:n0 + len(ex[1]["input_ids"])], alone[0], rtol=1e-4, atol=1e-4)
    # and the packed loss is the sum of the per-sequence losses
    s_packed, n_packed = sft.SFTLoss(5)(tiny_lm, packed)
    singles = [sft.SFTLoss(5)(tiny_lm, sft_data.collate([e], tiny_tokenizer.pad_token_id)) for e in ex]
    assert n_packed == sum(n for _, n in singles)
    torch.testing.assert_close(s_packed, sum(s for s, _ in singles), rtol=1e-4, atol=1e-3)


# ----------------------------------------------------------------------------- the training loop

def run_sft(out: Path, model_dir: Path, dataset: Path, *extra: str) -> int:
    return sft.main(["--model", str(model_dir), "--dataset", str(dataset), "--output_dir", str(out),
                     "--learning_rate", "3e-3", "--log_with", "none", "--per_device_train_batch_size", "2",
                     *extra])


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def data_loss(model, tokenizer, dataset: Path) -> float:
    """Mean assistant-token loss of `model` on the dataset."""
    rows = sft_data.load_conversations(str(dataset))
    ex, _ = sft_data.tokenize_dataset(rows, tokenizer, 4096, "truncate")
    batch = sft_data.collate(ex, tokenizer.pad_token_id)
    with torch.no_grad():
        s, n = sft.SFTLoss(64)(model.float().eval(), batch)
    return float(s / n)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_model_dir, small_dataset):
    out = tmp_path_factory.mktemp("sft_full")
    assert run_sft(out, tiny_model_dir, small_dataset, "--max_steps", "6", "--save_steps", "3",
                   "--stage", "sft") == 0
    return out


def test_sft_lowers_assistant_loss_and_logs(full_run, tiny_model_dir, tiny_tokenizer, small_dataset):
    from drkernel.modeling import load_model

    rows = read_metrics(full_run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "tokens", "label_tokens", "lr", "tokens_per_s", "grad_norm"):
        assert all(isinstance(r[key], (int, float)) for r in rows), key
    assert rows[-1]["loss"] < 0.9 * rows[0]["loss"]
    assert rows[0]["label_tokens"] < rows[0]["tokens"]  # prompts and feedback are not trained
    before = data_loss(load_model(str(tiny_model_dir)), tiny_tokenizer, small_dataset)
    after = data_loss(load_model(str(full_run / "final")), tiny_tokenizer, small_dataset)
    assert after < before - 0.3
    assert {"checkpoint-3", "checkpoint-6", "final", "metrics.jsonl"} <= {p.name for p in full_run.iterdir()}
    assert (full_run / "checkpoint-3" / "model" / "config.json").is_file()


def test_sft_run_writes_its_report(full_run):
    from drkernel.report import RUN_PLOT

    md = (full_run / "report.md").read_text()
    assert md.startswith(f"# SFT run: {full_run}") and "| step | loss | step_s |" in md
    loss_6 = read_metrics(full_run)[-1]["loss"]
    assert f"| 6 | {loss_6:.4g} |" in md
    assert (full_run / RUN_PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_reproduces_next_steps(full_run, tmp_path, tiny_model_dir, small_dataset):
    out = tmp_path / "resumed"
    assert run_sft(out, tiny_model_dir, small_dataset, "--max_steps", "6", "--save_steps", "3",
                   "--resume_from", str(full_run / "checkpoint-3")) == 0
    original = {r["step"]: r["loss"] for r in read_metrics(full_run)}
    resumed = {r["step"]: r["loss"] for r in read_metrics(out)}
    assert sorted(resumed) == [4, 5, 6]
    assert original[4] != original[3]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(original[step], rel=1e-6, abs=1e-7)


def test_handoff_full_weights_generate(full_run):
    from drkernel.modeling import load_model, load_tokenizer

    model = load_model(str(full_run / "final"))
    tok = load_tokenizer(str(full_run / "final"))
    ids = torch.tensor([tok("def kernel(x_ptr, n):", add_special_tokens=False)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1]
    ckpt_model = load_model(str(full_run / "checkpoint-6" / "model"))
    for a, b in zip(model.state_dict().values(), ckpt_model.state_dict().values()):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
def test_lora_sft_then_load_adapter(tmp_path, tiny_model_dir, tiny_tokenizer, small_dataset):
    from drkernel.modeling import load_model

    out = tmp_path / "lora"
    assert run_sft(out, tiny_model_dir, small_dataset, "--max_steps", "4", "--save_steps", "0",
                   "--lora_r", "8", "--lora_alpha", "16", "--learning_rate", "1e-2") == 0
    adapter = out / "final"
    assert (adapter / "adapter_config.json").is_file()
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        Path(tiny_model_dir).resolve())
    model = load_model(str(adapter))
    assert type(model).__name__.startswith("Peft")
    assert any(float(p.detach().abs().sum()) > 0 for n, p in model.named_parameters() if "lora_B" in n)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert model(input_ids=ids).logits.shape == (1, 4, len(tiny_tokenizer))
    before = data_loss(load_model(str(tiny_model_dir)), tiny_tokenizer, small_dataset)
    assert data_loss(model, tiny_tokenizer, small_dataset) < before - 0.1


def test_packing_run_and_bad_input(tmp_path, tiny_model_dir, small_dataset, capsys):
    out = tmp_path / "packed"
    assert run_sft(out, tiny_model_dir, small_dataset, "--max_steps", "2", "--save_steps", "0",
                   "--packing", "true", "--max_length", "512", "--per_device_train_batch_size", "1") == 0
    rows = read_metrics(out)
    assert len(rows) == 2 and rows[0]["tokens"] > 300  # several sequences in one packed row
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "hello"}) + "\n")
    assert run_sft(tmp_path / "bad", tiny_model_dir, bad, "--max_steps", "1") == 2
    assert "messages" in capsys.readouterr().err
    assert run_sft(tmp_path / "bad", tiny_model_dir, small_dataset, "--stage", "rl") == 2
    assert run_sft(tmp_path / "bad", tiny_model_dir, small_dataset, "--overlong", "wrap") == 2


def test_a_dataset_with_cut_or_bad_lines_skips_and_names_them(tmp_path, small_dataset, capsys):
    data = tmp_path / "data.jsonl"
    good = small_dataset.read_text().splitlines()
    data.write_text("\n".join([good[0], "not json", json.dumps({"text": "no messages"}), good[1], good[2][:50]]))
    rows = sft.read_conversations(sft.SFTConfig(dataset=str(data), output_dir=str(tmp_path / "out")))
    assert [r["messages"] for r in rows] == [json.loads(line)["messages"] for line in good[:2]]
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[sft]")]  # not datasets' bars
    assert len(said) == 1 and said[0].startswith(f"[sft] warning: --dataset {data}: skipped 3 unusable line(s): ")
    assert "line 2: not a JSON object" in said[0] and "line 3: no `messages`" in said[0] and "line 5: " in said[0]


@pytest.mark.parametrize("content,says", [
    (b"", "the file is empty"), (b"\n\n", "no usable rows (only blank lines)"),
    (b"\xff\xfe garbage\n{\"messages\": [", "no usable rows (line 1: not UTF-8"),
    (b'{"text": 1}\n{"messages": []}\n', "no usable rows (line 1: no `messages`")])
def test_an_empty_or_all_bad_dataset_exits_2_before_anything_loads(tmp_path, monkeypatch, capsys, content, says):
    from drkernel import modeling

    monkeypatch.setattr(modeling, "load_tokenizer", lambda *a: pytest.fail("loaded a tokenizer for a bad dataset"))
    data = tmp_path / "data.jsonl"
    data.write_bytes(content)
    assert run_sft(tmp_path / "out", tmp_path / "no_model", data) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"drkernel.sft: error: --dataset {data}: {says}") and "Traceback" not in "".join(err)


def damaged_copy(checkpoint: Path, out: Path, name: str, data: bytes, listed: bool = False) -> Path:
    """A copy of `checkpoint` in `out` with state file `name` replaced by `data` (`listed`: its new size
    recorded in trainer_state.json, so only restoring it can tell)."""
    import shutil

    copy = out / checkpoint.name
    shutil.copytree(checkpoint, copy)
    (copy / name).write_bytes(data)
    if listed:
        state = json.loads((copy / "trainer_state.json").read_text())
        state["files"][name] = len(data)
        (copy / "trainer_state.json").write_text(json.dumps(state))
    return copy


def test_resuming_a_damaged_checkpoint_exits_2_naming_it(full_run, tmp_path, tiny_model_dir, small_dataset, capsys):
    checkpoint = full_run / "checkpoint-3"
    listed = json.loads((checkpoint / "trainer_state.json").read_text())["files"]
    assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl"} <= set(listed)
    cut = damaged_copy(checkpoint, tmp_path / "cut", "optimizer.bin", (checkpoint / "optimizer.bin").read_bytes()[:99])
    assert run_sft(tmp_path / "cut", tiny_model_dir, small_dataset, "--resume_from", "auto") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"drkernel.sft: error: --resume_from auto: {cut / 'optimizer.bin'}: 99 bytes, saved with")
    # a well-formed file that is not this run's optimizer state: restoring it fails, said in one line
    buffer = io.BytesIO()
    torch.save({"not": "an optimizer"}, buffer)
    other = damaged_copy(checkpoint, tmp_path / "other", "optimizer.bin", buffer.getvalue(), listed=True)
    assert run_sft(tmp_path / "other", tiny_model_dir, small_dataset, "--resume_from", str(other)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"drkernel.sft: error: cannot restore {other}: KeyError")


def warmstart_build():
    """drkernel/data/warmstart/build.py, a script, as a module."""
    path = ROOT / "drkernel" / "data" / "warmstart" / "build.py"
    spec = importlib.util.spec_from_file_location("warmstart_build", path)
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build


def finished_sft_run(work: Path, weight: float, metrics: str) -> None:
    """What the warm-start's SFT run leaves in `work`: a smollm2 LoRA adapter in final/ and `metrics`."""
    from safetensors.torch import save_file

    (work / "final").mkdir(parents=True, exist_ok=True)
    (work / "final" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "smollm2", "r": 8}))
    save_file({"lora_A.weight": torch.full((2, 3), weight)}, work / "final" / "adapter_model.safetensors")
    (work / "metrics.jsonl").write_text(metrics)


def test_warmstart_build_reads_metrics_as_the_report_does_and_keeps_the_adapter_whole(tmp_path, monkeypatch, capsys):
    """A cut last line of the SFT run's metrics.jsonl is skipped and named, a step logged twice (by a
    resumed run) counts once; with no step at all the build stops before it touches --out, so the
    adapter there and its provenance.json stay as they were."""
    from safetensors.torch import load_file

    build, work, out = warmstart_build(), tmp_path / "work", tmp_path / "out"
    monkeypatch.setattr(sft, "main", lambda argv: 0)  # the SFT run: finished_sft_run stands for it
    rows = [{"step": 1, "loss": 2.0, "step_time_s": 10.0}, {"step": 2, "loss": 1.5, "step_time_s": 20.0},
            {"step": 2, "loss": 1.0, "step_time_s": 30.0}]
    finished_sft_run(work, 0.5, "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "lo')
    assert build.main(["--work_dir", str(work), "--out", str(out)]) == 0
    provenance = json.loads((out / "provenance.json").read_text())
    assert (provenance["steps"], provenance["final_loss"], provenance["sft_step_seconds"]) == (2, 1.0, 40)
    assert (provenance["tensors"], provenance["parameters"]) == (1, 6)
    assert load_file(out / "adapter_model.safetensors")["lora_A.weight"].dtype == torch.float16
    assert "skipped 1 line(s) that hold no step: line 4: not a JSON object" in capsys.readouterr().err

    shipped = {p.name: p.read_bytes() for p in out.iterdir()}
    finished_sft_run(work, 0.25, '{"step": 1, "lo')
    with pytest.raises(SystemExit, match="holds no step; the adapter is not exported"):
        build.main(["--work_dir", str(work), "--out", str(out)])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == shipped


# ----------------------------------------------------------------------------- generations -> SFT

TASK_NAMES = {t.problem_id: t.name for t in load_bundled()}  # a row names its task's file (Task.row_problem)


def gen_row(pid, sample, turn, verdict, reward, speedup=None, hacks=(), code="", level=0, **extra):
    response = f"Attempt {turn}.\n\n```python\n{code}```" if code else "I could not write it."
    return {"level": level, "problem_id": pid, "task": TASK_NAMES.get(pid, f"{pid}_Unknown.py"), "sample": sample,
            "turn": turn, "response": response,
            "code": code or None, "verdict": verdict, "correct": verdict == "correct", "speedup": speedup,
            "reward": reward, "hacks": list(hacks), **extra}


KERNEL_A = "import triton\n\n\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return x  # A\n"
KERNEL_A_REFORMATTED = "import triton\nclass ModelNew( nn.Module ):\n    # same kernel\n    def forward(self,x):\n        return x\n"
KERNEL_B = "import triton\n\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return x + 0  # B\n"


@pytest.fixture()
def generations(tmp_path) -> Path:
    rows = [
        # sample 0: fails, then a fast correct kernel -> kept, two turns
        gen_row(1, 0, 0, "incorrect", 0.0, code=KERNEL_B, error="max abs err 0.5", max_abs_err=0.5, max_rel_err=0.2),
        gen_row(1, 0, 1, "correct", 1.2, 1.5, code=KERNEL_A, ref_ms=1.0, candidate_ms=0.66),
        # sample 1: correct, then a hack, then correct -> cut before the hack
        gen_row(1, 1, 0, "correct", 1.0, 1.1, code=KERNEL_B),
        gen_row(1, 1, 1, "hacked", 0.0, hacks=["decoy_kernel"], code="import torch  # hack\nModelNew = 1\n"),
        gen_row(1, 1, 2, "correct", 1.5, 2.0, code="import triton\nclass ModelNew: pass  # C\n"),
        # sample 2: never correct -> dropped
        gen_row(1, 2, 0, "compile_error", 0.0, code=KERNEL_B, error="SyntaxError"),
        gen_row(1, 2, 1, "runtime_error", 0.0, code=KERNEL_B, error="boom"),
        # sample 3: the same final kernel as sample 0 (formatting, comments) with a lower reward -> duplicate
        gen_row(1, 3, 0, "correct", 1.1, 1.4, code=KERNEL_A_REFORMATTED),
        # problem 2: correct but slower than the reference
        gen_row(2, 0, 0, "correct", 0.9, 0.8, code=KERNEL_B + "# problem 2\n"),
        # a problem we do not have
        gen_row(99, 0, 0, "correct", 1.0, 1.0, code=KERNEL_B, level=7),
    ]
    path = tmp_path / "gen.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_generations_to_sft(generations, tiny_tokenizer):
    rows = [json.loads(line) for line in generations.read_text().splitlines()]
    tasks = load_bundled()
    out, stats = sft_data.generations_to_sft(rows, tasks, min_speedup=1.05)
    assert [(r["problem_id"], r["sample"], r["turns"]) for r in out] == [(1, 0, 2), (1, 1, 1)]
    assert stats == sft_data.ConvertStats(trajectories=6, kept=2, missing_task=1, hacked_turns_dropped=2,
                                          truncated_at_hack=1, below_threshold=2, duplicates=1)
    task1 = next(t for t in tasks if t.problem_id == 1)
    msgs = out[0]["messages"]
    assert msgs[:2] == first_turn_messages(task1)
    assert msgs[2] == {"role": "assistant", "content": rows[0]["response"], "weight": 0}
    assert msgs[3] == {"role": "user", "content": feedback_message(rows[0], 1)}  # generate.py's turn 0: the 1st
    assert "max abs error: 0.5" in msgs[3]["content"]
    assert msgs[4] == {"role": "assistant", "content": rows[1]["response"], "weight": 1}
    assert len(msgs) == 5
    hacked = out[1]["messages"]
    assert [m["role"] for m in hacked] == ["system", "user", "assistant"]
    assert "hack" not in hacked[-1]["content"]
    assert out[0]["kernel_hash"] == sft_data.kernel_hash(KERNEL_A_REFORMATTED) != sft_data.kernel_hash(KERNEL_B)
    deep = "y = " + "-" * 5000 + "x\n"  # too deep for Python's parser: hashed as text
    assert sft_data.kernel_hash(deep) == sft_data.kernel_hash(" " + deep) != sft_data.kernel_hash(deep + "z = 1\n")
    # the failed first answer is context, the fix is trained
    ex = sft_data.tokenize_conversation(msgs, tiny_tokenizer)
    check_labels(tiny_tokenizer, msgs, ex)

    out, stats = sft_data.generations_to_sft(rows, tasks, min_reward=1.15)
    assert [(r["problem_id"], r["sample"]) for r in out] == [(1, 0)]
    out, _ = sft_data.generations_to_sft(rows, tasks)  # no thresholds: any correct, non-hacked turn
    assert [(r["problem_id"], r["sample"]) for r in out] == [(1, 0), (1, 1), (2, 0)]
    out, _ = sft_data.generations_to_sft(rows, tasks, train_failed_turns=True)
    assert "weight" not in out[0]["messages"][2]
    # rows that cannot be placed in a conversation are skipped and named, the rest still convert
    bad = [{"level": 0}, {**rows[0], "sample": "x"}, {**rows[0], "turn": True}]
    out, stats = sft_data.generations_to_sft(bad + rows, tasks)
    assert [(r["problem_id"], r["sample"]) for r in out] == [(1, 0), (1, 1), (2, 0)]
    assert stats.skipped == ["row 1: missing key(s) problem_id, sample, turn, response",
                             "row 2: sample not an integer", "row 3: turn not an integer"]


def test_generations_cli(generations, tmp_path, capsys):
    out = tmp_path / "sft.jsonl"
    assert sft_data.main(["--generations", str(generations), "--out", str(out), "--min_speedup", "1.05"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["kept"] == 2
    rows = sft_data.load_conversations(str(out))
    assert len(rows) == 2 and rows[0]["messages"][2]["weight"] == 0
    assert sft_data.main(["--generations", str(tmp_path / "nope.jsonl"), "--out", str(out)]) == 2
    assert "no such file" in capsys.readouterr().err


def test_generations_cli_skips_and_names_unusable_lines(generations, tmp_path, capsys):
    """A killed generate.py run leaves its last line cut, and a row may lack what a conversation
    needs: each such line is skipped and named on stderr, every other row converts (exit 0). A .json
    list that is not JSON is a clear error (exit 2), not a traceback."""
    out = tmp_path / "sft.jsonl"
    cut = tmp_path / "cut.jsonl"
    lines = generations.read_text().splitlines()
    cut.write_text("\n".join([lines[0], '{"level": "one", "problem_id": 1, "sample": 0, "turn": 0, "response": ""}',
                              *lines[1:], '{"level": 1, "problem_id"']) + "\n")
    assert sft_data.main(["--generations", str(cut), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "skipped 2 unusable row(s): line 2: level not an integer; line 12: not a JSON object" in captured.err
    assert json.loads(captured.out.strip().splitlines()[-1])["kept"] == 3
    assert len(sft_data.load_conversations(str(out))) == 3
    out.unlink()
    broken = tmp_path / "gen.json"
    broken.write_text('[{"level": 1},')
    assert sft_data.main(["--generations", str(broken), "--out", str(out)]) == 2
    assert f"{broken}: not valid JSON" in capsys.readouterr().err
    assert not out.exists()


def test_generations_of_another_task_set_are_skipped_and_named(generations, tmp_path, capsys):
    """Rows are placed by (level, problem_id): a --tasks folder whose 1_*.py is another problem must
    not pair its prompt with the answers written for bundled 1_ReLU.py; nor may a row whose code
    digest is another's, or one that names no task."""
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "1_Softmax.py").write_text(load_bundled([4])[0].code)
    out = tmp_path / "sft.jsonl"
    assert sft_data.main(["--generations", str(generations), "--tasks", str(folder), "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()  # nothing kept: an error, no empty file
    assert line.startswith(f"drkernel.sft_data: error: --generations {generations}: no conversation to write (")
    assert "8 unusable row(s): row 1: answers another task than 1_Softmax.py: task '1_ReLU.py' " \
           "(not '1_Softmax.py'); row 2: " in line and not out.exists()

    relu = load_bundled([1])[0]
    good = dict(json.loads(generations.read_text().splitlines()[1]), turn=0)  # problem 1, correct, alone
    rows = [{**good, "task_sha": "0" * 16}, {k: v for k, v in good.items() if k != "task"}, {**good, "task_sha": relu.digest}]
    converted, stats = sft_data.generations_to_sft(rows, load_bundled())
    assert [(r["problem_id"], r["sample"]) for r in converted] == [(1, 0)]  # the row that names its task
    assert stats.skipped == [f"row 1: answers another task than 1_ReLU.py: task_sha '{'0' * 16}' (not '{relu.digest}')",
                             "row 2: names no task (no `task` column): it may answer another task than 1_ReLU.py"]


def test_the_rows_of_several_runs_are_not_stitched_into_one_conversation(generations, tmp_path, capsys):
    """generate.py outputs concatenated repeat a (level, problem_id, sample, turn): which rows belong
    together is unknown, so that trajectory is skipped whole and named, never stitched into a
    conversation no run had; so is one whose turns are not 0..k. The others still convert."""
    rows = [json.loads(line) for line in generations.read_text().splitlines()]
    other_run = gen_row(1, 0, 0, "correct", 1.3, 1.6, code=KERNEL_B + "# run 2\n")  # another run's sample 0
    gap = [gen_row(2, 1, 0, "incorrect", 0.0, code=KERNEL_B), gen_row(2, 1, 2, "correct", 1.0, 1.2, code=KERNEL_A)]
    out, stats = sft_data.generations_to_sft(rows + [other_run] + gap, load_bundled())
    assert [(r["problem_id"], r["sample"], r["turns"]) for r in out] == [(1, 1, 1), (1, 3, 1), (2, 0, 1)]
    assert (stats.trajectories, stats.repeated_turns, stats.turn_gaps, stats.duplicates) == (7, 1, 1, 0)
    assert stats.skipped_trajectories == [
        "level 0 problem 1 sample 0: turn(s) 0 in several rows (several runs' files concatenated?)",
        "level 0 problem 2 sample 1: turns 0, 2 are not 0..1"]

    joined = tmp_path / "joined.jsonl"
    joined.write_text(generations.read_text() + json.dumps(other_run) + "\n")
    out_file = tmp_path / "sft.jsonl"
    assert sft_data.main(["--generations", str(joined), "--out", str(out_file)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["repeated_turns"] == 1
    assert (f"{joined}: skipped 1 trajectory(ies) whose rows are not one run's turns 0..k: level 0 problem 1 "
            f"sample 0: turn(s) 0 in several rows") in captured.err
    assert "# run 2" not in out_file.read_text()


@pytest.mark.parametrize("content, says", [
    (b"", "(the file holds no rows)"),
    (b'\xff binary\n{"level": "one"}\n', "(2 unusable row(s): line 1: not UTF-8 text (byte 1); line 2: missing key(s) "),
    (json.dumps(gen_row(1, 0, 0, "incorrect", 0.0, code=KERNEL_B)).encode() + b"\n",
     "(1 trajectory(ies), 1 without a qualifying turn)"),
], ids=["empty", "all_unusable", "none_qualifies"])
def test_generations_without_a_conversation_exit_2(tmp_path, capsys, content, says):
    """No conversation to write is one error line (status 2), and no empty --out is left behind."""
    gen, out = tmp_path / "gen.jsonl", tmp_path / "sft.jsonl"
    gen.write_bytes(content)
    assert sft_data.main(["--generations", str(gen), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith(f"drkernel.sft_data: error: --generations {gen}: no conversation to write ") and says in line
    assert captured.out == "" and not out.exists()


@pytest.mark.parametrize("flags, says", [
    (["--generations", "{tmp}"], "--generations {tmp}: is a directory, not a file"),
    (["--generations", "{gen}", "--min_speedup", "-1"], "min_speedup must be > 0, got -1.0"),
    (["--generations", "{gen}", "--min_speedup", "0"], "min_speedup must be > 0, got 0.0"),
    (["--generations", "{gen}", "--min_reward", "inf"], "min_reward must be a finite number, got inf"),
], ids=["directory", "negative_speedup", "zero_speedup", "infinite_reward"])
def test_generations_cli_names_a_bad_option(generations, tmp_path, capsys, flags, says):
    out = tmp_path / "sft.jsonl"
    flags = [f.format(tmp=tmp_path, gen=generations) for f in flags]
    assert sft_data.main(flags + ["--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"drkernel.sft_data: error: {says.format(tmp=tmp_path)}") and not out.exists()


def test_generations_cli_writes_below_outputs_by_default(generations, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --out is relative: outputs/ of the working directory, as README's
    assert sft_data.main(["--generations", str(generations)]) == 0
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.jsonl")] == ["gen.jsonl", "outputs/sft.jsonl"]


@pytest.mark.parametrize("out, says", [("", "--out is empty (name a file)"),
                                       ("{tmp}", "--out {tmp}: is a directory, not a file"),
                                       ("/proc/drk_none/sft.jsonl", "--out /proc/drk_none/sft.jsonl: /proc is not writable")])
def test_generations_cli_names_an_out_it_cannot_write(generations, tmp_path, capsys, out, says):
    out, says = out.format(tmp=tmp_path), says.format(tmp=tmp_path)
    assert sft_data.main(["--generations", str(generations), "--out", out]) == 2
    assert capsys.readouterr().err.strip().startswith(f"drkernel.sft_data: error: {says}")


def test_bundled_labels_with_the_default_models_template():
    """The offline default's real chat template (SmolLM2, fetched into the cache on first use)
    on the bundled set."""
    from drkernel.modeling import load_tokenizer

    tok = load_tokenizer("smollm2")
    for row in sft_data.load_conversations(None):
        ex = sft_data.tokenize_conversation(row["messages"], tok)
        assert ex["method"] == "prefix"
        check_labels(tok, row["messages"], ex)
