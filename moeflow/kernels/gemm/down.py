"""down GEMM with the routing weight fused: out = route_w * (a @ W_down[e].T), per expert e.

    a [R, I] layer dtype or float8_e4m3fn + a_scale [R, G] (G = 1: fp8-tensor/-channel; I/128: fp8-block),
    w2 down_proj [E, H, I] (+ scale), route_w [R] float32 -> out [R, H] layer dtype
The routing weight multiplies the float32 result before the cast; a masked layout's empty slots are written as zeros.
Weight-only FP8 (weight_only=True; sm_80 / sm_86): a in the layer dtype, FP8 weights decoded after each load.
Forms (choice.py picks one): _down_kernel, one program per tile, any layout; _down_persistent_kernel, a persistent
grid over the tiles (sorted batch, both operands through TMA; the same bits); split K into a float32 workspace
[S, R, H] summed in order by _split_sum_kernel (deterministic, not bit-equal to one program). On Hopper the Gluon
kernels (down_wgmma.py, down_wgmma_persistent.py, warp_specialized.py). Reference: down_torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...quant import FP8_DTYPE
from ..common import (QUANT_CODES, RowLayout, acc_tile, block_rows, cdiv, expert_blocks, fp8e4m3_decode, grouped_tile,
                     next_pow2, num_sms, pdl, pdl_launch, pdl_wait, per_col, per_row, row_major, rows_operand,
                     scale_block, sorted_block, split_steps, tile_dot, tile_dot_acc, tile_ids, weight_operand)
from .choice import GemmKernel, choose_down
from .gate_up import _expert_of_row, _scale_strides


@triton.jit(do_not_specialize=["num_blocks_m", "w_rows_per_expert"])
def _down_kernel(
        a_src, as_ptr, w, ws_ptr, rw_ptr, out_ptr, meta_ptr,
        num_experts, capacity, num_blocks_m, H, I, w_rows_per_expert,
        stride_a, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_out,
        QUANT: tl.constexpr, MASKED: tl.constexpr, E_POW2: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        EVEN_K: tl.constexpr, DOT_IEEE: tl.constexpr, PROMOTE: tl.constexpr, W_TMA: tl.constexpr,
        A_TMA: tl.constexpr, PDL: tl.constexpr = False, SPLIT_K: tl.constexpr = 1, split_stride=0,
        SWAP: tl.constexpr = False, W_FP8_BITS: tl.constexpr = False):
    """One program per output tile of the grid's row blocks (an upper bound of them: programs
    past the real blocks return at once). Operands as in _down_tile. SPLIT_K > 1: grid axis 1 is
    the split; out_ptr is the float32 workspace, slab s at s * split_stride elements."""
    pdl_wait(PDL)
    pid_m, pid_n = tile_ids(num_blocks_m, H, BLOCK_N, GROUP_M)
    kb_lo, kb_hi = split_steps(I, BLOCK_K, SPLIT_K)
    if SPLIT_K > 1:
        out_ptr += tl.program_id(1).to(tl.int64) * split_stride
    expert, row_start, row_end, slab_end = block_rows(pid_m, meta_ptr, num_experts, capacity, BLOCK_M, E_POW2, MASKED)
    if row_start >= row_end:
        if MASKED:  # an empty block of a slab: its output slots must read as zeros
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            rows = row_start + tl.arange(0, BLOCK_M)
            zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
            tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], zero,
                     mask=(rows < slab_end)[:, None] & (cols < H)[None, :])
        return
    _down_tile(a_src, as_ptr, w, ws_ptr, rw_ptr, out_ptr, expert, row_start, row_end, slab_end, pid_n, H, I,
               w_rows_per_expert, stride_a, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_out,
               QUANT, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_IEEE, PROMOTE, W_TMA, A_TMA, PDL, kb_lo, kb_hi, SWAP,
               W_FP8_BITS)


@triton.jit(do_not_specialize=["w_rows_per_expert", "num_programs"])
def _down_persistent_kernel(
        a_src, as_ptr, w, ws_ptr, rw_ptr, out_ptr, meta_ptr,
        num_experts, H, I, w_rows_per_expert, num_programs,
        stride_a, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_out,
        QUANT: tl.constexpr, E_POW2: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        EVEN_K: tl.constexpr, PDL: tl.constexpr = False, SWAP: tl.constexpr = False,
        W_FP8_BITS: tl.constexpr = False):
    """Sorted layout, both operands through TMA: num_programs programs (the grid; a runtime value,
    so batch sizes do not recompile it) loop over the output tiles of
    the real row blocks (counted here from the offsets), in tile_ids' grouped order. The flattened
    loop lets Triton's pipeline run from one tile into the next: short K loops (Qwen3's I = 768)
    otherwise spend much of each tile filling the pipeline and in the epilogue. Not for float32 layers' IEEE dots
    (DOT_IEEE is off here; choice.py), weight-only FP8's included."""
    pdl_wait(PDL)
    idx, lo, hi, nb, cum = expert_blocks(meta_ptr, num_experts, BLOCK_M, E_POW2)
    num_pid_n = tl.cdiv(H, BLOCK_N)
    blocks_m = tl.sum(nb, 0).to(tl.int32)
    for tile in tl.range(tl.program_id(0), blocks_m * num_pid_n, num_programs, flatten=True):
        pid_m, pid_n = grouped_tile(tile, blocks_m, num_pid_n, GROUP_M)
        expert, row_start, row_end = sorted_block(pid_m, num_experts, idx, lo, hi, nb, cum, BLOCK_M)
        _down_tile(a_src, as_ptr, w, ws_ptr, rw_ptr, out_ptr, expert, row_start, row_end, row_end, pid_n, H, I,
                   w_rows_per_expert, stride_a, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_out,
                   QUANT, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, False, False, True, True, PDL, 0, tl.cdiv(I, BLOCK_K),
                   SWAP, W_FP8_BITS)


