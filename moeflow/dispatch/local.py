"""dispatcher="local": one process, all experts here. Permute token copies by expert (sorted
layout); combine is the weighted sum of each token's K copies (weights already applied by the
runner), accumulated in float32 in a fixed order, so results are deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..capabilities import DispatcherCaps
from ..layouts import SORTED, ExpertBatch, offsets_from_counts
from .base import Dispatcher


@dataclass
class LocalHandle:
    order: Tensor  # [T*K] int64: sorted row r holds flat copy order[r] = token * K + k
    num_tokens: int
    top_k: int


class LocalDispatcher(Dispatcher):
    name = "local"
    caps = DispatcherCaps(layout=SORTED, devices=frozenset({"cpu", "cuda"}), distributed=False, priority=10,
                          note="single process: sort copies by expert")

    def dispatch(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor):
        t, k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1).to(torch.int64)
        order = torch.argsort(flat_ids, stable=True)  # [T*K]
        counts = torch.bincount(flat_ids, minlength=self.config.num_experts).to(torch.int32)
        batch = ExpertBatch(
            layout=SORTED,
            hidden=hidden[order // k],
            weights=topk_weights.reshape(-1).float()[order],
            counts=counts,
            offsets=offsets_from_counts(counts),
        )
        return batch, LocalHandle(order, t, k)

    def combine(self, expert_out: Tensor, handle: LocalHandle) -> Tensor:
        t, k = handle.num_tokens, handle.top_k
        per_copy = torch.empty_like(expert_out)
        per_copy[handle.order] = expert_out
        # explicit H: view(0, k, -1) is ambiguous when T = 0
        return per_copy.view(t, k, expert_out.shape[-1]).float().sum(dim=1).to(expert_out.dtype)
