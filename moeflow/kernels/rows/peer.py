"""A barrier between the GPUs of one node through memory they all map (torch symmetric memory).

The peer-to-peer dispatcher (moeflow/dispatch/alltoall_p2p.py) stores tokens and partial sums straight into
its peers' buffers from its own kernels; this barrier tells every rank when its peers' stores have
landed (and when their buffers are free again). Kernel: _barrier_kernel (the protocol and its tensors: its
docstring); launcher: barrier(). One launch of one program, no host synchronization, capturable in a CUDA graph.
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _now(CLOCK: tl.constexpr):
    """Nanoseconds (the GPU's global timer) with CLOCK, else 0 (the interpreter has no inline PTX:
    its limit counts polls)."""
    if CLOCK:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    else:
        return 0


@triton.jit
def _barrier_kernel(pads_ptr, epoch_ptr, status_ptr, rank, world, limit, CLOCK: tl.constexpr):
    """Rank ``rank`` of ``world`` enters round e = epoch + 1.

    pads [W] int64: the address of each rank's signal pad, int64 [W] in memory every rank maps;
        slot s of rank r's pad holds the last epoch rank s signalled to rank r (zeroed once, before
        the first barrier of any rank)
    epoch [1] int64 on this device: barriers this rank has entered (the kernel counts it up, so a
        replayed graph waits for the right round); int64: it never wraps
    status [1] int64 on this device: the address of an int32 the host can read (pinned, mapped host
        memory): a barrier that waits past ``limit`` writes 1 + the first rank it did not hear from
        there and returns (no hang); the dispatcher raises MF502 from it.
    Round e: store e into slot ``rank`` of every rank's pad (release, system scope: every store this rank made
    before, in earlier kernels too, is visible to the peer first), then wait until every slot of its own pad
    holds >= e (acquire)."""
    e = tl.load(epoch_ptr) + 1
    tl.store(epoch_ptr, e)
    for r in range(world):
        pad = tl.load(pads_ptr + r).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(pad + rank, e, sem="release", scope="sys")
    mine = tl.load(pads_ptr + rank).to(tl.pointer_type(tl.int64))
    start = _now(CLOCK)
    silent = -1
    for r in range(world):
        seen = tl.atomic_add(mine + r, 0, sem="acquire", scope="sys")
        polls = 0
        while (seen < e) & (silent < 0):
            polls += 1
            if CLOCK:
                waited = _now(CLOCK) - start
            else:
                waited = polls
            if waited > limit:
                silent = r
            seen = tl.atomic_add(mine + r, 0, sem="acquire", scope="sys")
    if silent >= 0:
        tl.store(tl.load(status_ptr).to(tl.pointer_type(tl.int32)), silent + 1)


def barrier(pads: Tensor, epoch: Tensor, status: Tensor, rank: int, world: int, timeout_s: float) -> None:
    """Enter the next round (_barrier_kernel): pads [W] int64, epoch [1] int64, status [1] int64, all
    on this device. On CUDA the limit is ``timeout_s`` of the GPU's clock; in the interpreter it is
    ``timeout_s * 1e6`` polls."""
    clock = pads.is_cuda
    limit = int(timeout_s * (1e9 if clock else 1e6))
    _barrier_kernel[(1,)](pads, epoch, status, rank, world, limit, CLOCK=clock, num_warps=1)
