import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def gather_rows_kernel(ids_ptr, table_ptr, out_ptr, dim, BLOCK_D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(ids_ptr + i).to(tl.int64)
    for d0 in range(0, dim, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = cols < dim
        v = tl.load(table_ptr + row * dim + cols, mask=mask, other=0.0)
        tl.store(out_ptr + i * dim + cols, v, mask=mask)


class ModelNew(nn.Module):
    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(num_embeddings, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).contiguous()
        table = self.table.contiguous()
        n, dim = flat.numel(), table.shape[1]
        out = torch.empty((n, dim), device=table.device, dtype=table.dtype)
        if n:
            block = min(1024, triton.next_power_of_2(dim))
            gather_rows_kernel[(n,)](flat, table, out, dim, BLOCK_D=block)
        return out.reshape(*ids.shape, dim)
