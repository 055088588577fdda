"""Weight-only FP8 in the two Triton GEMMs (gate_up / down with weight_only=True, for GPUs without FP8 MMA): the
activations stay in the layer dtype, the float8_e4m3fn weights are read as bytes and decoded in the K loop
(common.fp8e4m3_decode). Under the CPU interpreter, fp16 and fp32 layers (bf16: tests/gpu/test_gpu_weight_only_fp8.py),
against float64 references that dequantize the weights only, outputs NaN-poisoned: the three FP8 schemes, sorted rows
by index and masked slots, TMA and pointer weights, swapped tiles, split K, the persistent down, edge batches. The
sm_80 compile check of this path: tests/kernels/test_weight_only_compile_sm80.py."""
import pytest
import torch

from triton_interp import SKIP_REASON

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))

if SKIP_REASON is None:
    import triton
    import triton.language as tl

    from moeflow.kernels import common, configs as kc
    from moeflow.kernels.common import fp8e4m3_decode, fp8e4m3_decode_torch
    from moeflow.kernels.gemm import choice, down as down_mod, gate_up as gate_up_mod
    from moeflow.kernels.gemm.choice import GemmKernel
    from moeflow.kernels.gemm.down import down
    from moeflow.kernels.gemm.gate_up import gate_up, gate_up_torch
    from moeflow.quant import create_scheme
    from test_triton_kernels import _gemms_float64, masked_layout, sorted_layout

    @triton.jit
    def _decode_kernel(src, dst, DTYPE: tl.constexpr):
        i = tl.arange(0, 256)
        tl.store(dst + i, fp8e4m3_decode(tl.load(src + i), DTYPE))

from oracle import assert_close
from tolerances import rel_tol

