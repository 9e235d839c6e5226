"""What every training stage shares: the Accelerator, metrics logging, checkpoints.

RL (`drkernel.trainer`) and SFT (`drkernel.sft`) both run under one `accelerate.Accelerator`
and leave the same things behind in `output_dir`:

    metrics.jsonl                 one JSON object per optimiser step (rank 0 writes it; a resumed
                                  run first drops the lines a kill left unreadable, e.g. a cut last
                                  line, and the rows of steps after its checkpoint, keeping the old
                                  file as metrics.<time>.jsonl.bak)
    logs/                         the Accelerate trackers' files (TensorBoard by default)
    checkpoint-<step>/            accelerator.save_state (model, optimizer, scheduler, RNG of every
                                  rank) + trainer_state.json (step, data position, the state
                                  files with their sizes, ...)
                                  + model/ (save_pretrained: full weights or the LoRA adapter,
                                  and the tokenizer), so `--model <dir>/checkpoint-N/model`
                                  starts the next stage from it
    final/                        the last model, same layout as checkpoint-N/model

Resuming (`--resume_from auto|<checkpoint dir>`) restores all of it; the caller then skips
the data it already consumed, using the position stored in trainer_state.json.

A checkpoint records the settings it was made with (`SETTINGS_KEY` in its trainer_state.json);
`start_run` refuses to resume it under other settings, except those in the config class's
`RESUME_SAFE` (along its MRO), which only warn. It refuses as well, before any model loads, a
checkpoint whose state files are missing, cut or not what their names say (`checkpoint_problem`):
a damaged checkpoint is never silently replaced by a fresh start. A run without `--resume_from`
refuses an `output_dir` that holds a previous run (`previous_run`): its metrics.jsonl would gain
the new rows and its checkpoints would sit beside (and, for `auto`, win over) the new ones.
`--resume_from auto` with no complete checkpoint starts from step 0, and says so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import zipfile
from pathlib import Path
from typing import Any, Sequence, TypeVar

from drkernel.config import (BELOW_1, COUNT, NON_NEGATIVE, POSITIVE, SEED, ConfigError, Limit, ModelSelection, Names,
                             changed_settings, comma_items, create_output, error_line, limit_problems,
                             load_config, output_problem, shown_path)
from drkernel.jsonl import first_reasons, iter_jsonl, json_safe, rewrite_keeping_backup

T = TypeVar("T")
TRAINER_STATE = "trainer_state.json"
SETTINGS_KEY = "config"  # where a checkpoint's trainer_state.json records the run's settings
STATE_FILES = "files"  # where trainer_state.json lists the checkpoint's state files: {name: bytes}
_CKPT = re.compile(r"^checkpoint-(\d+)$")
AUTO = ("auto", "latest")  # --resume_from values that mean the newest complete checkpoint of output_dir
RUN_FILES = ("final", "metrics.jsonl", "logs", "sft_config.json")  # beside checkpoint-N: what a run leaves
_TORCH_SAVED = (".bin", ".pkl", ".pt")  # Accelerate's torch.save files: zip archives
# transformers schedulers that `get_scheduler(name, optimizer, num_warmup_steps, num_training_steps)`
# cannot build without further arguments, or that step() only with a metric: the stages give neither
_UNUSABLE_SCHEDULERS = ("reduce_lr_on_plateau", "greedy", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
                        "warmup_stable_decay")


def lr_schedulers() -> tuple[str, ...]:
    """The `--lr_scheduler` names: transformers' `SchedulerType`s the stages can build and step."""
    from transformers import SchedulerType

    return tuple(s.value for s in SchedulerType if s.value not in _UNUSABLE_SCHEDULERS)


def precisions() -> tuple[str, ...]:
    """The `--mixed_precision` names: Accelerate's `PrecisionType`s."""
    from accelerate.utils import PrecisionType

    return tuple(PrecisionType.list())


def trackers() -> tuple[str, ...]:
    """The `--log_with` names: Accelerate's `LoggerType`s (`all` included) and `none`."""
    from accelerate.utils import LoggerType

    return ("none", *LoggerType.list())


