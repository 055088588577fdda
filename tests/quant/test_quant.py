"""Quantization schemes: the scale convention (dequantization multiplier = amax / 448 per group,
checked against scales computed here independently), saturation at ±448, NaN propagation,
scale shapes, the dequant(quant(w)) error bound, and all-zero groups."""
import math

import pytest
import torch

from moeflow.quant import FP8_DTYPE, FP8_MAX, SCHEMES, create_scheme, payload_scheme
from moeflow.quant.base import to_fp8

FP8 = ("fp8-tensor", "fp8-channel", "fp8-block")
B = 128


def cdiv(a, b):
    return -(-a // b)


def weight_scales_here(name, w):
    """Independent per-element weight scale amax/448 of each scheme's group, [E, N, K] float64."""
    e, n, k = w.shape
    a = w.double().abs()
    if name == "fp8-tensor":
        s = a.amax(dim=(1, 2), keepdim=True).expand(e, n, k)
    elif name == "fp8-channel":
        s = a.amax(dim=2, keepdim=True).expand(e, n, k)
    else:
        s = torch.empty_like(a)
        for i in range(cdiv(n, B)):
            for j in range(cdiv(k, B)):
                blk = (slice(None), slice(i * B, (i + 1) * B), slice(j * B, (j + 1) * B))
                s[blk] = a[blk].amax(dim=(1, 2), keepdim=True)
    return s / 448.0


def act_scales_here(name, x):
    m, k = x.shape
    a = x.double().abs()
    if name == "fp8-tensor":
        s = a.amax().expand(m, k)
    elif name == "fp8-channel":
        s = a.amax(dim=1, keepdim=True).expand(m, k)
    else:
        s = torch.cat([a[:, j:j + B].amax(dim=1, keepdim=True).expand(-1, a[:, j:j + B].shape[1])
                       for j in range(0, k, B)], dim=1)
    return s / 448.0


def assert_fp8_rounding_bound(deq, ref, scale):
    """e4m3: 3 mantissa bits -> |error| <= |ref| * 2^-4 for normals; subnormal steps are
    2^-9 * scale, so half a step (2^-10 * scale) bounds their error."""
    bound = ref.double().abs() * 2 ** -4 + scale * 2 ** -10
    err = (deq.double() - ref.double()).abs()
    worst = (err - bound).max()
    assert worst <= 1e-12, f"dequant(quant(x)) error exceeds the e4m3 bound by {worst.item():.3e}"


def test_registry_lists_every_scheme():
    assert set(SCHEMES.names()) == {"none", "fp8-tensor", "fp8-channel", "fp8-block"}


def test_to_fp8_saturates_and_keeps_nan():
    x = torch.tensor([1e6, -1e6, 448.0, -448.0, 500.0, 1e30, float("inf"), -float("inf"), 0.5, float("nan")])
    q = to_fp8(x, torch.tensor(1.0)).float()
    assert q[:8].tolist() == [448.0, -448.0, 448.0, -448.0, 448.0, 448.0, 448.0, -448.0]
    assert q[8] == 0.5 and math.isnan(q[9])
    assert torch.finfo(FP8_DTYPE).max == FP8_MAX


@pytest.mark.parametrize("name", FP8)
def test_outliers_never_become_nan(name):
    """A 1e6 outlier sets its group's scale and comes back as itself; nothing becomes NaN."""
    s = create_scheme(name)
    w = torch.randn(2, 256, 256)
    w[1, 3, 7] = 1e6
    q, scale = s.quantize_weight(w)
    deq = s.dequantize_weight(q, scale)
    assert not deq.isnan().any()
    torch.testing.assert_close(deq[1, 3, 7], torch.tensor(1e6), rtol=1e-6, atol=0)
    x = torch.randn(8, 256)
    x[2, 9] = -1e6
    deq_x = s.fake_quantize_activation(x)
    assert not deq_x.isnan().any()
    torch.testing.assert_close(deq_x[2, 9], torch.tensor(-1e6), rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", FP8)
def test_nan_stays_nan(name):
    s = create_scheme(name)
    x = torch.randn(6, 256)
    x[2, 5] = float("nan")
    assert s.fake_quantize_activation(x)[2, 5].isnan()
    w = torch.randn(2, 128, 256)
    w[0, 1, 2] = float("nan")
    assert s.dequantize_weight(*s.quantize_weight(w))[0, 1, 2].isnan()


EXPECTED_SCALE_SHAPE = {
    "none": lambda e, n, k: (),
    "fp8-tensor": lambda e, n, k: (e,),
    "fp8-channel": lambda e, n, k: (e, n),
    "fp8-block": lambda e, n, k: (e, cdiv(n, B), cdiv(k, B)),
}


@pytest.mark.parametrize("e,n,k", ((3, 256, 128), (2, 200, 300), (1, 1, 1), (4, 130, 129)))
@pytest.mark.parametrize("name", FP8)
def test_weight_scale_shapes_and_convention(name, e, n, k):
    s = create_scheme(name)
    w = torch.randn(e, n, k)
    q, scale = s.quantize_weight(w)
    assert q.shape == w.shape and q.dtype == FP8_DTYPE
    assert scale.dtype == torch.float32
    assert tuple(scale.shape) == tuple(s.weight_scale_shape(e, n, k)) == EXPECTED_SCALE_SHAPE[name](e, n, k)
    per_elem = weight_scales_here(name, w)
    deq = s.dequantize_weight(q, scale)
    # the convention: real = q * scale, scale = amax / 448 of the group (HF's weight_scale_inv)
    torch.testing.assert_close(deq.double(), q.double() * per_elem, rtol=1e-6, atol=0)
    assert_fp8_rounding_bound(deq, w, per_elem)


@pytest.mark.parametrize("e,n,k", ((3, 256, 128), (2, 200, 300), (1, 1, 1)))
@pytest.mark.parametrize("name", ("none",) + FP8)
def test_one_expert_dequantized_alone_matches_all_at_once(name, e, n, k):
    """dequantize_expert (the torch references' per-expert form, which never holds every expert in float32) gives
    each expert's slice of dequantize_weight bit for bit."""
    s = create_scheme(name)
    q, scale = s.quantize_weight(torch.randn(e, n, k) * torch.rand(e, 1, 1) * 10)
    whole = s.dequantize_weight(q, scale)
    for i in range(e):
        one = s.dequantize_expert(q, scale, i)
        assert one.shape == (n, k) and one.dtype == torch.float32
        assert torch.equal(one, whole[i])


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn), ids=str)
@pytest.mark.parametrize("m,k", ((5, 256), (3, 384), (0, 128), (4, 200)))
def test_block_activation_scales_broadcast_by_group_give_the_expanded_bits(m, k, dtype):
    """fp8-block activations with K a multiple of 128 broadcast each group's scale (no [M, K] float32 expansion):
    the same bits as multiplying by the expanded scales, NaN and all-zero groups included."""
    s = create_scheme("fp8-block")
    x = (torch.randn(m, k) * torch.rand(m, 1) * 100).to(dtype)
    if m > 1:
        x[0, :128], x[1, 3] = 0, float("nan")
    q, scale = s.quantize_activation(x)
    expanded = scale.repeat_interleave(B, dim=1)[:, :k]
    assert torch.equal(q.view(torch.uint8), to_fp8(x, expanded).view(torch.uint8))
    assert torch.equal(s.dequantize_activation(q, scale).nan_to_num(7.0), (q.float() * expanded).nan_to_num(7.0))
    columns = torch.randn(k, m).to(dtype).T  # not contiguous
    q_cols, scale_cols = s.quantize_activation(columns)
    assert torch.equal(q_cols.view(torch.uint8), s.quantize_activation(columns.contiguous())[0].view(torch.uint8))
    q_t = q_cols.T.contiguous().T  # not contiguous either
    assert torch.equal(s.dequantize_activation(q_t, scale_cols), s.dequantize_activation(q_cols, scale_cols))


