"""SFT data: conversations -> token ids with assistant-only labels -> (packed) batches.

A conversation is a row with a `messages` column: a list of `{"role", "content"}` chat
messages (system, user task prompt, assistant answer, user feedback, assistant answer, ...),
from a `datasets` hub id, a local directory or .jsonl/.json/.parquet file, or our small
bundled set (drkernel/data/sft/conversations.jsonl).

Labels. The loss covers the assistant's tokens only; system prompts, task prompts and the
environment's feedback turns get label -100. We find the assistant tokens with the
tokenizer's own chat template, without relying on `{% generation %}` markers:

1. "prefix" (default): render the conversation up to each assistant message with the
   generation prompt (`<|im_start|>assistant\\n`), and up to and including that message;
   the token ids in between are the assistant's. We check the prefix property (each
   rendering's ids start the full conversation's ids) so a template that rewrites history
   cannot silently shift the labels.
2. "offsets" (fallback, when the prefix property fails, e.g. a template that drops earlier
   reasoning): find each assistant message's content in the rendered text and label the
   tokens that overlap it (character offsets of a fast tokenizer).
   If neither works, we raise SFTDataError naming the conversation.

In both cases the trained span is the message content plus the template's end-of-turn
token (so the model learns to stop); the template's whitespace after it is not trained.
An assistant message with `"weight": 0` (OpenAI's fine-tuning convention) is context only.

Packing. Sequences are concatenated greedily into rows of at most `max_length` tokens with
per-sequence `position_ids` that restart at 0 and no attention mask. transformers then
builds a block-diagonal causal mask from the position ids (sdpa/eager) or runs varlen
flash attention, so packed sequences never attend to each other; the first label of every
packed sequence is -100, so no sequence is trained to predict another's first token.

From generations. `generations_to_sft` turns generate.py's JSONL (one row per sample per
turn) into `messages` rows: rejection-sampled distillation with reward/speedup thresholds,
hacked turns dropped (the trajectory ends before them) and de-duplication by kernel hash.
A row answers the selected task of its (level, problem_id) only when it names that task
(`Task.row_problem`, the rule generate.py's resume and summary apply too); any other is skipped and
named, so a file written for another task set never pairs one task's prompt with another's answer.
A trajectory's rows must be its turns 0..k, each once (generate.py's 0-based turns): one that
repeats a turn (e.g. the outputs of several runs concatenated) or lacks one is skipped whole and
named, as which rows belong together is unknown; it is never stitched into a conversation that no
run had. Keep one run's rows per (level, problem_id, sample) to convert them.
A file from which no conversation is kept is an error (exit status 2, no output written), as is a
`--min_speedup` of 0 or less (a speedup is a ratio of times).

    python -m drkernel.sft_data --generations gen.jsonl [--out outputs/sft.jsonl] [--min_reward R] [--min_speedup S]
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from drkernel import metrics
from drkernel.config import FINITE, POSITIVE, TaskSelection, limit_problems, output_problem
from drkernel.jsonl import finite, first_reasons, iter_jsonl, rewrite_jsonl
from drkernel.tasks import UNPARSABLE, Task, text_digest

IGNORE_INDEX = -100
BUNDLED_SFT = Path(__file__).parent / "data" / "sft" / "conversations.jsonl"
ROLES = ("system", "user", "assistant", "tool")
OVERLONG = ("truncate", "drop")  # what happens to a sequence longer than max_length


class SFTDataError(ValueError):
    """A dataset, conversation or chat template that SFT cannot use."""


# ----------------------------------------------------------------------------- loading

def _read_json_rows(path: Path) -> list[dict]:
    """A .jsonl (or .json list) file without `datasets` (the GPU image may not have it); SFTDataError
    names the first line that is not a JSON object."""
    if path.suffix == ".json" and path.read_text().lstrip().startswith("["):
        try:
            rows = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise SFTDataError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
        if not all(isinstance(r, dict) for r in rows):
            raise SFTDataError(f"{path}: every row must be a JSON object")
        return rows
    rows = []
    for line in iter_jsonl(path):
        if line.row is None:
            raise SFTDataError(f"{path}:{line.lineno}: {line.error}")
        rows.append(line.row)
    return rows


def load_conversations(spec: str | None = None, split: str = "train") -> list[dict]:
    """Rows (dicts with at least `messages`) from the bundled set, a local file or dir, or the hub.

    - None / "" / "bundled": drkernel/data/sft/conversations.jsonl;
    - a .jsonl / .json / .parquet file: `load_dataset("json"|"parquet", data_files=...)`;
    - a directory: `load_dataset(directory, split=split)`;
    - anything else: a hub id, `load_dataset(spec, split=split)`.
    Local JSON files are read directly when `datasets` is not installed.
    """
    if not spec or spec == "bundled":
        if not BUNDLED_SFT.is_file():
            raise SFTDataError(f"the bundled SFT set {BUNDLED_SFT} is missing (a broken install?)")
        spec, path = "bundled", BUNDLED_SFT
    else:
        path = Path(spec)
    if path.is_file():
        fmt = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(path.suffix)
        if fmt is None:
            raise SFTDataError(f"{path}: unsupported file type (use .jsonl, .json or .parquet)")
        try:
            import datasets
        except ImportError:
            if fmt != "json":
                raise SFTDataError(f"{path}: reading parquet needs the `datasets` package") from None
            rows = _read_json_rows(path)
        else:
            rows = list(datasets.load_dataset(fmt, data_files=str(path), split="train"))
    else:
        looks_local = spec.startswith((".", "/", "~")) or spec.endswith((".jsonl", ".json", ".parquet"))
        if looks_local and not path.exists():
            raise SFTDataError(f"--dataset {spec}: no such file or directory")
        try:
            import datasets
        except ImportError:
            raise SFTDataError(f"--dataset {spec}: loading a directory or hub id needs the `datasets` "
                               "package; pass a .jsonl file instead") from None
        try:
            rows = list(datasets.load_dataset(spec, split=split))
        except Exception as exc:  # hub errors, missing split, unreadable files
            raise SFTDataError(f"--dataset {spec} (split {split!r}): {type(exc).__name__}: {exc}") from None
    if not rows:
        raise SFTDataError(f"--dataset {spec}: no rows")
    for i, row in enumerate(rows):
        validate_messages(row.get("messages"), f"{spec} row {i}")
    return rows


def validate_messages(messages: Any, where: str = "conversation") -> None:
    """A list of {role, content} dicts with known roles, string contents and >= 1 assistant turn."""
    if messages is None:
        raise SFTDataError(f"{where}: no `messages` column (expected a list of {{role, content}})")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise SFTDataError(f"{where}: `messages` must be a non-empty list of {{role, content}}")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise SFTDataError(f"{where} message {j}: expected a dict with `role` and `content`")
        if m["role"] not in ROLES:
            raise SFTDataError(f"{where} message {j}: unknown role {m['role']!r} (expected one of {ROLES})")
        if not isinstance(m["content"], str):
            raise SFTDataError(f"{where} message {j}: `content` must be a string")
    if not any(m["role"] == "assistant" for m in messages):
        raise SFTDataError(f"{where}: no assistant message, nothing to train on")


def _clean(messages: Sequence[dict]) -> list[dict]:
    """Only role and content reach the template (datasets adds null columns to structs)."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _trained(m: dict) -> bool:
    w = m.get("weight")
    return m["role"] == "assistant" and (w is None or float(w) > 0)


