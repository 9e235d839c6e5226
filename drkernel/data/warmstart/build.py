"""Build the warm-start LoRA adapter that the default RL run starts from.

The offline default model (SmolLM2-135M-Instruct) never writes a usable ```python block on
its own, so RL from it sees only format errors: every reward is 0 and nothing is learnt. This
script runs this project's own SFT stage (`drkernel.sft`) on the bundled conversations
(drkernel/data/sft/conversations.jsonl: the 8 bundled tasks, a first answer with a typical
mistake, the evaluator's feedback, the fix) and keeps the LoRA adapter, stored in fp16:

    python drkernel/data/warmstart/build.py            # CPU: about an hour on 2 cores

The adapter has *seen the bundled tasks' solutions*: on those tasks it mostly reproduces what
it memorised. That is what it is for (a policy whose turns compile and are sometimes correct, so
that the default RL run has rewards and advantages to learn from), not a kernel writer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

# after the path above: the script runs from a checkout, not an installed package
from drkernel.jsonl import write_json
from drkernel.report import METRICS, load_run_history, unread_lines

# The exact SFT run; `--output_dir` is appended by `main`. A build cut short continues from its
# newest checkpoint when run again (exact resume).
SFT_ARGS = ["--model", "smollm2", "--dataset", "bundled", "--lora_r", "8", "--lora_alpha", "16",
            "--learning_rate", "2e-3", "--lr_scheduler", "cosine", "--warmup_steps", "4",
            "--num_epochs", "15", "--per_device_train_batch_size", "1", "--save_steps", "20",
            "--save_total_limit", "0", "--seed", "0", "--resume_from", "auto"]


def read_adapter(source: Path) -> tuple[dict, dict]:
    """The adapter config and weights of an SFT output (`final/`), the weights cast to fp16 (peft casts
    them back to the model's dtype when it loads them); SystemExit when its base is not smollm2."""
    from safetensors.torch import load_file

    config = json.loads((source / "adapter_config.json").read_text())
    if config["base_model_name_or_path"] != "smollm2":
        raise SystemExit(f"{source}: the adapter's base is {config['base_model_name_or_path']!r}, not smollm2")
    weights = {k: v.half() if v.is_floating_point() else v
               for k, v in load_file(source / "adapter_model.safetensors").items()}
    return config, weights


def sft_summary(work_dir: Path) -> dict:
    """The SFT run's steps, last loss and summed step seconds, from its metrics.jsonl as the run
    report reads it (each step by its last row; unreadable lines skipped and named on stderr);
    SystemExit when it holds no step."""
    history = load_run_history(work_dir)
    if history.skipped:
        print(f"[warmstart] warning: {unread_lines(work_dir, history)}", file=sys.stderr)
    if not history.steps:
        raise SystemExit(f"[warmstart] error: {work_dir / METRICS} holds no step; the adapter is not exported")
    seconds = [s for s in history.series.get("step_time_s", []) if s is not None]
    return {"steps": history.steps[-1], "final_loss": history.series.get("loss", [None])[-1],
            "sft_step_seconds": round(sum(seconds))}


def write_adapter(config: dict, weights: dict, summary: dict, target: Path) -> dict:
    """The adapter and its provenance.json in `target`. The old provenance goes first and the new one
    comes last, so that a write cut short never leaves a provenance of another adapter."""
    from safetensors.torch import save_file

    target.mkdir(parents=True, exist_ok=True)
    (target / "provenance.json").unlink(missing_ok=True)
    (target / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(weights, target / "adapter_model.safetensors", metadata={"format": "pt"})
    provenance = {"command": "python drkernel/data/warmstart/build.py", "sft_args": SFT_ARGS, **summary,
                  "tensors": len(weights), "parameters": sum(v.numel() for v in weights.values())}
    write_json(target / "provenance.json", provenance)
    return provenance


def main(argv: list[str] | None = None) -> int:
    import argparse

    from drkernel import sft

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work_dir", default="runs/warmstart_sft", help="the SFT run's output directory")
    parser.add_argument("--out", default=str(HERE), help="where the adapter goes")
    args = parser.parse_args(argv)
    if sft.main(SFT_ARGS + ["--output_dir", args.work_dir]) != 0:
        return 1
    work = Path(args.work_dir)
    summary = sft_summary(work)  # read before --out is touched: a failure leaves the old adapter whole
    config, weights = read_adapter(work / "final")
    provenance = write_adapter(config, weights, summary, Path(args.out))
    print(f"[warmstart] adapter written to {args.out}: {provenance}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