@pytest.mark.parametrize("m,k", ((5, 256), (3, 200), (1, 1), (0, 128)))
@pytest.mark.parametrize("name", FP8)
def test_activation_scale_shapes_and_convention(name, m, k):
    s = create_scheme(name)
    x = torch.randn(m, k)
    q, scale = s.quantize_activation(x)
    g = cdiv(k, B) if name == "fp8-block" else 1
    assert q.shape == (m, k) and q.dtype == FP8_DTYPE
    assert scale.shape == (m, g) and scale.dtype == torch.float32
    if m:
        per_elem = act_scales_here(name, x)
        deq = s.dequantize_activation(q, scale)
        torch.testing.assert_close(deq.double(), q.double() * per_elem, rtol=1e-6, atol=0)
        assert_fp8_rounding_bound(deq, x, per_elem)
        assert torch.equal(s.fake_quantize_activation(x), deq)


@pytest.mark.parametrize("name", FP8)
def test_group_maximum_maps_to_448(name):
    """Each group's largest magnitude quantizes to ±448: the whole FP8 range is used."""
    s = create_scheme(name)
    w = torch.randn(2, 256, 256)
    q, _ = s.quantize_weight(w)
    qa = q.float().abs()
    if name == "fp8-tensor":
        peaks = qa.amax(dim=(1, 2))
    elif name == "fp8-channel":
        peaks = qa.amax(dim=2)
    else:
        peaks = qa.view(2, 2, B, 2, B).amax(dim=(2, 4))
    assert (peaks == 448).all()


