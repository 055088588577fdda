"""kernels/gemm/warp_specialized.py (the warp-specialized Gluon GEMMs, GemmConfig.warp_specialize) on a Hopper GPU.
The down: against a float64 reference on fresh random data with NaN-poisoned outputs: empty experts, every row to one
expert, one row, no rows, K loops of 1, 2, 12 and 224 steps (a partial last step), H off the tiles, weights
shared by every expert (stride 0); grids of 1 and 3 programs, so that each program runs many tiles through both
consumer warpgroups by turns; the layer through a tuned file that picks it. Its tiles: 128 x 128 and 64 x 256 a
consumer, and 128 x 256 shared by the two (COOP). The gate_up: against a float64 reference, rows by index (copied
into order first) and in order, every activation, the same edge batches and grids, in 128 x 64, 64 x 128 and
128 x 128 (COOP) tiles. The fp8-block down: against the float64 reference of the dequantized operands and bit for
bit against the Triton kernel, K loops of 1, 3, 6, 7 and 112 steps (every loop-body form), the same edge batches
and grids, also in the wide 64 x 256 tiles. The fp8-block gate_up: bit for bit against the Triton kernel (fp8
intermediate and group scales) and, dequantized, against the float64 reference; rows in order and by index, K
loops of 1-56 steps, the same edge batches and grids.
Run: pytest -m gpu tests/gpu
"""
import pytest
import torch

from moeflow.kernels.configs import GemmConfig
from moeflow.kernels.gemm.tiles import fit
from moeflow.layouts import offsets_from_counts
from gluon_hopper import MARKS
from oracle import assert_close, replayed
from test_gpu_down_wgmma import operands as fp8_operands, reference as fp8_reference
from moeflow.kernels.gemm.choice import GemmKernel, choose_down, choose_gate_up  # noqa: E402
WS = GemmKernel.GLUON_WARP_SPECIALIZED
WGMMA_DOWN = (GemmKernel.GLUON_WGMMA, GemmKernel.GLUON_WGMMA_PERSISTENT)

pytestmark = MARKS

if torch.cuda.is_available():
    from moeflow.kernels.gemm import warp_specialized as down_ws
    from moeflow.kernels.common import RowLayout
    from moeflow.kernels.gemm.down import down

TILES = ([GemmConfig(128, 128, 64, 8, 4, s, warp_specialize=1) for s in (2, 5, 6)]
         + [GemmConfig(128, 256, 64, 8, 4, s, warp_specialize=1) for s in (2, 4)]  # COOP: 64 rows a consumer
         + [GemmConfig(64, 256, 64, 8, 4, 4, warp_specialize=1)])
GU_TILES = ([GemmConfig(128, 64, 64, 8, 4, s, warp_specialize=1) for s in (2, 6)]
            + [GemmConfig(128, 128, 64, 8, 4, s, warp_specialize=1) for s in (2, 4)]  # COOP
            + [GemmConfig(64, 128, 64, 8, 4, 5, warp_specialize=1)])
tile_id = lambda c: f"{c.block_m}x{c.block_n}s{c.num_stages}"


def operands(counts, h, i, dtype=torch.bfloat16, shared_weights=False):
    counts = torch.tensor(counts, dtype=torch.int32, device="cuda")
    e, r = counts.numel(), int(counts.sum())
    layout = RowLayout(False, offsets_from_counts(counts), e, 0, r)
    w = (torch.randn(1 if shared_weights else e, h, i, device="cuda") / i ** 0.5).to(dtype)
    if shared_weights:
        w = w.expand(e, h, i)
    return layout, torch.randn(r, i, device="cuda").to(dtype), w, torch.rand(r, device="cuda")


def reference(layout, a, w, rw):
    """float64: route_w * a @ w[e].T per row."""
    bounds = layout.meta.tolist()
    out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float64, device="cuda")
    for e in range(len(bounds) - 1):
        lo, hi = bounds[e], bounds[e + 1]
        out[lo:hi] = (a[lo:hi].double() @ w[e].double().T) * rw[lo:hi, None].double()
    return out


