"""Training entry point: `accelerate launch train.py [--stage rl|sft] [--config cfg.yaml] [--key value ...]`.

    accelerate launch train.py                       # no options: configs/cpu_quick.yaml, a short real CPU run
    python train.py --model Qwen/Qwen2.5-1.5B-Instruct --tasks ../shared/kernelbench --levels 1 \\
        --max_steps 100 --output_dir runs/rl_qwen
    python train.py --stage sft ...                  # supervised warm-up (drkernel.sft)
    python train.py --help                           # every RL option with its default

Stage "rl" (the default) is `drkernel.trainer.main`; stage "sft" is `drkernel.sft.main`.
"""

from __future__ import annotations

import sys
from pathlib import Path

STAGES = ("rl", "sft")


def split_stage(argv: list[str]) -> tuple[str, list[str]]:
    """Take `--stage X` / `--stage=X` out of argv; the rest goes to the stage's own parser."""
    stage, rest, i = "rl", [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--stage":
            if i + 1 >= len(argv):
                raise SystemExit("train.py: error: --stage needs a value (rl or sft)")
            stage, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--stage="):
            stage = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return stage, rest


# With no arguments at all, the RL stage runs this preset: the library defaults are the paper's
# settings (3 turns, 1024 new tokens, 5 trials), far too long for the offline default on a CPU.
QUICK = Path(__file__).resolve().parent / "configs" / "cpu_quick.yaml"


def main(argv: list[str] | None = None) -> int:
    stage, rest = split_stage(list(sys.argv[1:] if argv is None else argv))
    if stage == "rl" and not rest:
        print(f"train.py: no options given: the offline quick run, --config {QUICK}", file=sys.stderr)
        rest = ["--config", str(QUICK)]
    if stage == "rl":
        from drkernel import trainer

        return trainer.main(rest)
    if stage == "sft":
        from drkernel import sft  # imported only for this stage

        return sft.main(rest)
    print(f"train.py: error: --stage must be one of {', '.join(STAGES)}, not {stage!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
