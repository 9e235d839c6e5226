"""Prompts: the task message, the feedback message after each turn, code extraction, history.

A conversation is a list of chat messages `{"role", "content"}`:

    system  -- what a ModelNew is and the rules (SYSTEM_PROMPT)
    user    -- the one-shot example and the task's reference `Model` (first_turn_messages)
    assistant, user(feedback), assistant, user(feedback), ...

The feedback tells the policy what the evaluator saw (verdict, error, accuracy, timings,
kernel profile, detected hacks) but never how the reward is computed, so the policy can
only improve the reward by writing better kernels.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from drkernel.tasks import Task

FORMAT_ERROR = "format_error"
FORMAT_ERROR_MESSAGE = "no ```python block defining ModelNew found"

SYSTEM_PROMPT = """\
You are an expert GPU performance engineer who writes Triton kernels.

You are given a PyTorch program in KernelBench format: a class `Model(nn.Module)` plus
`get_inputs()` and `get_init_inputs()`. Write a new class `ModelNew(nn.Module)` that
computes the same outputs faster, using custom Triton kernels.

Rules:
- `ModelNew.__init__` and `ModelNew.forward` take exactly the same arguments as `Model`'s.
- Create the same parameters and buffers in the same order as `Model` (for example the same
  `nn.Linear` or `nn.Parameter` modules), so that with the same seed both models get
  identical weights.
- The forward pass must do its main work in kernels decorated with `@triton.jit` and
  launched from `forward`. Calling the PyTorch operator being replaced, copying the
  reference, caching outputs between calls or otherwise skipping the computation is
  detected and rejected.
- Results must match the reference within floating-point tolerance for any valid input.
- Answer with a single fenced ```python block containing a complete, self-contained module:
  all imports (torch, torch.nn, triton, triton.language), the kernels, helper functions
  and `ModelNew`. Do not redefine `Model`, `get_inputs` or `get_init_inputs`.
"""

EXAMPLE_REFERENCE = '''\
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


def get_inputs():
    return [torch.randn(4096), torch.randn(4096)]


def get_init_inputs():
    return []
'''

EXAMPLE_SOLUTION = '''\
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def add_kernel(a_ptr, b_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    pid = tl.program_id(axis=0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    a = tl.load(a_ptr + offsets, mask=mask)
    b = tl.load(b_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, a + b, mask=mask)


def triton_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a = a.contiguous()
    b = b.contiguous()
    out = torch.empty_like(a)
    n = out.numel()
    grid = (triton.cdiv(n, 1024),)
    add_kernel[grid](a, b, out, n, BLOCK=1024)
    return out


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return triton_add(a, b)
'''


def task_message(task: Task) -> str:
    """The first user message: the worked example, then the task's reference program."""
    return (
        "Here is an example. Reference program:\n"
        f"```python\n{EXAMPLE_REFERENCE}```\n"
        "A good answer:\n"
        f"```python\n{EXAMPLE_SOLUTION}```\n\n"
        "Now the real task. Reference program:\n"
        f"```python\n{task.code.rstrip()}\n```\n"
        "Write `ModelNew` with Triton kernels. Reply with one ```python block."
    )


def first_turn_messages(task: Task) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": task_message(task)}]


# ----------------------------------------------------------------------------- extraction

_FENCE = re.compile(r"^[ \t]*```[ \t]*([A-Za-z0-9_+-]*)[ \t]*$")
_PY_TAGS = {"", "python", "py", "python3"}


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language tag, body) of every fenced block; an unterminated final fence runs to the end."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    blocks: list[tuple[str, str]] = []
    tag: str | None = None
    body: list[str] = []
    for line in lines:
        m = _FENCE.match(line)
        if tag is None:
            if m:
                tag, body = m.group(1).lower(), []
        elif m and not m.group(1):  # a bare fence closes the open block
            blocks.append((tag, "\n".join(body)))
            tag = None
        else:
            body.append(line)
    if tag is not None:
        blocks.append((tag, "\n".join(body)))
    return blocks


