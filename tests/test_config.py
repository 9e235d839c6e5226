"""One source of defaults: scripts' configs mirror the library configs without retyping a default,
shipped config files set only what they change, command-line and YAML overrides reach the composed
configs, and configs/drkernel_recipe.yaml over the defaults gives the released values of docs/algorithm.md."""

import ast
import dataclasses
import os
import re
import sys
import typing
from pathlib import Path

import pytest
import yaml

from drkernel.config import (ConfigError, TaskSelection, cache_dir_problem, coerce, compose, create_output, disagreements, limit_problems,
                             limits, load_yaml, output_problem, parse_config, shared_settings)
from drkernel.evaluator import EvalConfig
from drkernel.rollout import RolloutConfig
from drkernel.runtime import start_run
from drkernel.sft import SFTConfig
from drkernel.trainer import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import evaluate  # noqa: E402
import generate  # noqa: E402
import train  # noqa: E402

SCRIPT_CONFIGS = (TrainConfig, generate.GenerateConfig, evaluate.EvaluateConfig)


@pytest.mark.parametrize("cls", SCRIPT_CONFIGS, ids=lambda c: c.__name__)
def test_no_script_config_disagrees_with_a_library_config(cls):
    assert disagreements(cls) == []
    names = {f.name for f in dataclasses.fields(cls)}
    for target, keys in shared_settings(cls).items():
        assert set(keys) <= names and set(keys.values()) <= {f.name for f in dataclasses.fields(target)}


def test_settings_shared_by_several_scripts_agree():
    train, gen, ev = TrainConfig(), generate.GenerateConfig(), evaluate.EvaluateConfig()
    assert (train.eval_trials, train.eval_perf_trials, train.eval_timeout) == \
        (gen.trials, gen.perf_trials, gen.timeout) == (ev.trials, ev.perf_trials, ev.timeout) == (5, 100, 180.0)
    assert (train.num_turns, train.max_prompt_tokens) == (gen.num_turns, gen.max_prompt_tokens)
    assert (train.num_generations, train.num_turns) == (RolloutConfig().num_generations, RolloutConfig().num_turns)
    assert (train.tasks, train.levels, train.model) == (gen.tasks, gen.levels, gen.model)


