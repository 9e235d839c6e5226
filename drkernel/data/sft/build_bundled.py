"""Build `conversations.jsonl`: our own small multi-turn SFT set for the bundled tasks.

Each conversation is what a good policy's episode looks like:

    system + user      drkernel.prompts.first_turn_messages(task)
    assistant          a first answer we wrote, with a mistake a model typically makes
    user               drkernel.prompts.feedback_message(<the evaluator's real result>, 1)
    [assistant, user   a second attempt and its feedback (one conversation has three turns)]
    assistant          the fix, ending with our bundled solution (drkernel/data/solutions)

The feedback is not invented: every intermediate answer is run through drkernel.evaluator
and its verdict, errors, timings and kernel profile are what the user message reports. Each row
records the device it was evaluated on (`evaluated_on`); rebuilding gives slightly different
timings.

    python drkernel/data/sft/build_bundled.py --device cpu|cuda [--out conversations.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from drkernel.prompts import feedback_message, first_turn_messages  # noqa: E402
from drkernel.tasks import bundled_solution, load_bundled  # noqa: E402

HEADER = "import torch\nimport torch.nn as nn\nimport triton\nimport triton.language as tl\n\n\n"

RELU_SLOW = HEADER + '''\
@triton.jit
def relu_kernel(x_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.where(x > 0, x, 0.0)
    tl.store(out_ptr + offs, y, mask=mask)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        n = x.numel()
        BLOCK = 64
        grid = (triton.cdiv(n, BLOCK),)
        relu_kernel[grid](x, out, n, BLOCK=BLOCK)
        return out
'''

RELU_TORCH_FALLBACK = HEADER + '''\
@triton.jit
def relu_kernel(x_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, tl.maximum(x, 0.0), mask=mask)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        if n < (1 << 16):
            # small inputs: a kernel launch costs more than it saves
            return torch.relu(x)
        out = torch.empty_like(x)
        relu_kernel[(triton.cdiv(n, 1024),)](x, out, n, BLOCK=1024)
        return out
'''

ADD_SCALE_WRONG = HEADER + '''\
@triton.jit
def add_scale_kernel(a_ptr, b_ptr, out_ptr, n_elements, scale, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    a = tl.load(a_ptr + offs, mask=mask)
    b = tl.load(b_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, a + b * scale, mask=mask)


class ModelNew(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(a)
        n = a.numel()
        grid = (triton.cdiv(n, 256),)
        add_scale_kernel[grid](a, b, out, n, self.scale, BLOCK=256)
        return out
'''

MATMUL_NO_K_MASK = HEADER + '''\
@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                  stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rm[:, None] * stride_am + (k0 + rk)[None, :] * stride_ak,
                    mask=rm[:, None] < M, other=0.0)
        b = tl.load(b_ptr + (k0 + rk)[:, None] * stride_bk + rn[None, :] * stride_bn,
                    mask=rn[None, :] < N, other=0.0)
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc,
             mask=(rm[:, None] < M) & (rn[None, :] < N))


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        M, K = A.shape
        _, N = B.shape
        C = torch.empty((M, N), device=A.device, dtype=A.dtype)
        grid = (triton.cdiv(M, 32), triton.cdiv(N, 32))
        matmul_kernel[grid](A, B, C, M, N, K,
                            A.stride(0), A.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
                            BLOCK_M=32, BLOCK_N=32, BLOCK_K=16)
        return C
'''

SOFTMAX_UNSTABLE = HEADER + '''\
@triton.jit
def softmax_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    e = tl.exp(x)
    tl.store(out_ptr + row * n_cols + cols, e / tl.sum(e, axis=0), mask=mask)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, cols = x.shape
        out = torch.empty_like(x)
        softmax_kernel[(rows,)](x, out, cols, BLOCK=triton.next_power_of_2(cols))
        return out
'''

SOFTMAX_MISSING_ARG = HEADER + '''\
@triton.jit
def softmax_kernel(x_ptr, out_ptr, n_cols, stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_row + cols, mask=mask, other=0.0)
    x = x - tl.max(x, axis=0)
    e = tl.exp(x)
    tl.store(out_ptr + row * stride_row + cols, e / tl.sum(e, axis=0), mask=mask)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, cols = x.shape
        out = torch.empty_like(x)
        softmax_kernel[(rows,)](x, out, cols, BLOCK=triton.next_power_of_2(cols))
        return out
'''

SOFTMAX_ZERO_PADDING = HEADER + '''\
@triton.jit
def softmax_kernel(x_ptr, out_ptr, n_cols, stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_row + cols, mask=mask, other=0.0)
    x = x - tl.max(x, axis=0)
    e = tl.exp(x)
    tl.store(out_ptr + row * stride_row + cols, e / tl.sum(e, axis=0), mask=mask)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, cols = x.shape
        out = torch.empty_like(x)
        softmax_kernel[(rows,)](x, out, cols, x.stride(0), BLOCK=triton.next_power_of_2(cols))
        return out
'''

LINEAR_GELU_TORCH_GEMM = HEADER + '''\
@triton.jit
def gelu_tanh_kernel(x_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    y = tl.load(x_ptr + offs, mask=mask, other=0.0)
    u = 0.7978845608028654 * (y + 0.044715 * y * y * y)
    t = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
    tl.store(out_ptr + offs, 0.5 * y * (1.0 + t), mask=mask)


class ModelNew(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x).contiguous()
        out = torch.empty_like(y)
        n = y.numel()
        gelu_tanh_kernel[(triton.cdiv(n, 1024),)](y, out, n, BLOCK=1024)
        return out
'''

ROWSUM_NO_KEEPDIM = HEADER + '''\
@triton.jit
def row_sum_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + cols, mask=cols < n_cols, other=0.0)
    tl.store(out_ptr + row, tl.sum(x, axis=0))


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, cols = x.shape
        out = torch.empty((rows,), device=x.device, dtype=x.dtype)
        row_sum_kernel[(rows,)](x, out, cols, BLOCK=triton.next_power_of_2(cols))
        return out
'''

EMBEDDING_WRONG_DTYPE = HEADER + '''\
@triton.jit
def gather_kernel(ids_ptr, table_ptr, out_ptr, dim, BLOCK_D: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(ids_ptr + i)
    cols = tl.arange(0, BLOCK_D)
    v = tl.load(table_ptr + row * dim + cols, mask=cols < dim)
    tl.store(out_ptr + i * dim + cols, v, mask=cols < dim)


class ModelNew(nn.Module):
    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(num_embeddings, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.numel()
        dim = self.table.shape[1]
        out = torch.empty((n, dim), device=ids.device, dtype=ids.dtype)
        gather_kernel[(n,)](ids, self.table, out, dim, BLOCK_D=triton.next_power_of_2(dim))
        return out
'''

LAYERNORM_NO_AFFINE = HEADER + '''\
@triton.jit
def layernorm_kernel(x_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    mean = tl.sum(x, axis=0) / n_cols
    d = tl.where(mask, x - mean, 0.0)
    var = tl.sum(d * d, axis=0) / n_cols
    tl.store(out_ptr + row * n_cols + cols, d / tl.sqrt(var + eps), mask=mask)


class ModelNew(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.ln = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        rows, cols = x.shape
        layernorm_kernel[(rows,)](x, out, cols, self.ln.eps, BLOCK=triton.next_power_of_2(cols))
        return out
'''

SOLUTION = None  # marks the final turn: the bundled solution of the task

# (task id, [(assistant prose, code or SOLUTION, expected verdict or None), ...])
CONVERSATIONS = [
    (1, [
        ("ReLU is elementwise, so a 1-D grid over the flattened tensor with one masked load and "
         "store per program is enough.", RELU_SLOW, "correct"),
        ("The kernel is correct but launches many tiny programs (64 elements each), so launch and "
         "scheduling overhead dominates. I process 1024 elements per program, make the input "
         "contiguous first (the kernel assumes a dense layout), compute offsets in int64 so very "
         "large tensors cannot overflow, and use `tl.maximum` instead of a compare-and-select.",
         SOLUTION, None),
    ]),
    (1, [
        ("ReLU is elementwise: one masked load, `tl.maximum` and one store per program. For small "
         "inputs a kernel launch costs more than it saves, so those take a fast path.",
         RELU_TORCH_FALLBACK, "hacked"),
        ("Right: for inputs of this size the \"fast path\" was PyTorch's own ReLU, so no Triton "
         "kernel ran at all. The kernel now handles every size; `forward` always launches it "
         "and returns its output, with no PyTorch operator on the data path.", SOLUTION, None),
    ]),
    (2, [
        ("A single fused elementwise kernel: load `a` and `b`, add, scale and store, so the "
         "intermediate sum never goes to memory.", ADD_SCALE_WRONG, "incorrect"),
        ("The error comes from operator precedence: I computed `a + b * scale`, but the reference "
         "is `(a + b) * scale`. Fixed, and I also broadcast the inputs, make them contiguous, use "
         "int64 offsets and pass the scale as a Python float.", SOLUTION, None),
    ]),
    (3, [
        ("A tiled matmul: each program computes a 32x32 tile of C and walks over K in steps of "
         "16, accumulating `tl.dot` products in fp32.", MATMUL_NO_K_MASK, "incorrect"),
        ("K = 40 is not a multiple of BLOCK_K = 16, so the last K step read past the end of the "
         "rows of A and the columns of B; those garbage values explain the huge error. Both loads "
         "are now masked along K as well (with `other=0.0`, which adds nothing to the dot "
         "product). I also pass `input_precision=\"ieee\"`: on a GPU `tl.dot` would otherwise "
         "round fp32 inputs to TF32, too coarse for an fp32 reference checked at 1e-4. The inputs "
         "are made contiguous and C is accumulated in fp32 before casting back.", SOLUTION, None),
    ]),
    (4, [
        ("One program per row: load the row, exponentiate and divide by the row sum.",
         SOFTMAX_UNSTABLE, "incorrect"),
        ("Two bugs. The row has 100 columns but the block has 128 lanes, and the padding lanes "
         "loaded 0.0, so each added exp(0) = 1 to the sum. And without subtracting the row "
         "maximum, `exp` can overflow for large inputs. Now the padding loads -inf, the maximum "
         "is subtracted before `exp`, masked lanes are zeroed before the sum, and rows are "
         "addressed through the row stride in int64.", SOLUTION, None),
    ]),
    (4, [
        ("A numerically stable softmax: one program per row, subtract the row maximum before "
         "`exp`, then divide by the sum.", SOFTMAX_MISSING_ARG, "runtime_error"),
        ("The launch did not pass the `stride_row` argument that the kernel expects; it is now "
         "`x.stride(0)`.", SOFTMAX_ZERO_PADDING, "incorrect"),
        ("The row has 100 columns but the block has 128 lanes. The padding lanes loaded 0.0, so "
         "after subtracting the maximum each of them still added exp(-max) to the sum. They now "
         "load -inf (exp(-inf) = 0) and are zeroed explicitly before the sum; I also make the "
         "input contiguous and index rows in int64.", SOLUTION, None),
    ]),
    (5, [
        ("I keep `nn.Linear` for the matrix multiply and apply the tanh-approximated GELU in a "
         "Triton kernel over the flattened output.", LINEAR_GELU_TORCH_GEMM, None),
        ("The matrix multiply still runs in PyTorch and writes an intermediate tensor that the "
         "GELU kernel reads back. One fused kernel does everything: a tiled `x @ W^T` with "
         "`tl.dot` in full fp32 precision, then the bias and the GELU applied in registers "
         "before a single store. `ModelNew` keeps the same `nn.Linear` parameters as `Model`.",
         SOLUTION, None),
    ]),
    (6, [
        ("One program per row: load the whole row in one block and reduce it with `tl.sum`.",
         ROWSUM_NO_KEEPDIM, "incorrect"),
        ("The values were right but the shape was not: the reference keeps the reduced "
         "dimension (`keepdim=True`), so the output must have shape (rows, 1). I also loop over "
         "the columns in blocks of at most 1024, so long rows do not need one huge block, and "
         "accept any leading shape.", SOLUTION, None),
    ]),
    (7, [
        ("An embedding lookup is a gather: one program per id loads the id and copies that row "
         "of the table to the output.", EMBEDDING_WRONG_DTYPE, "incorrect"),
        ("The output was allocated with the dtype of `ids` (int64) instead of the table's "
         "float dtype. It now takes the table's dtype and device; the row offset is computed "
         "in int64, the embedding dimension is walked in blocks, and an empty `ids` is "
         "handled.", SOLUTION, None),
    ]),
    (8, [
        ("One program per row: compute the mean and the biased variance, then normalise.",
         LAYERNORM_NO_AFFINE, "incorrect"),
        ("I forgot the learned affine transform: LayerNorm returns `normalised * weight + bias`, "
         "and this task initialises weight and bias to non-trivial values. `ModelNew` now "
         "creates and initialises its `nn.LayerNorm` exactly like `Model`, and the kernel loads "
         "the weight and bias and applies them before the store.", SOLUTION, None),
    ]),
]


def answer(prose: str, code: str) -> str:
    return f"{prose}\n\n```python\n{code.rstrip()}\n```"


def build(device: str) -> list[dict]:
    from drkernel.evaluator import EvalConfig, Evaluator

    tasks = {t.problem_id: t for t in load_bundled()}
    rows = []
    with Evaluator(EvalConfig(device=device)) as ev, tempfile.TemporaryDirectory() as tmp:
        for conv_id, (pid, turns) in enumerate(CONVERSATIONS):
            task = tasks[pid]
            solution = bundled_solution(task).read_text()
            messages = first_turn_messages(task)
            verdicts = []
            for turn, (prose, code, expected) in enumerate(turns, start=1):
                code = solution if code is SOLUTION else code
                messages.append({"role": "assistant", "content": answer(prose, code)})
                result = ev.evaluate(task.write(tmp), code).to_dict()
                verdicts.append(result["verdict"])
                final = turn == len(turns)
                want = "correct" if final else expected
                if want is not None and result["verdict"] != want:
                    raise SystemExit(f"conversation {conv_id} ({task.name}) turn {turn}: expected "
                                     f"{want}, the evaluator said {result['verdict']}: {result.get('error')}")
                if not final:
                    messages.append({"role": "user", "content": feedback_message(result, turn)})
                print(f"[{conv_id}] {task.name} turn {turn}: {result['verdict']} "
                      f"speedup={result.get('speedup')} hacks={result.get('hacks')}")
            rows.append({"messages": messages, "task": task.name, "level": task.level,
                         "problem_id": task.problem_id, "turns": len(turns), "verdicts": verdicts,
                         "evaluated_on": device})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=str(HERE / "conversations.jsonl"))
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    rows = build(args.device)
    with open(args.out, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} conversations to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
