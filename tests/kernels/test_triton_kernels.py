"""Each Triton kernel against the torch reference beside it, under TRITON_INTERPRET=1, plus the
kernel-config files (lookup, override directory, defaults, validation)."""
import json
from dataclasses import replace

import pytest
import torch

from triton_interp import SKIP_REASON

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))

if SKIP_REASON is None:
    from moeflow.kernels import configs as kc
    from moeflow.kernels.gemm import tiles
    from moeflow.dispatch.expert_sort import sort_by_expert_torch
    from moeflow.kernels.rows.align import align_blocks, align_blocks_torch, sort_copies
    from moeflow.kernels.common import RowLayout, rows_operand, weight_operand
    from moeflow.kernels.gemm.down import down, down_torch
    from moeflow.kernels.gemm.gate_up import gate_up, gate_up_torch
    from moeflow.kernels.rows.quant import gather_rows, quantize_activation, quantize_rows, quantize_rows_torch
    from moeflow.kernels.rows.reduce import moe_sum, moe_sum_torch
    from moeflow.layouts import offsets_from_counts
    from moeflow.quant import create_scheme
    from moeflow.quant.base import amax_to_scale, to_fp8 as to_fp8_reference

from oracle import assert_close


def sorted_layout(counts):
    counts = torch.tensor(counts, dtype=torch.int32)
    return RowLayout(False, offsets_from_counts(counts), len(counts), 0, int(counts.sum()))


def masked_layout(counts, capacity):
    counts = torch.tensor(counts, dtype=torch.int32)
    return RowLayout(True, counts, len(counts), capacity, len(counts) * capacity)


@pytest.mark.parametrize("counts,block_m", [
    ([5, 0, 33, 16, 1], 16),   # empty expert, a segment over 3 blocks, an exact multiple, a single row
    ([0, 0, 0], 16),           # no rows: every block empty
    ([40], 16),                # one expert owns everything
    ([1, 2, 3, 4, 5, 6, 7], 4),  # E=7: non-power-of-two expert count
])
def test_align_sorted(counts, block_m):
    layout = sorted_layout(counts)
    table = align_blocks(layout, block_m)
    assert torch.equal(table, align_blocks_torch(layout, block_m))
    real = table[table[:, 0] >= 0]
    assert int((real[:, 2] - real[:, 1]).sum()) == sum(counts)  # every row in exactly one block
    assert (real[:, 2] - real[:, 1] <= block_m).all()


@pytest.mark.parametrize("t,k,e,skew", [
    (0, 2, 4, None),     # no tokens: offsets all 0
    (1, 8, 128, None),   # decode, Qwen3-like routing
    (5, 2, 7, None),     # non-power-of-two expert count
    (40, 2, 4, 2),       # every token's first choice is expert 2; experts left empty
    (100, 8, 256, None),  # 800 copies: several row blocks, several expert blocks
])
def test_sort_copies_matches_the_torch_sort(t, k, e, skew):
    """The one-launch sort of copies by expert: offsets, rows, sources and weights exactly equal
    to the stable torch.sort path (outputs of the kernel are fresh, unwritten rows would differ)."""
    ids = torch.rand(t, e).argsort(dim=1)[:, :k].to(torch.int32)
    if skew is not None:
        ids[:, 0] = skew
        ids[:, 1:] = torch.where(ids[:, 1:] == skew, (skew + 1) % e, ids[:, 1:])
    w = torch.rand(t, k)
    got = sort_copies(ids, w, e)
    want = sort_by_expert_torch(ids, w, e)
    for g, r, name in zip(got, want, ("offsets", "counts", "row_of_copy", "source", "weights"), strict=True):
        assert g.shape == r.shape and g.dtype == r.dtype and torch.equal(g, r), name


@pytest.mark.parametrize("t,k,e,h,scheme", [
    (0, 2, 4, 256, "fp8-block"),       # no tokens: nothing to quantize
    (1, 8, 128, 2048, "fp8-block"),    # Qwen3-like decode
    (5, 2, 7, 200, "fp8-block"),       # H not a multiple of 128: a partial last group
    (16, 8, 64, 1500, "fp8-block"),    # several programs per token (BLOCK_H 1024), partial tail
    (3, 2, 4, 1100, "fp8-channel"),    # the row amax over two column chunks
    (1, 1, 1, 16, "fp8-channel"),      # one expert, one tiny row
    (1, 8, 128, 2048, "fp8-tensor"),   # Qwen3-like decode: one scale over the batch, two parts
    (7, 2, 5, 1100, "fp8-tensor"),     # several tokens, a partial last part, the amax loop past one step
    (0, 2, 4, 256, "fp8-tensor"),      # no tokens
])
def test_sort_copies_quantizes_the_tokens(t, k, e, h, scheme):
    """The one-launch sort with x: the sort's five outputs unchanged, plus the tokens' FP8 bytes and
    scales bit for bit kernels/quant.quantize_activation's (the runner's own quantization), into
    NaN-free fresh outputs (every element written)."""
    ids = torch.rand(t, e).argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand(t, k)
    x = (torch.randn(t, h) * torch.rand(t, 1) * 10).half()
    if t:
        x[0, :min(h, 128)] = 0  # an all-zero group (fp8-block) / a row with a zero part
    got = sort_copies(ids, w, e, x, scheme)
    for g, r in zip(got[:5], sort_copies(ids, w, e), strict=True):
        assert torch.equal(g, r)
    q, s = quantize_activation(x, scheme)
    assert got[5].dtype == q.dtype and torch.equal(got[5].view(torch.uint8), q.view(torch.uint8))
    assert got[6].shape == s.shape and torch.equal(got[6], s)
    with pytest.raises(ValueError, match="scheme"):
        sort_copies(ids, w, e, x, "none")  # nothing to quantize
    from moeflow.dispatch.expert_sort import SORT_QUANTIZES
    from moeflow.kernels.rows.align import SORT_QUANT_CODES
    assert set(SORT_QUANTIZES) == set(SORT_QUANT_CODES)  # the dispatcher's list is the kernels' own


def test_align_masked():
    layout = masked_layout([0, 9, 4, 12], capacity=12)
    assert torch.equal(align_blocks(layout, 8), align_blocks_torch(layout, 8))


@pytest.mark.parametrize("scheme", ["fp8-tensor", "fp8-channel", "fp8-block"])
@pytest.mark.parametrize("masked", [False, True], ids=["sorted", "masked"])
def test_quantize_rows(scheme, masked):
    """Same FP8 bytes and scales as the scheme's own quantize_activation (valid rows)."""
    layout = masked_layout([3, 0, 5], 6) if masked else sorted_layout([3, 0, 5])
    check_quantize_rows(scheme, layout, 256)


def check_quantize_rows(scheme, layout, width):
    """quantize_rows of random half rows [layout.rows, width] (empty masked slots hold garbage the tensor amax
    must skip) against quantize_rows_torch: the same bytes and scales on every valid row."""
    x = (torch.randn(layout.rows, width) * torch.rand(layout.rows, 1) * 4).half()
    if layout.masked:
        x[~layout.valid_rows()] = 1e4
    q, s = quantize_rows(x, scheme, layout)
    q_ref, s_ref = quantize_rows_torch(x, scheme, layout)
    v = layout.valid_rows()
    assert s.shape == s_ref.shape and torch.equal(s[v], s_ref[v].float())
    assert torch.equal(q[v].view(torch.uint8), q_ref[v].view(torch.uint8))


def test_fp8_rounding_every_value_and_tie():
    """The kernels' FP8 cast (common.to_fp8) on every finite e4m3 value, each midpoint between neighbours (ties
    to even), values just off the midpoints, the subnormals and signed zeros: the bytes of torch's cast. The
    row holds 448, so its fp8-channel scale is exactly 1."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    vals = torch.unique(codes[torch.isfinite(codes)])  # -448 .. 448, -0.0 and 0.0 merged
    mids = (vals[1:] + vals[:-1]) / 2
    x = torch.cat([vals, mids, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20), torch.tensor([-0.0, 2 ** -12, -2 ** -11])])
    x = x.reshape(1, -1)
    q, s = quantize_rows(x, "fp8-channel")
    assert s.item() == 1.0
    assert torch.equal(q.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("amax", [3.0, 7.3, 0.37])
def test_fp8_quantize_multiplies_by_the_reciprocal(amax):
    """The kernels quantize x * (1 / scale), as quant/base.to_fp8, not x / scale: values within 4 float32 ulps of
    scale times each e4m3 midpoint, where the two round to different bytes (the data is checked to hold such
    values), come out as the reference's bytes. The row's amax sets its fp8-channel scale."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    vals = torch.unique(codes[torch.isfinite(codes)])
    mids = (vals[1:] + vals[:-1]) / 2
    scale = amax_to_scale(torch.tensor(amax))
    near = [mids * scale]
    for direction in (float("inf"), -float("inf")):
        x = near[0]
        for _ in range(4):
            x = torch.nextafter(x, torch.full_like(x, direction))
            near.append(x)
    x = torch.cat([torch.tensor([amax])] + near).reshape(1, -1)
    q, s = quantize_rows(x, "fp8-channel")
    assert torch.equal(s, scale.reshape(1, 1))
    ref = to_fp8_reference(x, s)
    by_division = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert (by_division.view(torch.uint8) != ref.view(torch.uint8)).sum() > 10
    assert torch.equal(q.view(torch.uint8), ref.view(torch.uint8))