@triton.jit
def _down_tile(a_src, as_ptr, w, ws_ptr, rw_ptr, out_ptr, expert, row_start, row_end, slab_end, pid_n, H, I,
               w_rows_per_expert, stride_a, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_out,
               QUANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr, DOT_IEEE: tl.constexpr, PROMOTE: tl.constexpr, W_TMA: tl.constexpr,
               A_TMA: tl.constexpr, PDL: tl.constexpr, kb_lo, kb_hi, SWAP: tl.constexpr, W_FP8_BITS: tl.constexpr):
    """The [BLOCK_M, BLOCK_N] output tile of rows row_start .. row_end-1 (at least one; all of
    ``expert``) and columns from pid_n * BLOCK_N, over K steps kb_lo .. kb_hi-1 (all of them but
    under split K); stores up to slab_end (rows past row_end as 0).
    w: a TMA descriptor over the weight rows [E * H, I] (W_TMA; expert e's rows start at
    e * w_rows_per_expert) or a pointer to down_proj [E, H, I] (strides stride_we, stride_wn).
    a_src: a TMA descriptor over a [R, I] (A_TMA: the box at the block's first row; rows past the
    block's end are read but never stored: the row_ok select below drops them, NaN included) or a pointer.
    SWAP (GemmConfig.swap_ab): the accumulator is held transposed, the weight tile the MMA's M (common.tile_dot).
    W_FP8_BITS (weight-only FP8, QUANT 1-3): w holds float8_e4m3fn bytes (uint8), each tile decoded to a's dtype and
    dotted in it (DOT_IEEE for float32); as_ptr is not read, QUANT says which weight scale. Nothing on this path names
    float8e4nv (sm_80 refuses it)."""
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    rows_ld = tl.minimum(rows, row_end - 1)
    cols_ld = cols % H
    rk = tl.arange(0, BLOCK_K)
    ws_e = ws_ptr + expert.to(tl.int64) * stride_wse
    if A_TMA:
        a_row = row_start.to(tl.int32)
    else:
        a_ptrs = a_src + rows_ld[:, None] * stride_a + rk[None, :] + kb_lo * BLOCK_K
    if W_TMA:
        w_row = (expert * w_rows_per_expert + pid_n * BLOCK_N).to(tl.int32)  # rows past H are never stored
    else:
        b_ptrs = (w + expert.to(tl.int64) * stride_we + cols_ld[None, :].to(tl.int64) * stride_wn + rk[:, None]
                  + kb_lo * BLOCK_K)
    acc = acc_tile(BLOCK_M, BLOCK_N, SWAP)
    for kb in range(kb_lo, kb_hi):
        if A_TMA:  # zero-filled past I
            a = a_src.load([a_row, kb * BLOCK_K])
        elif EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(rk < I - kb * BLOCK_K)[None, :], other=0.0)
        if W_TMA:  # the descriptor zero-fills past I
            b = w.load([w_row, kb * BLOCK_K]).T
        elif EVEN_K:
            b = tl.load(b_ptrs)
        else:
            b = tl.load(b_ptrs, mask=(rk < I - kb * BLOCK_K)[:, None], other=0.0)
        if W_FP8_BITS:  # e4m3 bytes -> a's dtype: the dot runs in it (no FP8 MMA needed)
            b = fp8e4m3_decode(b, a.dtype)
        if QUANT == 3 and W_FP8_BITS:  # weight-only: each K step's dot times its 128x128 blocks' weight scales
            kg = (kb * BLOCK_K) // 128
            d = tile_dot_acc(a, b, acc_tile(BLOCK_M, BLOCK_N, SWAP), SWAP, DOT_IEEE)  # DOT_IEEE's precision
            if 128 % BLOCK_N == 0:  # the tile's columns share one weight scale
                acc += d * tl.load(ws_e + scale_block(pid_n * BLOCK_N, H) * stride_wsn + kg)
            else:
                acc += d * per_col(tl.load(ws_e + scale_block(cols, H) * stride_wsn + kg), SWAP)
        elif QUANT == 3:
            kg = (kb * BLOCK_K) // 128
            a_s = tl.load(as_ptr + rows_ld * stride_as + kg)
            if 128 % BLOCK_N == 0:  # the tile's columns share one weight scale: one FMA per element
                s = a_s * tl.load(ws_e + scale_block(pid_n * BLOCK_N, H) * stride_wsn + kg)
                acc += tile_dot(a, b, SWAP) * per_row(s, SWAP)
            else:
                b_s = tl.load(ws_e + scale_block(cols, H) * stride_wsn + kg)
                acc += tile_dot(a, b, SWAP) * (per_row(a_s, SWAP) * per_col(b_s, SWAP))
        elif PROMOTE:  # fp32 layers: fp8 partial sums added in full fp32 every K step
            acc += tile_dot(a, b, SWAP)
        else:
            acc = tile_dot_acc(a, b, acc, SWAP, DOT_IEEE)
        if not A_TMA:
            a_ptrs += BLOCK_K
        if not W_TMA:
            b_ptrs += BLOCK_K
    pdl_launch(PDL)
    acc = row_major(acc, SWAP)
    if QUANT == 1 and W_FP8_BITS:  # weight-only: the weight scale alone (the expert's; the output channel's)
        acc = acc * tl.load(ws_e)
    elif QUANT == 2 and W_FP8_BITS:
        acc = acc * tl.load(ws_e + cols_ld * stride_wsn)[None, :]
    elif QUANT == 1:
        acc = acc * (tl.load(as_ptr + rows_ld * stride_as) * tl.load(ws_e))[:, None]
    elif QUANT == 2:
        acc = acc * tl.load(as_ptr + rows_ld * stride_as)[:, None] * tl.load(ws_e + cols_ld * stride_wsn)[None, :]
    route_w = tl.load(rw_ptr + rows_ld)
    y = tl.where(row_ok[:, None], acc * route_w[:, None], 0.0).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y,
             mask=(rows < slab_end)[:, None] & (cols < H)[None, :])