SCHEMES = ["fp8-tensor", "fp8-channel", "fp8-block"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_every_pattern(dtype):
    """All 256 e4m3fn bytes but the two NaNs decode to torch's float8_e4m3fn values, bit for bit (signed zeros,
    subnormals, ±448 included)."""
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.full((256,), float("nan"), dtype=dtype)
    _decode_kernel[(1,)](bits, out, {torch.float16: tl.float16, torch.float32: tl.float32}[dtype])
    want = fp8e4m3_decode_torch(bits).to(dtype)
    keep = (bits != 0x7F) & (bits != 0xFF)
    assert torch.equal(out[keep].view(torch.uint8), want[keep].view(torch.uint8))
    assert want[keep].abs().max() == 448 and (want[keep] == 2 ** -9).any()  # the largest; the smallest subnormal


def shape(scheme):
    """(E, H, I): non-powers of two, multiples of 16 (uint8 weight rows TMA can address); fp8-block's I on its
    128x128 blocks (the gate and up halves each start one), two scale blocks along each GEMM's K."""
    return (4, 176, 256) if scheme == "fp8-block" else (4, 176, 144)


def operands(scheme, dtype, e, h, i):
    """Random FP8 weights (quantized by the scheme from the layer dtype) and their scales."""
    sch = create_scheme(scheme)
    q13, s13 = sch.quantize_weight((torch.randn(e, 2 * i, h) / h ** 0.5).to(dtype))
    q2, s2 = sch.quantize_weight((torch.randn(e, h, i) / i ** 0.5).to(dtype))
    return q13, s13, q2, s2


def use_tma(monkeypatch, on: bool):
    """Operands through TMA descriptors wherever their rows are 16-byte aligned (the interpreter runs descriptor
    loads, whatever the device's kernel target says), or pointer loads everywhere (MOEFLOW_TRITON_TMA=0)."""
    monkeypatch.setenv("MOEFLOW_TRITON_TMA", "1" if on else "0")
    if on:
        def aligned(t, row_stride):
            return t.stride(-1) == 1 and (row_stride * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
        monkeypatch.setattr(common, "tma_rows", aligned)
        monkeypatch.setattr(choice, "tma_rows", aligned)


def spy(monkeypatch, module, name):
    """Record each launch's (weight operand, its constexprs) of module.name while it still runs."""
    seen = []
    kernel = getattr(module, name)
    w_index = 3 if name == "_gate_up_kernel" else 2

    def launch(grid):
        return lambda *a, **kw: seen.append((a[w_index], kw)) or kernel[grid](*a, **kw)
    monkeypatch.setattr(module, name, type("Spy", (), {"__getitem__": lambda _, grid: launch(grid)})())
    return seen


def check(scheme, dtype, layout, src, x, q13, s13, q2, s2, cfg_gu, cfg_d, what):
    """gate_up then down (on gate_up's output) in weight-only mode, outputs poisoned, against the float64 reference of
    the rows (no activation quantization), valid rows; down's empty masked slots 0. -> inter."""
    inter, extra = gate_up(x, None, q13, s13, layout, scheme, "silu", dtype, cfg_gu, poison=True, source_rows=src,
                           weight_only=True)
    assert extra is None and inter.dtype == dtype and inter.shape == (layout.rows, q13.shape[1] // 2)
    route_w = torch.rand(layout.rows)
    out = down(inter, None, q2, s2, route_w, layout, scheme, dtype, cfg_d, poison=True, weight_only=True)
    assert out.dtype == dtype and out.shape == (layout.rows, q2.shape[1])
    rows = x[src] if src is not None else x
    ref_g, ref_d = _gemms_float64(rows, None, q13, s13, q2, s2, route_w, layout, scheme, inter, None)
    valid = layout.valid_rows()
    tol = rel_tol(scheme, dtype)
    assert_close(inter[valid], ref_g[valid], tol, f"{what}: gate_up")
    assert_close(out[valid], ref_d[valid], tol, f"{what}: down")
    assert torch.equal(out[~valid], torch.zeros_like(out[~valid])), what
    return inter


@pytest.mark.parametrize("masked", [False, True], ids=["sorted-by-index", "masked"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_weight_only_gemms(scheme, dtype, masked, monkeypatch):
    """Both GEMMs: an empty expert, a block over two experts' rows, a one-row expert, partial N and K tiles. Sorted:
    rows by index (the kernel gathers them), weights through TMA descriptors over the bytes, tiles swapped in one
    GEMM; masked: pointer loads. fp8-block's tiles take both scale paths (one weight scale a tile, BLOCK_N <= 128;
    one a column, 256). The launches get uint8 weights, W_FP8_BITS, and IEEE float32 dots for fp32 (which the
    interpreter, computing every dot in full precision, would not show)."""
    use_tma(monkeypatch, not masked)
    gu_seen, d_seen = spy(monkeypatch, gate_up_mod, "_gate_up_kernel"), spy(monkeypatch, down_mod, "_down_kernel")
    e, h, i = shape(scheme)
    q13, s13, q2, s2 = operands(scheme, dtype, e, h, i)
    if masked:
        layout, src = masked_layout([5, 0, 16, 1], 17), None
        x = torch.randn(layout.rows, h).to(dtype)
        x[~layout.valid_rows()] = float("nan")  # empty slots: never read into a valid row
    else:
        layout = sorted_layout([5, 0, 17, 1])
        x = torch.randn(9, h).to(dtype)
        src = torch.randint(0, 9, (layout.rows,))
    wide = 256 if scheme == "fp8-block" else 64
    if masked:
        cfg_gu, cfg_d = kc.GemmConfig(32, 64, 32), kc.GemmConfig(16, 64, 64, swap_ab=1)
    else:
        cfg_gu, cfg_d = kc.GemmConfig(16, wide, 64, swap_ab=1), kc.GemmConfig(16, wide, 64)
    check(scheme, dtype, layout, src, x, q13, s13, q2, s2, cfg_gu, cfg_d, f"{scheme} {dtype}")
    for w, kw in gu_seen + d_seen:
        assert kw["W_FP8_BITS"] and kw["DOT_IEEE"] == (dtype == torch.float32) and not kw["PROMOTE"]
        base = w if masked else w.base  # a TensorDescriptor where TMA reads the weights
        assert isinstance(base, torch.Tensor) and base.dtype == torch.uint8


@pytest.mark.parametrize("scheme,dtype,rows", [("fp8-tensor", torch.float32, "masked"),
                                               ("fp8-channel", torch.float16, "in order through TMA"),
                                               ("fp8-block", torch.float16, "by index")],
                         ids=["fp8-tensor-fp32-masked", "fp8-channel-fp16-x_tma", "fp8-block-fp16-by-index"])
def test_weight_only_split_k(scheme, dtype, rows, monkeypatch):
    """Split K (GemmConfig.split_k) in weight-only mode: float32 partial sums with the weight scales applied, summed
    by the none scheme's second launch (gate_up: 3 K steps over 2 splits; down: more splits than K steps, clamped):
    masked slots, sorted rows by index gathered into order and read through TMA (x_tma), rows by index in the kernel."""
    use_tma(monkeypatch, True)
    e, h, i = shape(scheme)
    q13, s13, q2, s2 = operands(scheme, dtype, e, h, i)
    if rows == "masked":
        layout, src = masked_layout([3, 0, 6, 1], 8), None
        x = torch.randn(layout.rows, h).to(dtype)
    else:
        layout = sorted_layout([3, 0, 9, 1])
        x = torch.randn(7, h).to(dtype)
        src = torch.randint(0, 7, (layout.rows,))
    cfg_gu = kc.GemmConfig(16, 64, 64, split_k=2, x_tma=int(rows == "in order through TMA"))
    cfg_d = kc.GemmConfig(16, 64, 64, split_k=5)
    check(scheme, dtype, layout, src, x, q13, s13, q2, s2, cfg_gu, cfg_d, f"{scheme} {dtype} split K, rows {rows}")


@pytest.mark.parametrize("counts", [[0, 0, 0], [0, 1, 0], [0, 0, 40]], ids=["T=0", "T=1", "all to one expert"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_weight_only_edge_batches(scheme, counts):
    """No rows, one row, every row on one expert (three row blocks, the last partial), fp16."""
    e, h, i = shape(scheme)
    e = len(counts)
    q13, s13, q2, s2 = operands(scheme, torch.float16, e, h, i)
    layout = sorted_layout(counts)
    x = torch.randn(layout.rows, h).half()
    cfg = kc.GemmConfig(16, 64, 64)
    if layout.rows == 0:
        inter, extra = gate_up(x, None, q13, s13, layout, scheme, "silu", torch.float16, cfg, weight_only=True)
        out = down(inter, None, q2, s2, torch.rand(0), layout, scheme, torch.float16, cfg, weight_only=True)
        assert inter.shape == (0, i) and extra is None and out.shape == (0, h)
        return
    check(scheme, torch.float16, layout, None, x, q13, s13, q2, s2, cfg, cfg, f"{scheme} {counts}")


def test_weight_only_kernel_choice_and_persistent_down(monkeypatch):
    """No Gluon kernel in weight-only mode even where one would run (a Hopper-like device, faked), with the reason in
    words; the persistent down runs it (TMA operands, fp16: the same bits as one program a tile), not for fp32 (its
    dots are not IEEE)."""
    monkeypatch.setattr(choice, "_gluon_blocker", lambda device: None)  # as on Hopper
    scheme, dtype = "fp8-block", torch.float16
    e, h, i = shape(scheme)
    q13, s13, q2, s2 = operands(scheme, dtype, e, h, i)
    layout = sorted_layout([5, 0, 17, 1])
    x, a = torch.randn(layout.rows, h).half(), torch.randn(layout.rows, i).half()
    tuned = kc.GemmConfig(64, 128, 128, scale_overlap=1, warp_specialize=1)
    got = choice.choose_gate_up(x, None, q13, s13, layout, scheme, tuned, weight_only=True)
    assert got.kernel is GemmKernel.TRITON and "weight-only FP8" in got.reason
    got = choice.choose_down(a, None, q2, s2, layout, scheme, dtype, tuned, weight_only=True)
    assert got.kernel is GemmKernel.TRITON and "weight-only FP8" in got.reason
    use_tma(monkeypatch, True)
    persistent = kc.GemmConfig(16, 64, 64, programs_per_sm=2)
    assert choice.choose_down(a, None, q2, s2, layout, scheme, dtype, persistent,
                              weight_only=True).kernel is GemmKernel.TRITON_PERSISTENT
    assert choice.choose_down(a.float(), None, q2, s2, layout, scheme, torch.float32, persistent,
                              weight_only=True).kernel is GemmKernel.TRITON
    route_w = torch.rand(layout.rows)
    want = down(a, None, q2, s2, route_w, layout, scheme, dtype, kc.GemmConfig(16, 64, 64), poison=True,
                weight_only=True)
    got = down(a, None, q2, s2, route_w, layout, scheme, dtype, persistent, poison=True, weight_only=True)
    assert not want.isnan().any() and torch.equal(got, want)


def test_weight_only_refuses_other_operands():
    """weight_only takes an FP8 scheme, unscaled activations and float8_e4m3fn weights."""
    sch = create_scheme("fp8-channel")
    q13, s13 = sch.quantize_weight(torch.randn(2, 64, 32))
    layout = sorted_layout([2, 1])
    x = torch.randn(3, 32)
    cfg = kc.GemmConfig(16, 32, 32)
    xq, xs = sch.quantize_activation(x)
    for args in ((x, None, q13, s13, "none"), (xq, xs, q13, s13, "fp8-channel"),
                 (x, None, q13.float(), s13, "fp8-channel")):
        with pytest.raises(ValueError, match="weight-only"):
            gate_up(*args[:4], layout, args[4], "silu", torch.float32, cfg, weight_only=True)
        with pytest.raises(ValueError, match="weight-only"):
            down(args[0], args[1], args[2][:, :32], args[3], torch.rand(3), layout, args[4], torch.float32, cfg,
                 weight_only=True)


def test_weight_only_reference_is_the_scheme_reference_without_activation_scales():
    """gate_up_torch / down_torch serve as the weight-only reference: x in the layer dtype with no scale dequantizes
    the weights only (the float64 reference agrees within float32 rounding)."""
    from moeflow.kernels.gemm.down import down_torch
    scheme = "fp8-block"
    e, h, i = 2, 128, 128
    q13, s13, q2, s2 = operands(scheme, torch.float32, e, h, i)
    layout = sorted_layout([3, 4])
    x = torch.randn(7, h)
    route_w = torch.rand(7)
    inter = gate_up_torch(x, None, q13, s13, layout, scheme, "silu", torch.float32)
    out = down_torch(inter, None, q2, s2, route_w, layout, scheme, torch.float32)
    ref_g, ref_d = _gemms_float64(x, None, q13, s13, q2, s2, route_w, layout, scheme, inter, None)
    assert_close(inter, ref_g, 1e-6, "gate_up_torch")
    assert_close(out, ref_d, 1e-6, "down_torch")
