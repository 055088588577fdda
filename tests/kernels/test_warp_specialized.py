"""kernels/gemm/warp_specialized.py's parts that run without a GPU: the row-block table kernel under TRITON_INTERPRET=1
against its torch reference (edge layouts), and fit()'s rule for GemmConfig.warp_specialize. The Gluon GEMMs
themselves need a Hopper GPU (tests/gpu/test_gpu_warp_specialized.py); tests/kernels/test_kernels_compile_sm90.py compiles it."""
import pytest
import torch

from triton_interp import SKIP_REASON

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))

if SKIP_REASON is None:
    from moeflow.kernels import configs as kc
    from moeflow.kernels.gemm import tiles
    from moeflow.kernels.common import RowLayout
    from moeflow.kernels.gemm.warp_specialized import block_table, block_table_torch
    from moeflow.layouts import offsets_from_counts


@pytest.mark.parametrize("counts", [
    [37, 0, 300, 1, 0, 129, 64, 2],  # empty experts, rows off the blocks
    [0, 0, 513, 0],                  # every row to one expert
    [1],                             # one row
    [0, 0, 0],                       # no rows
    [128, 128, 256],                 # exact blocks
    [3] * 70 + [0] * 58,             # 128 experts, non-power-of-two in use
])
@pytest.mark.parametrize("block_m", [64, 128])
def test_block_table_matches_reference(counts, block_m):
    c = torch.tensor(counts, dtype=torch.int32)
    layout = RowLayout(False, offsets_from_counts(c), len(counts), 0, int(c.sum()))
    blk, n = block_table(layout, block_m)
    want, n_want = block_table_torch(layout, block_m)
    assert blk.shape == (3, layout.num_row_blocks(block_m))
    assert torch.equal(blk, want) and torch.equal(n, n_want)
    real = [(e, lo, int(layout.meta[e + 1])) for e in range(len(counts))
            for lo in range(int(layout.meta[e]), int(layout.meta[e + 1]), block_m)]  # the blocks, written out
    assert [tuple(blk[:, b].tolist()) for b in range(int(n))] == real


