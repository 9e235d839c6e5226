import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def linear_bias_relu_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # y = relu(x @ w.T + bias); x (M, K), w (N, K) (nn.Linear layout), y (M, N), row-major.
    # 2-D grid: axis 0 over row tiles, axis 1 over column tiles.
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + ks
        a = tl.load(x_ptr + rows64[:, None] * K + kk[None, :],
                    mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
        # a (BK, BN) tile of w.T: element (k, n) is w[n, k]
        b = tl.load(w_ptr + cols64[None, :] * K + kk[:, None],
                    mask=(kk[:, None] < K) & (cols[None, :] < N), other=0.0)
        # the reference runs with TF32 off: full-precision fp32 products
        acc = tl.dot(a, b, acc, input_precision="ieee")
    acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0)[None, :]
    tl.store(y_ptr + rows64[:, None] * N + cols64[None, :], tl.maximum(acc, 0.0),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


class ModelNew(nn.Module):
    """GEMM (no bias) + bias add + ReLU in one Triton kernel; same parameters as the reference."""

    def __init__(self, in_features, out_features, bias_shape):
        super(ModelNew, self).__init__()
        self.gemm = nn.Linear(in_features, out_features, bias=False)
        self.bias = nn.Parameter(torch.randn(bias_shape))

    def forward(self, x):
        x = x.contiguous()
        w = self.gemm.weight.contiguous()
        bias = self.bias.contiguous()
        M, K = x.shape
        N = w.shape[0]
        y = torch.empty((M, N), device=x.device, dtype=torch.float32)
        grid = (triton.cdiv(M, 64), triton.cdiv(N, 64))
        linear_bias_relu_kernel[grid](x, w, bias, y, M, N, K, BM=64, BN=64, BK=32, num_warps=4, num_stages=3)
        return y
