"""dispatcher="alltoall-fixed": alltoall in blocks of a fixed size (C_rank = ``max_tokens_per_rank`` rows for every
rank pair, whatever the routing): no host synchronization, so a prefill-sized dispatch → experts → combine can be
captured in a CUDA graph, and the host never waits for the device in the middle of a forward. Sorted layout, rows
by index for the triton runner; payload: the layer dtype or FP8, as alltoall (AllToAllFixedDispatcher).

What it costs against alltoall: W·C_rank rows move per rank whatever T and the routing are. With few ranks and
top-k routing almost every token goes to every rank (2 ranks, top-8 of 256 experts: 99.6%), so at T = C_rank the
bytes are alltoall's; with many ranks or T well below C_rank the blocks are mostly blank. The batch, the expert
outputs and the GEMM grid are sized by the upper bound of the copies (up to ~2x alltoall's at 2 ranks and top-8).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..capabilities import DispatcherCaps
from ..distributed import collective, wait
from ..errors import error
from ..layouts import SORTED
from ._ep_rows import blank_rows, rank_rows
from .alltoall import AllToAllDispatcher, AllToAllHandle, _Pending
from .gather_sum import gather_sum


def chunk_major(slot: Tensor, capacity: int, chunk: int) -> Tensor:
    """slot [T, W] (row r * C + p of block r, -1) -> the row of the same (rank, position) in a buffer
    of C / L pieces of L = ``chunk`` rows per block, piece-major: piece c = rows p in c·L .. (c+1)·L - 1
    of block 0, then of block 1, ... (C a multiple of L)."""
    world = slot.shape[1]
    p = slot - torch.arange(world, device=slot.device) * capacity
    c = p // chunk
    return torch.where(slot >= 0, c * (world * chunk) + torch.arange(world, device=slot.device) * chunk + (p - c * chunk), -1)


def combine_pieces(capacity: int, most: int) -> int:
    """How many pieces the combine sends: the largest count up to ``most`` that divides C_rank."""
    return next(c for c in range(max(1, min(most, capacity)), 0, -1) if capacity % c == 0)


# The most pieces the combine is sent in, by default. One: more pieces did not overlap the sums with the transfers,
# so each extra all-to-all only added its latency.
COMBINE_CHUNKS = 1


class AllToAllFixedDispatcher(AllToAllDispatcher):
    """Every rank pair exchanges one block of C_rank = ``max_tokens_per_rank`` rows, whatever the routing:
      dispatch: the rows of alltoall (each token once per destination rank, with that rank's local
        ids; grouped by destination, tokens ascending) are written to block d of a [W, C_rank] send
        buffer; the unused tail of each block becomes blank rows (ids -1, zeros), so no count has to
        travel: one all_to_all_single of equal splits moves tokens, routing and the block's size. The
        receiver sorts the copies of its W·C_rank rows by local expert into a batch of
        W·C_rank·min(K, E_local) rows, an upper bound of the copies it can get: rows past offsets[-1]
        are padding (weight 0) that the runners skip.
      combine: as alltoall (partial sums per received row, sent back, the home rank adds its ranks'
        sums), optionally in ``combine_chunks`` pieces: the partial sums of rows c·L .. (c+1)·L - 1 of
        every block (L = C_rank / pieces) in their own all_to_all_single, meant to overlap the sum of
        piece c with the transfer of piece c - 1 (the home rank's receive buffer is then piece-major;
        the slot of each (token, rank) is remapped once per dispatch). One piece by default (COMBINE_CHUNKS).

    Capacity: a rank given T > C_rank tokens takes part with its first C_rank (its peers' results stay
    correct) and raises MF503 at combine_wait, as lowlatency does (the peers cannot learn of a
    fallback without a synchronization)."""

    name = "alltoall-fixed"
    caps = DispatcherCaps(layout=SORTED, devices=frozenset({"cpu", "cuda"}), distributed=True, priority=5,
                          note="alltoall in fixed blocks of max_tokens_per_rank rows: no host sync, CUDA-graph "
                               "capturable; moves W x max_tokens_per_rank rows per rank",
                          indexed_rows=True,
                          batch_invariant=True)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._blank = self.codec.blank_row(self.device)
        self.combine_chunks = COMBINE_CHUNKS  # the most pieces the combine is sent in (combine_pieces)

    @property
    def tokens_per_rank(self) -> int:
        """C_rank: rows per block, the most tokens one rank may hand to dispatch."""
        return self.config.max_tokens_per_rank

    def dispatch_start(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> _Pending:
        cap, w = self.tokens_per_rank, self.world
        t = topk_ids.shape[0]
        hidden, topk_ids, topk_weights = hidden[:cap], topk_ids[:cap], topk_weights[:cap]
        counts, slot = rank_rows(topk_ids, self.expert_rank, w, block=cap)  # slot [T, W]: row of token t in block r
        tokens, scale = self.codec.encode(hidden)
        send = self.codec.pack(w * cap, tokens, scale, topk_ids, topk_weights, dest_pos=slot,
                               expert_rank=self.expert_rank, expert_local=self.expert_local)
        blank_rows(send, counts[:, 0], cap, self._blank)
        buf = torch.empty_like(send)
        with collective("alltoall-fixed dispatch", self.process_group):
            work = dist.all_to_all_single(buf, send, group=self.process_group, async_op=True)
        pieces = combine_pieces(cap, self.combine_chunks)
        # row of (token, rank) in the combine's receive buffer (piece-major; the blocks' own rows in one piece)
        home = slot if pieces == 1 else chunk_major(slot, cap, cap // pieces)
        handle = AllToAllHandle(None, home, [cap] * w, [cap] * w, overflow=t if t > cap else 0, pieces=pieces)
        # copies here: at most min(K, E_local) per received row
        bound = w * cap * min(self.config.top_k, len(self._local))
        return _Pending(work, buf, handle, bound, padded=True)

    def combine_start(self, expert_out: Tensor, handle: AllToAllHandle) -> _Pending:
        w, cap, k = self.world, self.tokens_per_rank, self.config.top_k
        length = cap // handle.pieces
        pos = handle.copy_pos.view(w, cap, k)
        back = expert_out.new_empty(w * cap, expert_out.shape[1])  # piece-major (chunk_major)
        works = []
        for c in range(handle.pieces):  # meant to sum piece c while piece c - 1 travels (class docstring)
            partial = gather_sum(expert_out, pos[:, c * length:(c + 1) * length].reshape(-1, k))
            with collective("alltoall-fixed combine", self.process_group):
                works.append(dist.all_to_all_single(back[c * w * length:(c + 1) * w * length], partial,
                                                    group=self.process_group, async_op=True))
        return _Pending(works, back, handle, 0)

    def combine_wait(self, pending: _Pending) -> Tensor:
        for work in pending.work:
            wait(work, "alltoall-fixed combine", self.process_group, pending.buf.device)
        out = gather_sum(pending.buf, pending.handle.home)  # [T, H]: the partial sums of its ranks
        h = pending.handle
        if h.overflow:
            raise error("MF503", count=h.overflow, rank=self.rank, capacity=self.tokens_per_rank, name=self.name)
        return out
