"""Cold-start SFT: teach the policy the multi-turn kernel-writing format before RL.

    accelerate launch train.py --stage sft [--config FILE|none] [--key value ...]
    python -c "import drkernel.sft as s; raise SystemExit(s.main(['--max_steps', '2']))"

The same machinery as RL (drkernel.runtime): one Accelerator, metrics.jsonl, checkpoint-N/
with exact resume, final/ with the model (full weights or a LoRA adapter) and tokenizer.
RL then starts from it with `--model <output_dir>/final` (or `.../checkpoint-N/model`).

One optimiser step consumes `per_device_train_batch_size * gradient_accumulation_steps`
sequences (or packed rows) per process. The loss is the mean cross-entropy over every
trained (assistant) token of the step, over all micro-batches and processes, so long and
short conversations weigh per token, not per sequence. We run the micro-batches ourselves
(rather than `accelerator.accumulate`) because that normalisation needs the step's token
count before the first backward.

The loss never materialises [batch, length, vocab] logits: the model returns its last
hidden states, we select the trained positions and apply the output layer and the
cross-entropy chunk by chunk, each chunk recomputed in backward (activation checkpointing),
so peak memory holds one [chunk, vocab] fp32 block. `loss_chunk_size=0` uses the model's
full logits instead (and is what we fall back to, with a warning, if a model's output layer
is not a plain projection of its last hidden state, e.g. logit soft-capping or scaling).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from drkernel.config import COUNT, NON_NEGATIVE, ConfigError, Limit, OneOf, error_line
from drkernel.jsonl import JsonlLine, first_reasons, iter_jsonl
from drkernel.runtime import RunConfig, option_problems, record_settings, say, start_run
from drkernel.sft_data import (IGNORE_INDEX, OVERLONG, DataStats, SFTDataError, collate, load_conversations,
                               pack_sequences, tokenize_dataset, validate_messages)


@dataclasses.dataclass
class SFTConfig(RunConfig):
    """SFT options; the shared ones (model, output_dir, LoRA, checkpoints, ...) are RunConfig's. The
    field defaults are the library defaults (`train.py --stage sft --config none`); a bare
    `train.py --stage sft` runs configs/sft_quick.yaml over them."""

    # beside RunConfig's limits
    LIMITS = {"max_steps": Limit(-1, why="-1 = num_epochs passes over the data"),
              "max_length": Limit(2), "per_device_train_batch_size": COUNT, "num_epochs": NON_NEGATIVE,
              "loss_chunk_size": Limit(0, why="0 = full logits"), "overlong": OneOf(OVERLONG)}
    # beside RunConfig's, may change when a run is resumed: how long it runs, and how the same step is computed
    RESUME_SAFE = ("num_epochs", "loss_chunk_size", "fused_adamw", "attn_implementation")

    output_dir: str = "runs/sft"
    max_steps: int = -1  # -1: num_epochs passes over the data
    learning_rate: float = 1e-5
    lr_scheduler: str = "cosine"
    save_steps: int = 50
    dataset: str | None = None  # hub id, local dir, or .jsonl/.json/.parquet file; None: bundled set
    # (a .jsonl file's unusable lines are skipped and named: read_conversations)
    dataset_split: str = "train"
    max_length: int = 4096  # tokens per sequence (and per packed row)
    overlong: str = "truncate"  # longer sequences: "truncate" or "drop"
    packing: bool = False  # pack several sequences per row (position_ids restart per sequence)
    per_device_train_batch_size: int = 2
    num_epochs: int = 3
    loss_chunk_size: int = 1024  # trained tokens per output-layer/CE chunk; 0: full logits
    fused_adamw: bool = True  # torch's fused AdamW kernel (CUDA only)
    attn_implementation: str | None = None  # e.g. "sdpa", "flash_attention_2"; None: transformers' default

    def __post_init__(self) -> None:
        _validate(self)


def _validate(cfg: SFTConfig) -> None:
    """Every value checked once, when the config is made: a ConfigError names what is wrong."""
    problems = option_problems(cfg)
    if problems:
        raise ConfigError("; ".join(problems))
    if cfg.num_epochs < 1 and cfg.max_steps <= 0:
        raise ConfigError("num_epochs must be >= 1 (or give max_steps > 0)")


# ----------------------------------------------------------------------------- the loss

def _unwrap(model):
    while hasattr(model, "module"):  # DDP and friends
        model = model.module
    return model


class SFTLoss:
    """`loss(model, batch) -> (sum of token cross-entropies, number of trained tokens)`.

    Labels follow the HF convention (same positions as input_ids, -100 = not trained);
    position t predicts token t + 1.
    """

    def __init__(self, chunk_size: int):
        self.chunk_size = int(chunk_size)
        self.verified = False

    def __call__(self, model, batch: dict):
        import torch
        import torch.nn.functional as F
        import torch.utils.checkpoint

        labels = batch["labels"][:, 1:]
        mask = labels != IGNORE_INDEX
        n = int(mask.sum())
        inputs = dict(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                      position_ids=batch.get("position_ids"), use_cache=False)
        if self.chunk_size <= 0:
            logits = model(**inputs).logits[:, :-1]
            loss = F.cross_entropy(logits[mask].float(), labels[mask], reduction="sum")
            return loss + 0.0 * logits.sum() if n == 0 else loss, n
        try:  # logits_to_keep=1: the model computes logits for the last position only
            out = model(**inputs, output_hidden_states=True, logits_to_keep=1)
        except TypeError:  # a model without that argument: its full logits are computed (and unused)
            out = model(**inputs, output_hidden_states=True)
        hidden = out.hidden_states[-1]
        head = _unwrap(model).get_output_embeddings()
        if not self.verified:
            self._verify(head, hidden, out.logits)
            if self.chunk_size <= 0:  # verification switched us to full logits
                return self(model, batch)
        if n == 0:  # keep every parameter in the graph (DDP expects gradients for all of them)
            return 0.0 * (hidden.sum() + out.logits.sum()), 0
        h = hidden[:, :-1][mask]
        y = labels[mask]
        total = hidden.new_zeros((), dtype=torch.float32)
        for s in range(0, n, self.chunk_size):
            total = total + torch.utils.checkpoint.checkpoint(
                _chunk_ce, head, h[s:s + self.chunk_size], y[s:s + self.chunk_size], use_reentrant=False)
        # the last position's logits (logits_to_keep=1) are unused: keep them in the graph at no cost
        return total + 0.0 * out.logits.sum(), n

    def _verify(self, head, hidden, logits) -> None:
        """Once: the output layer applied to the last hidden state must give the model's logits."""
        import torch

        with torch.no_grad():
            mine = head(hidden[:, -1]).float()
            ref = logits[:, -1].float()
            ok = mine.shape == ref.shape and bool(
                (mine - ref).abs().max() <= 1e-3 * (1.0 + ref.abs().max()))
        self.verified = True
        if not ok:
            print("[sft] the model's logits are not its output layer applied to its last hidden "
                  "state (soft-capping or scaling?): using full logits (loss_chunk_size=0)", file=sys.stderr)
            self.chunk_size = 0


