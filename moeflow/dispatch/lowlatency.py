"""dispatcher="lowlatency": decode-time expert parallelism with fixed-size buffers, masked layout,
no host synchronization — a whole dispatch → experts → combine can be captured in a CUDA graph
(given a runner that consumes the masked layout without reading counts on the host).

Buffers are sized by ``max_tokens_per_rank`` (C_rank) once, so every collective has a fixed shape: one
all-gather of W·C_rank packed rows, one all_to_all_single of [W, C_rank, H] back (LowLatencyDispatcher).
A rank given more than C_rank tokens raises MF503 at combine_wait, never dropping them silently.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..capabilities import DispatcherCaps
from ..distributed import all_gather_start, collective, wait
from ..errors import error
from ..layouts import MASKED
from ._ep_base import ExpertParallelDispatcher
from ._ep_rows import masked_batch
from .gather_sum import gather_sum, ordered_sum


@dataclass
class LowLatencyHandle:
    copy_slot: Tensor  # [W * C_rank, K] int64: slab slot (e * C + c) of each gathered copy, -1: not here
    num_tokens: int  # tokens of this rank that were sent (<= C_rank)
    overflow: int  # tokens this rank was given (> C_rank means MF503 at combine_wait), else 0


@dataclass
class _Pending:
    work: Any
    buf: Tensor
    handle: LowLatencyHandle | None


class LowLatencyDispatcher(ExpertParallelDispatcher):
    """dispatch: each rank packs its T <= C_rank tokens into C_rank rows (global ids, weights, FP8 scales,
    token; padding rows carry id -1) and one all-gather gives every rank all W·C_rank rows. Each rank
    scatters the copies for its experts into a slab [E_local, W·C_rank, H]: an expert can receive at most
    one copy of each token of each rank, so a slab never overflows.
    combine: per gathered row, the sum of its copies here (float32 → layer dtype), one all_to_all_single
    of [W, C_rank, H] sends each rank its rows back, the home rank sums W blocks.
    With FP8 payload the dispatch moves 1 byte per hidden value; combine moves the layer dtype (bf16).

    Capacity overflow (T > max_tokens_per_rank on a rank) is never dropped silently. It is known on
    the host without a sync (T is a shape), but raising at once would leave the other ranks waiting in
    the collective. So the overflowing rank still takes part in dispatch and combine with its first
    C_rank tokens — the other ranks' outputs stay correct and the group stays usable — and
    ``combine_wait`` then raises MF503 on that rank (the end of the layer's forward). It raises rather
    than falling back to alltoall because a fallback changes the collectives one rank issues, which
    the other ranks cannot know without a synchronization. Fix: raise max_tokens_per_rank, or use
    dispatcher="alltoall" for batches of unbounded size."""

    name = "lowlatency"
    caps = DispatcherCaps(layout=MASKED, devices=frozenset({"cpu", "cuda"}), distributed=True, priority=10,
                          note="fixed buffers (max_tokens_per_rank), masked layout, no host sync, CUDA-graph capturable",
                          batch_invariant=True)

    @property
    def tokens_per_rank(self) -> int:
        """C_rank: the most tokens one rank may hand to dispatch (config.max_tokens_per_rank)."""
        return self.config.max_tokens_per_rank

    @property
    def capacity(self) -> int:
        """Slots per local expert in the masked batch: W * C_rank."""
        return self.world * self.tokens_per_rank

    def dispatch_start(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> _Pending:
        cap = self.tokens_per_rank
        t = topk_ids.shape[0]
        overflow = t if t > cap else 0
        hidden, topk_ids, topk_weights = hidden[:cap], topk_ids[:cap], topk_weights[:cap]
        tokens, scale = self.codec.encode(hidden)
        send = self.codec.pack(cap, tokens, scale, topk_ids, topk_weights)
        buf = send.new_empty(self.world * cap, self.codec.row_bytes)
        with collective("lowlatency dispatch", self.process_group):
            work = all_gather_start(buf, send, self.process_group)
        return _Pending(work, buf, LowLatencyHandle(None, min(t, cap), overflow))

    def dispatch_wait(self, pending: _Pending):
        wait(pending.work, "lowlatency dispatch", self.process_group, pending.buf.device)
        rows = self.codec.unpack(pending.buf)
        experts = self.local_copies(rows.ids)
        batch, pending.handle.copy_slot = masked_batch(self.codec, rows, experts, len(self._local), self.capacity)
        return batch, pending.handle

    def combine_start(self, expert_out: Tensor, handle: LowLatencyHandle) -> _Pending:
        partial = gather_sum(expert_out.reshape(-1, expert_out.shape[-1]), handle.copy_slot)
        back = torch.empty_like(partial)  # [W * C_rank, H]: block r = rank r's sums for my tokens
        with collective("lowlatency combine", self.process_group):
            work = dist.all_to_all_single(back, partial, group=self.process_group, async_op=True)
        return _Pending(work, back, handle)

    def combine_wait(self, pending: _Pending) -> Tensor:
        wait(pending.work, "lowlatency combine", self.process_group, pending.buf.device)
        h = pending.handle
        parts = pending.buf.view(self.world, self.tokens_per_rank, -1)[:, :h.num_tokens]
        out = ordered_sum(parts.unbind(0)).to(self.config.dtype)  # rank order, whatever the batch
        if h.overflow:
            raise error("MF503", count=h.overflow, rank=self.rank, capacity=self.tokens_per_rank, name=self.name)
        return out