def test_fit_keeps_warp_specialize_where_the_kernel_runs():
    ws = lambda cfg, **kw: tiles.fit(cfg, **{**dict(fused_pair=False, scheme="none", elem_bytes=2, n_size=2048), **kw})
    cfg = kc.GemmConfig(128, 128, 64, 8, 4, 6, warp_specialize=1)
    assert ws(cfg).warp_specialize == 1 and ws(cfg).num_stages == 6  # 6 x 32 KB fits the shared-memory budget
    assert ws(cfg, elem_bytes=4).warp_specialize == 0  # float32 layers
    assert ws(cfg, scheme="fp8-block", elem_bytes=1).warp_specialize == 0  # fp8-block: 64 x 128 or 128 x 64, K 128
    for bm, bn in ((64, 128), (128, 64)):
        f8 = ws(kc.GemmConfig(bm, bn, 128, 8, 4, 8, warp_specialize=1), scheme="fp8-block", elem_bytes=1)
        assert f8.warp_specialize == 1 and f8.num_stages == 8  # 8 x 24 KB fits the budget
        assert ws(f8, scheme="fp8-channel", elem_bytes=1).warp_specialize == 0
    # the fp8-block gate_up: 64 x 128 only (one output group a row), at most 5 stages of 40 KB
    gu8 = ws(kc.GemmConfig(64, 128, 128, 8, 4, 8, warp_specialize=1), fused_pair=True, scheme="fp8-block",
             elem_bytes=1, n_size=768)
    assert gu8.warp_specialize == 1 and gu8.num_stages == 5  # 8 stages clamped to the 200 KB budget
    assert ws(kc.GemmConfig(128, 64, 128, 8, 4, 4, warp_specialize=1), fused_pair=True, scheme="fp8-block",
              elem_bytes=1, n_size=768).warp_specialize == 0  # 64 columns: half a group
    assert not tiles.ws_fits(kc.GemmConfig(64, 128, 128, 8, 4, 6, warp_specialize=1), True, "fp8-block")  # 240 KB
    assert tiles.ws_fits(kc.GemmConfig(64, 128, 128, 8, 4, 2, warp_specialize=1), True, "fp8-block")
    # 128 x 128 (COOP: the two consumers 64 rows each), at most 4 stages of 48 KB
    coop = ws(kc.GemmConfig(128, 128, 128, 16, 4, 6, warp_specialize=1), fused_pair=True, scheme="fp8-block",
              elem_bytes=1, n_size=2048)
    assert (coop.block_m, coop.warp_specialize, coop.num_stages) == (128, 1, 4)
    assert not tiles.ws_fits(kc.GemmConfig(128, 128, 128, 8, 4, 5, warp_specialize=1), True, "fp8-block")
    # the wide fp8-block down: 64 x 256 in quarters, at most 5 stages of 40 KB; not for the gate_up
    wide = ws(kc.GemmConfig(64, 256, 128, 8, 4, 7, warp_specialize=1), scheme="fp8-block", elem_bytes=1)
    assert (wide.block_n, wide.warp_specialize, wide.num_stages) == (256, 1, 5)
    assert not tiles.ws_fits(kc.GemmConfig(64, 256, 128, 8, 4, 4, warp_specialize=1), True, "fp8-block")
    # and 128 x 256 shared by the two consumers (COOP, 64 rows each), at most 4 stages of 48 KB (213 KB compiled)
    wide_coop = ws(kc.GemmConfig(128, 256, 128, 16, 4, 6, warp_specialize=1), scheme="fp8-block", elem_bytes=1)
    assert (wide_coop.block_m, wide_coop.block_n, wide_coop.warp_specialize, wide_coop.num_stages) == (128, 256, 1, 4)
    assert not tiles.ws_fits(kc.GemmConfig(128, 256, 128, 8, 4, 5, warp_specialize=1), False, "fp8-block")
    assert not tiles.ws_fits(kc.GemmConfig(128, 256, 128, 8, 4, 4, warp_specialize=1), True, "fp8-block")
    assert ws(kc.GemmConfig(128, 128, 128, 8, 4, 4, warp_specialize=1), scheme="fp8-block",
              elem_bytes=1).warp_specialize == 0  # 128 x 128: three tiles of 128 registers
    assert ws(cfg, fused_pair=True).num_stages == 4  # as a gate_up tile: COOP (below), 48 KB stages
    gu = kc.GemmConfig(128, 64, 64, 8, 4, 6, warp_specialize=1)
    assert ws(gu, fused_pair=True, n_size=768).warp_specialize == 1 and ws(gu, fused_pair=True).num_stages == 6
    assert ws(gu).warp_specialize == 0  # the down's tile is 128 x 128
    assert ws(gu, fused_pair=True, scheme="fp8-channel", elem_bytes=1).warp_specialize == 0
    # bf16 / fp16: 256 accumulator columns run as COOP (64 rows a consumer), at most 4 stages of 48 KB
    for tile, gated in (((128, 256), False), ((128, 128), True)):
        cp = ws(kc.GemmConfig(*tile, 64, 8, 4, 4, warp_specialize=1), fused_pair=gated, n_size=768)
        assert (cp.block_m, cp.block_n, cp.warp_specialize, cp.num_stages) == (*tile, 1, 4)
        assert not tiles.ws_fits(kc.GemmConfig(*tile, 64, 8, 4, 5, warp_specialize=1), gated)
    # and 64-row tiles a consumer, by turns: the 64 x 256 down at most 4 stages of 40 KB, the 64 x 128 gate_up 5
    assert tiles.ws_fits(kc.GemmConfig(64, 256, 64, 8, 4, 4, warp_specialize=1), False)
    assert not tiles.ws_fits(kc.GemmConfig(64, 256, 64, 8, 4, 5, warp_specialize=1), False)  # 238 KB with its epilogue
    assert tiles.ws_fits(kc.GemmConfig(64, 128, 64, 8, 4, 5, warp_specialize=1), True)
    assert not tiles.ws_fits(kc.GemmConfig(64, 128, 64, 8, 4, 4, warp_specialize=1), False)  # not a down tile
    assert not tiles.ws_fits(kc.GemmConfig(128, 256, 64, 8, 4, 4, warp_specialize=1), True)  # 512 accumulator columns
    assert ws(kc.GemmConfig(128, 128, 64, 8, 8, 4, warp_specialize=1)).warp_specialize == 0  # a consumer is 4 warps
    assert ws(kc.GemmConfig(128, 128, 64, 8, 4, 4, split_k=2, warp_specialize=1)).warp_specialize == 0
    assert ws(kc.GemmConfig(128, 128, 64, 8, 4, 4, warp_specialize=True)).warp_specialize == 1  # JSON true
    assert kc.MoEKernelConfig.from_dict({"gate_up": kc.GemmConfig(64, 64, 64).to_dict(),
                                         "down": {"block_m": 128, "block_n": 128, "block_k": 64}}).down.warp_specialize == 0
