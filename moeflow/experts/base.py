"""The expert-runner interface: ExpertBatch -> expert outputs in the same layout.

A runner computes, for every token copy x routed to local expert e with routing weight w:
    y = w * down_e( act(gate_e(x)) * up_e(x) )
with gate_up_proj [E_local, 2I, H] (gate rows first) and down_proj [E_local, H, I]. Numerics
contract, shared by every runner: activations are quantized by the layer's scheme before each
GEMM (dynamic scales), GEMMs accumulate in float32, the intermediate act(gate)·up is rounded to
the layer dtype before it is quantized for the down GEMM, and the routing weight multiplies the
float32 result of the down GEMM before the final cast.
"""
from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ..capabilities import RunnerCaps
from ..config import MoEConfig
from ..layouts import MASKED, ExpertBatch
from ..quant import QuantScheme, payload_scheme


@dataclass
class ExpertWeights:
    """The local experts' weights as the layer stores them.

    w13: gate_up_proj [E_local, 2I, H], layer dtype or float8_e4m3fn.
    w2: down_proj [E_local, H, I].
    w13_scale, w2_scale: the scheme's weight scales (quant/base.py), or None for quant="none".
    """

    w13: Tensor
    w2: Tensor
    w13_scale: Tensor | None = None
    w2_scale: Tensor | None = None


def activation(kind: str) -> Callable[[Tensor], Tensor]:
    """The gate's activation function of ``kind`` ("silu", "gelu", "gelu_tanh"), elementwise."""
    if kind == "silu":
        return F.silu
    if kind == "gelu":
        return F.gelu
    return functools.partial(F.gelu, approximate="tanh")  # "gelu_tanh"; config validation admits only these three


def gated_activation(h: Tensor, kind: str) -> Tensor:
    """h: [M, 2I] (gate columns first) -> act(gate) * up, [M, I] float32."""
    gate, up = h.float().chunk(2, dim=-1)
    return activation(kind)(gate).mul_(up)  # the activation's own new tensor: one [M, I] float32 fewer at the peak


class ExpertRunner(ABC):
    name: ClassVar[str]
    caps: ClassVar[RunnerCaps]

    def __init__(self, config: MoEConfig, scheme: QuantScheme):
        self.config = config
        self.scheme = scheme

    @abstractmethod
    def run(self, batch: ExpertBatch, weights: ExpertWeights) -> Tensor:
        """batch in a layout listed in ``caps.layouts`` -> outputs [N, H] (sorted) or
        [E_local, C, H] (masked, zeros in empty slots), layer dtype, routing weights applied."""

    def fused_config(self, tokens: int, weights: ExpertWeights):
        """The config of a one-launch layer (dispatch, experts, combine) for ``tokens`` tokens, or None where
        that does not pay or the runner has none (the default). Asked only where the plan allows it
        (Plan.fused_layer: the runner declares the scheme in ``caps.fused_layer``)."""
        return None

    def run_fused(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, weights: ExpertWeights,
                  fused_config) -> Tensor:
        """hidden [T, H], topk_ids [T, K] int32, topk_weights [T, K] float32 -> [T, H] layer dtype: the whole
        single-process layer after routing, with a config ``fused_config`` returned."""
        raise TypeError(f"runner {self.name!r} declares no fused layer")  # unreachable: the plan never asks

    def input_activations(self, batch_hidden: Tensor, batch_scale: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The GEMM input for the first GEMM: the dispatcher's quantized payload as is, or the
        layer-dtype rows quantized now by the scheme. [M, H] -> (q [M, H], scale [M, G] | None)."""
        if batch_scale is not None:
            if self.scheme.activations_quantized:
                return batch_hidden, batch_scale
            deq = payload_scheme(self.scheme).dequantize_activation(batch_hidden, batch_scale)
            return deq.to(self.config.dtype), None
        return self.scheme.quantize_activation(batch_hidden)


def empty_output(batch: ExpertBatch, hidden_size: int, dtype: torch.dtype) -> Tensor:
    """Zero output in the batch's layout: [N, H] or [E_local, C, H]."""
    lead = batch.hidden.shape[:-1] if batch.layout == MASKED else (batch.num_rows,)
    return torch.zeros((*lead, hidden_size), dtype=dtype, device=batch.hidden.device)
