"""kernels/gemm/down_wgmma.py (the Gluon fp8-block down GEMM, GemmConfig.scale_overlap) on a Hopper GPU:
against a float64 reference of the dequantized operands and bit for bit against kernels/gemm/down.py's
Triton kernel, on fresh random data with NaN-poisoned outputs: empty experts, all rows to one
expert, one row, K loops of 1, 3, 6 and 112 steps (every UNROLL path), I and H off the tiles, weights
shared by every expert (stride 0), and the masked layout falling back to the Triton kernel; the persistent
grid (kernels/gemm/down_wgmma_persistent.py) with few programs, so that each loops over many tiles.
Run: pytest -m gpu tests/gpu
"""
import pytest
import torch

from moeflow.kernels.configs import GemmConfig
from moeflow.kernels.gemm.tiles import fit
from moeflow.layouts import offsets_from_counts
from moeflow.quant import create_scheme
from gluon_hopper import MARKS
from oracle import assert_close
from moeflow.kernels.gemm.choice import GemmKernel, choose_down  # noqa: E402
WS = GemmKernel.GLUON_WARP_SPECIALIZED
WGMMA_DOWN = (GemmKernel.GLUON_WGMMA, GemmKernel.GLUON_WGMMA_PERSISTENT)

pytestmark = MARKS

if torch.cuda.is_available():  # kernel modules: on CPU (CI) the interpreter tests define them first (triton_interp)
    from moeflow.kernels.common import RowLayout
    from moeflow.kernels.gemm.down import down

SCH = create_scheme("fp8-block")
TILES = [GemmConfig(128, 128, 128, 8, 8, 4, scale_overlap=1), GemmConfig(128, 128, 128, 8, 8, 4, scale_overlap=2),
         GemmConfig(128, 128, 128, 8, 8, 3, scale_overlap=1), GemmConfig(64, 128, 128, 4, 4, 4, scale_overlap=2),
         GemmConfig(64, 64, 128, 4, 4, 3, scale_overlap=1), GemmConfig(64, 64, 128, 4, 4, 3, scale_overlap=2),
         # persistent grids (kernels/gemm/down_wgmma_persistent.py; per-tile where STAGES > the K steps)
         GemmConfig(64, 128, 128, 8, 4, 4, 2, scale_overlap=2), GemmConfig(128, 128, 128, 8, 8, 3, 1, scale_overlap=1)]


def operands(counts, h, i, shared_weights=False):
    counts = torch.tensor(counts, dtype=torch.int32, device="cuda")
    e, r = counts.numel(), int(counts.sum())
    layout = RowLayout(False, offsets_from_counts(counts), e, 0, r)
    w = torch.randn(1 if shared_weights else e, h, i, device="cuda") / i ** 0.5
    q2, s2 = SCH.quantize_weight(w.bfloat16())
    if shared_weights:
        q2, s2 = q2.expand(e, h, i), s2.expand(e, *s2.shape[1:])
    a, a_s = SCH.quantize_activation(torch.randn(r, i, device="cuda").bfloat16())
    return layout, a, a_s, q2, s2, torch.rand(r, device="cuda")


def reference(layout, a, a_s, q2, s2, rw):
    """float64: route_w * dequant(a) @ dequant(w2[e]).T per row."""
    af = SCH.dequantize_activation(a, a_s).double()
    wf = SCH.dequantize_weight(q2, s2).double()
    bounds = layout.meta.tolist()
    out = torch.zeros(a.shape[0], q2.shape[1], dtype=torch.float64, device="cuda")
    for e in range(len(bounds) - 1):
        lo, hi = bounds[e], bounds[e + 1]
        out[lo:hi] = (af[lo:hi] @ wf[e].T) * rw[lo:hi, None].double()
    return out


def tile_id(c):
    return f"{c.block_m}x{c.block_n}w{c.num_warps}s{c.num_stages}o{c.scale_overlap}p{c.programs_per_sm}"


@pytest.mark.parametrize("cfg", TILES, ids=tile_id)
@pytest.mark.parametrize("counts,h,i", [
    ([37, 0, 300, 1, 0, 129, 64, 2], 384, 768),   # empty experts, rows off the blocks; 6 K steps (UNROLL 6)
    ([0, 0, 513, 0], 256, 384),                    # every row to one expert; 3 steps (UNROLL 3)
    ([1], 128, 128),                               # one row; one step (UNROLL 1)
    ([90, 41, 7], 200, 320),                       # H off the N tiles, I off the K steps (a partial last step)
    ([200, 300], 256, 14336),                      # Mixtral's K loop: 112 steps (UNROLL 8)
])
def test_matches_reference_and_the_triton_kernel(cfg, counts, h, i, poison):
    layout, a, a_s, q2, s2, rw = operands(counts, h, i)
    assert choose_down(a, a_s, q2, s2, layout, "fp8-block", torch.bfloat16, cfg).kernel in WGMMA_DOWN
    got = down(a, a_s, q2, s2, rw, layout, "fp8-block", torch.bfloat16, cfg, poison=True)
    assert not got.isnan().any()
    assert_close(got, reference(layout, a, a_s, q2, s2, rw), 1e-2, f"wgmma down {counts} H={h} I={i}")
    plain = down(a, a_s, q2, s2, rw, layout, "fp8-block", torch.bfloat16, GemmConfig(cfg.block_m, cfg.block_n, 128,
                 cfg.group_m, cfg.num_warps, cfg.num_stages), poison=True)
    assert torch.equal(got, plain)  # the same float32 sums in the same order