@pytest.mark.parametrize("name", FP8)
def test_all_zero_groups_give_zeros(name):
    s = create_scheme(name)
    w = torch.randn(3, 256, 256)
    w[1] = 0  # a whole expert (a per-tensor group)
    w[0, 5] = 0  # one output row (a per-channel group)
    w[2, :128, 128:] = 0  # one 128x128 block
    q, scale = s.quantize_weight(w)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    deq = s.dequantize_weight(q, scale)
    zero = w == 0
    assert (deq[zero] == 0).all() and not deq.isnan().any()
    x = torch.randn(4, 256)
    x[1] = 0
    assert (s.fake_quantize_activation(x)[1] == 0).all()
    assert (s.fake_quantize_activation(torch.zeros(3, 256)) == 0).all()  # the whole tensor zero


def test_no_quant_is_identity():
    s = create_scheme("none")
    assert not s.quantized and s.weight_scale_shape(2, 3, 4) == ()
    w = torch.randn(2, 3, 4, dtype=torch.bfloat16)
    q, scale = s.quantize_weight(w)
    assert q is w and scale is None
    assert torch.equal(s.dequantize_weight(q, None), w.float())
    x = torch.randn(5, 4, dtype=torch.float16)
    assert torch.equal(s.fake_quantize_activation(x), x.float())


@pytest.mark.parametrize("name", ("none",) + FP8)
def test_payload_scheme(name):
    """Dispatch payloads travel as FP8: the layer's own scheme, or per-token FP8 for quant none."""
    s = create_scheme(name)
    p = payload_scheme(s)
    assert p is s if s.quantized else p.name == "fp8-channel"


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("name", FP8)
def test_low_precision_inputs(name, dtype):
    """bf16 / fp16 weights and activations quantize like their float32 values."""
    s = create_scheme(name)
    w = torch.randn(2, 128, 256).to(dtype)
    q16, s16 = s.quantize_weight(w)
    q32, s32 = s.quantize_weight(w.float())
    assert torch.equal(q16.view(torch.uint8), q32.view(torch.uint8)) and torch.equal(s16, s32)
    x = torch.randn(4, 256).to(dtype)
    assert torch.equal(s.fake_quantize_activation(x), s.fake_quantize_activation(x.float()))


@pytest.mark.parametrize("name", FP8)
def test_fp8_input_quantizes_as_its_float_values(name):
    """An FP8 tensor quantized again (a payload the dispatcher quantized, a checkpoint's FP8 weights) gives the bits of
    its exact float32 values; torch has no FP8 amax on the CPU (nor abs on CUDA: gpu/test_gpu_runners.py)."""
    s = create_scheme(name)
    for x in (torch.randn(37, 256) * 50, torch.randn(5, 200) * 50):
        x8 = x.clamp(-448, 448).to(FP8_DTYPE)
        q, scale = s.quantize_activation(x8)
        want_q, want_scale = s.quantize_activation(x8.float())
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
    w8 = (torch.randn(3, 256, 384) * 50).clamp(-448, 448).to(FP8_DTYPE)
    q, scale = s.quantize_weight(w8)
    want_q, want_scale = s.quantize_weight(w8.float())
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
