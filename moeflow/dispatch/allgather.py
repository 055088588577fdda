"""dispatcher="allgather": every rank receives every token with its routing, computes the copies for its own
experts, and the outputs are reduce-scattered back (AllGatherDispatcher). Sorted layout; two host reads a dispatch
(the token counts, the copies here). Simple and robust; moves every token to every rank, so it suits small W or
small batches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..capabilities import DispatcherCaps
from ..distributed import all_gather_host, all_gather_start, collective, wait
from ..layouts import SORTED
from ._ep_base import ExpertParallelDispatcher
from ._ep_rows import sorted_batch
from .gather_sum import gather_sum


@dataclass
class AllGatherHandle:
    copy_pos: Tensor  # [W * T_max, K] int64: batch row of each gathered copy, -1 if not for this rank
    rows_per_rank: int  # T_max
    num_tokens: int


@dataclass
class _Pending:
    work: Any
    buf: Tensor  # gathered rows uint8 [W * T_max, row_bytes], or combine's [W, T_max, H]
    rows_per_rank: int
    num_tokens: int
    handle: AllGatherHandle | None = None


class AllGatherDispatcher(ExpertParallelDispatcher):
    """dispatch: token counts are all-gathered (the host reads them), every rank's packed rows (padded to the
    largest count, T_max) are all-gathered: [W * T_max] rows; the copies for this rank's experts are sorted by
    local expert (one more host read: their number).
    combine: per gathered row, the partial sum of this rank's copies (float32, stored in the layer dtype); the
    reduce-scatter is an all_to_all_single of those rows followed by a float32 sum on the home rank: the same
    bytes as a ring reduce-scatter, one rounding to the layer dtype fewer than NCCL's reduce_scatter in bf16, and
    deterministic."""

    name = "allgather"
    caps = DispatcherCaps(layout=SORTED, devices=frozenset({"cpu", "cuda"}), distributed=True, priority=20,
                          note="all-gather tokens + routing, reduce-scatter outputs")

    def dispatch_start(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> _Pending:
        t = topk_ids.shape[0]
        sizes = all_gather_host(torch.tensor([t], dtype=torch.int64, device=hidden.device), self.process_group,
                                "allgather token counts")
        t_max = max(int(sizes.max()), 1)
        tokens, scale = self.codec.encode(hidden)
        send = self.codec.pack(t_max, tokens, scale, topk_ids, topk_weights)
        buf = send.new_empty(self.world * t_max, self.codec.row_bytes)
        with collective("allgather dispatch", self.process_group):
            work = all_gather_start(buf, send, self.process_group)
        return _Pending(work, buf, t_max, t)

    def dispatch_wait(self, pending: _Pending):
        wait(pending.work, "allgather dispatch", self.process_group, pending.buf.device)
        rows = self.codec.unpack(pending.buf)
        e_local = len(self._local)
        experts = self.local_copies(rows.ids)  # [R * K] local expert, e_local where not here
        n = int((experts < e_local).sum())
        local = torch.where(experts < e_local, experts, -1).to(torch.int32).view(rows.ids.shape)
        batch, copy_pos = sorted_batch(self.codec, rows, n, e_local, ids=local)
        return batch, AllGatherHandle(copy_pos, pending.rows_per_rank, pending.num_tokens)

    def combine_start(self, expert_out: Tensor, handle: AllGatherHandle) -> _Pending:
        partial = gather_sum(expert_out, handle.copy_pos)  # [W * T_max, H]: this rank's share of each row
        back = torch.empty_like(partial)
        with collective("allgather combine (reduce-scatter)", self.process_group):
            work = dist.all_to_all_single(back, partial, group=self.process_group, async_op=True)
        return _Pending(work, back, handle.rows_per_rank, handle.num_tokens)

    def combine_wait(self, pending: _Pending) -> Tensor:
        wait(pending.work, "allgather combine (reduce-scatter)", self.process_group, pending.buf.device)
        parts = pending.buf.view(self.world, pending.rows_per_rank, -1)[:, :pending.num_tokens]
        return parts.sum(dim=0, dtype=torch.float32).to(self.config.dtype)
