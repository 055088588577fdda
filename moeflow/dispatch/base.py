"""The dispatcher interface: tokens on this rank -> ExpertBatch for this rank's experts, and back.

    dispatch(hidden [T, H], topk_ids [T, K] int32, topk_weights [T, K] float32)
        -> (ExpertBatch in ``caps.layout``, handle)
    combine(expert_out in that layout, handle) -> [T, H] layer dtype
        (the sum over the K weighted copies of each token, on the token's own rank)

Each call also comes in two halves, start / wait, so that other work overlaps the communication (Dispatcher).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from torch import Tensor

from ..balance.placement import Placement
from ..capabilities import DispatcherCaps
from ..config import MoEConfig
from ..layouts import ExpertBatch
from ..quant import QuantScheme


class Dispatcher(ABC):
    """Base of the dispatchers (module docstring: dispatch, combine).

    The handle is the dispatcher's own record of where each row came from; callers pass it back
    unchanged. Each call also comes in two halves, start / wait (DeepEP's dispatch_a/b style), so
    other work overlaps the communication: the layer computes shared experts between
    ``dispatch_start`` and ``dispatch_wait``. Expert-parallel dispatchers implement the halves (and
    dispatch = wait(start)); one-process dispatchers keep the defaults below, which do all the work
    in ``*_start``."""

    name: ClassVar[str]
    caps: ClassVar[DispatcherCaps]
    # set by create_dispatcher from the plan: hand sorted rows by index (ExpertBatch.source_rows)
    # because the runner reads them in place; only dispatchers whose caps say indexed_rows honour it
    indexed_rows: bool = False
    # the layer's physical expert slots (moeflow.balance.Placement): the "experts" the dispatcher routes to
    slots: Placement | None = None

    def __init__(self, config: MoEConfig, scheme: QuantScheme, process_group=None, planned=None):
        """planned: the layer's Plan (planner.Plan) when a layer builds the dispatcher, else None."""
        self.config = config
        self.scheme = scheme
        self.process_group = process_group
        self.planned = planned

    @property
    def local_experts(self) -> list[int]:
        """Global ids of the experts this rank computes, in local order (local id = position): with redundant
        experts, the logical expert of each local slot (a replicated one may appear twice)."""
        if self.slots is None:
            return list(range(self.config.num_experts))
        return self.slots.local_experts(0)

    @property
    def num_slots(self) -> int:
        """P: the layer's physical expert slots, E + num_redundant_experts (the ids topk_ids hold here)."""
        return self.config.num_experts + self.config.num_redundant_experts

    def set_slots(self, slots: Placement) -> None:
        """Route to ``slots`` from the next call on (MoE.rebalance; this rank's slot count unchanged)."""
        self.slots = slots

    @abstractmethod
    def dispatch(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> tuple[ExpertBatch, Any]:
        ...

    @abstractmethod
    def combine(self, expert_out: Tensor, handle: Any) -> Tensor:
        ...

    def dispatch_start(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Any:
        """First half of dispatch (same arguments): returns a pending object at once."""
        return self.dispatch(hidden, topk_ids, topk_weights)

    def dispatch_wait(self, pending: Any) -> tuple[ExpertBatch, Any]:
        """Second half of dispatch -> (ExpertBatch, handle)."""
        return pending

    def combine_start(self, expert_out: Tensor, handle: Any) -> Any:
        """First half of combine (same arguments): returns a pending object at once."""
        return self.combine(expert_out, handle)

    def combine_wait(self, pending: Any) -> Tensor:
        """Second half of combine -> [T, H] layer dtype."""
        return pending
