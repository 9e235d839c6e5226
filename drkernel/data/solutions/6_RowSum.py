import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def row_sum_kernel(x_ptr, out_ptr, n_cols, stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + row * stride_row + cols, mask=cols < n_cols, other=0.0)
    tl.store(out_ptr + row, tl.sum(acc, axis=0))


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        cols = x.shape[-1]
        x2 = x.reshape(-1, cols).contiguous()
        rows = x2.shape[0]
        out = torch.empty((rows,), device=x.device, dtype=x.dtype)
        block = min(1024, triton.next_power_of_2(cols))
        row_sum_kernel[(rows,)](x2, out, cols, x2.stride(0), BLOCK=block)
        return out.reshape(*lead, 1)
