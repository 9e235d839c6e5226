"""What every training stage shares: the Accelerator, metrics logging, checkpoints.

RL (`drkernel.trainer`) and SFT (`drkernel.sft`) both run under one `accelerate.Accelerator`
and leave the same things behind in `output_dir`:

    metrics.jsonl                 one JSON object per optimiser step (rank 0 writes it)
    logs/                         the Accelerate trackers' files (TensorBoard by default)
    checkpoint-<step>/            accelerator.save_state (model, optimizer, scheduler, RNG of every
                                  rank) + trainer_state.json (step, data position, ...)
                                  + model/ (save_pretrained: full weights or the LoRA adapter,
                                  and the tokenizer), so `--model <dir>/checkpoint-N/model`
                                  starts the next stage from it
    final/                        the last model, same layout as checkpoint-N/model

Resuming (`--resume_from auto|<checkpoint dir>`) restores all of it; the caller then skips
the data it already consumed, using the position stored in trainer_state.json.

A checkpoint records the settings it was made with (`SETTINGS_KEY` in its trainer_state.json);
`start_run` refuses to resume it under other settings, except those in the config class's
`RESUME_SAFE` (along its MRO), which only warn.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Sequence, TypeVar

from drkernel.config import (BELOW_1, COUNT, NON_NEGATIVE, POSITIVE, ConfigError, Limit, ModelSelection,
                             changed_settings, load_config, shown_path)
from drkernel.jsonl import json_safe

T = TypeVar("T")
TRAINER_STATE = "trainer_state.json"
SETTINGS_KEY = "config"  # where a checkpoint's trainer_state.json records the run's settings
_CKPT = re.compile(r"^checkpoint-(\d+)$")


@dataclasses.dataclass
class RunConfig(ModelSelection):
    """Fields both stages take (RL's TrainConfig and SFTConfig extend this)."""

    LIMITS = {
        "max_steps": COUNT, "learning_rate": NON_NEGATIVE, "weight_decay": NON_NEGATIVE, "adam_beta1": BELOW_1,
        "adam_beta2": BELOW_1, "warmup_steps": NON_NEGATIVE, "max_grad_norm": Limit(0, why="0 = no clipping"),
        "gradient_accumulation_steps": COUNT, "gradient_checkpointing_every": COUNT,
        "lora_r": Limit(0, why="0 = no LoRA"), "lora_alpha": POSITIVE, "lora_dropout": BELOW_1,
        "seed": NON_NEGATIVE, "save_steps": Limit(0, why="0 = only at the end"),
        "save_total_limit": Limit(0, why="0 = keep all"),
    }
    # may change when a run is resumed: where and how often it writes, how long it runs, and how the
    # same update is computed
    RESUME_SAFE = ("output_dir", "resume_from", "max_steps", "save_steps", "save_total_limit", "log_with",
                   "project_name", "gradient_checkpointing", "gradient_checkpointing_every", "torch_compile")

    output_dir: str = "runs/drkernel"
    max_steps: int = 2
    learning_rate: float = 1e-6
    weight_decay: float = 0.01  # KernelGYM's actor and SFT optimizers (verl actor.yaml, sft_trainer.yaml)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    warmup_steps: int = 0
    lr_scheduler: str = "constant_with_warmup"  # any transformers.get_scheduler name
    max_grad_norm: float = 1.0
    gradient_accumulation_steps: int = 1
    mixed_precision: str = "no"  # "no" | "bf16" | "fp16" (Accelerate)
    gradient_checkpointing: bool = False
    gradient_checkpointing_every: int = dataclasses.field(default=1, metadata={
        "help": "with gradient_checkpointing: checkpoint only every n-th decoder layer (1 = all, least "
                "memory); n > 1 keeps the other layers' activations: less recompute, memory in between"})
    torch_compile: bool = dataclasses.field(default=False, metadata={
        "help": "torch.compile each decoder layer (and RL's log-prob head): fused norms, rotary and MLP "
                "pointwise ops give a faster update and less activation memory; costs a one-off compile "
                "(~1 min on a GPU) and a second one when sequence lengths first change"})
    lora_r: int = 0  # > 0 trains a LoRA adapter through peft
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: str = "all-linear"
    seed: int = 0
    save_steps: int = 1  # checkpoint every N steps (0: only at the end)
    save_total_limit: int = 0  # keep the newest N checkpoints (0: keep all)
    resume_from: str | None = None  # "auto" (newest in output_dir) or a checkpoint dir
    log_with: str = "tensorboard"  # Accelerate tracker name(s), comma-separated; "none" for none
    project_name: str = "drkernel"


def make_accelerator(cfg: RunConfig, config_dict: dict[str, Any] | None = None):
    """An Accelerator writing its trackers under `<output_dir>/logs`; trackers degrade to none
    with a warning when their package is missing (a tracker should never stop a run)."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed

    out = Path(cfg.output_dir)
    trackers = [t.strip() for t in (cfg.log_with or "").split(",") if t.strip() and t.strip() != "none"]
    usable = []
    for t in trackers:
        if t == "tensorboard":
            try:
                import torch.utils.tensorboard  # noqa: F401
            except Exception as exc:  # pragma: no cover - depends on the install
                print(f"[drkernel] tensorboard unavailable ({exc}); logging to metrics.jsonl only")
                continue
        usable.append(t)
    acc = Accelerator(
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        mixed_precision=cfg.mixed_precision,
        log_with=usable or None,
        project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "logs")),
    )
    set_seed(cfg.seed, device_specific=True)
    if usable:
        acc.init_trackers(cfg.project_name, config=_flat_scalars(config_dict or dataclasses.asdict(cfg)))
    return acc


def make_optimizer(model, cfg: RunConfig, device, fused: bool = True):
    """AdamW over the trainable parameters; torch's fused kernel on a GPU (one launch per step)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no trainable parameters")
    fused = fused and torch.device(device).type == "cuda"
    return torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             weight_decay=cfg.weight_decay, **({"fused": True} if fused else {}))


