"""Quantization schemes: quantize weights, quantize activations (dynamic), dequantize.

Registry: ``SCHEMES`` maps "none", "fp8-tensor", "fp8-channel", "fp8-block" to their classes;
``create_scheme(name)`` builds one. Conventions are documented in ``quant/base.py``.
"""
from ..registry import Registry
from .base import FP8_DTYPE, FP8_MAX, QuantScheme
from .fp8_block import FP8Block
from .fp8_channel import FP8Channel
from .fp8_tensor import FP8Tensor
from .none import NoQuant

SCHEMES: Registry[QuantScheme] = Registry("quant scheme")
for _cls in (NoQuant, FP8Tensor, FP8Channel, FP8Block):
    SCHEMES.register(_cls)


def create_scheme(name: str) -> QuantScheme:
    return SCHEMES.get(name)()


def payload_scheme(scheme: QuantScheme) -> QuantScheme:
    """How a dispatcher compresses token payloads to FP8: with the layer's own scheme when it is
    quantized (the runner then uses the payload as is), else per-token (fp8-channel activations:
    scale [M, 1]), which the runner dequantizes back to the layer dtype."""
    return scheme if scheme.quantized else FP8Channel()


__all__ = ["SCHEMES", "create_scheme", "payload_scheme", "QuantScheme", "FP8_DTYPE", "FP8_MAX"]
