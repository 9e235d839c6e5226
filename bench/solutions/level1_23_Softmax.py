import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def softmax_looped_kernel(x_ptr, out_ptr, n_cols, stride_row, BLOCK: tl.constexpr):
    # rows are long (393216): pass 1 keeps a per-lane running max and rescaled sum (online
    # softmax), pass 2 writes exp(x - max) / sum.
    row = tl.program_id(0).to(tl.int64)
    base = row * stride_row
    m = tl.full((BLOCK,), -float("inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + base + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # lanes that have seen only -inf so far keep s = 0 (avoid inf - inf)
        alpha = tl.where(m_new == -float("inf"), 1.0, tl.exp(m - m_new))
        p = tl.where(m_new == -float("inf"), 0.0, tl.exp(x - m_new))
        s = s * alpha + p
        m = m_new
    row_max = tl.max(m, axis=0)
    scale = tl.where(m == -float("inf"), 0.0, tl.exp(m - row_max))
    row_sum = tl.sum(s * scale, axis=0)
    inv = 1.0 / row_sum
    for c0 in range(0, n_cols, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + base + cols, mask=mask, other=-float("inf")).to(tl.float32)
        tl.store(out_ptr + base + cols, tl.exp(x - row_max) * inv, mask=mask)


class ModelNew(nn.Module):
    def __init__(self):
        super(ModelNew, self).__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        rows, cols = x.shape
        out = torch.empty_like(x)
        block = min(4096, triton.next_power_of_2(cols))
        softmax_looped_kernel[(rows,)](x, out, cols, x.stride(0), BLOCK=block, num_warps=8)
        return out
