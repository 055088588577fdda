"""Experiment (not in the library: measured slower, benchmarks/results/decode_prefetch_2026-11-30_h200.md):
L2 prefetch of the routed experts' weights, for decode-sized batches.

    ids [n] int32: the batch's token copies' experts (n = T*K, at most MAX_COPIES)
    parts: up to four (tensor, bytes per expert to prefetch) pairs, each tensor [E, ...] with expert
    e's bytes contiguous at e * stride(0) elements (gate_up_proj, its scales, down_proj, its scales)
Program p asks the L2 for bytes p * CHUNK .. (p + 1) * CHUNK - 1 of each part of each distinct expert in
ids (MODE 1: cp.async.bulk.prefetch.L2; MODE 2: prefetch.global.L2 per line; nothing waited for), then ends.

Why: in a decode step the GEMMs stream the routed experts' weights from HBM, but they start only once
routing and the sort have run (~4-6 µs on H200), and meanwhile HBM is idle. Launched right after the
router, this kernel starts that stream during the sort; the GEMMs then find part of their weights in L2.
How much: ``PrefetchPlan`` keeps the prefetched bytes of all experts within a budget (a fraction of L2), taking
each expert's parts in the order the layer reads them (gate_up before down), so that nothing is evicted
before it is read.
Reference: ``prefetch_ranges_torch`` lists the (part, expert, byte offset, size) requests; record=True
(MODE 0) makes the kernel write its requests instead of issuing them (how the CPU interpreter checks it:
TRITON_INTERPRET=1, then compare the recorded set with the reference).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from moeflow.kernels.common import interpreting, pdl, pdl_start

MAX_COPIES = 128  # token copies one program compares pairwise to find the distinct experts
CHUNK = 32768  # bytes per request: a program's share of one part of one expert
MAX_PARTS = 4


@triton.jit
def _issue(base, ids, first, off_e, stride_e, nbytes, rec_ptr, j: tl.constexpr, BLOCK: tl.constexpr,
           CHUNK: tl.constexpr, MODE: tl.constexpr):
    """Part j's request of this program for each distinct expert: bytes off_e .. off_e + size - 1.
    MODE 0: record (offset, size); 1: one bulk L2 prefetch (the TMA unit); 2: prefetch.global.L2 per
    128-byte line (the load/store units)."""
    size = tl.minimum(nbytes - off_e, CHUNK)
    on = first & (size > 0)
    offset = ids.to(tl.int64) * stride_e + off_e
    if MODE == 0:
        i = tl.arange(0, BLOCK)
        slot = rec_ptr + ((tl.program_id(0) * 4 + j) * BLOCK + i) * 2
        tl.store(slot, tl.where(on, offset, 0))
        tl.store(slot + 1, tl.where(on, size, 0).to(tl.int64))
    elif MODE == 1:
        addr = (base.to(tl.pointer_type(tl.int8)) + offset).to(tl.int64)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r,r", [addr, size.to(tl.int32), on.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        line = tl.arange(0, CHUNK // 128) * 128
        ok = on[:, None] & (line[None, :] < size[:, None])
        addr = (base.to(tl.pointer_type(tl.int8)) + offset[:, None] + line[None, :]).to(tl.int64)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [addr, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(ids_ptr, num_copies, p0, s0, b0, p1, s1, b1, p2, s2, b2, p3, s3, b3, rec_ptr,
                     BLOCK: tl.constexpr, CHUNK: tl.constexpr, MODE: tl.constexpr, PDL: tl.constexpr = False):
    """s_j: part j's bytes from one expert to the next; b_j: its bytes to prefetch per expert (0: none)."""
    pdl_start(PDL)
    i = tl.arange(0, BLOCK)
    ok = i < num_copies
    ids = tl.load(ids_ptr + i, mask=ok, other=-1)
    earlier_same = (ids[None, :] == ids[:, None]) & (i[None, :] < i[:, None])
    first = ok & (tl.sum(earlier_same.to(tl.int32), axis=1) == 0)
    off_e = tl.program_id(0).to(tl.int64) * CHUNK
    _issue(p0, ids, first, off_e, s0, b0, rec_ptr, 0, BLOCK, CHUNK, MODE)
    _issue(p1, ids, first, off_e, s1, b1, rec_ptr, 1, BLOCK, CHUNK, MODE)
    _issue(p2, ids, first, off_e, s2, b2, rec_ptr, 2, BLOCK, CHUNK, MODE)
    _issue(p3, ids, first, off_e, s3, b3, rec_ptr, 3, BLOCK, CHUNK, MODE)


