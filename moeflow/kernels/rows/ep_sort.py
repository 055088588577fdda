"""Received token copies grouped by local expert: the sort of dispatch/_ep_rows.sorted_batch (and of
the local dispatcher's mid-sized batches) in Triton.

Launcher: sort_copies_by_expert (shapes, sentinels, method: its docstring). Kernels: _whole_sort_kernel (small
batches: one program), else _segment_hist_kernel, (_segment_scan_kernel,) _segment_place_kernel.
Torch reference: dispatch/_ep_reference.sort_copies_by_expert_torch (a stable argsort of
``where(ids >= 0, ids, E_local)`` in copy order, its first n): the same values, bit for bit.
One, two or three launches, no host synchronization.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .align import quantize_token_part, token_quant_launch
from ..common import cdiv, next_pow2, pdl, pdl_start


@triton.jit
def _segment_ids(ids_ptr, s, num_copies, stride_ids, valid_ptr, TOP_K: tl.constexpr, SEG: tl.constexpr,
                 VALID: tl.constexpr):
    """The ids of segment s's copies j = s * SEG .. (copy j: row j // TOP_K, column j % TOP_K), -1 past num_copies
    and, VALID, for the rows from valid_ptr[0] (int64) on (a padded call's padding tokens: routed to no expert)."""
    j = s.to(tl.int64) * SEG + tl.arange(0, SEG)
    ok = j < num_copies
    if VALID:
        ok = ok & (j // TOP_K < tl.load(valid_ptr))
    return tl.load(ids_ptr + (j // TOP_K) * stride_ids + j % TOP_K, mask=ok, other=-1)


@triton.jit
def _segment_hist_kernel(ids_ptr, hist_ptr, num_copies, e_local, stride_ids, num_segs, valid_ptr,
                         x_ptr, xq_ptr, xs_ptr, H, stride_x, stride_xq, stride_xs, num_tokens,
                         TOP_K: tl.constexpr, SEG: tl.constexpr, BINS: tl.constexpr, QUANT_X: tl.constexpr = 0,
                         BLOCK_H: tl.constexpr = 128, ROUND_IN_FP32: tl.constexpr = False, QROWS: tl.constexpr = 1,
                         VALID: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program s < num_segs: hist[s, key] over the copies of segment s (key: the id, E_local where it
    is < 0). Programs past them (QUANT_X, the local dispatcher's FP8 layers): part s - num_segs of the
    tokens' quantization (align.quantize_token_part)."""
    pdl_start(PDL)
    s = tl.program_id(0)
    if s < num_segs:
        ids = _segment_ids(ids_ptr, s, num_copies, stride_ids, valid_ptr, TOP_K, SEG, VALID)
        ok = s.to(tl.int64) * SEG + tl.arange(0, SEG) < num_copies
        key = tl.where(ids >= 0, ids, e_local)
        tl.store(hist_ptr + s * BINS + tl.arange(0, BINS), tl.histogram(key, BINS, mask=ok))
    else:
        quantize_token_part(x_ptr, xq_ptr, xs_ptr, s - num_segs, H, stride_x, stride_xq, stride_xs, num_tokens,
                            QUANT_X, BLOCK_H, ROUND_IN_FP32, QROWS)


@triton.jit
def _segment_scan_kernel(hist_ptr, before_ptr, totals_ptr, num_segs, BINS: tl.constexpr, KB: tl.constexpr,
                         S_POW2: tl.constexpr, PDL: tl.constexpr = False):
    """Program p, keys p*KB .. p*KB + KB - 1: before[s, key] = copies of key in segments before s, totals[key]
    = in all of them (hist, before [num_segs, BINS] int32, totals [BINS] int32)."""
    pdl_start(PDL)
    keys = tl.program_id(0) * KB + tl.arange(0, KB)
    segs = tl.arange(0, S_POW2)
    ok = (segs < num_segs)[:, None]
    cells = segs[:, None] * BINS + keys[None, :]
    tile = tl.load(hist_ptr + cells, mask=ok, other=0)
    tl.store(before_ptr + cells, tl.cumsum(tile, axis=0) - tile, mask=ok)
    tl.store(totals_ptr + keys, tl.sum(tile, axis=0))


@triton.jit
def _place(ids_ptr, w_ptr, counts_ptr, offsets_ptr, source_ptr, sorted_w_ptr, pos_ptr, s, mine, total, before,
           num_copies, n, e_local, stride_ids, stride_w, valid_ptr, TOP_K: tl.constexpr, SEG: tl.constexpr,
           BINS: tl.constexpr, VALID: tl.constexpr):
    """Segment s's copies sorted by (key, j) in registers and placed: copy i of the sorted segment goes to
    offsets[key] + before[key] + (i - first index of key in the segment); mine, total, before [BINS] int64: the
    segment's, all segments' and earlier segments' copies of each key. Segment 0 also writes offsets and counts.
    The ids are loaded here, after the prefix sums (loaded before them, 8192 copies at 16 warps spill)."""
    offsets = tl.cumsum(total, axis=0) - total
    start = offsets + before - (tl.cumsum(mine, axis=0) - mine)  # + sorted index = position
    bins = tl.arange(0, BINS)
    if s == 0:
        tl.store(offsets_ptr + bins, offsets, mask=bins <= e_local)
        tl.store(counts_ptr + bins, total.to(tl.int32), mask=bins < e_local)
    lane = tl.arange(0, SEG)
    ok = s.to(tl.int64) * SEG + lane < num_copies
    ids = _segment_ids(ids_ptr, s, num_copies, stride_ids, valid_ptr, TOP_K, SEG, VALID)
    key = tl.where(ok, tl.where(ids >= 0, ids, e_local), BINS)  # lanes past the end sort last
    order = tl.sort(key * SEG + lane, 0)  # by key, then copy order: stable
    skey = order // SEG
    real = skey < BINS
    pos = tl.gather(start, tl.minimum(skey, BINS - 1), 0) + lane
    sj = s.to(tl.int64) * SEG + order % SEG
    kept = real & (skey < e_local) & (pos < n)
    tl.store(pos_ptr + sj, tl.where(kept, pos, -1), mask=real)
    r = sj // TOP_K
    tl.store(source_ptr + pos, r, mask=kept)
    tl.store(sorted_w_ptr + pos, tl.load(w_ptr + r * stride_w + sj % TOP_K, mask=kept), mask=kept)


@triton.jit
def _segment_place_kernel(ids_ptr, w_ptr, hist_ptr, counts_ptr, offsets_ptr, source_ptr, sorted_w_ptr, pos_ptr,
                          before_ptr, totals_ptr, num_copies, n, e_local, num_segs, stride_ids, stride_w, valid_ptr,
                          TOP_K: tl.constexpr, SEG: tl.constexpr, BINS: tl.constexpr, S_POW2: tl.constexpr,
                          SCANNED: tl.constexpr = False, VALID: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program s: its copies placed (_place). The counts of earlier segments come from the whole histogram table
    (S_POW2 rows), or SCANNED from _segment_scan_kernel's before and totals (one row each; before_ptr, totals_ptr
    unused otherwise)."""
    pdl_start(PDL)
    s = tl.program_id(0)
    bins = tl.arange(0, BINS)
    mine = tl.load(hist_ptr + s * BINS + bins).to(tl.int64)
    if SCANNED:
        total = tl.load(totals_ptr + bins).to(tl.int64)
        before = tl.load(before_ptr + s * BINS + bins).to(tl.int64)
    else:
        segs = tl.arange(0, S_POW2)
        table = tl.load(hist_ptr + segs[:, None] * BINS + bins[None, :], mask=(segs < num_segs)[:, None], other=0)
        total = tl.sum(table, axis=0).to(tl.int64)  # [BINS] copies of each key
        before = tl.sum(tl.where((segs < s)[:, None], table, 0), axis=0).to(tl.int64)
    _place(ids_ptr, w_ptr, counts_ptr, offsets_ptr, source_ptr, sorted_w_ptr, pos_ptr, s, mine, total, before,
           num_copies, n, e_local, stride_ids, stride_w, valid_ptr, TOP_K, SEG, BINS, VALID)


@triton.jit
def _whole_sort_kernel(ids_ptr, w_ptr, counts_ptr, offsets_ptr, source_ptr, sorted_w_ptr, pos_ptr, num_copies, n,
                       e_local, stride_ids, stride_w, valid_ptr,
                       x_ptr, xq_ptr, xs_ptr, H, stride_x, stride_xq, stride_xs, num_tokens,
                       TOP_K: tl.constexpr, SEG: tl.constexpr, BINS: tl.constexpr, QUANT_X: tl.constexpr = 0,
                       BLOCK_H: tl.constexpr = 128, ROUND_IN_FP32: tl.constexpr = False, QROWS: tl.constexpr = 1,
                       VALID: tl.constexpr = False, PDL: tl.constexpr = False):
    """One launch (whole_sort): program 0 sorts every copy as one segment of SEG >= num_copies, its histogram taken
    in registers; programs past it (QUANT_X) quantize part pid - 1 of the tokens (align.quantize_token_part)."""
    pdl_start(PDL)
    s = tl.program_id(0)
    if s == 0:
        ids = _segment_ids(ids_ptr, s, num_copies, stride_ids, valid_ptr, TOP_K, SEG, VALID)
        key = tl.where(ids >= 0, ids, e_local)
        ok = tl.arange(0, SEG) < num_copies
        mine = tl.histogram(key, BINS, mask=ok).to(tl.int64)
        _place(ids_ptr, w_ptr, counts_ptr, offsets_ptr, source_ptr, sorted_w_ptr, pos_ptr, s, mine, mine,
               tl.zeros((BINS,), dtype=tl.int64), num_copies, n, e_local, stride_ids, stride_w, valid_ptr, TOP_K, SEG,
               BINS, VALID)
    else:
        quantize_token_part(x_ptr, xq_ptr, xs_ptr, s - 1, H, stride_x, stride_xq, stride_xs, num_tokens,
                            QUANT_X, BLOCK_H, ROUND_IN_FP32, QROWS)


_SEGMENT_TABLE = 8192  # most (segment, key) histogram cells one place program loads (the one-table form)
_TABLE_SEG = 512  # longest segments the one-table form takes; past them the scanned form
_SCAN_SEG = 256  # copies a segment in the scanned form
_SCAN_CELLS = 8192  # most (segment, key) cells one scan program loads


def segment_size(copies: int, bins: int) -> tuple[int, bool]:
    """-> (copies a segment, scanned) for sort_copies_by_expert. Two launches while every place program can load
    the whole histogram table (at most _SEGMENT_TABLE cells) with segments of _TABLE_SEG copies or fewer; past that,
    segments of _SCAN_SEG copies (more where one key's column would pass _SCAN_CELLS segments) with a scan launch
    between the two: the third launch costs more than it saves while segments are at most 512 copies long, and
    less beyond (one table read by every program grows as segments squared)."""
    seg = max(256, next_pow2(cdiv(copies, max(1, _SEGMENT_TABLE // bins))))
    seg = min(seg, max(256, next_pow2(copies)))
    if seg <= _TABLE_SEG:
        return seg, False
    return max(_SCAN_SEG, next_pow2(cdiv(copies, _SCAN_CELLS))), True


def sort_pays(copies: int, e_local: int) -> bool:
    """Whether to run sort_copies_by_expert rather than torch's sort for this many copies over E_local experts:
    up to _SORT_COPIES copies, where it is the faster of the two (for 8 to 256 experts). e_local: unused, since the
    scanned form (segment_size) keeps every size's segments short."""
    return copies <= _SORT_COPIES


_SORT_COPIES = 1 << 19
_WHOLE_COPIES = 256  # the most copies whole_sort takes (one program sorts them all in registers)


def whole_sort(copies: int) -> bool:
    """Whether sort_copies_by_expert sorts ``copies`` in one launch, one program sorting every copy in registers
    (_whole_sort_kernel), instead of the segment launches: up to _WHOLE_COPIES; past that one program's sort takes
    longer than the segment launches."""
    return copies <= _WHOLE_COPIES


def _whole_warps(seg: int) -> int:
    """Warps of the whole sort's launch: 8 elements a thread up to 16 warps."""
    return max(4, min(16, seg // 256))


def sort_copies_by_expert(ids: Tensor, weights: Tensor, e_local: int, n: int, padded: bool = False,
                          x: Tensor | None = None, scheme: str = "none", valid: Tensor | None = None
                          ) -> tuple[Tensor, ...]:
    """ids [R, K] int32 (may be a strided view: row stride != K, columns contiguous): local expert of
    each copy, or -1 where the copy is not for this rank; weights [R, K] float32 (same kind of view);
    n: the number of copies with ids >= 0 (known on the host), or with ``padded`` an upper bound of
    it: positions past the copies then hold source 0 and weight 0 (two more fills).
    ids must lie in -1 .. e_local-1.
    -> (source [n] int64: received row of each sorted copy (= j // K for copy j),
        sorted_weights [n] float32,
        counts [E_local] int32,
        offsets [E_local + 1] int64 (exclusive prefix of counts, offsets[E_local] == n),
        copy_pos [R * K] int64: the sorted position of copy j, -1 for copies that are not here)
    Within one expert, copies keep j order (stable). One to three launches, no host synchronization. Up to
    _WHOLE_COPIES copies (whole_sort) one program sorts them all in registers. Larger batches: a histogram of keys
    per segment of copies; then each segment sorts its (key, j) pairs in registers and places them from the
    histograms' prefix sums, so the work does not grow with E_local. The prefix sums: where the whole table of
    (segment, key) counts is small (segment_size), every place program reads all of it (two launches); past that
    a scan launch between the two writes each segment's counts of earlier segments and the totals, and a place
    program reads one row of each, so segments stay _SCAN_SEG copies long however many there are.
    x [R, H] (layer dtype, unit column stride) with scheme "fp8-tensor", "fp8-channel" or "fp8-block": the first
    launch also quantizes the tokens, and the tuple gains (xq [R, H] float8_e4m3fn, xs [R, G]
    float32), bit for bit rows/quant.quantize_activation(x, scheme) (the local dispatcher).
    valid: [1] int64 on the device, or None: the copies of rows valid[0] .. R-1 are sorted as ids -1 (a bucketed call's
    padding tokens, moeflow.graph_buckets; the local dispatcher's dropping form), without reading those ids.
    """
    if ids.dim() != 2 or ids.shape != weights.shape or any(t.shape[1] > 1 and t.stride(1) != 1 for t in (ids, weights)):
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must be [R, K] views "
                         "with contiguous columns")
    if ids.dtype != torch.int32 or weights.dtype != torch.float32:
        raise ValueError(f"ids must be int32 and weights float32, got {ids.dtype} and {weights.dtype}")
    if e_local < 1:
        raise ValueError(f"e_local must be >= 1, got {e_local}")
    r, k = ids.shape
    copies = r * k
    dev = ids.device
    bins = next_pow2(e_local + 1)
    fresh = torch.zeros if padded else torch.empty
    source = fresh(n, dtype=torch.int64, device=dev)
    sorted_w = fresh(n, dtype=torch.float32, device=dev)
    counts = torch.empty(e_local, dtype=torch.int32, device=dev)
    offsets = torch.empty(e_local + 1, dtype=torch.int64, device=dev)
    copy_pos = torch.empty(copies, dtype=torch.int64, device=dev)
    parts, quant_args, quant_consts, quantized = token_quant_launch(x, scheme, r, counts)
    valid_arg, has_valid = (valid, True) if valid is not None else (ids, False)  # ids: a pointer never read
    if whole_sort(copies):
        whole = max(16, next_pow2(copies))
        _whole_sort_kernel[(1 + parts,)](ids, weights, counts, offsets, source, sorted_w, copy_pos, copies, n, e_local,
                                         ids.stride(0), weights.stride(0), valid_arg, *quant_args, TOP_K=k, SEG=whole,
                                         BINS=bins, **quant_consts, VALID=has_valid, num_warps=_whole_warps(whole),
                                         **pdl(dev))
        return (source, sorted_w, counts, offsets, copy_pos, *quantized)
    seg, scanned = segment_size(copies, bins)
    segs = max(1, cdiv(copies, seg))
    warps = min(16, max(4, seg // 256))  # the in-register sort: 8192 copies spill at 8 warps (ptxas)
    hist = torch.empty((segs, bins), dtype=torch.int32, device=dev)
    _segment_hist_kernel[(segs + parts,)](ids, hist, copies, e_local, ids.stride(0), segs, valid_arg, *quant_args,
                                          TOP_K=k, SEG=seg, BINS=bins, **quant_consts, VALID=has_valid,
                                          num_warps=warps, **pdl(dev))
    s_pow2 = next_pow2(segs)
    before, totals = hist, hist  # unused by the one-table form
    if scanned:
        before = torch.empty_like(hist)
        totals = torch.empty(bins, dtype=torch.int32, device=dev)
        kb = max(1, min(bins, _SCAN_CELLS // s_pow2))
        scan_warps = max(4, min(16, kb * s_pow2 // 512))  # 8192 cells spill at 8 warps (ptxas)
        _segment_scan_kernel[(bins // kb,)](hist, before, totals, segs, BINS=bins, KB=kb, S_POW2=s_pow2,
                                            num_warps=scan_warps, **pdl(dev))
    _segment_place_kernel[(segs,)](ids, weights, hist, counts, offsets, source, sorted_w, copy_pos, before, totals,
                                   copies, n, e_local, segs, ids.stride(0), weights.stride(0), valid_arg,
                                   TOP_K=k, SEG=seg, BINS=bins, S_POW2=s_pow2, SCANNED=scanned, VALID=has_valid,
                                   num_warps=warps, **pdl(dev))
    return (source, sorted_w, counts, offsets, copy_pos, *quantized)
