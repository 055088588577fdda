"""fp8-block gate_up GEMM for Hopper in Gluon, the K loop's block scaling overlapped with the tensor cores.

x [R, H] fp8e4m3 + x_scale [R, H/128] fp32 (sorted layout, rows in order), w13 gate_up_proj [E, 2I, H] fp8e4m3
+ w13_scale [E, 2I/128, H/128] fp32 -> inter [R, I] fp8e4m3 + scale [R, I/128] fp32: act(gate) * up rounded to the
layer dtype, then quantized in 1x128 groups: the same bits as gemm/gate_up.py's Triton kernel (torch reference:
gate_up.gate_up_torch).
Kernel: _gate_up_wgmma_kernel (tile forms: its docstring; K loop: _tile's). Launcher: launch(), where gemm/choice.py
picks it (cannot_run() says None); pair_tiles() picks the 64-row tile form.
Imported only when a config asks for it on a CUDA device (gate_up.py): CPU runs never load Gluon.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ... import env as moeflow_env
from ..common import expert_rows, fp8_scale, gated_act, grouped_tile, tma_rows, to_fp8
from .tiles import wgmma_gate_up_fits
from .down_wgmma import gluon, smem_layout

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .down_wgmma import _expert_block, _release_barriers, _scaled_add, _slot_barriers, unroll

    _INTER = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}

    @gluon.jit
    def _load_step(x_desc, w_desc, x_bufs, w_bufs, x_bars, w_bars, t, x_row, plane, n_row, STAGES: gl.constexpr,
                   pred):
        """Start TMA loads of step t's x tile and its gate and up weight tiles (one 3-D box: planes plane, plane + 1)
        into slot t % STAGES; each lands on its own barrier."""
        slot = t % STAGES
        mbarrier.expect(x_bars.index(slot), x_desc.block_type.nbytes, pred=pred)
        mbarrier.expect(w_bars.index(slot), w_desc.block_type.nbytes, pred=pred)
        k = t * 128
        tma.async_copy_global_to_shared(x_desc, [x_row, k], x_bars.index(slot), x_bufs.index(slot), pred=pred)
        tma.async_copy_global_to_shared(w_desc, [plane, n_row, k], w_bars.index(slot), w_bufs.index(slot), pred=pred)

    @gluon.jit
    def _quarter(x_bufs, w_bufs, t, q: gl.constexpr, d, STAGES: gl.constexpr, QCOLS: gl.constexpr):
        """Start step t's wgmma of quarter q into d's registers (d's values unused); the caller has waited for the
        step's tiles. 128-row tile (QCOLS 64): 0 gate 0-63, 1 gate 64-127, 2 up 0-63, 3 up 64-127. Pair tile
        (QCOLS 128, each warpgroup 64 of the columns): 0 gate of column tile A, 1 gate of B, 2 up of A, 3 up of B."""
        slot = t % STAGES
        w = w_bufs.index(slot).reshape([4 * QCOLS, 128]).slice(q * QCOLS, QCOLS, dim=0)  # gate rows, then up rows
        return warpgroup_mma(x_bufs.index(slot), w.permute((1, 0)), d, use_acc=False, is_async=True)

    @gluon.jit
    def _step_scales(xs_rows, gs, us, stride_wsn, t, PAIR: gl.constexpr):
        """Step t's scales of the four quarters' products: the rows' x scale times the weight block's (a 128-row
        tile: gate, gate, up, up of its column tile; a pair tile: gate A, gate B, up A, up B)."""
        s_x = gl.load(xs_rows + t)
        if PAIR:
            return (s_x * gl.load(gs + t), s_x * gl.load(gs + stride_wsn + t), s_x * gl.load(us + t),
                    s_x * gl.load(us + stride_wsn + t))
        else:
            s_g = s_x * gl.load(gs + t)
            s_u = s_x * gl.load(us + t)
            return s_g, s_g, s_u, s_u

    @gluon.jit
    def _store_group(h, scale, row_start, row_end, col0, out_ptr, stride_out, ROWS: gl.constexpr,
                     COLS: gl.constexpr, num_warps: gl.constexpr):
        """Quantize h [ROWS, COLS] float32 by its rows' group scales and store it at rows row_start .., intermediate
        columns col0 .. col0 + COLS (rows past row_end left alone), in 16-byte rows."""
        st: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
        q = gl.convert_layout(to_fp8(h, scale[:, None], False), st)
        rows = row_start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, st))
        cols = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, st))
        gl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], q, mask=(rows < row_end)[:, None])

    @gluon.jit
    def _tile(x_desc, w_desc, xs_ptr, ws_ptr, out_ptr, outs_ptr, expert, pid_n, row_start, row_end, I, H,
              planes_per_expert, stride_xs, stride_wse, stride_wsn, stride_out, stride_outs,
              ACT: gl.constexpr, INTER_DTYPE: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
              UNROLL: gl.constexpr, PAIR: gl.constexpr, num_warps: gl.constexpr):
        """PAIR False: the [BLOCK_M, 128] tile of the intermediate at rows row_start .. row_end - 1. PAIR: the
        [64, 256] pair tile of a block of at most 64 rows over column tiles pid_n and pid_n + 1, with the pair
        descriptors (the two warpgroups side by side along the columns).

        Each 128-deep K step's gate and up products are scaled before they are added (acc += (x_k @ w_k) * s_k);
        Triton would wait for every wgmma before scaling it, idling the tensor cores. Here each step runs four
        wgmmas of QCOLS columns (_quarter) into two products by turns: each is scaled into its quarter of the
        accumulators while the next runs (four quarters plus two products: 192 registers a thread at 128 rows and
        8 warps, where two full-width products by turns would need 256). A loop body runs UNROLL steps and ends
        with nothing in flight (down_wgmma.unroll). Operands come by TMA into STAGES shared-memory slots; step
        t + STAGES is loaded into step t's slot once step t's last wgmma is done. A step's gate and up weight tiles
        come in one copy (w13 as planes [2E, I, H]), and the x and weight tiles land on barriers of their own
        allocations: 3 of the compiler's CTA barriers a refill, not 5 (down_wgmma._slot_barriers says why).
        Epilogue: act(gate) * up in the layer dtype, one amax per row and 128-column group, fp8 stored in
        16-byte rows. Pair or not, each row and column gets the same wgmmas and scaled adds: the same bits."""
        ROWS: gl.constexpr = 64 if PAIR else BLOCK_M
        QCOLS: gl.constexpr = 128 if PAIR else 64
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                      warps_per_cta=[4, num_warps // 4] if PAIR else [num_warps, 1],
                                                      instr_shape=[16, 64, 32])
        rows_l: gl.constexpr = gl.SliceLayout(1, mma)
        x_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, ROWS, 128], x_desc.layout)
        w_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 2, 2 * QCOLS, 128], w_desc.layout)
        x_bars, w_bars = _slot_barriers(STAGES)
        x_row = row_start.to(gl.int32)
        plane = (expert * planes_per_expert).to(gl.int32)  # the expert's gate plane; plane + 1: its up plane
        n_row = pid_n * 128
        n = H // 128
        for s in gl.static_range(STAGES):
            _load_step(x_desc, w_desc, x_bufs, w_bufs, x_bars, w_bars, s, x_row, plane, n_row, STAGES, s < n)
        rows = row_start + gl.arange(0, ROWS, layout=rows_l)
        xs_rows = xs_ptr + gl.minimum(rows, row_end - 1) * stride_xs  # row r's scale of K group t at xs_rows[r] + t
        gs = ws_ptr + expert.to(gl.int64) * stride_wse + pid_n * stride_wsn  # the (first) tile's gate block row
        us = gs + (I // 128) * stride_wsn
        acc0 = gl.zeros([ROWS, QCOLS], gl.float32, mma)  # quarter 0's sum (_quarter says which columns)
        acc1 = gl.zeros([ROWS, QCOLS], gl.float32, mma)
        acc2 = gl.zeros([ROWS, QCOLS], gl.float32, mma)
        acc3 = gl.zeros([ROWS, QCOLS], gl.float32, mma)
        d_a = gl.zeros([ROWS, QCOLS], gl.float32, mma)
        d_b = gl.zeros([ROWS, QCOLS], gl.float32, mma)
        for j in range(0, n // UNROLL):
            for u in gl.static_range(UNROLL):
                t = j * UNROLL + u
                mbarrier.wait(x_bars.index(t % STAGES), (t // STAGES) & 1)
                mbarrier.wait(w_bars.index(t % STAGES), (t // STAGES) & 1)
                s0, s1, s2, s3_next = _step_scales(xs_rows, gs, us, stride_wsn, t, PAIR)
                p_a = _quarter(x_bufs, w_bufs, t, 0, d_a, STAGES, QCOLS)
                if u > 0:  # the previous step's last quarter (p_b, s3: set by step u - 1 of this unrolled body)
                    d_b = warpgroup_mma_wait(num_outstanding=1, deps=(p_b,))  # noqa: F821
                    acc3 = _scaled_add(d_b, s3, acc3)  # noqa: F821
                    _load_step(x_desc, w_desc, x_bufs, w_bufs, x_bars, w_bars, t - 1 + STAGES, x_row, plane, n_row,
                               STAGES, t - 1 + STAGES < n)
                s3 = s3_next
                p_b = _quarter(x_bufs, w_bufs, t, 1, d_b, STAGES, QCOLS)
                d_a = warpgroup_mma_wait(num_outstanding=1, deps=(p_a,))
                acc0 = _scaled_add(d_a, s0, acc0)
                p_a = _quarter(x_bufs, w_bufs, t, 2, d_a, STAGES, QCOLS)
                d_b = warpgroup_mma_wait(num_outstanding=1, deps=(p_b,))
                acc1 = _scaled_add(d_b, s1, acc1)
                p_b = _quarter(x_bufs, w_bufs, t, 3, d_b, STAGES, QCOLS)
                d_a = warpgroup_mma_wait(num_outstanding=1, deps=(p_a,))
                acc2 = _scaled_add(d_a, s2, acc2)
            d_b = warpgroup_mma_wait(num_outstanding=0, deps=(p_b,))
            acc3 = _scaled_add(d_b, s3, acc3)
            t_last = j * UNROLL + UNROLL - 1
            _load_step(x_desc, w_desc, x_bufs, w_bufs, x_bars, w_bars, t_last + STAGES, x_row, plane, n_row,
                       STAGES, t_last + STAGES < n)
        _release_barriers((x_bars, w_bars), STAGES)
        h0 = gated_act(acc0, acc2, ACT).to(INTER_DTYPE).to(gl.float32)
        h1 = gated_act(acc1, acc3, ACT).to(INTER_DTYPE).to(gl.float32)
        ok = rows < row_end
        if PAIR:  # h0: column tile A's 128 columns, h1: B's; a group each
            scale = fp8_scale(gl.max(gl.abs(h0), axis=1))
            _store_group(h0, scale, row_start, row_end, pid_n * 128, out_ptr, stride_out, 64, 128, num_warps)
            gl.store(outs_ptr + rows * stride_outs + pid_n, scale, mask=ok)
            scale = fp8_scale(gl.max(gl.abs(h1), axis=1))
            _store_group(h1, scale, row_start, row_end, pid_n * 128 + 128, out_ptr, stride_out, 64, 128, num_warps)
            gl.store(outs_ptr + rows * stride_outs + pid_n + 1, scale, mask=ok)
        else:  # h0, h1: the two halves of one group
            scale = fp8_scale(gl.maximum(gl.max(gl.abs(h0), axis=1), gl.max(gl.abs(h1), axis=1)))
            _store_group(h0, scale, row_start, row_end, pid_n * 128, out_ptr, stride_out, BLOCK_M, 64, num_warps)
            _store_group(h1, scale, row_start, row_end, pid_n * 128 + 64, out_ptr, stride_out, BLOCK_M, 64,
                         num_warps)
            gl.store(outs_ptr + rows * stride_outs + pid_n, scale, mask=ok)

    @gluon.jit(do_not_specialize=["num_blocks_m", "planes_per_expert"])
    def _gate_up_wgmma_kernel(x_desc, w_desc, xt_desc, wt_desc, xs_ptr, ws_ptr, out_ptr, outs_ptr, meta_ptr,
                              num_experts, num_blocks_m, I, H, planes_per_expert,
                              stride_xs, stride_wse, stride_wsn, stride_out, stride_outs,
                              ACT: gl.constexpr, INTER_DTYPE: gl.constexpr, E_POW2: gl.constexpr,
                              BLOCK_M: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                              UNROLL: gl.constexpr, PAIRS: gl.constexpr, num_warps: gl.constexpr):
        """One program per [BLOCK_M, 128] tile of the intermediate over the grid's row blocks (grouped order).
        x_desc: TMA descriptor over x [R, H], [BLOCK_M, 128] boxes (rows past the block's end are read,
        never stored); w_desc: over w13 as planes [2E, I, H] (_weight_planes; expert e's gate plane is
        e * planes_per_expert: 2, or 0 where every expert reads the same weights), [2, 128, 128] boxes.
        PAIRS (pair_tiles(): BLOCK_M 128, 8 warps, I / 128 even): a block of at most 64 rows (most experts' last,
        part-filled block under uniform routing, on which a 128-row tile spends as long as on a full one) runs as
        one [64, 256] pair tile over column tiles pid_n and pid_n + 1, by the even column tile's program; the odd
        one's program ends at once. xt_desc and wt_desc: the same tensors in [64, 128] and [2, 256, 128] boxes
        (unused, any descriptors, without PAIRS)."""
        pid_m, pid_n = grouped_tile(gl.program_id(0), num_blocks_m, I // 128, GROUP_M)
        expert, row_start, row_end = _expert_block(pid_m, meta_ptr, num_experts, BLOCK_M, E_POW2, num_warps)
        if row_start < row_end:
            if PAIRS:
                if row_end - row_start <= 64:
                    if pid_n % 2 == 0:
                        _tile(xt_desc, wt_desc, xs_ptr, ws_ptr, out_ptr, outs_ptr, expert, pid_n, row_start, row_end,
                              I, H, planes_per_expert, stride_xs, stride_wse, stride_wsn, stride_out, stride_outs,
                              ACT, INTER_DTYPE, BLOCK_M, STAGES, UNROLL, True, num_warps)
                else:
                    _tile(x_desc, w_desc, xs_ptr, ws_ptr, out_ptr, outs_ptr, expert, pid_n, row_start, row_end,
                          I, H, planes_per_expert, stride_xs, stride_wse, stride_wsn, stride_out, stride_outs,
                          ACT, INTER_DTYPE, BLOCK_M, STAGES, UNROLL, False, num_warps)
            else:
                _tile(x_desc, w_desc, xs_ptr, ws_ptr, out_ptr, outs_ptr, expert, pid_n, row_start, row_end,
                      I, H, planes_per_expert, stride_xs, stride_wse, stride_wsn, stride_out, stride_outs,
                      ACT, INTER_DTYPE, BLOCK_M, STAGES, UNROLL, False, num_warps)


def cannot_run(x: Tensor, x_scale: Tensor | None, w13: Tensor, w13_scale: Tensor | None, cfg) -> str | None:
    """Why this kernel cannot run an fp8-block gate_up call on Hopper (choice.py asks), or None. It needs a tile that
    wgmma_gate_up_fits with no split K, 2I a multiple of 256 and H of 128, experts back to back, TMA-addressable
    rows (x [R, H] as given: rows by index are copied in order first, which keeps them addressable), unit-stride
    scales x_scale [R, H/128] and w13_scale [E, 2I/128, H/128]."""
    _, two_i, h = w13.shape
    if x_scale is None or w13_scale is None:
        return "no activation or weight scales"
    if not wgmma_gate_up_fits(cfg) or cfg.split_k > 1:
        return f"a {cfg.block_m}x{cfg.block_n}x{cfg.block_k} tile of {cfg.num_warps} warps it does not run"
    if two_i % 256 or h % 128:
        return f"I={two_i // 2} or H={h} not a multiple of 128"
    if expert_rows(w13) is None or not tma_rows(x, x.stride(0)) or not tma_rows(w13, w13.stride(1)):
        return "operands TMA cannot address (rows not 16-byte aligned, experts not back to back, or TMA off)"
    if x_scale.stride(1) != 1 or w13_scale.stride(2) != 1:
        return "scales not contiguous along K"
    return None


def launch(x: Tensor, x_scale: Tensor, w13: Tensor, w13_scale: Tensor, layout, activation: int, dtype: torch.dtype,
           cfg, inter: Tensor, scale: Tensor, most_unroll: int = 8) -> None:
    """Write inter [R, I] fp8e4m3 and scale [R, I/128] fp32 (module docstring) from x [R, H] fp8e4m3, x_scale
    [R, H/128] fp32, w13 [E, 2I, H] fp8e4m3, w13_scale [E, 2I/128, H/128] fp32, x's rows in order (sorted layout;
    rows by index are first copied in order: TMA reads rows in order, and a cp.async gather inside this kernel is
    slower); only where cannot_run() says None.
    activation: common.ACT_CODES' code; dtype: the layer dtype act(gate) * up is rounded to. most_unroll: the most K
    steps a loop body runs (down_wgmma.unroll). No host synchronization (CUDA-graph safe); nothing for R = 0."""
    r, h = x.shape
    e, two_i, _ = w13.shape
    i = two_i // 2
    if r == 0:
        return
    bm = cfg.block_m
    x_desc = TensorDescriptor(x, [r, h], [x.stride(0), 1], [bm, 128],
                              smem_layout((bm, 128), "float8e4nv"))
    per_expert = 2 if expert_rows(w13) else 0  # w13 as [planes, I, H]: expert e's gate rows in plane 2e, up in 2e + 1
    planes = e * per_expert or 2
    w_desc = _weight_planes(w13, planes, i, h, 128)
    pairs = pair_tiles(cfg, i)
    xt_desc, wt_desc = x_desc, w_desc
    if pairs:
        xt_desc = TensorDescriptor(x, [r, h], [x.stride(0), 1], [64, 128],
                                   smem_layout((64, 128), "float8e4nv"))
        wt_desc = _weight_planes(w13, planes, i, h, 256)
    blocks_m = layout.num_row_blocks(bm)
    _gate_up_wgmma_kernel[(blocks_m * (i // 128),)](
        x_desc, w_desc, xt_desc, wt_desc, x_scale, w13_scale, inter, scale, layout.meta, layout.num_experts, blocks_m,
        i, h, per_expert, x_scale.stride(0), w13_scale.stride(0), w13_scale.stride(1), inter.stride(0),
        scale.stride(0), ACT=activation, INTER_DTYPE=_INTER[dtype], E_POW2=layout.e_pow2, BLOCK_M=bm,
        GROUP_M=cfg.group_m, STAGES=cfg.num_stages, UNROLL=unroll(h // 128, most_unroll, cfg.num_stages),
        PAIRS=pairs, num_warps=cfg.num_warps)


def _weight_planes(w13: Tensor, planes: int, i: int, h: int, rows: int):
    """A TMA descriptor over w13 [E, 2I, H] read as [planes, I, H] (gate and up halves of each expert as planes, or
    one expert's two planes where the expert stride is 0), in [2, rows, 128] boxes: a step's gate and up tiles of
    ``rows`` weight rows in one copy."""
    return TensorDescriptor(w13, [planes, i, h], [i * w13.stride(1), w13.stride(1), 1], [2, rows, 128],
                            smem_layout((2, rows, 128), "float8e4nv"))


def pair_tiles(cfg, intermediate: int) -> bool:
    """Whether launch() runs blocks of at most 64 rows as pair tiles (_gate_up_wgmma_kernel): 128-row tiles of 8
    warps and at most 3 stages (a pair tile's stage takes 72 KB of shared memory; the two tile forms' shared memory
    overlaps), an even number of 128-column tiles, MOEFLOW_TRITON_PAIR_TILES on."""
    return (cfg.block_m == 128 and cfg.num_warps == 8 and cfg.num_stages <= 3 and (intermediate // 128) % 2 == 0
            and moeflow_env.TRITON_PAIR_TILES.get_bool())
