"""Packed token rows (RowCodec, Rows) and the batch builders (sorted_batch, masked_batch) shared by the
expert-parallel dispatchers: a packed row carries one token with its routing and scales, so that one collective
per direction moves all three.
"""
from __future__ import annotations

import functools
import importlib

import torch
from torch import Tensor

from ..capabilities import triton_glue
from ..layouts import MASKED, SORTED, ExpertBatch
from ..quant import QuantScheme
from ._ep_reference import (
    blank_rows_torch,
    masked_batch_torch,
    pack_rows_torch,
    rank_rows_torch,
    sort_copies_by_expert_torch,
)
from .packed import Rows

_ALIGN = 16


def _quantize(scheme: QuantScheme, x: Tensor) -> tuple[Tensor, Tensor]:
    """scheme.quantize_activation(x), through the Triton kernel on CUDA when triton is present."""
    if triton_glue(x, fp8=True) and x.shape[0]:
        try:
            from ..kernels.rows.quant import quantize_activation
        except ImportError:  # triton missing: the scheme's torch code below
            pass
        else:
            return quantize_activation(x, scheme.name)
    return scheme.quantize_activation(x)


def _ep_kernels(t: Tensor, module: str = "ep_rows"):
    """moeflow.kernels.rows.<module> (ep_rows, ep_sort, reduce) when ``t`` is on CUDA and triton imports, else
    None (the torch code)."""
    if not triton_glue(t):
        return None
    try:
        return importlib.import_module(f"moeflow.kernels.rows.{module}")
    except ImportError:
        return None


def rank_rows(topk_ids: Tensor, expert_rank: Tensor, world: int, block: int = 0) -> tuple[Tensor, Tensor]:
    """Where each token goes: topk_ids [T, K] int, expert_rank [E] int64 ->
    (counts [W, 2] int64: rows and copies for each rank, home [T, W] int64: row of token t in the
    send buffer for rank r, grouped by destination with tokens ascending, -1 where not sent).
    block > 0: the rows for rank r start at r * block (fixed blocks), else after those of ranks < r.
    Two Triton launches on CUDA (kernels/rows/ep_rows.rank_rows), rank_rows_torch otherwise."""
    kernels = _ep_kernels(topk_ids)
    return (rank_rows_torch if kernels is None else kernels.rank_rows)(topk_ids, expert_rank, world, block)


