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

from .common import RowLayout, block_rows, pdl, pdl_start


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


# ---------------------------------------------------------------- sort of token copies by expert
MAX_FUSED_COPIES = 2048  # sort_copies' comparison sort is O(copies^2) work: meant for decode-sized batches


@triton.jit
def _sort_copies_kernel(ids_ptr, w_ptr, offsets_ptr, counts_ptr, row_ptr, source_ptr, sorted_w_ptr, num_copies, num_experts,
                        TOP_K: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_E: tl.constexpr,
                        PDL: tl.constexpr = False):
    """Programs 0 .. cdiv(copies, BLOCK_I)-1 place copies; the rest write offsets (and counts) for
    BLOCK_E experts each.

    The sorted row of copy i is the number of copies before it in (expert, copy index) order, the
    stable sort's order: #{j : ids[j] < ids[i]} + #{j < i : ids[j] == ids[i]}.
    offsets[e] = #{j : ids[j] < e} for e in 0 .. E; counts[e] = #{j : ids[j] == e} for e in 0 .. E-1.
    """
    pdl_start(PDL)
    pid = tl.program_id(0)
    copy_blocks = tl.cdiv(num_copies, BLOCK_I)
    if pid < copy_blocks:
        i = pid * BLOCK_I + tl.arange(0, BLOCK_I)
        ok = i < num_copies
        ids_i = tl.load(ids_ptr + i, mask=ok, other=0)
        row = tl.zeros((BLOCK_I,), dtype=tl.int32)
        for j0 in range(0, num_copies, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            ids_j = tl.load(ids_ptr + j, mask=j < num_copies, other=2147483647)  # past the end: after everything
            before = (ids_j[None, :] < ids_i[:, None]) | ((ids_j[None, :] == ids_i[:, None]) & (j[None, :] < i[:, None]))
            row += tl.sum(before.to(tl.int32), axis=1)
        row64 = row.to(tl.int64)
        tl.store(row_ptr + i, row64, mask=ok)
        tl.store(source_ptr + row64, (i // TOP_K).to(tl.int64), mask=ok)
        tl.store(sorted_w_ptr + row64, tl.load(w_ptr + i, mask=ok, other=0.0), mask=ok)
    else:
        e = (pid - copy_blocks) * BLOCK_E + tl.arange(0, BLOCK_E)
        below = tl.zeros((BLOCK_E,), dtype=tl.int32)
        equal = tl.zeros((BLOCK_E,), dtype=tl.int32)
        for j0 in range(0, num_copies, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            ids_j = tl.load(ids_ptr + j, mask=j < num_copies, other=2147483647)
            below += tl.sum((ids_j[None, :] < e[:, None]).to(tl.int32), axis=1)
            equal += tl.sum((ids_j[None, :] == e[:, None]).to(tl.int32), axis=1)
        tl.store(offsets_ptr + e, below.to(tl.int64), mask=e <= num_experts)
        tl.store(counts_ptr + e, equal, mask=e < num_experts)


def sort_copies(topk_ids: Tensor, topk_weights: Tensor, num_experts: int):
    """Token copies grouped by expert in one launch (decode-sized batches: copies <= MAX_FUSED_COPIES).

    topk_ids [T, K] int (ids in 0 .. E-1), topk_weights [T, K] float32
    -> (offsets [E + 1] int64, counts [E] int32, row_of_copy [T, K] int64, source [T*K] int64,
        sorted_weights [T*K] float32):
    sorted row r holds copy order[r] (stable sort by expert), source[r] = order[r] // K its token,
    row_of_copy the inverse; the same values as its torch reference,
    moeflow.dispatch.expert_sort.sort_by_expert_torch (torch-only: the dispatcher's path without
    triton). No host synchronization.
    """
    t, k = topk_ids.shape
    n = t * k
    dev = topk_ids.device
    offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=dev)
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    row = torch.empty(n, dtype=torch.int64, device=dev)
    source = torch.empty(n, dtype=torch.int64, device=dev)
    sorted_w = torch.empty(n, dtype=torch.float32, device=dev)
    block_i, block_j, block_e = 64, 64, 64
    grid = (triton.cdiv(n, block_i) + triton.cdiv(num_experts + 1, block_e),)
    _sort_copies_kernel[grid](topk_ids.reshape(-1).to(torch.int32).contiguous(),
                              topk_weights.reshape(-1).float().contiguous(), offsets, counts, row, source, sorted_w,
                              n, num_experts, TOP_K=k, BLOCK_I=block_i, BLOCK_J=block_j, BLOCK_E=block_e,
                              **pdl(dev))
    return offsets, counts, row.view(t, k), source, sorted_w
