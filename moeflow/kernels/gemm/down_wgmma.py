"""fp8-block down GEMM for Hopper in Gluon: down.py's computation (the same bits) with the scaling overlapped.

    a [R, I] float8_e4m3fn + a_scale [R, I/128] float32 (sorted layout), w2 down_proj [E, H, I] float8_e4m3fn
    + w2_scale [E, H/128, I/128] float32, route_w [R] float32 -> out [R, H] layer dtype (reference: down.down_torch)
Why: fp8-block scales every 128-deep K step (acc += (a_k @ w_k) * s_k); Triton waits for each wgmma before scaling,
so the tensor cores idle. Here step t + 1's wgmma is issued before step t's product is scaled (_down_wgmma_kernel).
GemmConfig.scale_overlap 1 stores from the wgmma register layout, 2 through shared memory in 16-byte stores.
choice.py runs it on Hopper where cannot_run() allows; down_wgmma_persistent.py is its persistent form.
Imported only on a Hopper GPU: CPU runs never load Gluon.
"""
from __future__ import annotations

from functools import lru_cache

from torch import Tensor

from ..common import cdiv, expert_rows, grouped_tile, tma_rows
from .tiles import wgmma_down_fits

try:  # Gluon (triton.experimental.gluon) ships with recent triton (3.6 here); only Hopper GPUs run it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: choice.py then runs no Gluon kernel
    gluon = None


@lru_cache(maxsize=None)
def smem_layout(block: tuple, dtype: str):
    """gl.NVMMASharedLayout.get_default_for(list(block), gl.<dtype>), made once per block shape and dtype name
    ("float8e4nv", "bfloat16", "float16"): on the host it costs a call about 6-15 µs of Python (nested constexpr
    functions), and each launch's descriptors need one or two."""
    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, dtype))

