"""Grouped GEMMs for Hopper in Gluon: persistent, warp-specialized, two consumer warpgroups by turns.

down:    a [R, I] (sorted layout, rows in order), w2 [E, H, I], route_w [R] fp32 -> out [R, H] = route_w * a @ w2[e].T,
         as gemm/down.py (torch reference: down.down_torch); fp8-block: the same bits as down.py's kernel.
gate_up: x [R, H], w13 [E, 2I, H] -> inter [R, I] = act(x @ gate.T) * (x @ up.T), as gemm/gate_up.py (torch reference:
         gate_up.gate_up_torch); fp8-block: fp8e4m3 inter + 1x128 group scales, the same bits as gate_up.py's kernel.
Kernels: _block_table_kernel (launcher block_table, reference block_table_torch), _ws_gemm_kernel (partitions, barriers,
tile forms, registers: its docstring). Launcher: launch(), where gemm/choice.py picks it (cannot_run() says None).
Why: short K loops (I = 768: 12 steps of 64), where one tile at a time idles on its first loads and its epilogue.
Imported only when a config asks for it on a CUDA device: CPU runs never load Gluon.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..common import (RowLayout, cdiv, expert_blocks, expert_rows, fp8_scale, gated_act,
                     grouped_tile, num_sms, pdl, pdl_start, sorted_block, tma_rows)
from .tiles import ws_fits

try:  # Gluon ships with recent triton (3.6 here); only Hopper GPUs run this kernel
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .down_wgmma import _mma_step, _scaled_add, _weight_scales, smem_layout, unroll
    from .gate_up_wgmma import _INTER, _store_group
except ImportError:  # pragma: no cover - older triton: choice.py never picks these kernels
    gluon = None

MAXNREG = 168  # registers a thread at launch: 12 warps x 168 x 32 fit the SM's 64K
CONSUMER_REGS, LOADER_REGS = 232, 24  # the default partition (consumer 0) gets 3 * MAXNREG - these = 248


@triton.jit
def _block_table_kernel(meta_ptr, blk_ptr, nblk_ptr, num_experts, num_blocks,
                        BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, PDL: tl.constexpr = False):
    """Sorted layout, offsets meta [E + 1] int64 -> blk [3, num_blocks] int32: program b writes row block b's
    expert, first row and end row, by the alignment every Triton GEMM computes for itself (common.expert_blocks,
    common.sorted_block); blocks past the real ones: an empty range at the last expert's end. Program 0 also
    writes nblk [1] int32: the real row blocks."""
    pdl_start(PDL)
    b = tl.program_id(0)
    idx, lo, hi, nb, cum = expert_blocks(meta_ptr, num_experts, BLOCK_M, E_POW2)
    expert, row_start, row_end = sorted_block(b, num_experts, idx, lo, hi, nb, cum, BLOCK_M)
    real = expert < num_experts
    last_end = tl.load(meta_ptr + num_experts)
    ok = b < num_blocks  # the grid has one program when there are no blocks, for nblk
    tl.store(blk_ptr + b, tl.where(real, expert, num_experts - 1).to(tl.int32), mask=ok)
    tl.store(blk_ptr + num_blocks + b, tl.where(real, row_start, last_end).to(tl.int32), mask=ok)
    tl.store(blk_ptr + 2 * num_blocks + b, tl.where(real, row_end, last_end).to(tl.int32), mask=ok)
    if b == 0:
        tl.store(nblk_ptr, tl.sum(nb, 0).to(tl.int32))


def block_table(layout: RowLayout, block_m: int) -> tuple[Tensor, Tensor]:
    """-> (blk [3, B] int32, nblk [1] int32) of a sorted layout's row blocks (_block_table_kernel), B the host
    bound layout.num_row_blocks(block_m); one launch, no host synchronization."""
    b = layout.num_row_blocks(block_m)
    dev = layout.meta.device
    blk = torch.empty((3, b), dtype=torch.int32, device=dev)
    nblk = torch.empty(1, dtype=torch.int32, device=dev)
    _block_table_kernel[(max(1, b),)](layout.meta, blk, nblk, layout.num_experts, b, BLOCK_M=block_m,
                                      E_POW2=layout.e_pow2, **pdl(dev))
    return blk, nblk


def block_table_torch(layout: RowLayout, block_m: int) -> tuple[Tensor, Tensor]:
    """Reference of block_table, in torch."""
    off = layout.meta.to(torch.int64)
    nb = (off[1:] - off[:-1] + block_m - 1) // block_m
    cum = torch.cumsum(nb, 0)
    b = torch.arange(layout.num_row_blocks(block_m), device=off.device)
    e = torch.searchsorted(cum, b, right=True)
    real = e < layout.num_experts
    ec = e.clamp(max=layout.num_experts - 1)
    start = torch.where(real, off[ec] + (b - (cum[ec] - nb[ec])) * block_m, off[-1])
    end = torch.where(real, off[ec + 1], off[-1])
    return torch.stack([ec, start, end]).to(torch.int32), cum[-1:].to(torch.int32)


if gluon is not None:
    @gluon.constexpr_function
    def coop(gated, scaled, block_m, block_n):
        """Whether the two consumers share each tile (COOP, _ws_gemm_kernel), 64 rows each: 128-row tiles too large
        for one consumer's registers. Those of 256 accumulator columns at BLOCK_M 128: the gate_up at 128 x 128 (gate
        and up) and the down at 128 x 256, unscaled (bf16, fp16) or fp8-block (in quarters)."""
        return int(block_m) == 128 and int(block_n) * (2 if gated else 1) == 256

    @gluon.jit
    def _tiles(nblk_ptr, num_programs, N, BLOCK_N: gl.constexpr):
        """-> (real row blocks, column tiles, tiles of this program)."""
        pid = gl.program_id(0)
        blocks_m = gl.load(nblk_ptr)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        tiles = blocks_m * num_pid_n
        return blocks_m, num_pid_n, gl.where(pid < tiles, (tiles - pid + num_programs - 1) // num_programs, 0)

    @gluon.jit
    def _tile(j, blocks_m, num_pid_n, blk_ptr, num_blocks, num_programs, w_rows_per_expert, BLOCK_N: gl.constexpr,
              GROUP_M: gl.constexpr):
        """The program's j-th tile -> (first row, end row, column tile, first weight row, expert)."""
        pid_m, pid_n = grouped_tile(gl.program_id(0) + j * num_programs, blocks_m, num_pid_n, GROUP_M)
        expert = gl.load(blk_ptr + pid_m)
        row_start = gl.load(blk_ptr + num_blocks + pid_m)
        row_end = gl.load(blk_ptr + 2 * num_blocks + pid_m)
        return row_start, row_end, pid_n, expert * w_rows_per_expert + pid_n * BLOCK_N, expert

    @gluon.jit
    def _loader(p, c: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                GROUP_M: gl.constexpr, STAGES: gl.constexpr, GATED: gl.constexpr, ACT: gl.constexpr,
                SCALED: gl.constexpr, UNROLL: gl.constexpr, INTER_DTYPE: gl.constexpr):
        """The loader warp (_ws_gemm_kernel); c unused (the workers share a signature). GATED: each step
        also loads the up rows (N rows after the gate rows) into the slot's second weight buffer."""
        (a_desc, w_desc, a_bufs, w_bufs, ready, empty, turn, rw_ptr, out_ptr, blk_ptr, nblk_ptr, num_blocks,
         num_programs, N, K, w_rows_per_expert, stride_out, as_ptr, ws_ptr, stride_as, stride_wse, stride_wsn,
         outs_ptr, stride_outs) = p
        blocks_m, num_pid_n, my_tiles = _tiles(nblk_ptr, num_programs, N, BLOCK_N)
        n = gl.cdiv(K, BLOCK_K)
        WIDE: gl.constexpr = SCALED and not GATED and BLOCK_N == 256  # the wide fp8-block down: two 128-row halves
        nbytes: gl.constexpr = a_desc.block_type.nbytes + (2 if GATED or WIDE else 1) * w_desc.block_type.nbytes
        second: gl.constexpr = BLOCK_N // 2 if WIDE else 0  # WIDE: the second weight buffer's first row, past w_row
        for j in range(my_tiles):
            a_row, _, _, w_row, _ = _tile(j, blocks_m, num_pid_n, blk_ptr, num_blocks, num_programs,
                                          w_rows_per_expert, BLOCK_N, GROUP_M)
            for k in range(n):
                g = j * n + k
                slot = g % STAGES
                mbarrier.wait(empty.index(slot), ((g // STAGES) & 1) ^ 1)
                bar = ready.index(slot)
                mbarrier.expect(bar, nbytes)
                tma.async_copy_global_to_shared(a_desc, [a_row, k * BLOCK_K], bar, a_bufs.index(slot))
                if GATED or WIDE:
                    tma.async_copy_global_to_shared(w_desc, [w_row, k * BLOCK_K], bar, w_bufs.index(2 * slot))
                    tma.async_copy_global_to_shared(w_desc, [w_row + (N if GATED else second), k * BLOCK_K], bar,
                                                    w_bufs.index(2 * slot + 1))
                else:
                    tma.async_copy_global_to_shared(w_desc, [w_row, k * BLOCK_K], bar, w_bufs.index(slot))

    @gluon.jit
    def _rows_of(a_bufs, slot, d, ROW0: gl.constexpr):
        """The activation rows of slot's tile that d (an accumulator or product) multiplies: all of them, or (COOP:
        d holds half the tile's rows) the rows from ROW0 on, as many as d has."""
        a = a_bufs.index(slot)
        if a.shape[0] != d.shape[0]:
            a = a.slice(ROW0, d.shape[0], dim=0)
        return a

    @gluon.jit
    def _k_loop(a_bufs, w_bufs, ready, empty, turn_bar, g0, n, acc, acc_u, STAGES: gl.constexpr, GATED: gl.constexpr,
                ROW0: gl.constexpr = 0, TURNS: gl.constexpr = True):
        """acc + the tile's K steps g0 .. g0 + n - 1 (GATED: acc the gate's product and acc_u the up's, two wgmmas a
        step; acc_u unused otherwise), one step's wgmmas in flight, each step's slot released once the next step's
        are issued and it is done; turn_bar gets the other consumer's turn once the last step's are issued (TURNS;
        COOP runs without turns). The activation rows: acc's rows of the slot's tile from row ROW0 (COOP: each
        consumer its 64-row half) -> (acc, acc_u), every wgmma finished and every slot released."""
        for k in range(n):
            g = g0 + k
            slot = g % STAGES
            mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
            a = _rows_of(a_bufs, slot, acc, ROW0)
            if GATED:
                tok_g = warpgroup_mma(a, w_bufs.index(2 * slot).permute((1, 0)), acc, is_async=True)
                tok_u = warpgroup_mma(a, w_bufs.index(2 * slot + 1).permute((1, 0)), acc_u, is_async=True)
                acc, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(tok_g, tok_u))
            else:
                tok = warpgroup_mma(a, w_bufs.index(slot).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(tok,))
            mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), count=1, pred=k > 0)  # step g - 1's slot
        if TURNS:
            mbarrier.arrive(turn_bar, count=1)
        if GATED:
            acc, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_u))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((g0 + n - 1) % STAGES), count=1)
        return acc, acc_u

    @gluon.jit
    def _k_loop_scaled(a_bufs, w_bufs, ready, empty, turn_bar, g0, n, acc, d_a, d_b, as_rows, ws_tile,
                       STAGES: gl.constexpr, UNROLL: gl.constexpr):
        """fp8-block: acc + every step's product scaled by its row and weight-block scales (as_rows + t, ws_tile
        + t), the products by turns (gemm/down_wgmma.py's K loop: step t + 1's wgmma runs while step t's product
        is scaled; UNROLL steps a body, nothing in flight across its back edge). Each step's slot is released once
        its wgmma is done; turn_bar gets the other consumer's turn once the last step's wgmma is issued.
        -> (acc, d_a, d_b): the products' registers carry over to the next tile."""
        bodies = n // UNROLL
        for b in range(bodies):
            t = b * UNROLL
            last = b == bodies - 1
            p_a = _mma_step(a_bufs, w_bufs, (ready,), g0 + t, d_a, STAGES)
            s_a = gl.load(as_rows + t) * gl.load(ws_tile + t)
            if UNROLL == 1:
                mbarrier.arrive(turn_bar, count=1, pred=last)
            for u in gl.static_range(1, UNROLL):
                p_b = _mma_step(a_bufs, w_bufs, (ready,), g0 + t + u, d_b, STAGES)
                s_b = gl.load(as_rows + t + u) * gl.load(ws_tile + t + u)
                if u == UNROLL - 1:
                    mbarrier.arrive(turn_bar, count=1, pred=last)
                d_a = warpgroup_mma_wait(num_outstanding=1, deps=(p_a,))
                mbarrier.arrive(empty.index((g0 + t + u - 1) % STAGES), count=1)
                acc = _scaled_add(d_a, s_a, acc)
                p_a, s_a, d_a, p_b, s_b, d_b = p_b, s_b, d_b, p_a, s_a, d_a
            d_a = warpgroup_mma_wait(num_outstanding=0, deps=(p_a,))
            mbarrier.arrive(empty.index((g0 + t + UNROLL - 1) % STAGES), count=1)
            acc = _scaled_add(d_a, s_a, acc)
        return acc, d_a, d_b

    @gluon.jit
    def _quarter(a_bufs, w_bufs, g, q: gl.constexpr, d, STAGES: gl.constexpr, QN: gl.constexpr,
                 ROW0: gl.constexpr):
        """Start step g's wgmma of quarter q of a tile in quarters into d's registers (d's values unused); the caller
        has waited for the step's tiles. The slot's two weight buffers 2 * slot and 2 * slot + 1 (gated: the gate and
        the up rows; the wide down: the tile's two 128-row halves) of 2 * QN rows each; q: 0 the first buffer's rows
        0 .. QN - 1, 1 its rows QN .. 2QN - 1, 2 and 3 the same of the second. The activation rows: d's rows of the
        slot's tile from row ROW0 (COOP: each consumer its 64-row half of a 128-row tile)."""
        slot = g % STAGES
        w = w_bufs.index(2 * slot + q // 2).slice((q % 2) * QN, QN, dim=0)
        return warpgroup_mma(_rows_of(a_bufs, slot, d, ROW0), w.permute((1, 0)), d, use_acc=False, is_async=True)

    @gluon.jit
    def _k_loop_quarters(a_bufs, w_bufs, ready, empty, turn_bar, g0, n, acc0, acc1, acc2, acc3, d_a, d_b,
                         as_rows, gs, us, STAGES: gl.constexpr, UNROLL: gl.constexpr, QN: gl.constexpr,
                         ROW0: gl.constexpr = 0, TURNS: gl.constexpr = True):
        """fp8-block gate_up and wide down: the tile's four accumulator quarters (_quarter's order) plus every step's
        four quarter products, each scaled by the rows' group scale (as_rows + t) times its weight block's (gs + t for
        the first weight buffer's quarters, us + t for the second's), as gemm/gate_up_wgmma.py's K loop: the
        products by turns, each scaled into its quarter while the next runs, a step's last product finished during
        the next step's first; UNROLL steps a body, nothing in flight across its back edge. A step's slot is
        released once its last wgmma is done; turn_bar gets the other consumer's turn once the tile's last wgmma is
        issued (TURNS; COOP runs without turns). ROW0: _quarter's.
        -> (acc0, acc1, acc2, acc3, d_a, d_b): the products' registers carry over to the next tile."""
        bodies = n // UNROLL
        for b in range(bodies):
            last = b == bodies - 1
            for u in gl.static_range(UNROLL):
                t = b * UNROLL + u
                g = g0 + t
                mbarrier.wait(ready.index(g % STAGES), (g // STAGES) & 1)
                s_x = gl.load(as_rows + t)
                s_g = s_x * gl.load(gs + t)
                s_u_next = s_x * gl.load(us + t)
                p_a = _quarter(a_bufs, w_bufs, g, 0, d_a, STAGES, QN, ROW0)
                if u > 0:  # the previous step's last quarter (p_b, s_u: set by step u - 1 of this body)
                    d_b = warpgroup_mma_wait(num_outstanding=1, deps=(p_b,))  # noqa: F821
                    mbarrier.arrive(empty.index((g - 1) % STAGES), count=1)  # every wgmma of step g - 1 is done
                    acc3 = _scaled_add(d_b, s_u, acc3)  # noqa: F821
                s_u = s_u_next
                p_b = _quarter(a_bufs, w_bufs, g, 1, d_b, STAGES, QN, ROW0)
                d_a = warpgroup_mma_wait(num_outstanding=1, deps=(p_a,))
                acc0 = _scaled_add(d_a, s_g, acc0)
                p_a = _quarter(a_bufs, w_bufs, g, 2, d_a, STAGES, QN, ROW0)
                d_b = warpgroup_mma_wait(num_outstanding=1, deps=(p_b,))
                acc1 = _scaled_add(d_b, s_g, acc1)
                p_b = _quarter(a_bufs, w_bufs, g, 3, d_b, STAGES, QN, ROW0)
                if TURNS and u == UNROLL - 1:
                    mbarrier.arrive(turn_bar, count=1, pred=last)
                d_a = warpgroup_mma_wait(num_outstanding=1, deps=(p_a,))
                acc2 = _scaled_add(d_a, s_u, acc2)
            d_b = warpgroup_mma_wait(num_outstanding=0, deps=(p_b,))
            mbarrier.arrive(empty.index((g0 + b * UNROLL + UNROLL - 1) % STAGES), count=1)
            acc3 = _scaled_add(d_b, s_u, acc3)
        return acc0, acc1, acc2, acc3, d_a, d_b

    @gluon.jit
    def _store_fp8_groups(acc0, acc1, acc2, acc3, row_start, row_end, pid_n, out_ptr, outs_ptr, stride_out,
                          stride_outs, ACT: gl.constexpr, INTER_DTYPE: gl.constexpr, BLOCK_M: gl.constexpr,
                          QN: gl.constexpr):
        """fp8-block gate_up epilogue of a [BLOCK_M, 2 * QN = 128] tile (one 1x128 group a row), as
        gemm/gate_up_wgmma.py's: act(gate) * up of both halves rounded to the layer dtype, one amax per row,
        quantized into out (float8_e4m3fn) with the group scale into outs at column pid_n."""
        h0 = gated_act(acc0, acc2, ACT).to(INTER_DTYPE).to(gl.float32)
        h1 = gated_act(acc1, acc3, ACT).to(INTER_DTYPE).to(gl.float32)
        scale = fp8_scale(gl.maximum(gl.max(gl.abs(h0), axis=1), gl.max(gl.abs(h1), axis=1)))
        _store_group(h0, scale, row_start, row_end, pid_n * 2 * QN, out_ptr, stride_out, BLOCK_M, QN, 4)
        _store_group(h1, scale, row_start, row_end, pid_n * 2 * QN + QN, out_ptr, stride_out, BLOCK_M, QN, 4)
        rows = row_start + gl.arange(0, BLOCK_M, layout=scale.type.layout)
        gl.store(outs_ptr + rows * stride_outs + pid_n, scale, mask=rows < row_end)

    @gluon.jit
    def _store_cols(acc, rw, row_start, row_end, col0, out_ptr, stride_out, N, BLOCK_M: gl.constexpr,
                    QN: gl.constexpr):
        """The wide down's epilogue of one accumulator quarter acc [BLOCK_M, QN]: times the rows' routing weights rw
        [BLOCK_M] (acc's row layout), in out's dtype, at columns col0 .. col0 + QN - 1, 16-byte stores."""
        st: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (QN // 8), QN // 8], [4, 1], [1, 0])
        y = gl.convert_layout((acc * rw[:, None]).to(out_ptr.dtype.element_ty), st)
        rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st))
        cols = col0 + gl.arange(0, QN, layout=gl.SliceLayout(0, st))
        gl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y,
                 mask=(rows < row_end)[:, None] & (cols < N)[None, :])

    @gluon.jit
    def _consume(p, c: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                 GROUP_M: gl.constexpr, STAGES: gl.constexpr, GATED: gl.constexpr, ACT: gl.constexpr,
                 SCALED: gl.constexpr, UNROLL: gl.constexpr, INTER_DTYPE: gl.constexpr):
        """Consumer warpgroup c: the program's tiles c, c + 2, ...; COOP: every tile of the program, its rows
        64c .. 64c + 63 (_ws_gemm_kernel)."""
        (a_desc, w_desc, a_bufs, w_bufs, ready, empty, turn, rw_ptr, out_ptr, blk_ptr, nblk_ptr, num_blocks,
         num_programs, N, K, w_rows_per_expert, stride_out, as_ptr, ws_ptr, stride_as, stride_wse, stride_wsn,
         outs_ptr, stride_outs) = p
        blocks_m, num_pid_n, my_tiles = _tiles(nblk_ptr, num_programs, N, BLOCK_N)
        n = gl.cdiv(K, BLOCK_K)
        WIDE: gl.constexpr = SCALED and not GATED and BLOCK_N == 256  # the wide fp8-block down (_ws_gemm_kernel)
        QN: gl.constexpr = 64 if SCALED and (GATED or WIDE) else BLOCK_N  # a product's columns
        COOP: gl.constexpr = coop(GATED, SCALED, BLOCK_M, BLOCK_N)
        CM: gl.constexpr = BLOCK_M // 2 if COOP else BLOCK_M  # this consumer's rows of a tile
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, QN, 32 if SCALED else 16])
        st: gl.constexpr = gl.BlockedLayout([1, 8], [max(1, 32 // (BLOCK_N // 8)), min(32, BLOCK_N // 8)], [4, 1],
                                            [1, 0])
        d_a = gl.zeros([CM, QN], gl.float32, mma)  # SCALED: the two products by turns
        d_b = gl.zeros([CM, QN], gl.float32, mma)
        for j in range(0 if COOP else c, my_tiles, 1 if COOP else 2):
            row_start, row_end, pid_n, _, expert = _tile(j, blocks_m, num_pid_n, blk_ptr, num_blocks, num_programs,
                                                         w_rows_per_expert, BLOCK_N, GROUP_M)
            if not COOP:
                i = j // 2  # this consumer's i-th tile: wait until the other has issued its K loop before this one
                mbarrier.wait(turn.index(c), (i - c + 1) & 1, pred=(c == 1) | (i > 0))
            first = row_start + c * CM if COOP else row_start  # this consumer's first row
            rows_ld = gl.minimum(first + gl.arange(0, CM, layout=gl.SliceLayout(1, mma)), row_end - 1)
            if SCALED and (GATED or WIDE):  # fp8-block tiles in quarters (_k_loop_quarters)
                as_rows = as_ptr + rows_ld * stride_as
                if GATED:  # BLOCK_N 128: the gate rows' weight-scale block, and the up rows' I / 128 blocks on
                    gs = ws_ptr + expert.to(gl.int64) * stride_wse + pid_n * stride_wsn
                    us = gs + (N // 128) * stride_wsn
                else:  # WIDE, BLOCK_N 256: two weight-scale blocks, the second 128 rows past the first
                    gs = _weight_scales(ws_ptr, expert, pid_n, N, stride_wse, stride_wsn, BLOCK_N)
                    us = gs + stride_wsn
                acc0 = gl.zeros([CM, QN], gl.float32, mma)
                acc1 = gl.zeros([CM, QN], gl.float32, mma)
                acc2 = gl.zeros([CM, QN], gl.float32, mma)
                acc3 = gl.zeros([CM, QN], gl.float32, mma)
                acc0, acc1, acc2, acc3, d_a, d_b = _k_loop_quarters(
                    a_bufs, w_bufs, ready, empty, turn.index(1 - c), j * n, n, acc0, acc1, acc2, acc3, d_a, d_b,
                    as_rows, gs, us, STAGES, UNROLL, QN, c * CM, not COOP)
                if GATED:
                    _store_fp8_groups(acc0, acc1, acc2, acc3, first, row_end, pid_n, out_ptr, outs_ptr,
                                      stride_out, stride_outs, ACT, INTER_DTYPE, CM, QN)
                else:
                    rw = gl.load(rw_ptr + rows_ld)
                    col0 = pid_n * BLOCK_N
                    _store_cols(acc0, rw, first, row_end, col0, out_ptr, stride_out, N, CM, QN)
                    _store_cols(acc1, rw, first, row_end, col0 + QN, out_ptr, stride_out, N, CM, QN)
                    _store_cols(acc2, rw, first, row_end, col0 + 2 * QN, out_ptr, stride_out, N, CM, QN)
                    _store_cols(acc3, rw, first, row_end, col0 + 3 * QN, out_ptr, stride_out, N, CM, QN)
            else:
                if GATED:
                    acc_g = gl.zeros([CM, BLOCK_N], gl.float32, mma)
                    acc_u = gl.zeros([CM, BLOCK_N], gl.float32, mma)
                    acc_g, acc_u = _k_loop(a_bufs, w_bufs, ready, empty, turn.index(1 - c), j * n, n, acc_g, acc_u,
                                           STAGES, True, c * CM, not COOP)
                    y = gated_act(acc_g, acc_u, ACT)
                else:
                    acc = gl.zeros([CM, BLOCK_N], gl.float32, mma)
                    if SCALED:  # row r's group scale of step t at as_rows[r] + t; the weight block's at ws_tile + t
                        as_rows = as_ptr + rows_ld * stride_as
                        ws_tile = _weight_scales(ws_ptr, expert, pid_n, N, stride_wse, stride_wsn, BLOCK_N)
                        acc, d_a, d_b = _k_loop_scaled(a_bufs, w_bufs, ready, empty, turn.index(1 - c), j * n, n, acc,
                                                       d_a, d_b, as_rows, ws_tile, STAGES, UNROLL)
                    else:
                        acc, _ = _k_loop(a_bufs, w_bufs, ready, empty, turn.index(1 - c), j * n, n, acc, acc, STAGES,
                                         False, c * CM, not COOP)
                    y = acc * gl.load(rw_ptr + rows_ld)[:, None]
                y = gl.convert_layout(y.to(out_ptr.dtype.element_ty), st)  # 16-byte stores
                rows = first + gl.arange(0, CM, layout=gl.SliceLayout(1, st))
                cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, st))
                gl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y,
                         mask=(rows < row_end)[:, None] & (cols < N)[None, :])

    @gluon.jit
    def _consumer0(p, c: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                   GROUP_M: gl.constexpr, STAGES: gl.constexpr, GATED: gl.constexpr, ACT: gl.constexpr,
                   SCALED: gl.constexpr, UNROLL: gl.constexpr, INTER_DTYPE: gl.constexpr):
        _consume(p, 0, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, GATED, ACT, SCALED, UNROLL, INTER_DTYPE)

    @gluon.jit
    def _consumer1(p, c: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                   GROUP_M: gl.constexpr, STAGES: gl.constexpr, GATED: gl.constexpr, ACT: gl.constexpr,
                   SCALED: gl.constexpr, UNROLL: gl.constexpr, INTER_DTYPE: gl.constexpr):
        _consume(p, 1, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, GATED, ACT, SCALED, UNROLL, INTER_DTYPE)

    @gluon.jit(do_not_specialize=["num_blocks", "num_programs", "w_rows_per_expert"])
    def _ws_gemm_kernel(a_desc, w_desc, rw_ptr, out_ptr, blk_ptr, nblk_ptr, as_ptr, ws_ptr, num_blocks, num_programs,
                        N, K, w_rows_per_expert, stride_out, stride_as, stride_wse, stride_wsn, outs_ptr, stride_outs,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                        STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                        GATED: gl.constexpr = False, ACT: gl.constexpr = 0, SCALED: gl.constexpr = False,
                        UNROLL: gl.constexpr = 1, INTER_DTYPE: gl.constexpr = gl.bfloat16):
        """out [R, N] from a [R, K] (a_desc: TMA descriptor, [BLOCK_M, BLOCK_K] boxes; rows past a block's end are
        read, never stored) and the weight rows [E * W, K] (w_desc, [BLOCK_N, BLOCK_K] boxes; expert e's from
        e * w_rows_per_expert); both zero-fill past K. down: N = H, K = I, W = H, times rw_ptr's routing weight.
        GATED (gate_up): N = I, K = H, W = 2I, out = act(gate) * up (ACT: common.ACT_CODES), rw_ptr unused.
        blk_ptr, nblk_ptr: block_table's. SCALED (fp8-block, BLOCK_K 128): every step's product times the rows'
        group scales (as_ptr [R, K / 128] float32, row stride stride_as) and the weight block's (ws_ptr
        [E, N / 128, K / 128] float32, strides stride_wse, stride_wsn, 1), UNROLL steps a K-loop body. GATED and
        SCALED (BLOCK_N 128): out float8_e4m3fn, act(gate) * up rounded to INTER_DTYPE (the layer dtype), then
        quantized in 1x128 groups, their scales into outs_ptr [R, N / 128] float32 (row stride stride_outs); outs_ptr
        unused otherwise. WIDE (SCALED down, BLOCK_N 256): a 64 x 256 tile whose slot holds its two 128-row weight
        halves (two weight-scale blocks), run in four 64-column quarters (_k_loop_quarters, _store_cols).

        Persistent: program p of num_programs takes tiles p, p + P, ... of the nblk real row blocks in grouped
        order (_tiles, _tile). Three partitions (gl.warp_specialize):
          - _loader, one warp: every K step of the program's tiles, in order, by TMA into a ring of STAGES slots
            (step g in slot g % STAGES; GATED: gate and up rows into the slot's two weight buffers), each once the
            slot's `empty` barrier says it is released; the slot's `ready` barrier says it has landed.
          - _consume, two consumer warpgroups: consumer c takes tiles c, c + 2, ... (a ping-pong); its K loop
            (_k_loop; SCALED: _k_loop_scaled, two products by turns; GATED and SCALED or WIDE: _k_loop_quarters)
            releases each slot once its wgmmas are done, then the epilogue (routing weight; or act(gate) * up,
            quantized where SCALED), 16-byte stores. A consumer starts a tile's K loop only once the other has
            issued its own (the `turn` barriers): the K loops run one after the other at the tensor cores' full
            rate while the other consumer runs its epilogue, and no wait on a slot's barrier is more than one
            phase ahead (a parity wait cannot tell phases two apart: without turns, wrong steps are read).
          - COOP (coop(): 128-row tiles of 256 accumulator columns): both consumers share each tile, 64 rows each,
            both reading every slot (`empty` of count 2), no turns; each weight tile serves twice the rows, but
            the epilogues no longer overlap a K loop. Both run every tile's wgmmas, even for blocks of at most 64
            rows: a consumer that skipped them would run ahead of the other, its ring short of loaded steps.
        Registers (setmaxnreg): 12 warps launched at MAXNREG 168; consumer 1 gets CONSUMER_REGS 232, the loader
        LOADER_REGS 24, consumer 0 (the default partition) the rest, 248. Per consumer: down one 128 x 128 or
        64 x 256 accumulator (COOP: 64 rows of 128 x 256), gate_up two 128 x 64 or 64 x 128 (COOP: 64 rows of two
        128 x 128); SCALED an accumulator and two products of 64 x 128 (or 128 x 64); in quarters four quarters
        and two products of 64 x 64. No spills on sm_90a (tests/kernels/test_kernels_compile_sm90.py)."""
        dtype: gl.constexpr = a_desc.dtype
        WIDE: gl.constexpr = SCALED and not GATED and BLOCK_N == 256
        WB: gl.constexpr = 2 if GATED or WIDE else 1  # weight buffers a slot (gate and up; WIDE: two 128-row halves)
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        w_bufs = gl.allocate_shared_memory(dtype, [WB * STAGES, BLOCK_N // 2 if WIDE else BLOCK_N, BLOCK_K],
                                           w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2 if coop(GATED, SCALED, BLOCK_M, BLOCK_N) else 1)  # COOP: both
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        fence_async_shared()
        p = (a_desc, w_desc, a_bufs, w_bufs, ready, empty, turn, rw_ptr, out_ptr, blk_ptr, nblk_ptr, num_blocks,
             num_programs, N, K, w_rows_per_expert, stride_out, as_ptr, ws_ptr, stride_as, stride_wse, stride_wsn,
             outs_ptr, stride_outs)
        gl.warp_specialize(
            [(_consumer0, (p, 0, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, GATED, ACT, SCALED, UNROLL,
                           INTER_DTYPE)),
             (_consumer1, (p, 1, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, GATED, ACT, SCALED, UNROLL,
                           INTER_DTYPE)),
             (_loader, (p, 0, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, GATED, ACT, SCALED, UNROLL, INTER_DTYPE))],
            [4, 1], [CONSUMER_REGS, LOADER_REGS])


_GL_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float8_e4m3fn: "float8e4nv"}