def test_fp8_scale_is_amax_times_the_reciprocal_of_448():
    """A scale is amax * float32(1/448) in the kernels and in quant/base.amax_to_scale, bit for bit, on rows whose
    amax / 448 in IEEE division differs from that for about half of them (torch on CUDA divides by a scalar as the
    multiply, on the CPU as the division: the kernels must match the rule that is the same on both)."""
    x = torch.randn(512, 96) * torch.rand(512, 1) * 100
    q, s = quantize_rows(x, "fp8-channel")
    amax = x.abs().amax(dim=1, keepdim=True)
    assert (amax / 448 != amax_to_scale(amax)).sum() > 100
    assert torch.equal(s, amax_to_scale(amax))
    assert torch.equal(q.view(torch.uint8), to_fp8_reference(x, s).view(torch.uint8))


@pytest.mark.parametrize("one_step,fold_rows", [(128, 1024), (8192, 1024), (8192, 1)],
                         ids=["row-in-3-steps", "row-in-1-step", "tensor-max-by-torch"])
@pytest.mark.parametrize("scheme", ["fp8-tensor", "fp8-channel"])
@pytest.mark.parametrize("masked", [False, True], ids=["sorted", "masked"])
def test_quantize_rows_amax_paths(scheme, masked, one_step, fold_rows, monkeypatch):
    """The row amax in one load per row or in a K loop (quant.ROW_AMAX_ONE_STEP), and fp8-tensor's tensor amax
    taken by the quantization's programs or by a torch max first (quant.AMAX_FOLD_ROWS): the scheme's bytes and
    scales on every valid row, rows of odd count and width (H = 300: a partial last step), empty slots left out."""
    from moeflow.kernels.rows import quant as quant_mod
    monkeypatch.setattr(quant_mod, "ROW_AMAX_ONE_STEP", one_step)
    monkeypatch.setattr(quant_mod, "AMAX_FOLD_ROWS", fold_rows)
    check_quantize_rows(scheme, masked_layout([3, 0, 6], 7) if masked else sorted_layout([3, 0, 6, 1]), 300)


