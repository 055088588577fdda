"""Experiment: decode GEMMs on CUDA cores (no tensor-core tile): each program multiplies BLOCK_M rows
of one expert by a [BLOCK_N, BLOCK_K] weight tile per K step as broadcast products summed over K, so
BLOCK_M can be 1 and BLOCK_N as narrow as 8 (the tensor-core tiles need 16 x 16). Sorted layout,
rows by index or in order, QUANT 0 (bf16/fp16) and 3 (fp8-block, BLOCK_K 128, 128 % BLOCK_N == 0).
LATE: keep [BLOCK_M, BLOCK_N, BLOCK_K] float32 partial products and sum over K once after the loop
(else a sum over K every step)."""
import torch
import triton
import triton.language as tl

from moeflow.kernels.common import block_rows, gated_act, pdl, pdl_launch, pdl_wait, scale_block
from moeflow.kernels.gate_up import _TL_DTYPE


@triton.jit
def _dot_rows(a, w, acc, LATE: tl.constexpr):
    """a [BM, 1, BK] float32, w [1, BN, BK] float32 -> acc + products (LATE: [BM, BN, BK]; else summed
    over K: [BM, BN])."""
    if LATE:
        return acc + a * w
    return acc + tl.sum(a * w, axis=2)


@triton.jit(do_not_specialize=["num_blocks_m"])
def gemv_gate_up_kernel(x_ptr, xs_ptr, src_ptr, w_ptr, ws_ptr, out_ptr, meta_ptr,
                        num_experts, num_blocks_m, I, H,
                        stride_x, stride_xs, stride_we, stride_wn, stride_wse, stride_wsn, stride_out,
                        QUANT: tl.constexpr, ACT: tl.constexpr, INTER_DTYPE: tl.constexpr, E_POW2: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        INDEXED: tl.constexpr, LATE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    num_pid_n = tl.cdiv(I, BLOCK_N)
    pid_m = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    expert, row_start, row_end, _ = block_rows(pid_m, meta_ptr, num_experts, 1, BLOCK_M, E_POW2, False)
    if row_start >= row_end:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    rows_ld = tl.minimum(rows, row_end - 1)
    x_rows = tl.load(src_ptr + rows_ld) if INDEXED else rows_ld
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ld = tl.minimum(cols, I - 1)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + x_rows[:, None, None] * stride_x + rk[None, None, :]
    g_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols_ld[None, :, None].to(tl.int64) * stride_wn + rk[None, None, :]
    u_ptrs = g_ptrs + I * stride_wn
    ws_e = ws_ptr + expert.to(tl.int64) * stride_wse
    if LATE:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    g_b = scale_block(pid_n * BLOCK_N, I)
    for kb in range(0, tl.cdiv(H, BLOCK_K)):
        k_ok = rk[None, None, :] < H - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        if QUANT == 3:
            a_s = tl.load(xs_ptr + x_rows * stride_xs + kb)[:, None, None]
            g_s = tl.load(ws_e + g_b * stride_wsn + kb)
            u_s = tl.load(ws_e + (g_b + I // 128) * stride_wsn + kb)
            acc_g = _dot_rows(a * (a_s * g_s), g, acc_g, LATE)
            acc_u = _dot_rows(a * (a_s * u_s), u, acc_u, LATE)
        else:
            acc_g = _dot_rows(a, g, acc_g, LATE)
            acc_u = _dot_rows(a, u, acc_u, LATE)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    pdl_launch(PDL)
    if LATE:
        gate = tl.sum(acc_g, axis=2)
        up = tl.sum(acc_u, axis=2)
    else:
        gate = acc_g
        up = acc_u
    h = gated_act(gate, up, ACT).to(INTER_DTYPE)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], h, mask=row_ok[:, None] & (cols < I)[None, :])


@triton.jit(do_not_specialize=["num_blocks_m"])
def gemv_down_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, rw_ptr, out_ptr, meta_ptr,
                     num_experts, num_blocks_m, H, I,
                     stride_a, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_out,
                     QUANT: tl.constexpr, E_POW2: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     LATE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    num_pid_n = tl.cdiv(H, BLOCK_N)
    pid_m = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    expert, row_start, row_end, _ = block_rows(pid_m, meta_ptr, num_experts, 1, BLOCK_M, E_POW2, False)
    if row_start >= row_end:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    rows_ld = tl.minimum(rows, row_end - 1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ld = tl.minimum(cols, H - 1)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_ld[:, None, None] * stride_a + rk[None, None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols_ld[None, :, None].to(tl.int64) * stride_wn + rk[None, None, :]
    ws_e = ws_ptr + expert.to(tl.int64) * stride_wse
    if LATE:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_b = scale_block(pid_n * BLOCK_N, H)
    for kb in range(0, tl.cdiv(I, BLOCK_K)):
        k_ok = rk[None, None, :] < I - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        if QUANT == 3:
            s = tl.load(as_ptr + rows_ld * stride_as + kb)[:, None, None] * tl.load(ws_e + w_b * stride_wsn + kb)
            acc = _dot_rows(a * s, w, acc, LATE)
        else:
            acc = _dot_rows(a, w, acc, LATE)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    pdl_launch(PDL)
    y = tl.sum(acc, axis=2) if LATE else acc
    route_w = tl.load(rw_ptr + rows_ld)
    y = (y * route_w[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y, mask=row_ok[:, None] & (cols < H)[None, :])


def _scale(ws, q):
    return (ws.stride(0), ws.stride(1)) if q == 3 else (0, 0)


def gemv_gate_up(x, xs, w13, w13s, layout, q, dtype, bm, bn, bk, warps, stages, late, source_rows=None):
    r, h = layout.rows, x.shape[1]
    e, two_i, _ = w13.shape
    i = two_i // 2
    inter = torch.empty((r, i), dtype=dtype, device=x.device)
    ws = w13s if w13s is not None else x
    xs_ = xs if xs is not None else x
    blocks_m = layout.num_row_blocks(bm)
    grid = (blocks_m * triton.cdiv(i, bn),)
    gemv_gate_up_kernel[grid](x, xs_, source_rows if source_rows is not None else layout.meta, w13, ws, inter,
                              layout.meta, layout.num_experts, blocks_m, i, h, x.stride(0), xs_.stride(0),
                              w13.stride(0), w13.stride(1), *_scale(ws, q), inter.stride(0),
                              QUANT=q, ACT=0, INTER_DTYPE=_TL_DTYPE[dtype], E_POW2=layout.e_pow2, BLOCK_M=bm,
                              BLOCK_N=bn, BLOCK_K=bk, INDEXED=source_rows is not None, LATE=late, num_warps=warps,
                              num_stages=stages, **pdl(x.device, early_start=False))
    return inter


def gemv_down(a, a_s, w2, w2s, route_w, layout, q, dtype, bm, bn, bk, warps, stages, late):
    r, i = a.shape
    h = w2.shape[1]
    out = torch.empty((r, h), dtype=dtype, device=a.device)
    ws = w2s if w2s is not None else a
    as_ = a_s if a_s is not None else a
    blocks_m = layout.num_row_blocks(bm)
    grid = (blocks_m * triton.cdiv(h, bn),)
    gemv_down_kernel[grid](a, as_, w2, ws, route_w, out, layout.meta, layout.num_experts, blocks_m, h, i,
                           a.stride(0), as_.stride(0), w2.stride(0), w2.stride(1), *_scale(ws, q), out.stride(0),
                           QUANT=q, E_POW2=layout.e_pow2, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, LATE=late,
                           num_warps=warps, num_stages=stages, **pdl(a.device, early_start=False))
    return out
