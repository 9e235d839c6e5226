import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def sum_dim_kernel(x_ptr, out_ptr, R, inner, BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr):
    # x viewed as (outer, R, inner) contiguous; out (outer, inner). 128*4096*4095 > 2^31: int64.
    pid_i = tl.program_id(0)
    o = tl.program_id(1).to(tl.int64)
    cols = pid_i.to(tl.int64) * BLOCK_I + tl.arange(0, BLOCK_I)
    cmask = cols < inner
    base = o * R * inner
    acc = tl.zeros((BLOCK_R, BLOCK_I), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
        ptrs = x_ptr + base + r[:, None] * inner + cols[None, :]
        acc += tl.load(ptrs, mask=(r[:, None] < R) & cmask[None, :], other=0.0).to(tl.float32)
    tl.store(out_ptr + o * inner + cols, tl.sum(acc, axis=0), mask=cmask)


class ModelNew(nn.Module):
    def __init__(self, dim: int):
        super(ModelNew, self).__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        d = self.dim % x.dim()
        shape = list(x.shape)
        R = shape[d]
        outer = 1
        for s in shape[:d]:
            outer *= s
        inner = 1
        for s in shape[d + 1:]:
            inner *= s
        out_shape = shape[:d] + [1] + shape[d + 1:]
        out = torch.empty(out_shape, device=x.device, dtype=x.dtype)
        grid = lambda meta: (triton.cdiv(inner, meta["BLOCK_I"]), outer)
        sum_dim_kernel[grid](x, out, R, inner, BLOCK_I=128, BLOCK_R=16, num_warps=4)
        return out
