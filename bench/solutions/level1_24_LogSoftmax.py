import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def log_softmax_row_kernel(x_ptr, y_ptr, n_cols, row_stride, BLOCK: tl.constexpr):
    # One program per row. Rows are long (393216 floats), so the row is streamed twice:
    # pass 1 keeps a scalar running max `m` and the sum `s` of exp(x - m), rescaling `s`
    # whenever the max grows (online softmax); pass 2 writes x - m - log(s).
    row_start = tl.program_id(0).to(tl.int64) * row_stride
    lanes = tl.arange(0, BLOCK)
    m = -float("inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK):
        idx = start + lanes
        v = tl.load(x_ptr + row_start + idx, mask=idx < n_cols, other=-float("inf")).to(tl.float32)
        m_next = tl.maximum(m, tl.max(v, axis=0))  # finite: every block holds a real column
        s = s * tl.exp(m - m_next) + tl.sum(tl.exp(v - m_next), axis=0)
        m = m_next
    shift = m + tl.log(s)
    for start in range(0, n_cols, BLOCK):
        idx = start + lanes
        keep = idx < n_cols
        v = tl.load(x_ptr + row_start + idx, mask=keep, other=0.0).to(tl.float32)
        tl.store(y_ptr + row_start + idx, v - shift, mask=keep)


class ModelNew(nn.Module):
    def __init__(self, dim: int = 1):
        super(ModelNew, self).__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the problem is 2-D with dim=1 (the last dim); move any other dim last
        moved = x.movedim(self.dim, -1).contiguous()
        n_cols = moved.shape[-1]
        rows = moved.numel() // max(1, n_cols)
        y = torch.empty_like(moved)
        block = min(4096, triton.next_power_of_2(n_cols))
        log_softmax_row_kernel[(rows,)](moved, y, n_cols, n_cols, BLOCK=block, num_warps=8)
        return y.movedim(-1, self.dim)
