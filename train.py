"""Training entry point: `accelerate launch train.py [--stage rl|sft] [--config FILE|none] [--key value ...]`.

    accelerate launch train.py                       # the RL stage's bare run: its preset, configs/cpu_quick.yaml
    accelerate launch train.py --max_steps 1         # the same run with one step
    accelerate launch train.py --config configs/rl_example.yaml       # that file instead of the preset
    accelerate launch train.py --config none --model Qwen/Qwen2.5-1.5B-Instruct \\
        --tasks ../shared/kernelbench --levels 1 --output_dir runs/rl_qwen   # the library defaults alone
    accelerate launch train.py --stage sft           # supervised warm-up, its preset configs/sft_quick.yaml
    python train.py --help                           # the rule below and every option

Settings, in order: the library defaults (the stage's config dataclass), a base file, then each
--key value. A bare run's base is the stage's preset, so each option adjusts that run; `--config
FILE` replaces the preset and `--config none` drops it. Stage "rl" (the default) is
`drkernel.trainer.main`; stage "sft" is `drkernel.sft.main`.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import NamedTuple

from drkernel.config import HELP_FLAGS, NO_CONFIG, ConfigError, describe, interruptible, load_yaml, shown_path

PROG = "train.py"
CONFIGS = Path(__file__).resolve().parent / "configs"


class Stage(NamedTuple):
    """One training stage: where it runs and the preset a bare run of it starts from."""

    module: str  # runs it: `module.main(argv, preset=, prog=)`
    config: str  # its config class in `module` (for --help)
    preset: Path
    what: str
    preset_what: str


STAGES = {
    "rl": Stage("drkernel.trainer", "TrainConfig", CONFIGS / "cpu_quick.yaml", "the RL loop (drkernel/trainer.py)",
                "a short real run on a CPU"),
    "sft": Stage("drkernel.sft", "SFTConfig", CONFIGS / "sft_quick.yaml", "supervised warm-up (drkernel/sft.py)",
                 "a short LoRA run on the bundled conversations"),
}

# the line Ctrl-C leaves (`interruptible`): where the finished work is and how to go on
RESUME_HINT = "the checkpoints saved so far are in its output_dir; the same command plus --resume_from auto continues"
USAGE = f"usage: accelerate launch {PROG} [--stage rl|sft] [--config FILE|{NO_CONFIG}] [--key value ...]"


def split_stage(argv: list[str]) -> tuple[str, list[str]]:
    """Take `--stage X` / `--stage=X` out of argv; the rest goes to the stage's own parser."""
    stage, rest, i = "rl", [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--stage":
            if i + 1 >= len(argv):
                raise ConfigError("--stage needs a value (rl or sft)")
            stage, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--stage="):
            stage = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    if stage not in STAGES:
        raise ConfigError(f"--stage must be one of {', '.join(STAGES)}, not {stage!r}")
    return stage, rest


def help_text(name: str) -> str:
    """--help: the usage, the stages, how settings are chosen, this stage's preset and its options."""
    stage = STAGES[name]
    config_class = getattr(importlib.import_module(stage.module), stage.config)
    preset = ", ".join(f"{k}={v}" for k, v in load_yaml(str(stage.preset)).items())
    stages = [f"  --stage {k:<4} {s.what}\n               preset: {shown_path(s.preset)} ({s.preset_what})"
              for k, s in STAGES.items()]
    return "\n".join([
        USAGE, "",
        "Stages (default rl), each with the preset a bare run uses:", *stages, "",
        "Settings, in order: the library defaults, then a base file, then each --key value.",
        "Without --config the base is the stage's preset, so an option adjusts the bare run",
        "(--max_steps 1: the preset with one step). --config FILE replaces the preset (FILE over the",
        f"library defaults); --config {NO_CONFIG} drops it: the library defaults alone (for rl, the",
        "released recipe's algorithm and reward at a small scale; configs/drkernel_recipe.yaml is the",
        "full recipe).",
        "--resume_from auto|DIR continues a checkpoint and refuses settings that differ from the ones",
        "it was made with (max_steps, checkpoint and logging intervals and the like may change).",
        "Without it, a run refuses an output_dir that holds a previous run (checkpoints, metrics.jsonl) or",
        "anything else but hidden files.",
        "The first line on stderr says which base a run uses.", "",
        f"This stage ({name}) without --config: {shown_path(stage.preset)} sets {preset}.", "",
        describe(config_class),
    ])


def main(argv: list[str] | None = None) -> int:
    try:
        name, rest = split_stage(list(sys.argv[1:] if argv is None else argv))
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if any(a in HELP_FLAGS for a in rest):
        print(help_text(name))
        return 0
    stage = STAGES[name]
    return importlib.import_module(stage.module).main(rest, preset=stage.preset, prog=PROG)


if __name__ == "__main__":
    raise SystemExit(interruptible(main, PROG, RESUME_HINT))