def _chunk_ce(head, h, y):
    import torch.nn.functional as F

    return F.cross_entropy(head(h).float(), y, reduction="sum")


def sft_step(accelerator, model, optimizer, micro_batches: Sequence[dict], loss_fn: SFTLoss,
             max_grad_norm: float) -> dict:
    """One optimiser step over this process's micro-batches.

    Every backward gets `sum_ce * num_processes / trained_tokens_of_the_step`: DDP averages
    gradients over processes, so the update is exactly the gradient of the mean token loss
    over the whole step. Gradients are synchronised only on the last micro-batch.
    """
    import torch

    local = [sum(int((mb["labels"][:, 1:] != IGNORE_INDEX).sum()) for mb in micro_batches),
             sum(int(mb["num_tokens"]) for mb in micro_batches)]
    counts = accelerator.reduce(torch.tensor(local, device=accelerator.device, dtype=torch.float64), "sum")
    n_total = max(1.0, float(counts[0]))
    loss_sum = torch.zeros((), device=accelerator.device, dtype=torch.float32)
    for i, mb in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with (contextlib.nullcontext() if last else accelerator.no_sync(model)):
            with accelerator.autocast():
                s, _ = loss_fn(model, mb)
            accelerator.backward(s * (accelerator.num_processes / n_total))
        loss_sum += s.detach().float()
    grad_norm = None
    if max_grad_norm and max_grad_norm > 0:
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = accelerator.reduce(loss_sum, "sum") / n_total
    return {"loss": float(loss), "label_tokens": int(counts[0]), "tokens": int(counts[1]),
            "grad_norm": float(grad_norm) if grad_norm is not None else None}


