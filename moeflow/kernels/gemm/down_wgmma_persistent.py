"""down_wgmma.py's kernel as a persistent grid: each program loops over output tiles, and its shared-memory slots
run on from one tile into the next (the same bits; reference: down.down_torch).

Why: short K loops (Qwen3's I = 768 is 6 steps of 128): a program per tile waits for its first tiles and then runs
its epilogue with nothing loading. Program p takes tiles p, p + P, ... in grouped order; steps are numbered across
its tiles (slot g % STAGES, phase (g / STAGES) & 1), so loads issued STAGES steps ahead reach into the next tile
while this one's epilogue runs. Needs STAGES <= the K steps (choice.py runs the per-tile kernel otherwise).
"""
from __future__ import annotations

from torch import Tensor

from ..common import cdiv, grouped_tile, num_sms
from .down_wgmma import descriptors, gluon, unroll

if gluon is not None:
    from triton.experimental.gluon import language as gl

    from .down_wgmma import (_block_counts, _expert_block, _k_loop, _load_step, _release_barriers, _ring, _store_tile,
                              _weight_scales)

    @gluon.jit
    def _tile(j, pid, num_programs, blocks_m, num_pid_n, meta_ptr, num_experts, w_rows_per_expert,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, E_POW2: gl.constexpr,
              num_warps: gl.constexpr):
        """The program's j-th tile -> (expert, row_start, row_end, pid_n, weight row). Past the last tile it
        repeats the last one (its loads are predicated off)."""
        tile = gl.minimum(pid + j * num_programs, gl.maximum(blocks_m * num_pid_n - 1, 0))
        pid_m, pid_n = grouped_tile(tile, gl.maximum(blocks_m, 1), num_pid_n, GROUP_M)
        expert, row_start, row_end = _expert_block(pid_m, meta_ptr, num_experts, BLOCK_M, E_POW2, num_warps)
        return expert, row_start, row_end, pid_n, (expert * w_rows_per_expert + pid_n * BLOCK_N).to(gl.int32)

    @gluon.jit(do_not_specialize=["num_programs", "w_rows_per_expert"])
    def _down_wgmma_persistent_kernel(a_desc, w_desc, as_ptr, ws_ptr, rw_ptr, out_ptr, meta_ptr,
                                      num_experts, num_programs, H, I, w_rows_per_expert,
                                      stride_as, stride_wse, stride_wsn, stride_out,
                                      E_POW2: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                      BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                                      UNROLL: gl.constexpr, num_warps: gl.constexpr,
                                      COALESCED_STORE: gl.constexpr = False):
        """num_programs programs (the grid) over the real tiles (module docstring). Descriptors as
        down_wgmma._down_wgmma_kernel's."""
        pid = gl.program_id(0)
        blocks_m = gl.sum(_block_counts(meta_ptr, num_experts, BLOCK_M, E_POW2, num_warps)[3], 0).to(gl.int32)
        num_pid_n = gl.cdiv(H, BLOCK_N)
        tiles = blocks_m * num_pid_n
        my_tiles = gl.where(pid < tiles, (tiles - pid + num_programs - 1) // num_programs, 0)
        n = gl.cdiv(I, BLOCK_K)
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BLOCK_N, 32])
        rows_l: gl.constexpr = gl.SliceLayout(1, mma)
        a_bufs, w_bufs, bars = _ring(a_desc, w_desc, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
        expert, row_start, row_end, pid_n, w_row = _tile(0, pid, num_programs, blocks_m, num_pid_n, meta_ptr,
                                                         num_experts, w_rows_per_expert, BLOCK_M, BLOCK_N, GROUP_M,
                                                         E_POW2, num_warps)
        for s in gl.static_range(STAGES):  # STAGES <= n: all in the first tile
            _load_step(a_desc, w_desc, a_bufs, w_bufs, bars, s, s, row_start.to(gl.int32), w_row, STAGES, BLOCK_K,
                       my_tiles > 0)
        d_a = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
        d_b = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
        for j in range(my_tiles):
            expert_n, row_start_n, row_end_n, pid_n_n, w_row_n = _tile(
                j + 1, pid, num_programs, blocks_m, num_pid_n, meta_ptr, num_experts, w_rows_per_expert, BLOCK_M,
                BLOCK_N, GROUP_M, E_POW2, num_warps)
            rows_ld = gl.minimum(row_start + gl.arange(0, BLOCK_M, layout=rows_l), row_end - 1)
            ws_tile = _weight_scales(ws_ptr, expert, pid_n, H, stride_wse, stride_wsn, BLOCK_N)
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
            acc, d_a, d_b = _k_loop(a_desc, w_desc, a_bufs, w_bufs, bars, as_ptr + rows_ld * stride_as, ws_tile, acc,
                                    d_a, d_b, j * n, n, row_start.to(gl.int32), w_row, row_start_n.to(gl.int32),
                                    w_row_n, j + 1 < my_tiles, BLOCK_K, STAGES, UNROLL)
            _store_tile(acc, rw_ptr, out_ptr, rows_ld, row_start, row_end, pid_n, H, stride_out, mma, BLOCK_M, BLOCK_N,
                        num_warps, COALESCED_STORE)
            expert, row_start, row_end, pid_n, w_row = expert_n, row_start_n, row_end_n, pid_n_n, w_row_n
        _release_barriers(bars, STAGES)


def launch(a: Tensor, a_scale: Tensor, w2: Tensor, w2_scale: Tensor, route_w: Tensor, layout, cfg,
           out: Tensor) -> None:
    """down_wgmma.launch's computation as a persistent grid of programs_per_sm programs an SM (choice.py picks it
    where cfg.programs_per_sm > 0 and STAGES <= the K steps)."""
    r, i = a.shape
    h = w2.shape[1]
    if r == 0 or h == 0:
        return
    a_desc, w_desc, per_expert = descriptors(a, w2, cfg)
    tiles = layout.num_row_blocks(cfg.block_m) * cdiv(h, cfg.block_n)  # an upper bound: no device read
    programs = min(cfg.programs_per_sm * num_sms(a.device), tiles)
    _down_wgmma_persistent_kernel[(programs,)](
        a_desc, w_desc, a_scale, w2_scale, route_w, out, layout.meta, layout.num_experts, programs, h, i, per_expert,
        a_scale.stride(0), w2_scale.stride(0), w2_scale.stride(1), out.stride(0),
        E_POW2=layout.e_pow2, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        STAGES=cfg.num_stages, UNROLL=unroll(cdiv(i, cfg.block_k)), num_warps=cfg.num_warps,
        COALESCED_STORE=cfg.scale_overlap == 2)
