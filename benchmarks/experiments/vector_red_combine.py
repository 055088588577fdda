"""Would the down GEMM's epilogue adding its rows into the token outputs pay with 16-byte vector reductions?
atomic_combine.py (2026-11-30) measured element atomics (tl.atomic_add: one 4-byte red per element) at
3.4-4.5x the top-k sum (float32) and 1.9x (bfloat16). sm_90 also has vector reductions to global memory,
16 bytes an instruction: `red.global.add.v4.f32` and `red.global.add.noftz.v4.bf16x2`. Measured here, on
sorted rows of uniform random routing, µs a call (a CUDA graph of 10 calls, median of 5 replays):

  moe_sum      kernels/reduce.moe_sum(y, row_of_copy): today's top-k sum (reads y, writes out [T, H])
  v4f32        out32 [T, H] float32 zeroed, each row of y added into its token's row, 4 floats a red,
               then out32 cast to bf16: what a fused float32 epilogue adds to the GEMM
  v4bf16x2     the same into a zeroed out [T, H] bfloat16, 8 values a red (rounds at every add)
  *_hot        the same reductions with y read from 256 rows that stay in L2 (the values a fused
               epilogue holds in registers): the reductions' own cost
A fused down saves y's write (2 R H bytes) in the GEMM and moe_sum's whole time; it pays the *_hot
time (plus the zeroing and the cast). Reductions are unordered, so the sums are not deterministic.

    PYTHONPATH=$PWD python benchmarks/experiments/vector_red_combine.py [OUT.json]
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl

from moeflow.kernels.reduce import moe_sum

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from atomic_combine import SHAPES, sorted_rows  # noqa: E402  (the same shapes and routings as the element atomics')
from sort_variants import graph_us  # noqa: E402


def _red_asm(n_vals: int, kind: str) -> str:
    """Inline PTX for one packed group of n_vals elements: outputs $0..$(n-1) (dummies), n pointers, then the
    values (4 registers: float32 one a register, bfloat16 two, as Triton packs 16-bit elements)."""
    outs = "".join(f"mov.u32 ${i}, 0;\n" for i in range(n_vals))
    vals = ", ".join(f"${2 * n_vals + i}" for i in range(4))
    op = "red.global.add.v4.f32" if kind == "f32" else "red.global.add.noftz.v4.bf16x2"
    return outs + f"{op} [${n_vals}], {{{vals}}};"


@triton.jit
def _vector_red_kernel(y_ptr, tok_ptr, out_ptr, R, H, HOT_ROWS: tl.constexpr, F32: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_H), 8), 8)
    ok = (rows < R)[:, None] & (cols < H)[None, :]
    tok = tl.load(tok_ptr + rows, mask=rows < R, other=0).to(tl.int64)
    src = rows % HOT_ROWS if HOT_ROWS > 0 else rows
    v = tl.load(y_ptr + src.to(tl.int64)[:, None] * H + cols[None, :], mask=ok, other=0.0)
    dst = out_ptr + tok[:, None] * H + cols[None, :]
    if F32:
        tl.inline_asm_elementwise(_RED_F32, "=r,=r,=r,=r,l,l,l,l,f,f,f,f", [dst.to(tl.int64), v.to(tl.float32)],
                                  dtype=tl.int32, is_pure=False, pack=4)
    else:
        tl.inline_asm_elementwise(_RED_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,l,l,l,l,l,l,l,l,r,r,r,r",
                                  [dst.to(tl.int64), v.to(tl.bfloat16)], dtype=tl.int32, is_pure=False, pack=8)


_RED_F32 = tl.constexpr(_red_asm(4, "f32"))
_RED_BF16 = tl.constexpr(_red_asm(8, "bf16"))


def vector_red(y, tok, out, hot_rows=0, block_r=32, block_h=256):
    r, h = y.shape
    _vector_red_kernel[(triton.cdiv(r, block_r), triton.cdiv(h, block_h))](
        y, tok, out, r, h, HOT_ROWS=hot_rows, F32=out.dtype == torch.float32, BLOCK_R=block_r, BLOCK_H=block_h,
        num_warps=4)


def main():
    out = []
    for name, t, h, k, e in SHAPES:
        row_of_copy, tok, y = sorted_rows(t, h, k, e)
        ref = moe_sum(y, row_of_copy, k).double()  # today's output, rounded once
        out32 = torch.empty(t, h, device="cuda", dtype=torch.float32)
        out16 = torch.empty(t, h, device="cuda", dtype=torch.bfloat16)

        def f32(hot=0):
            out32.zero_()
            vector_red(y, tok, out32, hot)
            return out32.to(torch.bfloat16)

        def bf16(hot=0):
            out16.zero_()
            vector_red(y, tok, out16, hot)

        row = dict(preset=name, T=t, H=h, K=k, y_MB=round(y.numel() * 2 / 1e6, 1),
                   moe_sum=graph_us(lambda: moe_sum(y, row_of_copy, k), calls=10),
                   v4f32=graph_us(f32, calls=10), v4bf16x2=graph_us(bf16, calls=10),
                   v4f32_hot=graph_us(lambda: f32(256), calls=10), v4bf16x2_hot=graph_us(lambda: bf16(256), calls=10),
                   zero_cast_f32=graph_us(lambda: out32.zero_().to(torch.bfloat16), calls=10))
        res32 = f32()
        bf16()
        torch.cuda.synchronize()
        scale = ref.abs().max().item()
        row["err_moe_sum_vs_f32"] = (res32.double() - ref).abs().max().item() / scale  # both round once: 0 or 1 ulp
        row["err_f32_unrounded"] = (out32.double() - ref).abs().max().item() / scale
        row["err_bf16"] = (out16.double() - ref).abs().max().item() / scale
        out.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
