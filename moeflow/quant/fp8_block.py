"""quant="fp8-block": 128×128 weight blocks × 1×128 dynamic activation groups (DeepSeek-V3).

Weight scale: [E, ceil(N/128), ceil(K/128)] float32, one per 128×128 block (Hugging Face's
``weight_scale_inv``). Activation scale: [M, ceil(K/128)], one per 128 consecutive values of a row.
Layers using it need hidden_size and intermediate_size divisible by 128 (declared in ``caps``)
so that activation groups line up with weight blocks and the fused gate/up rows split on a block.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from ..capabilities import SchemeCaps, ShapeRule
from .base import QuantScheme, amax_to_scale, exact_float, to_fp8

BLOCK = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expand_blocks(scale: Tensor, n: int, k: int) -> Tensor:
    """[..., ceil(n/128), ceil(k/128)] block scales -> [..., n, k] per-element scales."""
    return scale.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)[..., :n, :k]


class FP8Block(QuantScheme):
    name = "fp8-block"
    caps = SchemeCaps(shape_rules=(ShapeRule("hidden_size", BLOCK), ShapeRule("intermediate_size", BLOCK)))

    def weight_scale_shape(self, e, n, k):
        return (e, _cdiv(n, BLOCK), _cdiv(k, BLOCK))

    def quantize_weight(self, w: Tensor):
        e, n, k = w.shape
        nb, kb = _cdiv(n, BLOCK), _cdiv(k, BLOCK)
        padded = F.pad(w.float(), (0, kb * BLOCK - k, 0, nb * BLOCK - n))
        amax = padded.abs().view(e, nb, BLOCK, kb, BLOCK).amax(dim=(2, 4))
        scale = amax_to_scale(amax)
        if n % BLOCK == 0 and k % BLOCK == 0:  # broadcast over the blocks: no [E, N, K] scale tensor
            q = to_fp8(padded.view(e, nb, BLOCK, kb, BLOCK), scale[:, :, None, :, None])
            return q.view(e, n, k), scale
        return to_fp8(w, expand_blocks(scale, n, k)), scale

    def dequantize_weight(self, q: Tensor, scale: Tensor):
        n, k = q.shape[-2:]
        if n % BLOCK == 0 and k % BLOCK == 0:  # the same products, without expanding the scales
            lead = q.shape[:-2]
            blocks = q.float().reshape(*lead, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
            return (blocks * scale.float()[..., :, None, :, None]).reshape(*lead, n, k)
        return q.float() * expand_blocks(scale.float(), n, k)

    def quantize_activation(self, x: Tensor):
        m, k = x.shape
        g = _cdiv(k, BLOCK)
        if k % BLOCK == 0:  # the same bits, with the scales broadcast by group, not expanded to [M, K] float32
            x = exact_float(x)
            scale = amax_to_scale(x.reshape(m, g, BLOCK).abs().amax(dim=2))  # abs and max are exact in any dtype
            return to_fp8(x.reshape(m, g, BLOCK), scale[:, :, None]).view(m, k), scale
        padded = F.pad(x.float(), (0, g * BLOCK - k))
        scale = amax_to_scale(padded.abs().view(m, g, BLOCK).amax(dim=2))
        return to_fp8(x, scale.repeat_interleave(BLOCK, dim=1)[:, :k]), scale

    def dequantize_activation(self, q: Tensor, scale: Tensor):
        m, k = q.shape
        if k % BLOCK == 0:
            return (q.float().reshape(m, k // BLOCK, BLOCK) * scale.float()[:, :, None]).view(m, k)
        return q.float() * scale.float().repeat_interleave(BLOCK, dim=1)[:, :k]
