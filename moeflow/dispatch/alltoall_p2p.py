"""dispatcher="alltoall-p2p": alltoall-fixed's blocks, stored by moeflow's own kernels straight into the peers' GPU
memory (one node; torch symmetric memory over NVLink / PCIe peer access): no NCCL call, no send buffer, no host
synchronization; dispatch and combine capture in CUDA graphs. On CPU (gloo groups of one node) the buffers are
shared files and the barrier is gloo's: the same dispatcher, tested in CI; there torch packs the rows and copies
them into the peers' blocks. PeerAllToAllDispatcher (its transport: _peer.PeerBuffers): one batch at a time per
set of buffers (MF509), MF507 where the buffers cannot be mapped, capacity as alltoall-fixed (MF503).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..capabilities import DispatcherCaps
from ..errors import error
from ..layouts import SORTED
from . import _ep_rows
from ._ep_rows import blank_rows, rank_rows
from ._peer import PeerBuffers
from .alltoall import AllToAllHandle, _Pending
from .alltoall_fixed import AllToAllFixedDispatcher
from .gather_sum import gather_sum


# what MF507 and MF509 name instead: the same blocks through NCCL, with buffers of their own per call
_WITHOUT_PEER_MEMORY = ["alltoall-fixed", "alltoall"]


class PeerAllToAllDispatcher(AllToAllFixedDispatcher):
    """Buffers, mapped by every rank at the construction of the first layer that needs them and shared by the
    layers of the same group, device and sizes (PeerBuffers.shared: the layers run one at a time)
    (C = max_tokens_per_rank, W ranks):
      rows [W·C, row_bytes] uint8: block s holds the packed rows rank s sent here (alltoall-fixed's
        layout: its tokens for this rank, tokens ascending, then blank rows);
      sums [W·C, H] layer dtype: block s holds the partial sums rank s computed for this rank's tokens.
    dispatch: barrier (every rank is done with its rows buffer: the last dispatch's experts read it) →
      one pack launch stores each token's row for rank d into block ``rank`` of d's rows buffer (each
      token read once; the stores to peers cross the link) → the tail of each of those blocks blanked →
      barrier (every rank's rows have landed) → the receiver sorts its copies as alltoall-fixed does.
    combine: barrier (every rank is done with its sums buffer) → one top-k-sum launch stores the partial
      sums of the rows from rank s into block ``rank`` of s's sums buffer → barrier → the home rank
      adds its ranks' partial sums (gather_sum), as alltoall-fixed.
    What it saves against alltoall-fixed (CUDA): the send buffer (the pack writes straight to its
    destinations), the blank rows' round trip, NCCL's own copies, and the serial partial sums before
    the transfer (the sums are the transfer). The barrier is one kernel of one program.

    The halves: on CUDA ``dispatch_start`` / ``combine_start`` queue the transfer (barriers, stores) on
    the transport's own stream and return; work queued before the wait half (the layer's shared experts)
    runs beside it, sharing the SMs; the wait half makes the current stream wait for it. One batch at a
    time per set of buffers: each dispatch_start and combine_start refills them (numbered: rows_epoch,
    sums_epoch), so a batch whose rows or partial sums a later start refilled, of this layer or another
    sharing the buffers, is MF509 where it is next used (dispatch_wait, combine_start, combine_wait): two
    micro-batches overlapped need alltoall-fixed or alltoall, whose buffers are per call. Nothing is held
    between calls: a dispatch repeated without its combine or a call that raised leaves no state behind.
    The barriers at the start of each half make the next batch safe, whichever layer sends it.
    A rank that never arrives: on CUDA the barrier stops waiting after MOEFLOW_DIST_TIMEOUT_S and the
    next eager call raises MF502 (dispatch_start, combine_wait); on CPU gloo's barrier raises it at once.
    Buffers that cannot be mapped (ranks on several nodes, no peer access): MF507 at construction."""

    name = "alltoall-p2p"
    caps = DispatcherCaps(layout=SORTED, devices=frozenset({"cpu", "cuda"}), distributed=True, priority=4,
                          note="alltoall-fixed's blocks stored straight into the peers' memory (one node; CUDA: "
                               "symmetric memory, no NCCL call, CUDA-graph capturable; CPU: shared files, gloo barrier)",
                          indexed_rows=True,
                          batch_invariant=True)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cap, w = self.tokens_per_rank, self.world
        self.peers = PeerBuffers.shared(self.name, self.process_group, self.rank, w, self.device, {
            "rows": ((w * cap, self.codec.row_bytes), torch.uint8),
            "sums": ((w * cap, self.config.hidden_size), self.config.dtype)}, alternatives=_WITHOUT_PEER_MEMORY)
        self._rows_to = self.peers.table("rows", cap)  # [W] int64: block `rank` of each rank's rows buffer
        self._sums_to = self.peers.table("sums", cap)
        self._block_start = torch.arange(w, dtype=torch.int64, device=self.device) * cap

    def dispatch_start(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> _Pending:
        self.peers.check()
        self.peers.rows_epoch += 1  # from here on, an earlier batch's rows may be overwritten: it is stale
        cap, w = self.tokens_per_rank, self.world
        t = topk_ids.shape[0]
        hidden, topk_ids, topk_weights = hidden[:cap], topk_ids[:cap], topk_weights[:cap]
        counts, slot = rank_rows(topk_ids, self.expert_rank, w, block=cap)  # slot [T, W]: row r * C + p, or -1
        tokens, scale = self.codec.encode(hidden)
        used = counts[:, 0]
        with self.peers.side_stream():
            self.peers.barrier()
            self._send_rows(tokens, scale, topk_ids, topk_weights, slot, used)
            self.peers.barrier()
        handle = AllToAllHandle(None, slot, [cap] * w, [cap] * w, overflow=t if t > cap else 0,
                                epoch=self.peers.rows_epoch)
        bound = w * cap * min(self.config.top_k, len(self._local))
        # `work` keeps what the transfer's stream reads alive until dispatch_wait joins it
        return _Pending((tokens, scale, topk_ids, topk_weights, used), self.peers.local["rows"], handle, bound,
                        padded=True, epoch=self.peers.rows_epoch)

    def _current(self, epoch: int, now: int, what: str, by: str) -> None:
        """MF509 where a later transfer (of this layer or another sharing the buffers) has refilled them."""
        if epoch != now:
            raise error("MF509", name=self.name, what=what, by=by, valid=_WITHOUT_PEER_MEMORY)

    def dispatch_wait(self, pending: _Pending):
        self._current(pending.epoch, self.peers.rows_epoch, "received rows", "dispatch_start")
        self.peers.join()
        pending.work = None
        return super().dispatch_wait(pending)

    def _send_rows(self, tokens: Tensor, scale: Tensor | None, ids: Tensor, weights: Tensor, slot: Tensor,
                   used: Tensor) -> None:
        """Block ``rank`` of every rank's rows buffer gets this rank's rows for it, then blank rows.
        slot [T, W]: row r * C + p of token t for rank r (-1: not sent); used [W]: rows for each rank."""
        cap, w = self.tokens_per_rank, self.world
        if _ep_rows._ep_kernels(tokens) is not None:  # one pack launch through the address table
            self.codec.pack_to(self._rows_to, self.peers.local["rows"], tokens, scale, ids, weights,
                               slot - self._block_start, self.expert_rank, self.expert_local)  # p (< 0: not sent)
            blank_rows(self.peers.local["rows"], used, cap, self._blank, table=self._rows_to)
            return
        send = self.codec.pack(w * cap, tokens, scale, ids, weights, dest_pos=slot, expert_rank=self.expert_rank,
                               expert_local=self.expert_local)  # torch: alltoall-fixed's send buffer, copied out
        blank_rows(send, used, cap, self._blank)
        for d, block in enumerate(self.peers.blocks("rows", cap)):
            block.copy_(send[d * cap:(d + 1) * cap])

    def combine_start(self, expert_out: Tensor, handle: AllToAllHandle) -> _Pending:
        # the rows this batch's experts read in place (by index) must still be this batch's
        self._current(handle.epoch, self.peers.rows_epoch, "received rows", "dispatch_start")
        self.peers.sums_epoch += 1
        cap, k = self.tokens_per_rank, self.config.top_k
        with self.peers.side_stream():
            self.peers.barrier()
            # received row s * C + p (rank s's token p) -> row p of block `rank` of s's sums buffer
            kernels = _ep_rows._ep_kernels(expert_out, "reduce")
            if kernels is not None:
                kernels.moe_sum_to(expert_out, handle.copy_pos.reshape(-1), k, self._sums_to, cap)
            else:
                partial = gather_sum(expert_out, handle.copy_pos)
                for s, block in enumerate(self.peers.blocks("sums", cap)):
                    block.copy_(partial[s * cap:(s + 1) * cap])
            self.peers.barrier()
        # work: kept alive until combine_wait
        return _Pending(expert_out, self.peers.local["sums"], handle, 0, epoch=self.peers.sums_epoch)

    def combine_wait(self, pending: _Pending) -> Tensor:
        self._current(pending.epoch, self.peers.sums_epoch, "partial sums", "combine_start")
        self.peers.join()
        pending.work = None
        out = gather_sum(pending.buf, pending.handle.home)  # [T, H]: row r * C + p came from rank r
        self.peers.check()
        if pending.handle.overflow:
            raise error("MF503", count=pending.handle.overflow, rank=self.rank, capacity=self.tokens_per_rank,
                        name=self.name)
        return out