class RowCodec:
    """Packs (payload, routing) rows. ``payload``: a quant scheme whose ``quantize_activation``
    compresses the token (FP8 payload), or None to send the layer dtype.

    One packed row (uint8 [row_bytes]) carries everything a rank needs about one token:

        ids      int32   [K]   expert ids (global or local, as the dispatcher says); -1: none / padding
        weights  float32 [K]   routing weights (0 where ids is -1)
        scale    float32 [G]   payload scales when the payload is FP8 (G = 0 for a layer-dtype payload)
        hidden   [H]           the token, in the payload dtype (layer dtype or float8_e4m3fn)
        padding up to a multiple of 16 bytes (NCCL likes 16-byte aligned rows; hidden starts 16-aligned)

    so the latency floor of an NCCL call (~40 µs) is paid once per dispatch, not three times. Token bytes
    move as ``word``s (int64 when the row's token bytes allow, else narrower), since torch's index kernels
    move one element per thread; ``as_payload`` views them back as the payload dtype."""

    def __init__(self, hidden_size: int, top_k: int, dtype: torch.dtype, payload: QuantScheme | None):
        self.hidden_size, self.top_k, self.payload = hidden_size, top_k, payload
        if payload is None:
            self.dtype, self.groups = dtype, 0
        else:
            q, s = payload.quantize_activation(torch.ones(1, hidden_size))
            self.dtype, self.groups = q.dtype, s.shape[1]
        self.token_bytes = hidden_size * self.dtype.itemsize
        self.word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8)
                         if self.token_bytes % w.itemsize == 0)
        self._hidden_at = -(-4 * (2 * top_k + self.groups) // _ALIGN) * _ALIGN
        self.row_bytes = -(-(self._hidden_at + self.token_bytes) // _ALIGN) * _ALIGN

    def encode(self, hidden: Tensor) -> tuple[Tensor, Tensor | None]:
        """hidden [T, H] layer dtype -> (token words [T, token_bytes / word size], scale [T, G] | None)."""
        if self.payload is None:
            return self._words(hidden), None
        q, s = _quantize(self.payload, hidden)
        return self._words(q), s.float()

    def _words(self, t: Tensor) -> Tensor:
        return t.contiguous().view(torch.uint8).view(self.word)

    def pack(self, rows: int, tokens: Tensor, scale: Tensor | None, ids: Tensor, weights: Tensor,
             dest_pos: Tensor | None = None, expert_rank: Tensor | None = None,
             expert_local: Tensor | None = None) -> Tensor:
        """-> uint8 [rows, row_bytes]. tokens [T, Wd] words, scale [T, G] | None (``encode``),
        ids [T, K] int global expert ids, weights [T, K] float (converted to int32 / float32 here).

        dest_pos None: row t holds token t as it is; rows T.. are padding (ids -1, weights 0).
        dest_pos [T, D] int64: token t goes to row dest_pos[t, d] for each d where it is >= 0, with
        the ids of rank d's experts as local ids (``expert_local``, where ``expert_rank`` is d)
        and -1 / weight 0 for the others; rows no pair names stay unwritten.
        One Triton launch on CUDA (kernels/rows/ep_rows.pack_rows), torch otherwise; the same bytes.
        """
        buf = torch.empty(rows, self.row_bytes, dtype=torch.uint8, device=tokens.device)
        t = ids.shape[0]
        pad_from = None
        if dest_pos is None:
            dest_pos, pad_from = torch.arange(t, device=tokens.device)[:, None], t
        kernels = _ep_kernels(tokens)
        pack = pack_rows_torch if kernels is None else kernels.pack_rows
        pack(self.unpack(buf), tokens, scale, ids.to(torch.int32), weights.float(), dest_pos, expert_rank,
             expert_local, pad_from)
        return buf

    def pack_to(self, table: Tensor, template: Tensor, tokens: Tensor, scale: Tensor | None, ids: Tensor,
                weights: Tensor, dest_pos: Tensor, expert_rank: Tensor, expert_local: Tensor) -> None:
        """``pack``'s rows stored elsewhere (peer-to-peer dispatch, CUDA): destination d's rows start at
        address table[d] ([D] int64) and dest_pos [T, D] counts rows from there (negative: not sent);
        template: any uint8 [*, row_bytes] buffer of this codec (its row layout). One Triton launch
        (kernels/rows/ep_rows.pack_rows with a table)."""
        from ..kernels.rows.ep_rows import pack_rows

        pack_rows(self.unpack(template), tokens, scale, ids.to(torch.int32), weights.float(), dest_pos, expert_rank,
                  expert_local, table=table)

    def blank_row(self, device) -> Tensor:
        """uint8 [row_bytes]: a row that carries no token (ids -1; weights, scales, token 0)."""
        row = torch.zeros(self.row_bytes, dtype=torch.uint8, device=device)
        row[:4 * self.top_k] = 255  # int32 -1
        return row

    def unpack(self, buf: Tensor) -> Rows:
        k, g, at = self.top_k, self.groups, self._hidden_at
        return Rows(
            ids=buf[:, :4 * k].view(torch.int32),
            weights=buf[:, 4 * k:8 * k].view(torch.float32),
            scale=buf[:, 8 * k:8 * k + 4 * g].view(torch.float32) if g else None,
            hidden=buf[:, at:at + self.token_bytes].view(self.word),
        )

    def as_payload(self, words: Tensor) -> Tensor:
        """Contiguous token words [..., token_bytes / word size] -> [..., H] payload dtype (a view)."""
        return words.view(torch.uint8).view(self.dtype)


def sorted_batch(codec: RowCodec, rows: Rows, n: int, e_local: int, indexed: bool = False,
                 ids: Tensor | None = None, padded: bool = False) -> tuple[ExpertBatch, Tensor]:
    """The copies of received ``rows`` for this rank (``ids`` [R, K] int32, default rows.ids: local
    expert ids, -1 for copies not here; ``n`` of them are here) as a sorted-layout batch: grouped by
    expert, in row order within one. Two Triton launches on CUDA where they beat torch's sort
    (kernels/rows/ep_sort.sort_pays), torch ops otherwise.

    indexed: the batch names its rows (``source_rows`` [n] into the R received rows, which it
    holds as strided views of the receive buffer) instead of copying one row per copy
    (n x H bytes written and read again: 470 MB per dispatch at 4096 tokens/rank, H=7168, top-8).
    padded: n is only an upper bound of the copies here (no host synchronization: alltoall-fixed);
    the batch has n rows, those past offsets[-1] are padding (row 0 of ``rows``, weight 0).
    Returns (batch, copy_pos [R, K] int64: the batch row of each copy, -1 for non-copies).
    """
    k = codec.top_k
    ids = rows.ids if ids is None else ids
    kernels = _ep_kernels(ids, "ep_sort")
    if kernels is not None and kernels.sort_pays(ids.numel(), e_local):
        sort = functools.partial(kernels.sort_copies_by_expert, padded=padded)
    else:
        sort = sort_copies_by_expert_torch  # fills the padding the same way
    row, weights, counts, offsets, copy_pos = sort(ids, rows.weights, e_local, n)
    if indexed:
        hidden, scale, source = codec.as_payload(rows.hidden), rows.scale, row
    else:
        hidden = codec.as_payload(rows.hidden.index_select(0, row))
        scale = None if rows.scale is None else rows.scale.index_select(0, row)
        source = None
    batch = ExpertBatch(layout=SORTED, hidden=hidden, weights=weights, counts=counts, offsets=offsets,
                        hidden_scale=scale, source_rows=source, padded=padded)
    return batch, copy_pos.view(-1, k)


def blank_rows(buf: Tensor, counts: Tensor, capacity: int, blank: Tensor, table: Tensor | None = None) -> None:
    """Rows counts[d] .. C-1 of each block d of buf [W * C, row_bytes] become ``blank``
    (RowCodec.blank_row), in place, without a host synchronization: one Triton launch on CUDA
    (kernels/rows/ep_rows.blank_rows), blank_rows_torch otherwise. table [W] int64 (peer-to-peer, CUDA):
    block d is the C rows from address table[d] (buf gives the row size)."""
    if table is not None:
        from ..kernels.rows.ep_rows import blank_rows as blank_rows_kernel

        blank_rows_kernel(buf, counts, capacity, blank, table=table)
        return
    kernels = _ep_kernels(buf)
    (blank_rows_torch if kernels is None else kernels.blank_rows)(buf, counts, capacity, blank)


def masked_batch(codec: RowCodec, rows: Rows, experts: Tensor, e_local: int, capacity: int) -> tuple[ExpertBatch, Tensor]:
    """Every copy of ``experts`` ([R * K], sentinel e_local) into a fixed slab [E_local, capacity, H],
    with no host synchronization (CUDA-graph capturable). Returns (batch, copy_slot [R, K] int64:
    e * capacity + position of each copy among its expert's copies in row order, -1 for non-copies).

    The caller guarantees no expert receives more than ``capacity`` copies. Empty slots of
    ``hidden`` hold unspecified bytes (zeroing E_local·capacity·H bytes would cost more than the
    dispatch); ``weights`` is 0 there and ``counts`` says which slots are valid.
    Two Triton launches on CUDA (kernels/rows/ep_rows.masked_scatter), masked_batch_torch otherwise.
    """
    kernels = _ep_kernels(experts)
    if kernels is None:
        return masked_batch_torch(codec, rows, experts, e_local, capacity)
    hidden, weights, scale, counts, slot = kernels.masked_scatter(rows, experts, e_local, capacity)
    batch = ExpertBatch(layout=MASKED, hidden=codec.as_payload(hidden), weights=weights, counts=counts,
                        hidden_scale=scale)
    return batch, slot.view(-1, codec.top_k)
