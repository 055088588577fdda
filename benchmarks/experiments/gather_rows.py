"""The row copy before the TMA gate_up kernels (kernels/quant.gather_rows, one row per program) against a
variant that moves several rows per program (16 KiB per K chunk; here only: it measured no faster,
benchmarks/results/gather_rows_2026-11-30_h200.md), alone and in the whole layer.

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD python benchmarks/experiments/gather_rows.py [OUT.json]
Alone: do_bench median (L2 flushed), copies checked equal. Layer: bench_layer's graph_us, the two versions
in turns over two rounds (each patched in for its turns).
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from bench_layer import Case, graph_us  # noqa: E402
from moeflow.experts import create_runner  # noqa: E402
from moeflow.kernels import quant  # noqa: E402


@triton.jit
def _rows_kernel(x_ptr, xs_ptr, src_ptr, out_ptr, outs_ptr, R, K, G, stride_x, stride_xs, stride_out, stride_outs,
                 BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < R
    src = tl.load(src_ptr + r, mask=ok, other=0)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        m = ok[:, None] & (cols < K)[None, :]
        tl.store(out_ptr + r[:, None] * stride_out + cols[None, :],
                 tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=m), mask=m)
    g = tl.arange(0, BLOCK_G)
    m = ok[:, None] & (g < G)[None, :]
    tl.store(outs_ptr + r[:, None] * stride_outs + g[None, :], tl.load(xs_ptr + src[:, None] * stride_xs + g[None, :],
                                                                      mask=m), mask=m)


def rows(x, x_scale, source_rows):
    r, (_, k) = source_rows.numel(), x.shape
    g = x_scale.shape[1] if x_scale is not None else 0
    out = torch.empty((r, k), dtype=x.dtype, device=x.device)
    outs = torch.empty((r, g), dtype=torch.float32, device=x.device) if x_scale is not None else None
    if r and k:
        xb, ob = x.view(torch.uint8), out.view(torch.uint8)
        kb = k * x.element_size()
        block_k = min(4096, triton.next_power_of_2(kb))
        block_r = max(1, 16384 // block_k)
        xs = x_scale if x_scale is not None else ob
        _rows_kernel[(triton.cdiv(r, block_r),)](xb, xs, source_rows, ob, outs if outs is not None else ob, r, kb, g,
                                                 xb.stride(0), xs.stride(0), ob.stride(0),
                                                 outs.stride(0) if outs is not None else 0, BLOCK_R=block_r,
                                                 BLOCK_K=block_k, BLOCK_G=triton.next_power_of_2(max(g, 1)), num_warps=4)
    return out, outs


ALONE = [("qwen3 fp8 T=4096", 4096, 2048, 8, torch.float8_e4m3fn, 16), ("qwen3 fp8 T=16384", 16384, 2048, 8, torch.float8_e4m3fn, 16),
         ("deepseek-v3 fp8 T=16384", 16384, 7168, 8, torch.float8_e4m3fn, 56),
         ("deepseek-v3 bf16 T=16384", 16384, 7168, 8, torch.bfloat16, 0), ("mixtral bf16 T=16384", 16384, 4096, 2, torch.bfloat16, 0)]
LAYER = [("qwen3-30b-a3b", "fp8-block", (4096, 16384)), ("mixtral-8x7b", "none", (16384,)), ("deepseek-v3", "fp8-block", (16384,)),
         ("deepseek-v3", "none", (16384,))]


def main():
    out = {"alone": {}, "layer": {}}
    one_row, new = quant.gather_rows, rows
    for name, t, h, k, dtype, g in ALONE:
        x = torch.randn(t, h, device="cuda").to(dtype)
        xs = torch.rand(t, g, device="cuda") if g else None
        src = torch.randint(0, t, (t * k,), device="cuda")
        a, b = one_row(x, xs, src), new(x, xs, src)
        assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and (g == 0 or torch.equal(a[1], b[1]))
        us = [do_bench(lambda f=f: f(x, xs, src), return_mode="median") * 1e3 for f in (one_row, new)]
        nbytes = t * k * h * x.element_size()
        out["alone"][name] = dict(one_row_us=round(us[0], 1), rows_us=round(us[1], 1), written_GBps=[round(nbytes / u / 1e3) for u in us])
        print(name, out["alone"][name], flush=True)
        del x, xs, src, a, b
    for preset, scheme, tokens in LAYER:
        torch.cuda.empty_cache()
        case = Case(preset, scheme)
        runner = create_runner("triton", case.cfg.replace(runner="triton"), case.scheme)
        for t in tokens:
            x, logits = case.inputs(t, 1)[0]
            fn = lambda: case.layer(runner, x, logits)  # noqa: E731
            res = {"one_row": [], "rows": []}
            for _ in range(2):
                for label, f in (("one_row", one_row), ("rows", new)):
                    quant.gather_rows = f
                    res[label].append(round(graph_us(fn), 1))
            quant.gather_rows = one_row
            out["layer"][f"{preset} {scheme} T={t}"] = res
            print(preset, scheme, t, res, flush=True)
        del case, runner
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