# ----------------------------------------------------------------------------- labels

def _render(tokenizer, messages: Sequence[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=generation_prompt)


def _encode(tokenizer, text: str) -> list[int]:
    # the template already wrote BOS and friends: never add special tokens twice
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _trim_trailing_whitespace(tokenizer, ids: list[int], start: int, end: int) -> int:
    """Drop the template's whitespace after the end-of-turn token (e.g. the "\\n" after <|im_end|>)."""
    while end > start and not tokenizer.decode([ids[end - 1]]).strip():
        end -= 1
    return end


def _spans_by_prefix(tokenizer, messages: list[dict], full_ids: list[int]) -> list[tuple[int, int]] | None:
    """Token spans [start, end) of trained assistant messages, or None if the prefix property fails."""
    spans = []
    for i, m in enumerate(messages):
        if not _trained(m):
            continue
        try:
            prompt = _encode(tokenizer, _render(tokenizer, _clean(messages[:i]), True))
            upto = _encode(tokenizer, _render(tokenizer, _clean(messages[: i + 1]), False))
        except Exception:  # e.g. a template that refuses a conversation not ending with a user turn
            return None
        if upto[: len(prompt)] != prompt or full_ids[: len(upto)] != upto or len(upto) <= len(prompt):
            return None
        end = _trim_trailing_whitespace(tokenizer, upto, len(prompt), len(upto))
        if end > len(prompt):
            spans.append((len(prompt), end))
    return spans


def _spans_by_offsets(tokenizer, messages: list[dict], text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Fallback: locate each message's content in the rendered text; label overlapping tokens
    plus the end-of-turn special token right after the content."""
    if not getattr(tokenizer, "is_fast", False):
        raise SFTDataError("the chat template does not render conversations prefix-consistently and "
                           "the tokenizer is not a fast tokenizer (no character offsets)")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    spans, pos = [], 0
    for i, m in enumerate(messages):
        content = m["content"]
        at = text.find(content, pos) if content else pos
        if at < 0:
            raise SFTDataError(f"message {i} ({m['role']}): its content does not appear verbatim in the "
                               "rendered chat template, so its tokens cannot be located")
        pos = at + len(content)
        if not _trained(m) or not content:
            continue
        toks = [k for k, (a, b) in enumerate(offsets) if a < pos and b > at and b > a]
        if not toks:
            continue
        start, end = toks[0], toks[-1] + 1
        if end < len(ids) and ids[end] in special:
            end += 1
        spans.append((start, end))
    return ids, spans


def tokenize_conversation(messages: Sequence[dict], tokenizer) -> dict:
    """{"input_ids", "labels", "method"} for one conversation; labels are -100 outside the
    trained assistant spans (see the module docstring)."""
    messages = [dict(m) for m in messages]
    validate_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise SFTDataError("the tokenizer has no chat template; SFT renders conversations with it "
                           "(pass --tokenizer with one)")
    text = _render(tokenizer, _clean(messages), False)
    ids = _encode(tokenizer, text)
    spans = _spans_by_prefix(tokenizer, messages, ids)
    method = "prefix"
    if spans is None:
        ids, spans = _spans_by_offsets(tokenizer, messages, text)
        method = "offsets"
    labels = [IGNORE_INDEX] * len(ids)
    for a, b in spans:
        labels[a:b] = ids[a:b]
    return {"input_ids": ids, "labels": labels, "method": method}


@dataclasses.dataclass
class DataStats:
    conversations: int = 0
    sequences: int = 0  # kept after length handling
    truncated: int = 0  # cut to max_length
    dropped: int = 0  # removed: too long with overlong="drop", or no trained token left
    tokens: int = 0
    label_tokens: int = 0
    fallback_offsets: int = 0  # conversations labelled through character offsets


def tokenize_dataset(rows: Iterable[dict], tokenizer, max_length: int,
                     overlong: str) -> tuple[list[dict], DataStats]:
    """Tokenise every row; sequences longer than `max_length` are cut ("truncate") or dropped
    ("drop"); a sequence left without any trained token is dropped either way."""
    if overlong not in OVERLONG:
        raise SFTDataError(f"overlong must be one of {OVERLONG}, not {overlong!r}")
    if max_length < 2:
        raise SFTDataError(f"max_length must be >= 2, not {max_length}")
    stats = DataStats()
    out = []
    for i, row in enumerate(rows):
        stats.conversations += 1
        try:
            ex = tokenize_conversation(row.get("messages"), tokenizer)
        except SFTDataError as exc:
            raise SFTDataError(f"conversation {i}: {exc}") from None
        stats.fallback_offsets += ex["method"] == "offsets"
        ids, labels = ex["input_ids"], ex["labels"]
        if len(ids) > max_length:
            if overlong == "drop":
                stats.dropped += 1
                continue
            ids, labels = ids[:max_length], labels[:max_length]
            stats.truncated += 1
        n_labels = sum(1 for t in labels[1:] if t != IGNORE_INDEX)  # position 0 is never predicted
        if n_labels == 0:
            stats.dropped += 1
            continue
        out.append({"input_ids": ids, "labels": labels})
        stats.sequences += 1
        stats.tokens += len(ids)
        stats.label_tokens += n_labels
    return out, stats


# ----------------------------------------------------------------------------- packing, batches

def pack_sequences(examples: Sequence[dict], max_length: int) -> list[dict]:
    """Greedy packing in the given order: each row holds whole sequences, at most `max_length`
    tokens, with `position_ids` restarting at 0 per sequence and the first label of each
    sequence masked (see the module docstring)."""
    rows: list[dict] = []
    cur: dict | None = None
    for ex in examples:
        n = len(ex["input_ids"])
        if n > max_length:
            raise SFTDataError(f"a sequence of {n} tokens does not fit max_length {max_length}")
        if cur is None or len(cur["input_ids"]) + n > max_length:
            cur = {"input_ids": [], "labels": [], "position_ids": []}
            rows.append(cur)
        cur["input_ids"].extend(ex["input_ids"])
        cur["labels"].extend([IGNORE_INDEX] + list(ex["labels"][1:]))
        cur["position_ids"].extend(range(n))
    return rows


def collate(examples: Sequence[dict], pad_token_id: int, device=None) -> dict:
    """Right-padded tensors. Unpacked rows get an attention mask; packed rows (with
    `position_ids`) get none, and their padding is a separate pseudo-sequence (positions
    from 0) so that it cannot be attended to by the real ones."""
    import torch

    width = max(len(e["input_ids"]) for e in examples)
    packed = "position_ids" in examples[0]
    ids = torch.full((len(examples), width), int(pad_token_id), dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    batch: dict[str, Any] = {}
    if packed:
        pos = torch.zeros((len(examples), width), dtype=torch.long)
    else:
        mask = torch.zeros((len(examples), width), dtype=torch.long)
    for r, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[r, :n] = torch.tensor(e["input_ids"])
        labels[r, :n] = torch.tensor(e["labels"])
        if packed:
            pos[r, :n] = torch.tensor(e["position_ids"])
            pos[r, n:] = torch.arange(width - n)
        else:
            mask[r, :n] = 1
    batch["input_ids"], batch["labels"] = ids, labels
    if packed:
        batch["position_ids"], batch["attention_mask"] = pos, None
    else:
        batch["attention_mask"], batch["position_ids"] = mask, None
    batch["num_tokens"] = sum(len(e["input_ids"]) for e in examples)
    if device is not None:
        batch = {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}
    return batch


# ----------------------------------------------------------------------------- from generations

@dataclasses.dataclass
class ConvertConfig(TaskSelection):
    """`python -m drkernel.sft_data`: generate.py's JSONL -> SFT `messages` rows; `tasks`/`levels`
    name where the rows' problems come from (as generate.py's)."""

    # the thresholds a turn must reach: any finite reward (a reward's scale is configurable), a
    # speedup > 0 (a ratio of times: 0 or less would only drop turns that have no speedup)
    LIMITS = {"min_reward": FINITE, "min_speedup": POSITIVE}

    generations: str = dataclasses.field(default="", metadata={
        "help": "generate.py's JSONL: one row per (level, problem_id, sample, turn); a trajectory whose "
                "turns are not 0..k, each in one row (e.g. several runs' files concatenated), is skipped "
                "and named"})
    out: str = dataclasses.field(default="outputs/sft.jsonl", metadata={"help": "the SFT rows written (JSONL)"})
    min_reward: float | None = dataclasses.field(default=None, metadata={
        "help": "a turn qualifies if correct, not hacked, and its reward is at least this"})
    min_speedup: float | None = dataclasses.field(default=None, metadata={
        "help": "... and its speedup (> 0) is at least this"})
    train_failed_turns: bool = dataclasses.field(default=False, metadata={
        "help": "also train on earlier, non-qualifying answers (default: context only)"})


def kernel_hash(code: str) -> str:
    """sha256 of the code with comments, blank lines and formatting normalised away (via ast)."""
    try:
        norm = ast.unparse(ast.parse(code))
    except UNPARSABLE:
        norm = "\n".join(" ".join(line.split()) for line in code.splitlines()
                         if line.strip() and not line.strip().startswith("#"))
    return text_digest(norm)[:16]


def _qualifies(row: dict, min_reward: float | None, min_speedup: float | None) -> bool:
    correct = bool(row.get("correct")) or row.get("verdict") == "correct"
    if not correct or metrics.is_hacked(row):
        return False
    if min_reward is not None and (finite(row.get("reward")) is None or finite(row["reward"]) < min_reward):
        return False
    if min_speedup is not None and (finite(row.get("speedup")) is None or finite(row["speedup"]) < min_speedup):
        return False
    return True


def _result_of(row: dict) -> dict:
    """The evaluator fields feedback_message reads: a nested `result` if the row has one,
    updated by the row's own top-level fields."""
    result = dict(row.get("result") or {})
    result.update({k: v for k, v in row.items() if k != "result"})
    return result


@dataclasses.dataclass
class ConvertStats:
    """What `generations_to_sft` kept and why it left the rest out."""

    trajectories: int = 0  # (level, problem_id, sample) in the input
    kept: int = 0  # conversations written
    missing_task: int = 0  # trajectories of a problem not in the task set
    hacked_turns_dropped: int = 0  # a hacked turn and the turns after it
    truncated_at_hack: int = 0  # trajectories cut before a hacked turn
    below_threshold: int = 0  # trajectories without a qualifying turn
    duplicates: int = 0  # the same final kernel as a kept trajectory of the problem with a higher reward
    repeated_turns: int = 0  # trajectories with a turn in several rows (several runs' files concatenated)
    turn_gaps: int = 0  # trajectories whose turns are not 0..k
    skipped: list[str] = dataclasses.field(default_factory=list)  # "row N: why" per unusable row or line
    # "level L problem P sample S: why" per trajectory skipped whole (repeated_turns, turn_gaps)
    skipped_trajectories: list[str] = dataclasses.field(default_factory=list)


_ROW_KEYS = ("level", "problem_id", "sample", "turn")  # counts that place a row in its trajectory


def _row_problem(row: dict) -> str | None:
    """Why a generation row cannot be placed in a conversation (None: it can)."""
    missing = [k for k in (*_ROW_KEYS, "response") if k not in row]
    if missing:
        return f"missing key(s) {', '.join(missing)}"
    bad = [k for k in _ROW_KEYS if isinstance(row[k], bool) or not isinstance(row[k], int)]
    return f"{', '.join(bad)} not an integer" if bad else None


def _selected_task_problem(row: dict, by_key: Mapping[tuple[int, int], Task]) -> str | None:
    """`Task.row_problem` against the selected task of the row's (level, problem_id); None when there is
    none (the trajectory then counts as `missing_task`)."""
    task = by_key.get((row["level"], row["problem_id"]))
    return None if task is None else task.row_problem(row)


def _trajectories(rows: Iterable[dict], by_key: Mapping[tuple[int, int], Task],
                  stats: ConvertStats) -> dict[tuple[int, int, int], list[dict]]:
    """The rows of each (level, problem_id, sample); a row that cannot be placed, or that answers
    another task than the selected one of its problem, is skipped and named."""
    trajs: dict[tuple[int, int, int], list[dict]] = {}
    for i, row in enumerate(rows, 1):
        problem = _row_problem(row) or _selected_task_problem(row, by_key)
        if problem:
            stats.skipped.append(f"row {i}: {problem}")
            continue
        trajs.setdefault((row["level"], row["problem_id"], row["sample"]), []).append(row)
    return trajs


def _turn_problem(turns: list[dict], stats: ConvertStats) -> str | None:
    """Why a trajectory's rows are not one conversation, its turns 0..k each once, counted in `stats`
    (None: they are). Which of several rows of one turn belongs with the others is unknown, so such a
    trajectory is skipped whole rather than stitched from several runs."""
    numbers = sorted(r["turn"] for r in turns)
    repeated = sorted({n for n in numbers if numbers.count(n) > 1})
    if repeated:
        stats.repeated_turns += 1
        return f"turn(s) {', '.join(map(str, repeated))} in several rows (several runs' files concatenated?)"
    if numbers != list(range(len(numbers))):
        stats.turn_gaps += 1
        return f"turns {', '.join(map(str, numbers))} are not 0..{len(numbers) - 1}"
    return None


def _before_hack(turns: list[dict], stats: ConvertStats) -> list[dict]:
    """The turns before the first hacked one."""
    for t, r in enumerate(turns):
        if metrics.is_hacked(r):
            stats.hacked_turns_dropped += len(turns) - t
            stats.truncated_at_hack += 1
            return turns[:t]
    return turns


def _conversation(task, turns: list[dict], good: list[int], train_failed_turns: bool) -> list[dict]:
    """The task prompt, then each turn's answer and the feedback on it, numbered from 1 as the rollout
    does (the answers of `good` turns trained, the others only with `train_failed_turns`)."""
    from drkernel.prompts import feedback_message, first_turn_messages

    messages = first_turn_messages(task)
    for t, r in enumerate(turns):
        msg = {"role": "assistant", "content": str(r["response"])}
        if not train_failed_turns:
            msg["weight"] = 1 if t in good else 0
        messages.append(msg)
        if t < len(turns) - 1:
            messages.append({"role": "user", "content": feedback_message(_result_of(r), t + 1)})
    return messages


def _best_per_kernel(candidates: list[dict], stats: ConvertStats) -> list[dict]:
    """One trajectory per (problem, final kernel): the one with the highest final reward."""
    candidates = sorted(candidates, key=lambda c: -(c["final_reward"] if c["final_reward"] is not None
                                                     else -math.inf))
    seen: set[tuple] = set()
    out = []
    for c in candidates:
        key = (c["level"], c["problem_id"], c["kernel_hash"])
        if key in seen:
            stats.duplicates += 1
            continue
        seen.add(key)
        out.append(c)
    return sorted(out, key=lambda c: (c["level"], c["problem_id"], c["sample"]))


def generations_to_sft(rows: Iterable[dict], tasks: Sequence[Task], min_reward: float | None = None,
                       min_speedup: float | None = None,
                       train_failed_turns: bool = False) -> tuple[list[dict], ConvertStats]:
    """Rejection-sampled distillation from generation rows.

    A row that does not name the selected task of its (level, problem_id) (`Task.row_problem`) is
    skipped and named, and so is a trajectory (level, problem_id, sample) whose turns are not 0..k,
    each in one row (`_turn_problem`). Per trajectory, turns in order:
    - a hacked turn and everything after it are dropped;
    - the trajectory is kept only if some remaining turn qualifies (correct, not hacked,
      reward >= min_reward, speedup >= min_speedup), and it ends at its last qualifying turn;
    - earlier answers stay as context; they are trained only with `train_failed_turns`
      (otherwise `weight: 0`), so we never imitate a failed kernel;
    - the feedback between turns is rebuilt with drkernel.prompts.feedback_message from the
      turn's result fields, exactly as the rollout showed it;
    - trajectories of one problem with the same final kernel (kernel_hash) are de-duplicated,
      keeping the one with the highest final reward.
    Returns (messages rows, stats).
    """
    from drkernel.prompts import extract_code

    by_key = {(int(t.level), int(t.problem_id)): t for t in tasks}
    stats = ConvertStats()
    trajs = _trajectories(rows, by_key, stats)
    stats.trajectories = len(trajs)
    candidates = []
    for (level, pid, sample), turns in sorted(trajs.items()):
        task = by_key.get((level, pid))
        if task is None:
            stats.missing_task += 1
            continue
        if problem := _turn_problem(turns, stats):
            stats.skipped_trajectories.append(f"level {level} problem {pid} sample {sample}: {problem}")
            continue
        turns = _before_hack(sorted(turns, key=lambda r: r["turn"]), stats)
        good = [t for t, r in enumerate(turns) if _qualifies(r, min_reward, min_speedup)]
        if not good:
            stats.below_threshold += 1
            continue
        turns = turns[: good[-1] + 1]
        final = turns[-1]
        code = final.get("code") or extract_code(str(final["response"])) or str(final["response"])
        candidates.append({"messages": _conversation(task, turns, good, train_failed_turns), "level": level,
                           "problem_id": pid, "sample": sample, "turns": len(turns),
                           "final_reward": finite(final.get("reward")), "final_speedup": finite(final.get("speedup")),
                           "kernel_hash": kernel_hash(code)})
    out = _best_per_kernel(candidates, stats)
    stats.kept = len(out)
    return out, stats


def _generation_rows(path: Path) -> tuple[list[dict], list[str]]:
    """The usable rows of generate.py's JSONL (a .json list is read whole), and "line N: why" for
    each other line (a killed run leaves its last line cut)."""
    if path.suffix == ".json":
        return _read_json_rows(path), []
    lines = [(ln, ln.error if ln.row is None else _row_problem(ln.row)) for ln in iter_jsonl(path)]
    return ([ln.row for ln, problem in lines if not problem],
            [f"line {ln.lineno}: {problem}" for ln, problem in lines if problem])


def convert_file(cfg: ConvertConfig) -> ConvertStats:
    """Read `cfg.generations`, write `cfg.out`; return the stats."""
    path = Path(cfg.generations)
    if problem := _generations_problem(cfg.generations) or output_problem("--out", cfg.out):
        raise SFTDataError(problem)
    if Path(cfg.out).resolve() == path.resolve():
        raise SFTDataError(f"--out {cfg.out} is the --generations file: it would be overwritten")
    if problems := limit_problems(cfg):
        raise SFTDataError("; ".join(problems))
    rows, unreadable = _generation_rows(path)
    tasks = cfg.selected_tasks()
    out_rows, stats = generations_to_sft(rows, tasks, cfg.min_reward, cfg.min_speedup, cfg.train_failed_turns)
    stats.skipped = unreadable + stats.skipped  # file lines first, then rows without integer counts
    if not out_rows:  # an empty SFT set would only fail later, in training
        raise SFTDataError(f"--generations {path}: no conversation to write ({_none_kept(stats)})")
    try:
        rewrite_jsonl(cfg.out, out_rows)
    except OSError as exc:
        raise SFTDataError(f"--out {cfg.out}: cannot write it ({exc.strerror or exc})") from None
    return stats


def _generations_problem(generations: str) -> str | None:
    """Why --generations names no file to read, or None."""
    if not generations:
        return "--generations is required (generate.py's JSONL)"
    path = Path(generations)
    if path.is_dir():
        return f"--generations {path}: is a directory, not a file (name generate.py's JSONL)"
    return None if path.is_file() else f"--generations {path}: no such file"


def _none_kept(stats: ConvertStats) -> str:
    """Why no conversation was kept: what the trajectories and rows were, then the first skipped rows."""
    counts = {"trajectory(ies)": stats.trajectories, "of no selected task": stats.missing_task,
              "with a turn in several rows": stats.repeated_turns, "with turns not 0..k": stats.turn_gaps,
              "without a qualifying turn": stats.below_threshold, "unusable row(s)": len(stats.skipped)}
    text = ", ".join(f"{n} {what}" for what, n in counts.items() if n)
    if not text:
        return "the file holds no rows"
    reasons = stats.skipped + stats.skipped_trajectories
    return text + (f": {first_reasons(reasons)}" if reasons else "")


def main(argv: Sequence[str] | None = None) -> int:
    from drkernel.config import ConfigError, parse_config
    from drkernel.tasks import TaskError

    try:
        cfg = parse_config(ConvertConfig, argv)
        stats = convert_file(cfg)
    except (ConfigError, SFTDataError, TaskError, OSError) as exc:
        print(f"drkernel.sft_data: error: {exc}", file=sys.stderr)
        return 2
    if stats.skipped:
        print(f"drkernel.sft_data: {cfg.generations}: skipped {len(stats.skipped)} unusable row(s): "
              f"{first_reasons(stats.skipped)}", file=sys.stderr)
    if stats.skipped_trajectories:
        print(f"drkernel.sft_data: {cfg.generations}: skipped {len(stats.skipped_trajectories)} trajectory(ies) "
              f"whose rows are not one run's turns 0..k: {first_reasons(stats.skipped_trajectories)}", file=sys.stderr)
    print(json.dumps({"out": cfg.out, **dataclasses.asdict(stats)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
