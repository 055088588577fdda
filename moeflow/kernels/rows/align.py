"""Token copies and expert rows: the block alignment as a table, and the one-launch sort of small batches.

align_blocks (_align_kernel; reference align_blocks_torch): table [B, 3] int64, B = RowLayout.num_row_blocks(BLOCK_M),
    table[b] = (expert, first row, end row) of block b; (-1, 0, 0) for a block with no rows. The GEMM kernels
    compute their block's rows themselves (common.block_rows); this writes what each program sees, for tests.
sort_copies (_sort_copies_kernel; reference moeflow.dispatch.expert_sort.sort_by_expert_torch): token copies
    grouped by expert, stable, for decode-sized batches (MAX_FUSED_COPIES), optionally quantizing the tokens in the
    same launch (quantize_token_part, token_quant_launch; the other sorts use them too).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...quant import FP8_DTYPE
from ..common import RowLayout, block_rows, cdiv, fp8_scale, interpreting, next_pow2, pdl, pdl_start, to_fp8


@triton.jit
def _align_kernel(meta_ptr, table_ptr, num_experts, capacity,
                  BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, MASKED: tl.constexpr):
    """Program b writes table[b] (module docstring) from common.block_rows."""
    pid = tl.program_id(0)
    expert, start, end, _ = block_rows(pid, meta_ptr, num_experts, capacity, BLOCK_M, E_POW2, MASKED)
    empty = start >= end
    tl.store(table_ptr + pid * 3, tl.where(empty, -1, expert).to(tl.int64))
    tl.store(table_ptr + pid * 3 + 1, tl.where(empty, 0, start).to(tl.int64))
    tl.store(table_ptr + pid * 3 + 2, tl.where(empty, 0, tl.minimum(start + BLOCK_M, end)).to(tl.int64))


def align_blocks(layout: RowLayout, block_m: int) -> Tensor:
    """-> table [B, 3] int64 (module docstring), computed by the kernels' own alignment code."""
    b = layout.num_row_blocks(block_m)
    table = torch.empty((b, 3), dtype=torch.int64, device=layout.meta.device)
    if b:
        _align_kernel[(b,)](layout.meta, table, layout.num_experts, max(layout.capacity, 1),
                            BLOCK_M=block_m, E_POW2=layout.e_pow2, MASKED=layout.masked)
    return table


def align_blocks_torch(layout: RowLayout, block_m: int) -> Tensor:
    """Reference of align_blocks, in Python over host counts."""
    rows = []
    if layout.masked:
        c = layout.capacity
        for e, n in enumerate(layout.meta.tolist()):
            n = min(n, c)
            for j in range(cdiv(c, block_m)):
                lo = e * c + j * block_m
                rows.append((e, lo, min(lo + block_m, e * c + n)) if j * block_m < n else (-1, 0, 0))
    else:
        off = layout.meta.tolist()
        for e in range(layout.num_experts):
            for lo in range(off[e], off[e + 1], block_m):
                rows.append((e, lo, min(lo + block_m, off[e + 1])))
    b = layout.num_row_blocks(block_m)
    rows += [(-1, 0, 0)] * (b - len(rows))
    return torch.tensor(rows, dtype=torch.int64).reshape(b, 3)


# ---------------------------------------------------------------- sort of token copies by expert
MAX_FUSED_COPIES = 2048  # sort_copies' comparison sort is O(copies^2) work: meant for decode-sized batches