# ----------------------------------------------------------------------------- the loop

@functools.lru_cache(maxsize=1)  # every step of an epoch reads the same order
def epoch_order(n: int, epoch: int, seed: int, length: int) -> list[int]:
    """A fixed permutation per (seed, epoch), wrapped around to `length` items so every step
    and every process gets full batches (as DistributedSampler pads)."""
    import torch

    g = torch.Generator().manual_seed(int(seed) * 100_003 + int(epoch))
    perm = torch.randperm(n, generator=g).tolist()
    return (perm * (length // n + 1))[:length]


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """Which rows each optimiser step trains: `per_step` rows over all processes, `per_rank` of them
    on each, in the order `epoch_order` gives each epoch."""

    rows: int
    per_rank: int
    per_step: int
    steps_per_epoch: int
    total: int  # optimiser steps of the run
    seed: int

    @classmethod
    def make(cls, cfg: SFTConfig, rows: int, processes: int) -> "RowPlan":
        per_rank = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
        per_step = per_rank * processes
        steps_per_epoch = math.ceil(rows / per_step)
        total = cfg.max_steps if cfg.max_steps > 0 else steps_per_epoch * cfg.num_epochs
        return cls(rows, per_rank, per_step, steps_per_epoch, total, cfg.seed)

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, step within it, 0-based) of optimiser step `step` (1-based)."""
        return divmod(step - 1, self.steps_per_epoch)

    def rows_of(self, step: int, rank: int) -> list[int]:
        """The row indices process `rank` trains at optimiser step `step`."""
        epoch, k = self.position(step)
        order = epoch_order(self.rows, epoch, self.seed, self.steps_per_epoch * self.per_step)
        return order[k * self.per_step:(k + 1) * self.per_step][rank * self.per_rank:(rank + 1) * self.per_rank]


def _line_problem(line: JsonlLine) -> str | None:
    """Why a line of a JSONL dataset holds no conversation (cut by a killed writer, not a JSON
    object, or without valid `messages`), or None when it holds one."""
    if line.row is None:
        return f"line {line.lineno}: {line.error}"
    try:
        validate_messages(line.row.get("messages"), f"line {line.lineno}")
    except SFTDataError as exc:
        return str(exc)
    return None


def _usable_lines(path: Path) -> tuple[list[dict], list[str]]:
    """The rows of a JSONL dataset that hold a conversation, and why each other line does not."""
    try:
        lines = [(line, _line_problem(line)) for line in iter_jsonl(path)]
    except OSError as exc:
        raise SFTDataError(f"--dataset {path}: cannot read it ({exc.strerror or exc})") from None
    return [line.row for line, why in lines if why is None], [why for _, why in lines if why]


def _read_dataset(spec: str | None, split: str, shown: str | None = None) -> list[dict]:
    """`load_conversations(spec, split)`; what `datasets` raises on a local file becomes an
    SFTDataError naming the dataset (`shown`, else `spec`)."""
    try:
        return load_conversations(spec, split)
    except SFTDataError:
        raise
    except Exception as exc:  # datasets' errors on a file it cannot parse (their cause says why)
        raise SFTDataError(f"--dataset {shown or spec}: cannot be read ({error_line(exc.__cause__ or exc)})") from None


def read_conversations(cfg: SFTConfig) -> list[dict]:
    """The conversations of `--dataset`. A local .jsonl file's unusable lines are skipped and named
    in one stderr line; the rest still loads through `datasets`, from a copy without them."""
    path = Path(cfg.dataset or "")
    if path.is_file() and path.stat().st_size == 0:
        raise SFTDataError(f"--dataset {path}: the file is empty")
    if path.suffix != ".jsonl" or not path.is_file():
        return _read_dataset(cfg.dataset, cfg.dataset_split)
    rows, skipped = _usable_lines(path)
    if not rows:
        raise SFTDataError(f"--dataset {path}: no usable rows ({first_reasons(skipped) or 'only blank lines'})")
    if not skipped:
        return _read_dataset(str(path), cfg.dataset_split)
    say(f"[sft] warning: --dataset {path}: skipped {len(skipped)} unusable line(s): {first_reasons(skipped)}")
    with tempfile.TemporaryDirectory() as tmp:
        clean = Path(tmp) / path.name
        clean.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return _read_dataset(str(clean), cfg.dataset_split, shown=str(path))


def _load_rows(cfg: SFTConfig, conversations: list[dict], tokenizer) -> tuple[list[dict], DataStats]:
    """The training rows (sequences, or packed rows of them) and what tokenising did."""
    examples, dstats = tokenize_dataset(conversations, tokenizer, cfg.max_length, cfg.overlong)
    if not examples:
        raise SFTDataError(f"no sequence left to train on ({dstats.dropped} dropped: too long for "
                           f"max_length={cfg.max_length} or no assistant token within it)")
    return (pack_sequences(examples, cfg.max_length) if cfg.packing else examples), dstats


def _data_line(cfg: SFTConfig, dstats: DataStats, plan: RowPlan) -> str:
    return (f"[sft] {dstats.conversations} conversations -> {dstats.sequences} sequences "
            f"({dstats.truncated} truncated, {dstats.dropped} dropped at max_length={cfg.max_length}), "
            f"{dstats.tokens} tokens, {dstats.label_tokens} trained; {plan.rows} rows"
            f"{' (packed)' if cfg.packing else ''}, {plan.steps_per_epoch} steps/epoch, {plan.total} steps")


def _prepare_model(cfg: SFTConfig, acc, total_steps: int):
    """(model, optimizer, scheduler), the first two prepared by Accelerate, the scheduler registered
    for checkpoints."""
    from transformers import get_scheduler

    from drkernel import runtime as rt
    from drkernel.modeling import compile_decoder_layers, load_model

    model = load_model(cfg.model, dtype=cfg.dtype, gradient_checkpointing=cfg.gradient_checkpointing,
                       lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                       lora_target_modules=cfg.lora_target_modules,
                       attn_implementation=cfg.attn_implementation,
                       gradient_checkpointing_every=cfg.gradient_checkpointing_every)
    model.config.use_cache = False
    if cfg.torch_compile:  # after LoRA and checkpointing, before prepare
        compile_decoder_layers(model)
    optimizer = rt.make_optimizer(model, cfg, acc.device, fused=cfg.fused_adamw)
    scheduler = get_scheduler(cfg.lr_scheduler, optimizer, num_warmup_steps=cfg.warmup_steps,
                              num_training_steps=total_steps)
    model, optimizer = acc.prepare(model, optimizer)
    acc.register_for_checkpointing(scheduler)  # stepped by us, once per optimiser step
    return model, optimizer, scheduler


def _resume(cfg: SFTConfig, acc, plan: RowPlan) -> int:
    """Restore the newest (or the given) checkpoint; the step it was made at (0: a fresh run)."""
    from drkernel import runtime as rt

    resume = rt.resolve_resume(cfg.resume_from, cfg.output_dir)
    if resume is None:
        return 0
    state = rt.load_checkpoint(acc, resume)
    start = int(state["step"])
    if state.get("rows") not in (None, plan.rows) or state.get("steps_per_epoch") not in (None, plan.steps_per_epoch):
        print(f"[sft] warning: the data changed since {resume} ({state.get('rows')} rows then, "
              f"{plan.rows} now): the data position is approximate", file=sys.stderr)
    if acc.is_main_process:
        print(f"[sft] resumed from {resume} at step {start}")
    return start


def _save_checkpoint(acc, model, tokenizer, cfg: SFTConfig, step: int, plan: RowPlan) -> None:
    from drkernel import runtime as rt

    epoch, k = plan.position(step)
    rt.save_checkpoint(acc, model, tokenizer, cfg, step, {
        **record_settings(cfg), "stage": "sft", "epoch": epoch, "step_in_epoch": k + 1, "rows": plan.rows,
        "steps_per_epoch": plan.steps_per_epoch})


def train(cfg: SFTConfig) -> dict:
    """Run SFT; return a summary (steps, last loss, paths)."""
    from tqdm.auto import tqdm

    from drkernel import runtime as rt
    from drkernel.modeling import load_tokenizer
    from drkernel.report import write_run_report

    conversations = read_conversations(cfg)  # a bad dataset is said before anything loads
    # we accumulate ourselves (see sft_step), so Accelerate must not rescale the loss
    acc = rt.make_accelerator(dataclasses.replace(cfg, gradient_accumulation_steps=1), dataclasses.asdict(cfg))
    tokenizer = load_tokenizer(cfg.model, cfg.tokenizer)
    units, dstats = _load_rows(cfg, conversations, tokenizer)
    plan = RowPlan.make(cfg, len(units), acc.num_processes)
    if acc.is_main_process:
        print(_data_line(cfg, dstats, plan))
    model, optimizer, scheduler = _prepare_model(cfg, acc, plan.total)
    start = _resume(cfg, acc, plan)
    logger = rt.MetricsLogger(acc, cfg.output_dir, start)
    if acc.is_main_process:
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.output_dir) / "sft_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))

    loss_fn = SFTLoss(cfg.loss_chunk_size)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    bsz = cfg.per_device_train_batch_size
    model.train()
    last: dict[str, Any] = {}
    saved_at = start
    bar = tqdm(range(start + 1, plan.total + 1), initial=start, total=plan.total, desc="sft",
               disable=not acc.is_main_process)
    for step in bar:
        mine = plan.rows_of(step, acc.process_index)
        micro = [collate([units[j] for j in mine[m:m + bsz]], pad_id, acc.device) for m in range(0, len(mine), bsz)]
        lr = scheduler.get_last_lr()[0]
        t0 = time.perf_counter()
        out = sft_step(acc, model, optimizer, micro, loss_fn, cfg.max_grad_norm)
        scheduler.step()
        dt = time.perf_counter() - t0
        last = {"loss": out["loss"], "tokens": out["tokens"], "label_tokens": out["label_tokens"],
                "lr": lr, "tokens_per_s": out["tokens"] / max(dt, 1e-9), "grad_norm": out["grad_norm"],
                "epoch": step / plan.steps_per_epoch, "step_time_s": dt,
                "seqs_truncated": dstats.truncated, "seqs_dropped": dstats.dropped}
        logger.log(last, step)
        bar.set_postfix(loss=f"{out['loss']:.4f}")
        if (cfg.save_steps > 0 and step % cfg.save_steps == 0) or step == plan.total:
            _save_checkpoint(acc, model, tokenizer, cfg, step, plan)
            saved_at = step
    final = Path(cfg.output_dir) / "final"
    rt.save_model(acc, model, tokenizer, final)
    logger.close()
    if acc.is_main_process:
        write_run_report(cfg.output_dir, f"SFT run: {cfg.output_dir}")
    return {"steps": plan.total, "start_step": start, "last": last, "final": str(final),
            "last_checkpoint": saved_at, "data": dataclasses.asdict(dstats)}


def _strip_stage(argv: list[str]) -> list[str]:
    """train.py passes our args; accept (and drop) a leftover `--stage sft` to be safe."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--stage" or a.startswith("--stage="):
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            if value != "sft":
                raise ConfigError(f"--stage {value!r} given to the SFT entry point (expected sft)")
            i += 1 if "=" in a else 2
            continue
        out.append(a)
        i += 1
    return out


def main(argv: Sequence[str] | None = None, preset: str | Path | None = None, prog: str = "drkernel.sft") -> int:
    """`train.py --stage sft` lands here (with `preset` configs/sft_quick.yaml: the settings start
    from it unless --config is given). Returns a process exit code; bad input is a clear message
    and exit code 2, not a traceback."""
    from drkernel.modeling import ModelLoadError
    from drkernel.tasks import TaskError

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = start_run(SFTConfig, _strip_stage(argv), preset, prog)
        summary = train(cfg)
    except (ConfigError, SFTDataError, TaskError, FileNotFoundError, ModelLoadError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    print(f"[sft] done: {summary['steps']} steps, last loss "
          f"{summary['last'].get('loss', float('nan')):.4f}, model in {summary['final']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