@dataclasses.dataclass
class RunConfig(ModelSelection):
    """Fields both stages take (RL's TrainConfig and SFTConfig extend this)."""

    LIMITS = {
        "max_steps": COUNT, "learning_rate": NON_NEGATIVE, "weight_decay": NON_NEGATIVE, "adam_beta1": BELOW_1,
        "adam_beta2": BELOW_1, "warmup_steps": NON_NEGATIVE, "max_grad_norm": Limit(0, why="0 = no clipping"),
        "gradient_accumulation_steps": COUNT, "gradient_checkpointing_every": COUNT,
        "lora_r": Limit(0, why="0 = no LoRA"), "lora_alpha": POSITIVE, "lora_dropout": BELOW_1,
        "seed": SEED, "save_steps": Limit(0, why="0 = only at the end"),
        "save_total_limit": Limit(0, why="0 = keep all"),
        "lr_scheduler": Names(lr_schedulers), "mixed_precision": Names(precisions),
        "log_with": Names(trackers, comma_list=True),
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
    lr_scheduler: str = "constant_with_warmup"  # a transformers.get_scheduler name (lr_schedulers())
    max_grad_norm: float = 1.0
    gradient_accumulation_steps: int = 1
    mixed_precision: str = "no"  # "no" | "bf16" | "fp16" | "fp8" (Accelerate)
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


def option_problems(cfg: RunConfig) -> list[str]:
    """One sentence per bad setting of a stage's config: its limits and its output directory."""
    output = output_problem("--output_dir", cfg.output_dir, is_dir=True)
    return limit_problems(cfg) + ([output] if output else [])


def make_accelerator(cfg: RunConfig, config_dict: dict[str, Any] | None = None):
    """An Accelerator writing its trackers under `<output_dir>/logs`; trackers degrade to none
    with a warning when their package is missing (a tracker should never stop a run)."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed

    out = Path(cfg.output_dir)
    usable = []
    for t in [t for t in comma_items(cfg.log_with) if t != "none"]:
        if t == "tensorboard":
            try:
                import torch.utils.tensorboard  # noqa: F401
            except Exception as exc:  # pragma: no cover - depends on the install
                print(f"[drkernel] tensorboard unavailable ({exc}); logging to metrics.jsonl only")
                continue
        usable.append(t)
    try:
        acc = Accelerator(
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            mixed_precision=cfg.mixed_precision,
            log_with=usable or None,
            project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "logs")),
        )
    except ValueError as exc:  # a known setting this machine cannot honour, e.g. fp8 without its package
        raise ConfigError(f"mixed_precision={cfg.mixed_precision!r}, log_with={cfg.log_with!r}: {exc}") from None
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

    def __init__(self, accelerator, output_dir: str | os.PathLike, resumed_step: int):
        self.acc = accelerator
        self.path = Path(output_dir) / "metrics.jsonl"
        if self.acc.is_main_process:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            keep_rows_up_to(self.path, resumed_step)

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
        # also destroys the process group: a rank exiting with gloo/NCCL threads alive can abort
        self.acc.end_training()


def keep_rows_up_to(path: Path, step: int) -> None:
    """Rewrite the JSONL file `path` keeping the rows of steps up to `step`, the one a run resumes
    from (0: it starts anew, as `--resume_from auto` does with no complete checkpoint). Dropped:
    lines that hold no JSON object (a run killed mid-write leaves its last line cut, and the next
    row would be glued to it) and rows of steps after `step` (the killed run logged them; this run
    logs them again). Said in one line on stderr; the old file is copied aside first, as
    `<stem>.<time>.jsonl.bak`, and the new one replaces it atomically."""
    kept, dropped = [], []
    for line in iter_jsonl(path):
        logged = line.row.get("step") if line.row is not None else None
        if line.row is None:
            dropped.append(f"line {line.lineno}: {line.error}")
        elif isinstance(logged, int) and not isinstance(logged, bool) and logged > step:
            dropped.append(f"line {line.lineno}: step {logged}, after step {step} this run starts from")
        else:
            kept.append(line.row)
    if not dropped:
        return
    backup = rewrite_keeping_backup(path, kept)
    say(f"[drkernel] {shown_path(path)}: dropped {len(dropped)} line(s) (the old file is kept as "
        f"{backup.name}): {first_reasons(dropped)}")


def _numbered(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(N, path) of every checkpoint-N directory in `output_dir`, complete or not, oldest first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in out.iterdir() if (m := _CKPT.match(p.name)) and p.is_dir())


def previous_run(output_dir: str | os.PathLike) -> list[str]:
    """The names in `output_dir` that an earlier run left there: its checkpoint-N (complete or not,
    newest first) and `RUN_FILES`; empty when it holds none."""
    out = Path(output_dir)
    return [p.name for _, p in reversed(_numbered(out))] + [name for name in RUN_FILES if (out / name).exists()]


def checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first (a checkpoint without its
    trainer_state.json was interrupted while saving and is ignored)."""
    return [p for _, p in _numbered(output_dir) if (p / TRAINER_STATE).is_file()]


def resolve_resume(resume_from: str | None, output_dir: str | os.PathLike) -> Path | None:
    """`None` → fresh run; "auto"/"latest" → newest checkpoint in output_dir (or fresh);
    a path → that checkpoint, which must exist."""
    if not resume_from:
        return None
    if resume_from in AUTO:
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
    if accelerator.is_main_process and path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)  # an earlier, cut-off save of this step: none of it may mix in
    elif accelerator.is_main_process and os.path.lexists(path):
        path.unlink()
    accelerator.wait_for_everyone()
    accelerator.save_state(str(path))
    save_model(accelerator, model, tokenizer, path / "model")
    if accelerator.is_main_process:
        with open(path / TRAINER_STATE, "w") as fh:  # written last: marks the checkpoint complete
            json.dump({"step": int(step), **state, STATE_FILES: _state_files(path)}, fh, indent=1)
        if cfg.save_total_limit > 0:
            for old in checkpoints(cfg.output_dir)[:-cfg.save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return path


def load_checkpoint(accelerator, path: str | os.PathLike) -> dict[str, Any]:
    """Restore model/optimizer/scheduler/RNG in place; return trainer_state.json. A checkpoint that
    cannot be restored is a ConfigError naming it."""
    state = read_state(Path(path))
    try:
        accelerator.load_state(str(path))
    except Exception as exc:  # whatever the library raises, the run cannot continue from it (nor start afresh)
        raise ConfigError(f"cannot restore {shown_path(path)}: {error_line(exc)}") from None
    return state


def _state_files(path: Path) -> dict[str, int]:
    """{name: bytes} of a checkpoint's state files (what `load_state` reads), for `checkpoint_problem`."""
    return {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file() and p.name != TRAINER_STATE}


def read_state(path: Path) -> dict[str, Any]:
    """A checkpoint's trainer_state.json; a ConfigError naming it when it is unreadable or has no step."""
    file = path / TRAINER_STATE
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{shown_path(file)}: cannot read it ({exc})") from None
    step = state.get("step") if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        raise ConfigError(f"{shown_path(file)}: not a trainer state (no integer step)")
    return state


def _file_problem(file: Path, size: Any) -> str | None:
    """Why a checkpoint's state file cannot be restored (missing, of another size than saved, or not
    the format its name says; `size` None: not recorded), or None. Cheap: no tensor is read."""
    if not file.is_file():
        return "missing"
    if size is not None and file.stat().st_size != size:
        return f"{file.stat().st_size} bytes, saved with {size} (cut or overwritten)"
    if file.suffix in _TORCH_SAVED and not zipfile.is_zipfile(file):
        return "not a torch.save archive (cut or overwritten)"
    if file.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open
        try:
            with safe_open(str(file), framework="pt"):  # reads the header and checks it covers the file
                pass
        except (SafetensorError, OSError) as exc:
            return f"not a readable safetensors file ({exc})"
    return None


def checkpoint_problem(path: Path, state: dict[str, Any]) -> str | None:
    """The first state file of checkpoint `path` that cannot be restored, and why; None when all can.
    The files are those its trainer_state.json lists (older checkpoints list none: those present)."""
    listed = state.get(STATE_FILES)
    if not isinstance(listed, dict):
        listed = dict.fromkeys(_state_files(path))
    for name, size in sorted(listed.items()):
        if (why := _file_problem(path / name, size)) is not None:
            return f"{shown_path(path / name)}: {why}"
    return None


# --------------------------------------------------------------------------------------
# starting a run: the start line and the resume check
# --------------------------------------------------------------------------------------

def record_settings(cfg: Any) -> dict[str, Any]:
    """What a checkpoint's trainer_state.json holds about the settings it was made with."""
    return {SETTINGS_KEY: dataclasses.asdict(cfg)}


def resume_safe(cls: type) -> set[str]:
    """The settings of `cls` that may change on resume (`RESUME_SAFE` along the MRO)."""
    return {k for klass in cls.__mro__ for k in vars(klass).get("RESUME_SAFE", ())}


def check_resume(cfg: Any) -> list[str]:
    """Before resuming `cfg.resume_from` (before any model loads): a ConfigError naming a state file
    that cannot be restored, or every setting that differs from the checkpoint's, except those in
    `RESUME_SAFE`; for those, the warnings to print."""
    if not cfg.resume_from:
        _check_fresh(cfg.output_dir)
    path = resolve_resume(cfg.resume_from, cfg.output_dir)
    passed = _passed_over(cfg, path)
    if path is None:
        return passed
    state = read_state(path)
    if (problem := checkpoint_problem(path, state)) is not None:
        raise ConfigError(f"--resume_from {cfg.resume_from}: {problem}; resume from an earlier checkpoint "
                          f"(--resume_from DIR) or start a new run in another --output_dir")
    saved = state.get(SETTINGS_KEY)
    if not isinstance(saved, dict):
        return passed + [f"{shown_path(path)} does not record the settings it was made with; they are not checked"]
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
    return passed + [f"resuming {shown_path(path)} with {c} (a setting that may change on resume)" for c in changes]


def _check_fresh(output_dir: str) -> None:
    """A ConfigError when a new run's `output_dir` holds a previous run (`previous_run`): the two would
    share one metrics.jsonl, and a later `--resume_from auto` could pick the old run's newest checkpoint;
    or anything else (another script's results and report, which this run's report would replace)."""
    found = previous_run(output_dir)
    if found:
        raise ConfigError(f"{shown_path(output_dir)} holds a previous run ({first_reasons(found, sep=', ')}); pass "
                          f"--resume_from auto to continue it, or another --output_dir")
    out = Path(output_dir)
    others = sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) if out.is_dir() else []
    if others:
        raise ConfigError(f"{shown_path(output_dir)} holds files of something else ({first_reasons(others, sep=', ')}); "
                          f"a run writes its checkpoints, metrics and report there: give it a new or empty --output_dir")


