"""The one-launch layer (kernels/fused_layer.py) for Hopper in Gluon: every weight tile of a work item asked for
as soon as its slot is free, so a program keeps STAGES tiles in flight instead of the two Triton's loop gets.

    x [T, H] layer dtype, topk_ids [T, K] int32, topk_weights [T, K] float32,
    w13 gate_up_proj [E, 2I, H], w2 down_proj [E, H, I] (scheme none: the layer dtype; fp8-block: float8_e4m3fn with
    scales [E, 2I/128, H/128], [E, H/128, I/128]) -> out [T, H] layer dtype, as fused_layer.fused_layer (the same
    work items, tickets, counters and split-K partial sums; reference: fused_layer.fused_layer_torch).
Why: at T = 1 the Triton kernel's programs stream 20-26 GB/s each, about 1.2 µs a K step. Its pipelined loop issues
step t + 2's tiles only after step t's wgmmas are done and after the step's x (or intermediate) row has been
quantized and written to shared memory as the dot's operand, so a step costs half of (load latency + that chain)
(benchmarks/results/fused_wgmma_*.md has the timeline this came from).
How: each item allocates a ring of STAGES weight slots (gate_up: gate and up tiles in one [2, BLOCK_N1, BLOCK_K]
copy of w13 read as planes [2E, I, H]; down: [BLOCK_N2, BLOCK_K] tiles of w2 read as rows [E * H, I]) and starts
its first STAGES tiles at once; a down item does so before it waits for the gate_up items it reads, so its first
tiles arrive while it waits. A step: the row's BLOCK_K values (loaded a step ahead) quantized (fp8-block: the 1x128
group, as kernels/quant.quantize_groups) and written broadcast into a [16, BLOCK_K] operand buffer, the weight
tiles' wgmmas (weights as A, [BLOCK_N, BLOCK_K] x [BLOCK_K, 16]), waited, the slot refilled with the step STAGES
ahead, then (fp8-block) the product scaled into the accumulator. BLOCK_K: 128 (fp8, one scale group a step) or
64 (16-bit, the 128-byte TMA box row).
Where: FusedConfig.wgmma (configs.py) on CUDA compute capability 9.x, schemes none (bf16/fp16) and fp8-block, H and
I multiples of 128, weights TMA-addressable (usable()); fused_layer.fused_layer runs the Triton kernel otherwise.
Imported only when a config asks for it on a CUDA device: CPU runs never load Gluon.
"""
from __future__ import annotations

import torch
import triton
from torch import Tensor