def extract_code(text: str) -> str | None:
    """The last fenced python block (```python, ```py or bare ```) that defines `ModelNew`."""
    if not text:
        return None
    for tag, body in reversed(_fenced_blocks(text)):
        if tag in _PY_TAGS and "ModelNew" in body and body.strip():
            return body.strip("\n") + "\n"
    return None


def format_error_result(msg: str = FORMAT_ERROR_MESSAGE) -> dict:
    """An evaluator-shaped result for a response without usable code (scored as a failure)."""
    return {"verdict": FORMAT_ERROR, "compiled": False, "correct": False, "speedup": 0.0,
            "ref_ms": None, "candidate_ms": None, "hacks": [], "error": msg or FORMAT_ERROR_MESSAGE,
            "max_abs_err": None, "max_rel_err": None, "triton_time_share": None, "kernels": []}


# ----------------------------------------------------------------------------- feedback

HACK_HINTS = {  # codes as reported by drkernel.evaluator (HACK_CODES)
    "no_triton_kernel": "no Triton kernel ran; launch your @triton.jit kernels from forward",
    "decoy_kernel": "a Triton kernel ran but the result came from PyTorch; compute it in your kernels",
    "output_cached": "do not cache outputs between calls; compute them on every call",
    "output_aliases_input": "return a new output tensor, not a view of an input",
    "side_stream": "launch kernels on the current stream; do not use side streams",
    "patched_function": "do not patch torch, triton or the evaluation harness",
    "global_state_changed": "do not change global torch or process state",
    "reference_access": "do not call, import or copy the reference Model",
    "input_mutated": "do not modify the inputs in place",
    "bad_output_type": "return tensors of the same type, shape and structure as Model",
    "degenerate_output": "the output is constant or empty; compute the real result",
    "precision_downgrade": "keep the reference's precision; do not compute in a lower dtype",
    "implausible_speedup": "the timing is implausible; do not skip or defer the computation",
    "thread_spawned": "do not start threads or processes",
    "launch_pattern_changed": "launch the same kernels the same way on every call; do not switch paths between calls",
}
_VERDICT_TEXT = {
    "correct": "correct",
    "incorrect": "wrong output",
    "compile_error": "failed to compile or import",
    "runtime_error": "raised an error at run time",
    "timeout": "timed out",
    "crashed": "crashed the evaluation process",
    "hacked": "rejected: it does not really compute the result with Triton kernels",
    FORMAT_ERROR: "no code found",
}


def _error_excerpt(error: str, max_lines: int = 12, max_chars: int = 1200) -> str:
    """The end of an error (tracebacks say what went wrong last), bounded in lines and chars."""
    lines = [ln.rstrip() for ln in str(error).replace("\r\n", "\n").strip().split("\n")]
    if len(lines) > max_lines:
        lines = ["..."] + lines[-max_lines:]
    out = "\n".join(lines)
    if len(out) > max_chars:
        out = "..." + out[-max_chars:]
    return out


def _fmt_num(x: Any, spec: str = ".3g") -> str:
    try:
        return format(float(x), spec)
    except (TypeError, ValueError):
        return "n/a"


def _hack_code(h: Any) -> tuple[str, str]:
    if isinstance(h, dict):
        return str(h.get("code") or h.get("name") or h.get("kind") or "hack"), str(h.get("detail") or h.get("message") or "")
    return str(h), ""


