"""Fixed-order torch arithmetic for batch-invariant layers (MoEConfig.batch_invariant, docs/batch-invariance.md).

torch's reductions and matmuls choose their algorithm by the whole tensor's shape: a BLAS takes a matrix-vector path
for one row and a blocked one for many, a CUDA reduction splits a row over threads when there are few rows. A row's
result then depends on how many rows came with it. The functions here compute every output element from its own row
alone with elementwise IEEE operations in an order fixed by the reduced length only, so a row gives the same bits
alone, among thousands, or at any position, on any device. They are slow (products are materialized) and serve the
torch paths: the reference runner, the torch router, shared experts on the CPU. The Triton paths keep one tile and
kernel for every batch size instead (invariant_linear.py, experts/triton.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

# rows of one fixed_matmul step: bounds the materialized products to CHUNK_ELEMENTS floats
CHUNK_ELEMENTS = 1 << 24
K_BLOCK = 128  # the reduction runs over blocks of this many products, blocks summed in order
# fixed_apply on the CPU: pieces of this many elements (a multiple of every SIMD width, under torch's 32768-element
# grain, so one thread runs each), padded to a multiple of PAD
CPU_PIECE, PAD = 16384, 64


def fixed_apply(fn, x: Tensor) -> Tensor:
    """fn(x) for an elementwise ``fn`` whose every element takes the same code path wherever it sits.

    On the CPU torch runs an elementwise op's SIMD form on whole vectors and its scalar form on what is left at the end
    of each thread's range, and the two may round a transcendental (exp, tanh, erf) differently; the ranges depend on
    the tensor's size. So the values go flat, padded to a multiple of PAD, in pieces of CPU_PIECE elements that one
    thread runs as whole vectors. On CUDA every element runs the same code already."""
    if x.device.type != "cpu" or x.numel() == 0:
        return fn(x)
    flat = x.contiguous().view(-1)
    n = flat.numel()
    if n % PAD:
        flat = torch.cat([flat, flat.new_zeros(PAD - n % PAD)])
    out = torch.cat([fn(piece) for piece in flat.split(CPU_PIECE)]) if flat.numel() > CPU_PIECE else fn(flat)
    return out[:n].view(x.shape)


def fixed_gated_activation(h: Tensor, kind: str) -> Tensor:
    """experts/base.gated_activation with every element on one code path (fixed_apply): [M, 2I] -> [M, I] float32."""
    from .experts.base import activation
    gate, up = h.float().chunk(2, dim=-1)
    return fixed_apply(activation(kind), gate) * up


def fixed_sum(x: Tensor) -> Tensor:
    """Sum over the last dimension in a fixed pairwise order: [..., N] -> [...] (x's dtype).

    N is padded with zeros to a power of two, then halves are added elementwise until one column is left: the order of
    the additions depends on N alone (x + 0 is exact, so the padding changes nothing)."""
    n = x.shape[-1]
    if n == 0:
        return x.new_zeros(x.shape[:-1])
    width = 1 << (n - 1).bit_length()
    if width != n:
        x = torch.cat([x, x.new_zeros(*x.shape[:-1], width - n)], dim=-1)
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


def fixed_matmul(x: Tensor, w: Tensor) -> Tensor:
    """x [M, K] @ w[N, K]^T -> [M, N] float32, each element a fixed-order sum of its K products.

    The products of K_BLOCK columns at a time are summed by fixed_sum, the blocks' sums added in order; rows go in
    chunks of a fixed product budget. No BLAS and no torch reduction: a row's values do not depend on M or on its
    position."""
    x, w = x.float(), w.float()
    m, k = x.shape
    n = w.shape[0]
    out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0 or k == 0:
        return out
    rows = max(1, CHUNK_ELEMENTS // (n * min(k, K_BLOCK)))
    for r0 in range(0, m, rows):
        xs = x[r0:r0 + rows]
        acc = torch.zeros(xs.shape[0], n, dtype=torch.float32, device=x.device)
        for k0 in range(0, k, K_BLOCK):
            acc = acc + fixed_sum(xs[:, None, k0:k0 + K_BLOCK] * w[None, :, k0:k0 + K_BLOCK])
        out[r0:r0 + rows] = acc
    return out


def fixed_softmax(x: Tensor) -> Tensor:
    """softmax over the last dimension, its sum by fixed_sum (max and exp are elementwise-exact in any order):
    [..., N] float32 -> [..., N] float32."""
    e = fixed_apply(torch.exp, x - x.amax(dim=-1, keepdim=True))
    return e / fixed_sum(e)[..., None]


def fixed_topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest along the last dimension, largest first, ties in ascending index: (values, int64 indices).
    A stable sort, so the tie rule holds whatever the batch (torch.topk leaves ties to its algorithm)."""
    values, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], ids[..., :k]