@dataclass(frozen=True)
class PrefetchPlan:
    """What to prefetch per routed expert: parts ((tensor, bytes per expert), ...) in the order the
    layer reads them, each within a budget of ``budget`` bytes over all experts of a batch."""
    parts: tuple
    budget: int

    def bytes_per_expert(self, copies: int, num_experts: int) -> list[int]:
        """Bytes of each part to prefetch per expert, for a batch of ``copies`` token copies: the
        parts' prefixes, in order, within budget / (the most distinct experts it can route to),
        rounded down to 16 bytes (the requests' granule)."""
        left = self.budget // max(1, min(copies, num_experts))
        out = []
        for t, n in self.parts:
            take = min(n, left) // 16 * 16
            out.append(take)
            left -= take
        return out


def expert_parts(tensors) -> tuple:
    """(tensor, bytes per expert) of each given [E, ...] tensor whose experts are contiguous blocks
    (None entries and tensors laid out otherwise are left out)."""
    parts = []
    for t in tensors:
        if t is None or t.dim() < 2 or not t[0].is_contiguous() or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            continue
        parts.append((t, t[0].numel() * t.element_size()))
    return tuple(parts[:MAX_PARTS])


def prefetch_experts(ids: Tensor, plan: PrefetchPlan, num_experts: int, record: bool = False, mode: int = 1,
                     chunk: int = CHUNK, warps: int = 1) -> Tensor | None:
    """Launch the prefetch of the experts in ids [T, K] (or [n]) int32 by ``plan``. No host
    synchronization; nothing is written (record=True: returns the requests instead, as
    [programs, 4, BLOCK, 2] int64 (byte offset in the part, size), size 0 where none is issued)."""
    ids = ids.reshape(-1)
    n = ids.numel()
    if n == 0 or n > MAX_COPIES:
        return None
    take = plan.bytes_per_expert(n, num_experts)
    grid = triton.cdiv(max(take, default=0), chunk)
    if grid == 0:
        return None
    block = max(32, triton.next_power_of_2(n))
    args = []
    for j in range(MAX_PARTS):
        if j < len(plan.parts):
            t = plan.parts[j][0]
            args += [t, t.stride(0) * t.element_size(), take[j]]
        else:
            args += [ids, 0, 0]
    rec = torch.zeros((grid, MAX_PARTS, block, 2) if record else (1,), dtype=torch.int64, device=ids.device)
    _prefetch_kernel[(grid,)](ids.to(torch.int32), n, *args, rec, BLOCK=block, CHUNK=chunk, MODE=0 if record else mode,
                              num_warps=warps, **(pdl(ids.device) if not interpreting() else {}))
    return rec if record else None


def prefetch_ranges_torch(ids: Tensor, plan: PrefetchPlan, num_experts: int) -> set:
    """Reference: {(part, expert, byte offset, size)} of every request prefetch_experts issues."""
    flat = ids.reshape(-1).tolist()
    take = plan.bytes_per_expert(len(flat), num_experts)
    out = set()
    for j, nbytes in enumerate(take):
        for e in dict.fromkeys(flat):
            for lo in range(0, nbytes, CHUNK):
                out.add((j, e, lo, min(CHUNK, nbytes - lo)))
    return out