if gluon is not None:
    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _block_counts(meta_ptr, num_experts, BLOCK_M: gl.constexpr, E_POW2: gl.constexpr, num_warps: gl.constexpr):
        """Per expert e (idx, E_POW2 lanes): its rows lo .. hi - 1 from the offsets, and nb = cdiv(rows, BLOCK_M)
        row blocks (0 past num_experts)."""
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        idx = gl.arange(0, E_POW2, layout=lay)
        lo = gl.load(meta_ptr + idx, mask=idx < num_experts, other=0)
        hi = gl.load(meta_ptr + idx + 1, mask=idx < num_experts, other=0)
        return idx, lo, hi, (hi - lo + BLOCK_M - 1) // BLOCK_M

    @gluon.jit
    def _expert_block(pid_m, meta_ptr, num_experts, BLOCK_M: gl.constexpr, E_POW2: gl.constexpr,
                      num_warps: gl.constexpr):
        """common.block_rows for the sorted layout: block pid_m -> (expert, row_start, row_end). Written
        again with explicit layouts: Gluon's arange needs one, so block_rows itself does not compile here
        (common.grouped_tile, scalar code, does: the kernel calls it)."""
        idx, lo, hi, nb = _block_counts(meta_ptr, num_experts, BLOCK_M, E_POW2, num_warps)
        cum = gl.associative_scan(nb, 0, _add)
        expert = gl.sum((cum <= pid_m).to(gl.int32), 0)
        mine = idx == expert
        first_block = gl.sum(gl.where(mine, cum - nb, 0), 0)
        row_end = gl.sum(gl.where(mine, hi, 0), 0)
        row_start = gl.sum(gl.where(mine, lo, 0), 0) + (pid_m - first_block) * BLOCK_M
        row_start = gl.where(expert < num_experts, row_start, row_end)
        return expert, row_start, row_end

    @gluon.jit
    def _load_step(a_desc, w_desc, a_bufs, w_bufs, bars, g, k, a_row, w_row, STAGES: gl.constexpr,
                   BLOCK_K: gl.constexpr, pred):
        """Start TMA loads of K step k of the tile at (a_row, w_row) into the slot of the program's step g
        (g % STAGES; g == k but in the persistent kernel, whose steps run on across tiles). No-op where pred
        is False. bars: (a tiles' barriers, weight tiles' barriers), two allocations (_slot_barriers says why)."""
        slot = g % STAGES
        a_bar = bars[0].index(slot)
        w_bar = bars[1].index(slot)
        mbarrier.expect(a_bar, a_desc.block_type.nbytes, pred=pred)
        mbarrier.expect(w_bar, w_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(a_desc, [a_row, k * BLOCK_K], a_bar, a_bufs.index(slot), pred=pred)
        tma.async_copy_global_to_shared(w_desc, [w_row, k * BLOCK_K], w_bar, w_bufs.index(slot), pred=pred)

    @gluon.jit
    def _load_ahead(a_desc, w_desc, a_bufs, w_bufs, bars, base, tn, n, a_row, w_row, a_row_next, w_row_next,
                    has_next, STAGES: gl.constexpr, BLOCK_K: gl.constexpr):
        """Load the program's step base + tn: step tn of this tile, else step tn - n of the next one (if any)."""
        here = tn < n
        _load_step(a_desc, w_desc, a_bufs, w_bufs, bars, base + tn, gl.where(here, tn, tn - n),
                   gl.where(here, a_row, a_row_next), gl.where(here, w_row, w_row_next), STAGES, BLOCK_K,
                   here | has_next)

    @gluon.jit
    def _mma_step(a_bufs, w_bufs, bars, t, d, STAGES: gl.constexpr):
        """Wait for step t's tiles and start its wgmma into d's registers (d's values unused)."""
        slot = t % STAGES
        for b in gl.static_range(len(bars)):  # a tuple of barrier allocations: every copy into the slot landed
            mbarrier.wait(bars[b].index(slot), (t // STAGES) & 1)
        return warpgroup_mma(a_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), d, use_acc=False,
                             is_async=True)

    @gluon.jit
    def _scaled_add(d, s, acc):
        """acc + d * s[:, None], as an inline asm with side effects so that it stays before the next wgmma."""
        return gl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=r,r,r,r",
                                         [d, gl.broadcast(s[:, None], d)[0], acc], dtype=gl.float32,
                                         is_pure=False, pack=1)

    @gluon.jit
    def _slot_barriers(STAGES: gl.constexpr):
        """Each slot's two mbarriers, one for its activation tile's copy and one for its weight tiles', in two
        allocations, initialized -> (activation barriers, weight barriers). Why two: the compiler puts a CTA
        barrier between two operations on one shared allocation where either writes it, and an expect and a TMA
        copy both write their mbarrier. With one mbarrier a slot a refill (expect, then its copies) took a CTA
        barrier between every two of them (4 for the down's two copies, 5 for the gate_up's three); with these,
        the expects run, then one barrier, then the copies: 3 a refill in all."""
        a_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        w_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(a_bars.index(s), count=1)
            mbarrier.init(w_bars.index(s), count=1)
        fence_async_shared()  # the barriers' initialization seen by the TMA units before they arrive on them
        return a_bars, w_bars

    @gluon.jit
    def _release_barriers(bars, STAGES: gl.constexpr):
        """Invalidate _slot_barriers' mbarriers (bars: the pair it returned) once the K loop is done."""
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars[0].index(s))
            mbarrier.invalidate(bars[1].index(s))

    @gluon.jit
    def _ring(a_desc, w_desc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              STAGES: gl.constexpr):
        """The STAGES shared-memory slots of a and weight tiles and their barriers, initialized -> (a_bufs, w_bufs,
        (a barriers, weight barriers): _slot_barriers)."""
        a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        w_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        return a_bufs, w_bufs, _slot_barriers(STAGES)

    @gluon.jit
    def _weight_scales(ws_ptr, expert, pid_n, H, stride_wse, stride_wsn, BLOCK_N: gl.constexpr):
        """The tile's weight-scale row: one 128-row block of expert's scales (BLOCK_N divides 128)."""
        block = gl.minimum(pid_n * BLOCK_N // 128, (H - 1) // 128)
        return ws_ptr + expert.to(gl.int64) * stride_wse + block * stride_wsn

    @gluon.jit
    def _k_loop(a_desc, w_desc, a_bufs, w_bufs, bars, as_rows, ws_tile, acc, d_a, d_b, base, n, a_row, w_row,
                a_row_next, w_row_next, has_next, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, UNROLL: gl.constexpr):
        """The tile's K loop over the program's steps base .. base + n - 1 (module docstring, How): acc plus
        every step's product scaled by as_rows[r] + t (the rows' group scales) times ws_tile + t (the weight
        block's), loading STAGES steps ahead (into the next tile at (a_row_next, w_row_next) where has_next).
        -> (acc, d_a, d_b): the products' registers carry over to the next tile."""
        for j in range(0, n // UNROLL):
            t = j * UNROLL
            p_a = _mma_step(a_bufs, w_bufs, bars, base + t, d_a, STAGES)
            s_a = gl.load(as_rows + t) * gl.load(ws_tile + t)
            for u in gl.static_range(1, UNROLL):  # step t + u runs while step t + u - 1 is scaled
                p_b = _mma_step(a_bufs, w_bufs, bars, base + t + u, d_b, STAGES)
                s_b = gl.load(as_rows + t + u) * gl.load(ws_tile + t + u)
                d_a = warpgroup_mma_wait(num_outstanding=1, deps=(p_a,))
                acc = _scaled_add(d_a, s_a, acc)
                _load_ahead(a_desc, w_desc, a_bufs, w_bufs, bars, base, t + u - 1 + STAGES, n, a_row, w_row,
                            a_row_next, w_row_next, has_next, STAGES, BLOCK_K)
                p_a, s_a, d_a, p_b, s_b, d_b = p_b, s_b, d_b, p_a, s_a, d_a
            d_a = warpgroup_mma_wait(num_outstanding=0, deps=(p_a,))
            acc = _scaled_add(d_a, s_a, acc)
            _load_ahead(a_desc, w_desc, a_bufs, w_bufs, bars, base, t + UNROLL - 1 + STAGES, n, a_row, w_row,
                        a_row_next, w_row_next, has_next, STAGES, BLOCK_K)
        return acc, d_a, d_b

    @gluon.jit
    def _store_tile(acc, rw_ptr, out_ptr, rows_ld, row_start, row_end, pid_n, H, stride_out, mma: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, num_warps: gl.constexpr,
                    COALESCED_STORE: gl.constexpr):
        """out[rows, cols] = acc * route_w[rows], rows row_start .. row_end - 1 (module docstring, Epilogue)."""
        y = (acc * gl.load(rw_ptr + rows_ld)[:, None]).to(out_ptr.dtype.element_ty)
        if COALESCED_STORE:  # 16 bytes per thread along a row (the wgmma layout stores 4 bytes)
            st: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_N // 8), BLOCK_N // 8], [num_warps, 1], [1, 0])
            y = gl.convert_layout(y, st)
            rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st))
            cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, st))
        else:
            rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
            cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
        gl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y,
                 mask=(rows < row_end)[:, None] & (cols < H)[None, :])

    @gluon.jit(do_not_specialize=["num_blocks_m", "w_rows_per_expert"])
    def _down_wgmma_kernel(a_desc, w_desc, as_ptr, ws_ptr, rw_ptr, out_ptr, meta_ptr,
                           num_experts, num_blocks_m, H, I, w_rows_per_expert,
                           stride_as, stride_wse, stride_wsn, stride_out,
                           E_POW2: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                           UNROLL: gl.constexpr, num_warps: gl.constexpr, COALESCED_STORE: gl.constexpr = False):
        """One program per output tile of the grid's row blocks (programs past the real blocks return).
        a_desc: TMA descriptor over a [R, I], [BLOCK_M, BLOCK_K] boxes (rows past the block's end are read,
        never stored); w_desc: over the weight rows [E * H, I] (expert e's from e * w_rows_per_expert),
        [BLOCK_N, BLOCK_K] boxes. Both zero-fill past I."""
        pid_m, pid_n = grouped_tile(gl.program_id(0), num_blocks_m, gl.cdiv(H, BLOCK_N), GROUP_M)
        expert, row_start, row_end = _expert_block(pid_m, meta_ptr, num_experts, BLOCK_M, E_POW2, num_warps)
        if row_start < row_end:
            mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                          instr_shape=[16, BLOCK_N, 32])
            rows_l: gl.constexpr = gl.SliceLayout(1, mma)
            a_bufs, w_bufs, bars = _ring(a_desc, w_desc, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
            a_row = row_start.to(gl.int32)
            w_row = (expert * w_rows_per_expert + pid_n * BLOCK_N).to(gl.int32)  # rows past H: never stored
            n = gl.cdiv(I, BLOCK_K)
            for s in gl.static_range(STAGES):
                _load_step(a_desc, w_desc, a_bufs, w_bufs, bars, s, s, a_row, w_row, STAGES, BLOCK_K, s < n)
            rows = row_start + gl.arange(0, BLOCK_M, layout=rows_l)
            rows_ld = gl.minimum(rows, row_end - 1)
            as_rows = as_ptr + rows_ld * stride_as  # row r's scale of K group t at as_rows[r] + t (BLOCK_K 128)
            ws_tile = _weight_scales(ws_ptr, expert, pid_n, H, stride_wse, stride_wsn, BLOCK_N)
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
            d_a = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
            d_b = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
            acc, d_a, d_b = _k_loop(a_desc, w_desc, a_bufs, w_bufs, bars, as_rows, ws_tile, acc, d_a, d_b, 0, n, a_row,
                                    w_row, a_row, w_row, False, BLOCK_K, STAGES, UNROLL)
            _release_barriers(bars, STAGES)
            _store_tile(acc, rw_ptr, out_ptr, rows_ld, row_start, row_end, pid_n, H, stride_out, mma, BLOCK_M, BLOCK_N,
                        num_warps, COALESCED_STORE)


def unroll(num_steps: int, most: int = 8, stages: int | None = None) -> int:
    """Steps per loop body: the largest of most .. 1 dividing the K steps, and with ``stages`` (the Gluon
    gate_up) not a multiple of them. A body of a multiple of STAGES steps makes every slot index a
    compile-time constant, and ptxas then keeps each slot's wgmma operand descriptors in registers: the
    gate_up's 128x128 tile with 8 warps spills 280 bytes at 4 stages and 4 steps a body, 600 at 8 steps;
    none at 3 stages and 4 or 8 steps (ptxas, sm_90a)."""
    return next(u for u in range(most, 0, -1) if num_steps % u == 0 and (u == 1 or not stages or u % stages))


def cannot_run(a: Tensor, a_scale: Tensor | None, w2: Tensor, w2_scale: Tensor | None, scheme: str, cfg) -> str | None:
    """Why this kernel cannot run a down call on Hopper (choice.py asks), or None: it needs fp8-block, a tile that
    wgmma_down_fits, experts back to back, TMA-addressable rows of a [R, I] and w2 [E, H, I], unit-stride scales."""
    if scheme != "fp8-block" or a_scale is None or w2_scale is None:
        return f"scheme {scheme} (it runs fp8-block)"
    if not wgmma_down_fits(cfg):
        return f"a {cfg.block_m}x{cfg.block_n}x{cfg.block_k} tile of {cfg.num_warps} warps it does not run"
    if expert_rows(w2) is None or not tma_rows(a, a.stride(0)) or not tma_rows(w2, w2.stride(1)):
        return "operands TMA cannot address (rows not 16-byte aligned, experts not back to back, or TMA off)"
    if a_scale.stride(1) != 1 or w2_scale.stride(2) != 1:
        return "scales not contiguous along K"
    return None


def descriptors(a: Tensor, w2: Tensor, cfg):
    """(a_desc, w_desc, per_expert): TMA descriptors over a [R, I]'s rows and w2 [E, H, I]'s rows [E * H, I] in
    [BLOCK_M or BLOCK_N, BLOCK_K] boxes; per_expert is H, or 0 for an expert stride of 0 (every expert reads the
    same rows). Shared with the persistent form (down_wgmma_persistent.py)."""
    r, i = a.shape
    e, h, _ = w2.shape
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    a_desc = TensorDescriptor(a, [r, i], [a.stride(0), 1], [bm, bk], smem_layout((bm, bk), "float8e4nv"))
    per_expert = expert_rows(w2)
    w_desc = TensorDescriptor(w2, [e * h if per_expert else h, i], [w2.stride(1), 1], [bn, bk],
                              smem_layout((bn, bk), "float8e4nv"))
    return a_desc, w_desc, per_expert


def launch(a: Tensor, a_scale: Tensor, w2: Tensor, w2_scale: Tensor, route_w: Tensor, layout, cfg, out: Tensor) -> None:
    """out [R, H] layer dtype = (a [R, I] fp8 * a_scale [R, I/128]) @ (w2 [E, H, I] fp8 * w2_scale
    [E, H/128, I/128])^T per expert, times route_w [R] float32; one program per tile. cannot_run() must be None."""
    r, i = a.shape
    h = w2.shape[1]
    if r == 0 or h == 0:
        return
    a_desc, w_desc, per_expert = descriptors(a, w2, cfg)
    blocks_m = layout.num_row_blocks(cfg.block_m)
    _down_wgmma_kernel[(blocks_m * cdiv(h, cfg.block_n),)](
        a_desc, w_desc, a_scale, w2_scale, route_w, out, layout.meta, layout.num_experts, blocks_m, h, i, per_expert,
        a_scale.stride(0), w2_scale.stride(0), w2_scale.stride(1), out.stride(0),
        E_POW2=layout.e_pow2, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        STAGES=cfg.num_stages, UNROLL=unroll(cdiv(i, cfg.block_k)), num_warps=cfg.num_warps,
        COALESCED_STORE=cfg.scale_overlap == 2)
