"""gate_up GEMM with the gated activation fused: inter = act(x @ W_gate[e].T) * (x @ W_up[e].T), per expert e.

    x [R or S, H] layer dtype or fp8 (+ x_scale), gate_up_proj [E, 2I, H] (+ scale) -> inter [R, I]
Two accumulators a program (gate rows n, up rows I + n): the [R, 2I] pre-activation never reaches memory; act(gate) *
up in float32, rounded to the layer dtype. Epilogue: none: inter; fp8-tensor / -channel: inter and its amax (tensor /
rows); fp8-block with BLOCK_N a multiple of 128 (or split K): inter float8_e4m3fn and its 1x128 group scales.
Weight-only FP8 (weight_only=True; no FP8 MMA: sm_80 / sm_86): x in the layer dtype, the FP8 weights read as bytes and
decoded after each load (common.fp8e4m3_decode), weight scales only; inter in the layer dtype. Tile options
(GemmConfig): split_k, x_tma, swap_ab. choice.py picks the kernel: this one, or on Hopper gate_up_wgmma.py /
warp_specialized.py. Reference: gate_up_torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...quant import FP8_DTYPE
from ...targets import kernel_target
from ..common import (QUANT_CODES, RowLayout, acc_tile, block_rows, cdiv, fp8_scale, fp8e4m3_decode, gated_act,
                     interpreting, next_pow2, pdl, pdl_launch, pdl_start, pdl_wait, per_col, per_row, row_major,
                     rows_operand, scale_block, split_steps, tile_dot, tile_dot_acc, tile_ids, to_fp8, weight_operand)
from .choice import GLUON, GemmKernel, choose_gate_up

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit(do_not_specialize=["num_blocks_m", "w_rows_per_expert"])
def _gate_up_kernel(
        x_ptr, xs_ptr, src_ptr, w, ws_ptr, out_ptr, outs_ptr, amax_ptr, meta_ptr,
        num_experts, capacity, num_blocks_m, I, H, w_rows_per_expert,
        stride_x, stride_xs, stride_we, stride_wn, stride_wse, stride_wsn, stride_out, stride_outs,
        QUANT: tl.constexpr, ACT: tl.constexpr, INTER_DTYPE: tl.constexpr, MASKED: tl.constexpr,
        E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_IEEE: tl.constexpr, PROMOTE: tl.constexpr,
        ROUND_IN_FP32: tl.constexpr, W_TMA: tl.constexpr, INDEXED: tl.constexpr, PDL: tl.constexpr = False,
        SPLIT_K: tl.constexpr = 1, split_stride=0, X_TMA: tl.constexpr = False, SWAP: tl.constexpr = False,
        AMAX_BY_ROW: tl.constexpr = False,
        W_FP8_BITS: tl.constexpr = False):
    """w: a TMA descriptor over the weight rows [E * 2I, H] (W_TMA; expert e's rows start at
    e * w_rows_per_expert) or a pointer to gate_up_proj [E, 2I, H] (strides stride_we, stride_wn).
    INDEXED: row r of x (and of its scales) is x[src[r]] (src_ptr: [R] int64), else x[r].
    X_TMA (not INDEXED): x_ptr is a TMA descriptor over x [R, H] with [BLOCK_M, BLOCK_K] boxes, read at
    the block's first row (rows past the block's end are read, never stored; columns past H are zero).
    SPLIT_K > 1: grid axis 1 is the split, program s runs K steps s * ceil(n / S) .. of the n and
    stores its float32 gate and up partial sums (scales applied) into slab s of the workspace
    out_ptr [S, R, 2I] (slab stride split_stride; gate at columns n, up at I + n); no epilogue.
    SWAP (GemmConfig.swap_ab): the K loop's accumulators are held transposed, [BLOCK_N, BLOCK_M], the weight tile
    the MMA's M (common.tile_dot), and transposed once before the epilogue.
    W_FP8_BITS (weight-only FP8, QUANT 1-3): w holds float8_e4m3fn bytes (uint8), each tile decoded to x's dtype and
    dotted in it (DOT_IEEE for float32); no activation scale is read (xs_ptr unused), QUANT says which weight scale.
    Nothing on this path names float8e4nv (sm_80 refuses it): the fp8-block epilogue and the amax are left out."""
    pdl_wait(PDL)
    pid_m, pid_n = tile_ids(num_blocks_m, I, BLOCK_N, GROUP_M)
    kb_lo, kb_hi = split_steps(H, BLOCK_K, SPLIT_K)
    expert, row_start, row_end, _ = block_rows(pid_m, meta_ptr, num_experts, capacity, BLOCK_M, E_POW2, MASKED)
    if row_start >= row_end:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    rows_ld = tl.minimum(rows, row_end - 1)  # in-bounds loads without a mask; stores are masked
    if INDEXED:
        x_rows = tl.load(src_ptr + rows_ld)
    else:
        x_rows = rows_ld
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ld = cols % I
    rk = tl.arange(0, BLOCK_K)
    if X_TMA:
        x_row = row_start.to(tl.int32)
    else:
        x_ptrs = x_ptr + x_rows[:, None] * stride_x + rk[None, :] + kb_lo * BLOCK_K
    if W_TMA:
        g_row = expert * w_rows_per_expert + pid_n * BLOCK_N  # rows past I are never stored
    else:
        w_e = w + expert.to(tl.int64) * stride_we
        g_ptrs = w_e + cols_ld[None, :].to(tl.int64) * stride_wn + rk[:, None] + kb_lo * BLOCK_K
        u_ptrs = g_ptrs + I * stride_wn
    ws_e = ws_ptr + expert.to(tl.int64) * stride_wse
    acc_g = acc_tile(BLOCK_M, BLOCK_N, SWAP)
    acc_u = acc_tile(BLOCK_M, BLOCK_N, SWAP)
    if QUANT == 3:  # the first step's scales; each step loads the next's (Triton does not pipeline these loads)
        if 128 % BLOCK_N == 0:  # the tile's columns share one weight scale block
            g_b = scale_block(pid_n * BLOCK_N, I)
        else:
            g_b = scale_block(cols, I)
        gs_ptr = ws_e + g_b * stride_wsn
        us_ptr = ws_e + (g_b + I // 128) * stride_wsn
        kg0 = tl.minimum((kb_lo * BLOCK_K) // 128, (H - 1) // 128)  # a split past the last step loads in bounds
        g_s_next, u_s_next = tl.load(gs_ptr + kg0), tl.load(us_ptr + kg0)
        if not W_FP8_BITS:
            xs_rows = xs_ptr + x_rows * stride_xs
            a_s_next = tl.load(xs_rows + kg0)
    for kb in range(kb_lo, kb_hi):
        if X_TMA:
            a = x_ptr.load([x_row, kb * BLOCK_K])
        elif EVEN_K:
            a = tl.load(x_ptrs)
        else:
            a = tl.load(x_ptrs, mask=(rk < H - kb * BLOCK_K)[None, :], other=0.0)
        if W_TMA:  # the descriptor zero-fills past H
            bg = w.load([g_row, kb * BLOCK_K]).T
            bu = w.load([g_row + I, kb * BLOCK_K]).T
        elif EVEN_K:
            bg = tl.load(g_ptrs)
            bu = tl.load(u_ptrs)
        else:
            k_ok = rk < H - kb * BLOCK_K
            bg = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            bu = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        if W_FP8_BITS:  # e4m3 bytes -> x's dtype: the dot runs in it (no FP8 MMA needed)
            bg = fp8e4m3_decode(bg, a.dtype)
            bu = fp8e4m3_decode(bu, a.dtype)
        if QUANT == 3 and W_FP8_BITS:  # weight-only: each K step's dot times its 128x128 blocks' weight scales
            g_s, u_s = g_s_next, u_s_next
            kg = tl.minimum(((kb + 1) * BLOCK_K) // 128, (H - 1) // 128)
            g_s_next, u_s_next = tl.load(gs_ptr + kg), tl.load(us_ptr + kg)
            zero = acc_tile(BLOCK_M, BLOCK_N, SWAP)  # a dot of its own: tile_dot_acc for DOT_IEEE's precision
            if 128 % BLOCK_N == 0:  # one scale a tile
                acc_g += tile_dot_acc(a, bg, zero, SWAP, DOT_IEEE) * g_s
                acc_u += tile_dot_acc(a, bu, zero, SWAP, DOT_IEEE) * u_s
            else:
                acc_g += tile_dot_acc(a, bg, zero, SWAP, DOT_IEEE) * per_col(g_s, SWAP)
                acc_u += tile_dot_acc(a, bu, zero, SWAP, DOT_IEEE) * per_col(u_s, SWAP)
        elif QUANT == 3:  # 128x128 weight blocks x 1x128 activation groups: scale every K step
            a_s, g_s, u_s = a_s_next, g_s_next, u_s_next
            kg = tl.minimum(((kb + 1) * BLOCK_K) // 128, (H - 1) // 128)
            a_s_next, g_s_next, u_s_next = tl.load(xs_rows + kg), tl.load(gs_ptr + kg), tl.load(us_ptr + kg)
            if 128 % BLOCK_N == 0:  # one FMA per element: a per-row scale
                acc_g += tile_dot(a, bg, SWAP) * per_row(a_s * g_s, SWAP)
                acc_u += tile_dot(a, bu, SWAP) * per_row(a_s * u_s, SWAP)
            else:
                acc_g += tile_dot(a, bg, SWAP) * (per_row(a_s, SWAP) * per_col(g_s, SWAP))
                acc_u += tile_dot(a, bu, SWAP) * (per_row(a_s, SWAP) * per_col(u_s, SWAP))
        elif PROMOTE:  # fp32 layers: fp8 partial sums added in full fp32 every K step
            acc_g += tile_dot(a, bg, SWAP)
            acc_u += tile_dot(a, bu, SWAP)
        else:
            acc_g = tile_dot_acc(a, bg, acc_g, SWAP, DOT_IEEE)
            acc_u = tile_dot_acc(a, bu, acc_u, SWAP, DOT_IEEE)
        if not X_TMA:
            x_ptrs += BLOCK_K
        if not W_TMA:
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
    pdl_launch(PDL)
    acc_g = row_major(acc_g, SWAP)
    acc_u = row_major(acc_u, SWAP)
    if QUANT == 1 and W_FP8_BITS:  # weight-only: the expert's weight scale alone
        s = tl.load(ws_e)
        acc_g = acc_g * s
        acc_u = acc_u * s
    elif QUANT == 2 and W_FP8_BITS:  # the output channel's weight scale alone
        acc_g = acc_g * tl.load(ws_e + cols_ld * stride_wsn)[None, :]
        acc_u = acc_u * tl.load(ws_e + (cols_ld + I) * stride_wsn)[None, :]
    elif QUANT == 1:  # each row's activation scale (rows from different EP ranks may differ) x the expert's
        s = tl.load(xs_ptr + x_rows * stride_xs) * tl.load(ws_e)
        acc_g = acc_g * s[:, None]
        acc_u = acc_u * s[:, None]
    elif QUANT == 2:  # per-token x per-output-channel
        a_s = tl.load(xs_ptr + x_rows * stride_xs)
        acc_g = acc_g * a_s[:, None] * tl.load(ws_e + cols_ld * stride_wsn)[None, :]
        acc_u = acc_u * a_s[:, None] * tl.load(ws_e + (cols_ld + I) * stride_wsn)[None, :]
    ok = row_ok[:, None] & (cols < I)[None, :]
    if SPLIT_K > 1:  # partial sums for _gate_up_split_sum_kernel
        part = out_ptr + tl.program_id(1).to(tl.int64) * split_stride + rows[:, None] * (2 * I) + cols[None, :]
        tl.store(part, acc_g, mask=ok)
        tl.store(part + I, acc_u, mask=ok)
        return
    h = gated_act(acc_g, acc_u, ACT).to(INTER_DTYPE)
    out_ptrs = out_ptr + rows[:, None] * stride_out + cols[None, :]
    if W_FP8_BITS:  # weight-only: inter in the layer dtype, no FP8 groups nor amax (and no float8e4nv for sm_80)
        tl.store(out_ptrs, h, mask=ok)
    elif QUANT == 3 and BLOCK_N % 128 == 0:  # fp8-block: the 1x128 groups of the tile quantized here
        hf = tl.reshape(h.to(tl.float32), (BLOCK_M, BLOCK_N // 128, 128))
        scale = fp8_scale(tl.max(tl.abs(hf), axis=2))  # [BLOCK_M, BLOCK_N // 128]
        q = tl.reshape(to_fp8(hf, scale[:, :, None], ROUND_IN_FP32), (BLOCK_M, BLOCK_N))
        tl.store(out_ptrs, q, mask=ok)
        groups = pid_n * (BLOCK_N // 128) + tl.arange(0, BLOCK_N // 128)
        tl.store(outs_ptr + rows[:, None] * stride_outs + groups[None, :], scale,
                 mask=row_ok[:, None] & (groups < tl.cdiv(I, 128))[None, :])
    else:
        tl.store(out_ptrs, h, mask=ok)
        if QUANT == 1 or QUANT == 2:
            row_amax = tl.max(tl.where(ok, tl.abs(h.to(tl.float32)), 0.0), axis=1)
            if QUANT == 2:
                tl.atomic_max(amax_ptr + rows, row_amax, mask=row_ok)
            elif AMAX_BY_ROW:  # targets.Target.tile_to_scalar False (sm_100): one atomic a row, to the one address
                tl.atomic_max(amax_ptr + rows * 0, row_amax, mask=row_ok)
            else:
                tl.atomic_max(amax_ptr, tl.max(row_amax, axis=0))


@triton.jit
def _gate_up_split_sum_kernel(part_ptr, out_ptr, outs_ptr, amax_ptr, meta_ptr, num_experts, capacity, I,
                              stride_out, stride_outs, split_stride,
                              QUANT: tl.constexpr, ACT: tl.constexpr, INTER_DTYPE: tl.constexpr, MASKED: tl.constexpr,
                              SPLIT_K: tl.constexpr, BLOCK_I: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
                              PDL: tl.constexpr = False):
    """Split K's second launch, program (r, c): row r, columns c * BLOCK_I ..: the SPLIT_K slabs'
    gate and up partial sums added in slab order, act(gate) * up rounded to INTER_DTYPE, then
    gate_up's epilogue (fp8-block: BLOCK_I == 128, the row's group c quantized; fp8-tensor /
    fp8-channel: the amax). Rows that hold no token copy (sorted: past offsets[E]; masked: empty
    slots) are left alone, as the one-launch form leaves them."""
    pdl_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    if MASKED:
        valid = r % capacity < tl.load(meta_ptr + r // capacity)
    else:
        valid = r < tl.load(meta_ptr + num_experts)
    if valid:
        c = tl.program_id(1)
        cols = c * BLOCK_I + tl.arange(0, BLOCK_I)
        ok = cols < I
        g = tl.zeros((BLOCK_I,), dtype=tl.float32)
        u = tl.zeros((BLOCK_I,), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            row = part_ptr + s * split_stride + r * (2 * I)
            g += tl.load(row + cols, mask=ok, other=0.0)
            u += tl.load(row + I + cols, mask=ok, other=0.0)
        h = gated_act(g, u, ACT).to(INTER_DTYPE)
        hf = tl.where(ok, tl.abs(h.to(tl.float32)), 0.0)
        if QUANT == 3:
            scale = fp8_scale(tl.max(hf, axis=0))
            tl.store(out_ptr + r * stride_out + cols, to_fp8(h.to(tl.float32), scale, ROUND_IN_FP32), mask=ok)
            tl.store(outs_ptr + r * stride_outs + c, scale)
        else:
            tl.store(out_ptr + r * stride_out + cols, h, mask=ok)
            if QUANT == 2:
                tl.atomic_max(amax_ptr + r, tl.max(hf, axis=0))
            elif QUANT == 1:
                tl.atomic_max(amax_ptr, tl.max(hf, axis=0))


def gate_up(x: Tensor, x_scale: Tensor | None, w13: Tensor, w13_scale: Tensor | None, layout: RowLayout,
            scheme: str, activation: str, dtype: torch.dtype, cfg, poison: bool = False,
            source_rows: Tensor | None = None, copy_rows: Tensor | None = None,
            weight_only: bool = False) -> tuple[Tensor, Tensor | None]:
    """x [R, H] (layer dtype, or fp8 with x_scale [R, G]), w13 [E, 2I, H] (+ scheme scale)
    -> (inter [R, I], extra): extra is None (none), amax [R] / [1] float32 (fp8-channel /
    fp8-tensor; inter in layer dtype) or scale [R, I/128] (fp8-block with BLOCK_N a multiple of
    128 or split K: inter float8_e4m3fn, its 1x128 groups quantized in the epilogue). fp8-block with a
    narrower BLOCK_N (more programs for small batches) returns inter in the layer dtype and None:
    the caller quantizes it (kernels/quant.quantize_groups).
    source_rows: [R] int64 or None: row r is x[source_rows[r]] (x [S, H], x_scale [S, G]).
    copy_rows: [S, C] int64 (S * C == R) or None: with source_rows, its inverse (ExpertBatch.copy_rows, -1 for a
    padded batch's dropped copies); a copy of the rows in order is then scattered by it (each source row read once)
    instead of gathered.
    cfg: a GemmConfig (configs.py); with split_k > 1 fp8-block always returns the quantized groups; x_tma
    copies rows given by index into order first, then reads rows in order through TMA.
    poison: fill outputs (and a split K's workspace) with NaN first (tests).
    weight_only: weight-only FP8 (an FP8 scheme; GPUs without FP8 MMA): x [R or S, H] in ``dtype`` and x_scale None,
    w13 float8_e4m3fn with its scheme scale, decoded in the K loop -> (inter [R, I] ``dtype``, None). The Triton
    kernel only (choice.py), split K included."""
    r, h = layout.rows, x.shape[1]
    e, two_i, _ = w13.shape
    i = two_i // 2
    dev = x.device
    q = QUANT_CODES[scheme]
    fill = torch.full if poison else (lambda shape, _v, **kw: torch.empty(shape, **kw))
    nan = float("nan")
    if weight_only and (q == 0 or x_scale is not None or w13.dtype != FP8_DTYPE):
        raise ValueError(f"weight-only FP8 takes an FP8 scheme, x in the layer dtype without a scale and "
                         f"float8_e4m3fn weights (got {scheme}, x_scale {'set' if x_scale is not None else 'None'}, "
                         f"weights {w13.dtype})")
    choice = choose_gate_up(x, x_scale, w13, w13_scale, layout, scheme, cfg, weight_only)
    split = choice.split_k
    aq = 0 if weight_only else q  # what the epilogue does past the dot: weight-only's is the none scheme's
    fused_groups = aq == 3 and (cfg.block_n % 128 == 0 or split > 1)
    inter = fill((r, i), nan, dtype=FP8_DTYPE if fused_groups else dtype, device=dev)
    extra = None
    if fused_groups:
        extra = fill((r, cdiv(i, 128)), nan, dtype=torch.float32, device=dev)
    elif aq in (1, 2):
        extra = torch.zeros(r if aq == 2 else 1, dtype=torch.float32, device=dev)
    if choice.kernel in GLUON and source_rows is not None:  # they read rows in order (TMA): one copy in order first
        x, x_scale = _rows_in_order(x, x_scale, source_rows, copy_rows)
    if choice.kernel is GemmKernel.GLUON_WGMMA:
        from . import gate_up_wgmma  # Gluon: loaded on Hopper only
        gate_up_wgmma.launch(x, x_scale, w13, w13_scale, layout, _act_code(activation), dtype, cfg, inter, extra)
        return inter, extra
    if choice.kernel is GemmKernel.GLUON_WARP_SPECIALIZED:
        from . import warp_specialized  # Gluon: loaded on Hopper only
        warp_specialized.launch(x, w13, None, layout, cfg, inter, gated=True, act=_act_code(activation),
                                a_scale=x_scale, w_scale=w13_scale, out_scale=extra, dtype=dtype)
        return inter, extra
    x_arg = x
    if choice.rows_in_order:  # rows in order through TMA (GemmConfig.x_tma)
        if source_rows is not None:
            x, x_scale = _rows_in_order(x, x_scale, source_rows, copy_rows)
            source_rows = None
        x_arg = rows_operand(x, cfg.block_m, cfg.block_k)
    ws = w13_scale if w13_scale is not None else x  # unused pointer when q == 0
    stride_wse, stride_wsn = _scale_strides(ws, q)
    xs = x_scale if x_scale is not None else x
    blocks_m = layout.num_row_blocks(cfg.block_m)
    grid = (blocks_m * cdiv(i, cfg.block_n),)
    w13_in = w13.view(torch.uint8) if weight_only else w13  # weight-only: the kernel decodes the bytes (no float8e4nv)
    w_arg, w_rows = weight_operand(w13_in, cfg.block_n, cfg.block_k)
    part = fill((split, r, two_i), nan, dtype=torch.float32, device=dev) if split > 1 else inter
    _gate_up_kernel[grid + (split,)](
        x_arg, xs, source_rows if source_rows is not None else layout.meta, w_arg, ws, part, extra if fused_groups else inter,
        extra if aq in (1, 2) else inter, layout.meta,
        layout.num_experts, max(layout.capacity, 1), blocks_m, i, h, w_rows,
        x.stride(0), xs.stride(0), w13.stride(0), w13.stride(1), stride_wse, stride_wsn, inter.stride(0),
        extra.stride(0) if fused_groups else 0,
        QUANT=q, ACT=_act_code(activation), INTER_DTYPE=_TL_DTYPE[dtype], MASKED=layout.masked,
        E_POW2=layout.e_pow2, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, EVEN_K=h % cfg.block_k == 0, DOT_IEEE=dtype == torch.float32 and aq == 0,
        PROMOTE=dtype == torch.float32 and aq in (1, 2), ROUND_IN_FP32=interpreting(), W_TMA=w_arg is not w13_in,
        INDEXED=source_rows is not None, SPLIT_K=split, split_stride=r * two_i if split > 1 else 0,
        X_TMA=x_arg is not x, SWAP=bool(cfg.swap_ab), W_FP8_BITS=weight_only,
        AMAX_BY_ROW=aq == 1 and not kernel_target(dev).tile_to_scalar, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl(dev, early_start=False))
    if split > 1:
        block_i = 128 if aq == 3 else min(1024, next_pow2(i))
        _gate_up_split_sum_kernel[(r, cdiv(i, block_i))](
            part, inter, extra if fused_groups else inter, extra if aq in (1, 2) else inter, layout.meta,
            layout.num_experts, max(layout.capacity, 1), i, inter.stride(0), extra.stride(0) if fused_groups else 0,
            r * two_i, QUANT=aq, ACT=_act_code(activation), INTER_DTYPE=_TL_DTYPE[dtype], MASKED=layout.masked,
            SPLIT_K=split, BLOCK_I=block_i, ROUND_IN_FP32=interpreting(), **pdl(dev))
    return inter, extra


def _rows_in_order(x: Tensor, x_scale: Tensor | None, source_rows: Tensor, copy_rows: Tensor | None):
    """(x[source_rows], x_scale[source_rows]) as contiguous copies in one launch: scattered by copy_rows when
    it is given and covers the rows (each source row read once; a padded batch's padding rows, which its -1 entries
    leave unwritten, are rows no GEMM tile stores), else gathered by source_rows."""
    from ..rows.quant import gather_rows, scatter_rows
    if copy_rows is not None and copy_rows.dim() == 2 and copy_rows.shape[0] == x.shape[0] \
            and copy_rows.numel() == source_rows.numel():
        return scatter_rows(x, x_scale, copy_rows)
    return gather_rows(x, x_scale, source_rows)


def _act_code(name: str) -> int:
    from ..common import ACT_CODES
    return ACT_CODES[name]


def _scale_strides(ws: Tensor, q: int) -> tuple[int, int]:
    """(per-expert stride, per-output-row(-block) stride) of a weight scale:
    tensor [E] -> (1, 0); channel [E, N] -> (N, 1); block [E, N/128, K/128] -> (NB*KB, KB)."""
    if q == 1:
        return ws.stride(0), 0
    if q in (2, 3):
        return ws.stride(0), ws.stride(1)
    return 0, 0


def gate_up_torch(x: Tensor, x_scale: Tensor | None, w13: Tensor, w13_scale: Tensor | None, layout: RowLayout,
                  scheme: str, activation: str, dtype: torch.dtype, source_rows: Tensor | None = None) -> Tensor:
    """Reference: act(gate) * up per valid row, float32 math, rounded to ``dtype`` -> [R, I]
    (rows of empty masked slots are 0). Dequantizes by the scheme (quant/*.py). source_rows as gate_up. Weight-only
    FP8's reference: x in the layer dtype with x_scale None (only the weights dequantized)."""
    from ...experts.base import gated_activation
    from ...quant import create_scheme
    sch = create_scheme(scheme)
    xf = sch.dequantize_activation(x, x_scale) if x_scale is not None else x.float()
    if source_rows is not None:
        xf = xf[source_rows]
    expert = _expert_of_row(layout)
    out = torch.zeros(xf.shape[0], w13.shape[1] // 2, dtype=torch.float32, device=x.device)  # R rows
    for e in range(w13.shape[0]):
        sel = expert == e
        if bool(sel.any()):
            out[sel] = gated_activation(xf[sel] @ sch.dequantize_expert(w13, w13_scale, e).T, activation)
    return out.to(dtype)


def _expert_of_row(layout: RowLayout) -> Tensor:
    """[R] int64 local expert of each flat row, -1 for empty masked slots (torch)."""
    dev = layout.meta.device
    if layout.masked:
        e = torch.arange(layout.num_experts, device=dev).repeat_interleave(layout.capacity)
        return torch.where(layout.valid_rows(), e, -1)
    from ...layouts import expert_of_sorted_row
    e = expert_of_sorted_row(layout.meta, layout.rows)  # num_experts for padding rows past offsets[-1]
    return torch.where(e < layout.num_experts, e, -1)
