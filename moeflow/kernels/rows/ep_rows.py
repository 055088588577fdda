"""Packed-row kernels of the expert-parallel dispatchers (rows: moeflow/dispatch/_ep_rows.py).

A packed buffer is uint8 [M, row_bytes]; RowCodec.unpack gives strided views of it (a ``Rows``): ids int32 [M, K],
weights float32 [M, K], scale float32 [M, G] or None, hidden words [M, Wd] (int64 / int32 / int16 / uint8:
RowCodec.word). The kernels take those views as they are (each with its row stride, in elements) and do in one
launch what took a chain of small torch ops. Launchers (contracts: their docstrings; torch references:
dispatch/_ep_reference.py): pack_rows (tokens into send rows), rank_rows (where each token goes), blank_rows (the
unused tail of fixed blocks), masked_scatter (received copies into a masked batch's slabs).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..common import cdiv, next_pow2, unit_stride_rows

if TYPE_CHECKING:
    from ...dispatch.packed import Rows

_PAD_ROWS = 64  # padding rows per program of pack_rows


def _block(n: int, most: int = 1024) -> int:
    return min(most, next_pow2(max(n, 1)))


def _check_rows(rows: Rows) -> None:
    views = [rows.ids, rows.weights, rows.hidden] + ([] if rows.scale is None else [rows.scale])
    if any(v.dim() != 2 or (v.shape[1] > 1 and v.stride(1) != 1) for v in views):
        raise ValueError("Rows views must be 2-D with contiguous columns (RowCodec.unpack)")


# ---------------------------------------------------------------- pack_rows
@triton.jit
def _pack_rows_kernel(tokens_ptr, tscale_ptr, ids_ptr, w_ptr, dest_ptr, rank_ptr, local_ptr,
                      out_ids_ptr, out_w_ptr, out_scale_ptr, out_hidden_ptr,
                      num_dest, num_pairs, num_rows, pad_from, words,
                      stride_tok, stride_tscale, stride_ids, stride_w,
                      stride_oids, stride_ow, stride_oscale, stride_oh,
                      table_ptr, row_bytes, ids_at, w_at, scale_at, hidden_at,
                      TOP_K: tl.constexpr, GROUPS: tl.constexpr, REMAP: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr,
                      BLOCK_P: tl.constexpr, TABLE: tl.constexpr):
    """Programs 0 .. T*D-1: pair (t, d) = divmod(pid, D), written to row dest_pos[t, d] if >= 0: of
    the out views, or with TABLE of the rows starting at address table[d] (row_bytes apart, the
    fields at the given byte offsets). The rest: BLOCK_P padding rows each, from pad_from."""
    pid = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < TOP_K
    if pid < num_pairs:
        t = pid // num_dest
        row = tl.load(dest_ptr + pid)  # dest_pos is contiguous: pair (t, d) at t * D + d
        if row >= 0:
            if TABLE:
                base = tl.load(table_ptr + pid % num_dest).to(tl.pointer_type(tl.uint8)) + row * row_bytes
                o_ids = (base + ids_at).to(tl.pointer_type(tl.int32), bitcast=True)
                o_w = (base + w_at).to(tl.pointer_type(tl.float32), bitcast=True)
                o_scale = (base + scale_at).to(tl.pointer_type(tl.float32), bitcast=True)
                o_hidden = (base + hidden_at).to(tokens_ptr.dtype, bitcast=True)
            else:
                o_ids = out_ids_ptr + row * stride_oids
                o_w = out_w_ptr + row * stride_ow
                o_scale = out_scale_ptr + row * stride_oscale
                o_hidden = out_hidden_ptr + row * stride_oh
            ids = tl.load(ids_ptr + t * stride_ids + kk, mask=k_ok, other=-1)
            w = tl.load(w_ptr + t * stride_w + kk, mask=k_ok, other=0.0)
            if REMAP:
                known = k_ok & (ids >= 0)
                keep = known & (tl.load(rank_ptr + ids, mask=known, other=-1) == pid % num_dest)
                ids = tl.where(keep, tl.load(local_ptr + ids, mask=keep, other=-1), -1).to(tl.int32)
                w = tl.where(keep, w, 0.0)
            tl.store(o_ids + kk, ids, mask=k_ok)
            tl.store(o_w + kk, w, mask=k_ok)
            if GROUPS > 0:
                gg = tl.arange(0, BLOCK_G)
                s = tl.load(tscale_ptr + t * stride_tscale + gg, mask=gg < GROUPS)
                tl.store(o_scale + gg, s, mask=gg < GROUPS)
            for c0 in range(0, words, BLOCK_W):
                cols = c0 + tl.arange(0, BLOCK_W)
                x = tl.load(tokens_ptr + t * stride_tok + cols, mask=cols < words)
                tl.store(o_hidden + cols, x, mask=cols < words)
    else:
        rows = pad_from + (pid - num_pairs) * BLOCK_P + tl.arange(0, BLOCK_P)
        ok = (rows < num_rows)[:, None] & k_ok[None, :]
        tl.store(out_ids_ptr + rows[:, None] * stride_oids + kk[None, :],
                 tl.full((BLOCK_P, BLOCK_K), -1, tl.int32), mask=ok)
        tl.store(out_w_ptr + rows[:, None] * stride_ow + kk[None, :],
                 tl.zeros((BLOCK_P, BLOCK_K), tl.float32), mask=ok)


def pack_rows(out: Rows, tokens: Tensor, scale: Tensor | None, ids: Tensor, weights: Tensor,
              dest_pos: Tensor, expert_rank: Tensor | None = None, expert_local: Tensor | None = None,
              pad_from: int | None = None, table: Tensor | None = None) -> None:
    """Write tokens into the rows of a send buffer ``out``, one row per (token, destination): row dest_pos[t, d]
    (-1: not sent) gets token t's words, scale, ids and weights. With expert_rank / expert_local, destination d gets
    ids ``expert_local[id]`` where ``expert_rank[id] == d``, else -1, and weights where kept, else 0.0 (without
    them ids and weights are copied as they are). Rows pad_from .. M-1 get ids -1, weights 0 (padding). One
    launch, no host synchronization. Torch reference (the dispatchers' path off CUDA):
    dispatch/_ep_reference.pack_rows_torch.

    out: Rows of M rows; tokens [T, Wd] out.hidden's word dtype; scale [T, G] float32 | None (None
    iff out.scale is None); ids [T, K] int32; weights [T, K] float32; dest_pos [T, D] int64;
    expert_rank, expert_local [E] int64 or both None (D is then 1); ids in 0 .. E-1 (negative ones
    are never kept). dest_pos names each row at most once, all below pad_from; rows below pad_from
    that it does not name are left as they are.

    table [D] int64 (peer-to-peer dispatch): destination d's rows start at address table[d], in
    out's row layout (out is then only the template: its row stride and field offsets); dest_pos
    counts rows from there; no padding rows (pad_from must be None).
    """
    _check_rows(out)
    if (scale is None) != (out.scale is None) or (expert_rank is None) != (expert_local is None):
        raise ValueError("scale must be given iff out.scale is; expert_rank and expert_local together")
    if tokens.dtype != out.hidden.dtype:
        raise ValueError(f"tokens are {tokens.dtype} words, out.hidden {out.hidden.dtype}")
    m, k = out.ids.shape
    t, d = dest_pos.shape
    words = out.hidden.shape[1]
    groups = 0 if scale is None else scale.shape[1]
    pads = 0 if pad_from is None or pad_from >= m else cdiv(m - pad_from, _PAD_ROWS)
    if t * d + pads == 0:
        return
    tokens, ids, weights, dest_pos = tokens.contiguous(), ids.contiguous(), weights.contiguous(), dest_pos.contiguous()
    scale = out.weights if scale is None else scale.contiguous()  # unused pointer when G == 0
    remap = expert_rank is not None
    rank, local = (expert_rank.contiguous(), expert_local.contiguous()) if remap else (dest_pos, dest_pos)
    out_scale = out.weights if out.scale is None else out.scale
    if table is not None and (pad_from is not None or table.shape != (d,) or table.dtype != torch.int64):
        raise ValueError(f"table must be int64 [D={d}] and pad_from None, got {tuple(table.shape)} {table.dtype}")
    at = [v.data_ptr() - out.ids.data_ptr() for v in (out.ids, out.weights, out_scale, out.hidden)]
    _pack_rows_kernel[(t * d + pads,)](
        tokens, scale, ids, weights, dest_pos, rank, local,
        out.ids, out.weights, out_scale, out.hidden,
        d, t * d, m, 0 if pad_from is None else pad_from, words,
        tokens.stride(0), scale.stride(0), ids.stride(0), weights.stride(0),
        out.ids.stride(0), out.weights.stride(0), out_scale.stride(0), out.hidden.stride(0),
        dest_pos if table is None else table, out.ids.stride(0) * 4, *at,
        TOP_K=k, GROUPS=groups, REMAP=remap, BLOCK_K=_block(k), BLOCK_G=_block(groups), BLOCK_W=_block(words),
        BLOCK_P=_PAD_ROWS, TABLE=table is not None)


# ---------------------------------------------------------------- rank_rows
@triton.jit
def _need_block(ids_ptr, rank_ptr, tt, ok, stride_ids, ww, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                W_POW2: tl.constexpr):
    """-> (need [BLOCK_T, W_POW2] int32: token tt goes to rank w, copies [W_POW2] int32 of the block)."""
    need = tl.zeros((BLOCK_T, W_POW2), tl.int32)
    copies = tl.zeros((W_POW2,), tl.int32)
    for k in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + tt * stride_ids + k, mask=ok, other=0)
        r = tl.load(rank_ptr + e, mask=ok, other=-1)
        hit = (r[:, None] == ww[None, :]).to(tl.int32)
        need = tl.maximum(need, hit)
        copies += tl.sum(hit, axis=0)
    return need, copies


@triton.jit
def _rank_count_kernel(ids_ptr, rank_ptr, table_ptr, T, W, stride_ids,
                       TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, W_POW2: tl.constexpr):
    """Program b (tokens b*BLOCK_T ..): table[b, w] = (rows, copies) it sends to rank w."""
    b = tl.program_id(0)
    ww = tl.arange(0, W_POW2)
    tt = b.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    need, copies = _need_block(ids_ptr, rank_ptr, tt, tt < T, stride_ids, ww, TOP_K, BLOCK_T, W_POW2)
    tl.store(table_ptr + (b * W + ww) * 2, tl.sum(need, axis=0).to(tl.int64), mask=ww < W)
    tl.store(table_ptr + (b * W + ww) * 2 + 1, copies.to(tl.int64), mask=ww < W)


@triton.jit
def _rank_rows_kernel(ids_ptr, rank_ptr, table_ptr, counts_ptr, home_ptr, T, W, num_blocks, stride_ids, block_rows,
                      TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, W_POW2: tl.constexpr, B_POW2: tl.constexpr):
    """Program b: numbers its tokens' rows for each rank, after the rows of earlier ranks (all
    tokens; or rank * block_rows when block_rows > 0) and of earlier blocks (this rank); program 0
    writes counts."""
    b = tl.program_id(0)
    ww = tl.arange(0, W_POW2)
    bb = tl.arange(0, B_POW2)
    cell = (bb[:, None] < num_blocks) & (ww < W)[None, :]
    rows_bw = tl.load(table_ptr + (bb[:, None] * W + ww[None, :]) * 2, mask=cell, other=0)  # [B, W]
    rows = tl.sum(rows_bw, axis=0)  # [W] rows sent to each rank
    if b == 0:
        tl.store(counts_ptr + ww * 2, rows, mask=ww < W)
        copies = tl.sum(tl.load(table_ptr + (bb[:, None] * W + ww[None, :]) * 2 + 1, mask=cell, other=0), axis=0)
        tl.store(counts_ptr + ww * 2 + 1, copies, mask=ww < W)
    before = tl.sum(tl.where((bb < b)[:, None], rows_bw, 0), axis=0)  # this rank's rows of earlier blocks
    start = tl.where(block_rows > 0, ww.to(tl.int64) * block_rows, tl.cumsum(rows, axis=0) - rows) + before
    tt = b.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = tt < T
    need, _ = _need_block(ids_ptr, rank_ptr, tt, ok, stride_ids, ww, TOP_K, BLOCK_T, W_POW2)
    pos = start[None, :] + tl.cumsum(need, axis=0).to(tl.int64) - 1
    tl.store(home_ptr + tt[:, None] * W + ww[None, :], tl.where(need > 0, pos, -1), mask=ok[:, None] & (ww < W)[None, :])


_RANK_TABLE = 4096  # most (block, rank) cells one program sums


def rank_rows(topk_ids: Tensor, expert_rank: Tensor, world: int, block: int = 0) -> tuple[Tensor, Tensor]:
    """Where each token goes (alltoall): topk_ids [T, K] int32, expert_rank [E] int64 -> (counts [W, 2] int64:
    rows and copies sent to each rank, home [T, W] int64: row of token t in the send buffer for rank r, grouped by
    destination, tokens ascending; -1 if not sent). Rank r's rows start after the rows of ranks < r, or with
    block > 0 at r * block (alltoall-fixed's blocks). Two launches over token blocks (count, then number), no host
    sync. Torch reference: dispatch/_ep_reference.rank_rows_torch."""
    t, k = topk_ids.shape
    dev = topk_ids.device
    counts = torch.empty((world, 2), dtype=torch.int64, device=dev)
    home = torch.empty((t, world), dtype=torch.int64, device=dev)
    ids = unit_stride_rows(topk_ids)
    w_pow2 = next_pow2(world)
    block_t = max(16, min(1024 // w_pow2, _block(t)))
    while cdiv(t, block_t) * w_pow2 > _RANK_TABLE:  # keep the block table small
        block_t *= 2
    blocks = max(1, cdiv(t, block_t))
    table = torch.empty((blocks, world, 2), dtype=torch.int64, device=dev)
    _rank_count_kernel[(blocks,)](ids, expert_rank, table, t, world, ids.stride(0),
                                  TOP_K=k, BLOCK_T=block_t, W_POW2=w_pow2)
    _rank_rows_kernel[(blocks,)](ids, expert_rank, table, counts, home, t, world, blocks, ids.stride(0), block,
                                 TOP_K=k, BLOCK_T=block_t, W_POW2=w_pow2, B_POW2=next_pow2(blocks))
    return counts, home


# ---------------------------------------------------------------- blank_rows
@triton.jit
def _blank_rows_kernel(buf_ptr, blank_ptr, counts_ptr, table_ptr, capacity, words,
                       BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, TABLE: tl.constexpr):
    """Program (b, d): rows b*BLOCK_R .. of block d that lie at or past counts[d] get the blank row.
    Block d is rows d*capacity .. of buf, or with TABLE the rows starting at address table[d]."""
    b = tl.program_id(0)
    d = tl.program_id(1).to(tl.int64)
    used = tl.load(counts_ptr + d)
    r = b * BLOCK_R + tl.arange(0, BLOCK_R)
    if b * BLOCK_R + BLOCK_R > used:  # else every row of this tile holds a token
        blank = (r >= used) & (r < capacity)
        if TABLE:
            buf_ptr = tl.load(table_ptr + d).to(tl.pointer_type(tl.int32))
            rows = r.to(tl.int64)
        else:
            rows = d * capacity + r
        for c0 in range(0, words, BLOCK_W):
            cols = c0 + tl.arange(0, BLOCK_W)
            v = tl.load(blank_ptr + cols, mask=cols < words)
            tl.store(buf_ptr + rows[:, None] * words + cols[None, :], tl.broadcast_to(v[None, :], (BLOCK_R, BLOCK_W)),
                     mask=blank[:, None] & (cols < words)[None, :])


def blank_rows(buf: Tensor, counts: Tensor, capacity: int, blank: Tensor, table: Tensor | None = None) -> None:
    """The unused tail of each block of a send buffer in fixed blocks (alltoall-fixed): buf uint8 [W * C,
    row_bytes] (contiguous, row_bytes a multiple of 4), counts [W] int64 (rows used in block d), blank uint8
    [row_bytes] -> rows d*C + counts[d] .. (d+1)*C - 1 become ``blank`` (RowCodec.blank_row: ids -1, weights,
    scales and token 0), in place; one launch, no host synchronization.
    table [W] int64 (peer-to-peer dispatch): block d is the C rows from address table[d] instead;
    buf then only gives the row size. Torch reference: dispatch/_ep_reference.blank_rows_torch."""
    m, row_bytes = buf.shape
    world = counts.shape[0]
    if table is not None:
        m = world * capacity
        if table.shape != (world,) or table.dtype != torch.int64:
            raise ValueError(f"table must be int64 [W={world}], got {tuple(table.shape)} {table.dtype}")
    if m != world * capacity or row_bytes % 4 or not buf.is_contiguous():
        raise ValueError(f"buf {tuple(buf.shape)} must be contiguous [W * C, row_bytes] with W={world}, "
                         f"C={capacity}, row_bytes a multiple of 4")
    if m == 0:
        return
    words = row_bytes // 4
    block_r = 16
    _blank_rows_kernel[(cdiv(capacity, block_r), world)](
        buf.view(torch.int32), blank.view(torch.int32), counts.contiguous(), counts if table is None else table,
        capacity, words, BLOCK_R=block_r, BLOCK_W=_block(words, 256), TABLE=table is not None)


# ---------------------------------------------------------------- masked_scatter
@triton.jit
def _copy_slots_kernel(experts_ptr, slot_ptr, counts_ptr, w_slab_ptr, num_copies, e_local, capacity,
                       BLOCK: tl.constexpr):
    """Program e < E_local: slots of expert e's copies (a running count in j order), counts[e], and
    weights 0 in its empty slots. Program E_local: copy_slot -1 for the copies not here."""
    e = tl.program_id(0)
    here = e < e_local
    base = e.to(tl.int64) * capacity
    total = 0
    for j0 in range(0, num_copies, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        hit = (tl.load(experts_ptr + j, mask=j < num_copies, other=-1) == e).to(tl.int32)
        pos = total + tl.cumsum(hit, axis=0) - 1
        tl.store(slot_ptr + j, tl.where(here, base + pos, -1), mask=hit != 0)
        total += tl.sum(hit, axis=0)
    if here:
        tl.store(counts_ptr + e, total)
        for c0 in range(0, capacity, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            tl.store(w_slab_ptr + base + c, tl.zeros((BLOCK,), tl.float32), mask=(c >= total) & (c < capacity))


@triton.jit
def _scatter_rows_kernel(slot_ptr, w_ptr, scale_ptr, hidden_ptr, w_slab_ptr, scale_slab_ptr, hidden_slab_ptr,
                         words, stride_w, stride_scale, stride_h,
                         TOP_K: tl.constexpr, GROUPS: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr):
    """Program r: row r read once, written to the slot of each of its K copies that is here."""
    r = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    slots = tl.load(slot_ptr + r * TOP_K + kk, mask=kk < TOP_K, other=-1)
    here = slots >= 0
    if tl.max(slots, axis=0) >= 0:
        tl.store(w_slab_ptr + slots, tl.load(w_ptr + r * stride_w + kk, mask=here), mask=here)
        if GROUPS > 0:
            gg = tl.arange(0, BLOCK_G)
            s = tl.load(scale_ptr + r * stride_scale + gg, mask=gg < GROUPS)
            tl.store(scale_slab_ptr + slots[:, None] * GROUPS + gg[None, :],
                     tl.broadcast_to(s[None, :], (BLOCK_K, BLOCK_G)), mask=here[:, None] & (gg < GROUPS)[None, :])
        for c0 in range(0, words, BLOCK_W):
            cols = c0 + tl.arange(0, BLOCK_W)
            x = tl.load(hidden_ptr + r * stride_h + cols, mask=cols < words)
            for k in tl.static_range(TOP_K):
                slot = tl.load(slot_ptr + r * TOP_K + k)
                tl.store(hidden_slab_ptr + slot * words + cols, x, mask=(cols < words) & (slot >= 0))


def masked_scatter(rows: Rows, experts: Tensor, e_local: int,
                   capacity: int) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor]:
    """The copies of received rows into a masked batch's slabs, as masked_batch does. rows: R received rows;
    experts [R*K] int64: local expert of copy j (of row j // K), e_local for copies not here
    -> (hidden [E_local, capacity, Wd] words, weights [E_local, capacity] float32, scale [E_local, capacity, G]
    float32 | None, counts [E_local] int32, copy_slot [R*K] int64: e*C + position of the copy among its expert's
    copies in j order; -1 for copies not here). Empty slots: weights 0, hidden / scale unspecified. Two launches,
    no host synchronization (CUDA-graph capturable). Torch reference: dispatch/_ep_reference.masked_batch_torch.

    The caller guarantees no expert receives more than ``capacity`` copies.
    """
    _check_rows(rows)
    r, k = rows.ids.shape
    words = rows.hidden.shape[1]
    dev = experts.device
    experts = experts.contiguous()
    hidden = torch.empty((e_local, capacity, words), dtype=rows.hidden.dtype, device=dev)
    weights = torch.empty((e_local, capacity), dtype=torch.float32, device=dev)
    scale = None if rows.scale is None else torch.empty((e_local, capacity, rows.scale.shape[1]),
                                                       dtype=torch.float32, device=dev)
    counts = torch.empty(e_local, dtype=torch.int32, device=dev)
    copy_slot = torch.empty(r * k, dtype=torch.int64, device=dev)
    _copy_slots_kernel[(e_local + 1,)](experts, copy_slot, counts, weights, r * k, e_local, capacity,
                                       BLOCK=_block(max(r * k, capacity)))
    if r:
        groups = 0 if scale is None else scale.shape[2]
        src_scale, slab_scale = (weights, weights) if scale is None else (rows.scale, scale)  # unused when G == 0
        _scatter_rows_kernel[(r,)](copy_slot, rows.weights, src_scale, rows.hidden, weights, slab_scale, hidden,
                                   words, rows.weights.stride(0), src_scale.stride(0), rows.hidden.stride(0),
                                   TOP_K=k, GROUPS=groups, BLOCK_K=_block(k), BLOCK_G=_block(groups),
                                   BLOCK_W=_block(words))
    return hidden, weights, scale, counts, copy_slot
