"""The torch code of the expert-parallel row kernels (kernels/rows/ep_rows.py, kernels/rows/ep_sort.py): their
references in the tests, and the dispatchers' path off CUDA or without triton. Same arguments and
the same values as the kernels; packed rows as _ep_rows.RowCodec describes them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..layouts import MASKED, ExpertBatch, offsets_from_counts

if TYPE_CHECKING:
    from .packed import Rows


def pack_rows_torch(out: Rows, tokens: Tensor, scale: Tensor | None, ids: Tensor, weights: Tensor,
                    dest_pos: Tensor, expert_rank: Tensor | None = None, expert_local: Tensor | None = None,
                    pad_from: int | None = None) -> None:
    """Torch reference of kernels/rows/ep_rows.pack_rows (same arguments; it reads the number of
    (token, destination) pairs on the host): rows of ``out`` named by dest_pos [T, D] get token t,
    its scale and its routing (remapped to destination d's local ids when expert_rank / expert_local
    [E] are given); rows pad_from.. get ids -1, weights 0."""
    token, dest = torch.nonzero(dest_pos >= 0, as_tuple=True)
    row = dest_pos[token, dest]
    gid, w = ids[token], weights[token]
    if expert_rank is not None:
        g = gid.long().clamp(min=0)
        keep = (gid >= 0) & (expert_rank[g] == dest[:, None])
        gid = torch.where(keep, expert_local[g], -1).to(torch.int32)
        w = torch.where(keep, w, 0.0)
    out.ids[row] = gid
    out.weights[row] = w
    out.hidden[row] = tokens[token]
    if scale is not None:
        out.scale[row] = scale[token]
    if pad_from is not None:
        out.ids[pad_from:] = -1
        out.weights[pad_from:] = 0


def rank_rows_torch(topk_ids: Tensor, expert_rank: Tensor, world: int, block: int = 0) -> tuple[Tensor, Tensor]:
    """rank_rows in torch ops (the reference of the kernel; block > 0: rank r's rows start at r * block)."""
    t, dev = topk_ids.shape[0], topk_ids.device
    rank_of = expert_rank[topk_ids.long()]  # [T, K]
    need = torch.zeros(world, t, dtype=torch.int64, device=dev)
    need.scatter_(0, rank_of.t(), 1)  # [W, T]: token t goes to rank r
    copies = torch.zeros(world, dtype=torch.int64, device=dev)
    copies.scatter_add_(0, rank_of.flatten(), torch.ones_like(rank_of.flatten()))
    rows = need.sum(1)
    first = torch.arange(world, device=dev) * block if block else torch.cumsum(rows, 0) - rows  # [W] first row of each destination's block
    home = torch.where(need > 0, first[:, None] + need.cumsum(1) - 1, -1).t()  # scan along T (the last dim)
    return torch.stack([rows, copies], dim=1), home


def sort_copies_by_expert_torch(ids: Tensor, weights: Tensor, e_local: int,
                                n: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Torch reference of kernels/rows/ep_sort.sort_copies_by_expert: ids [R, K] (local ids, -1: not
    here), weights [R, K] float32 -> (source [n] int64 row of each sorted copy, sorted weights [n],
    counts [E_local] int32, offsets [E_local + 1] int64, copy_pos [R * K] int64, -1 if not here).
    n may exceed the copies here (an upper bound, alltoall-fixed): positions past them get source 0
    and weight 0 (``padded=True`` of the kernel). No host synchronization."""
    k = ids.shape[1]
    experts = torch.where(ids >= 0, ids, e_local).long().flatten()
    order = torch.argsort(experts, stable=True)[:n]  # grouped by local expert, in row order
    here = experts[order] < e_local
    ones = torch.ones_like(experts, dtype=torch.int32)  # (bincount would read its max on the host)
    counts = torch.zeros(e_local + 1, dtype=torch.int32, device=ids.device).scatter_add_(0, experts, ones)[:e_local]
    copy_pos = torch.full_like(experts, -1)
    copy_pos.scatter_(0, order, torch.where(here, torch.arange(n, device=ids.device), -1))
    source = torch.where(here, order // k, 0)
    sorted_w = torch.where(here, weights.reshape(-1)[order], 0.0)
    return source, sorted_w, counts, offsets_from_counts(counts), copy_pos


def blank_rows_torch(buf: Tensor, counts: Tensor, capacity: int, blank: Tensor) -> None:
    """Reference of kernels/rows/ep_rows.blank_rows: rows d*C + counts[d] .. of each block d of
    buf [W * C, row_bytes] become ``blank`` [row_bytes], in place (no host synchronization)."""
    world = counts.shape[0]
    blocks = buf.view(world, capacity, -1)
    unused = torch.arange(capacity, device=buf.device)[None, :] >= counts[:, None]
    blocks.copy_(torch.where(unused[..., None], blank, blocks))


def masked_batch_torch(codec, rows: Rows, experts: Tensor, e_local: int,
                       capacity: int) -> tuple[ExpertBatch, Tensor]:
    """masked_batch in torch ops (the reference of kernels/rows/ep_rows.masked_scatter); codec: the _ep_rows.RowCodec
    the rows were packed with."""
    k, dev = codec.top_k, experts.device
    # position of each copy among its expert's copies, in row order: a running count per expert
    # ([E_local+1, R*K] int32, a few MB at decode sizes) instead of a sort. The scan runs along the
    # last dim: along dim 0 torch scans each column serially.
    running = (torch.arange(e_local + 1, device=dev)[:, None] == experts[None, :]).to(torch.int32).cumsum(1)
    pos = running.gather(0, experts[None, :]).squeeze(0) - 1
    counts = running[:e_local, -1].to(torch.int32)
    trash = e_local * capacity
    slot = torch.where(experts < e_local, experts * capacity + pos, trash)
    row = torch.arange(experts.numel(), device=dev) // k

    def scatter(values: Tensor, fill: float | None) -> Tensor:  # values [R * K, ...]
        slab = (torch.empty if fill is None else torch.zeros)((trash + 1, *values.shape[1:]), dtype=values.dtype, device=dev)
        slab[slot] = values
        return slab[:trash].view(e_local, capacity, *values.shape[1:])

    batch = ExpertBatch(
        layout=MASKED,
        hidden=codec.as_payload(scatter(rows.hidden.index_select(0, row), None)),
        weights=scatter(rows.weights.reshape(-1), 0.0),
        counts=counts,
        hidden_scale=None if rows.scale is None else scatter(rows.scale.index_select(0, row), None),
    )
    return batch, torch.where(slot < trash, slot, -1).view(-1, k)
