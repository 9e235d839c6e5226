import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def scale_leaky_relu_kernel(y_ptr, out_ptr, n_elements, multiplier, negative_slope,
                            BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    y = tl.load(y_ptr + offs, mask=mask, other=0.0) * multiplier
    tl.store(out_ptr + offs, tl.where(y >= 0, y, y * negative_slope), mask=mask)


class ModelNew(nn.Module):
    """GEMM left to cuBLAS (nn.Linear), only the epilogue in Triton: a low Triton time share."""

    def __init__(self, in_features, out_features, multiplier, negative_slope):
        super(ModelNew, self).__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.multiplier = multiplier
        self.leaky_relu = nn.LeakyReLU(negative_slope)

    def forward(self, x):
        y = self.gemm(x).contiguous()
        out = torch.empty_like(y)
        n = y.numel()
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)
        scale_leaky_relu_kernel[grid](y, out, n, float(self.multiplier),
                                      float(self.leaky_relu.negative_slope), BLOCK=1024)
        return out
