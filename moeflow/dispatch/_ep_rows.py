"""Packed token rows and the batch builders shared by the expert-parallel dispatchers.

One packed row (uint8 [row_bytes]) carries everything a rank needs about one token:

    ids      int32   [K]   expert ids (global or local, as the dispatcher says); -1: none / padding
    weights  float32 [K]   routing weights (0 where ids is -1)
    scale    float32 [G]   payload scales when the payload is FP8 (G = 0 for a layer-dtype payload)
    hidden   [H]           the token, in the payload dtype (layer dtype or float8_e4m3fn)
    padding up to a multiple of 16 bytes (NCCL likes 16-byte aligned rows)

so one collective per direction moves tokens, routing and scales together: the ~40 µs latency floor
of an NCCL call (PERF.md) is paid once per dispatch, not three times. Token bytes move as uint8
(index kernels need no FP8 support) and are viewed back as the payload dtype at the end.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..layouts import MASKED, SORTED, ExpertBatch, offsets_from_counts
from ..quant import QuantScheme

_ALIGN = 16


@dataclass
class Rows:
    """Views into a packed buffer of R rows."""

    ids: Tensor  # [R, K] int32
    weights: Tensor  # [R, K] float32
    scale: Tensor | None  # [R, G] float32
    hidden: Tensor  # [R, H * itemsize] uint8


class RowCodec:
    """Packs (payload, routing) rows. ``payload``: a quant scheme whose ``quantize_activation``
    compresses the token (FP8 payload), or None to send the layer dtype."""

    def __init__(self, hidden_size: int, top_k: int, dtype: torch.dtype, payload: QuantScheme | None):
        self.hidden_size, self.top_k, self.payload = hidden_size, top_k, payload
        if payload is None:
            self.dtype, self.groups = dtype, 0
        else:
            q, s = payload.quantize_activation(torch.ones(1, hidden_size))
            self.dtype, self.groups = q.dtype, s.shape[1]
        self.token_bytes = hidden_size * self.dtype.itemsize
        self._hidden_at = 4 * (2 * top_k + self.groups)
        self.row_bytes = -(-(self._hidden_at + self.token_bytes) // _ALIGN) * _ALIGN

    def encode(self, hidden: Tensor) -> tuple[Tensor, Tensor | None]:
        """hidden [T, H] layer dtype -> (token bytes [T, H * itemsize] uint8, scale [T, G] | None)."""
        if self.payload is None:
            return hidden.contiguous().view(torch.uint8), None
        q, s = self.payload.quantize_activation(hidden)
        return q.contiguous().view(torch.uint8), s.float()

    def pack(self, rows: int, tokens: Tensor, scale: Tensor | None, ids: Tensor, weights: Tensor,
             index: Tensor | None = None) -> Tensor:
        """-> uint8 [rows, row_bytes]. Row i < n = ids.shape[0] holds token ``index[i]`` (or i) with
        routing ``ids[i]``, ``weights[i]``; rows n.. are padding (ids -1, weights 0)."""
        n = ids.shape[0]
        buf = torch.empty(rows, self.row_bytes, dtype=torch.uint8, device=tokens.device)
        view = self.unpack(buf)
        view.ids[:n] = ids
        view.ids[n:] = -1
        view.weights[:n] = weights
        view.weights[n:] = 0
        if index is None:
            view.hidden[:n] = tokens[:n]
            if scale is not None:
                view.scale[:n] = scale[:n]
        else:
            torch.index_select(tokens, 0, index, out=view.hidden[:n])  # one pass, into the row
            if scale is not None:
                torch.index_select(scale, 0, index, out=view.scale[:n])
        return buf

    def unpack(self, buf: Tensor) -> Rows:
        k, g, at = self.top_k, self.groups, self._hidden_at
        return Rows(
            ids=buf[:, :4 * k].view(torch.int32),
            weights=buf[:, 4 * k:8 * k].view(torch.float32),
            scale=buf[:, 8 * k:at].view(torch.float32) if g else None,
            hidden=buf[:, at:at + self.token_bytes],
        )

    def as_payload(self, token_bytes: Tensor) -> Tensor:
        """uint8 [..., H * itemsize] -> [..., H] payload dtype (a view)."""
        return token_bytes.view(self.dtype)


def local_copy_experts(gids: Tensor, expert_rank: Tensor, expert_local: Tensor, rank: int, e_local: int) -> Tensor:
    """gids [R, K] global expert ids (-1 padding) -> [R * K] int64 local expert of each copy,
    ``e_local`` (a sentinel that sorts last) where the copy is not for this rank."""
    g = gids.long().clamp(min=0)
    mine = (gids >= 0) & (expert_rank[g] == rank)
    return torch.where(mine, expert_local[g], e_local).flatten()


def copy_counts(experts: Tensor, e_local: int) -> Tensor:
    """experts [R * K] (sentinel e_local) -> counts [E_local] int32, without a host sync."""
    ones = torch.ones_like(experts, dtype=torch.int32)
    return torch.zeros(e_local + 1, dtype=torch.int32, device=experts.device).scatter_add_(0, experts, ones)[:e_local]


def sorted_batch(codec: RowCodec, rows: Rows, experts: Tensor, n: int, e_local: int) -> tuple[ExpertBatch, Tensor]:
    """The copies marked in ``experts`` ([R * K], sentinel e_local; ``n`` of them are real) as a
    sorted-layout batch. Returns (batch, row_of_copy [n] int64: the packed row of each batch row)."""
    k = codec.top_k
    order = torch.argsort(experts, stable=True)[:n]  # grouped by local expert, in row order
    row = order // k
    counts = copy_counts(experts, e_local)
    batch = ExpertBatch(
        layout=SORTED,
        hidden=codec.as_payload(rows.hidden.index_select(0, row)),
        weights=rows.weights.reshape(-1)[order],
        counts=counts,
        offsets=offsets_from_counts(counts),
        hidden_scale=None if rows.scale is None else rows.scale.index_select(0, row),
    )
    return batch, row


def masked_batch(codec: RowCodec, rows: Rows, experts: Tensor, e_local: int, capacity: int) -> tuple[ExpertBatch, Tensor]:
    """Every copy of ``experts`` ([R * K], sentinel e_local) into a fixed slab [E_local, capacity, H],
    with no host synchronization (CUDA-graph capturable). Returns (batch, slot [R * K] int64:
    e * capacity + position of each copy, or E_local * capacity — a trash slot — for non-copies).

    The caller guarantees no expert receives more than ``capacity`` copies. Empty slots of
    ``hidden`` hold unspecified bytes (zeroing E_local·capacity·H bytes would cost more than the
    dispatch); ``weights`` is 0 there and ``counts`` says which slots are valid.
    """
    k, dev = codec.top_k, experts.device
    order = torch.argsort(experts, stable=True)
    counts = copy_counts(experts, e_local)
    starts = offsets_from_counts(counts)  # [E_local + 1]; the sentinel's start is the real total
    sorted_e = experts[order]
    pos_sorted = torch.arange(experts.numel(), device=dev) - starts[sorted_e]
    pos = torch.empty_like(pos_sorted).scatter_(0, order, pos_sorted)
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
        weights=scatter(rows.weights.reshape(-1), 0.0).float(),
        counts=counts,
        hidden_scale=None if rows.scale is None else scatter(rows.scale.index_select(0, row), None),
    )
    return batch, slot


def partial_sums(expert_out: Tensor, row: Tensor, num_rows: int) -> Tensor:
    """Sorted-layout outputs [N, H] (weights applied) -> [num_rows, H] float32: per packed row, the
    sum of its copies computed on this rank (its partial combine)."""
    out = torch.zeros(num_rows, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
    return out.index_add_(0, row, expert_out.float())


def masked_partial_sums(expert_out: Tensor, slot: Tensor, top_k: int) -> Tensor:
    """Masked outputs [E_local, C, H] -> [R, H] float32, R = slot.numel() / K: per packed row, the
    sum of its K copies' outputs (non-copies, slot == trash, count as 0). No host sync."""
    flat = expert_out.reshape(-1, expert_out.shape[-1])
    trash = flat.shape[0]
    picked = flat.index_select(0, slot.clamp(max=max(trash - 1, 0)))
    picked = torch.where((slot < trash)[:, None], picked, torch.zeros((), dtype=picked.dtype, device=picked.device))
    return picked.view(-1, top_k, flat.shape[1]).sum(dim=1, dtype=torch.float32)