def _flat_scalars(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Trackers (TensorBoard hparams) accept only scalars and strings."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat_scalars(v, key + "."))
        elif isinstance(v, (int, float, str, bool)):
            out[key] = v
        elif v is not None:
            out[key] = str(v)
    return out


class MetricsLogger:
    """`log(metrics, step)`: to the trackers and as one line of `<output_dir>/metrics.jsonl`.

    Non-finite floats become null in the JSONL (strict JSON), and only numbers go to trackers.
    """

    def __init__(self, accelerator, output_dir: str | os.PathLike):
        self.acc = accelerator
        self.path = Path(output_dir) / "metrics.jsonl"
        if self.acc.is_main_process:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = {"step": int(step)}
        row.update({k: v.item() if hasattr(v, "item") else v for k, v in metrics.items() if k != "step"})
        row = json_safe(row)
        numeric = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.acc.trackers:
            self.acc.log(numeric, step=int(step))
        if self.acc.is_main_process:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self.acc.trackers:
            self.acc.end_training()


def checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first (a checkpoint without its
    trainer_state.json was interrupted while saving and is ignored)."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir()
             if (m := _CKPT.match(p.name)) and (p / TRAINER_STATE).is_file()]
    return [p for _, p in sorted(found)]


def resolve_resume(resume_from: str | None, output_dir: str | os.PathLike) -> Path | None:
    """`None` → fresh run; "auto"/"latest" → newest checkpoint in output_dir (or fresh);
    a path → that checkpoint, which must exist."""
    if not resume_from:
        return None
    if resume_from in ("auto", "latest"):
        found = checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume_from)
    if not (path / TRAINER_STATE).is_file():
        raise FileNotFoundError(f"--resume_from {resume_from}: not a checkpoint (no {TRAINER_STATE})")
    return path