@triton.jit
def _sort_copies_kernel(ids_ptr, w_ptr, offsets_ptr, counts_ptr, row_ptr, source_ptr, sorted_w_ptr, num_copies, num_experts,
                        x_ptr, xq_ptr, xs_ptr, H, stride_x, stride_xq, stride_xs, num_tokens,
                        TOP_K: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_E: tl.constexpr,
                        QUANT_X: tl.constexpr = 0, BLOCK_H: tl.constexpr = 128, ROUND_IN_FP32: tl.constexpr = False,
                        QROWS: tl.constexpr = 1, PDL: tl.constexpr = False):
    """Programs 0 .. cdiv(copies, BLOCK_I)-1 place copies; the next cdiv(E + 1, BLOCK_E) write
    offsets (and counts) for BLOCK_E experts each; with QUANT_X (1: fp8-tensor, 2: fp8-channel, 3: fp8-block)
    the rest quantize the tokens x [T, H] (T = num_tokens = copies / TOP_K) -> xq [T, H] fp8, xs [T, G] float32,
    as rows/quant.py does (quantize_token_part).

    The sorted row of copy i is the number of copies before it in (expert, copy index) order, the
    stable sort's order: #{j : ids[j] < ids[i]} + #{j < i : ids[j] == ids[i]}.
    offsets[e] = #{j : ids[j] < e} for e in 0 .. E; counts[e] = #{j : ids[j] == e} for e in 0 .. E-1.
    """
    pdl_start(PDL)
    pid = tl.program_id(0)
    copy_blocks = tl.cdiv(num_copies, BLOCK_I)
    if pid < copy_blocks:
        i = pid * BLOCK_I + tl.arange(0, BLOCK_I)
        ok = i < num_copies
        ids_i = tl.load(ids_ptr + i, mask=ok, other=0)
        row = tl.zeros((BLOCK_I,), dtype=tl.int32)
        for j0 in range(0, num_copies, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            ids_j = tl.load(ids_ptr + j, mask=j < num_copies, other=2147483647)  # past the end: after everything
            before = (ids_j[None, :] < ids_i[:, None]) | ((ids_j[None, :] == ids_i[:, None]) & (j[None, :] < i[:, None]))
            row += tl.sum(before.to(tl.int32), axis=1)
        row64 = row.to(tl.int64)
        tl.store(row_ptr + i, row64, mask=ok)
        tl.store(source_ptr + row64, (i // TOP_K).to(tl.int64), mask=ok)
        tl.store(sorted_w_ptr + row64, tl.load(w_ptr + i, mask=ok, other=0.0), mask=ok)
    elif pid < copy_blocks + tl.cdiv(num_experts + 1, BLOCK_E):
        e = (pid - copy_blocks) * BLOCK_E + tl.arange(0, BLOCK_E)
        below = tl.zeros((BLOCK_E,), dtype=tl.int32)
        equal = tl.zeros((BLOCK_E,), dtype=tl.int32)
        for j0 in range(0, num_copies, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            ids_j = tl.load(ids_ptr + j, mask=j < num_copies, other=2147483647)
            below += tl.sum((ids_j[None, :] < e[:, None]).to(tl.int32), axis=1)
            equal += tl.sum((ids_j[None, :] == e[:, None]).to(tl.int32), axis=1)
        tl.store(offsets_ptr + e, below.to(tl.int64), mask=e <= num_experts)
        tl.store(counts_ptr + e, equal, mask=e < num_experts)
    else:
        quantize_token_part(x_ptr, xq_ptr, xs_ptr, pid - copy_blocks - tl.cdiv(num_experts + 1, BLOCK_E), H, stride_x,
                            stride_xq, stride_xs, num_tokens, QUANT_X, BLOCK_H, ROUND_IN_FP32, QROWS)


@triton.jit
def quantize_token_part(x_ptr, xq_ptr, xs_ptr, q, H, stride_x, stride_xq, stride_xs, T,
                        QUANT_X: tl.constexpr, BLOCK_H: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
                        QROWS: tl.constexpr = 1):
    """Part q of the tokens' quantization x [T, H] -> xq [T, H] fp8, xs [T, G] float32, as
    rows/quant.py computes it: QUANT_X 3 (fp8-block) the columns c * BLOCK_H .. of tokens
    (q // cdiv(H, BLOCK_H)) * QROWS .. + QROWS - 1 (c = q % cdiv(H, BLOCK_H); BLOCK_H / 128 groups a token);
    1 (fp8-tensor) the same columns, by the amax of all of x, which every part takes again (T * H < 2**30 reads a
    part: meant for decode-sized batches, expert_sort.TENSOR_QUANT_IN_SORT_MAX), xs [T, 1] all equal; 2
    (fp8-channel) token q's row amax, then its row; 0: nothing. The sorts' extra programs run it
    (token_quant_launch says how many, and QROWS)."""
    if QUANT_X == 1 or QUANT_X == 3:  # part q: BLOCK_H columns of QROWS tokens
        per_token = tl.cdiv(H, BLOCK_H)
        t = (q // per_token).to(tl.int64) * QROWS + tl.arange(0, QROWS)
        c = q % per_token
        cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = (t < T)[:, None] & (cols < H)[None, :]
        xv = tl.load(x_ptr + t[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if QUANT_X == 3:
            xg = tl.reshape(xv, (QROWS, BLOCK_H // 128, 128))
            scale = fp8_scale(tl.max(tl.abs(xg), axis=2))
            tl.store(xq_ptr + t[:, None] * stride_xq + cols[None, :],
                     tl.reshape(to_fp8(xg, scale[:, :, None], ROUND_IN_FP32), (QROWS, BLOCK_H)), mask=ok)
            groups = c * (BLOCK_H // 128) + tl.arange(0, BLOCK_H // 128)
            tl.store(xs_ptr + t[:, None] * stride_xs + groups[None, :], scale,
                     mask=(t < T)[:, None] & (groups < tl.cdiv(H, 128))[None, :])
        else:
            n = T * H  # below 2**30 (token_quant_launch); T may come specialized to a plain 1
            amax = tl.zeros((_TENSOR_AMAX_BLOCK,), dtype=tl.float32)
            for i0 in range(0, n, _TENSOR_AMAX_BLOCK):
                i = i0 + tl.arange(0, _TENSOR_AMAX_BLOCK)
                xa = tl.load(x_ptr + (i // H).to(tl.int64) * stride_x + i % H, mask=i < n, other=0.0)
                amax = tl.maximum(amax, tl.abs(xa.to(tl.float32)))
            scale = fp8_scale(tl.max(amax, axis=0))
            tl.store(xq_ptr + t[:, None] * stride_xq + cols[None, :], to_fp8(xv, scale, ROUND_IN_FP32), mask=ok)
            if c == 0:
                tl.store(xs_ptr + t * stride_xs, tl.zeros((QROWS,), tl.float32) + scale, mask=t < T)
    elif QUANT_X == 2:
        t = q.to(tl.int64)
        amax = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_H):
            cols = k0 + tl.arange(0, BLOCK_H)
            amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + t * stride_x + cols, mask=cols < H, other=0.0).to(tl.float32)))
        scale = fp8_scale(tl.max(amax, axis=0))
        tl.store(xs_ptr + t * stride_xs, scale)
        for k0 in range(0, H, BLOCK_H):
            cols = k0 + tl.arange(0, BLOCK_H)
            xv = tl.load(x_ptr + t * stride_x + cols, mask=cols < H, other=0.0).to(tl.float32)
            tl.store(xq_ptr + t * stride_xq + cols, to_fp8(xv, scale, ROUND_IN_FP32), mask=cols < H)


_QUANT_PARTS = 1024  # quant_rows keeps at least this many parts (8 a streaming multiprocessor on H200)
SORT_QUANT_CODES = {"fp8-tensor": 1, "fp8-channel": 2, "fp8-block": 3}  # schemes the sorts quantize tokens for: QUANT_X
_TENSOR_AMAX_BLOCK = tl.constexpr(4096)  # elements of x a fp8-tensor part reads per step of its amax loop


def token_quant_launch(x: Tensor | None, scheme: str, t: int, unused: Tensor):
    """What a sort kernel needs to also quantize x [t, H] by ``scheme`` (quantize_token_part) ->
    (programs it adds, its arguments (x_ptr, xq_ptr, xs_ptr, H, stride_x, stride_xq, stride_xs, num_tokens), its
    constexprs, the outputs: (xq [t, H] fp8, xs [t, G] float32) fresh, or () without x). x None:
    no programs, ``unused`` in the pointer places. ValueError unless x is [t, H] with unit column
    stride and the scheme one the sorts quantize for (SORT_QUANT_CODES). fp8-tensor: every part reads all
    of x (quantize_token_part): fast only for small batches, and refused (ValueError) from 2**30 elements."""
    if x is None:
        return 0, (unused, unused, unused, 0, 0, 0, 0, 0), dict(QUANT_X=0), ()
    if scheme not in SORT_QUANT_CODES or x.dim() != 2 or x.shape[0] != t or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"x must be [{t}, H] with unit column stride and scheme one of {sorted(SORT_QUANT_CODES)}")
    code, h = SORT_QUANT_CODES[scheme], x.shape[1]
    if code == 1 and x.numel() >= 2 ** 30:  # the amax loop's int32 indices run up to a block past T * H
        raise ValueError(f"fp8-tensor tokens are quantized in the sort below 2**30 elements, got {tuple(x.shape)}")
    block_h = min(1024, next_pow2(max(h, 128)))  # up to 8 fp8-block groups per program
    qrows = 1 if code == 2 else quant_rows(t, cdiv(h, block_h), block_h)
    parts = 0 if not h else t if code == 2 else cdiv(t, qrows) * cdiv(h, block_h)
    xq = torch.empty((t, h), dtype=FP8_DTYPE, device=x.device)
    xs = torch.empty((t, cdiv(h, 128) if code == 3 else 1), dtype=torch.float32, device=x.device)
    args = (x, xq, xs, h, x.stride(0), xq.stride(0), xs.stride(0), t)
    return parts, args, dict(QUANT_X=code, BLOCK_H=block_h, ROUND_IN_FP32=interpreting(), QROWS=qrows), (xq, xs)


def quant_rows(t: int, per_token: int, block_h: int) -> int:
    """Tokens a quantizing part takes (quantize_token_part's QROWS): one while the parts would number at most
    _QUANT_PARTS, else up to 8192 elements a part, keeping at least _QUANT_PARTS parts. Why: a program a token
    (and BLOCK_H columns) has the GPU start tens of thousands of small programs at large T, and their start cost,
    not the traffic, then bounds the sort."""
    rows = 1
    while rows * 2 * block_h <= 8192 and cdiv(t, rows * 2) * per_token >= _QUANT_PARTS:
        rows *= 2
    return rows


def sort_copies(topk_ids: Tensor, topk_weights: Tensor, num_experts: int, x: Tensor | None = None,
                scheme: str = "none"):
    """Token copies grouped by expert in one launch (decode-sized batches: copies <= MAX_FUSED_COPIES).

    topk_ids [T, K] int (ids in 0 .. E-1), topk_weights [T, K] float32
    -> (offsets [E + 1] int64, counts [E] int32, row_of_copy [T, K] int64, source [T*K] int64,
        sorted_weights [T*K] float32):
    sorted row r holds copy order[r] (stable sort by expert), source[r] = order[r] // K its token,
    row_of_copy the inverse; the same values as its torch reference,
    moeflow.dispatch.expert_sort.sort_by_expert_torch (torch-only: the dispatcher's path without
    triton). No host synchronization.
    x [T, H] (layer dtype, unit column stride) with scheme "fp8-tensor", "fp8-channel" or "fp8-block": the same
    launch also quantizes the tokens, and the tuple gains (xq [T, H] float8_e4m3fn, xs [T, G]
    float32), bit for bit rows/quant.quantize_activation(x, scheme).
    """
    t, k = topk_ids.shape
    n = t * k
    dev = topk_ids.device
    offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=dev)
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    row = torch.empty(n, dtype=torch.int64, device=dev)
    source = torch.empty(n, dtype=torch.int64, device=dev)
    sorted_w = torch.empty(n, dtype=torch.float32, device=dev)
    block_i, block_j, block_e = 64, 64, 64
    parts, quant_args, quant_consts, quantized = token_quant_launch(x, scheme, t, sorted_w)
    grid = cdiv(n, block_i) + cdiv(num_experts + 1, block_e) + parts
    _sort_copies_kernel[(grid,)](topk_ids.reshape(-1).to(torch.int32).contiguous(),
                                 topk_weights.reshape(-1).float().contiguous(), offsets, counts, row, source, sorted_w,
                                 n, num_experts, *quant_args, TOP_K=k, BLOCK_I=block_i, BLOCK_J=block_j,
                                 BLOCK_E=block_e, **quant_consts, **pdl(dev))
    return (offsets, counts, row.view(t, k), source, sorted_w, *quantized)
