import math

import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def max_over_dim_kernel(x_ptr, y_ptr, reduce_len, inner, TILE_R: tl.constexpr, TILE_C: tl.constexpr):
    # x is viewed as (outer, reduce_len, inner) contiguous and y as (outer, inner). Each program
    # owns TILE_C neighbouring columns of one outer slice and walks down reduce_len, TILE_R rows
    # per step (coalesced loads along `inner`). 128 * 4096 * 4095 > 2^31 elements: int64 offsets.
    col_block = tl.program_id(0)
    outer_idx = tl.program_id(1).to(tl.int64)
    cols = col_block.to(tl.int64) * TILE_C + tl.arange(0, TILE_C)
    col_ok = cols < inner
    slice_ptr = x_ptr + outer_idx * reduce_len * inner
    best = tl.full((TILE_R, TILE_C), -float("inf"), dtype=tl.float32)
    for r_start in range(0, reduce_len, TILE_R):
        rs = (r_start + tl.arange(0, TILE_R)).to(tl.int64)
        tile = tl.load(slice_ptr + rs[:, None] * inner + cols[None, :],
                       mask=(rs[:, None] < reduce_len) & col_ok[None, :], other=-float("inf"))
        best = tl.maximum(best, tile.to(tl.float32))
    tl.store(y_ptr + outer_idx * inner + cols, tl.max(best, axis=0), mask=col_ok)


class ModelNew(nn.Module):
    def __init__(self, dim: int):
        super(ModelNew, self).__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        d = self.dim % x.dim()
        before, reduce_len, after = x.shape[:d], x.shape[d], x.shape[d + 1:]
        outer, inner = math.prod(before), math.prod(after)
        y = torch.empty((*before, *after), device=x.device, dtype=x.dtype)
        grid = (triton.cdiv(inner, 128), outer)
        max_over_dim_kernel[grid](x, y, reduce_len, inner, TILE_R=8, TILE_C=128, num_warps=4)
        return y
