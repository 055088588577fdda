"""The quantization-scheme interface (QuantScheme) and the FP8 helpers the schemes share (amax_to_scale, to_fp8).

A scale is the *dequantization multiplier*, float32: ``real ≈ float(q) * scale``, as Hugging Face's
``*_scale_inv`` tensors, so checkpoints load without inversion (QuantScheme has the shapes).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import Tensor

from ..capabilities import SchemeCaps

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_MIN_AMAX = 1e-12


def amax_to_scale(amax: Tensor) -> Tensor:
    """amax (any shape) -> float32 dequantization scale, never zero: amax times float32(1 / 448).

    A multiply, not ``amax / 448``: torch on CUDA divides a tensor by a Python scalar as a multiply by the scalar's
    float32 reciprocal, and on the CPU in IEEE division, which differ by one ulp for about half of all amaxes. The
    multiply gives the same bits on both, and the kernels use it too (kernels/common.fp8_scale).
    """
    return amax.float().clamp(min=_MIN_AMAX) * (1.0 / FP8_MAX)


def exact_float(x: Tensor) -> Tensor:
    """x as it is, or an FP8 x as float32 (exactly its values): torch has no abs for FP8 on CUDA, nor an amax on
    the CPU, and an FP8 payload quantized again (tests/gpu/test_gpu_triton.py, test_prequantized_payload) is one."""
    return x.float() if x.dtype.itemsize == 1 else x


def to_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """Saturating quantize: float32 ``x * (1 / scale)`` clamped to ±448 then cast (NaN stays NaN).

    A multiply by the scale's reciprocal, not a division, as vLLM's and SGLang's FP8 kernels do: the kernels take the
    reciprocal once a row or group and multiply each element (kernels/common.to_fp8, the same bits). The two differ
    from ``x / scale`` only where the float32 quotients straddle an e4m3 rounding boundary, by one e4m3 step.
    """
    return (x.float() * torch.reciprocal(scale.float())).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


class QuantScheme(ABC):
    """A quantization scheme of expert weights and activations.

    Scale convention (all schemes): a scale is the *dequantization multiplier*, float32:
    ``real ≈ float(q) * scale``. This is exactly Hugging Face's ``*_scale_inv`` tensors (DeepSeek-V3's
    ``weight_scale_inv``), so checkpoints load without inversion. Quantization multiplies by the scale's
    reciprocal and saturates to ±448 (FP8 e4m3fn's largest finite value): an overflow never becomes NaN.
    Scales are amax · (1/448) over their group (a group of all zeros gets a tiny positive scale, so it
    quantizes to zeros instead of NaN).

    Weights are [E, N, K] (N output rows, K the reduction dim: gate_up_proj [E, 2I, H],
    down_proj [E, H, I]). Activations are [M, K] rows; their scales are always [M, G] float32 so that
    they travel with their rows through permutations and all-to-all: G = 1 for per-tensor and
    per-token schemes, G = ceil(K / 128) for 1x128 groups."""

    name: ClassVar[str]
    quantized: ClassVar[bool] = True  # weights stored quantized (FP8)
    activations_quantized: bool = True  # activations quantized before the GEMMs (False: "none", weight-only FP8)
    caps: ClassVar[SchemeCaps] = SchemeCaps()

    @property
    def weight_only(self) -> bool:
        """FP8 weights with activations left in the layer dtype (weight_only.WeightOnly)."""
        return self.quantized and not self.activations_quantized

    @abstractmethod
    def weight_scale_shape(self, e: int, n: int, k: int) -> tuple[int, ...]:
        """Shape of the scale of a weight [e, n, k]."""

    @abstractmethod
    def quantize_weight(self, w: Tensor) -> tuple[Tensor, Tensor | None]:
        """w: [E, N, K] floating -> (q [E, N, K] storage dtype, scale weight_scale_shape or None)."""

    @abstractmethod
    def dequantize_weight(self, q: Tensor, scale: Tensor | None) -> Tensor:
        """-> [E, N, K] float32."""

    def dequantize_expert(self, q: Tensor, scale: Tensor | None, e: int) -> Tensor:
        """Expert ``e`` of q [E, N, K] (scale of weight_scale_shape) -> [N, K] float32: one expert's copy, where
        ``dequantize_weight`` of the whole [E, N, K] would hold every expert's in float32 at once (28 GiB for
        DeepSeek-V3's gate_up)."""
        return self.dequantize_weight(q[e:e + 1], None if scale is None else scale[e:e + 1])[0]

    @abstractmethod
    def quantize_activation(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """x: [M, K] floating -> (q [M, K], scale [M, G] float32 or None). Dynamic: scales from x."""

    @abstractmethod
    def dequantize_activation(self, q: Tensor, scale: Tensor | None) -> Tensor:
        """-> [M, K] float32."""

    def fake_quantize_activation(self, x: Tensor) -> Tensor:
        """Quantize then dequantize: what the activation looks like to the GEMM, float32."""
        return self.dequantize_activation(*self.quantize_activation(x))
