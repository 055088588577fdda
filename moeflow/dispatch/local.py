"""dispatcher="local": one process, all experts here. Permute token copies by expert (sorted
layout); combine is the weighted sum of each token's K copies (weights already applied by the
runner), accumulated in float32 in k order, so results are deterministic. No host
synchronization anywhere: with a graph-safe runner the whole layer is CUDA-graph capturable.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..capabilities import DispatcherCaps
from ..layouts import SORTED, ExpertBatch, offsets_from_counts
from ._ep_rows import gather_sum
from .base import Dispatcher


@dataclass
class LocalHandle:
    row_of_copy: Tensor  # [T, K] int64: the sorted row holding copy k of token t (inverse of the sort)


class LocalDispatcher(Dispatcher):
    name = "local"
    caps = DispatcherCaps(layout=SORTED, devices=frozenset({"cpu", "cuda"}), distributed=False, priority=10,
                          note="single process: sort copies by expert")

    def dispatch(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor):
        t, k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1).to(torch.int64)
        order = torch.argsort(flat_ids, stable=True)  # [T*K]
        # scatter_add, not bincount: bincount reads the max id on the host (no CUDA-graph capture)
        counts = torch.zeros(self.config.num_experts, dtype=torch.int32, device=flat_ids.device)
        counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
        row_of_copy = torch.empty_like(order)
        row_of_copy[order] = torch.arange(order.numel(), device=order.device)
        batch = ExpertBatch(
            layout=SORTED,
            hidden=hidden[order // k],
            weights=topk_weights.reshape(-1).float()[order],
            counts=counts,
            offsets=offsets_from_counts(counts),
        )
        return batch, LocalHandle(row_of_copy.view(t, k))

    def combine(self, expert_out: Tensor, handle: LocalHandle) -> Tensor:
        return gather_sum(expert_out, handle.row_of_copy)
