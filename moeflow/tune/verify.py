"""Check a timed kernel config's output before `moeflow tune` records it (tune/autotune.tune).

Timing alone would record a config that runs fast and computes wrong values: a compiler fault at one tile
shape, a race in a warp-specialized pipeline, a tile the fit guards let through. tune() therefore runs the
fastest candidate of each GEMM once more with its outputs poisoned (NaN first) and compares it with the torch
reference (gemm_error); a candidate that fails is refused (logged, and listed in the file's "measured" notes) and
the next fastest is checked (first_correct), so a table only ever holds configs that computed right on this GPU.
The float64 reference costs far more than the GEMM, once per GEMM and token count tuned.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..experts.base import gated_activation
from ..quant import FP8_DTYPE, create_scheme

# The limit catches faults, not rounding: a correct output is off by its own last rounding only (under 4e-3 in bf16,
# whose step is 2^-8 of a value). gate_up's fp8 groups are compared with the reference quantized the same way: an
# element whose value before quantization lies near a rounding boundary may still land on the neighbouring fp8 value
# (a step of 2^-3), a few 1e-3 in all (against the unquantized reference they would be ~2.5e-2 off). A row block
# left unwritten, a wrong expert's weights or a K step missing are off by 0.2 or more, or NaN.
MAX_REL_ERR = 2e-2


def gemm_error(gemm: str, scheme: str, activation: str, offsets: Tensor, inputs: tuple, weights: tuple,
               outputs: tuple, layer_dtype: torch.dtype = torch.bfloat16) -> float:
    """A sorted-layout GEMM's output against the reference -> relative error (inf if any element is not finite).

    gemm "gate_up": inputs (x [R, H] layer dtype or fp8, x_scale [R, G] or None), weights (w13 [E, 2I, H],
    w13_scale or None), outputs (inter [R, I], extra): inter in the layer dtype, or fp8 groups with extra their
    scale [R, I/128] float32 -> act(gate) * up; fp8-tensor / fp8-channel's extra, the amax of |inter| the kernel
    gathers (one [1] or a row's [R]), must match the output's own within 1% (else inf).
    gemm "down": inputs (a [R, I], a_scale, route_w [R] float32), weights (w2 [E, H, I], w2_scale),
    outputs (out [R, H],) -> route_w * (a @ w2[e].T).
    offsets: [E + 1] int64, expert e's rows offsets[e] .. offsets[e + 1] (sorted layout, rows in order, as the
    tuner's batches). An fp8 output is compared with the reference rounded to ``layer_dtype`` and quantized by the
    scheme as the kernel's epilogue does: what remains are rounding flips where float32 and float64 sums straddle
    a step.
    The check: every output element written (no NaN left of the poison fill); every expert's rows against the
    reference computed in float64 expert by expert from the same quantized operands (one expert's weights
    dequantized at a time: a whole-layer reference of DeepSeek-V3's 256 experts would take tens of GB); the
    relative Frobenius error over all rows, to be compared with MAX_REL_ERR."""
    sch = create_scheme(scheme)
    out = outputs[0]
    out_scale = outputs[1] if out.dtype == FP8_DTYPE else None
    if not _all_finite(out) or (out_scale is not None and not _all_finite(out_scale)):
        return math.inf
    extra = outputs[1] if len(outputs) > 1 else None
    if gemm == "gate_up" and out_scale is None and extra is not None:  # fp8-tensor / -channel: the amax gathered
        amax = out.abs().amax(dim=1) if extra.numel() == out.shape[0] else out.abs().amax().reshape(1)
        if out.shape[0] and not torch.allclose(extra.float(), amax.float(), rtol=1e-2, atol=0):
            return math.inf
    offs = offsets.tolist()
    w, w_scale = weights
    a, a_scale = inputs[0], inputs[1]
    num = den = torch.zeros((), dtype=torch.float64, device=out.device)  # summed on the device: one sync at the end
    for e in range(len(offs) - 1):
        lo, hi = offs[e], offs[e + 1]
        if hi == lo:
            continue
        af = (sch.dequantize_activation(a[lo:hi], a_scale[lo:hi]) if a_scale is not None else a[lo:hi].float())
        wf = sch.dequantize_expert(w, w_scale, e)
        prod = af.double() @ wf.double().T
        if gemm == "gate_up":
            ref = gated_activation(prod, activation)
            ref = (sch.fake_quantize_activation(ref.to(layer_dtype)) if out_scale is not None else ref).double()
        else:
            ref = prod * inputs[2][lo:hi].double()[:, None]
        got = (sch.dequantize_activation(out[lo:hi], out_scale[lo:hi]) if out_scale is not None
               else out[lo:hi]).double()
        num = num + (got - ref).square().sum()
        den = den + ref.square().sum()
    num, den = num.item(), den.item()
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return math.sqrt(num / den)


def _all_finite(t: Tensor) -> bool:
    """No NaN or inf in ``t`` (float8_e4m3fn: no NaN, its only non-finite value, bits S.1111.111), without an upcast
    of the whole output (DeepSeek-V3's down at T = 16384 is 1.9 GB of bf16)."""
    if t.dtype == FP8_DTYPE:
        return not bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())
    return bool(torch.isfinite(t).all())


def first_correct(order: list, check) -> tuple[object | None, list[tuple[object, float]]]:
    """Candidates ``order`` (fastest first), check(c) -> relative error -> (the first whose error is within
    MAX_REL_ERR, or None; [(candidate, error)] of those refused before it)."""
    refused = []
    for c in order:
        err = check(c)
        if err <= MAX_REL_ERR:  # NaN never is
            return c, refused
        refused.append((c, err))
    return None, refused
