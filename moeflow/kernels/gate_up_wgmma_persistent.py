"""The fp8-block Gluon gate_up GEMM (kernels/gate_up_wgmma.py) as a persistent grid: each program loops over
[BLOCK_M, 128] tiles of the intermediate, its shared-memory slots running on from one tile into the next.

    x [R, H] float8_e4m3fn + x_scale [R, H/128] float32 (sorted layout, rows in order), w13 gate_up_proj
    [E, 2I, H] float8_e4m3fn + w13_scale [E, 2I/128, H/128] float32
    -> inter [R, I] float8_e4m3fn + scale [R, I/128] float32; the same bits as gate_up_wgmma.py's kernel
    and gate_up.py's (reference: gate_up.gate_up_torch).
Why: as kernels/down_wgmma_persistent.py: a program per tile waits for its first tiles and then runs the
epilogue (activation, amax, quantization, stores) with nothing loading. Qwen3's H = 2048 is 16 steps.
How: down_wgmma_persistent.py's scheme (steps numbered across a program's tiles, loads STAGES steps ahead
reaching into the next tile, whose coordinates are computed at the start of each tile) around
gate_up_wgmma.py's K loop (four 64-column quarters a step into two half-width products by turns).
Needs STAGES <= the K steps; launch() runs the per-tile kernel otherwise.
Where: GemmConfig.programs_per_sm > 0 on a gate_up config the per-tile kernel runs (usable() there).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .common import fp8_scale, gated_act, num_sms, to_fp8
from .down_wgmma import gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma_wait

    from .down_wgmma import _scaled_add
    from .down_wgmma_persistent import _load, _load_ahead, _real_blocks, _tile
    from .gate_up_wgmma import _INTER, _quarter

    @gluon.jit(do_not_specialize=["num_programs", "w_rows_per_expert"])
    def _gate_up_wgmma_persistent_kernel(x_desc, w_desc, xs_ptr, ws_ptr, out_ptr, outs_ptr, meta_ptr,
                                         num_experts, num_programs, I, H, w_rows_per_expert,
                                         stride_xs, stride_wse, stride_wsn, stride_out, stride_outs,
                                         ACT: gl.constexpr, INTER_DTYPE: gl.constexpr, E_POW2: gl.constexpr,
                                         BLOCK_M: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                                         UNROLL: gl.constexpr, num_warps: gl.constexpr):
        """num_programs programs (the grid) over the real tiles (module docstring). Descriptors as
        gate_up_wgmma._gate_up_wgmma_kernel's."""
        pid = gl.program_id(0)
        blocks_m = _real_blocks(meta_ptr, num_experts, BLOCK_M, E_POW2, num_warps)
        num_pid_n = I // 128
        tiles = blocks_m * num_pid_n
        my_tiles = gl.where(pid < tiles, (tiles - pid + num_programs - 1) // num_programs, 0)
        n = H // 128
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, 64, 32])
        rows_l: gl.constexpr = gl.SliceLayout(1, mma)
        st: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
        x_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, 128], x_desc.layout)
        w_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2 * STAGES, 128, 128], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        fence_async_shared()
        expert, row_start, row_end, pid_n, g_row = _tile(0, pid, num_programs, blocks_m, num_pid_n, meta_ptr,
                                                         num_experts, w_rows_per_expert, BLOCK_M, 128, GROUP_M,
                                                         E_POW2, num_warps)
        for s in gl.static_range(STAGES):  # STAGES <= n: all in the first tile
            _load(x_desc, w_desc, x_bufs, w_bufs, bars, s, s, row_start.to(gl.int32), g_row, I, STAGES, 128, True,
                  my_tiles > 0)
        d_a = gl.zeros([BLOCK_M, 64], gl.float32, mma)
        d_b = gl.zeros([BLOCK_M, 64], gl.float32, mma)
        for j in range(my_tiles):
            expert_n, row_start_n, row_end_n, pid_n_n, g_row_n = _tile(
                j + 1, pid, num_programs, blocks_m, num_pid_n, meta_ptr, num_experts, w_rows_per_expert, BLOCK_M,
                128, GROUP_M, E_POW2, num_warps)
            has_next = j + 1 < my_tiles
            x_row = row_start.to(gl.int32)
            x_row_n = row_start_n.to(gl.int32)
            base = j * n
            rows = row_start + gl.arange(0, BLOCK_M, layout=rows_l)
            rows_ld = gl.minimum(rows, row_end - 1)
            xs_rows = xs_ptr + rows_ld * stride_xs
            gs = ws_ptr + expert.to(gl.int64) * stride_wse + pid_n * stride_wsn  # the tile's gate block row
            us = gs + (I // 128) * stride_wsn
            acc0 = gl.zeros([BLOCK_M, 64], gl.float32, mma)  # gate 0-63
            acc1 = gl.zeros([BLOCK_M, 64], gl.float32, mma)  # gate 64-127
            acc2 = gl.zeros([BLOCK_M, 64], gl.float32, mma)  # up 0-63
            acc3 = gl.zeros([BLOCK_M, 64], gl.float32, mma)  # up 64-127
            for b in range(0, n // UNROLL):
                for u in gl.static_range(UNROLL):
                    t = b * UNROLL + u
                    g = base + t
                    mbarrier.wait(bars.index(g % STAGES), (g // STAGES) & 1)
                    s_x = gl.load(xs_rows + t)
                    s_g = s_x * gl.load(gs + t)
                    s_u_next = s_x * gl.load(us + t)
                    p_a = _quarter(x_bufs, w_bufs, g, 0, d_a, STAGES)
                    if u > 0:  # the previous step's last quarter (p_b, s_u: set by step u - 1 of this unrolled body)
                        d_b = warpgroup_mma_wait(num_outstanding=1, deps=(p_b,))  # noqa: F821
                        acc3 = _scaled_add(d_b, s_u, acc3)  # noqa: F821
                        _load_ahead(x_desc, w_desc, x_bufs, w_bufs, bars, base, t - 1 + STAGES, n, x_row, g_row,
                                    x_row_n, g_row_n, has_next, I, STAGES, 128, True)
                    s_u = s_u_next
                    p_b = _quarter(x_bufs, w_bufs, g, 1, d_b, STAGES)
                    d_a = warpgroup_mma_wait(num_outstanding=1, deps=(p_a,))
                    acc0 = _scaled_add(d_a, s_g, acc0)
                    p_a = _quarter(x_bufs, w_bufs, g, 2, d_a, STAGES)
                    d_b = warpgroup_mma_wait(num_outstanding=1, deps=(p_b,))
                    acc1 = _scaled_add(d_b, s_g, acc1)
                    p_b = _quarter(x_bufs, w_bufs, g, 3, d_b, STAGES)
                    d_a = warpgroup_mma_wait(num_outstanding=1, deps=(p_a,))
                    acc2 = _scaled_add(d_a, s_u, acc2)
                d_b = warpgroup_mma_wait(num_outstanding=0, deps=(p_b,))
                acc3 = _scaled_add(d_b, s_u, acc3)
                _load_ahead(x_desc, w_desc, x_bufs, w_bufs, bars, base, b * UNROLL + UNROLL - 1 + STAGES, n, x_row,
                            g_row, x_row_n, g_row_n, has_next, I, STAGES, 128, True)
            h0 = gated_act(acc0, acc2, ACT).to(INTER_DTYPE).to(gl.float32)
            h1 = gated_act(acc1, acc3, ACT).to(INTER_DTYPE).to(gl.float32)
            scale = fp8_scale(gl.maximum(gl.max(gl.abs(h0), axis=1), gl.max(gl.abs(h1), axis=1)))
            q0 = gl.convert_layout(to_fp8(h0, scale[:, None], False), st)
            q1 = gl.convert_layout(to_fp8(h1, scale[:, None], False), st)
            rows_st = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st))
            cols = pid_n * 128 + gl.arange(0, 64, layout=gl.SliceLayout(0, st))
            ptrs = out_ptr + rows_st[:, None] * stride_out + cols[None, :]
            ok = (rows_st < row_end)[:, None]
            gl.store(ptrs, q0, mask=ok)
            gl.store(ptrs + 64, q1, mask=ok)
            gl.store(outs_ptr + rows * stride_outs + pid_n, scale, mask=rows < row_end)
            expert, row_start, row_end, pid_n, g_row = expert_n, row_start_n, row_end_n, pid_n_n, g_row_n
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))


def launch(x: Tensor, x_desc, w_desc, x_scale: Tensor, w13_scale: Tensor, layout, activation: int, dtype: torch.dtype,
           cfg, inter: Tensor, scale: Tensor, per_expert: int, unroll: int) -> None:
    """Run the persistent kernel (gate_up_wgmma.launch calls it with its descriptors where
    cfg.programs_per_sm > 0 and STAGES <= the K steps)."""
    h, i = x.shape[1], inter.shape[1]
    programs = min(cfg.programs_per_sm * num_sms(x.device), layout.num_row_blocks(cfg.block_m) * (i // 128))
    _gate_up_wgmma_persistent_kernel[(programs,)](
        x_desc, w_desc, x_scale, w13_scale, inter, scale, layout.meta, layout.num_experts, programs, i, h, per_expert,
        x_scale.stride(0), w13_scale.stride(0), w13_scale.stride(1), inter.stride(0), scale.stride(0),
        ACT=activation, INTER_DTYPE=_INTER[dtype], E_POW2=layout.e_pow2, BLOCK_M=cfg.block_m, GROUP_M=cfg.group_m,
        STAGES=cfg.num_stages, UNROLL=unroll, num_warps=cfg.num_warps)