def test_weights_shared_by_every_expert(poison):
    """Expert stride 0 (the tuner's compile jobs run such weights): every expert reads the same rows."""
    layout, a, a_s, q2, s2, rw = operands([5, 70, 0, 33], 256, 512, shared_weights=True)
    cfg = TILES[2]
    got = down(a, a_s, q2, s2, rw, layout, "fp8-block", torch.bfloat16, cfg, poison=True)
    assert_close(got, reference(layout, a, a_s, q2, s2, rw), 1e-2, "shared weights")


def test_where_it_does_not_run(poison):
    """Masked batches, other schemes and tiles it cannot run take the Triton kernel; fit() clears the flag."""
    layout, a, a_s, q2, s2, rw = operands([3, 4], 128, 256)
    masked = RowLayout(True, torch.tensor([3, 4], dtype=torch.int32, device="cuda"), 2, 4, 8)
    cfg = TILES[3]
    assert not choose_down(a, a_s, q2, s2, masked, "fp8-block", torch.bfloat16, cfg).kernel in WGMMA_DOWN
    assert not choose_down(a, a_s, q2, s2, layout, "fp8-channel", torch.bfloat16, cfg).kernel in WGMMA_DOWN
    assert not choose_down(a, a_s, q2, s2, layout, "fp8-block", torch.bfloat16, GemmConfig(64, 256, 128, 4, 4, 4, scale_overlap=1)).kernel in WGMMA_DOWN
    assert not fit(GemmConfig(64, 128, 128, 4, 4, 4, scale_overlap=1), fused_pair=False, scheme="fp8-channel",
                   elem_bytes=1, n_size=128).scale_overlap
    assert fit(cfg, fused_pair=False, scheme="fp8-block", elem_bytes=1, n_size=128).scale_overlap == 2
    assert fit(GemmConfig(64, 128, 128, 4, 4, 4, scale_overlap=True), fused_pair=False, scheme="fp8-block", elem_bytes=1,
               n_size=128).scale_overlap == 1  # JSON true


@pytest.mark.parametrize("cfg", [GemmConfig(64, 128, 128, 8, 4, 4, 2, scale_overlap=2),
                                 GemmConfig(64, 128, 128, 4, 4, 3, 1, scale_overlap=1),
                                 GemmConfig(128, 128, 128, 8, 8, 3, 1, scale_overlap=2)], ids=tile_id)
@pytest.mark.parametrize("sms", [1, 3])
@pytest.mark.parametrize("counts,h,i", [
    ([37, 0, 300, 1, 0, 129, 64, 2], 384, 768),        # 6 K steps: loads reach into the next tile
    ([0, 0, 513, 0], 256, 384),                         # 3 steps: STAGES 3 reaches a whole tile ahead; 4 falls back
    ([90, 41, 7], 200, 320),                            # H and I off the tiles
    ([int(c) for c in torch.randint(0, 60, (128,))], 256, 768),  # 128 experts (Qwen3's), some empty
])
def test_persistent_programs_loop_over_many_tiles(cfg, sms, counts, h, i, poison, monkeypatch):
    """Few programs (num_sms patched to 1 or 3: 1-6 programs), so each runs many tiles and its loads cross
    from one tile into the next, odd and even tile counts; bit-equal to the per-tile Triton kernel."""
    from moeflow.kernels.gemm import down_wgmma_persistent
    monkeypatch.setattr(down_wgmma_persistent, "num_sms", lambda device: sms)
    layout, a, a_s, q2, s2, rw = operands(counts, h, i)
    assert choose_down(a, a_s, q2, s2, layout, "fp8-block", torch.bfloat16, cfg).kernel in WGMMA_DOWN
    got = down(a, a_s, q2, s2, rw, layout, "fp8-block", torch.bfloat16, cfg, poison=True)
    assert not got.isnan().any()
    assert_close(got, reference(layout, a, a_s, q2, s2, rw), 1e-2, f"persistent wgmma down {len(counts)} experts")
    plain = down(a, a_s, q2, s2, rw, layout, "fp8-block", torch.bfloat16,
                 GemmConfig(cfg.block_m, cfg.block_n, 128, cfg.group_m, cfg.num_warps, cfg.num_stages), poison=True)
    assert torch.equal(got, plain)


def test_persistent_empty_batch(poison):
    """No rows at all: every program finds no tile."""
    layout, a, a_s, q2, s2, rw = operands([0, 0, 0], 256, 768)
    got = down(a, a_s, q2, s2, rw, layout, "fp8-block", torch.bfloat16, GemmConfig(64, 128, 128, 8, 4, 4, 2,
                                                                                    scale_overlap=2), poison=True)
    assert got.shape == (0, 256)