def test_the_config_module_builds_on_no_other_drkernel_module():
    """Every config class builds on drkernel.config, so it imports none of them (no import circle);
    only `TaskSelection` reaches drkernel.tasks, when it loads tasks."""
    tree = ast.parse((ROOT / "drkernel" / "config.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    assert {m for m in imported if m.startswith("drkernel")} == {"drkernel.tasks"}


def test_a_retyped_default_is_reported():
    @dataclasses.dataclass
    class Retyped:
        SHARED = ((EvalConfig, {"trials": "trials", "timeout": "timeout"}),)
        trials: int = 3  # EvalConfig says 5
        timeout: float = EvalConfig.timeout

    assert disagreements(Retyped) == ["Retyped.trials = 3 but EvalConfig.trials = 5"]


def test_overrides_reach_the_composed_configs(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("eval_trials: 2\nprs_missing_profile: keep\ngeo_scope: turn\n")
    cfg = parse_config(TrainConfig, ["--config", str(path), "--eval_timeout", "33", "--num_turns", "4"])
    assert (cfg.eval_config("cpu").trials, cfg.eval_config("cpu").timeout) == (2, 33.0)
    assert cfg.reward_config().prs_missing_profile == "keep" and cfg.mismatch_config().geo_scope == "turn"
    assert cfg.rollout_config(seed=1).num_turns == 4
    gen = parse_config(generate.GenerateConfig, ["--trials", "1", "--max_new_tokens", "9"])
    assert compose(gen, EvalConfig, device="cpu").trials == 1 and compose(gen, RolloutConfig).max_prompt_tokens == 4096


SHIPPED = sorted((ROOT / "configs").glob("*.yaml"))


def _stage_config(path: Path) -> type:
    return SFTConfig if path == train.STAGES["sft"].preset else TrainConfig


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = parse_config(_stage_config(path), ["--config", str(path)])
    assert set(yaml.safe_load(path.read_text())) <= {f.name for f in dataclasses.fields(cfg)}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_a_shipped_config_lists_only_what_it_changes(path):
    """Every shipped file is applied over the library defaults (a preset and --config FILE alike), so a
    key it sets to the default would be a second copy of that default."""
    cls = _stage_config(path)
    cfg, default = parse_config(cls, ["--config", str(path)]), cls()
    assert [key for key in yaml.safe_load(path.read_text()) if getattr(cfg, key) == getattr(default, key)] == []


def _numeric(tp) -> bool:
    return any(t in (int, float) for t in typing.get_args(tp) or (tp,))


@pytest.mark.parametrize("cls", (TrainConfig, SFTConfig), ids=lambda c: c.__name__)
def test_every_numeric_setting_of_a_training_stage_has_a_limit(cls):
    hints = typing.get_type_hints(cls)
    numeric = {f.name for f in dataclasses.fields(cls) if _numeric(hints[f.name])}
    assert numeric <= set(limits(cls))  # text settings (the evaluator's device, baseline) may have limits too
    assert limit_problems(cls()) == []


def test_a_library_limit_reaches_every_script_that_mirrors_it():
    """GenerationConfig says temperature >= 0 once; train.py (stricter: RL samples) and generate.py's config
    both check it through their SHARED maps."""
    assert limit_problems(generate.GenerateConfig(temperature=-1.0, top_p=0.0)) == [
        "temperature must be >= 0, got -1.0 (0 = greedy)", "top_p must be in (0, 1], got 0.0"]
    assert limit_problems(generate.GenerateConfig(temperature=0.0)) == []
    with pytest.raises(ValueError, match="temperature must be > 0"):
        TrainConfig(temperature=0.0)


def test_names_check_a_value_or_a_comma_list_against_a_library_listing():
    from drkernel.config import Names

    calls = []
    lazy = Names(lambda: calls.append(1) or ("a", "b"))
    assert calls == []  # the listing is read only when a value is checked
    assert lazy.problem("x", "a") is None and calls == [1]
    assert lazy.problem("x", "c") == "x must be one of a, b, got 'c'"
    listed = Names(("a", "b"), comma_list=True)
    assert listed.problem("x", "") is None and listed.problem("x", " a, b,") is None
    assert listed.problem("x", "a,zz") == "x must be a comma list of a, b, got 'zz'"


@pytest.mark.parametrize("cls", (TrainConfig, SFTConfig), ids=lambda c: c.__name__)
@pytest.mark.parametrize("key,value,allowed", [("lr_scheduler", "foo", "cosine"), ("mixed_precision", "fp4", "bf16"),
                                               ("log_with", "tensorboard,foo", "wandb")])
def test_library_names_are_checked_with_the_allowed_ones_listed(cls, key, value, allowed):
    with pytest.raises(ValueError, match=f"^{key} must be .*{allowed}.*, got '(foo|fp4)'$"):
        parse_config(cls, [f"--{key}", value])


def test_every_allowed_lr_scheduler_builds_and_steps_as_the_stages_use_it():
    """What --lr_scheduler accepts comes from transformers' SchedulerType, less the schedulers that
    `get_scheduler` cannot build without further arguments or step without a metric."""
    import torch
    from transformers import get_scheduler

    from drkernel.runtime import lr_schedulers

    assert {"linear", "cosine", "constant_with_warmup"} <= set(lr_schedulers())
    assert "reduce_lr_on_plateau" not in lr_schedulers()
    for name in lr_schedulers():
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        scheduler = get_scheduler(name, optimizer, num_warmup_steps=1, num_training_steps=4)
        optimizer.step()
        scheduler.step()


def test_mask_verdicts_are_verdict_names():
    from drkernel.evaltypes import VERDICTS

    assert parse_config(TrainConfig, ["--mask_verdicts", "timeout, crashed,format_error"]).mask_verdicts
    assert all(parse_config(TrainConfig, ["--mask_verdicts", v]) for v in VERDICTS)
    with pytest.raises(ValueError, match="^mask_verdicts must be a comma list of correct, .*timeout.*, got 'timeuot'$"):
        parse_config(TrainConfig, ["--mask_verdicts", "crashed,timeuot"])


@pytest.mark.parametrize("cls", (TrainConfig, SFTConfig), ids=lambda c: c.__name__)
def test_output_dir_must_be_a_directory_that_can_be_made(cls, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert parse_config(cls, ["--output_dir", str(tmp_path / "new" / "run")]).output_dir
    for value, says in [(str(a_file), "is a file, not a directory"), ("", "is empty"),
                        (str(a_file / "run"), "lies below a file")]:
        with pytest.raises(ValueError, match=f"^--output_dir .*{says}"):
            parse_config(cls, ["--output_dir", value])


# ---------------------------------------------------------------------------- the released recipe

def recipe_table() -> dict[str, str]:
    """`| \\`field\\` | value | KernelGYM source |` rows of docs/algorithm.md's recipe section."""
    text = (ROOT / "docs" / "algorithm.md").read_text()
    section = text.split("## The released recipe", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+?) \| (.+?) \|$", section, flags=re.M)
    assert all(source.strip() for _, _, source in rows)
    return {field: value.strip() for field, value, _ in rows}


def test_the_recipe_gives_the_documented_table():
    """The file sets what the recipe changes from the library defaults; with them it gives every
    released value of the table, and it sets nothing the table does not document."""
    table = recipe_table()
    path = ROOT / "configs" / "drkernel_recipe.yaml"
    assert set(yaml.safe_load(path.read_text())) <= set(table)
    cfg = parse_config(TrainConfig, ["--config", str(path)])
    hints = typing.get_type_hints(TrainConfig)
    for field, value in table.items():
        assert getattr(cfg, field) == coerce(value, hints[field], field), field


def test_create_output_makes_the_path_now_and_names_a_refused_one(tmp_path):
    """Outputs are created before a model loads: a file (its folders too) left as it is, a
    directory; a path the system refuses is one line naming the option."""
    kept = tmp_path / "a" / "rows.jsonl"
    assert create_output("--output", str(kept)) is None and kept.read_text() == ""
    kept.write_text("row\n")
    assert create_output("--output", str(kept)) is None and kept.read_text() == "row\n"
    assert create_output("--output_dir", str(tmp_path / "b" / "c"), is_dir=True) is None
    assert (tmp_path / "b" / "c").is_dir()
    problem = create_output("--output_dir", "/proc/drk_none/eval", is_dir=True)
    assert problem and problem.startswith("--output_dir /proc/drk_none/eval: cannot create it")


@pytest.mark.parametrize("cls", (TrainConfig, SFTConfig), ids=lambda c: c.__name__)
def test_a_training_stage_refuses_an_output_dir_it_cannot_create_before_a_model_loads(cls, tmp_path):
    """A path the system refuses (here /proc, writable to root by its mode) names the option."""
    assert start_run(cls, ["--config", "none", "--output_dir", str(tmp_path / "run")], None, "train.py")
    with pytest.raises(ConfigError, match="^--output_dir /proc/drk_none/run: /proc is not writable"):
        start_run(cls, ["--config", "none", "--output_dir", "/proc/drk_none/run"], None, "train.py")


def test_an_eval_cache_dir_that_is_a_file_is_refused_not_left_unused(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert parse_config(TrainConfig, ["--eval_cache_dir", str(tmp_path / "cache")]).eval_cache_dir
    with pytest.raises(ConfigError, match=f"^--eval_cache_dir {a_file}: is a file, not a directory$"):
        parse_config(TrainConfig, ["--eval_cache_dir", str(a_file)])
    with pytest.raises(ConfigError, match="^--eval_cache_dir /proc/drk_none/cache: /proc is not writable$"):
        parse_config(TrainConfig, ["--eval_cache_dir", "/proc/drk_none/cache"])  # it could never be made
    assert parse_config(TrainConfig, ["--eval_cache_dir", "/proc"]).eval_cache_dir  # an existing one may be read-only


@pytest.mark.parametrize("tasks", ["", "  "])
def test_an_empty_tasks_option_says_so(tasks):
    with pytest.raises(ConfigError, match="^--tasks is empty"):
        TaskSelection(tasks=tasks).selected_tasks()


def test_an_output_below_a_place_nothing_can_be_created_in_is_refused_even_for_root(tmp_path):
    """Writability is tried, not read from permission bits (which pass for root on /proc)."""
    assert output_problem("--out", "/proc/drk_none/rows.json") == "--out /proc/drk_none/rows.json: /proc is not writable"
    assert output_problem("--out", str(tmp_path / "new" / "rows.json")) is None
    assert list(tmp_path.iterdir()) == []  # the try leaves nothing behind


def test_an_output_that_is_a_device_or_a_pipe_is_refused(tmp_path):
    """Scripts write files beside their output (a summary, a report): beside /dev/null is /dev.
    (A pipe here: this machine's /dev/null is a regular file.)"""
    os.mkfifo(tmp_path / "pipe")
    assert output_problem("--output", str(tmp_path / "pipe")) == f"--output {tmp_path / 'pipe'}: is not a regular file"


def test_an_output_that_is_a_link_to_nothing_is_refused(tmp_path):
    link = tmp_path / "results.jsonl"
    link.symlink_to(tmp_path / "gone" / "results.jsonl")
    assert "is a link to nothing" in output_problem("--output", str(link))


def test_a_path_the_system_refuses_to_look_at_is_one_line(tmp_path):
    """A name over 255 bytes makes even a stat raise: what the system says, naming the option."""
    long = str(tmp_path / ("a" * 300))
    assert output_problem("--output_dir", long, is_dir=True) == f"--output_dir {long}: File name too long"
    assert cache_dir_problem("--cache_dir", long) == f"--cache_dir {long}: File name too long"
    with pytest.raises(ConfigError, match="seed must be in \\[0, 4.29497e\\+09\\]"):
        start_run(TrainConfig, ["--config", "none", "--output_dir", str(tmp_path / "r"), "--seed", str(2**32)],
                  None, "train.py")


def test_a_null_for_a_setting_that_is_not_optional_is_refused():
    """`output_dir: null` in a YAML file is refused where it is read, before any path is made of it."""
    with pytest.raises(ConfigError, match="output_dir must be str, got None"):
        coerce(None, str, "output_dir")
    assert coerce(None, typing.Optional[int], "seed") is None


def test_a_count_past_any_real_run_is_refused():
    """A mistyped count (1e11 samples) is refused at once; it used to hang building its work."""
    from drkernel.config import COUNT
    assert COUNT.problem("samples_per_task", 10**6) is None
    assert "samples_per_task must be in [1, 1e+06]" in COUNT.problem("samples_per_task", 10**11)


def test_a_key_given_twice_in_a_config_file_is_refused_at_any_depth(tmp_path):
    # YAML keeps the last of two values silently: one of the user's two settings would be dropped
    path = tmp_path / "run.yaml"
    for text, key, line in (("lr: 1\nseed: 2\nlr: 3\n", "lr", 3), ("x: [{c: 1, c: 2}]\n", "c", 1),
                            ("x: {yes: 1, true: 2}\n", "true", 1)):  # one key as YAML reads it
        path.write_text(text)
        with pytest.raises(ConfigError, match=f"^--config {path}: '{key}' is given twice \\(line {line}\\)"):
            load_yaml(str(path))
    path.write_text("a: &x [*x]\nb: {c: 1}\nd: {c: 2}\n")  # an alias into itself; one key in two mappings
    assert load_yaml(str(path))["b"] == {"c": 1}


HOLDER = ("import sys, time\nfrom drkernel.config import create_output\n"
          "print(create_output('--output', sys.argv[1], is_dir=sys.argv[2] == 'dir'), flush=True)\ntime.sleep(120)\n")


@pytest.mark.parametrize("kind", ("file", "dir"))
def test_a_second_run_writing_the_same_output_is_refused_while_the_first_runs(tmp_path, kind):
    """Two runs on one output would interleave their rows: the second is refused until the first
    ends, however it ends (the lock is the kernel's); one process may create its output twice."""
    import subprocess

    path = str(tmp_path / ("out.jsonl" if kind == "file" else "out"))
    root = Path(__file__).resolve().parents[1]
    first = subprocess.Popen([sys.executable, "-c", HOLDER, path, kind], cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "None"
        assert "another run is writing there now" in create_output("--output", path, is_dir=kind == "dir")
        if kind == "file":  # the first run replaces its file (a rewrite, a backup moved aside): still held
            Path(path + ".new").write_text("")
            os.replace(path + ".new", path)
            assert "another run is writing there now" in create_output("--output", path)
    finally:
        first.kill()
        first.wait()
    assert create_output("--output", path, is_dir=kind == "dir") is None
    assert create_output("--output", path, is_dir=kind == "dir") is None


def test_a_training_stage_holds_its_output_dir(tmp_path):
    import subprocess

    run = str(tmp_path / "run")
    root = Path(__file__).resolve().parents[1]
    first = subprocess.Popen([sys.executable, "-c", HOLDER, run, "dir"], cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "None"
        with pytest.raises(ConfigError, match="another run is writing there now"):
            start_run(TrainConfig, ["--config", "none", "--output_dir", run], None, "train.py")
    finally:
        first.kill()
        first.wait()


def test_two_spellings_of_one_model_folder_are_the_same_setting_on_resume(tmp_path, monkeypatch):
    from drkernel.config import changed_settings
    (tmp_path / "tiny").mkdir()
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig(model=str(tmp_path / "tiny") + "/")
    assert changed_settings({"model": "tiny"}, cfg) == []
    assert [c.key for c in changed_settings({"model": "other"}, cfg)] == ["model"]
    assert [c.key for c in changed_settings({"model": "hub/model"}, cfg)] == ["model"]
