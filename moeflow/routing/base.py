"""The router interface: router_logits -> (topk_ids, topk_weights)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from torch import Tensor

from ..capabilities import RouterCaps
from ..config import MoEConfig


class Router(ABC):
    name: ClassVar[str]
    caps: ClassVar[RouterCaps]  # what it supports; the planner picks (planner.check_router)

    def __init__(self, config: MoEConfig):
        self.config = config

    @abstractmethod
    def __call__(self, router_logits: Tensor, correction_bias: Tensor | None) -> tuple[Tensor, Tensor]:
        """router_logits: [T, E] any float dtype; correction_bias: [E] float or None.

        Returns topk_ids [T, K] int32 (distinct per row) and topk_weights [T, K] float32
        (renormalized if configured, times routed_scaling_factor).
        """