@pytest.mark.parametrize("cfg", TILES, ids=tile_id)
@pytest.mark.parametrize("sms", [None, 1, 3])
@pytest.mark.parametrize("counts,h,i", [
    ([37, 0, 300, 1, 0, 129, 64, 2], 384, 768),   # empty experts, rows off the blocks; 12 K steps
    ([0, 0, 513, 0], 256, 128),                    # every row to one expert; 2 steps
    ([1], 128, 64),                                # one row; one step
    ([90, 41, 7], 200, 72),                        # H off the N tiles, I off the K steps (a partial step)
    ([200, 300], 256, 14336),                      # Mixtral's K loop: 224 steps
])
def test_matches_reference(cfg, sms, counts, h, i, poison, monkeypatch):
    if sms is not None:  # few programs: each runs many tiles, its consumers by turns
        monkeypatch.setattr(down_ws, "num_sms", lambda device: sms)
    layout, a, w, rw = operands(counts, h, i)
    assert choose_down(a, None, w, None, layout, "none", torch.bfloat16, cfg).kernel is WS
    got = down(a, None, w, None, rw, layout, "none", torch.bfloat16, cfg, poison=True)
    assert not got.isnan().any()
    assert_close(got, reference(layout, a, w, rw), 1e-2, f"ws down {counts} H={h} I={i} sms={sms}")


@pytest.mark.parametrize("cfg", GU_TILES, ids=tile_id)
@pytest.mark.parametrize("sms", [None, 3])
@pytest.mark.parametrize("indexed", [False, True])
@pytest.mark.parametrize("counts,h,i,act", [
    ([37, 0, 300, 1, 0, 129, 64, 2], 768, 384, "silu"),  # empty experts; 12 K steps
    ([0, 0, 513, 0], 128, 256, "gelu"),                   # every row to one expert; 2 steps
    ([1], 64, 64, "gelu_tanh"),                           # one row; one step
    ([90, 41, 7], 200, 72, "silu"),                       # I off the N tiles, H off the K steps
])
def test_gate_up_matches_reference(cfg, sms, indexed, counts, h, i, act, poison, monkeypatch):
    from moeflow.experts.base import gated_activation
    from moeflow.kernels.gemm.gate_up import gate_up
    if sms is not None:
        monkeypatch.setattr(down_ws, "num_sms", lambda device: sms)
    c = torch.tensor(counts, dtype=torch.int32, device="cuda")
    e, r = c.numel(), int(c.sum())
    layout = RowLayout(False, offsets_from_counts(c), e, 0, r)
    w13 = (torch.randn(e, 2 * i, h, device="cuda") / h ** 0.5).bfloat16()
    x = torch.randn(max(r, 1), h, device="cuda").bfloat16()
    src = torch.randperm(r, device="cuda") if indexed else None  # rows by index: x[src[r]]
    copy_rows = torch.argsort(src).view(r, 1) if indexed else None
    assert choose_gate_up(x, None, w13, None, layout, "none", cfg).kernel is WS
    got, extra = gate_up(x if indexed else x[:r], None, w13, None, layout, "none", act, torch.bfloat16, cfg,
                         poison=True, source_rows=src, copy_rows=copy_rows)
    assert extra is None and not got.isnan().any()
    rows = x[src] if indexed else x[:r]
    bounds = layout.meta.tolist()
    want = torch.zeros(r, i, dtype=torch.float64, device="cuda")
    for k in range(e):
        lo, hi = bounds[k], bounds[k + 1]
        pre = rows[lo:hi].double() @ w13[k].double().T
        want[lo:hi] = gated_activation(pre, act)
    assert_close(got, want, 1e-2, f"ws gate_up {counts} H={h} I={i} {act} indexed={indexed} sms={sms}")


FP8_TILES = [GemmConfig(64, 128, 128, 8, 4, 4, warp_specialize=1), GemmConfig(64, 128, 128, 8, 4, 8, warp_specialize=1),
             GemmConfig(128, 64, 128, 8, 4, 3, warp_specialize=1)]


@pytest.mark.parametrize("cfg", FP8_TILES, ids=lambda c: f"{c.block_m}x{c.block_n}s{c.num_stages}")
@pytest.mark.parametrize("sms", [None, 1, 3])
@pytest.mark.parametrize("counts,h,i", [
    ([37, 0, 300, 1, 0, 129, 64, 2], 384, 768),   # empty experts, rows off the blocks; 6 K steps (a body of 6)
    ([0, 0, 513, 0], 256, 384),                    # every row to one expert; 3 steps
    ([1], 128, 128),                               # one row; one step (a body of 1)
    ([90, 41, 7], 200, 320),                       # H off the N tiles, I off the K steps (a partial last step)
    ([200, 300], 256, 14336),                      # Mixtral's K loop: 112 steps (bodies of 8)
    ([3, 5], 384, 896),                            # 7 steps: bodies of 7
])
def test_fp8_block_down_matches_reference_and_the_triton_kernel(cfg, sms, counts, h, i, poison, monkeypatch):
    """fp8-block (SCALED): close to the float64 reference of the dequantized operands, and bit for bit the Triton
    kernel's output (the same float32 sums in the same order: each step's product times its scales, added)."""
    check_fp8_down(cfg, sms, counts, h, i, monkeypatch, "ws fp8 down")