def save_model(accelerator, model, tokenizer, directory: str | os.PathLike) -> None:
    """Full weights, or only the adapter for a peft model, plus the tokenizer: what
    `drkernel.modeling.load_model(directory)` loads for the next stage or for generate.py."""
    accelerator.wait_for_everyone()
    state = accelerator.get_state_dict(model)  # gathers FSDP shards on every rank
    if accelerator.is_main_process:
        m = accelerator.unwrap_model(model)
        Path(directory).mkdir(parents=True, exist_ok=True)
        m.save_pretrained(directory, state_dict=state, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
    accelerator.wait_for_everyone()


def save_checkpoint(accelerator, model, tokenizer, cfg: RunConfig, step: int,
                    state: dict[str, Any]) -> Path:
    """Everything needed to continue exactly: Accelerate state (+ RNG) and our trainer state."""
    path = Path(cfg.output_dir) / f"checkpoint-{step}"
    accelerator.save_state(str(path))
    save_model(accelerator, model, tokenizer, path / "model")
    if accelerator.is_main_process:
        with open(path / TRAINER_STATE, "w") as fh:  # written last: marks the checkpoint complete
            json.dump({"step": int(step), **state}, fh, indent=1)
        if cfg.save_total_limit > 0:
            import shutil

            for old in checkpoints(cfg.output_dir)[:-cfg.save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return path


def load_checkpoint(accelerator, path: str | os.PathLike) -> dict[str, Any]:
    """Restore model/optimizer/scheduler/RNG in place; return trainer_state.json."""
    accelerator.load_state(str(path))
    with open(Path(path) / TRAINER_STATE) as fh:
        return json.load(fh)


# --------------------------------------------------------------------------------------
# starting a run: the start line and the resume check
# --------------------------------------------------------------------------------------

def record_settings(cfg: Any) -> dict[str, Any]:
    """What a checkpoint's trainer_state.json holds about the settings it was made with."""
    return {SETTINGS_KEY: dataclasses.asdict(cfg)}


def resume_safe(cls: type) -> set[str]:
    """The settings of `cls` that may change on resume (`RESUME_SAFE` along the MRO)."""
    return {k for klass in cls.__mro__ for k in vars(klass).get("RESUME_SAFE", ())}


def _recorded_settings(state_file: Path) -> dict[str, Any] | None:
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{state_file}: cannot read it ({exc})") from None
    saved = state.get(SETTINGS_KEY) if isinstance(state, dict) else None
    return saved if isinstance(saved, dict) else None


def check_resume(cfg: Any) -> list[str]:
    """Before resuming `cfg.resume_from`: a ConfigError naming every setting that differs from the
    checkpoint's, except those in `RESUME_SAFE`; for those, the warnings to print."""
    path = resolve_resume(cfg.resume_from, cfg.output_dir)
    if path is None:
        return []
    saved = _recorded_settings(path / TRAINER_STATE)
    if saved is None:
        return [f"{shown_path(path)} does not record the settings it was made with; they are not checked"]
    changes = changed_settings(saved, cfg)
    safe = resume_safe(type(cfg))
    refused = [c for c in changes if c.key not in safe]
    if refused:
        raise ConfigError(
            f"--resume_from {cfg.resume_from}: {shown_path(path)} was made with other settings "
            f"({'; '.join(map(str, refused))}: the checkpoint's value, then this run's). Resuming would "
            f"continue that run under settings it was not trained with: give the settings it was made with "
            f"(the same --config and options) or start a new run in another --output_dir. "
            f"Only {', '.join(sorted(safe))} may change on resume.")
    return [f"resuming {shown_path(path)} with {c} (a setting that may change on resume)" for c in changes]


def _say(line: str) -> None:
    """A line on stderr, once per launch (from the first process of `accelerate launch`)."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)


def start_run(cls: type[T], argv: Sequence[str] | None, preset: str | os.PathLike | None, prog: str) -> T:
    """A training stage's settings (`load_config`), announced in one line on stderr, with the
    resume check done (ConfigError when it refuses)."""
    run = load_config(cls, argv, preset)
    _say(run.start_line(prog))
    for warning in check_resume(run.cfg):
        _say(f"{prog}: warning: {warning}")
    return run.cfg