def cannot_run(a: Tensor, a_scale: Tensor | None, w: Tensor, scheme: str, cfg, gated: bool = False,
               w_scale: Tensor | None = None) -> str | None:
    """Why this kernel cannot run a down call (gated: a gate_up call) on Hopper (choice.py asks), or None.
    It needs a [R, K] rows in order and w [E, N or 2N, K] of one dtype; scheme none in bf16/fp16, or fp8-block with
    a_scale [R, K/128] and w_scale [E, N/128 or 2N/128, K/128] unit-stride along K (gated: N and K multiples of 128,
    each tile one weight-scale block and one output group; the 256-wide down: H a multiple of 256); a tile that
    tiles.ws_fits; K > 0 (with no K step the consumers never hand each other the turn); experts back to back and
    TMA-addressable operands."""
    if w.dtype != a.dtype:
        return f"weights {w.dtype} and rows {a.dtype} differ"
    if not ws_fits(cfg, gated, scheme):
        return f"a {cfg.block_m}x{cfg.block_n}x{cfg.block_k} tile of {cfg.num_stages} stages it does not run"
    if a.shape[1] == 0:
        return "no K steps"
    if scheme == "fp8-block":
        if (a.dtype != torch.float8_e4m3fn or a_scale is None or w_scale is None or a_scale.stride(1) != 1
                or w_scale.stride(2) != 1):
            return "fp8-block operands without unit-stride scales"
        if gated and (w.shape[1] % 256 or a.shape[1] % 128):
            return f"I={w.shape[1] // 2} or H={a.shape[1]} not a multiple of 128"
        if not gated and cfg.block_n == 256 and w.shape[1] % 256:
            return f"H={w.shape[1]} not a multiple of 256 (the 256-wide tile: two whole weight-scale blocks)"
    elif scheme != "none" or a_scale is not None or a.dtype not in (torch.bfloat16, torch.float16):
        return f"scheme {scheme} in {a.dtype} (it runs bf16/fp16, or fp8-block)"
    if expert_rows(w) is None or not tma_rows(a, a.stride(0)) or not tma_rows(w, w.stride(1)):
        return "operands TMA cannot address (rows not 16-byte aligned, experts not back to back, or TMA off)"
    return None


