"""Weight-only FP8: an FP8 scheme's weights and scales as stored, activations kept in the layer dtype.

For GPUs without FP8 tensor cores (sm_80, sm_86: moeflow.targets): the planner sets Plan.weight_only and the layer
wraps its scheme in WeightOnly, so every runner computes dequantized weights x layer-dtype activations (the Triton
runner decodes the FP8 weights inside its GEMM loops) and no dispatcher quantizes the tokens.
"""
from __future__ import annotations

from torch import Tensor

from .base import QuantScheme


class WeightOnly(QuantScheme):
    """``inner``'s weights (name, scale shapes, weight quantization) with unquantized activations: quantize_activation
    returns x [M, K] as is and no scale."""

    activations_quantized = False

    def __init__(self, inner: QuantScheme):
        self.inner = inner
        self.name = inner.name
        self.caps = inner.caps

    def weight_scale_shape(self, e, n, k):
        return self.inner.weight_scale_shape(e, n, k)

    def quantize_weight(self, w: Tensor):
        return self.inner.quantize_weight(w)

    def dequantize_weight(self, q: Tensor, scale):
        return self.inner.dequantize_weight(q, scale)

    def dequantize_expert(self, q: Tensor, scale, e: int):
        return self.inner.dequantize_expert(q, scale, e)

    def quantize_activation(self, x: Tensor):
        return x, None

    def dequantize_activation(self, q: Tensor, scale):
        return q.float() if scale is None else self.inner.dequantize_activation(q, scale)
