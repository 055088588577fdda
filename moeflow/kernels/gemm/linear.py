"""A dense linear layer in one fixed tile for every batch size: out = x @ w.T, batch-invariant.

    x [M, K] (bfloat16, float16 or float32), w [N, K] the same dtype -> out [M, N] float32
Shared experts and the shared-expert gate of a batch-invariant layer (MoEConfig.batch_invariant) run here on CUDA:
torch's F.linear picks its cuBLAS kernel (tiles, split K) by M, so a row's bits would follow the batch's size. One
program a BLOCK_M x BLOCK_N tile, the K loop in order in one program (no split K), float32 accumulation (float32
operands dot in IEEE float32): every row is computed the same way at every M and position. Reference: linear_torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...invariant import fixed_matmul
from ..common import cdiv

BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 64, 128, 64, 4, 3  # one tile for every M (the point)


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * stride_xm  # rows past M read row M - 1, unstored
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_rows + kk[None, :], mask=(kk < K)[None, :], other=0.0)
        b = tl.load(w_rows + kk[None, :], mask=(kk < K)[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, acc, mask=(rm < M)[:, None] & (rn < N)[None, :])


def linear(x: Tensor, w: Tensor) -> Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] float32 with the fixed tile (module docstring); CUDA tensors, the last
    dimension contiguous."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    x, w = x.contiguous(), w.contiguous()
    _linear_kernel[(cdiv(m, BLOCK_M), cdiv(n, BLOCK_N))](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=x.dtype == torch.float32,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


def linear_torch(x: Tensor, w: Tensor) -> Tensor:
    """The reference: the same product with every element's K sum in a fixed order (moeflow.invariant.fixed_matmul),
    batch-invariant on any device, slow. -> [M, N] float32."""
    return fixed_matmul(x, w)
