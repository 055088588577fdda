"""Dynamic FP8 activation quantization of flat rows (the input of a GEMM), as quant/*.py define it.

    fp8-block   : scale [R, ceil(K/128)], one per 128 values of a row      (quantize_groups: 1 kernel)
    fp8-channel : scale [R, 1], the row's amax                             (row_amax, then quantize_with_amax)
    fp8-tensor  : scale [R, 1], all equal: the amax over the *valid* rows   (the same; past AMAX_FOLD_ROWS rows a
                  torch max between them)
Entry: quantize_rows (kernels _row_amax_kernel, _quant_kernel); torch reference: quantize_rows_torch.
gather_rows / scatter_rows (_gather_kernel, _scatter_kernel): rows (any dtype) and their scales by index, or by the
inverse map, in one launch (reference: torch indexing); the TMA gate_up kernels read rows in order from such a copy.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...quant import FP8_DTYPE, create_scheme
from ...quant.base import amax_to_scale, to_fp8 as to_fp8_torch
from ..common import RowLayout, cdiv, fp8_scale, interpreting, next_pow2, pdl, pdl_start, to_fp8, unit_stride_rows

GROUP = 128  # fp8-block activation group (quant/fp8_block.py)
# elements of x one row-amax program loads at once (rows up to this long take one step): a whole row in one load, a
# few rows a program, since a K loop in few programs waits out one memory latency per step
ROW_AMAX_ONE_STEP = 8192
# elements of x one quantization program takes: small enough for several programs an SM (larger tiles leave one
# program an SM at low occupancy, bound by instruction latency)
QUANT_TILE = 2048
AMAX_FOLD_ROWS = 1024  # fp8-tensor up to this many rows: the quantization's programs reduce the row amaxes themselves


@triton.jit(do_not_specialize=["num_rows"])
def _row_amax_kernel(x_ptr, amax_ptr, meta_ptr, num_rows, K, stride_x, capacity,
                     BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, MASKED: tl.constexpr, PDL: tl.constexpr = False):
    """amax [R] float32 of |x| per row; 0 for rows of empty masked slots (they may hold garbage: left out of the
    tensor amax, and quantized like any row, since nothing reads them)."""
    pdl_start(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = rows < num_rows
    if MASKED:
        count = tl.load(meta_ptr + rows // capacity, mask=valid, other=0)
        valid = valid & (rows % capacity < count)
    amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :],
                    mask=valid[:, None] & (cols < K)[None, :], other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    tl.store(amax_ptr + rows, amax, mask=rows < num_rows)


@triton.jit(do_not_specialize=["num_rows"])
def _quant_kernel(x_ptr, q_ptr, s_ptr, amax_ptr, num_rows, K, stride_x, stride_q, stride_s, amax_stride,
                  BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, GROUPED: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
                  PDL: tl.constexpr = False, AMAX_ROWS: tl.constexpr = 0):
    """q [R, K] fp8 and scale [R, G]. GROUPED: BLOCK_K == 128, one scale per (row, group);
    AMAX_ROWS > 0: one scale for the tensor, from the max of amax_ptr[0 .. num_rows) (per-row amaxes, num_rows
    <= AMAX_ROWS), which every program takes; else the scale of row r comes from amax_ptr[r * amax_stride]
    (stride 0: one tensor amax)."""
    pdl_start(PDL)
    pid_k = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rmask = rows < num_rows
    mask = rmask[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if GROUPED:
        scale = fp8_scale(tl.max(tl.abs(x), axis=1))
        tl.store(s_ptr + rows * stride_s + pid_k, scale, mask=rmask)
    else:
        if AMAX_ROWS > 0:
            every = tl.arange(0, AMAX_ROWS)
            tensor_amax = tl.max(tl.load(amax_ptr + every, mask=every < num_rows, other=0.0), axis=0)
            scale = tl.full((BLOCK_R,), 0.0, tl.float32) + fp8_scale(tensor_amax)
        else:
            scale = fp8_scale(tl.load(amax_ptr + rows * amax_stride, mask=rmask, other=1.0))
        if pid_k == 0:
            tl.store(s_ptr + rows * stride_s, scale, mask=rmask)
    q = to_fp8(x, scale[:, None], ROUND_IN_FP32)
    tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], q, mask=mask)


def row_amax(x: Tensor, layout: RowLayout | None = None) -> Tensor:
    """x [R, K] float -> [R] float32 amax per row (0 for the empty slots of a masked layout; with no
    layout, or a sorted one, every row counts and the layout is not read)."""
    r, k = x.shape
    amax = torch.empty(r, dtype=torch.float32, device=x.device)
    masked = layout is not None and layout.masked
    block_k = min(ROW_AMAX_ONE_STEP, next_pow2(max(k, 16)))  # the whole row in one step where it fits
    block_r = max(1, min(16, ROW_AMAX_ONE_STEP // block_k))
    _row_amax_kernel[(cdiv(r, block_r),)](
        x, amax, layout.meta if masked else amax, r, k, x.stride(0), max(layout.capacity, 1) if masked else 1,
        BLOCK_R=block_r, BLOCK_K=block_k, MASKED=masked, num_warps=4, **pdl(x.device))
    return amax


def quantize_with_amax(x: Tensor, amax: Tensor, tensor: bool = False) -> tuple[Tensor, Tensor]:
    """x [R, K] float, amax [R] (per row) or [1] (one for the tensor) -> (q [R, K] fp8, scale [R, 1]).
    tensor: amax [R] holds per-row amaxes, and the scale is the tensor's, from their max (R <= AMAX_FOLD_ROWS: the
    quantization's programs take it; else a torch max first)."""
    r, k = x.shape
    fold = tensor and 0 < r <= AMAX_FOLD_ROWS
    if tensor and not fold:
        amax = amax.amax().reshape(1) if amax.numel() else amax.new_zeros(1)
    q = torch.empty((r, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((r, 1), dtype=torch.float32, device=x.device)
    block_k = max(64, min(512, k & -k))  # a power of two that divides K where one does: no half-empty column tile
    block_r = max(1, min(16, QUANT_TILE // block_k))
    _quant_kernel[(cdiv(r, block_r), cdiv(k, block_k))](
        x, q, scale, amax, r, k, x.stride(0), q.stride(0), scale.stride(0), 0 if amax.numel() == 1 else 1,
        BLOCK_R=block_r, BLOCK_K=block_k, GROUPED=False, ROUND_IN_FP32=interpreting(),
        AMAX_ROWS=AMAX_FOLD_ROWS if fold else 0, **pdl(x.device))
    return q, scale


def quantize_groups(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [R, K] float -> (q [R, K] fp8, scale [R, ceil(K/128)]): fp8-block activations."""
    r, k = x.shape
    g = cdiv(k, GROUP)
    q = torch.empty((r, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((r, g), dtype=torch.float32, device=x.device)
    block_r = 16
    _quant_kernel[(cdiv(r, block_r), g)](
        x, q, scale, scale, r, k, x.stride(0), q.stride(0), scale.stride(0), 0,
        BLOCK_R=block_r, BLOCK_K=GROUP, GROUPED=True, ROUND_IN_FP32=interpreting(), **pdl(x.device))
    return q, scale


def down_input(inter: Tensor, extra: Tensor | None, scheme: str) -> tuple[Tensor, Tensor | None]:
    """gate_up's (inter, extra) -> the down GEMM's input (a [R, I], a_scale or None) by scheme:
    fp8-block: its 1x128 groups, quantized in gate_up's epilogue or (narrow tiles, extra None) here;
    fp8-tensor / fp8-channel: quantized with the amax gate_up gathered; none: inter as it is."""
    if scheme == "fp8-block":
        return (inter, extra) if extra is not None else quantize_groups(inter)
    if scheme == "none":
        return inter, None
    return quantize_with_amax(inter, extra)


def quantize_rows(x: Tensor, scheme: str, layout: RowLayout | None = None) -> tuple[Tensor, Tensor]:
    """x [R, K] layer dtype, any row stride -> (q [R, K] float8_e4m3fn, scale [R, G] float32) by ``scheme``.
    layout: only a masked one matters (its empty slots stay out of the amax); None: every row valid."""
    x = unit_stride_rows(x)
    if scheme == "fp8-block":
        return quantize_groups(x)
    return quantize_with_amax(x, row_amax(x, layout), tensor=scheme == "fp8-tensor")


def quantize_activation(x: Tensor, scheme: str) -> tuple[Tensor, Tensor]:
    """x [R, K] layer dtype (every row valid) -> (q [R, K] fp8, scale [R, G] float32): the same
    result as ``create_scheme(scheme).quantize_activation(x)``, in one or two kernels instead of
    torch's chain of elementwise and reduction kernels (dispatchers' FP8 payloads use it on CUDA)."""
    return quantize_rows(x, scheme)


def quantize_rows_torch(x: Tensor, scheme: str, layout: RowLayout) -> tuple[Tensor, Tensor]:
    """Reference of quantize_rows: the scheme's own quantize_activation; for fp8-tensor the
    tensor amax is taken over valid rows only."""
    sch = create_scheme(scheme)
    if scheme != "fp8-tensor":
        return sch.quantize_activation(x)
    valid = layout.valid_rows()
    _, s = sch.quantize_activation(x[valid]) if bool(valid.any()) else (None, amax_to_scale(x.new_zeros((1, 1))))
    scale = s[:1].float().expand(x.shape[0], 1).contiguous()
    return to_fp8_torch(x, scale), scale


@triton.jit
def _gather_kernel(x_ptr, xs_ptr, src_ptr, out_ptr, outs_ptr, K, G, stride_x, stride_xs, stride_out, stride_outs,
                   BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):
    """Program r: out[r] = x[src[r]] (bytes; BLOCK_K at a time) and outs[r] = xs[src[r]] (G float32;
    none when G is 0)."""
    r = tl.program_id(0).to(tl.int64)
    src = tl.load(src_ptr + r)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + r * stride_out + cols, tl.load(x_ptr + src * stride_x + cols, mask=cols < K), mask=cols < K)
    g = tl.arange(0, BLOCK_G)
    tl.store(outs_ptr + r * stride_outs + g, tl.load(xs_ptr + src * stride_xs + g, mask=g < G), mask=g < G)


@triton.jit
def _scatter_kernel(x_ptr, xs_ptr, dst_ptr, out_ptr, outs_ptr, K, G, stride_x, stride_xs, stride_out, stride_outs,
                    COPIES: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):
    """Program s: x[s] (bytes; BLOCK_K at a time) and xs[s] (G float32; none when G is 0), read once, are
    written to rows dst[s, 0 .. COPIES-1] of out and outs; a dst of -1 (a dropped copy) is skipped."""
    s = tl.program_id(0).to(tl.int64)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_ptr + s * stride_x + cols, mask=cols < K)
        for c in tl.static_range(COPIES):
            d = tl.load(dst_ptr + s * COPIES + c)
            tl.store(out_ptr + d * stride_out + cols, v, mask=(cols < K) & (d >= 0))
    g = tl.arange(0, BLOCK_G)
    sv = tl.load(xs_ptr + s * stride_xs + g, mask=g < G)
    for c in tl.static_range(COPIES):
        d = tl.load(dst_ptr + s * COPIES + c)
        tl.store(outs_ptr + d * stride_outs + g, sv, mask=(g < G) & (d >= 0))


def scatter_rows(x: Tensor, x_scale: Tensor | None, copy_rows: Tensor) -> tuple[Tensor, Tensor | None]:
    """gather_rows by the inverse map: x [S, K] any dtype (last dimension contiguous), x_scale [S, G] float32
    or None, copy_rows [S, C] int64 (contiguous), a permutation of 0 .. S*C-1: the rows that copy each
    source row -> (out [S*C, K], outs [S*C, G] or None) with out[copy_rows[s, c]] = x[s]: the same result
    as gather_rows(x, x_scale, source_rows) for source_rows[copy_rows[s, c]] = s, but each source row is
    read once instead of C times. A copy_rows entry of -1 is a dropped copy (a padded batch's, ExpertBatch.copy_rows):
    nothing is written for it, and the rows no entry names are left unwritten."""
    copies = copy_rows.shape[1]
    out, outs, args, consts = _row_copy(x, x_scale, x.shape[0] * copies)
    if args:
        _scatter_kernel[(x.shape[0],)](args[0], args[1], copy_rows, *args[2:], COPIES=copies, **consts)
    return out, outs


def gather_rows(x: Tensor, x_scale: Tensor | None, source_rows: Tensor) -> tuple[Tensor, Tensor | None]:
    """x [S, K] any dtype (last dimension contiguous), x_scale [S, G] float32 or None, source_rows [R]
    int64 -> (x[source_rows] [R, K], x_scale[source_rows] [R, G] or None), contiguous."""
    out, outs, args, consts = _row_copy(x, x_scale, source_rows.numel())
    if args:
        _gather_kernel[(source_rows.numel(),)](args[0], args[1], source_rows, *args[2:], **consts)
    return out, outs


def _row_copy(x: Tensor, x_scale: Tensor | None, r: int):
    """The outputs of a copy of r rows of x (and x_scale) -> (out [r, K], outs [r, G] or None, the copy kernels'
    arguments but the index pointer: rows as bytes, one kernel for every dtype; () when nothing is copied,
    their constexprs)."""
    k = x.shape[1]
    g = x_scale.shape[1] if x_scale is not None else 0
    out = torch.empty((r, k), dtype=x.dtype, device=x.device)
    outs = torch.empty((r, g), dtype=torch.float32, device=x.device) if x_scale is not None else None
    if not (r and k):
        return out, outs, (), {}
    xb, ob = x.view(torch.uint8), out.view(torch.uint8)
    kb = k * x.element_size()
    xs = x_scale if x_scale is not None else ob  # unused pointers when G is 0
    args = (xb, xs, ob, outs if outs is not None else ob, kb, g, xb.stride(0), xs.stride(0), ob.stride(0),
            outs.stride(0) if outs is not None else 0)
    consts = dict(BLOCK_K=min(8192, next_pow2(kb)), BLOCK_G=next_pow2(max(g, 1)), num_warps=4)
    return out, outs, args, consts