def _passed_over(cfg: Any, path: Path | None) -> list[str]:
    """What `--resume_from auto` passes over, so that no fresh start is silent: with no complete
    checkpoint (`path` None), one line saying that a new run starts; else a line for each newer
    checkpoint cut off before its trainer_state.json was written."""
    if cfg.resume_from not in AUTO:
        return []
    if path is None:
        cut = [p.name for _, p in _numbered(cfg.output_dir)]
        why = f" ({', '.join(cut)} {'is' if len(cut) == 1 else 'are'} incomplete)" if cut else ""
        return [f"no complete checkpoint in {shown_path(cfg.output_dir)}{why}; starting a new run"]
    newest = int(_CKPT.match(path.name).group(1))
    return [f"{shown_path(p)} has no {TRAINER_STATE} (its save was cut off): resuming {shown_path(path)}"
            for n, p in _numbered(cfg.output_dir) if n > newest]


def first_process() -> bool:
    """Whether this is the first process of `accelerate launch` (or the only one)."""
    return os.environ.get("RANK", "0") == "0"


def say(line: str) -> None:
    """A line on stderr, once per launch (from the first process)."""
    if first_process():
        print(line, file=sys.stderr, flush=True)


def start_run(cls: type[T], argv: Sequence[str] | None, preset: str | os.PathLike | None, prog: str) -> T:
    """A training stage's settings (`load_config`), announced in one line on stderr, with the
    resume check done (ConfigError when it refuses)."""
    run = load_config(cls, argv, preset)
    say(run.start_line(prog))
    # first, so that no check reads a directory another run is writing; the launch's other
    # processes share the first one's directory, and it alone holds the lock
    if first_process() and (problem := create_output("--output_dir", run.cfg.output_dir, is_dir=True)):
        raise ConfigError(problem)
    for warning in check_resume(run.cfg):
        say(f"{prog}: warning: {warning}")
    return run.cfg
