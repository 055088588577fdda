"""Would the down GEMM's epilogue adding its rows straight into the token outputs (atomics) beat writing
y [R, H] and summing it afterwards (kernels/reduce.moe_sum)? A measurement of the atomic traffic alone,
before any kernel is written: each way on the same sorted rows y (uniform random routing), µs per call
from a CUDA graph (10 calls a graph, median of 5 replays; y is larger than L2 at every size here).

  moe_sum        reduce.moe_sum(y, row_of_copy): reads y by token, writes out [T, H] (today's path)
  atomic_f32     out32 [T, H] float32 zeroed, every row of y added into its token's row with
                 tl.atomic_add (relaxed), then out32 cast to y.dtype: what a fused epilogue would add
  atomic_bf16    the same, added straight into a zeroed out [T, H] y.dtype (rounding at every add)
A fused down would save y's write inside the GEMM and moe_sum's read of it (2 R H bytes each); it would
pay the atomics instead. If atomic_f32 (less y's read, which the fused form would not do) is not well
under moe_sum's time, the fusion does not pay.

    PYTHONPATH=$PWD python benchmarks/experiments/atomic_combine.py [OUT.json]
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl

from moeflow.kernels.reduce import moe_sum

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sort_variants import graph_us  # noqa: E402  (a CUDA graph of calls, median of replays, µs per call)

SHAPES = [("qwen3-30b-a3b", 4096, 2048, 8, 128), ("qwen3-30b-a3b", 16384, 2048, 8, 128),
          ("mixtral-8x7b", 4096, 4096, 2, 8), ("deepseek-v3", 4096, 7168, 8, 256)]


@triton.jit
def _scatter_add_kernel(y_ptr, tok_ptr, out_ptr, R, H, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = (rows < R)[:, None] & (cols < H)[None, :]
    tok = tl.load(tok_ptr + rows, mask=rows < R, other=0).to(tl.int64)
    v = tl.load(y_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], mask=ok, other=0.0)
    tl.atomic_add(out_ptr + tok[:, None] * H + cols[None, :], v.to(out_ptr.dtype.element_ty), mask=ok, sem="relaxed")


def scatter_add(y, tok, out, block_r=64, block_h=128):
    r, h = y.shape
    _scatter_add_kernel[(triton.cdiv(r, block_r), triton.cdiv(h, block_h))](y, tok, out, r, h, BLOCK_R=block_r,
                                                                             BLOCK_H=block_h, num_warps=4)


def sorted_rows(t, h, k, e):
    """Uniform random top-k routing of T tokens over E experts, its copies sorted by expert -> (row_of_copy
    [T * K] int64: the row of y holding copy t * K + k, tok [T * K] int32: each row's token, y [T * K, H] bf16
    random rows in that order)."""
    ids = torch.rand(t, e, device="cuda").topk(k, dim=1).indices.flatten()
    order = torch.sort(ids, stable=True).indices  # row r holds copy order[r]
    row_of_copy = torch.empty_like(order)
    row_of_copy[order] = torch.arange(order.numel(), device="cuda")
    return row_of_copy, (order // k).to(torch.int32), torch.randn(t * k, h, device="cuda", dtype=torch.bfloat16)


def main():
    out = []
    for name, t, h, k, e in SHAPES:
        row_of_copy, tok, y = sorted_rows(t, h, k, e)
        ref = moe_sum(y, row_of_copy, k).float()
        out32 = torch.empty(t, h, device="cuda", dtype=torch.float32)
        out16 = torch.empty(t, h, device="cuda", dtype=torch.bfloat16)

        def f32():
            out32.zero_()
            scatter_add(y, tok, out32)
            return out32.to(torch.bfloat16)

        def bf16():
            out16.zero_()
            scatter_add(y, tok, out16)

        row = dict(preset=name, T=t, H=h, K=k, y_MB=round(y.numel() * 2 / 1e6, 1),
                   moe_sum=graph_us(lambda: moe_sum(y, row_of_copy, k), calls=10),
                   atomic_f32=graph_us(f32, calls=10), atomic_bf16=graph_us(bf16, calls=10))
        f32()
        bf16()
        torch.cuda.synchronize()
        row["err_f32"] = (out32 - ref).abs().max().item()  # ref is rounded once; out32 is not rounded yet
        row["err_bf16"] = (out16.float() - ref).abs().max().item()
        out.append(row)
        print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