from .common import QUANT_CODES, _cuda_properties, expert_rows, fp8_scale, gated_act, to_fp8
from .down_wgmma import gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _GL = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}

    @gluon.jit
    def _bars(STAGES: gl.constexpr):
        """STAGES mbarriers (one a slot), initialized."""
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        fence_async_shared()
        return bars

    @gluon.jit
    def _free_bars(bars, STAGES: gl.constexpr):
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))

    @gluon.jit
    def _start(desc, bufs, bars, i, c0, c1, c2, RANK3: gl.constexpr, STAGES: gl.constexpr, pred):
        """Start the TMA copy of the item's step i (box at c0, c1[, c2]) into slot i % STAGES."""
        slot = i % STAGES
        mbarrier.expect(bars.index(slot), desc.block_type.nbytes, pred=pred)
        if RANK3:
            tma.async_copy_global_to_shared(desc, [c0, c1, c2], bars.index(slot), bufs.index(slot), pred=pred)
        else:
            tma.async_copy_global_to_shared(desc, [c0, c1], bars.index(slot), bufs.index(slot), pred=pred)

    @gluon.jit
    def _operand(vals, b_smem, QUANT: gl.constexpr, blk: gl.constexpr, BLOCK_K: gl.constexpr):
        """vals [BLOCK_K] float32 (SliceLayout(0, blk)) -> written into b_smem [16, BLOCK_K] as 16 equal rows, the
        dot's B operand (fp8-block: the group quantized as quant.quantize_groups); returns the group's scale
        (1 without quantization). Fenced for the wgmma and a CTA barrier after."""
        if QUANT == 3:
            scale = fp8_scale(gl.max(gl.abs(vals), axis=0))
            q = to_fp8(vals, scale, False)
        else:
            scale = 1.0
            q = vals.to(b_smem.dtype)
        row = gl.expand_dims(q, 0)
        b = gl.broadcast(row, gl.full([16, BLOCK_K], 0, b_smem.dtype, blk))[0]
        b_smem.store(b)
        fence_async_shared()
        gl.thread_barrier()
        return scale

    @gluon.jit
    def _column0(acc, mma: gl.constexpr):
        """[BLOCK_N, 16] product of 16 equal columns -> its first column [BLOCK_N] (SliceLayout(1, mma)), exactly."""
        cols = gl.arange(0, 16, layout=gl.SliceLayout(0, mma))
        return gl.sum(gl.where(gl.expand_dims(cols == 0, 0), acc, 0.0), axis=1)

    @gluon.jit
    def _pick(vec, kk, k):
        """vec[k] of a small per-thread vector (every thread holds all of it: no exchange)."""
        return gl.sum(gl.where(kk == k, vec, 0), axis=0)

    @gluon.jit
    def _fma_pinned(d, s, acc):
        """acc + d * s (s a scalar), kept before the next wgmma (an inline asm with side effects)."""
        return gl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=r,r,r,r",
                                         [d, gl.full(d.shape, s, gl.float32, d.type.layout), acc],
                                         dtype=gl.float32, is_pure=False, pack=1)

    @gluon.jit
    def _split_sum(counter_ptr, part_ptr, s, a, b, rows, SPLIT: gl.constexpr, N: gl.constexpr):
        """fused_layer._last_of for two partials: store this split's float32 a, b [N] in slot s of part_ptr
        [SPLIT, 2N], count it in -> (whether this program came last, the a and b partials summed in slot order:
        valid for the last one, which also zeroes the counter for the next launch)."""
        gl.store(part_ptr + s * 2 * N + rows, a)
        gl.store(part_ptr + s * 2 * N + N + rows, b)
        gl.thread_barrier()  # every thread's stores before the count
        last = gl.atomic_add(counter_ptr, 1, sem="acq_rel") == SPLIT - 1
        ta = gl.zeros_like(a)
        tb = gl.zeros_like(b)
        if last:
            gl.atomic_xchg(counter_ptr, 0)
            for k in gl.static_range(SPLIT):
                ta += gl.load(part_ptr + k * 2 * N + rows, cache_modifier=".cg")
                tb += gl.load(part_ptr + k * 2 * N + N + rows, cache_modifier=".cg")
        return last, ta, tb

    @gluon.jit
    def _gate_up_item(item, x_ptr, ids_ptr, w13_desc, w13s_ptr, inter_ptr, part1_ptr, sync_ptr, split1_counts, H, I,
                      stride_x, stride_w13se, stride_w13sn, TOP_K: gl.constexpr, QUANT: gl.constexpr, ACT: gl.constexpr,
                      INTER_DTYPE: gl.constexpr, BLOCK_N1: gl.constexpr, BLOCK_K: gl.constexpr,
                      SPLIT1: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
        """Gate_up work item (fused_layer's): copy c, columns j * BLOCK_N1 .., K steps of split s."""
        KI: gl.constexpr = 256 // w13_desc.dtype.primitive_bitwidth  # an instruction's K: 32 fp8, 16 16-bit
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, 16, KI])
        blk: gl.constexpr = gl.BlockedLayout([1, BLOCK_K // 32], [1, 32], [num_warps, 1], [1, 0])
        vec: gl.constexpr = gl.SliceLayout(0, blk)
        tiles1 = I // BLOCK_N1
        tile = item // SPLIT1
        s = item % SPLIT1
        c = tile // tiles1
        j = tile % tiles1
        t = c // TOP_K
        e = gl.load(ids_ptr + c)
        steps = H // BLOCK_K
        per = gl.cdiv(steps, SPLIT1)
        k_lo = s * per
        n = gl.minimum(per, steps - k_lo)
        bufs = gl.allocate_shared_memory(w13_desc.dtype, [STAGES, 2, BLOCK_N1, BLOCK_K], w13_desc.layout)
        bars = _bars(STAGES)
        plane = 2 * e
        n_row = j * BLOCK_N1
        for i in gl.static_range(STAGES):
            _start(w13_desc, bufs, bars, i, plane, n_row, (k_lo + i) * BLOCK_K, True, STAGES, i < n)
        b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([16, BLOCK_K], w13_desc.dtype)
        b_smem = gl.allocate_shared_memory(w13_desc.dtype, [16, BLOCK_K], b_layout)
        cols = gl.arange(0, BLOCK_K, layout=vec)
        x_row = x_ptr + t.to(gl.int64) * stride_x
        gs_ptr = w13s_ptr + e.to(gl.int64) * stride_w13se + (j * BLOCK_N1 // 128) * stride_w13sn
        us_ptr = gs_ptr + (I // 128) * stride_w13sn
        acc_g = gl.zeros([BLOCK_N1, 16], gl.float32, mma)
        acc_u = gl.zeros([BLOCK_N1, 16], gl.float32, mma)
        d_g = gl.zeros([BLOCK_N1, 16], gl.float32, mma)
        d_u = gl.zeros([BLOCK_N1, 16], gl.float32, mma)
        x_next = gl.load(x_row + k_lo * BLOCK_K + cols).to(gl.float32)
        for i in range(n):
            kb = k_lo + i
            vals = x_next
            x_next = gl.load(x_row + gl.minimum(kb + 1, steps - 1) * BLOCK_K + cols).to(gl.float32)
            x_s = _operand(vals, b_smem, QUANT, blk, BLOCK_K)
            slot = i % STAGES
            mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
            w = bufs.index(slot).reshape([2 * BLOCK_N1, BLOCK_K])
            w_g = w.slice(0, BLOCK_N1, dim=0)
            w_u = w.slice(BLOCK_N1, BLOCK_N1, dim=0)
            if QUANT == 3:
                s_g = x_s * gl.load(gs_ptr + kb)
                s_u = x_s * gl.load(us_ptr + kb)
                d_g = warpgroup_mma(w_g, b_smem.permute((1, 0)), d_g, use_acc=False, is_async=True)
                d_u = warpgroup_mma(w_u, b_smem.permute((1, 0)), d_u, use_acc=False, is_async=True)
                d_g, d_u = warpgroup_mma_wait(num_outstanding=0, deps=(d_g, d_u))
                _start(w13_desc, bufs, bars, i + STAGES, plane, n_row, (kb + STAGES) * BLOCK_K, True, STAGES,
                       i + STAGES < n)
                acc_g = _fma_pinned(d_g, s_g, acc_g)
                acc_u = _fma_pinned(d_u, s_u, acc_u)
            else:
                acc_g = warpgroup_mma(w_g, b_smem.permute((1, 0)), acc_g, is_async=True)
                acc_u = warpgroup_mma(w_u, b_smem.permute((1, 0)), acc_u, is_async=True)
                acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
                _start(w13_desc, bufs, bars, i + STAGES, plane, n_row, (kb + STAGES) * BLOCK_K, True, STAGES,
                       i + STAGES < n)
        _free_bars(bars, STAGES)
        g = _column0(acc_g, mma)
        u = _column0(acc_u, mma)
        rows = gl.arange(0, BLOCK_N1, layout=gl.SliceLayout(1, mma))
        finish = True
        if SPLIT1 > 1:  # the last split of the tile adds the partials and finishes it
            part = part1_ptr + tile.to(gl.int64) * (SPLIT1 * 2 * BLOCK_N1)
            finish, g, u = _split_sum(split1_counts + tile, part, s, g, u, rows, SPLIT1, BLOCK_N1)
        if finish:
            h = gated_act(g, u, ACT).to(INTER_DTYPE)
            gl.store(inter_ptr + c.to(gl.int64) * I + j * BLOCK_N1 + rows, h)
            gl.thread_barrier()
            gl.atomic_add(sync_ptr + 2 + c, 1, sem="release")

    @gluon.jit
    def _split_sum1(counter_ptr, part_ptr, s, a, rows, SPLIT: gl.constexpr, N: gl.constexpr):
        """_split_sum for one partial a [N] (part_ptr [SPLIT, N])."""
        gl.store(part_ptr + s * N + rows, a)
        gl.thread_barrier()
        last = gl.atomic_add(counter_ptr, 1, sem="acq_rel") == SPLIT - 1
        ta = gl.zeros_like(a)
        if last:
            gl.atomic_xchg(counter_ptr, 0)
            for k in gl.static_range(SPLIT):
                ta += gl.load(part_ptr + k * N + rows, cache_modifier=".cg")
        return last, ta

    @gluon.jit
    def _down_item(d, ids_ptr, rw_ptr, w2_desc, w2s_ptr, inter_ptr, part2_ptr, out_ptr, sync_ptr, split2_counts, T,
                   H, I, stride_w2se, stride_w2sn, stride_out, TOP_K: gl.constexpr, K_POW2: gl.constexpr,
                   QUANT: gl.constexpr, BLOCK_N1: gl.constexpr, BLOCK_N2: gl.constexpr, BLOCK_K: gl.constexpr,
                   SPLIT2: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
        """Down work item (fused_layer's) d, counted from the first down item: token t, columns j * BLOCK_N2 ..,
        split s of the K copies' steps (k-major). Its first STAGES weight tiles are started before it waits."""
        KI: gl.constexpr = 256 // w2_desc.dtype.primitive_bitwidth
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, 16, KI])
        blk: gl.constexpr = gl.BlockedLayout([1, BLOCK_K // 32], [1, 32], [num_warps, 1], [1, 0])
        vec: gl.constexpr = gl.SliceLayout(0, blk)
        rep: gl.constexpr = gl.BlockedLayout([K_POW2], [32], [num_warps], [0])  # every thread holds all K
        tiles1 = I // BLOCK_N1
        tiles2 = H // BLOCK_N2
        tile = d // SPLIT2
        s = d % SPLIT2
        t = tile // tiles2
        j = tile % tiles2
        kk = gl.arange(0, K_POW2, layout=rep)
        ids = gl.load(ids_ptr + t * TOP_K + kk, mask=kk < TOP_K, other=0)
        wts = gl.load(rw_ptr + t * TOP_K + kk, mask=kk < TOP_K, other=0.0)
        steps = I // BLOCK_K
        total = TOP_K * steps
        per = gl.cdiv(total, SPLIT2)
        st_lo = s * per
        n = gl.maximum(gl.minimum(per, total - st_lo), 0)
        bufs = gl.allocate_shared_memory(w2_desc.dtype, [STAGES, BLOCK_N2, BLOCK_K], w2_desc.layout)
        bars = _bars(STAGES)
        n_row = j * BLOCK_N2
        for i in gl.static_range(STAGES):  # before the wait: the weights do not depend on it
            st = gl.minimum(st_lo + i, total - 1)
            e_i = _pick(ids, kk, st // steps)
            _start(w2_desc, bufs, bars, i, e_i * H + n_row, (st % steps) * BLOCK_K, 0, False, STAGES, i < n)
        if n > 0:
            k_first = st_lo // steps
            k_last = (st_lo + n - 1) // steps
            for k in range(k_first, k_last + 1):  # the copies this split reads: each one's gate_up done
                ready = gl.atomic_add(sync_ptr + 2 + t * TOP_K + k, 0, sem="acquire")
                while ready < tiles1:
                    ready = gl.atomic_add(sync_ptr + 2 + t * TOP_K + k, 0, sem="acquire")
        b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([16, BLOCK_K], w2_desc.dtype)
        b_smem = gl.allocate_shared_memory(w2_desc.dtype, [16, BLOCK_K], b_layout)
        cols = gl.arange(0, BLOCK_K, layout=vec)
        ws_tile = w2s_ptr + (j * BLOCK_N2 // 128) * stride_w2sn
        acc = gl.zeros([BLOCK_N2, 16], gl.float32, mma)
        dd = gl.zeros([BLOCK_N2, 16], gl.float32, mma)
        st0 = gl.minimum(st_lo, total - 1)
        v_next = gl.load(inter_ptr + (t * TOP_K + st0 // steps).to(gl.int64) * I + (st0 % steps) * BLOCK_K + cols,
                         cache_modifier=".cg").to(gl.float32)
        for i in range(n):
            st = st_lo + i
            k = st // steps
            ks = st % steps
            vals = v_next
            st1 = gl.minimum(st + 1, total - 1)
            v_next = gl.load(inter_ptr + (t * TOP_K + st1 // steps).to(gl.int64) * I + (st1 % steps) * BLOCK_K + cols,
                             cache_modifier=".cg").to(gl.float32)
            e = _pick(ids, kk, k)
            w_k = _pick(wts, kk, k)
            a_s = _operand(vals, b_smem, QUANT, blk, BLOCK_K)
            if QUANT == 3:
                scale = w_k * a_s * gl.load(ws_tile + e.to(gl.int64) * stride_w2se + ks)
            else:
                scale = w_k
            slot = i % STAGES
            mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
            dd = warpgroup_mma(bufs.index(slot), b_smem.permute((1, 0)), dd, use_acc=False, is_async=True)
            dd = warpgroup_mma_wait(num_outstanding=0, deps=(dd,))
            st2 = gl.minimum(st + STAGES, total - 1)
            e2 = _pick(ids, kk, st2 // steps)
            _start(w2_desc, bufs, bars, i + STAGES, e2 * H + n_row, (st2 % steps) * BLOCK_K, 0, False, STAGES,
                   i + STAGES < n)
            acc = _fma_pinned(dd, scale, acc)
        _free_bars(bars, STAGES)
        y = _column0(acc, mma)
        rows = gl.arange(0, BLOCK_N2, layout=gl.SliceLayout(1, mma))
        finish = True
        if SPLIT2 > 1:
            finish, y = _split_sum1(split2_counts + tile, part2_ptr + tile.to(gl.int64) * (SPLIT2 * BLOCK_N2), s, y,
                                    rows, SPLIT2, BLOCK_N2)
        if finish:
            gl.store(out_ptr + t.to(gl.int64) * stride_out + j * BLOCK_N2 + rows, y.to(out_ptr.dtype.element_ty))
            done = gl.atomic_add(sync_ptr + 1, 1, sem="acq_rel")
            if done == T * tiles2 - 1:  # the last tile: every ticket is taken and every count read
                gl.atomic_xchg(sync_ptr, 0)
                gl.atomic_xchg(sync_ptr + 1, 0)
                zl: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
                for c0 in range(0, T * TOP_K, 128):
                    cc = c0 + gl.arange(0, 128, layout=zl)
                    gl.store(sync_ptr + 2 + cc, gl.zeros([128], gl.int32, zl), mask=cc < T * TOP_K)

    @gluon.jit(do_not_specialize=["T"])
    def _fused_wgmma_kernel(x_ptr, ids_ptr, rw_ptr, w13_desc, w13s_ptr, w2_desc, w2s_ptr, inter_ptr, part1_ptr,
                            part2_ptr, out_ptr, sync_ptr, T, H, I, stride_x, stride_w13se, stride_w13sn, stride_w2se,
                            stride_w2sn, stride_out, TOP_K: gl.constexpr, K_POW2: gl.constexpr, QUANT: gl.constexpr,
                            ACT: gl.constexpr, INTER_DTYPE: gl.constexpr, BLOCK_N1: gl.constexpr,
                            SPLIT1: gl.constexpr, BLOCK_N2: gl.constexpr, SPLIT2: gl.constexpr,
                            BLOCK_K: gl.constexpr, STAGES1: gl.constexpr, STAGES2: gl.constexpr,
                            num_warps: gl.constexpr):
        """fused_layer._fused_layer_kernel's grid, counters and scratch; w13_desc over w13 as planes [2E, I, H] in
        [2, BLOCK_N1, BLOCK_K] boxes, w2_desc over w2 as rows [E * H, I] in [BLOCK_N2, BLOCK_K] boxes."""
        tiles1 = I // BLOCK_N1
        items1 = T * TOP_K * tiles1 * SPLIT1
        split1_counts = sync_ptr + 2 + T * TOP_K
        split2_counts = split1_counts + (T * TOP_K * tiles1 if SPLIT1 > 1 else 0)
        item = gl.atomic_add(sync_ptr, 1, sem="relaxed")
        if item < items1:
            _gate_up_item(item, x_ptr, ids_ptr, w13_desc, w13s_ptr, inter_ptr, part1_ptr, sync_ptr, split1_counts,
                          H, I, stride_x, stride_w13se, stride_w13sn, TOP_K, QUANT, ACT, INTER_DTYPE, BLOCK_N1,
                          BLOCK_K, SPLIT1, STAGES1, num_warps)
        else:
            _down_item(item - items1, ids_ptr, rw_ptr, w2_desc, w2s_ptr, inter_ptr, part2_ptr, out_ptr, sync_ptr,
                       split2_counts, T, H, I, stride_w2se, stride_w2sn, stride_out, TOP_K, K_POW2, QUANT,
                       BLOCK_N1, BLOCK_N2, BLOCK_K, SPLIT2, STAGES2, num_warps)


def usable(x: Tensor, w13: Tensor, w2: Tensor, scheme: str, cfg) -> bool:
    """Whether fused_layer may run this kernel for the call (module docstring, Where)."""
    if gluon is None or not x.is_cuda or scheme not in ("none", "fp8-block") or _cuda_properties(x.device).major != 9:
        return False
    if w13.dtype not in _GL or w2.dtype != w13.dtype:
        return False
    _, two_i, h = w13.shape
    i = two_i // 2
    bk = 128 if w13.element_size() == 1 else 64
    return (h % 128 == 0 and i % 128 == 0 and i % cfg.block_n1 == 0 and h % cfg.block_n2 == 0
            and cfg.block_n1 in (64, 128) and cfg.block_n2 in (64, 128) and cfg.num_warps == 4
            and expert_rows(w13) and expert_rows(w2) and w13.stride(2) == 1 and w2.stride(2) == 1
            and (h * w13.element_size()) % 16 == 0 and (i * w2.element_size()) % 16 == 0
            and cfg.num_stages * 2 * cfg.block_n1 * bk * w13.element_size() <= 200 * 1024)  # the gate_up ring


def launch(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: Tensor, w13_scale: Tensor | None, w2: Tensor,
           w2_scale: Tensor | None, scheme: str, activation: int, dtype: torch.dtype, cfg, sync: Tensor, out: Tensor,
           inter: Tensor, part1: Tensor, part2: Tensor) -> None:
    """Run the kernel over fused_layer's buffers (usable() must have said True). activation: common.ACT_CODES'."""
    t, h = x.shape
    k = topk_ids.shape[1]
    e, two_i, _ = w13.shape
    i = two_i // 2
    q = QUANT_CODES[scheme]
    wdt = _GL[w13.dtype]
    bk = 128 if w13.element_size() == 1 else 64
    w13_desc = TensorDescriptor(w13, [2 * e, i, h], [i * w13.stride(1), w13.stride(1), 1], [2, cfg.block_n1, bk],
                                gl.NVMMASharedLayout.get_default_for([2, cfg.block_n1, bk], wdt))
    w2_desc = TensorDescriptor(w2, [e * h, i], [w2.stride(1), 1], [cfg.block_n2, bk],
                               gl.NVMMASharedLayout.get_default_for([cfg.block_n2, bk], wdt))
    s13 = w13_scale if w13_scale is not None else w13
    s2 = w2_scale if w2_scale is not None else w2
    tiles1, tiles2 = t * k * (i // cfg.block_n1), t * (h // cfg.block_n2)
    _fused_wgmma_kernel[(tiles1 * cfg.split1 + tiles2 * cfg.split2,)](
        x, topk_ids, topk_weights, w13_desc, s13, w2_desc, s2, inter, part1, part2, out, sync, t, h, i, x.stride(0),
        s13.stride(0) if q else 0, s13.stride(1) if q else 0, s2.stride(0) if q else 0, s2.stride(1) if q else 0,
        out.stride(0), TOP_K=k, K_POW2=max(2, triton.next_power_of_2(k)), QUANT=q, ACT=activation,
        INTER_DTYPE=_GL[dtype], BLOCK_N1=cfg.block_n1, SPLIT1=cfg.split1, BLOCK_N2=cfg.block_n2, SPLIT2=cfg.split2,
        BLOCK_K=bk, STAGES1=cfg.num_stages, STAGES2=cfg.num_stages, num_warps=cfg.num_warps)