def launch(a: Tensor, w: Tensor, route_w: Tensor | None, layout: RowLayout, cfg, out: Tensor, gated: bool = False,
           act: int = 0, a_scale: Tensor | None = None, w_scale: Tensor | None = None, out_scale: Tensor | None = None,
           dtype: torch.dtype = torch.bfloat16, most_unroll: int = 8) -> None:
    """Write out [R, N] (_ws_gemm_kernel); only where cannot_run() says None. down: w = down_proj [E, H, I], out
    [R, H], route_w [R] float32; fp8-block: with a_scale [R, I / 128] and w_scale (down_proj_scale_inv)
    [E, H / 128, I / 128] float32. gated (gate_up): w = gate_up_proj [E, 2I, H], out [R, I], act a
    common.ACT_CODES value, route_w unused; fp8-block: a_scale [R, H / 128], w_scale (gate_up_proj_scale_inv)
    [E, 2I / 128, H / 128], out float8_e4m3fn and out_scale [R, I / 128] float32 (its 1x128 groups), dtype the
    layer dtype the activation is rounded to first. most_unroll: the most K steps of an fp8-block loop body.
    Two launches (block_table, then the GEMM on min(SMs, tiles) programs), no host synchronization."""
    r, k = a.shape
    e, w_rows, _ = w.shape
    n = out.shape[1]
    if r == 0 or n == 0:
        return
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    dt = _GL_DTYPE[a.dtype]
    a_desc = TensorDescriptor(a, [r, k], [a.stride(0), 1], [bm, bk], smem_layout((bm, bk), dt))
    per_expert = expert_rows(w)  # 0 for an expert stride of 0: every expert reads the same rows
    wide = a_scale is not None and not gated and bn == 256  # the wide fp8-block down: [128, BLOCK_K] boxes, two a step
    w_box = bn // 2 if wide else bn
    w_desc = TensorDescriptor(w, [e * w_rows if per_expert else w_rows, k], [w.stride(1), 1], [w_box, bk],
                              smem_layout((w_box, bk), dt))
    blk, nblk = block_table(layout, bm)
    programs = min(num_sms(a.device), blk.shape[1] * cdiv(n, bn))
    scaled = a_scale is not None
    steps = cdiv(k, bk)
    as_, ws_ = (a_scale, w_scale) if scaled else (out, out)
    outs = out_scale if out_scale is not None else as_
    _ws_gemm_kernel[(programs,)](
        a_desc, w_desc, route_w if route_w is not None else out, out, blk, nblk, as_, ws_, blk.shape[1], programs, n,
        k, per_expert, out.stride(0), as_.stride(0), ws_.stride(0) if scaled else 0, ws_.stride(1) if scaled else 0,
        outs, outs.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, STAGES=cfg.num_stages,
        CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS, GATED=gated, ACT=act, SCALED=scaled,
        UNROLL=unroll(steps, most_unroll) if scaled else 1, INTER_DTYPE=_INTER[dtype], num_warps=4, maxnreg=MAXNREG)
