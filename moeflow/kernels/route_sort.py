"""Routing and the sort of its copies by expert in one launch, for batches whose routing fits one
program of kernels/route.py (launch_shape: T = 1 for 128-256 experts, T <= 16 for 8): the local
dispatcher's decode path (dispatch/local.py), where the router's launch and the sort's launch each
cost a step of the layer's serial chain.

    logits [T, E], bias [E] or None, routing parameters (kernels/route.py)
    [x [T, H] and an fp8-channel / fp8-block scheme: the tokens quantized too]
    -> (offsets [E + 1] int64, counts [E] int32, row_of_copy [T, K] int64, source [T*K] int64,
        sorted_weights [T*K] float32[, xq [T, H] float8_e4m3fn, xs [T, G] float32])
Program 0 routes the T tokens (route.route_rows) and sorts the copies as kernels/align.sort_copies
does (the same order: expert, then copy index), with every copy in registers (at most 16 x 8);
programs 1 .. quantize the tokens (align.quantize_token_part). The values are bit for bit route()
followed by sort_copies().
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..quant import FP8_DTYPE
from .align import SORT_QUANT_CODES, quant_block_h, quant_parts, quantize_token_part
from .common import interpreting, pdl, pdl_start
from .route import launch_shape, route_rows


@triton.jit
def _route_sort_kernel(logits_ptr, bias_ptr, T, E, stride_l, scale,
                       offsets_ptr, counts_ptr, row_ptr, source_ptr, sorted_w_ptr,
                       x_ptr, xq_ptr, xs_ptr, H, stride_x, stride_xq, stride_xs,
                       K: tl.constexpr, K_POW2: tl.constexpr, E_POW2: tl.constexpr, SIGMOID: tl.constexpr,
                       RENORM: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                       QUANT_X: tl.constexpr, BLOCK_H: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Program 0: route tokens 0 .. T-1 (T <= BLOCK_T) and sort their copies in registers; programs
    1 ..: quantize_token_part(pid - 1)."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    if pid == 0:
        t = tl.arange(0, BLOCK_T).to(tl.int64)
        ids, wts = route_rows(logits_ptr, bias_ptr, t, T, E, stride_l, scale, K, K_POW2, E_POW2, SIGMOID, RENORM,
                              HAS_BIAS, GROUPS, TOPK_GROUPS, BLOCK_T)
        kk = tl.arange(0, K_POW2)
        out = t[:, None] * K + kk[None, :]
        store_ok = (t < T)[:, None] & (kk < K)[None, :]
        # the sort of kernels/align.place_copies / expert_offsets, on the copies in registers: copy
        # (t, k) is flat copy t * K + k; padding (t >= T or k >= K) sorts after everything
        N: tl.constexpr = BLOCK_T * K_POW2
        flat = tl.reshape(out, (N,))
        valid = tl.reshape(store_ok, (N,))
        key = tl.where(valid, tl.reshape(ids, (N,)), 2147483647)
        w_flat = tl.reshape(wts, (N,))
        before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None]) & (flat[None, :] < flat[:, None]))
        row = tl.sum(before.to(tl.int32), axis=1).to(tl.int64)
        tl.store(row_ptr + flat, row, mask=valid)
        tl.store(source_ptr + row, flat // K, mask=valid)
        tl.store(sorted_w_ptr + row, w_flat, mask=valid)
        for e0 in range(0, E + 1, BLOCK_E):
            e = e0 + tl.arange(0, BLOCK_E)
            tl.store(offsets_ptr + e, tl.sum((key[None, :] < e[:, None]).to(tl.int64), axis=1), mask=e <= E)
            tl.store(counts_ptr + e, tl.sum((key[None, :] == e[:, None]).to(tl.int32), axis=1), mask=e < E)
    else:
        quantize_token_part(x_ptr, xq_ptr, xs_ptr, pid - 1, H, stride_x, stride_xq, stride_xs, QUANT_X, BLOCK_H,
                            ROUND_IN_FP32)


def fits_one_program(tokens: int, num_experts: int) -> bool:
    """Whether route_and_sort takes these tokens: route's launch for them is one program."""
    return 0 < tokens <= launch_shape(triton.next_power_of_2(num_experts))[0]


def route_and_sort(logits: Tensor, bias: Tensor | None, top_k: int, scoring: str, renormalize: bool,
                   num_groups: int = 1, topk_groups: int = 1, scaling: float = 1.0,
                   x: Tensor | None = None, scheme: str = "none"):
    """The module docstring's call; T must fit one program (fits_one_program), x (when given) [T, H]
    with contiguous columns and scheme "fp8-channel" or "fp8-block"."""
    t, e = logits.shape
    if not fits_one_program(t, e):
        raise ValueError(f"route_and_sort takes 1 .. {launch_shape(triton.next_power_of_2(e))[0]} tokens of "
                         f"{e} experts (one routing program); got {t}")
    dev = logits.device
    n = t * top_k
    offsets = torch.empty(e + 1, dtype=torch.int64, device=dev)
    counts = torch.empty(e, dtype=torch.int32, device=dev)
    row = torch.empty(n, dtype=torch.int64, device=dev)
    source = torch.empty(n, dtype=torch.int64, device=dev)
    sorted_w = torch.empty(n, dtype=torch.float32, device=dev)
    quant_x, h, xq, xs = 0, 0, sorted_w, sorted_w  # unused pointers without x
    if x is not None:
        if scheme not in SORT_QUANT_CODES or x.shape[0] != t or (x.shape[1] and x.stride(1) != 1):
            raise ValueError(f"x must be [{t}, H] with unit column stride and scheme one of {sorted(SORT_QUANT_CODES)}")
        quant_x, h = SORT_QUANT_CODES[scheme], x.shape[1]
        xq = torch.empty((t, h), dtype=FP8_DTYPE, device=dev)
        xs = torch.empty((t, triton.cdiv(h, 128) if quant_x == 3 else 1), dtype=torch.float32, device=dev)
    block_h = quant_block_h(h)
    e_pow2 = triton.next_power_of_2(e)
    block_t, warps = launch_shape(e_pow2)
    b = bias.float().contiguous() if bias is not None else sorted_w
    _route_sort_kernel[(1 + quant_parts(t, h, quant_x, block_h),)](
        logits, b, t, e, logits.stride(0), float(scaling), offsets, counts, row, source, sorted_w,
        x if x is not None else sorted_w, xq, xs, h, x.stride(0) if x is not None else 0, xq.stride(0), xs.stride(0),
        K=top_k, K_POW2=triton.next_power_of_2(top_k), E_POW2=e_pow2, SIGMOID=scoring == "sigmoid",
        RENORM=renormalize, HAS_BIAS=bias is not None, GROUPS=num_groups, TOPK_GROUPS=topk_groups, BLOCK_T=block_t,
        BLOCK_E=64, QUANT_X=quant_x, BLOCK_H=block_h,
        ROUND_IN_FP32=interpreting(), num_warps=warps, **pdl(dev))
    out = (offsets, counts, row.view(t, top_k), source, sorted_w)
    return out if x is None else (*out, xq, xs)
