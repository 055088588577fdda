"""dispatcher="local": one process, all experts here (LocalDispatcher). Permute token copies by expert (sorted
layout; by index when the plan says the runner reads rows in place: no permuted copy). Combine is the weighted sum
of each token's K copies (weights already applied by the runner), accumulated in float32 in k order, so results
are deterministic. No host synchronization anywhere: with a graph-safe runner the whole layer is CUDA-graph
capturable. ``dropping(valid)``: the same dispatcher for ids that may hold -1 and for padded (bucketed) calls.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor

from ..capabilities import DispatcherCaps
from ..errors import error
from ..layouts import SORTED, ExpertBatch
from ._ep_base import slot_placement
from .base import Dispatcher
from .expert_sort import SORT_QUANTIZES, sort_and_quantize, sort_by_expert, sort_dropping
from .gather_sum import gather_sum


@dataclass
class LocalHandle:
    row_of_copy: Tensor  # [T, K] int64: the sorted row holding copy k of token t (inverse of the sort); -1: dropped


class LocalDispatcher(Dispatcher):
    """CUDA batches of an fp8-channel / fp8-block layer that a Triton sort takes travel as FP8
    (ExpertBatch.hidden_scale), quantized by the sort's first launch (expert_sort.sort_and_quantize), the bits
    the runner would make; fp8-tensor batches too, up to expert_sort.TENSOR_QUANT_IN_SORT_MAX elements."""

    name = "local"
    caps = DispatcherCaps(layout=SORTED, devices=frozenset({"cpu", "cuda"}), distributed=False, priority=10,
                          note="single process: sort copies by expert", indexed_rows=True, fusable=True,
                          graph_safe=True, drops_copies=True,
                          batch_invariant=True)
    drops = False  # dropping(): ids may hold -1
    valid: Tensor | None = None  # dropping(valid): [1] int64, the rows from valid[0] on are padding

    def __init__(self, config, scheme, process_group=None, planned=None):
        super().__init__(config, scheme, process_group, planned)
        if isinstance(config.placement, tuple) and any(config.placement):  # one process: rank 0 holds every expert
            raise error("MF504", why=f"names rank {max(config.placement)}, but this layer runs in one process (world "
                                     "size 1: torch.distributed is not initialized, or its group has one rank)")
        self.slots = slot_placement(config, 1)  # with redundant experts the batches are by slot (MoE maps the ids)
        self._bounds: dict = {}
        # CUDA batches the Triton sorts take: their first launch also quantizes the tokens (fp8-tensor:
        # small batches only, expert_sort.sort_and_quantize), the bits the runner would compute one launch
        # or more later; MoEConfig.dispatch_payload="dtype" keeps the layer dtype
        # (not for a weight-only FP8 layer, whose activations stay in the layer dtype: quant/weight_only.py)
        self._quantize_in_sort = (scheme.name in SORT_QUANTIZES and scheme.activations_quantized
                                  and config.dispatch_payload != "dtype")
        if config.device.type == "cuda":  # made now, not at the first call: as TritonRunner's counters (moeflow.ops)
            self._expert_bounds(torch.empty(0, dtype=torch.int32, device=config.device))

    def dropping(self, valid: Tensor | None = None) -> "LocalDispatcher":
        """This dispatcher for calls whose topk_ids [T, K] int32 may hold -1, a copy routed to no expert: it adds zero
        to its token's sum, and the batch has T*K rows, those past offsets[-1] padding (ExpertBatch.padded).
        valid: [1] int64 on the device, or None: every copy of the rows from valid[0] on goes to no expert too (a
        bucketed call's padding tokens, moeflow.graph_buckets; their ids and weights are not read). On CUDA the sort is
        kernels/rows/ep_sort's, the expert-parallel dispatchers', reading the padding rows as ids -1 in its own
        launches (expert_sort.sort_dropping)."""
        new = copy.copy(self)
        new.drops, new.valid = True, valid
        return new

    def dispatch(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor):
        if self.drops:
            return self._dispatch_dropping(hidden, topk_ids, topk_weights)
        if self._quantize_in_sort:
            offsets, counts, row_of_copy, source, sorted_w, hq, hs = sort_and_quantize(
                topk_ids, topk_weights, self.num_slots, hidden, self.scheme.name, self._expert_bounds(topk_ids))
        else:
            offsets, counts, row_of_copy, source, sorted_w = sort_by_expert(
                topk_ids, topk_weights, self.num_slots, self._expert_bounds(topk_ids))
            hq = hs = None
        return self._batch(hidden, hq, hs, source, sorted_w, counts, offsets, row_of_copy), LocalHandle(row_of_copy)

    def _dispatch_dropping(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor):
        """dispatch() where ids may hold -1 (dropping): a padded batch, rows given by index where the plan says so,
        with copy_pos as its copy_rows (-1 for a dropped copy: the runner's row scatter skips it)."""
        offsets, counts, copy_pos, source, sorted_w, hq, hs = sort_dropping(
            topk_ids, topk_weights, self.num_slots, hidden if self._quantize_in_sort else None,
            self.scheme.name, self.valid)
        return self._batch(hidden, hq, hs, source, sorted_w, counts, offsets, copy_pos), LocalHandle(copy_pos)

    def _batch(self, hidden: Tensor, hq: Tensor | None, hs: Tensor | None, source: Tensor, sorted_w: Tensor,
               counts: Tensor, offsets: Tensor, row_of_copy: Tensor) -> ExpertBatch:
        """The sorted batch of a sort's outputs: the rows (hq, quantized by the sort, else hidden) by index where the
        plan says so (with row_of_copy, the runner's scatter map), else copied in order. A dropping batch
        (self.drops) is padded past offsets[-1]."""
        rows = hidden if hq is None else hq
        indexed = self.indexed_rows
        return ExpertBatch(layout=SORTED, hidden=rows if indexed else rows[source], weights=sorted_w, counts=counts,
                           offsets=offsets, source_rows=source if indexed else None,
                           hidden_scale=None if hs is None else hs if indexed else hs[source],
                           copy_rows=row_of_copy if indexed else None, padded=self.drops)

    def _expert_bounds(self, like: Tensor) -> Tensor:
        """[P + 1] = 0..P (P slots: E without redundant experts) in ``like``'s dtype and device, made once per
        (device, dtype) (int32 on the layer's CUDA device when the dispatcher is built)."""
        device = like.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (device, like.dtype)
        bounds = self._bounds.get(key)
        if bounds is None:
            bounds = self._bounds[key] = torch.arange(self.num_slots + 1, dtype=like.dtype, device=device)
        return bounds

    def combine(self, expert_out: Tensor, handle: LocalHandle) -> Tensor:
        return gather_sum(expert_out, handle.row_of_copy)
