import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def l2_normalize_kernel(x_ptr, y_ptr, n_cols, BLOCK: tl.constexpr):
    # x is (rows, n_cols) contiguous; y = x / ||x||_2 along each row. One program per row:
    # pass 1 accumulates squares lane-wise (summed once at the end, better rounding than a
    # scalar running sum), pass 2 scales by the reciprocal norm.
    base = tl.program_id(0).to(tl.int64) * n_cols
    offs = tl.arange(0, BLOCK)
    sq = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, n_cols, BLOCK):
        cols = c + offs
        v = tl.load(x_ptr + base + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        sq += v * v
    inv_norm = 1.0 / tl.sqrt(tl.sum(sq, axis=0))
    for c in range(0, n_cols, BLOCK):
        cols = c + offs
        inside = cols < n_cols
        v = tl.load(x_ptr + base + cols, mask=inside, other=0.0)
        tl.store(y_ptr + base + cols, v * inv_norm, mask=inside)


class ModelNew(nn.Module):
    def __init__(self):
        super(ModelNew, self).__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the reference normalises over dim 1 of a 2-D input
        x = x.contiguous()
        rows, n_cols = x.shape
        y = torch.empty_like(x)
        block = min(8192, triton.next_power_of_2(n_cols))
        l2_normalize_kernel[(rows,)](x, y, n_cols, BLOCK=block, num_warps=8)
        return y