@pytest.mark.parametrize("scheme", ["none", "fp8-channel", "fp8-block"])
@pytest.mark.parametrize("indexed", [False, True])
def test_tuner_gemm_inputs(scheme, indexed):
    """What `moeflow tune` (and the GEMM experiments) feed gate_up: one batch per tuner routing, every copy of the
    T tokens sorted by expert; by index: the T tokens quantized once, in order: the T * top_k rows quantized per
    row; both the scheme's bytes and scales (quantize_rows_torch), none: the rows themselves and no scale."""
    from moeflow.tune import autotune
    shape = autotune.Shape(5, 256, 128, 2, scheme, torch.float16)
    routings = autotune.tuner_routings(shape, 3, "cpu")
    assert len(routings) == autotune.batches_for(3)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(routings, autotune.tuner_routings(shape, 3, "cpu")))
    for (x, ids, _), (batch, layout, xq, xs) in zip(routings, autotune.gemm_inputs(shape, routings, indexed)):
        assert int(batch.counts.sum()) == 6 and layout.rows == 6
        rows = x if indexed else x[torch.sort(ids.flatten(), stable=True).indices // 2]
        assert torch.equal(batch.hidden, rows)
        if scheme == "none":
            assert xq is batch.hidden and xs is None
            continue
        q_ref, s_ref = quantize_rows_torch(rows, scheme, sorted_layout([rows.shape[0]]))
        assert torch.equal(xq.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(xs, s_ref.float())


@pytest.mark.parametrize("rows,k", [(0, 384), (1, 128), (50, 384), (9, 10368)])  # none; one; repeats; two K blocks
def test_gather_rows(rows, k):
    """FP8 rows and their scales by index: the same bytes as torch indexing, every output element written."""
    q, s = quantize_activation(torch.randn(37, k).half(), "fp8-block")
    src = torch.randint(0, 37, (rows,))
    got_q, got_s = gather_rows(q, s, src)
    assert got_q.shape == (rows, k) and got_s.shape == (rows, s.shape[1])
    assert torch.equal(got_q.view(torch.uint8), q.view(torch.uint8)[src]) and torch.equal(got_s, s[src])


@pytest.mark.parametrize("dtype,k", [(torch.float16, 200), (torch.float32, 3000), (torch.bfloat16, 8)])
def test_gather_rows_without_scales(dtype, k):
    """Rows of any dtype by index (bytes moved, 8192 a step: the fp32 rows take two), no scales."""
    x = torch.randn(11, k).to(dtype)
    src = torch.randint(0, 11, (23,))
    got, none = gather_rows(x, None, src)
    assert none is None and got.dtype == dtype and torch.equal(got.view(torch.uint8), x[src].view(torch.uint8))


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("scheme,dtype", [("none", torch.float16), ("fp8-channel", torch.float32),
                                          ("fp8-tensor", torch.float16), ("fp8-block", torch.float16)])
@pytest.mark.slow
def test_gate_up_rows_through_tma(scheme, dtype, split, monkeypatch):
    """GemmConfig.x_tma: rows by index are gathered into a copy in order, then read through a TMA
    descriptor (blocks whose rows end mid-box, an empty expert, H off the K tile); the same bits as the
    pointer loads, and the reference's values. A masked layout and MOEFLOW_TRITON_TMA=0 fall back to
    pointer loads."""
    from moeflow.kernels.gemm import gate_up as gate_up_mod
    seen = []
    kernel = gate_up_mod._gate_up_kernel
    monkeypatch.setattr(gate_up_mod, "_gate_up_kernel", type("Spy", (), {
        "__getitem__": lambda _, grid: lambda *a, **kw: seen.append(kw["X_TMA"]) or kernel[grid](*a, **kw)})())
    sch = create_scheme(scheme)
    layout = sorted_layout([5, 0, 21, 1])
    e, h, i = 4, 192, 128
    q13, s13 = sch.quantize_weight((torch.randn(e, 2 * i, h) / h ** 0.5).to(dtype))
    x, xs = sch.quantize_activation(torch.randn(9, h).to(dtype))
    src = torch.randint(0, 9, (layout.rows,))
    bk = 128 if scheme == "fp8-block" else 64
    base = kc.GemmConfig(16, 128, bk, split_k=split)
    args = (q13, s13, layout, scheme, "silu", dtype)
    want, want_s = gate_up(x, xs, *args, base, poison=True, source_rows=src)
    got, got_s = gate_up(x, xs, *args, replace(base, x_tma=1), poison=True, source_rows=src)
    assert seen == [False, True]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert (got_s is None and want_s is None) or torch.equal(got_s, want_s)
    if scheme in ("none", "fp8-channel"):
        assert_close(got, gate_up_torch(x, xs, *args, src), 1e-3, "gate_up, rows through TMA")
    monkeypatch.setenv("MOEFLOW_TRITON_TMA", "0")
    off, _ = gate_up(x, xs, *args, replace(base, x_tma=1), poison=True, source_rows=src)
    assert seen[-1] is False and torch.equal(off.view(torch.uint8), want.view(torch.uint8))


def test_gate_up_rows_through_tma_edges():
    """x_tma with no rows at all, and on a masked layout (pointer loads: slabs are not a row copy)."""
    w13 = (torch.randn(2, 128, 64) / 8).half()
    empty = sorted_layout([0, 0])
    out, _ = gate_up(torch.randn(3, 64).half(), None, w13, None, empty, "none", "silu", torch.float16,
                     kc.GemmConfig(16, 64, 64, x_tma=1), source_rows=torch.zeros(0, dtype=torch.int64))
    assert out.shape == (0, 64)
    masked = masked_layout([3, 0], capacity=4)
    xm = torch.randn(8, 64).half()
    cfg = kc.GemmConfig(16, 64, 64)
    want, _ = gate_up(xm, None, w13, None, masked, "none", "silu", torch.float16, cfg, poison=True)
    got, _ = gate_up(xm, None, w13, None, masked, "none", "silu", torch.float16, replace(cfg, x_tma=1), poison=True)
    v = masked.valid_rows()
    assert torch.equal(got[v], want[v])


@pytest.mark.parametrize("scheme", ["fp8-tensor", "fp8-channel", "fp8-block"])
@pytest.mark.parametrize("rows,k", [(0, 256), (1, 256), (7, 200)])  # no token; one; partial last 1x128 group
def test_quantize_activation_matches_the_scheme(scheme, rows, k):
    """The dispatchers' FP8 payload path: identical bytes and scales to quant/*.py's torch code."""
    x = (torch.randn(rows, k) * torch.rand(rows, 1) * 8).half()
    q, s = quantize_activation(x, scheme)
    q_ref, s_ref = create_scheme(scheme).quantize_activation(x)
    assert torch.equal(s, s_ref.float()) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_fp8_block_gate_up_narrow_tiles(poison_empty):
    """fp8-block gate_up with BLOCK_N < 128 (decode: more programs): the layer dtype out, no
    scales, equal to the reference within the dtype's rounding; quantized by quantize_groups it
    matches the fused epilogue's bits (the same rounding of the same values)."""
    from moeflow.kernels.rows.quant import quantize_groups
    sch = create_scheme("fp8-block")
    layout = sorted_layout([4, 0, 19])
    e, h, i = 3, 128, 256
    q13, s13 = sch.quantize_weight((torch.randn(e, 2 * i, h) / h ** 0.5).half())
    xq, xs = sch.quantize_activation(torch.randn(layout.rows, h).half())
    ref = gate_up_torch(xq, xs, q13, s13, layout, "fp8-block", "silu", torch.float16)
    narrow, none = gate_up(xq, xs, q13, s13, layout, "fp8-block", "silu", torch.float16, kc.GemmConfig(16, 32, 64),
                           poison=True)
    assert none is None and narrow.dtype == torch.float16
    assert_close(narrow, ref, 2e-3, "gate_up fp8-block, BLOCK_N 32")
    fused, scale = gate_up(xq, xs, q13, s13, layout, "fp8-block", "silu", torch.float16, kc.GemmConfig(16, 128, 64),
                           poison=True)
    q, s = quantize_groups(narrow)
    assert torch.equal(s, scale) and torch.equal(q.view(torch.uint8), fused.view(torch.uint8))


def test_gate_up_rows_by_index():
    """gate_up with source_rows (row r is x[src[r]]) equals gate_up on the gathered rows, and so
    does its reference (which once sized its output by x's rows instead of the layout's)."""
    layout = sorted_layout([4, 0, 19])
    e, h, i = 3, 64, 64
    w13 = (torch.randn(e, 2 * i, h) / h ** 0.5).half()
    x = torch.randn(5, h).half()
    src = torch.randint(0, 5, (layout.rows,))
    cfg = kc.GemmConfig(16, 32, 32)
    by_index, _ = gate_up(x, None, w13, None, layout, "none", "silu", torch.float16, cfg, poison=True, source_rows=src)
    gathered, _ = gate_up(x[src], None, w13, None, layout, "none", "silu", torch.float16, cfg, poison=True)
    assert torch.equal(by_index, gathered)
    ref = gate_up_torch(x, None, w13, None, layout, "none", "silu", torch.float16, src)
    assert torch.equal(ref, gate_up_torch(x[src], None, w13, None, layout, "none", "silu", torch.float16))
    assert_close(by_index, ref, 1e-3, "gate_up rows by index")


@pytest.mark.parametrize("programs_per_sm", [1, 3])
@pytest.mark.parametrize("scheme,dtype", [("none", torch.float16), ("fp8-tensor", torch.float16),
                                          ("fp8-channel", torch.float16), ("fp8-block", torch.float16),
                                          ("fp8-block", torch.float32)])
@pytest.mark.slow
def test_down_persistent_equals_per_tile(scheme, dtype, programs_per_sm, poison_empty, monkeypatch):
    """The persistent down (programs loop over the tiles of the real row blocks) writes the same
    bits as one program per tile: empty experts, a block split over 3 experts' rows, tiles that
    outnumber the programs (1 SM here: 1 or 3 programs), partial N tiles (H = 200)."""
    from moeflow.kernels.gemm import down as down_mod
    grids = []
    kernel = down_mod._down_persistent_kernel
    monkeypatch.setattr(down_mod, "_down_persistent_kernel",
                        type("Spy", (), {"__getitem__": lambda _, grid: grids.append(grid) or kernel[grid]})())
    sch = create_scheme(scheme)
    layout = sorted_layout([5, 0, 33, 16, 0, 1])
    e, h, i = 6, 200, 128
    q2, s2 = sch.quantize_weight((torch.randn(e, h, i) / i ** 0.5).to(dtype))
    a, a_s = sch.quantize_activation(torch.randn(layout.rows, i).to(dtype))
    rw = torch.rand(layout.rows)
    bk = 128 if scheme == "fp8-block" else 64
    per_tile = down(a, a_s, q2, s2, rw, layout, scheme, dtype, kc.GemmConfig(16, 64, bk, 2), poison=True)
    persistent = down(a, a_s, q2, s2, rw, layout, scheme, dtype,
                      kc.GemmConfig(16, 64, bk, 2, programs_per_sm=programs_per_sm), poison=True)
    assert grids == [(programs_per_sm,)]  # the per-tile call above did not take it; this one did
    assert not per_tile.isnan().any()
    assert torch.equal(persistent, per_tile)


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("scheme,dtype", [("none", torch.float16), ("fp8-channel", torch.float32),
                                          ("fp8-block", torch.float16)])
def test_gate_up_and_down_kernels(scheme, dtype, tma, monkeypatch):
    """gate_up (with its fused epilogue) and down against their references, sorted layout,
    weight tiles through TMA descriptors and through pointer loads."""
    monkeypatch.setenv("MOEFLOW_TRITON_TMA", "1" if tma else "0")
    sch = create_scheme(scheme)
    layout = sorted_layout([4, 0, 19])
    e, h, i = 3, 128, 128
    q13, s13 = sch.quantize_weight((torch.randn(e, 2 * i, h) / h ** 0.5).to(dtype))
    q2, s2 = sch.quantize_weight((torch.randn(e, h, i) / i ** 0.5).to(dtype))
    x = torch.randn(layout.rows, h).to(dtype)
    xq, xs = sch.quantize_activation(x)
    cfg = kc.GemmConfig(16, 128, 64)
    inter, extra = gate_up(xq, xs, q13, s13, layout, scheme, "silu", dtype, cfg, poison=True)
    ref = gate_up_torch(xq, xs, q13, s13, layout, scheme, "silu", dtype)
    if scheme == "fp8-block":
        deq = sch.dequantize_activation(inter, extra)
        assert_close(deq, ref, 5e-2, "gate_up (fp8-block output, one e4m3 rounding)")
        a, a_s = inter, extra
    else:
        assert_close(inter, ref, 1e-3, "gate_up")
        if scheme == "fp8-channel":
            assert torch.equal(extra, inter.float().abs().amax(dim=1))  # fused row amax
        a, a_s = sch.quantize_activation(inter)
    route_w = torch.rand(layout.rows)
    out = down(a, a_s, q2, s2, route_w, layout, scheme, dtype, kc.GemmConfig(16, 32, 64), poison=True)
    assert_close(out, down_torch(a, a_s, q2, s2, route_w, layout, scheme, dtype), 1e-3, "down")


def _gemms_float64(xq, xs, q13, s13, q2, s2, route_w, layout, scheme, a, a_s):
    """float64 references of gate_up (act(gate) * up, before the layer-dtype rounding) and of down on the input the
    kernel got (a, a_s: gate_up's output, quantized by the scheme), per valid row; empty masked slots 0."""
    from moeflow.kernels.gemm.gate_up import _expert_of_row
    sch = create_scheme(scheme)
    xf = (sch.dequantize_activation(xq, xs) if xs is not None else xq.float()).double()
    af = (sch.dequantize_activation(a, a_s) if a_s is not None else a.float()).double()
    w13, w2 = sch.dequantize_weight(q13, s13).double(), sch.dequantize_weight(q2, s2).double()
    expert = _expert_of_row(layout)
    g = torch.zeros(layout.rows, w13.shape[1] // 2, dtype=torch.float64)
    d = torch.zeros(layout.rows, w2.shape[1], dtype=torch.float64)
    for e in range(w13.shape[0]):
        sel = expert == e
        gate, up = (xf[sel] @ w13[e].T).chunk(2, dim=1)
        g[sel] = torch.nn.functional.silu(gate) * up
        d[sel] = (af[sel] @ w2[e].T) * route_w[sel].double()[:, None]
    return g, d


@pytest.mark.parametrize("masked", [False, True], ids=["sorted", "masked"])
@pytest.mark.parametrize("scheme,dtype,bm,bn,tma", [
    ("none", torch.float16, 16, 64, True), ("none", torch.float32, 32, 64, False),
    ("fp8-tensor", torch.float16, 16, 64, True), ("fp8-channel", torch.float32, 16, 128, False),
    ("fp8-block", torch.float16, 16, 128, True), ("fp8-block", torch.float16, 32, 256, False)])
@pytest.mark.slow
def test_swapped_tiles(scheme, dtype, bm, bn, tma, masked, monkeypatch):
    """GemmConfig.swap_ab (each tile computed transposed, weights as the MMA's M) against float64 references, outputs
    NaN-poisoned first: an empty expert, a block over 3 experts' rows, a one-row expert, partial N tiles (I = H = 192
    but fp8-block's 256), per-row and per-column scale paths (fp8-block BLOCK_N 128 and 256), TMA and pointer
    weights; the split K and persistent down forms and an empty batch too."""
    monkeypatch.setenv("MOEFLOW_TRITON_TMA", "1" if tma else "0")
    sch = create_scheme(scheme)
    layout = masked_layout([5, 0, 16, 1], 17) if masked else sorted_layout([5, 0, 33, 1])
    e, h, i = 4, (256 if scheme == "fp8-block" else 192), (256 if scheme == "fp8-block" else 192)
    bk = 128 if scheme == "fp8-block" else 64
    q13, s13 = sch.quantize_weight((torch.randn(e, 2 * i, h) / h ** 0.5).to(dtype))
    q2, s2 = sch.quantize_weight((torch.randn(e, h, i) / i ** 0.5).to(dtype))
    xq, xs = sch.quantize_activation(torch.randn(layout.rows, h).to(dtype))
    route_w = torch.rand(layout.rows)
    gu = tiles.fit(kc.GemmConfig(bm, bn, bk, swap_ab=1), fused_pair=True, scheme=scheme, elem_bytes=1, n_size=i)
    assert gu.swap_ab == 1 and gu.block_n == bn
    inter, extra = gate_up(xq, xs, q13, s13, layout, scheme, "silu", dtype, gu, poison=True)
    valid = layout.valid_rows() if masked else torch.ones(layout.rows, dtype=torch.bool)
    # empty masked slots' rows are the caller's (NaN here): zeroed before a whole-tensor quantization
    a, a_s = (inter, extra) if scheme == "fp8-block" else sch.quantize_activation(inter.masked_fill(~valid[:, None], 0))
    outs = {form: down(a, a_s, q2, s2, route_w, layout, scheme, dtype, kc.GemmConfig(bm, bn, bk, swap_ab=1, **kw),
                       poison=True)
            for form, kw in (("per tile", {}), ("split K", dict(split_k=2)), ("persistent", dict(programs_per_sm=2)))}
    ref_g, ref_d = _gemms_float64(xq, xs, q13, s13, q2, s2, route_w, layout, scheme, a, a_s)
    got_g = sch.dequantize_activation(inter, extra) if scheme == "fp8-block" else inter.float()
    tol_g = 5e-2 if scheme == "fp8-block" else 5e-3  # one e4m3 rounding of the output; one fp16 rounding
    assert_close(got_g[valid], ref_g[valid], tol_g, "gate_up swapped")
    for form, out in outs.items():
        assert_close(out[valid], ref_d[valid], 5e-3, f"down swapped, {form}")
        if masked:
            assert torch.equal(out[~valid], torch.zeros_like(out[~valid])), form
    empty = sorted_layout([0, 0, 0, 0])
    none_in = torch.empty(0, h).to(xq.dtype)
    got, _ = gate_up(none_in, xs[:0] if xs is not None else None, q13, s13, empty, scheme, "silu", dtype, gu)
    assert got.shape == (0, i)


@pytest.mark.parametrize("counts", [[0, 0, 40, 0], [0, 1, 0, 0]], ids=["all to one expert", "one row"])
@pytest.mark.parametrize("scheme,dtype", [("none", torch.float16), ("fp8-block", torch.float16)])
def test_swapped_tiles_edge_batches(scheme, dtype, counts):
    """Swapped tiles (GemmConfig.swap_ab) on a batch routed to one expert (3 row blocks of 16) and on one row (T=1),
    against float64 references, outputs NaN-poisoned."""
    sch = create_scheme(scheme)
    layout = sorted_layout(counts)
    e, h, i = 4, 256, 256
    bk = 128 if scheme == "fp8-block" else 64
    q13, s13 = sch.quantize_weight((torch.randn(e, 2 * i, h) / h ** 0.5).to(dtype))
    q2, s2 = sch.quantize_weight((torch.randn(e, h, i) / i ** 0.5).to(dtype))
    xq, xs = sch.quantize_activation(torch.randn(layout.rows, h).to(dtype))
    route_w = torch.rand(layout.rows)
    cfg = kc.GemmConfig(16, 128, bk, swap_ab=1)
    inter, extra = gate_up(xq, xs, q13, s13, layout, scheme, "silu", dtype, cfg, poison=True)
    a, a_s = (inter, extra) if scheme == "fp8-block" else (inter, None)
    out = down(a, a_s, q2, s2, route_w, layout, scheme, dtype, cfg, poison=True)
    ref_g, ref_d = _gemms_float64(xq, xs, q13, s13, q2, s2, route_w, layout, scheme, a, a_s)
    got_g = sch.dequantize_activation(inter, extra) if scheme == "fp8-block" else inter.float()
    assert_close(got_g, ref_g, 5e-2 if scheme == "fp8-block" else 5e-3, "gate_up swapped")
    assert_close(out, ref_d, 5e-3, "down swapped")


@pytest.mark.slow
@pytest.mark.parametrize("split", [2, 7])
@pytest.mark.parametrize("scheme,dtype,i,tma", [("none", torch.float16, 320, True), ("none", torch.float32, 200, False),
                                                ("fp8-channel", torch.float16, 384, True),
                                                ("fp8-block", torch.float16, 384, False)])
def test_down_split_k(scheme, dtype, i, tma, split, monkeypatch):
    """GemmConfig.split_k: the K loop over `split` programs per tile, float32 partial tiles summed by a
    second launch. Against the reference (poisoned output and workspace), sorted and masked layouts:
    empty experts, an odd K (I = 200: a partial last step), more splits than K steps (7 > 384/128:
    clamped), a split with one step."""
    monkeypatch.setenv("MOEFLOW_TRITON_TMA", "1" if tma else "0")
    sch = create_scheme(scheme)
    e, h = 4, 96
    q2, s2 = sch.quantize_weight((torch.randn(e, h, i) / i ** 0.5).to(dtype))
    bk = 128 if scheme != "none" else 64
    for layout in (sorted_layout([3, 0, 18, 1]), masked_layout([2, 0, 5, 1], 8)):
        a, a_s = sch.quantize_activation(torch.randn(layout.rows, i).to(dtype))
        route_w = torch.rand(layout.rows)
        cfg = kc.GemmConfig(16, 32, bk, split_k=split)
        out = down(a, a_s, q2, s2, route_w, layout, scheme, dtype, cfg, poison=True)
        want = down_torch(a, a_s, q2, s2, route_w, layout, scheme, dtype)
        assert not out.isnan().any()
        assert_close(out, want, 1e-5 if dtype == torch.float32 else 1e-3, f"down split_k={split}")
        one = down(a, a_s, q2, s2, route_w, layout, scheme, dtype, kc.GemmConfig(16, 32, bk), poison=True)
        assert_close(out, one, 1e-5 if dtype == torch.float32 else 2e-3, "split vs one program per tile")


@pytest.mark.slow
@pytest.mark.parametrize("scheme,dtype,h,tma,split", [("none", torch.float16, 320, True, 3),
                                                      ("none", torch.float32, 200, False, 5),
                                                      ("fp8-tensor", torch.float16, 384, False, 3),
                                                      ("fp8-channel", torch.float16, 384, True, 5),
                                                      ("fp8-block", torch.float16, 512, True, 3),
                                                      ("fp8-block", torch.float16, 200, False, 5)])
def test_gate_up_split_k(scheme, dtype, h, tma, split, monkeypatch):
    """GemmConfig.split_k for gate_up: `split` programs per tile store float32 gate and up partial
    sums, a second launch adds them in order and runs the epilogue (activation; fp8-block's group
    quantization at any BLOCK_N; the fp8-tensor / fp8-channel amax). Against the reference and
    the one-launch form (poisoned outputs and workspace): sorted rows, rows by index, masked
    slots, an odd H (a partial last step), more splits than K steps (5 > 384/128: clamped), and a
    split with no step (3 splits of 4 steps: 2, 2, 0)."""
    monkeypatch.setenv("MOEFLOW_TRITON_TMA", "1" if tma else "0")
    sch = create_scheme(scheme)
    e, i = 4, 96 if scheme != "fp8-block" else 128  # 6 or 8 column tiles: the interpreter's time is per program
    q13, s13 = sch.quantize_weight((torch.randn(e, 2 * i, h) / h ** 0.5).to(dtype))
    bk = 128 if scheme != "none" else 64
    for layout, src in ((sorted_layout([3, 0, 18, 1]), None), (sorted_layout([3, 0, 18, 1]), torch.randint(0, 7, (22,))),
                        (masked_layout([2, 0, 5, 1], 8), None)):
        x = torch.randn(7 if src is not None else layout.rows, h).to(dtype)
        xq, xs = sch.quantize_activation(x) if sch.quantized else (x, None)
        valid = layout.valid_rows()
        got, extra = gate_up(xq, xs, q13, s13, layout, scheme, "silu", dtype, kc.GemmConfig(16, 32, bk, split_k=split),
                             poison=True, source_rows=src)
        one, one_extra = gate_up(xq, xs, q13, s13, layout, scheme, "silu", dtype, kc.GemmConfig(16, 32, bk),
                                 poison=True, source_rows=src)
        ref = gate_up_torch(xq, xs, q13, s13, layout, scheme, "silu", dtype, src)
        if scheme == "fp8-block":  # quantized here at BLOCK_N 32 (the one-launch form leaves that to quantize_groups)
            assert got.dtype == torch.float8_e4m3fn and one_extra is None
            from moeflow.kernels.rows.quant import quantize_groups
            deq = sch.dequantize_activation(got, extra)[valid]
            assert_close(deq, ref[valid], 5e-2, "gate_up split K, fp8-block output")
            q, qs = quantize_groups(one)
            assert_close(deq, sch.dequantize_activation(q, qs)[valid], 5e-2, "split vs one launch")
            continue
        assert not got[valid].isnan().any()
        assert_close(got[valid], ref[valid], 1e-5 if dtype == torch.float32 else 1e-3, f"gate_up split_k={split}")
        assert_close(got[valid], one[valid], 1e-5 if dtype == torch.float32 else 2e-3, "split vs one launch")
        if scheme == "fp8-channel":
            assert torch.equal(extra[valid], got[valid].float().abs().amax(dim=1))
            assert torch.equal(extra[~valid], torch.zeros_like(extra[~valid]))
        elif scheme == "fp8-tensor":
            assert torch.equal(extra, got[valid].float().abs().amax().reshape(1))


def test_weight_operand_choice(monkeypatch):
    """TMA descriptor where rows are 16-byte aligned and experts back to back; pointers otherwise."""
    w = torch.randn(3, 64, 128).half()
    desc, per_expert = weight_operand(w, 32, 64)
    assert desc is not w and per_expert == 64 and list(desc.shape) == [192, 128]
    one = torch.randn(1, 64, 128).half().expand(3, 64, 128)  # expert stride 0: one expert's rows
    desc, per_expert = weight_operand(one, 32, 64)
    assert desc is not one and per_expert == 0 and list(desc.shape) == [64, 128]
    odd = torch.randn(3, 64, 20).half()  # 40-byte rows: TMA cannot address them
    assert weight_operand(odd, 32, 64) == (odd, 0)
    gappy = torch.randn(3, 80, 128).half()[:, :64]  # experts not back to back
    assert weight_operand(gappy, 32, 64) == (gappy, 0)
    a = torch.randn(10, 128).half()
    assert rows_operand(a, 16, 64) is not a and list(rows_operand(a, 16, 64).shape) == [10, 128]
    odd_rows = torch.randn(10, 20).half()
    assert rows_operand(odd_rows, 16, 64) is odd_rows
    monkeypatch.setenv("MOEFLOW_TRITON_TMA", "0")
    assert weight_operand(w, 32, 64) == (w, 0) and rows_operand(a, 16, 64) is a


def test_pdl_launch_keywords(monkeypatch):
    """Programmatic dependent launch: on for CUDA devices whose target has it (moeflow.targets: sm_90 on) outside the
    interpreter unless MOEFLOW_TRITON_PDL=0; the GEMMs (early_start=False) keep the code but launch
    plainly; never on the CPU, an older GPU or in the interpreter."""
    from moeflow.kernels import common
    from moeflow.targets import BY_ARCH
    cuda = torch.device("cuda", 0)
    assert common.pdl(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setattr(common, "kernel_target", lambda device: BY_ARCH["sm_90"])
    assert common.pdl(cuda) == {"PDL": False, "launch_pdl": False}  # this test runs interpreted
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert common.pdl(cuda) == {"PDL": True, "launch_pdl": True}
    assert common.pdl(cuda, early_start=False) == {"PDL": True, "launch_pdl": False}
    monkeypatch.setenv("MOEFLOW_TRITON_PDL", "0")
    assert common.pdl(cuda) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setenv("MOEFLOW_TRITON_PDL", "1")
    monkeypatch.setattr(common, "kernel_target", lambda device: BY_ARCH["sm_89"])
    assert common.pdl(cuda) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setattr(common, "kernel_target", lambda device: BY_ARCH["sm_120"])
    assert common.pdl(cuda) == {"PDL": True, "launch_pdl": True}


def test_expanded_weights_through_tma():
    """An expert stride of 0 (every expert the same tensor, as autotune compiles with) gives the
    same bytes as the materialized weights."""
    layout = sorted_layout([3, 5, 0, 9])
    w13 = (torch.randn(1, 64, 128) / 12).half().expand(4, 64, 128)
    x = torch.randn(layout.rows, 128).half()
    cfg = kc.GemmConfig(16, 32, 64)
    got, _ = gate_up(x, None, w13, None, layout, "none", "silu", torch.float16, cfg, poison=True)
    want, _ = gate_up(x, None, w13.contiguous(), None, layout, "none", "silu", torch.float16, cfg, poison=True)
    assert torch.equal(got, want)


def test_moe_sum():
    y = torch.randn(10, 40).half()
    rows = torch.randperm(12)
    rows[rows >= 10] = -1  # two copies not computed here
    assert torch.equal(moe_sum(y, rows, 3), moe_sum_torch(y, rows, 3))


# ---------------------------------------------------------------- kernel configs
@pytest.mark.parametrize("path", sorted(kc.SHIPPED_DIR.glob("*.json")), ids=lambda p: p.name)
def test_shipped_table_is_named_for_its_shape_and_loads(path):
    """Every shipped tuned file: its name is file_name() of its own header, each entry parses (MF603 otherwise), every
    entry has its measured GEMM or layer times, and the token counts are positive."""
    data = json.loads(path.read_text())
    assert path.name == kc.file_name(data["device"], data["E"], data["N"], data["K"], data["scheme"])
    assert data["triton_version"] and data["dtype"] in ("bfloat16", "float16")
    table, measured = kc.read_table(path)
    assert table and all(t > 0 for t in table)
    assert set(measured) == {str(t) for t in table}
    for t, entry in table.items():
        assert isinstance(entry.gate_up, kc.GemmConfig) and isinstance(entry.down, kc.GemmConfig)
        if entry.fused is not None:
            assert data["scheme"] in ("none", "fp8-channel", "fp8-block") and t <= 16


def test_config_file_lookup(monkeypatch, tmp_path):
    """The override directory wins over shipped files; the nearest token count (log scale) wins."""
    monkeypatch.setenv("MOEFLOW_KERNEL_CONFIG_DIR", str(tmp_path))
    small, big = kc.MoEKernelConfig(kc.GemmConfig(16, 64, 128), kc.GemmConfig(16, 64, 128)), \
        kc.MoEKernelConfig(kc.GemmConfig(128, 128, 64, 8, 8, 3), kc.GemmConfig(128, 256, 64, 8, 8, 3))
    name = kc.file_name("NVIDIA H200", 8, 128, 256, "fp8-block")
    assert name == "E=8,N=128,K=256,device=NVIDIA_H200,scheme=fp8-block.json"
    kc.write_table(tmp_path / name, {"triton_version": "x"}, {1: small, 4096: big})
    table = kc.find_table("NVIDIA H200", 8, 128, 256, "fp8-block")
    assert kc.nearest(table, 1) == small and kc.nearest(table, 60) == small and kc.nearest(table, 70) == big
    assert json.loads((tmp_path / name).read_text())["triton_version"] == "x"


def test_config_borrowed_from_another_expert_count(monkeypatch, tmp_path):
    """No file for E=4 (say 2 ranks of an 8-expert model): the E=8 table of the same device, N, K
    and scheme is borrowed, with a warning, its token counts rescaled to the same rows per expert
    (tuned at T over 8 experts = T/2 here); the nearer E wins over a farther one; another N or
    scheme is never borrowed."""
    monkeypatch.setenv("MOEFLOW_KERNEL_CONFIG_DIR", str(tmp_path))
    a, b = kc.MoEKernelConfig(kc.GemmConfig(16, 64, 128), kc.GemmConfig(16, 64, 128)), \
        kc.MoEKernelConfig(kc.GemmConfig(64, 128, 64, 8, 8, 3), kc.GemmConfig(64, 256, 64, 8, 8, 3))
    kc.write_table(tmp_path / kc.file_name("GPU X", 8, 128, 256, "none"), {}, {1: a, 4096: b})
    kc.write_table(tmp_path / kc.file_name("GPU X", 64, 128, 256, "none"), {}, {1: b})
    kc.write_table(tmp_path / kc.file_name("GPU X", 4, 128, 512, "none"), {}, {1: b})  # another K
    with pytest.warns(UserWarning, match=r"borrowing 'E=8,N=128.*moeflow tune --local-experts 4"):
        table = kc.find_table("GPU X", 4, 128, 256, "none")
    assert table == {1: a, 2048: b}
    with pytest.warns(UserWarning, match="using defaults"):
        assert kc.find_table("GPU X", 4, 128, 256, "fp8-block") is None


def test_config_file_missing_and_malformed(monkeypatch, tmp_path):
    monkeypatch.setenv("MOEFLOW_KERNEL_CONFIG_DIR", str(tmp_path))
    with pytest.warns(UserWarning, match="moeflow tune"):
        assert kc.find_table("Some GPU", 3, 5, 7, "none") is None
    (tmp_path / kc.file_name("Some GPU", 3, 5, 7, "none")).write_text("{not json")
    with pytest.raises(Exception) as info:
        kc.find_table("Some GPU", 3, 5, 7, "none")
    assert getattr(info.value, "code", None) == "MF603"


@pytest.mark.parametrize("entry,what", [
    ({"block_m": 48}, "gate_up.block_m = 48: a power of two"),
    ({"block_n": "128"}, "gate_up.block_n = '128': an integer"),
    ({"num_warps": 3}, "gate_up.num_warps = 3: one of 1, 2, 4, 8"),
    ({"num_warps": 16}, "gate_up.num_warps = 16: one of 1, 2, 4, 8"),
    ({"num_stages": 0}, "gate_up.num_stages = 0: from 1 to 8"),
    ({"block_k": 512}, "gate_up.block_k = 512: a power of two from 1 to 256"),
    ({"swap_ab": 2}, "gate_up.swap_ab = 2: from 0 to 1"),
    ({"blockm": 64}, "gate_up: .*unexpected keyword argument 'blockm'"),
    ({"num_warps": 4.0}, "gate_up.num_warps = 4.0: an integer"),
])
def test_config_file_hand_edited_wrong(monkeypatch, tmp_path, entry, what):
    """An entry a person edited into a file of $MOEFLOW_KERNEL_CONFIG_DIR with a value no kernel takes: MF603 at the
    lookup, naming the field and what it may hold, instead of a compile error inside the forward."""
    monkeypatch.setenv("MOEFLOW_KERNEL_CONFIG_DIR", str(tmp_path))
    good = {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 3}
    body = {"configs": {"16": {"gate_up": {**good, **entry}, "down": good}}}
    (tmp_path / kc.file_name("Some GPU", 3, 5, 7, "none")).write_text(json.dumps(body))
    with pytest.raises(Exception, match=what) as info:
        kc.find_table("Some GPU", 3, 5, 7, "none")
    assert getattr(info.value, "code", None) == "MF603"


def test_fit_brings_oversized_tiles_within_budget():
    """Tiles no tuner writes (a hand-edited file): the accumulators are held to 256 float32 registers a thread and
    one stage to the shared-memory budget; the one launch's stages likewise. The tuner's candidates and the shipped
    tables are left as they were (tests/kernels/test_kernel_defaults.py, test_tune_fused.py)."""
    g = tiles.fit(kc.GemmConfig(256, 256, 256, 1, 4, 8), fused_pair=True, scheme="none", elem_bytes=4, n_size=1024)
    assert 2 * g.block_m * g.block_n <= 256 * 32 * 4 and min(g.block_m, g.block_n) >= 16
    assert g.num_stages * (g.block_m * g.block_k + 2 * g.block_k * g.block_n) * 4 <= 200 * 1024
    d = tiles.fit(kc.GemmConfig(256, 256, 256, 1, 8, 8), fused_pair=False, scheme="none", elem_bytes=2, n_size=1024)
    assert (d.block_m, d.block_n) == (256, 256) and (d.block_m * d.block_k + d.block_k * d.block_n) * 2 <= 200 * 1024
    f = tiles.fit_fused(kc.FusedConfig(256, 256, 256, 256, 8, 8), "none")
    assert f.num_stages * 2 * f.block_n1 * f.block_k1 * 2 <= 200 * 1024 and f.block_n2 * f.block_k2 * 2 <= 200 * 1024
    assert f.block_n1 >= 16 and f.block_k1 >= 16


def test_fit_rules():
    """fp8-block: BLOCK_K divides 128; gate_up BLOCK_N of 128 or more is 128 (or 256 when I allows),
    narrower ones stay (the groups are then quantized by a separate kernel); shared memory bounded
    by lowering stages; minimum dot tiles."""
    g = tiles.fit(kc.GemmConfig(8, 64, 256, 1, 4, 6), fused_pair=True, scheme="fp8-block", elem_bytes=1, n_size=384)
    assert (g.block_m, g.block_n, g.block_k) == (16, 64, 128)
    g = tiles.fit(kc.GemmConfig(8, 192, 256, 1, 4, 6), fused_pair=True, scheme="fp8-block", elem_bytes=1, n_size=384)
    assert (g.block_m, g.block_n, g.block_k) == (16, 128, 128)
    for t in (1, 64, 4096):  # the defaults keep the fused epilogue (what they were measured with)
        assert tiles.default_config(t, 8, 8, "fp8-block").gate_up.block_n >= 128
    assert tiles.fit(kc.GemmConfig(64, 256, 128), fused_pair=True, scheme="fp8-block", elem_bytes=1, n_size=512).block_n == 256
    big = tiles.fit(kc.GemmConfig(128, 256, 128, 8, 8, 5), fused_pair=True, scheme="none", elem_bytes=4, n_size=512)
    assert big.num_stages * (128 * 128 + 2 * 128 * 256) * 4 <= 200 * 1024 or big.num_stages == 1
    assert tiles.fit(kc.GemmConfig(16, 16, 16), fused_pair=False, scheme="fp8-tensor", elem_bytes=1, n_size=64).block_k == 32
    # the Gluon down (kernels/gemm/down_wgmma.py): only fp8-block down tiles it runs keep scale_overlap; JSON true is 1
    so = lambda cfg, **kw: tiles.fit(cfg, **{**dict(fused_pair=False, scheme="fp8-block", elem_bytes=1, n_size=4096), **kw}).scale_overlap
    assert so(kc.GemmConfig(128, 128, 128, 8, 8, 4, scale_overlap=2)) == 2
    assert so(kc.GemmConfig(128, 128, 128, 8, 8, 4, scale_overlap=True)) == 1
    assert so(kc.GemmConfig(128, 128, 128, 8, 8, 4, scale_overlap=1), scheme="fp8-channel") == 0
    # the Gluon gate_up (kernels/gemm/gate_up_wgmma.py): 128 x 128 weight steps, 16 rows a warp; its flag is 1
    assert so(kc.GemmConfig(128, 128, 128, 8, 8, 4, scale_overlap=2), fused_pair=True) == 1
    assert so(kc.GemmConfig(64, 128, 128, 8, 4, 5, scale_overlap=1), fused_pair=True) == 1
    assert so(kc.GemmConfig(128, 256, 128, 8, 8, 3, scale_overlap=1), fused_pair=True) == 0  # BLOCK_N stays 256
    assert so(kc.GemmConfig(64, 128, 128, 8, 8, 4, scale_overlap=1), fused_pair=True) == 0  # 8 warps need 128 rows
    assert so(kc.GemmConfig(128, 64, 128, 8, 8, 4, scale_overlap=1), fused_pair=True) == 0  # half a quant group
    assert so(kc.GemmConfig(128, 128, 128, 8, 8, 4, scale_overlap=1), fused_pair=True, scheme="fp8-channel") == 0
    assert so(kc.GemmConfig(128, 256, 128, 8, 8, 3, scale_overlap=1)) == 0  # two weight-scale blocks a tile
    assert so(kc.GemmConfig(64, 128, 128, 8, 8, 4, scale_overlap=1)) == 0  # 8 warps need 128 rows
    assert so(kc.GemmConfig(128, 128, 128, 8, 8, 4, scale_overlap=3)) == 0


ROUTING = {  # name: MoEConfig routing fields (E=64, K=6)
    "softmax-renorm": dict(scoring="softmax", renormalize=True),
    "softmax": dict(scoring="softmax", renormalize=False),
    "sigmoid-renorm-scaled": dict(scoring="sigmoid", renormalize=True, routed_scaling_factor=2.5),
    "grouped-bias (DeepSeek-V3)": dict(scoring="sigmoid", renormalize=True, num_expert_groups=8, topk_groups=4,
                                       use_correction_bias=True, routed_scaling_factor=2.5),
    "grouped (DeepSeek-V2)": dict(scoring="softmax", renormalize=False, num_expert_groups=8, topk_groups=3),
}


@pytest.mark.parametrize("t", [1, 37])
@pytest.mark.parametrize("case", ROUTING)
def test_route_kernel_matches_the_torch_router(case, t):
    """The one-launch router: the same expert ids (in order) and weights as routing/torch_topk.py."""
    from moeflow import MoEConfig
    from moeflow.kernels.routing.route import route
    from moeflow.routing import create_router
    fields = ROUTING[case]
    cfg = MoEConfig(num_experts=64, hidden_size=16, intermediate_size=16, top_k=6, **fields)
    logits = torch.randn(t, 64) * 3
    bias = (torch.rand(64) - 0.5) * 0.2 if cfg.use_correction_bias else None
    want_ids, want_w = create_router(cfg, "torch")(logits, bias)
    ids, w = route(logits, bias, 6, cfg.scoring, cfg.renormalize, cfg.num_expert_groups, cfg.topk_groups,
                   cfg.routed_scaling_factor)
    assert ids.dtype == torch.int32 and torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("e,k,bias", [(8, 2, False), (16, 4, True), (256, 8, True)])
def test_route_kernel_rows_per_program(e, k, bias):
    """launch_shape's rows per program (16 tokens of 8 experts, 8 of 16, 1 of 256): a last block
    past T; a row of exactly tied scores picks the lowest ids in order (torch.topk's order among
    ties is unspecified, so that row is compared with torch by its weights alone)."""
    from moeflow import MoEConfig
    from moeflow.kernels.routing.route import route
    from moeflow.routing import create_router
    cfg = MoEConfig(num_experts=e, hidden_size=16, intermediate_size=16, top_k=k, scoring="sigmoid" if bias else "softmax",
                    use_correction_bias=bias)
    t = 37
    logits = torch.randn(t, e) * 3
    logits[5] = 0.5  # a row of exact ties: ids 0 .. k-1 in order
    b = torch.full((e,), 0.05) if bias else None  # one value for every expert: the tied row stays tied
    want_ids, want_w = create_router(cfg, "torch")(logits, b)
    ids, w = route(logits, b, k, cfg.scoring, cfg.renormalize)
    assert torch.equal(ids[5], torch.arange(k, dtype=torch.int32))
    rest = torch.arange(t) != 5
    assert torch.equal(ids[rest], want_ids[rest])
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize("case", ROUTING)
def test_route_stream_kernel_matches_the_torch_router(case, lanes):
    """kernels/routing/route_stream.py (threads a token: lanes): the same expert ids (in order) and weights as
    routing/torch_topk.py, a last block past T, and a row of exact ties picking the lowest ids in order; softmax
    with groups runs kernels/routing/route.py instead (streams())."""
    from moeflow import MoEConfig
    from moeflow.kernels.routing.route import route
    from moeflow.kernels.routing.route_stream import streams
    from moeflow.routing import create_router
    fields = ROUTING[case]
    cfg = MoEConfig(num_experts=64, hidden_size=16, intermediate_size=16, top_k=6, **fields)
    t = 37
    logits = torch.randn(t, 64) * 3
    logits[5] = 0.5
    bias = torch.full((64,), 0.05) if cfg.use_correction_bias else None  # one value: the tied row stays tied
    if bias is not None:
        bias[7:40:3] = -0.1
    want_ids, want_w = create_router(cfg, "torch")(logits, bias)
    args = (6, cfg.scoring, cfg.renormalize, cfg.num_expert_groups, cfg.topk_groups, cfg.routed_scaling_factor)
    ids, w = route(logits, bias, *args, lanes=lanes, num_warps=1)
    assert streams(cfg.scoring, bias is not None, cfg.num_expert_groups) == (case != "grouped (DeepSeek-V2)")
    rest = torch.arange(t) != 5
    assert ids.dtype == torch.int32 and torch.equal(ids[rest], want_ids[rest])
    if bias is None:
        assert torch.equal(ids[5], torch.arange(6, dtype=torch.int32))
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-7)
    assert torch.equal(ids, route(logits, bias, *args, lanes=0)[0])  # the warp-per-token kernel's ids


def test_large_batch_of_two_expert_groups_routes_with_the_one_warp_kernel(monkeypatch):
    """A biased grouped router with 2 experts a group (E=64 in 32 groups, which the planner gives the Triton router):
    at T >= 2048 route() had picked the streaming kernel, whose lanes load 4 columns of one group, and raised an
    uncoded ValueError at the first large batch; it runs the one-warp kernel there, with the torch router's ids.
    The kernel choice is made as at T=2048 (stream_pays asked about 2048 tokens) on a batch of 96, which the
    interpreter runs in seconds rather than minutes."""
    from moeflow import MoEConfig
    from moeflow.kernels.routing import route as route_module
    from moeflow.kernels.routing.route import route
    from moeflow.kernels.routing.route_stream import stream_pays
    from moeflow.routing import create_router
    assert stream_pays(2048, 64) and not stream_pays(2048, 64, 32)
    monkeypatch.setattr(route_module, "stream_pays", lambda t, e_pow2, num_groups=1: stream_pays(2048, e_pow2, num_groups))
    cfg = MoEConfig(num_experts=64, hidden_size=16, intermediate_size=16, top_k=8, scoring="sigmoid",
                    num_expert_groups=32, topk_groups=4, use_correction_bias=True)
    logits, bias = torch.randn(96, 64), (torch.rand(64) - 0.5) * 0.1
    ids, w = route(logits, bias, 8, "sigmoid", True, 32, 4, 1.0)
    want_ids, want_w = create_router(cfg, "torch")(logits, bias)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("renormalize", [True, False])
def test_sigmoid_routers_agree_where_the_scores_saturate(renormalize):
    """Sigmoid without a bias: float32 sigmoids are exactly 1.0 from a logit of about 16.6, so the scores tie where
    the logits do not. The torch router, routing/route.py and the streaming kernel all pick the largest logits (the
    warp-a-token kernel had ranked the tied scores and picked the lowest ids: other experts, at full weight)."""
    from moeflow import MoEConfig
    from moeflow.kernels.routing.route import route
    from moeflow.routing import create_router
    cfg = MoEConfig(num_experts=16, hidden_size=16, intermediate_size=16, top_k=3, scoring="sigmoid",
                    renormalize=renormalize)
    logits = torch.randn(9, 16)
    logits[:, [2, 5, 9, 11, 14]] = torch.tensor([20.0, 30.0, 25.0, 18.0, 40.0])  # five saturate; the best: 14, 5, 9
    assert torch.sigmoid(logits[:, [2, 5, 9, 11, 14]]).eq(1.0).all()
    want_ids, want_w = create_router(cfg, "torch")(logits, None)
    assert torch.equal(want_ids, torch.tensor([[14, 5, 9]], dtype=torch.int32).expand(9, 3))
    for lanes in (0, 1, 2):  # 0: kernels/routing/route.py's warp-a-token kernel; else the streaming kernel
        ids, w = route(logits, None, 3, "sigmoid", renormalize, lanes=lanes, num_warps=1)
        assert torch.equal(ids, want_ids), lanes
        torch.testing.assert_close(w, want_w, rtol=1e-6, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("e,k,lanes,t", [(100, 8, 4, 9), (13, 3, 1, 1), (128, 8, 8, 33)])
def test_route_stream_kernel_odd_shapes(e, k, lanes, t):
    """The streaming kernel past a part-filled last chunk (E not a multiple of 4 * lanes), one token, and 8
    threads a token."""
    from moeflow import MoEConfig
    from moeflow.kernels.routing.route import route
    from moeflow.routing import create_router
    for scoring, renorm in (("softmax", True), ("softmax", False), ("sigmoid", True)):
        cfg = MoEConfig(num_experts=e, hidden_size=16, intermediate_size=16, top_k=k, scoring=scoring,
                        renormalize=renorm)
        logits = torch.randn(t, e) * 3
        want_ids, want_w = create_router(cfg, "torch")(logits, None)
        ids, w = route(logits, None, k, scoring, renorm, lanes=lanes, num_warps=1)
        assert torch.equal(ids, want_ids), (scoring, renorm)
        torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-7)


def test_tune_merge_keeps_other_token_counts(monkeypatch, tmp_path):
    """`moeflow tune --merge` rewrites the token counts it tunes and keeps the file's others
    (the search itself is replaced: it needs a GPU)."""
    import argparse

    from moeflow.cli import tune as tune_cli
    from moeflow.tune import autotune
    a, b, c = (kc.MoEKernelConfig(kc.GemmConfig(bm, 64, 128), kc.GemmConfig(bm, 64, 128)) for bm in (16, 32, 64))
    name = kc.file_name("GPU X", 8, 32, 64, "none")
    kc.write_table(tmp_path / name, {}, {1: a, 4096: b}, {"1": {"gate_up": 1.0, "down": 2.0}})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "GPU X")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    monkeypatch.setattr(autotune, "tune", lambda shape, tokens, on_result, **kw:
                        on_result({4096: c}, {"4096": {"gate_up": 3.0, "down": 4.0}}))
    parser = argparse.ArgumentParser()
    tune_cli.add_parser(parser.add_subparsers())
    for merge, want in ((True, {1: a, 4096: c}), (False, {4096: c})):
        args = parser.parse_args(["tune", "--experts", "8", "--inter", "32", "--hidden", "64", "--tokens", "4096",
                                  "--device", "cpu", "--out", str(tmp_path)] + (["--merge"] if merge else []))
        if not merge:
            kc.write_table(tmp_path / name, {}, {1: a, 4096: b}, {"1": {"gate_up": 1.0, "down": 2.0}})
        assert args.func(args) == 0
        table, measured = kc.read_table(tmp_path / name)
        assert table == want
        assert measured["4096"] == {"gate_up": 3.0, "down": 4.0} and (("1" in measured) == merge)


def test_tune_times_gate_up_rows_as_the_layer_feeds_them(monkeypatch, tmp_path):
    """A single-process layer's table is timed with gate_up's rows by index (the local dispatcher's plan),
    a --local-experts (expert parallelism) table with rows in order; the file says which. The indexed
    random batch is the sorted one, given by index."""
    import argparse

    from moeflow.cli import tune as tune_cli
    from moeflow.tune import autotune
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "GPU X")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    monkeypatch.setattr(autotune, "tune", lambda shape, tokens, on_result, indexed_rows, **kw:
                        (seen.append((shape.num_experts, indexed_rows)), on_result({}, {})))
    parser = argparse.ArgumentParser()
    tune_cli.add_parser(parser.add_subparsers())
    for extra, want in (([], (8, True)), (["--local-experts", "4"], (4, False))):
        args = parser.parse_args(["tune", "--experts", "8", "--inter", "32", "--hidden", "64", "--tokens", "16",
                                  "--device", "cpu", "--out", str(tmp_path)] + extra)
        assert args.func(args) == 0 and seen[-1] == want
        meta = json.loads((tmp_path / kc.file_name("GPU X", want[0], 32, 64, "none")).read_text())
        assert meta["gate_up_rows"] == ("by index" if want[1] else "in order") and meta["capability"] == [9, 0]
    shape = autotune.Shape(6, 64, 32, 2, "none")
    plain, indexed = autotune.random_batch(shape, 9, "cpu", seed=3), autotune.random_batch(shape, 9, "cpu", seed=3,
                                                                                           indexed=True)
    assert indexed.hidden.shape == (9, 64) and torch.equal(indexed.hidden[indexed.source_rows], plain.hidden)
    assert torch.equal(indexed.offsets, plain.offsets) and torch.equal(indexed.weights, plain.weights)
    assert torch.equal(indexed.source_rows[indexed.copy_rows], torch.arange(9)[:, None].expand(9, 2))  # its inverse


@pytest.mark.parametrize("dtype,k,copies,g", [(torch.float16, 200, 3, 0), (torch.float32, 3000, 2, 0),
                                              (torch.float8_e4m3fn, 384, 8, 3), (torch.bfloat16, 8, 1, 0)])
def test_scatter_rows_equals_gather_rows(dtype, k, copies, g):
    """The row copy from the inverse map (each source row read once) equals the gather by source rows, every
    element written (outputs start as garbage: torch.empty), scales included; a source with no rows."""
    from moeflow.kernels.rows.quant import scatter_rows
    s = 9
    x = torch.randn(s, k).to(dtype)
    xs = torch.rand(s, g) if g else None
    perm = torch.randperm(s * copies)
    copy_rows = perm.view(s, copies)
    src = torch.empty_like(perm)
    src[perm] = torch.arange(s * copies) // copies
    got, got_s = scatter_rows(x, xs, copy_rows)
    want, want_s = gather_rows(x, xs, src)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert (got_s is None and want_s is None) or torch.equal(got_s, want_s)
    none, _ = scatter_rows(x[:0], None, copy_rows[:0])
    assert none.shape == (0, k)


def test_scatter_rows_skips_dropped_copies():
    """copy_rows of a padded batch (-1: a copy routed to no expert, the local dispatcher's dropping form): the named
    rows get their source row, nothing is written for a -1 (the rows no entry names keep what they held)."""
    from moeflow.kernels.rows.quant import scatter_rows
    s, copies = 7, 3
    x, xs = torch.randn(s, 40).half(), torch.rand(s, 2)
    copy_rows = torch.randperm(s * copies).view(s, copies)
    copy_rows[torch.rand(s, copies) < 0.4] = -1
    copy_rows[2] = -1  # a padding token: every copy dropped
    got, got_s = scatter_rows(x, xs, copy_rows)
    named = copy_rows[copy_rows >= 0]
    src = torch.arange(s)[:, None].expand(s, copies)[copy_rows >= 0]
    assert torch.equal(got[named], x[src]) and torch.equal(got_s[named], xs[src])


@pytest.mark.parametrize("dropping", [False, True])
def test_gate_up_rows_in_order_by_scatter(monkeypatch, dropping):
    """gate_up with x_tma and copy_rows (the local dispatcher's inverse map) scatters the rows into order:
    the same bits as the gather by source_rows, which it falls back to without copy_rows. dropping: the dispatcher's
    dropping batch (ids -1, as a bucketed call's padding tokens), whose copy_rows holds -1 for the dropped copies and
    whose padding rows past offsets[-1] the scatter leaves unwritten (no tile stores them)."""
    from moeflow.dispatch.expert_sort import sort_dropping
    from moeflow.kernels.rows import quant as quant_mod
    calls = []
    for name in ("gather_rows", "scatter_rows"):
        fn = getattr(quant_mod, name)
        monkeypatch.setattr(quant_mod, name, lambda *a, _f=fn, _n=name: calls.append(_n) or _f(*a))
    ids = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2], [1, 0], [1, 2]], dtype=torch.int32)
    if dropping:
        ids[3:] = torch.tensor([[-1, -1], [1, -1], [-1, -1]], dtype=torch.int32)
        offsets, _, row_of_copy, source, _, _, _ = sort_dropping(ids, torch.rand(6, 2), 3)
    else:
        offsets, _, row_of_copy, source, _ = sort_by_expert_torch(ids, torch.rand(6, 2), 3)
    layout = RowLayout(False, offsets, 3, 0, 12)
    n = int(offsets[-1])  # 7 copies and 5 padding rows where dropping
    w13 = (torch.randn(3, 128, 64) / 8).half()
    x = torch.randn(6, 64).half()
    cfg = kc.GemmConfig(16, 64, 64, x_tma=1)
    by_gather, _ = gate_up(x, None, w13, None, layout, "none", "silu", torch.float16, cfg, poison=True, source_rows=source)
    by_scatter, _ = gate_up(x, None, w13, None, layout, "none", "silu", torch.float16, cfg, poison=True,
                            source_rows=source, copy_rows=row_of_copy)
    assert calls == ["gather_rows", "scatter_rows"] and n == (7 if dropping else 12)
    assert torch.equal(by_gather[:n], by_scatter[:n]) and not by_scatter[:n].isnan().any()
    assert_close(by_scatter[:n], gate_up_torch(x, None, w13, None, layout, "none", "silu", torch.float16, source)[:n],
                 1e-3, "gate_up, rows scattered into order")


