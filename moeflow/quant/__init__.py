"""Quantization schemes: quantize weights, quantize activations (dynamic), dequantize.

Registry: ``SCHEMES`` maps "none", "fp8-tensor", "fp8-channel", "fp8-block" to their classes;
``create_scheme(name)`` builds one (``weight_only=True``: weight_only.py, FP8 weights with unquantized activations).
Conventions are documented in ``quant/base.py``.
"""
from ..registry import Registry
from .base import FP8_DTYPE, FP8_MAX, QuantScheme
from .fp8_block import FP8Block
from .fp8_channel import FP8Channel
from .fp8_tensor import FP8Tensor
from .none import NoQuant
from .weight_only import WeightOnly

SCHEMES: Registry[QuantScheme] = Registry("quant scheme")
for _cls in (NoQuant, FP8Tensor, FP8Channel, FP8Block):
    SCHEMES.register(_cls)


def create_scheme(name: str, weight_only: bool = False) -> QuantScheme:
    """The scheme ``name``; weight_only (an FP8 scheme on a GPU without FP8 tensor cores: Plan.weight_only): its
    weights with activations left in the layer dtype (weight_only.WeightOnly)."""
    scheme = SCHEMES.get(name)()
    return WeightOnly(scheme) if weight_only and scheme.quantized else scheme


def payload_scheme(scheme: QuantScheme) -> QuantScheme:
    """How a dispatcher compresses token payloads to FP8: with the layer's own scheme when it is
    quantized (the runner then uses the payload as is), else per-token (fp8-channel activations:
    scale [M, 1]), which the runner dequantizes back to the layer dtype."""
    return scheme if scheme.activations_quantized else FP8Channel()


def row_local(scheme: QuantScheme) -> bool:
    """Whether ``scheme`` quantizes each activation row independently of the others (probed, not
    looked up by name: a row quantized alone gets the scale it gets inside a larger batch)."""
    import torch

    x = torch.tensor([[1.0, -2.0], [30.0, 4.0]])
    _, alone = scheme.quantize_activation(x[:1])
    _, together = scheme.quantize_activation(x)
    return alone is None or torch.equal(alone[0], together[0])


__all__ = ["SCHEMES", "create_scheme", "payload_scheme", "row_local", "QuantScheme", "WeightOnly", "FP8_DTYPE",
           "FP8_MAX"]
