"""dispatcher="alltoall-fixed": alltoall in blocks of a fixed size: no host synchronization, so a
prefill-sized dispatch → experts → combine can be captured in a CUDA graph, and the host never
waits for the device in the middle of a forward. Sorted layout, rows by index for the triton runner.

Every rank pair exchanges one block of C_rank = ``max_tokens_per_rank`` rows, whatever the routing:
  dispatch: the rows of alltoall (each token once per destination rank, with that rank's local
    ids; grouped by destination, tokens ascending) are written to block d of a [W, C_rank] send
    buffer; the unused tail of each block becomes blank rows (ids -1, zeros), so no count has to
    travel: one all_to_all_single of equal splits moves tokens, routing and the block's size. The
    receiver sorts the copies of its W·C_rank rows by local expert into a batch of
    W·C_rank·min(K, E_local) rows, an upper bound of the copies it can get: rows past offsets[-1]
    are padding (weight 0) that the runners skip.
  combine: as alltoall (partial sums per received row, one all_to_all_single back, the home rank
    adds its ranks' sums), with equal splits.

What it costs against alltoall: the all-to-all moves W·C_rank rows per rank whatever T and the
routing are. With few ranks and top-k routing almost every token goes to every rank (2 ranks, top-8
of 256 experts: 99.6%), so at T = C_rank the bytes are alltoall's; with many ranks or T well below
C_rank the blocks are mostly blank. The batch, the expert outputs and the GEMM grid are sized by the
upper bound (up to ~2x alltoall's at 2 ranks and top-8).

Capacity: a rank given T > C_rank tokens takes part with its first C_rank (its peers' results stay
correct) and raises MF503 at combine_wait, as lowlatency does (the peers cannot learn of a
fallback without a synchronization). Payload: the layer dtype or FP8, as alltoall.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..capabilities import DispatcherCaps
from ..distributed import collective
from ..errors import error
from ..layouts import SORTED
from ._ep_rows import blank_rows, rank_rows
from .alltoall import AllToAllDispatcher, AllToAllHandle, _Pending


def block_slots(counts: Tensor, home: Tensor, capacity: int) -> Tensor:
    """counts [W, 2], home [T, W] from rank_rows (rows grouped by destination) -> [T, W] int64: the
    row of token t in block r of a buffer of W blocks of ``capacity`` rows (r * C + its rank among
    the tokens sent to r), -1 where not sent. Device ops, no host synchronization."""
    rows = counts[:, 0]
    shift = torch.arange(counts.shape[0], device=counts.device) * capacity - (torch.cumsum(rows, 0) - rows)
    return torch.where(home >= 0, home + shift, -1)


class AllToAllFixedDispatcher(AllToAllDispatcher):
    name = "alltoall-fixed"
    caps = DispatcherCaps(layout=SORTED, devices=frozenset({"cpu", "cuda"}), distributed=True, priority=5,
                          note="alltoall in fixed blocks of max_tokens_per_rank rows: no host sync, CUDA-graph "
                               "capturable; moves W x max_tokens_per_rank rows per rank",
                          indexed_rows=True)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._blank = self.codec.blank_row(self.device)

    @property
    def tokens_per_rank(self) -> int:
        """C_rank: rows per block, the most tokens one rank may hand to dispatch."""
        return self.config.max_tokens_per_rank

    def dispatch_start(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> _Pending:
        cap, w = self.tokens_per_rank, self.world
        t = topk_ids.shape[0]
        hidden, topk_ids, topk_weights = hidden[:cap], topk_ids[:cap], topk_weights[:cap]
        counts, home = rank_rows(topk_ids, self.expert_rank, w)
        slot = block_slots(counts, home, cap)  # [T, W]: row of token t in block r; the combine's too
        tokens, scale = self.codec.encode(hidden)
        send = self.codec.pack(w * cap, tokens, scale, topk_ids, topk_weights, dest_pos=slot,
                               expert_rank=self.expert_rank, expert_local=self.expert_local)
        blank_rows(send, counts[:, 0], cap, self._blank)
        buf = torch.empty_like(send)
        with collective("alltoall-fixed dispatch", self.process_group):
            work = dist.all_to_all_single(buf, send, group=self.process_group, async_op=True)
        handle = AllToAllHandle(None, slot, [cap] * w, [cap] * w, overflow=t if t > cap else 0)
        # copies here: at most min(K, E_local) per received row
        bound = w * cap * min(self.config.top_k, len(self._local))
        return _Pending(work, buf, handle, bound, padded=True)

    def combine_wait(self, pending: _Pending) -> Tensor:
        out = super().combine_wait(pending)
        h = pending.handle
        if h.overflow:
            raise error("MF503", count=h.overflow, rank=self.rank, capacity=self.tokens_per_rank, name=self.name)
        return out
