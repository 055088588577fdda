"""The token->expert block alignment as a table, for tests and inspection.

The GEMM kernels compute their block's rows themselves (common.block_rows: one cumsum over the
experts per program, no extra launch); this kernel writes what each program sees, so the
alignment can be checked against ``align_blocks_torch``.

    table [B, 3] int64, B = RowLayout.num_row_blocks(BLOCK_M):
        table[b] = (expert, first row, end row) of block b; (-1, 0, 0) for a block with no rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import RowLayout, block_rows


@triton.jit
def _align_kernel(meta_ptr, table_ptr, num_experts, capacity,
                  BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, MASKED: tl.constexpr):
    pid = tl.program_id(0)
    expert, start, end, _ = block_rows(pid, meta_ptr, num_experts, capacity, BLOCK_M, E_POW2, MASKED)
    empty = start >= end
    tl.store(table_ptr + pid * 3, tl.where(empty, -1, expert).to(tl.int64))
    tl.store(table_ptr + pid * 3 + 1, tl.where(empty, 0, start).to(tl.int64))
    tl.store(table_ptr + pid * 3 + 2, tl.where(empty, 0, tl.minimum(start + BLOCK_M, end)).to(tl.int64))


def align_blocks(layout: RowLayout, block_m: int) -> Tensor:
    """-> table [B, 3] int64 (module docstring), computed by the kernels' own alignment code."""
    b = layout.num_row_blocks(block_m)
    table = torch.empty((b, 3), dtype=torch.int64, device=layout.meta.device)
    if b:
        _align_kernel[(b,)](layout.meta, table, layout.num_experts, max(layout.capacity, 1),
                            BLOCK_M=block_m, E_POW2=layout.e_pow2, MASKED=layout.masked)
    return table


def align_blocks_torch(layout: RowLayout, block_m: int) -> Tensor:
    """Reference of align_blocks, in Python over host counts."""
    rows = []
    if layout.masked:
        c = layout.capacity
        for e, n in enumerate(layout.meta.tolist()):
            n = min(n, c)
            for j in range(triton.cdiv(c, block_m)):
                lo = e * c + j * block_m
                rows.append((e, lo, min(lo + block_m, e * c + n)) if j * block_m < n else (-1, 0, 0))
    else:
        off = layout.meta.tolist()
        for e in range(layout.num_experts):
            for lo in range(off[e], off[e + 1], block_m):
                rows.append((e, lo, min(lo + block_m, off[e + 1])))
    b = layout.num_row_blocks(block_m)
    rows += [(-1, 0, 0)] * (b - len(rows))
    return torch.tensor(rows, dtype=torch.int64).reshape(b, 3)