def feedback_message(result: dict, turn: int) -> str:
    """What the evaluator saw for the answer of `turn` (1-based), and what to do next."""
    verdict = str(result.get("verdict") or "crashed")
    lines = [f"Evaluation of your answer (turn {turn}):",
             f"- verdict: {verdict} ({_VERDICT_TEXT.get(verdict, verdict)})"]
    if verdict != "correct" and result.get("error"):
        lines.append("- error:\n```\n" + _error_excerpt(result["error"]) + "\n```")
    if verdict == "incorrect":
        lines.append(f"- max abs error: {_fmt_num(result.get('max_abs_err'))}, "
                     f"max rel error: {_fmt_num(result.get('max_rel_err'))}")
    if verdict == "correct":
        lines.append(f"- speedup over the reference: {_fmt_num(result.get('speedup'), '.2f')}x "
                     f"(reference {_fmt_num(result.get('ref_ms'), '.4g')} ms, "
                     f"yours {_fmt_num(result.get('candidate_ms'), '.4g')} ms)")
    hacks = result.get("hacks") or []
    if hacks:
        lines.append("- problems detected:")
        for h in hacks:
            code, detail = _hack_code(h)
            hint = HACK_HINTS.get(code, detail or "compute the result honestly in Triton kernels")
            lines.append(f"  - {code}: {hint}")
    kernels = result.get("kernels") or []
    if kernels:
        top = sorted(kernels, key=lambda k: -float(k.get("total_ms") or 0.0))[:5]
        lines.append("- kernels by device time:")
        for k in top:
            lines.append(f"  - {k.get('name', '?')} [{k.get('kind', '?')}]: "
                         f"{_fmt_num(k.get('total_ms'), '.4g')} ms over {k.get('calls', '?')} calls "
                         f"({_fmt_num(100 * float(k.get('share') or 0.0), '.0f')}%)")
    share = result.get("triton_time_share")
    if share is not None:
        lines.append(f"- share of device time in your Triton kernels: {_fmt_num(100 * float(share), '.0f')}%")
    if verdict == "correct":
        lines.append("Your kernel is correct. Make it faster: fuse operations, improve memory "
                     "access and block sizes, and move any remaining PyTorch work into Triton. "
                     "Reply with the complete improved program in one ```python block.")
    else:
        lines.append("Fix the problem and reply with the complete corrected program in one "
                     "```python block.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- history

TRUNCATION_MARKER = "\n...[truncated]...\n"


def render_prompt(messages: Sequence[dict], tokenizer) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)


def count_prompt_tokens(messages: Sequence[dict], tokenizer) -> int:
    text = render_prompt(messages, tokenizer)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _truncate_middle(text: str, tokenizer, keep_tokens: int) -> str:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= keep_tokens:
        return text
    keep_tokens = max(keep_tokens, 2)
    head, tail = ids[: keep_tokens // 2], ids[len(ids) - (keep_tokens - keep_tokens // 2):]
    return tokenizer.decode(head) + TRUNCATION_MARKER + tokenizer.decode(tail)


def truncate_history(messages: Sequence[dict], tokenizer, max_prompt_tokens: int) -> list[dict]:
    """Keep system + task + the most recent (assistant, feedback) pairs that fit the budget.

    Messages after the first user message come in (assistant, user) pairs. Older pairs are
    dropped first. If even the latest pair alone is too long, its assistant content is cut
    in the middle (head and tail kept, TRUNCATION_MARKER between) until it fits.
    """
    messages = list(messages)
    n_head = 0
    while n_head < len(messages) and messages[n_head]["role"] != "user":
        n_head += 1
    head, rest = messages[: n_head + 1], messages[n_head + 1:]
    pairs = [rest[i:i + 2] for i in range(0, len(rest), 2)]
    if count_prompt_tokens(messages, tokenizer) <= max_prompt_tokens or not pairs:
        return messages
    kept: list[list[dict]] = []
    for pair in reversed(pairs):
        trial = head + [m for p in [pair] + kept for m in p]
        if count_prompt_tokens(trial, tokenizer) <= max_prompt_tokens:
            kept.insert(0, pair)
        else:
            break
    if kept:
        return head + [m for p in kept for m in p]
    # Even the latest pair does not fit: shorten its assistant message in the middle.
    latest = [dict(m) for m in pairs[-1]]
    base = count_prompt_tokens(head + [dict(m, content="") if m["role"] == "assistant" else m
                                       for m in latest], tokenizer)
    budget = max_prompt_tokens - base - len(tokenizer(TRUNCATION_MARKER, add_special_tokens=False)["input_ids"])
    for m in latest:
        if m["role"] == "assistant":
            original = m["content"]
            keep = max(budget, 16)
            for _ in range(8):  # decode/re-encode can shift counts a little; shrink until it fits
                m["content"] = _truncate_middle(original, tokenizer, keep)
                if count_prompt_tokens(head + latest, tokenizer) <= max_prompt_tokens or keep <= 16:
                    break
                keep = max(16, int(keep * 0.9) - 4)
    return head + latest
