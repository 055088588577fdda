"""The dispatcher interface: tokens on this rank -> ExpertBatch for this rank's experts, and back.

    dispatch(hidden [T, H], topk_ids [T, K] int32, topk_weights [T, K] float32)
        -> (ExpertBatch in ``caps.layout``, handle)
    combine(expert_out in that layout, handle) -> [T, H] layer dtype
        (the sum over the K weighted copies of each token, on the token's own rank)

The handle is the dispatcher's own record of where each row came from; callers pass it back
unchanged. Expert-parallel dispatchers also split each call in two halves (start / wait) so
other work overlaps the communication; the base class provides the synchronous halves.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from torch import Tensor

from ..capabilities import DispatcherCaps
from ..config import MoEConfig
from ..layouts import ExpertBatch
from ..quant import QuantScheme


class Dispatcher(ABC):
    name: ClassVar[str]
    caps: ClassVar[DispatcherCaps]

    def __init__(self, config: MoEConfig, scheme: QuantScheme, process_group=None):
        self.config = config
        self.scheme = scheme
        self.process_group = process_group

    @property
    def local_experts(self) -> list[int]:
        """Global ids of the experts this rank computes, in local order (local id = position)."""
        return list(range(self.config.num_experts))

    @abstractmethod
    def dispatch(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> tuple[ExpertBatch, Any]:
        ...

    @abstractmethod
    def combine(self, expert_out: Tensor, handle: Any) -> Tensor:
        ...