def check_fp8_down(cfg, sms, counts, h, i, monkeypatch, what):
    """The fp8-block down at cfg on sms programs (None: one a SM) on fresh operands: usable, no unwritten (NaN)
    element, within 1e-2 of the float64 reference, and bit for bit the Triton kernel's output."""
    if sms is not None:  # few programs: each runs many tiles, its consumers by turns
        monkeypatch.setattr(down_ws, "num_sms", lambda device: sms)
    layout, a, a_s, q2, s2, rw = fp8_operands(counts, h, i)
    assert choose_down(a, a_s, q2, s2, layout, "fp8-block", torch.bfloat16, cfg).kernel is WS
    got = down(a, a_s, q2, s2, rw, layout, "fp8-block", torch.bfloat16, cfg, poison=True)
    assert not got.isnan().any()
    assert_close(got, fp8_reference(layout, a, a_s, q2, s2, rw), 1e-2, f"{what} {counts} H={h} I={i} sms={sms}")
    plain = down(a, a_s, q2, s2, rw, layout, "fp8-block", torch.bfloat16, GemmConfig(64, 128, 128, 8, 4, 3),
                 poison=True)
    assert torch.equal(got, plain)


WIDE_TILES = ([GemmConfig(64, 256, 128, 8, 4, s, warp_specialize=1) for s in (2, 4, 5)]
              + [GemmConfig(128, 256, 128, 8, 4, s, warp_specialize=1) for s in (2, 4)])  # COOP: 64 rows a consumer


@pytest.mark.parametrize("cfg", WIDE_TILES, ids=tile_id)
@pytest.mark.parametrize("sms", [None, 1, 3])
@pytest.mark.parametrize("counts,h,i", [
    ([37, 0, 300, 1, 0, 129, 64, 2], 512, 768),   # empty experts, rows off the blocks; 6 K steps, 2 column tiles
    ([0, 0, 513, 0], 256, 384),                    # every row to one expert; 3 steps
    ([1], 256, 128),                               # one row; one step
    ([90, 41, 7], 768, 320),                       # a partial last step
    ([200, 300], 256, 14336),                      # Mixtral's K loop: 112 steps (bodies of 8)
    ([3, 5], 512, 896),                            # 7 steps: bodies of 7
])
def test_wide_fp8_block_down_matches_reference_and_the_triton_kernel(cfg, sms, counts, h, i, poison, monkeypatch):
    """The wide fp8-block down (64 x 256 tiles in quarters, two weight-scale blocks a tile; or 128 x 256 shared by
    the two consumers, COOP): bit for bit the Triton kernel's output and close to the float64 reference."""
    check_fp8_down(cfg, sms, counts, h, i, monkeypatch, "wide fp8 down")
    layout3, a3, a3_s, q3, s3, _ = fp8_operands([3, 4], 384, 256)  # H = 384: half a tile's scale blocks past the end
    assert not choose_down(a3, a3_s, q3, s3, layout3, "fp8-block", torch.bfloat16, cfg).kernel is WS


def test_fp16_and_shared_weights(poison):
    """fp16, and an expert stride of 0 (the tuner's compile jobs run such weights), by turns and COOP."""
    for cfg in (TILES[1], TILES[4]):
        for dtype, shared in ((torch.float16, False), (torch.bfloat16, True)):
            layout, a, w, rw = operands([5, 70, 0, 33], 256, 512, dtype, shared)
            got = down(a, None, w, None, rw, layout, "none", dtype, cfg, poison=True)
            assert_close(got, reference(layout, a, w, rw), 1e-2, f"{dtype} shared={shared} {tile_id(cfg)}")


def test_no_rows(poison):
    layout, a, w, rw = operands([0, 0, 0], 128, 128)
    assert down(a, None, w, None, rw, layout, "none", torch.bfloat16, TILES[1], poison=True).shape == (0, 128)


