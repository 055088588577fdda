"""dispatcher="alltoall": high-throughput expert parallelism (prefill), sorted layout (AllToAllDispatcher). Each
token goes once to every rank owning one of its K experts, as one packed row (_ep_rows); a counts exchange that
the host reads (one host synchronization a dispatch), then one all_to_all_single per direction.
Payload: the layer dtype, or FP8 with its scales (``MoEConfig.dispatch_payload``, see _ep_base).
AllToAllHandle is shared with alltoall-fixed and alltoall-p2p.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..capabilities import DispatcherCaps
from ..distributed import collective, wait
from ..layouts import SORTED
from ._ep_base import ExpertParallelDispatcher
from ._ep_rows import rank_rows, sorted_batch
from .gather_sum import gather_sum


@dataclass
class AllToAllHandle:
    copy_pos: Tensor | None  # [R, K] int64: batch row of each received copy, -1 if none
    home: Tensor  # [T, W] int64: row of the combine's receive buffer holding token t's sum from rank r, or -1
    sent: list[int]  # rows sent to each rank (grouped by destination, tokens ascending)
    received: list[int]  # rows received from each rank
    overflow: int = 0  # alltoall-fixed: tokens this rank was given when beyond its capacity (MF503)
    pieces: int = 1  # alltoall-fixed: the combine goes out in this many all-to-alls
    epoch: int = 0  # alltoall-p2p: the dispatch (PeerBuffers.rows_epoch) whose rows this batch's experts read


@dataclass
class _Pending:
    work: Any
    buf: Tensor  # received rows, uint8 [R, row_bytes]
    handle: AllToAllHandle
    copies: int  # copies received for this rank's experts (padded: an upper bound of them)
    padded: bool = False  # copies is a bound: the batch is padded past offsets[-1] (alltoall-fixed)
    epoch: int = 0  # alltoall-p2p: the transfer (PeerBuffers.rows_epoch / sums_epoch) that filled buf


class AllToAllDispatcher(ExpertParallelDispatcher):
    """dispatch:
      1. each token goes once to every rank owning one of its K experts, with its routing for that
         rank's experts only (local ids, -1 for the others): one packed row (see _ep_rows);
      2. per destination rank, (rows, copies) counts are exchanged (a small all-to-all; the host reads
         them: this dispatcher synchronizes once per dispatch, like every variable-size all-to-all);
      3. one all_to_all_single moves the rows; the receiver sorts the copies by local expert. With
         rows by index (Plan.indexed_rows: the triton runner) the batch names the received rows
         instead of copying one row per copy.
    combine: each rank sums, per received row, the outputs of that row's copies (float32), sends the
    rows back in the layer dtype (one all_to_all_single), and the token's home rank adds the partial
    sums of the ranks it went to (float32, then the layer dtype). Both sums are ``gather_sum``: one
    read of each row, a fixed order, deterministic."""

    name = "alltoall"
    caps = DispatcherCaps(layout=SORTED, devices=frozenset({"cpu", "cuda"}), distributed=True, priority=30,
                          note="counts exchange + one all_to_all_single per direction; FP8 payload optional",
                          indexed_rows=True,
                          batch_invariant=True)

    def dispatch_start(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> _Pending:
        t, w, dev = topk_ids.shape[0], self.world, hidden.device
        # counts [W, 2]: rows and copies per destination; home [T, W]: row of token t in the send
        # buffer for rank r (grouped by destination, tokens ascending), -1 if not sent; the
        # combine's receive buffer has the same rows
        counts, home = rank_rows(topk_ids, self.expert_rank, w)
        theirs = torch.empty_like(counts)
        with collective(f"{self.name} counts exchange", self.process_group):
            work = dist.all_to_all_single(theirs, counts, group=self.process_group, async_op=True)
        # Everything below up to the host read runs on the device while the counts travel; after
        # it the host only launches the all-to-all (each op queued after a host synchronization
        # leaves the GPU idle for its launch time).
        tokens, scale = self.codec.encode(hidden)
        most = t * min(w, self.config.top_k)  # a token goes to at most min(W, K) ranks
        send = self.codec.pack(most, tokens, scale, topk_ids, topk_weights, dest_pos=home,
                               expert_rank=self.expert_rank, expert_local=self.expert_local)
        wait(work, f"{self.name} counts exchange", self.process_group, counts.device, host=True)
        both = torch.cat([counts, theirs], dim=1).tolist()  # the one host synchronization of dispatch
        sent, received = [row[0] for row in both], [row[2] for row in both]
        copies_in = sum(row[3] for row in both)
        buf = torch.empty(sum(received), self.codec.row_bytes, dtype=torch.uint8, device=dev)
        with collective(f"{self.name} dispatch", self.process_group):
            work = dist.all_to_all_single(buf, send[:sum(sent)], received, sent, group=self.process_group,
                                          async_op=True)
        return _Pending(work, buf, AllToAllHandle(None, home, sent, received), copies_in)

    def dispatch_wait(self, pending: _Pending):
        if pending.work is not None:  # None: the rows are already here (alltoall-p2p)
            wait(pending.work, f"{self.name} dispatch", self.process_group, pending.buf.device)
        rows = self.codec.unpack(pending.buf)
        batch, pending.handle.copy_pos = sorted_batch(self.codec, rows, pending.copies, len(self._local),
                                                      indexed=self.indexed_rows, padded=pending.padded)
        return batch, pending.handle

    def combine_start(self, expert_out: Tensor, handle: AllToAllHandle) -> _Pending:
        partial = gather_sum(expert_out, handle.copy_pos)  # [R, H]: per received row, its copies here
        back = partial.new_empty(sum(handle.sent), partial.shape[1])
        with collective(f"{self.name} combine", self.process_group):
            work = dist.all_to_all_single(back, partial, handle.sent, handle.received,
                                          group=self.process_group, async_op=True)
        return _Pending(work, back, handle, 0)

    def combine_wait(self, pending: _Pending) -> Tensor:
        wait(pending.work, f"{self.name} combine", self.process_group, pending.buf.device)
        return gather_sum(pending.buf, pending.handle.home)  # [T, H]: the partial sums of its ranks
