"""On the device, in the forward: each token copy's logical expert -> one of its replicas (to_slots), the load
counter (count_copies), and the layer's state for both (ExpertSlots). Tensor ops only: no host synchronization, so
a layer with replicas or a counter captures in a CUDA graph.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .placement import Placement


def to_slots(topk_ids: Tensor, start: Tensor, count: Tensor, slots: Tensor, rank: int = 0) -> Tensor:
    """topk_ids [T, K] int logical experts (-1: no expert) -> [T, K] int32 physical slots (-1 kept).

    The replica rule: copy k of token t of logical expert e goes to replica j = (t + k + rank) mod count[e] of e,
    i.e. slot ``slots[start[e] + j]`` (start [E], count [E] >= 1, slots [P] int64: Placement.replica_table).
    Consecutive tokens of a rank alternate between an expert's replicas, whatever position k the expert takes, and
    ranks start at different replicas, so one token per rank (decode) spreads too. Deterministic; no host read."""
    t, k = topk_ids.shape
    e = topk_ids.long()
    known = e >= 0
    e = e.clamp(min=0)
    pos = torch.arange(t, device=e.device)[:, None] + torch.arange(k, device=e.device)[None, :] + rank
    slot = slots[start[e] + pos % count[e]]
    return torch.where(known, slot, -1).to(torch.int32)


def count_copies(topk_ids: Tensor, load: Tensor, valid: Tensor | None = None) -> None:
    """load [E] int64 += the copies of each logical expert in topk_ids [T, K] (ids -1 skipped), in place. valid:
    [1] int64 or None: rows from valid[0] on are padding (a bucketed call) and are not counted. No host read."""
    if topk_ids.numel() == 0:
        return
    e = topk_ids.long()
    keep = e >= 0
    if valid is not None:
        keep = keep & (torch.arange(e.shape[0], device=e.device)[:, None] < valid)
    load.scatter_add_(0, e.clamp(min=0).flatten(), keep.flatten().to(torch.int64))


class ExpertSlots:
    """A layer's placement on the device: the replica tables of ``to_slots`` and the load counter.

    placement: the current Placement. load: [E] int64 copies per logical expert since the last reset, or None (the
    layer does not record: MoEConfig.record_expert_load). maps: False where the placement is the identity (slot e
    holds expert e): then ``__call__`` hands the ids on untouched, the same launches as a layer without this module.
    The tables have fixed shapes (E, P), so ``update`` rewrites them in place: a captured graph reads the new ones."""

    def __init__(self, placement: Placement, num_experts: int, device, rank: int = 0, record: bool = False):
        self.num_experts, self.rank = num_experts, rank
        start, count, slots = placement.replica_table(num_experts)
        self.start, self.count, self.slots = (torch.tensor(v, dtype=torch.int64, device=device)
                                              for v in (start, count, slots))
        self.placement, self.maps = placement, not placement.identity
        self.load = torch.zeros(num_experts, dtype=torch.int64, device=device) if record else None

    @classmethod
    def of(cls, config, dispatcher) -> "ExpertSlots":
        """The layer's, from its dispatcher's placement (Dispatcher.slots) and rank."""
        return cls(dispatcher.slots, config.num_experts, config.device, getattr(dispatcher, "rank", 0),
                   config.record_expert_load)

    def __call__(self, topk_ids: Tensor, valid: Tensor | None = None) -> Tensor:
        """topk_ids [T, K] int32 logical -> [T, K] int32 physical slots (the same tensor where ``maps`` is False);
        the copies counted first when the layer records its load. valid: as count_copies'."""
        if self.load is not None:
            count_copies(topk_ids, self.load, valid)
        if not self.maps:
            return topk_ids
        return to_slots(topk_ids, self.start, self.count, self.slots, self.rank)

    def update(self, placement: Placement) -> bool:
        """Route by ``placement`` (same slot count) from now on, tables rewritten in place; -> whether ``maps``
        changed (the launches of a forward did: graphs captured before must be captured again)."""
        start, count, slots = placement.replica_table(self.num_experts)
        for dst, values in ((self.start, start), (self.count, count), (self.slots, slots)):
            dst.copy_(torch.tensor(values, dtype=torch.int64), non_blocking=False)
        flipped = self.maps == placement.identity
        self.placement, self.maps = placement, not placement.identity
        return flipped