def test_block_table_on_gpu():
    """The row-block table against its torch reference (also checked in the interpreter, tests/kernels/test_warp_specialized.py)."""
    for counts in ([37, 0, 300, 1, 0, 129, 64, 2], [0] * 256, [513] + [0] * 255, [1] * 128):
        c = torch.tensor(counts, dtype=torch.int32, device="cuda")
        layout = RowLayout(False, offsets_from_counts(c), len(counts), 0, int(c.sum()))
        blk, n = down_ws.block_table(layout, 128)
        want, n_want = down_ws.block_table_torch(layout, 128)
        assert torch.equal(blk, want) and torch.equal(n, n_want)


def test_where_it_does_not_run():
    """Masked batches, fp8 schemes, fp32 and tiles it cannot run take the Triton kernels; fit() clears the flag."""
    layout, a, w, rw = operands([3, 4], 128, 256)
    masked = RowLayout(True, torch.tensor([3, 4], dtype=torch.int32, device="cuda"), 2, 4, 8)
    cfg = TILES[1]
    assert not choose_down(a, None, w, None, masked, "none", torch.bfloat16, cfg).kernel is WS
    assert not choose_down(a.float(), None, w.float(), None, layout, "none", torch.bfloat16, cfg).kernel is WS
    assert not choose_down(a, None, w, None, layout, "none", torch.bfloat16, GemmConfig(64, 128, 64, 8, 4, 4, warp_specialize=1)).kernel is WS
    assert not fit(cfg, fused_pair=False, scheme="fp8-block", elem_bytes=1, n_size=128).warp_specialize  # 128x128
    assert fit(cfg, fused_pair=False, scheme="none", elem_bytes=2, n_size=128).warp_specialize == 1
    layout8, a8, a8_s, q2, s2, _ = fp8_operands([3, 4], 128, 256)
    f8 = FP8_TILES[0]
    assert choose_down(a8, a8_s, q2, s2, layout8, "fp8-block", torch.bfloat16, f8).kernel is WS
    assert not choose_down(a8, a8_s, q2, s2, masked, "fp8-block", torch.bfloat16, f8).kernel is WS
    assert not choose_down(a8, a8_s, q2, s2, layout8, "fp8-channel", torch.bfloat16, f8).kernel is WS
    assert not choose_down(a8, None, q2, s2, layout8, "fp8-block", torch.bfloat16, f8).kernel is WS


@pytest.mark.parametrize("scheme", ["none", "fp8-block"])
def test_layer_through_a_tuned_file(make_layer, tmp_path, monkeypatch, scheme):
    """A layer whose tuned file (MOEFLOW_KERNEL_CONFIG_DIR) picks the kernel for its down (bf16, and fp8-block's
    SCALED form): it runs (counted), the output is close to the oracle, and the same from a CUDA graph."""
    from moeflow.kernels import configs as kc
    from oracle import layer_oracle
    from tolerances import rel_tol
    e, h, i, k, t = 16, 512, 384, 4, 1000
    pair = (kc.MoEKernelConfig(kc.GemmConfig(64, 128, 64, 8, 4, 3), TILES[1]) if scheme == "none" else
            kc.MoEKernelConfig(kc.GemmConfig(64, 128, 128, 8, 4, 3), FP8_TILES[0]))
    name = kc.file_name(torch.cuda.get_device_name(), e, i, h, scheme)
    kc.write_table(tmp_path / name, dict(device=torch.cuda.get_device_name(), E=e, N=i, K=h, scheme=scheme), {t: pair})
    monkeypatch.setenv("MOEFLOW_KERNEL_CONFIG_DIR", str(tmp_path))
    layer = make_layer(num_experts=e, hidden_size=h, intermediate_size=i, top_k=k, quant=scheme,
                       dtype=torch.bfloat16, device="cuda", runner="triton")
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand(t, k, device="cuda") + 0.1
    calls = []
    launch = down_ws.launch
    monkeypatch.setattr(down_ws, "launch",
                        lambda *a, **kw: calls.append(kw.get("a_scale") is not None) or launch(*a, **kw))
    want = layer.forward_topk(x, ids, w)
    assert calls == [scheme == "fp8-block"], "the runner did not run the warp-specialized down through the tuned tile"
    assert_close(want, layer_oracle(layer, x, ids, w), rel_tol(scheme, torch.bfloat16), f"ws down layer {scheme}")
    assert torch.equal(replayed(lambda: layer.forward_topk(x, ids, w)), want), "graph replay"


