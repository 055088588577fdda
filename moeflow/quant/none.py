"""quant="none": weights and activations stay in the layer dtype (bf16 / fp16 / fp32)."""
from __future__ import annotations

from torch import Tensor

from .base import QuantScheme


class NoQuant(QuantScheme):
    name = "none"
    quantized = False
    activations_quantized = False

    def weight_scale_shape(self, e, n, k):
        return ()

    def quantize_weight(self, w: Tensor):
        return w, None

    def dequantize_weight(self, q: Tensor, scale):
        return q.float()

    def quantize_activation(self, x: Tensor):
        return x, None

    def dequantize_activation(self, q: Tensor, scale):
        return q.float()
