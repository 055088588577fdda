"""quant="fp8-channel": per-output-channel weight scales × per-token dynamic activation scales.

Weight scale: [E, N] float32 (one per output row of each expert). Activation scale: [M, 1], the
amax of each row. This is the "row-wise" scaling of torch._scaled_grouped_mm.
"""
from __future__ import annotations

from torch import Tensor

from .base import QuantScheme, amax_to_scale, exact_float, to_fp8


class FP8Channel(QuantScheme):
    name = "fp8-channel"

    def weight_scale_shape(self, e, n, k):
        return (e, n)

    def quantize_weight(self, w: Tensor):
        w = exact_float(w)
        amax = w.abs().amax(dim=2) if w.shape[2] else w.new_zeros(w.shape[:2])
        scale = amax_to_scale(amax)
        return to_fp8(w, scale[:, :, None]), scale

    def dequantize_weight(self, q: Tensor, scale: Tensor):
        return q.float() * scale.float()[:, :, None]

    def quantize_activation(self, x: Tensor):
        x = exact_float(x)
        amax = x.abs().amax(dim=1, keepdim=True) if x.shape[1] else x.new_zeros(x.shape[0], 1)
        scale = amax_to_scale(amax)
        return to_fp8(x, scale), scale

    def dequantize_activation(self, q: Tensor, scale: Tensor):
        return q.float() * scale.float()
