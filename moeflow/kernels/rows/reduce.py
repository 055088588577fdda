"""The top-k reduction: each token's output is the sum of its K (already weighted) expert copies.

    y [N, H] runner output in sorted order; row_of_copy [T * K] int64: the row of y holding copy
    k of token t at t * K + k (-1: the copy was not computed here, it counts as zero)
    -> out [T, H] y.dtype, summed in float32 in k order (0 .. K-1).
Kernel: _moe_sum_kernel; launchers: moe_sum, and moe_sum_to, which stores its rows through a table of addresses
(alltoall-p2p: each partial sum straight into its home rank's buffer). Torch reference: moe_sum_torch.
One pass over y instead of torch's scatter + float copy + sum (three passes and a float32 [N, H] temporary); a
dispatcher's combine calls it (the local one gets row_of_copy as the inverse of its sort order).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..common import cdiv, next_pow2, pdl, pdl_start


@triton.jit
def _moe_sum_kernel(y_ptr, row_ptr, out_ptr, table_ptr, num_dest, rows_per_dest, H, stride_y, stride_out,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, TABLE: tl.constexpr = False,
                    PDL: tl.constexpr = False):
    """Program (t, j): output row t's columns j * BLOCK_H .. (module docstring); TABLE: moe_sum_to's addressing."""
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    if TABLE:
        # row t goes to row p of the rows at address table[d], t = d * rows_per_dest + p; programs take
        # the destinations in turn (d = pid % D) so stores to peers and to this GPU run side by side
        d = t % num_dest
        out_row = t // num_dest
        t = d * rows_per_dest + out_row
        out_ptr = tl.load(table_ptr + d).to(tl.pointer_type(y_ptr.dtype.element_ty))
    else:
        out_row = t
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        row = tl.load(row_ptr + t * TOP_K + k)
        acc += tl.load(y_ptr + row * stride_y + cols, mask=ok & (row >= 0), other=0.0).to(tl.float32)
    tl.store(out_ptr + out_row * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def moe_sum(y: Tensor, row_of_copy: Tensor, top_k: int) -> Tensor:
    """y [N, H], row_of_copy [T * top_k] int64 -> [T, H] y.dtype (module docstring)."""
    t = row_of_copy.numel() // top_k
    h = y.shape[1]
    out = torch.empty((t, h), dtype=y.dtype, device=y.device)
    if t == 0 or h == 0:
        return out.zero_()
    block_h = min(1024, next_pow2(h))
    _moe_sum_kernel[(t, cdiv(h, block_h))](y, row_of_copy.contiguous(), out, out, 1, 1, h, y.stride(0), out.stride(0),
                                                   TOP_K=top_k, BLOCK_H=block_h, **pdl(y.device))
    return out


def moe_sum_to(y: Tensor, row_of_copy: Tensor, top_k: int, table: Tensor, rows_per_dest: int) -> None:
    """moe_sum whose output row t = d * rows_per_dest + p is stored at row p of the contiguous [*, H]
    y.dtype rows starting at address table[d] (table [D] int64, T = D * rows_per_dest: the peer-to-peer
    combine writes each rank's partial sums straight into that rank's receive buffer). Plain launch:
    the rows may live on other GPUs."""
    t = row_of_copy.numel() // top_k
    h = y.shape[1]
    if table.dtype != torch.int64 or table.dim() != 1 or t != table.shape[0] * rows_per_dest:
        raise ValueError(f"table must be int64 [D] with D * {rows_per_dest} = {t} rows")
    if t == 0 or h == 0:
        return
    block_h = min(1024, next_pow2(h))
    _moe_sum_kernel[(t, cdiv(h, block_h))](y, row_of_copy.contiguous(), y, table, table.shape[0], rows_per_dest, h,
                                                   y.stride(0), h, TOP_K=top_k, BLOCK_H=block_h, TABLE=True)


def moe_sum_torch(y: Tensor, row_of_copy: Tensor, top_k: int) -> Tensor:
    """Reference of moe_sum."""
    rows = row_of_copy.view(-1, top_k)
    picked = torch.where((rows >= 0)[..., None], y.float()[rows.clamp(min=0)], 0.0)
    acc = torch.zeros(rows.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
    for k in range(top_k):
        acc += picked[:, k]
    return acc.to(y.dtype)
