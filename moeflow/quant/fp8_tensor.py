"""quant="fp8-tensor": one scale per expert weight matrix × one dynamic scale per activation tensor.

Weight scale: [E] float32 (per expert, per matrix). Activation scale: the amax of the whole
[M, K] tensor the GEMM sees, stored per row as [M, 1] (all rows equal).
"""
from __future__ import annotations

from torch import Tensor

from .base import QuantScheme, amax_to_scale, exact_float, to_fp8


class FP8Tensor(QuantScheme):
    name = "fp8-tensor"

    def weight_scale_shape(self, e, n, k):
        return (e,)

    def quantize_weight(self, w: Tensor):
        w = exact_float(w)
        scale = amax_to_scale(w.abs().amax(dim=(1, 2)) if w.numel() else w.new_zeros(w.shape[0]))
        return to_fp8(w, scale[:, None, None]), scale

    def dequantize_weight(self, q: Tensor, scale: Tensor):
        return q.float() * scale.float()[:, None, None]

    def quantize_activation(self, x: Tensor):
        x = exact_float(x)
        amax = x.abs().amax() if x.numel() else x.new_zeros(())
        scale = amax_to_scale(amax).expand(x.shape[0], 1).contiguous()
        return to_fp8(x, scale), scale

    def dequantize_activation(self, q: Tensor, scale: Tensor):
        return q.float() * scale.float()