@triton.jit
def _split_sum_kernel(part_ptr, out_ptr, rows, H, SPLIT_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out [R, H] = the sum of the SPLIT_K float32 slabs [S, R, H] of part, in slab order."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * rows + r) * H + cols, mask=ok, other=0.0)
    tl.store(out_ptr + r * H + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def down(a: Tensor, a_scale: Tensor | None, w2: Tensor, w2_scale: Tensor | None, route_w: Tensor,
         layout: RowLayout, scheme: str, dtype: torch.dtype, cfg, poison: bool = False,
         weight_only: bool = False) -> Tensor:
    """a [R, I] (+ a_scale [R, G]), w2 [E, H, I] (+ scale), route_w [R] float32 -> out [R, H] ``dtype``.
    Rows of empty masked slots are zero. cfg: a GemmConfig. poison: NaN-fill the output (and a split
    K's workspace) first. weight_only: weight-only FP8 (an FP8 scheme; GPUs without FP8 MMA): a in ``dtype`` and
    a_scale None, w2 float8_e4m3fn with its scheme scale, decoded in the K loop; the Triton kernels only (choice.py)."""
    r, i = a.shape
    _, h, _ = w2.shape
    if weight_only and (QUANT_CODES[scheme] == 0 or a_scale is not None or w2.dtype != FP8_DTYPE):
        raise ValueError(f"weight-only FP8 takes an FP8 scheme, a in the layer dtype without a scale and "
                         f"float8_e4m3fn weights (got {scheme}, a_scale {'set' if a_scale is not None else 'None'}, "
                         f"weights {w2.dtype})")
    out = torch.full((r, h), float("nan"), dtype=dtype, device=a.device) if poison else \
        torch.empty((r, h), dtype=dtype, device=a.device)
    choice = choose_down(a, a_scale, w2, w2_scale, layout, scheme, dtype, cfg, weight_only)
    if choice.kernel is GemmKernel.GLUON_WARP_SPECIALIZED:
        from . import warp_specialized  # Gluon: loaded on Hopper only
        warp_specialized.launch(a, w2, route_w, layout, cfg, out, a_scale=a_scale, w_scale=w2_scale)
    elif choice.kernel is GemmKernel.GLUON_WGMMA:
        from . import down_wgmma  # Gluon: loaded on Hopper only
        down_wgmma.launch(a, a_scale, w2, w2_scale, route_w, layout, cfg, out)
    elif choice.kernel is GemmKernel.GLUON_WGMMA_PERSISTENT:
        from . import down_wgmma_persistent  # Gluon: loaded on Hopper only
        down_wgmma_persistent.launch(a, a_scale, w2, w2_scale, route_w, layout, cfg, out)
    elif choice.kernel is not GemmKernel.TRITON_SPLIT_K:
        _launch(a, a_scale, w2, w2_scale, route_w, layout, scheme, dtype, cfg, out, 1,
                persistent=choice.kernel is GemmKernel.TRITON_PERSISTENT, weight_only=weight_only)
    else:
        _split_k(a, a_scale, w2, w2_scale, route_w, layout, scheme, dtype, cfg, out, choice.split_k, poison,
                 weight_only)
    return out


def _split_k(a, a_scale, w2, w2_scale, route_w, layout: RowLayout, scheme: str, dtype: torch.dtype, cfg,
             out: Tensor, split: int, poison: bool, weight_only: bool = False) -> None:
    """down with the K loop over ``split`` programs a tile into a float32 workspace [S, R, H], summed in order
    (weight scales applied before: the sum is the same for weight-only FP8)."""
    r, h = out.shape
    part = torch.full((split, r, h), float("nan"), dtype=torch.float32, device=a.device) if poison else \
        torch.empty((split, r, h), dtype=torch.float32, device=a.device)
    _launch(a, a_scale, w2, w2_scale, route_w, layout, scheme, dtype, cfg, part, split, weight_only=weight_only)
    block_h = min(1024, next_pow2(h))
    _split_sum_kernel[(r, cdiv(h, block_h))](part, out, r, h, SPLIT_K=split, BLOCK_H=block_h)


def _launch(a, a_scale, w2, w2_scale, route_w, layout: RowLayout, scheme: str, dtype: torch.dtype, cfg,
            out: Tensor, split: int, persistent: bool = False, weight_only: bool = False) -> None:
    """One down launch into ``out``: [R, H] ``dtype``, or with split > 1 the float32 workspace [S, R, H]
    (dtype still the layer's: it picks the dot precision). weight_only: as down's."""
    r, i = a.shape
    _, h, _ = w2.shape
    q = QUANT_CODES[scheme]
    ws = w2_scale if w2_scale is not None else a
    stride_wse, stride_wsn = _scale_strides(ws, q)
    a_s = a_scale if a_scale is not None else a
    blocks_m = layout.num_row_blocks(cfg.block_m)
    tiles = blocks_m * cdiv(h, cfg.block_n)
    w2_in = w2.view(torch.uint8) if weight_only else w2  # weight-only: the kernel decodes the bytes (no float8e4nv)
    w_arg, w_rows = weight_operand(w2_in, cfg.block_n, cfg.block_k)
    a_arg = rows_operand(a, cfg.block_m, cfg.block_k)
    args = (a_arg, a_s, w_arg, ws, route_w, out, layout.meta)
    strides = (a.stride(0), a_s.stride(0), w2.stride(0), w2.stride(1), stride_wse, stride_wsn, out.stride(-2))
    tiling = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                  EVEN_K=i % cfg.block_k == 0, SWAP=bool(cfg.swap_ab), W_FP8_BITS=weight_only,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if persistent:  # choice.py's TRITON_PERSISTENT: a sorted batch, both operands through TMA, not float32
        programs = min(cfg.programs_per_sm * num_sms(a.device), tiles)
        if programs:
            _down_persistent_kernel[(programs,)](*args, layout.num_experts, h, i, w_rows, programs, *strides, QUANT=q,
                                                 E_POW2=layout.e_pow2, **tiling, **pdl(a.device, early_start=False))
        return
    fp32 = dtype == torch.float32
    _down_kernel[(tiles, split)](
        *args, layout.num_experts, max(layout.capacity, 1), blocks_m, h, i, w_rows, *strides,
        QUANT=q, MASKED=layout.masked, E_POW2=layout.e_pow2, DOT_IEEE=fp32 and (q == 0 or weight_only),
        PROMOTE=fp32 and q in (1, 2) and not weight_only, W_TMA=w_arg is not w2_in, A_TMA=a_arg is not a,
        SPLIT_K=split, split_stride=r * h if split > 1 else 0, **tiling, **pdl(a.device, early_start=False))


def down_torch(a: Tensor, a_scale: Tensor | None, w2: Tensor, w2_scale: Tensor | None, route_w: Tensor,
               layout: RowLayout, scheme: str, dtype: torch.dtype) -> Tensor:
    """Reference: route_w * (dequant(a) @ dequant(w2[e]).T) per valid row in float32 -> [R, H] ``dtype``. Weight-only
    FP8's reference: a in the layer dtype with a_scale None (only the weights dequantized)."""
    from ...quant import create_scheme
    sch = create_scheme(scheme)
    af = sch.dequantize_activation(a, a_scale) if a_scale is not None else a.float()
    expert = _expert_of_row(layout)
    out = torch.zeros(a.shape[0], w2.shape[1], dtype=torch.float32, device=a.device)
    for e in range(w2.shape[0]):
        sel = expert == e
        if bool(sel.any()):
            out[sel] = (af[sel] @ sch.dequantize_expert(w2, w2_scale, e).T) * route_w[sel].float()[:, None]
    return out.to(dtype)
