"""kernels/gemm/gate_up_wgmma.py (the Gluon fp8-block gate_up GEMM, GemmConfig.scale_overlap on a gate_up config)
on a Hopper GPU: bit for bit against kernels/gemm/gate_up.py's Triton kernel (fp8 intermediate and group scales)
and, dequantized, against a float64 reference, on fresh random data with NaN-poisoned outputs: empty
experts, all rows to one expert, one row, K loops of 1, 2, 3, 9, 32 and 56 steps (several loop-body
lengths), several column tiles, weights shared by every expert (stride 0), and the cases that fall back
to the Triton kernel (masked layout, other schemes, tiles it cannot run), and rows by index (gathered first).
Run: pytest -m gpu tests/gpu
"""
import pytest
import torch

from moeflow.kernels.configs import GemmConfig
from moeflow.layouts import offsets_from_counts
from moeflow.quant import create_scheme
from gluon_hopper import MARKS
from oracle import assert_close
from moeflow.kernels.gemm.choice import GemmKernel, choose_gate_up  # noqa: E402
WS = GemmKernel.GLUON_WARP_SPECIALIZED
WGMMA_DOWN = (GemmKernel.GLUON_WGMMA, GemmKernel.GLUON_WGMMA_PERSISTENT)

pytestmark = MARKS

if torch.cuda.is_available():  # kernel modules: on CPU (CI) the interpreter tests define them first (triton_interp)
    from moeflow.kernels.gemm import gate_up_wgmma
    from moeflow.kernels.common import RowLayout
    from moeflow.kernels.gemm.gate_up import gate_up

SCH = create_scheme("fp8-block")
TILES = [GemmConfig(128, 128, 128, 8, 8, 4, scale_overlap=1), GemmConfig(128, 128, 128, 8, 8, 3, scale_overlap=1),
         GemmConfig(64, 128, 128, 4, 4, 4, scale_overlap=1), GemmConfig(64, 128, 128, 8, 4, 5, scale_overlap=1)]


def operands(counts, h, i, shared_weights=False):
    counts = torch.tensor(counts, dtype=torch.int32, device="cuda")
    e, r = counts.numel(), int(counts.sum())
    layout = RowLayout(False, offsets_from_counts(counts), e, 0, r)
    w = torch.randn(1 if shared_weights else e, 2 * i, h, device="cuda") / h ** 0.5
    q, s = SCH.quantize_weight(w.bfloat16())
    if shared_weights:
        q, s = q.expand(e, 2 * i, h), s.expand(e, *s.shape[1:])
    x, xs = SCH.quantize_activation(torch.randn(r, h, device="cuda").bfloat16())
    return layout, x, xs, q, s


def reference(layout, x, xs, q, s):
    """float64: silu(x @ gate.T) * (x @ up.T) per row, from the dequantized operands."""
    xf = SCH.dequantize_activation(x, xs).double()
    wf = SCH.dequantize_weight(q, s).double()
    i = q.shape[1] // 2
    bounds = layout.meta.tolist()
    out = torch.zeros(x.shape[0], i, dtype=torch.float64, device="cuda")
    for e in range(len(bounds) - 1):
        lo, hi = bounds[e], bounds[e + 1]
        y = xf[lo:hi] @ wf[e].T
        out[lo:hi] = torch.nn.functional.silu(y[:, :i]) * y[:, i:]
    return out


def run(layout, x, xs, q, s, cfg, **kw):
    return gate_up(x, xs, q, s, layout, "fp8-block", "silu", torch.bfloat16, cfg, poison=True, **kw)


@pytest.mark.parametrize("cfg", TILES, ids=lambda c: f"{c.block_m}w{c.num_warps}s{c.num_stages}")
@pytest.mark.parametrize("counts,h,i", [
    ([37, 0, 300, 1, 0, 129, 64, 2], 384, 256),  # empty experts, rows off the blocks; 3 K steps, 2 column tiles
    ([0, 0, 513, 0], 256, 128),                   # every row to one expert; 2 steps
    ([1], 128, 384),                              # one row; one step
    ([90, 41, 7], 1152, 128),                     # 9 steps (one a body at 3 stages, 3 at 4)
    ([200, 300], 4096, 256),                      # Mixtral's K loop: 32 steps
    ([5, 260], 7168, 128),                        # DeepSeek-V3's: 56 steps (7 or 8 a body)
])
def test_matches_reference_and_the_triton_kernel(cfg, counts, h, i):
    layout, x, xs, q, s = operands(counts, h, i)
    assert choose_gate_up(x, xs, q, s, layout, "fp8-block", cfg).kernel is GemmKernel.GLUON_WGMMA
    got, got_s = run(layout, x, xs, q, s, cfg)
    assert got.dtype == torch.float8_e4m3fn and not got.float().isnan().any() and not got_s.isnan().any()
    deq = SCH.dequantize_activation(got, got_s)
    assert_close(deq, reference(layout, x, xs, q, s), 6e-2, f"wgmma gate_up {counts} H={h} I={i}")
    plain, plain_s = run(layout, x, xs, q, s, GemmConfig(cfg.block_m, 128, 128, cfg.group_m, cfg.num_warps,
                                                         cfg.num_stages))
    assert torch.equal(got.view(torch.uint8), plain.view(torch.uint8)) and torch.equal(got_s, plain_s)


