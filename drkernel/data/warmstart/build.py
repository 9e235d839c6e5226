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

# The exact SFT run; `--output_dir` is appended by `main`. A build cut short continues from its
# newest checkpoint when run again (exact resume).
SFT_ARGS = ["--model", "smollm2", "--dataset", "bundled", "--lora_r", "8", "--lora_alpha", "16",
            "--learning_rate", "2e-3", "--lr_scheduler", "cosine", "--warmup_steps", "4",
            "--num_epochs", "15", "--per_device_train_batch_size", "1", "--save_steps", "20",
            "--save_total_limit", "0", "--seed", "0", "--resume_from", "auto"]


def export_adapter(source: Path, target: Path) -> dict:
    """Copy the adapter from an SFT output (`final/`) into `target`, weights cast to fp16
    (peft casts them back to the model's dtype when it loads them)."""
    from safetensors.torch import load_file, save_file

    config = json.loads((source / "adapter_config.json").read_text())
    if config["base_model_name_or_path"] != "smollm2":
        raise SystemExit(f"{source}: the adapter's base is {config['base_model_name_or_path']!r}, not smollm2")
    weights = {k: v.half() if v.is_floating_point() else v
               for k, v in load_file(source / "adapter_model.safetensors").items()}
    target.mkdir(parents=True, exist_ok=True)
    (target / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(weights, target / "adapter_model.safetensors", metadata={"format": "pt"})
    return {"tensors": len(weights), "parameters": sum(v.numel() for v in weights.values())}


def main(argv: list[str] | None = None) -> int:
    import argparse

    from drkernel import sft

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work_dir", default="runs/warmstart_sft", help="the SFT run's output directory")
    parser.add_argument("--out", default=str(HERE), help="where the adapter goes")
    args = parser.parse_args(argv)
    if sft.main(SFT_ARGS + ["--output_dir", args.work_dir]) != 0:
        return 1
    info = export_adapter(Path(args.work_dir) / "final", Path(args.out))
    steps = [json.loads(line) for line in (Path(args.work_dir) / "metrics.jsonl").read_text().splitlines()]
    provenance = {"command": "python drkernel/data/warmstart/build.py", "sft_args": SFT_ARGS,
                  "steps": steps[-1]["step"], "final_loss": steps[-1]["loss"],
                  "sft_step_seconds": round(sum(r["step_time_s"] for r in steps)), **info}
    (Path(args.out) / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(f"[warmstart] adapter written to {args.out}: {provenance}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
