"""What `train.py` runs, as a user meets it: the stage's preset as the base that options change one
setting at a time, `--config FILE|none`, the start line, --help, the resume check and the value and
config-file errors. The stages are replaced by fakes that record the resolved config: no model loads."""

import dataclasses
import importlib.util
import json
import types
from pathlib import Path

import pytest

from drkernel import sft, trainer
from drkernel.config import parse_config
from drkernel.runtime import record_settings
from drkernel.sft import SFTConfig
from drkernel.trainer import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
SAMPLING = ("model", "tasks", "levels", "tasks_per_step", "num_generations", "num_turns", "max_new_tokens",
            "temperature", "eval_trials", "eval_timeout")


def load_train():
    spec = importlib.util.spec_from_file_location("train_entry", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def train():
    return load_train()


class FakeTrainer:
    """Stands in for `drkernel.trainer.Trainer`: records the config it is given, trains nothing."""

    built: list = []
    acc = types.SimpleNamespace(is_main_process=True)

    def __init__(self, cfg):
        self.built.append(cfg)

    def train(self):
        return []


@pytest.fixture
def built(monkeypatch, tmp_path):
    """The configs the RL and SFT stages were started with, in order. The tests run in an empty
    directory: a bare run's output_dir (runs/rl) is relative, and one holding a run is refused."""
    monkeypatch.chdir(tmp_path)
    seen = []
    monkeypatch.setattr(FakeTrainer, "built", seen)
    monkeypatch.setattr(trainer, "Trainer", FakeTrainer)
    monkeypatch.setattr(sft, "train", lambda cfg: seen.append(cfg) or {"steps": 0, "last": {}, "final": ""})
    return seen


def run(train, argv, capsys):
    """(exit status, stderr lines) of `train.py argv`."""
    status = train.main(argv)
    return status, capsys.readouterr().err.strip().splitlines()


def test_an_option_changes_one_setting_of_the_bare_run(train, built, capsys):
    assert run(train, [], capsys)[0] == 0
    assert run(train, ["--max_steps", "1"], capsys)[0] == 0
    bare, one_step = built
    preset = parse_config(TrainConfig, ["--config", str(train.STAGES["rl"].preset)])
    assert bare == preset and bare.model == "smollm2-warmstart"
    assert one_step == dataclasses.replace(bare, max_steps=1)
    assert [getattr(one_step, k) for k in SAMPLING] == [getattr(bare, k) for k in SAMPLING]
    # the SFT stage follows the same rule with its own preset
    assert run(train, ["--stage", "sft"], capsys)[0] == 0
    assert run(train, ["--stage", "sft", "--max_steps", "1"], capsys)[0] == 0
    sft_bare, sft_one_step = built[2:]
    assert sft_bare == parse_config(SFTConfig, ["--config", str(train.STAGES["sft"].preset)])
    assert sft_bare.lora_r > 0 and sft_one_step == dataclasses.replace(sft_bare, max_steps=1)


def test_config_none_gives_the_library_defaults_and_a_file_replaces_the_preset(train, built, capsys, tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("num_turns: 4\n")
    for argv in (["--config", "none"], ["--config=NONE", "--max_steps", "3"], ["--config", str(mine)]):
        assert run(train, argv, capsys)[0] == 0
    assert built[0] == TrainConfig()
    assert built[1] == TrainConfig(max_steps=3)
    assert built[2] == TrainConfig(num_turns=4)  # the library defaults, then the file: no preset
    assert run(train, ["--stage", "sft", "--config", "none"], capsys)[0] == 0
    assert built[3] == SFTConfig()


def test_the_start_line_names_the_base(train, built, capsys, tmp_path):
    status, err = run(train, ["--max_steps", "1"], capsys)
    assert status == 0 and len(err) == 1
    assert err[0].startswith("train.py: settings: ") and "cpu_quick.yaml" in err[0] and "preset" in err[0]
    assert "max_steps=1" in err[0]
    status, err = run(train, ["--config", "none"], capsys)
    assert len(err) == 1 and "the library defaults (--config none)" in err[0] and "cpu_quick" not in err[0]
    mine = tmp_path / "mine.yaml"
    mine.write_text("num_turns: 4\n")
    status, err = run(train, ["--config", str(mine)], capsys)
    assert len(err) == 1 and str(mine) in err[0] and "cpu_quick" not in err[0]
    status, err = run(train, ["--stage", "sft"], capsys)
    assert len(err) == 1 and "sft_quick.yaml" in err[0]


@pytest.mark.parametrize("stage,preset,config_class", [([], "configs/cpu_quick.yaml", "TrainConfig"),
                                                       (["--stage", "sft"], "configs/sft_quick.yaml", "SFTConfig")])
def test_help_lists_the_stages_and_the_preset(train, capsys, monkeypatch, stage, preset, config_class):
    monkeypatch.chdir(ROOT)
    assert train.main(stage + ["--help"]) == 0
    out = capsys.readouterr().out
    assert "--stage rl|sft" in out and "--stage sft" in out and "--config none" in out
    assert f"This stage ({stage[-1] if stage else 'rl'}) without --config: {preset} sets" in out
    assert f"{config_class} options" in out and "--max_steps" in out


def make_checkpoint(output_dir: Path, cfg, step: int = 2) -> Path:
    """A checkpoint directory as `drkernel.runtime.save_checkpoint` leaves it, as far as resuming reads it."""
    path = output_dir / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": step, **record_settings(cfg)}))
    return path


def test_resume_refuses_changed_settings_and_warns_on_safe_ones(train, built, capsys, tmp_path):
    out = str(tmp_path / "run")
    made = parse_config(TrainConfig, ["--config", str(train.STAGES["rl"].preset), "--output_dir", out])
    make_checkpoint(Path(out), made)

    status, err = run(train, ["--output_dir", out, "--resume_from", "auto", "--num_turns", "3", "--temperature", "1"],
                      capsys)
    assert status == 2 and built == [] and len(err) == 2  # the start line, then the refusal
    assert err[1].startswith("train.py: error: --resume_from auto:")
    assert "num_turns 2 -> 3" in err[1] and "temperature 0.5 -> 1.0" in err[1] and "max_steps" in err[1]
    # a different base is a different configuration too
    status, err = run(train, ["--config", "none", "--output_dir", out, "--resume_from", "auto"], capsys)
    assert status == 2 and "model 'smollm2-warmstart' -> 'smollm2'" in err[-1]

    status, err = run(train, ["--output_dir", out, "--resume_from", "auto", "--max_steps", "4"], capsys)
    assert status == 0 and built[-1].max_steps == 4
    warnings = [line for line in err if line.startswith("train.py: warning:")]
    assert len(warnings) == 2 and any("max_steps 2 -> 4" in w for w in warnings)
    assert any("resume_from None -> 'auto'" in w for w in warnings)


def test_resume_of_a_checkpoint_without_recorded_settings_warns(train, built, capsys, tmp_path):
    path = tmp_path / "run" / "checkpoint-1"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": 1}))
    status, err = run(train, ["--output_dir", str(tmp_path / "run"), "--resume_from", "auto"], capsys)
    assert status == 0 and len(built) == 1 and "not checked" in err[-1]


@pytest.mark.parametrize("argv,name", [(["--temperature", "-1"], "temperature"),
                                       (["--top_p", "1.5"], "top_p"),
                                       (["--eval_timeout", "inf"], "eval_timeout"),
                                       (["--eval_trials", "0"], "eval_trials"),
                                       (["--learning_rate", "nan"], "learning_rate"),
                                       (["--stage", "sft", "--per_device_train_batch_size", "0"],
                                        "per_device_train_batch_size")])
def test_a_bad_value_exits_2_with_a_one_line_message(train, built, capsys, argv, name):
    status, err = run(train, argv, capsys)
    assert status == 2 and built == [] and len(err) == 1
    assert err[0].startswith(f"train.py: error: {name} must be ")


@pytest.mark.parametrize("stage", [[], ["--stage", "sft"]])
@pytest.mark.parametrize("content,says", [("model: [unclosed\n", "not valid YAML"),
                                          ("- a list\n- of items\n", "must be a mapping"),
                                          (None, "no such file"),
                                          (b"\xff\xfe\x00binary", "cannot read it"),
                                          ("num_turnz: 3\n", "unknown key(s) num_turnz")])
def test_a_broken_config_file_exits_2_with_a_one_line_message(train, built, capsys, tmp_path, stage, content, says):
    path = tmp_path / "broken.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    status, err = run(train, stage + ["--config", str(path)], capsys)
    assert status == 2 and built == [] and len(err) == 1
    assert err[0].startswith(f"train.py: error: --config {path}: ") and says in err[0]


@pytest.mark.parametrize("stage", [[], ["--stage", "sft"]])
@pytest.mark.parametrize("argv,says", [
    (["--lr_scheduler", "foo"], "lr_scheduler must be one of linear, cosine"),
    (["--mixed_precision", "foo"], "mixed_precision must be one of no, fp8, fp16, bf16"),
    (["--log_with", "foo"], "log_with must be a comma list of none, all, "),
    (["--output_dir", ""], "--output_dir is empty"),
    (["--output_dir", "train.py"], "--output_dir train.py: is a file"),
    (["--output_dir", "train.py/run"], "--output_dir train.py/run: lies below a file")])
def test_a_bad_library_name_or_output_dir_exits_2_before_the_stage_starts(train, built, capsys, monkeypatch, stage,
                                                                         argv, says):
    monkeypatch.chdir(ROOT)
    status, err = run(train, stage + argv, capsys)
    assert status == 2 and built == [] and len(err) == 1
    assert err[0].startswith(f"train.py: error: {says}")


def test_mask_verdicts_must_name_verdicts(train, built, capsys):
    status, err = run(train, ["--mask_verdicts", "timeout,foo"], capsys)
    assert status == 2 and built == [] and len(err) == 1
    assert err[0].startswith("train.py: error: mask_verdicts must be a comma list of correct, ") and "'foo'" in err[0]


def state_files(path: Path, files: dict[str, bytes], listed: bool = True) -> None:
    """Give checkpoint `path` these state files, listed in its trainer_state.json as saving lists them
    (`listed` false: listed nowhere, as in a checkpoint made before saving listed them)."""
    for name, data in files.items():
        (path / name).write_bytes(data)
    state = json.loads((path / "trainer_state.json").read_text())
    state["files"] = {name: len(data) for name, data in files.items()}
    if not listed:
        del state["files"]
    (path / "trainer_state.json").write_text(json.dumps(state))


ARCHIVE = b"PK\x05\x06" + b"\x00" * 18  # an empty zip archive: what a torch.save file looks like to the check


@pytest.mark.parametrize("stage", [[], ["--stage", "sft"]])
@pytest.mark.parametrize("spoil,says", [
    (lambda p: (p / "optimizer.bin").write_bytes(ARCHIVE[:10]), "optimizer.bin: 10 bytes, saved with 22"),
    (lambda p: (p / "random_states_0.pkl").unlink(), "random_states_0.pkl: missing"),
    (lambda p: state_files(p, {"optimizer.bin": b"garbage"}, listed=False), "optimizer.bin: not a torch.save archive"),
    (lambda p: state_files(p, {"model.safetensors": b"\x10" + b"\x00" * 7 + b"{}"}, listed=False),
     "model.safetensors: not a readable safetensors file"),
    (lambda p: (p / "trainer_state.json").write_text('{"step": "two"}'), "trainer_state.json: not a trainer state"),
    (lambda p: (p / "trainer_state.json").write_text('{"step": 2, "con'), "trainer_state.json: cannot read it")])
def test_resuming_a_damaged_checkpoint_names_the_file_and_exits_2(train, built, capsys, tmp_path, stage, spoil, says):
    out = tmp_path / "run"
    made = parse_config(SFTConfig if stage else TrainConfig,
                        ["--config", str(train.STAGES[stage[-1] if stage else "rl"].preset), "--output_dir", str(out)])
    path = make_checkpoint(out, made)
    state_files(path, {"optimizer.bin": ARCHIVE, "random_states_0.pkl": ARCHIVE})
    spoil(path)
    for resume_from in ("auto", str(path)):
        status, err = run(train, stage + ["--output_dir", str(out), "--resume_from", resume_from], capsys)
        assert status == 2 and built == [] and len(err) == 2  # the start line, then the refusal: no fresh start
        assert err[1].startswith("train.py: error: ") and says in err[1]


def test_auto_resume_without_a_complete_checkpoint_says_a_new_run_starts(train, built, capsys):
    out = Path("run")  # in the test's empty working directory
    status, err = run(train, ["--output_dir", str(out), "--resume_from", "auto"], capsys)
    assert status == 0 and err[1:] == [f"train.py: warning: no complete checkpoint in {out}; starting a new run"]
    (out / "checkpoint-3").mkdir(parents=True)  # a save killed before its trainer_state.json
    status, err = run(train, ["--output_dir", str(out), "--resume_from", "auto"], capsys)
    assert status == 0 and len(built) == 2
    assert err[1:] == [f"train.py: warning: no complete checkpoint in {out} (checkpoint-3 is incomplete); "
                       f"starting a new run"]
    make_checkpoint(out, built[0], step=1)
    status, err = run(train, ["--output_dir", str(out), "--resume_from", "auto"], capsys)
    assert status == 0 and err[-1] == (f"train.py: warning: {out / 'checkpoint-3'} has no trainer_state.json (its "
                                       f"save was cut off): resuming {out / 'checkpoint-1'}")


@pytest.mark.parametrize("stage", [[], ["--stage", "sft"]])
def test_a_new_run_refuses_an_output_dir_holding_a_previous_run(train, built, capsys, tmp_path, stage):
    """The README's bare command twice: the second run would append to the first's metrics.jsonl and
    leave its checkpoints beside the new ones. It stops; --resume_from auto continues it."""
    preset = train.STAGES[stage[-1] if stage else "rl"].preset
    out = Path("runs") / (stage[-1] if stage else "rl")  # the bare run's, relative to the (empty) working directory
    assert run(train, stage, capsys)[0] == 0 and parse_config(type(built[0]), ["--config", str(preset)]) == built[0]
    assert str(out) == built[0].output_dir
    make_checkpoint(out, built[0], step=7)
    (out / "metrics.jsonl").write_text('{"step": 7}\n')
    status, err = run(train, stage, capsys)
    assert status == 2 and len(built) == 1 and err[1:] == [
        f"train.py: error: {out} holds a previous run (checkpoint-7, metrics.jsonl); pass --resume_from auto to "
        f"continue it, or another --output_dir"]
    assert run(train, stage + ["--resume_from", "auto", "--max_steps", "9"], capsys)[0] == 0
    assert run(train, stage + ["--output_dir", "runs/other"], capsys)[0] == 0 and len(built) == 3

    other = Path("runs") / "evaluated"  # another script's output: this run's report would replace its report
    other.mkdir()
    (other / "results.jsonl").write_text("{}\n")
    (other / ".hidden").write_text("")
    status, err = run(train, stage + ["--output_dir", str(other)], capsys)
    assert status == 2 and len(built) == 3 and err[1:] == [
        f"train.py: error: {other} holds files of something else (results.jsonl); a run writes its checkpoints, "
        f"metrics and report there: give it a new or empty --output_dir"]
