"""fp8-block gate_up GEMM for Hopper in Gluon, the K loop's scaling overlapped with the tensor cores.

    x [R, H] float8_e4m3fn + x_scale [R, H/128] float32 (sorted layout, rows in order), w13 gate_up_proj
    [E, 2I, H] float8_e4m3fn + w13_scale [E, 2I/128, H/128] float32
    -> inter [R, I] float8_e4m3fn + scale [R, I/128] float32: act(gate) * up rounded to the layer dtype,
    then quantized in 1x128 groups, as kernels/gate_up.py's fp8-block epilogue (reference:
    gate_up.gate_up_torch); the same bits as gate_up.py's kernel.
Why: as kernels/down_wgmma.py. Each 128-deep K step's gate and up products are scaled before they are
added (acc += (x_k @ w_k) * s_k); Triton waits for every wgmma before scaling its product, so the tensor
cores idle meanwhile.
How: a [BLOCK_M, 128] tile of the intermediate needs two accumulators (gate, up). Two products by turns,
as down_wgmma.py does, would hold four [BLOCK_M, 128] float32 tiles: 256 registers a thread at 128 rows
and 8 warps. So each K step runs four wgmmas of 64 columns (gate 0-63, gate 64-127, up 0-63, up 64-127)
into two half-width products by turns: each is scaled into its quarter of the accumulators while the
next runs. Four accumulator quarters and two products: 192 registers a thread. A loop body runs UNROLL
steps and ends with nothing in flight (down_wgmma.py says why). Operands come through TMA into STAGES
shared-memory slots; step t + STAGES is loaded into step t's slot once step t's last wgmma is done.
Epilogue: the two halves' activations, one amax per row over all 128 columns (the group), quantized,
stored in 16-byte rows.
Where: GemmConfig.scale_overlap on a gate_up config (fit() keeps it where wgmma_gate_up_fits), sorted
batches, CUDA compute capability 9.x, operands TMA-addressable, H and I multiples of 128; kernels/gate_up.py
falls back to its own kernel otherwise. TMA reads rows in order: for rows by index (source_rows, the local
dispatcher's plan) gate_up() first copies the R rows and their scales in order into a contiguous buffer (one
launch, gate_up._rows_in_order: scattered from each token once where the batch has copy_rows). A gather
inside this kernel by cp.async measured slower (commit 85b447b).
Measured on H200 (benchmarks/results/gluon_gate_up_2026-11-30_h200_256cb47.md): 1.09-1.18x the Triton
kernel alone on Mixtral's and DeepSeek-V3's shapes, 1.14-1.15x on Qwen3's; in the layer, with the copy,
1.03-1.19x (Mixtral), 1.03-1.07x (DeepSeek-V3 T=4096), about 1.0x (Qwen3, whose table keeps Triton).
Imported only when a config asks for it on a CUDA device (gate_up.py): CPU runs never load Gluon.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import env as moeflow_env
from .common import _cuda_properties, expert_rows, fp8_scale, gated_act, grouped_tile, tma_rows, to_fp8
from .configs import wgmma_gate_up_fits
from .down_wgmma import gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .down_wgmma import _expert_block, _scaled_add, unroll

    _INTER = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}

    @gluon.jit
    def _load_step(x_desc, w_desc, x_bufs, w_bufs, bars, t, x_row, g_row, I, STAGES: gl.constexpr, pred):
        """Start TMA loads of step t's x tile and gate and up weight tiles into slot t % STAGES."""
        slot = t % STAGES
        bar = bars.index(slot)
        mbarrier.expect(bar, x_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes, pred=pred)
        k = t * 128
        tma.async_copy_global_to_shared(x_desc, [x_row, k], bar, x_bufs.index(slot), pred=pred)
        tma.async_copy_global_to_shared(w_desc, [g_row, k], bar, w_bufs.index(2 * slot), pred=pred)
        tma.async_copy_global_to_shared(w_desc, [g_row + I, k], bar, w_bufs.index(2 * slot + 1), pred=pred)

    @gluon.jit
    def _quarter(x_bufs, w_bufs, t, q: gl.constexpr, d, STAGES: gl.constexpr):
        """Start step t's wgmma of quarter q (0 gate 0-63, 1 gate 64-127, 2 up 0-63, 3 up 64-127) into d's
        registers (d's values unused); the caller has waited for the step's tiles."""
        slot = t % STAGES
        w = w_bufs.index(2 * slot + q // 2).slice((q % 2) * 64, 64, dim=0)
        return warpgroup_mma(x_bufs.index(slot), w.permute((1, 0)), d, use_acc=False, is_async=True)

    @gluon.jit(do_not_specialize=["num_blocks_m", "w_rows_per_expert"])
    def _gate_up_wgmma_kernel(x_desc, w_desc, xs_ptr, ws_ptr, out_ptr, outs_ptr, meta_ptr,
                              num_experts, num_blocks_m, I, H, w_rows_per_expert,
                              stride_xs, stride_wse, stride_wsn, stride_out, stride_outs,
                              ACT: gl.constexpr, INTER_DTYPE: gl.constexpr, E_POW2: gl.constexpr,
                              BLOCK_M: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                              UNROLL: gl.constexpr, num_warps: gl.constexpr):
        """One program per [BLOCK_M, 128] tile of the intermediate over the grid's row blocks.
        x_desc: TMA descriptor over x [R, H], [BLOCK_M, 128] boxes (rows past the block's end are read,
        never stored); w_desc: over the weight rows [E * 2I, H] (expert e's from e * w_rows_per_expert),
        [128, 128] boxes."""
        pid_m, pid_n = grouped_tile(gl.program_id(0), num_blocks_m, I // 128, GROUP_M)
        expert, row_start, row_end = _expert_block(pid_m, meta_ptr, num_experts, BLOCK_M, E_POW2, num_warps)
        if row_start < row_end:
            mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                          instr_shape=[16, 64, 32])
            rows_l: gl.constexpr = gl.SliceLayout(1, mma)
            x_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, 128], x_desc.layout)
            w_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2 * STAGES, 128, 128], w_desc.layout)
            bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for s in gl.static_range(STAGES):
                mbarrier.init(bars.index(s), count=1)
            fence_async_shared()
            x_row = row_start.to(gl.int32)
            g_row = (expert * w_rows_per_expert + pid_n * 128).to(gl.int32)
            n = H // 128
            for s in gl.static_range(STAGES):
                _load_step(x_desc, w_desc, x_bufs, w_bufs, bars, s, x_row, g_row, I, STAGES, s < n)
            rows = row_start + gl.arange(0, BLOCK_M, layout=rows_l)
            rows_ld = gl.minimum(rows, row_end - 1)
            xs_rows = xs_ptr + rows_ld * stride_xs  # row r's scale of K group t at xs_rows[r] + t
            gs = ws_ptr + expert.to(gl.int64) * stride_wse + pid_n * stride_wsn  # the tile's gate block row
            us = gs + (I // 128) * stride_wsn
            acc0 = gl.zeros([BLOCK_M, 64], gl.float32, mma)  # gate 0-63
            acc1 = gl.zeros([BLOCK_M, 64], gl.float32, mma)  # gate 64-127
            acc2 = gl.zeros([BLOCK_M, 64], gl.float32, mma)  # up 0-63
            acc3 = gl.zeros([BLOCK_M, 64], gl.float32, mma)  # up 64-127
            d_a = gl.zeros([BLOCK_M, 64], gl.float32, mma)
            d_b = gl.zeros([BLOCK_M, 64], gl.float32, mma)
            for j in range(0, n // UNROLL):
                for u in gl.static_range(UNROLL):
                    t = j * UNROLL + u
                    slot = t % STAGES
                    mbarrier.wait(bars.index(slot), (t // STAGES) & 1)
                    s_x = gl.load(xs_rows + t)
                    s_g = s_x * gl.load(gs + t)
                    s_u_next = s_x * gl.load(us + t)
                    p_a = _quarter(x_bufs, w_bufs, t, 0, d_a, STAGES)
                    if u > 0:  # the previous step's last quarter (p_b, s_u: set by step u - 1 of this unrolled body)
                        d_b = warpgroup_mma_wait(num_outstanding=1, deps=(p_b,))  # noqa: F821
                        acc3 = _scaled_add(d_b, s_u, acc3)  # noqa: F821
                        _load_step(x_desc, w_desc, x_bufs, w_bufs, bars, t - 1 + STAGES, x_row, g_row, I, STAGES,
                                   t - 1 + STAGES < n)
                    s_u = s_u_next
                    p_b = _quarter(x_bufs, w_bufs, t, 1, d_b, STAGES)
                    d_a = warpgroup_mma_wait(num_outstanding=1, deps=(p_a,))
                    acc0 = _scaled_add(d_a, s_g, acc0)
                    p_a = _quarter(x_bufs, w_bufs, t, 2, d_a, STAGES)
                    d_b = warpgroup_mma_wait(num_outstanding=1, deps=(p_b,))
                    acc1 = _scaled_add(d_b, s_g, acc1)
                    p_b = _quarter(x_bufs, w_bufs, t, 3, d_b, STAGES)
                    d_a = warpgroup_mma_wait(num_outstanding=1, deps=(p_a,))
                    acc2 = _scaled_add(d_a, s_u, acc2)
                d_b = warpgroup_mma_wait(num_outstanding=0, deps=(p_b,))
                acc3 = _scaled_add(d_b, s_u, acc3)
                t_last = j * UNROLL + UNROLL - 1
                _load_step(x_desc, w_desc, x_bufs, w_bufs, bars, t_last + STAGES, x_row, g_row, I, STAGES,
                           t_last + STAGES < n)
            for s in gl.static_range(STAGES):
                mbarrier.invalidate(bars.index(s))
            h0 = gated_act(acc0, acc2, ACT).to(INTER_DTYPE).to(gl.float32)
            h1 = gated_act(acc1, acc3, ACT).to(INTER_DTYPE).to(gl.float32)
            scale = fp8_scale(gl.maximum(gl.max(gl.abs(h0), axis=1), gl.max(gl.abs(h1), axis=1)))
            st: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
            q0 = gl.convert_layout(to_fp8(h0, scale[:, None], False), st)
            q1 = gl.convert_layout(to_fp8(h1, scale[:, None], False), st)
            rows_st = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st))
            cols = pid_n * 128 + gl.arange(0, 64, layout=gl.SliceLayout(0, st))
            ptrs = out_ptr + rows_st[:, None] * stride_out + cols[None, :]
            ok = (rows_st < row_end)[:, None]
            gl.store(ptrs, q0, mask=ok)
            gl.store(ptrs + 64, q1, mask=ok)
            gl.store(outs_ptr + rows * stride_outs + pid_n, scale, mask=rows < row_end)


def usable(x: Tensor, x_scale: Tensor | None, w13: Tensor, w13_scale: Tensor | None, layout, scheme: str, cfg) -> bool:
    """Whether gate_up() may run this kernel for the call (module docstring, Where). x: the rows as given
    (rows by index: gate_up() first copies them in order, contiguous: TMA-addressable if these rows are)."""
    if (gluon is None or scheme != "fp8-block" or layout.masked or not x.is_cuda
            or x_scale is None or w13_scale is None or not wgmma_gate_up_fits(cfg) or cfg.split_k > 1
            or moeflow_env.TRITON_INTERPRET.get_bool() or _cuda_properties(x.device).major != 9):
        return False
    _, two_i, h = w13.shape
    return (two_i % 256 == 0 and h % 128 == 0 and expert_rows(w13) is not None and tma_rows(x, x.stride(0))
            and tma_rows(w13, w13.stride(1)) and x_scale.stride(1) == 1 and w13_scale.stride(2) == 1)


def launch(x: Tensor, x_scale: Tensor, w13: Tensor, w13_scale: Tensor, layout, activation: int, dtype: torch.dtype,
           cfg, inter: Tensor, scale: Tensor, most_unroll: int = 8) -> None:
    """Write inter [R, I] float8_e4m3fn and scale [R, I/128] (module docstring); usable() must have said True.
    activation: common.ACT_CODES' code. most_unroll: the most K steps a loop body runs (down_wgmma.unroll)."""
    r, h = x.shape
    e, two_i, _ = w13.shape
    i = two_i // 2
    if r == 0:
        return
    bm = cfg.block_m
    x_desc = TensorDescriptor(x, [r, h], [x.stride(0), 1], [bm, 128],
                              gl.NVMMASharedLayout.get_default_for([bm, 128], gl.float8e4nv))
    per_expert = expert_rows(w13)
    w_desc = TensorDescriptor(w13, [e * two_i if per_expert else two_i, h], [w13.stride(1), 1], [128, 128],
                              gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv))
    blocks_m = layout.num_row_blocks(bm)
    _gate_up_wgmma_kernel[(blocks_m * (i // 128),)](
        x_desc, w_desc, x_scale, w13_scale, inter, scale, layout.meta, layout.num_experts, blocks_m, i, h, per_expert,
        x_scale.stride(0), w13_scale.stride(0), w13_scale.stride(1), inter.stride(0), scale.stride(0),
        ACT=activation, INTER_DTYPE=_INTER[dtype], E_POW2=layout.e_pow2, BLOCK_M=bm, GROUP_M=cfg.group_m,
        STAGES=cfg.num_stages, UNROLL=unroll(h // 128, most_unroll, cfg.num_stages), num_warps=cfg.num_warps)