@pytest.mark.parametrize("scheme, h, quantized", [("fp8-tensor", 2048, True), ("fp8-tensor", 2049, False),
                                                  ("fp8-block", 4096, True), ("fp8-channel", 4096, True)])
def test_sort_and_quantize_asks_the_sort_for_fp8_tensor_tokens_only_in_small_batches(monkeypatch, scheme, h, quantized):
    """fp8-tensor's parts each read the whole batch for its amax: the dispatcher's sort quantizes its tokens up to
    TENSOR_QUANT_IN_SORT_MAX elements and leaves larger batches to the runner (per-token schemes at any size)."""
    from moeflow.dispatch import expert_sort
    seen = []
    monkeypatch.setattr(expert_sort, "_triton_sort", lambda ids, w, e, hidden=None, scheme="none": seen.append(hidden))
    x = torch.zeros(expert_sort.TENSOR_QUANT_IN_SORT_MAX // 2048, h)
    ids = torch.zeros(x.shape[0], 2, dtype=torch.int32)
    out = expert_sort.sort_and_quantize(ids, torch.ones(x.shape[0], 2), 4, x, scheme)
    assert (seen[0] is x) == quantized and len(out) == 7 and out[5] is None  # torch's sort ran: the runner quantizes


def test_host_cdiv_and_next_pow2_agree_with_triton():
    """kernels/common's host helpers stand in for triton.cdiv / triton.next_power_of_2 (constexpr functions, slow to
    call on the host) in every launch's grid and block sizes: they must give the same values."""
    import triton
    from moeflow.kernels.common import cdiv, next_pow2
    assert [next_pow2(n) for n in range(0, 70000)] == [triton.next_power_of_2(n) for n in range(0, 70000)]
    assert next_pow2((1 << 40) + 1) == triton.next_power_of_2((1 << 40) + 1) == 1 << 41
    pairs = [(a, b) for a in range(0, 600) for b in (1, 2, 3, 7, 16, 64, 128, 255)]
    assert [cdiv(a, b) for a, b in pairs] == [triton.cdiv(a, b) for a, b in pairs]


def test_tensor_amax_by_row_as_on_sm100(monkeypatch):
    """fp8-tensor's gate_up amax, one atomic a row (what sm_100 compiles: targets.Target.tile_to_scalar), equals the
    whole tile's one atomic, and the inter it comes with is the same."""
    from moeflow.kernels.common import RowLayout
    from moeflow.kernels.configs import GemmConfig
    from moeflow.kernels.gemm.gate_up import gate_up
    from moeflow.quant import create_scheme
    sch = create_scheme("fp8-tensor")
    x = torch.randn(40, 128, dtype=torch.float16)
    xq, xs = sch.quantize_activation(x)
    w13, s13 = sch.quantize_weight(torch.randn(2, 192, 128) * 0.1)
    lay = RowLayout(False, torch.tensor([0, 17, 40]), 2, 0, 40)
    cfg = GemmConfig(16, 32, 64)
    outs = []
    for arch in ("sm_90", "sm_100"):
        monkeypatch.setenv("MOEFLOW_KERNEL_ARCH", arch)
        outs.append(gate_up(xq, xs.expand(40, 1), w13, s13, lay, "fp8-tensor", "silu", torch.float16, cfg))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert outs[0][1].item() == outs[0][0].float().abs().max().item()
