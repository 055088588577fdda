"""Experiment: a warp-specialized, persistent down GEMM in Gluon for Hopper, bf16/fp16 (no scales).

    a [R, I] (sorted layout, rows in order), w2 down_proj [E, H, I], route_w [R] float32 -> out [R, H],
    as kernels/down.py (reference: down.down_torch).
Partitions of each program (one program per SM, tiles p, p + P, ... of the real row blocks in grouped order):
  - loader (1 warp): TMA loads of every K step of the program's tiles into a ring of STAGES slots, in order;
    slot g % STAGES of the program's step g, waiting for the slot to be released first;
  - two consumer warpgroups (the default partition, 4 warps, and a 4-warp worker): consumer c takes the
    program's tiles j = c, c + 2, ...; wgmma over the ring's steps of its tile, one in flight, releasing each
    step's slot once the wgmma after it is issued and it is done; then the epilogue (route weight, store).
Since the ring is filled in tile order, one consumer's K loop runs while the other runs its epilogue
(ping-pong), and the loader runs ahead into the next tile while a tile's last steps compute.
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from moeflow.kernels.common import grouped_tile, num_sms, expert_rows
import torch

_GL = {"torch.bfloat16": gl.bfloat16, "torch.float16": gl.float16}


@gluon.jit
def _tile(j, pid, num_programs, blocks_m, num_pid_n, blk_ptr, blk_stride, w_rows_per_expert, BLOCK_N: gl.constexpr,
          GROUP_M: gl.constexpr):
    """The program's j-th tile -> (expert, row_start, row_end, pid_n, weight row), from the block table
    blk_ptr [3, blk_stride] int32 (expert, first row, end row of each row block)."""
    tile = pid + j * num_programs
    pid_m, pid_n = grouped_tile(tile, blocks_m, num_pid_n, GROUP_M)
    expert = gl.load(blk_ptr + pid_m)
    row_start = gl.load(blk_ptr + blk_stride + pid_m)
    row_end = gl.load(blk_ptr + 2 * blk_stride + pid_m)
    return expert, row_start, row_end, pid_n, expert * w_rows_per_expert + pid_n * BLOCK_N


@gluon.jit
def _my_tiles(pid, num_programs, nblk_ptr, H, BLOCK_N: gl.constexpr):
    blocks_m = gl.load(nblk_ptr)
    num_pid_n = gl.cdiv(H, BLOCK_N)
    tiles = blocks_m * num_pid_n
    return blocks_m, num_pid_n, gl.where(pid < tiles, (tiles - pid + num_programs - 1) // num_programs, 0)


@gluon.jit
def _loader(p, C: gl.constexpr, E_POW2: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, MODE: gl.constexpr = 0):
    (a_desc, w_desc, a_bufs, w_bufs, ready, empty, turn, rw_ptr, out_ptr, blk_ptr, nblk_ptr, blk_stride, num_programs,
     H, I, w_rows_per_expert, stride_out) = p
    pid = gl.program_id(0)
    blocks_m, num_pid_n, my_tiles = _my_tiles(pid, num_programs, nblk_ptr, H, BLOCK_N)
    n = gl.cdiv(I, BLOCK_K)
    for j in range(my_tiles):
        expert, row_start, row_end, pid_n, w_row = _tile(j, pid, num_programs, blocks_m, num_pid_n, blk_ptr,
                                                         blk_stride, w_rows_per_expert, BLOCK_N, GROUP_M)
        a_row = row_start
        for k in range(n):
            g = j * n + k
            slot = g % STAGES
            mbarrier.wait(empty.index(slot), ((g // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [a_row, k * BLOCK_K], bar, a_bufs.index(slot))
            tma.async_copy_global_to_shared(w_desc, [w_row, k * BLOCK_K], bar, w_bufs.index(slot))


@gluon.jit
def _consume(p, c: gl.constexpr, E_POW2: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, MODE: gl.constexpr = 0):
    (a_desc, w_desc, a_bufs, w_bufs, ready, empty, turn, rw_ptr, out_ptr, blk_ptr, nblk_ptr, blk_stride, num_programs,
     H, I, w_rows_per_expert, stride_out) = p
    pid = gl.program_id(0)
    blocks_m, num_pid_n, my_tiles = _my_tiles(pid, num_programs, nblk_ptr, H, BLOCK_N)
    n = gl.cdiv(I, BLOCK_K)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    for j in range(c, my_tiles, 2):
        expert, row_start, row_end, pid_n, w_row = _tile(j, pid, num_programs, blocks_m, num_pid_n, blk_ptr,
                                                         blk_stride, w_rows_per_expert, BLOCK_N, GROUP_M)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
        # my turn: the other consumer has issued its last tile's K loop (ping-pong; and no wait below can then be
        # more than one phase ahead of its slot's barrier, which a parity wait could not tell apart)
        i = j // 2
        mbarrier.wait(turn.index(c), (i - c + 1) & 1, pred=(c == 1) | (i > 0))
        g0 = j * n
        for k in range(n):
            g = g0 + k
            slot = g % STAGES
            mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
            if MODE != 2:
                tok = warpgroup_mma(a_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(tok,))
            mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), count=1, pred=k > 0)  # step g - 1's slot
        mbarrier.arrive(turn.index(1 - c), count=1)  # the other consumer's turn
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((g0 + n - 1) % STAGES), count=1)
        rows_ld = gl.minimum(row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma)), row_end - 1)
        y = (acc * gl.load(rw_ptr + rows_ld)[:, None]).to(out_ptr.dtype.element_ty)
        if MODE == 3:
            rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
            cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
            gl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y,
                     mask=(rows < row_end)[:, None] & (cols < H)[None, :])
        elif MODE != 1:
            st: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_N // 8), BLOCK_N // 8], [4, 1], [1, 0])
            y = gl.convert_layout(y, st)  # 16-byte stores
            rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st))
            cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, st))
            gl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y,
                     mask=(rows < row_end)[:, None] & (cols < H)[None, :])


@gluon.jit
def _consumer0(p, C: gl.constexpr, E_POW2: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, MODE: gl.constexpr):
    _consume(p, 0, E_POW2, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, MODE)


@gluon.jit
def _consumer1(p, C: gl.constexpr, E_POW2: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, MODE: gl.constexpr):
    _consume(p, 1, E_POW2, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, MODE)


@gluon.jit(do_not_specialize=["num_programs", "w_rows_per_expert"])
def ws_down_kernel(a_desc, w_desc, rw_ptr, out_ptr, blk_ptr, nblk_ptr, blk_stride, num_programs, H, I,
                   w_rows_per_expert,
                   stride_out, E_POW2: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                   LOADER_WARPS: gl.constexpr = 1, LOADER_REGS: gl.constexpr = 24, MODE: gl.constexpr = 0):
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()
    p = (a_desc, w_desc, a_bufs, w_bufs, ready, empty, turn, rw_ptr, out_ptr, blk_ptr, nblk_ptr, blk_stride,
         num_programs, H, I, w_rows_per_expert, stride_out)
    # the 4-warp worker first: it takes warps 4-7, a whole warpgroup as wgmma needs (the loader then warp 8)
    gl.warp_specialize([(_consumer0, (p, 0, E_POW2, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, MODE)),
                        (_consumer1, (p, 1, E_POW2, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, MODE)),
                        (_loader, (p, 0, E_POW2, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, MODE))],
                       [4, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])


def ws_down(a, w2, route_w, layout, out, block_m=128, block_n=128, block_k=64, stages=4, group_m=8,
            programs_per_sm=1, consumer_regs=232, loader_regs=24, maxnreg=168, mode=0, table=None, loader_warps=1):
    r, i = a.shape
    e, h, _ = w2.shape
    if r == 0:
        return out
    dt = _GL[str(a.dtype)]
    a_desc = TensorDescriptor(a, [r, i], [a.stride(0), 1], [block_m, block_k],
                              gl.NVMMASharedLayout.get_default_for([block_m, block_k], dt))
    per_expert = expert_rows(w2)
    w_desc = TensorDescriptor(w2, [e * h, i], [w2.stride(1), 1], [block_n, block_k],
                              gl.NVMMASharedLayout.get_default_for([block_n, block_k], dt))
    tiles = layout.num_row_blocks(block_m) * triton.cdiv(h, block_n)
    programs = min(programs_per_sm * num_sms(a.device), tiles)
    blk, nblk = table if table is not None else block_table(layout, block_m)
    ws_down_kernel[(programs,)](a_desc, w_desc, route_w, out, blk, nblk, blk.shape[1], programs, h, i,
                                per_expert, out.stride(0), E_POW2=layout.e_pow2, BLOCK_M=block_m, BLOCK_N=block_n,
                                BLOCK_K=block_k, GROUP_M=group_m, STAGES=stages, CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs, MODE=mode, LOADER_WARPS=loader_warps,
                                num_warps=4, maxnreg=maxnreg)
    return out


def block_table(layout, block_m):
    """Sorted layout -> (blk [3, B] int32: expert, first row, end row of row block b, B = the host bound of row
    blocks; nblk [1] int32: the real row blocks), in torch on the device (no host synchronization)."""
    off = layout.meta
    nb = (off[1:] - off[:-1] + block_m - 1) // block_m
    cum = torch.cumsum(nb, 0)
    b = torch.arange(layout.num_row_blocks(block_m), device=off.device)
    e = torch.searchsorted(cum, b, right=True).clamp_(max=layout.num_experts - 1)
    start = off[e] + (b - (cum[e] - nb[e])) * block_m
    return torch.stack([e, start, off[e + 1]]).to(torch.int32).contiguous(), cum[-1:].to(torch.int32)