def test_weights_shared_by_every_expert():
    """Expert stride 0 (the tuner's compile jobs run such weights): every expert reads the same rows."""
    layout, x, xs, q, s = operands([5, 70, 0, 33], 256, 256, shared_weights=True)
    got, got_s = run(layout, x, xs, q, s, TILES[1])
    assert_close(SCH.dequantize_activation(got, got_s), reference(layout, x, xs, q, s), 6e-2, "shared weights")


def test_where_it_does_not_run():
    """Masked batches, other schemes, tiles it cannot run and I off the 128-column groups are refused
    (gate_up() then runs the Triton kernel)."""
    layout, x, xs, q, s = operands([3, 4], 256, 128)
    cfg = TILES[0]
    masked = RowLayout(True, torch.tensor([3, 4], dtype=torch.int32, device="cuda"), 2, 4, 8)
    assert not choose_gate_up(x, xs, q, s, masked, "fp8-block", cfg).kernel is GemmKernel.GLUON_WGMMA
    assert not choose_gate_up(x, xs, q, s, layout, "fp8-channel", cfg).kernel is GemmKernel.GLUON_WGMMA
    assert not choose_gate_up(x, xs, q, s, layout, "fp8-block", GemmConfig(128, 256, 128, 8, 8, 3, scale_overlap=1)).kernel is GemmKernel.GLUON_WGMMA
    layout2, x2, xs2, q2, s2 = operands([9, 2], 256, 192)  # I = 192 (layers refuse it for fp8-block: caps)
    assert not choose_gate_up(x2, xs2, q2, s2, layout2, "fp8-block", cfg).kernel is GemmKernel.GLUON_WGMMA


def test_rows_by_index():
    """source_rows (the local dispatcher's plan): gate_up() gathers the rows, then runs the Gluon kernel; the
    same bits as the Triton kernel's own gather."""
    layout, x, xs, q, s = operands([40, 0, 300, 9], 512, 256)
    src = torch.randperm(x.shape[0], device="cuda")
    got, got_s = run(layout, x, xs, q, s, TILES[0], source_rows=src)
    plain, plain_s = run(layout, x, xs, q, s, GemmConfig(128, 128, 128, 8, 8, 4), source_rows=src)
    assert torch.equal(got.view(torch.uint8), plain.view(torch.uint8)) and torch.equal(got_s, plain_s)
    assert_close(SCH.dequantize_activation(got, got_s), reference(layout, x.view(torch.uint8)[src].view(x.dtype), xs[src], q, s), 6e-2, "rows by index")


PAIR_TILES = [TILES[1], GemmConfig(128, 128, 128, 4, 8, 2, scale_overlap=1)]


@pytest.mark.parametrize("cfg", PAIR_TILES, ids=lambda c: f"{c.block_m}w{c.num_warps}s{c.num_stages}")
@pytest.mark.parametrize("counts,h,i", [
    ([64, 65, 1, 0, 192, 130, 63, 0], 256, 768),  # pair blocks of 64, 63, 2 and 1 rows, a 65-row block that is not
    ([3, 40, 64, 17], 1152, 256),                 # every block a pair block; 9 steps
    ([300, 0, 20], 4096, 512),                    # Mixtral's K loop, a 44-row last block
])
def test_pair_tiles_are_the_full_tiles_bits(cfg, counts, h, i, monkeypatch):
    """Blocks of at most 64 rows as pair tiles (two column tiles a program, the warpgroups side by side): the same
    bits as every block at 128 rows and as the Triton kernel, and close to the float64 reference."""
    layout, x, xs, q, s = operands(counts, h, i)
    assert gate_up_wgmma.pair_tiles(cfg, i)
    got, got_s = run(layout, x, xs, q, s, cfg)
    monkeypatch.setenv("MOEFLOW_TRITON_PAIR_TILES", "0")
    assert not gate_up_wgmma.pair_tiles(cfg, i)
    full, full_s = run(layout, x, xs, q, s, cfg)
    assert torch.equal(got.view(torch.uint8), full.view(torch.uint8)) and torch.equal(got_s, full_s)
    plain, plain_s = run(layout, x, xs, q, s, GemmConfig(128, 128, 128, cfg.group_m, 8, cfg.num_stages))
    assert torch.equal(got.view(torch.uint8), plain.view(torch.uint8)) and torch.equal(got_s, plain_s)
    assert_close(SCH.dequantize_activation(got, got_s), reference(layout, x, xs, q, s), 6e-2, f"pairs {counts}")


def test_pair_tiles_only_where_they_fit():
    """Pair tiles need 128-row tiles of 8 warps, at most 3 stages and an even number of 128-column tiles."""
    assert gate_up_wgmma.pair_tiles(TILES[1], 768) and not gate_up_wgmma.pair_tiles(TILES[1], 384)
    assert not gate_up_wgmma.pair_tiles(TILES[0], 768)  # 4 stages
    assert not gate_up_wgmma.pair_tiles(TILES[2], 768)  # 64-row tiles