FP8_GU_TILES = ([GemmConfig(64, 128, 128, 8, 4, s, warp_specialize=1) for s in (2, 4, 5)]
                + [GemmConfig(128, 128, 128, 8, 4, s, warp_specialize=1) for s in (2, 4)])  # COOP: 64 rows a consumer


@pytest.mark.parametrize("cfg", FP8_GU_TILES, ids=lambda c: f"{c.block_m}s{c.num_stages}")
@pytest.mark.parametrize("sms", [None, 1, 3])
@pytest.mark.parametrize("indexed", [False, True])
@pytest.mark.parametrize("counts,h,i", [
    ([37, 0, 300, 1, 0, 129, 64, 2], 384, 256),  # empty experts, rows off the blocks; 3 K steps, 2 column tiles
    ([0, 0, 513, 0], 256, 128),                   # every row to one expert; 2 steps
    ([1], 128, 384),                              # one row; one step (a body of 1)
    ([90, 41, 7], 1152, 128),                     # 9 steps: bodies of 3
    ([200, 300], 4096, 256),                      # Mixtral's K loop: 32 steps (bodies of 8)
    ([5, 260], 7168, 128),                        # DeepSeek-V3's: 56 steps
    ([3, 5], 896, 768),                           # 7 steps (a body of 7), Qwen3's 6 column tiles
])
def test_fp8_block_gate_up_matches_reference_and_the_triton_kernel(cfg, sms, indexed, counts, h, i, poison,
                                                                   monkeypatch):
    """fp8-block gate_up (GATED and SCALED): bit for bit the Triton kernel's fp8 intermediate and group scales (the
    same float32 sums in the same order), and dequantized close to the float64 reference; rows by index are copied
    into order first."""
    from test_gpu_gate_up_wgmma import SCH, operands as gu_operands, reference as gu_reference
    from moeflow.kernels.gemm.gate_up import gate_up
    if sms is not None:  # few programs: each runs many tiles, its consumers by turns (COOP: both on each)
        monkeypatch.setattr(down_ws, "num_sms", lambda device: sms)
    layout, x, xs, q, s = gu_operands(counts, h, i)
    assert choose_gate_up(x, xs, q, s, layout, "fp8-block", cfg).kernel is WS
    src = torch.randperm(x.shape[0], device="cuda") if indexed else None
    copy_rows = torch.argsort(src).view(-1, 1) if indexed else None
    run = lambda c: gate_up(x, xs, q, s, layout, "fp8-block", "silu", torch.bfloat16, c, poison=True,
                            source_rows=src, copy_rows=copy_rows)
    got, got_s = run(cfg)
    assert got.dtype == torch.float8_e4m3fn and not got.float().isnan().any() and not got_s.isnan().any()
    plain, plain_s = run(GemmConfig(64, 128, 128, 8, 4, 3))
    assert torch.equal(got.view(torch.uint8), plain.view(torch.uint8)) and torch.equal(got_s, plain_s)
    rows = x.view(torch.uint8)[src].view(x.dtype) if indexed else x
    want = gu_reference(layout, rows, xs[src] if indexed else xs, q, s)
    assert_close(SCH.dequantize_activation(got, got_s), want, 6e-2, f"ws fp8 gate_up {counts} H={h} I={i} sms={sms}")


def test_fp8_block_gate_up_where_it_does_not_run():
    """I or H off the 128-wide groups, 128 x 64 tiles (half a group) and masked batches take the other kernels."""
    from test_gpu_gate_up_wgmma import operands as gu_operands
    layout, x, xs, q, s = gu_operands([3, 4], 256, 128)
    cfg = FP8_GU_TILES[1]
    assert choose_gate_up(x, xs, q, s, layout, "fp8-block", cfg).kernel is WS
    masked = RowLayout(True, torch.tensor([3, 4], dtype=torch.int32, device="cuda"), 2, 4, 8)
    assert not choose_gate_up(x, xs, q, s, masked, "fp8-block", cfg).kernel is WS
    assert not choose_gate_up(x, xs, q, s, layout, "fp8-block", GemmConfig(128, 64, 128, 8, 4, 4, warp_specialize=1)).kernel is WS
    layout2, x2, xs2, q2, s2 = gu_operands([9, 2], 256, 192)  # I = 192
    assert not choose_gate_up(x2, xs2, q2, s2, layout2, "fp8-block", cfg).kernel is WS
