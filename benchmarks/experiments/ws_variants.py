"""Experiment (GPU): both GEMM operands through TMA descriptors, with and without Triton's Hopper
warp specialization (tl.range(..., warp_specialize=True)), against the shipped kernels.

    PYTHONPATH=$PWD python benchmarks/experiments/ws_variants.py --out $OUT/ws
A operand: the sorted rows [R, K] (materialized, contiguous per expert) as a [BLOCK_M, BLOCK_K] box
at the block's first row (rows past the expert's end are read but never stored).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moeflow.kernels.autotune import Shape, _layer_parts, random_batch, random_weights
from moeflow.kernels.common import RowLayout, block_rows, fp8_scale, gated_act, tile_ids, to_fp8
from moeflow.kernels.down import down
from moeflow.kernels.gate_up import gate_up
from moeflow.kernels.quant import quantize_rows
from moeflow.presets import preset_config


@triton.jit
def _gu(x_desc, xs_ptr, w_desc, ws_ptr, out_ptr, outs_ptr, meta_ptr, num_experts, num_blocks_m, I, H,
        stride_xs, stride_wse, stride_wsn, stride_out, stride_outs,
        Q: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, WS: tl.constexpr):
    pid_m, pid_n = tile_ids(num_blocks_m, I, BLOCK_N, GROUP_M)
    expert, row_start, row_end, _ = block_rows(pid_m, meta_ptr, num_experts, 1, BLOCK_M, E_POW2, False)
    if row_start >= row_end:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    rows_ld = tl.minimum(rows, row_end - 1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    g_row = (expert * 2 * I + pid_n * BLOCK_N).to(tl.int32)
    r0 = row_start.to(tl.int32)
    ws_e = ws_ptr + expert.to(tl.int64) * stride_wse
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in tl.range(0, tl.cdiv(H, BLOCK_K), warp_specialize=WS):
        a = x_desc.load([r0, kb * BLOCK_K])
        bg = w_desc.load([g_row, kb * BLOCK_K]).T
        bu = w_desc.load([g_row + I, kb * BLOCK_K]).T
        if Q == 3:
            kg = (kb * BLOCK_K) // 128
            a_s = tl.load(xs_ptr + rows_ld * stride_xs + kg)
            g_s = tl.load(ws_e + (cols // 128) * stride_wsn + kg)
            u_s = tl.load(ws_e + ((cols + I) // 128) * stride_wsn + kg)
            acc_g += tl.dot(a, bg) * (a_s[:, None] * g_s[None, :])
            acc_u += tl.dot(a, bu) * (a_s[:, None] * u_s[None, :])
        else:
            acc_g = tl.dot(a, bg, acc_g)
            acc_u = tl.dot(a, bu, acc_u)
    h = gated_act(acc_g, acc_u, 0).to(tl.bfloat16)
    ok = row_ok[:, None] & (cols < I)[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_out + cols[None, :]
    if Q == 3:
        hf = tl.reshape(h.to(tl.float32), (BLOCK_M, BLOCK_N // 128, 128))
        scale = fp8_scale(tl.max(tl.abs(hf), axis=2))
        q = tl.reshape(to_fp8(hf, scale[:, :, None], False), (BLOCK_M, BLOCK_N))
        tl.store(out_ptrs, q, mask=ok)
        groups = pid_n * (BLOCK_N // 128) + tl.arange(0, BLOCK_N // 128)
        tl.store(outs_ptr + rows[:, None] * stride_outs + groups[None, :], scale, mask=row_ok[:, None])
    else:
        tl.store(out_ptrs, h, mask=ok)


@triton.jit
def _dn(a_desc, as_ptr, w_desc, ws_ptr, rw_ptr, out_ptr, meta_ptr, num_experts, num_blocks_m, H, I,
        stride_as, stride_wse, stride_wsn, stride_out,
        Q: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, WS: tl.constexpr):
    pid_m, pid_n = tile_ids(num_blocks_m, H, BLOCK_N, GROUP_M)
    expert, row_start, row_end, _ = block_rows(pid_m, meta_ptr, num_experts, 1, BLOCK_M, E_POW2, False)
    if row_start >= row_end:
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    rows_ld = tl.minimum(rows, row_end - 1)
    w_row = (expert * H + pid_n * BLOCK_N).to(tl.int32)
    r0 = row_start.to(tl.int32)
    ws_e = ws_ptr + expert.to(tl.int64) * stride_wse
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in tl.range(0, tl.cdiv(I, BLOCK_K), warp_specialize=WS):
        a = a_desc.load([r0, kb * BLOCK_K])
        b = w_desc.load([w_row, kb * BLOCK_K]).T
        if Q == 3:
            kg = (kb * BLOCK_K) // 128
            a_s = tl.load(as_ptr + rows_ld * stride_as + kg)
            b_s = tl.load(ws_e + (cols // 128) * stride_wsn + kg)
            acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
        else:
            acc = tl.dot(a, b, acc)
    route_w = tl.load(rw_ptr + rows_ld)
    y = (acc * route_w[:, None]).to(tl.bfloat16)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y, mask=row_ok[:, None] & (cols < H)[None, :])


def bench(fn):
    from triton.testing import do_bench
    return do_bench(fn, warmup=5, rep=60, return_mode="median") * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/ws")
    ap.add_argument("--cases", default="qwen3-30b-a3b:16384,deepseek-v3:16384,mixtral-8x7b:16384,qwen3-30b-a3b:4096")
    ap.add_argument("--schemes", default="fp8-block,none")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    dev = torch.device("cuda")

    def record(**row):
        results.append(row)
        print(row, flush=True)
        (out / "ws.json").write_text(json.dumps(results, indent=1))

    for case in args.cases.split(","):
        preset, t = case.split(":")
        t = int(t)
        cfg = preset_config(preset)
        for scheme in args.schemes.split(","):
            shape = Shape(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k, scheme)
            w = random_weights(shape, dev)
            batch = random_batch(shape, t, dev)
            layout = RowLayout.of(batch)
            kc = _layer_parts(shape)[1].kernel_config(batch, w)
            e, i, h = shape.num_experts, shape.inter, shape.hidden
            x = batch.hidden.reshape(-1, h)
            r = x.shape[0]
            q = 3 if scheme == "fp8-block" else 0
            xq, xs = quantize_rows(x, scheme, layout) if q else (x, None)
            xs_ = xs if xs is not None else xq
            fl_gu, fl_dn = 2 * r * h * 2 * i, 2 * r * h * i
            ref_i, ref_x = gate_up(xq, xs, w.w13, w.w13_scale, layout, scheme, "silu", torch.bfloat16, kc.gate_up)
            us = bench(lambda: gate_up(xq, xs, w.w13, w.w13_scale, layout, scheme, "silu", torch.bfloat16, kc.gate_up))
            record(preset=preset, T=t, scheme=scheme, kernel="gate_up", variant="shipped", cfg=str(kc.gate_up), us=us,
                   tflops=fl_gu / us * 1e-6, err=0.0)
            ref_f = ref_i.float() if not q else (ref_i.float().view(-1, i // 128, 128) * ref_x[:, :, None]).view(-1, i)
            ws = w.w13_scale if q else xq
            wse, wsn = (ws.stride(0), ws.stride(1)) if q else (0, 0)
            bk = 128 if q else 64
            cfgs = ([(64, 128, bk, 8, 4), (64, 128, bk, 4, 4), (128, 128, bk, 8, 3)] if q else
                    [(128, 128, bk, 8, 3), (128, 128, bk, 8, 4), (64, 128, bk, 4, 4)])
            for bm, bn, bkk, nw, ns in cfgs:
                for wsp in (False, True):
                    inter = torch.empty((r, i), dtype=torch.float8_e4m3fn if q else torch.bfloat16, device=dev)
                    isc = torch.empty((r, i // 128), dtype=torch.float32, device=dev)
                    nbm = layout.num_row_blocks(bm)
                    grid = (nbm * triton.cdiv(i, bn),)
                    xd = TensorDescriptor.from_tensor(xq, [bm, bkk])
                    wd = TensorDescriptor.from_tensor(w.w13.view(e * 2 * i, h), [bn, bkk])

                    def run():
                        _gu[grid](xd, xs_, wd, ws, inter, isc, layout.meta, e, nbm, i, h, xs_.stride(0), wse, wsn,
                                  inter.stride(0), isc.stride(0), Q=q, E_POW2=layout.e_pow2, BLOCK_M=bm, BLOCK_N=bn,
                                  BLOCK_K=bkk, GROUP_M=8, WS=wsp, num_warps=nw, num_stages=ns)
                    try:
                        run()
                        torch.cuda.synchronize()
                        us = bench(run)
                        got = inter.float() if not q else (inter.float().view(-1, i // 128, 128) * isc[:, :, None]).view(-1, i)
                        err = float((got - ref_f).abs().max())
                    except Exception as exc:  # noqa: BLE001 - record and go on
                        us, err = float("nan"), repr(exc)[:300]
                    record(preset=preset, T=t, scheme=scheme, kernel="gate_up", variant="tma-a+b" + (" ws" if wsp else ""),
                           cfg=f"{bm}x{bn}x{bkk} w{nw} s{ns}", us=us, tflops=fl_gu / us * 1e-6, err=err)
            a, a_s = ref_i, (ref_x if q else None)
            a_s_ = a_s if a_s is not None else a
            rw = batch.weights.reshape(-1).float().contiguous()
            ref_o = down(a, a_s, w.w2, w.w2_scale, rw, layout, scheme, torch.bfloat16, kc.down)
            us = bench(lambda: down(a, a_s, w.w2, w.w2_scale, rw, layout, scheme, torch.bfloat16, kc.down))
            record(preset=preset, T=t, scheme=scheme, kernel="down", variant="shipped", cfg=str(kc.down), us=us,
                   tflops=fl_dn / us * 1e-6, err=0.0)
            ws2 = w.w2_scale if q else a
            wse2, wsn2 = (ws2.stride(0), ws2.stride(1)) if q else (0, 0)
            cfgs = ([(128, 128, bk, 8, 3), (64, 128, bk, 4, 4), (128, 128, bk, 4, 4)] if q else
                    [(128, 256, bk, 8, 3), (128, 128, bk, 8, 4), (128, 128, bk, 4, 4)])
            for bm, bn, bkk, nw, ns in cfgs:
                for wsp in (False, True):
                    o = torch.empty((r, h), dtype=torch.bfloat16, device=dev)
                    nbm = layout.num_row_blocks(bm)
                    grid = (nbm * triton.cdiv(h, bn),)
                    ad = TensorDescriptor.from_tensor(a, [bm, bkk])
                    wd = TensorDescriptor.from_tensor(w.w2.view(e * h, i), [bn, bkk])

                    def run():
                        _dn[grid](ad, a_s_, wd, ws2, rw, o, layout.meta, e, nbm, h, i, a_s_.stride(0), wse2, wsn2,
                                  o.stride(0), Q=q, E_POW2=layout.e_pow2, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bkk,
                                  GROUP_M=8, WS=wsp, num_warps=nw, num_stages=ns)
                    try:
                        run()
                        torch.cuda.synchronize()
                        us = bench(run)
                        err = float((o.float() - ref_o.float()).abs().max())
                    except Exception as exc:  # noqa: BLE001
                        us, err = float("nan"), repr(exc)[:300]
                    record(preset=preset, T=t, scheme=scheme, kernel="down", variant="tma-a+b" + (" ws" if wsp else ""),
                           cfg=f"{bm}x{bn}x{bkk} w{nw} s{ns}", us=us, tflops=fl_dn / us * 1e-6, err=err)
            del w, batch
            torch.cuda.empty_cache()
    print("\n| preset | T | scheme | kernel | variant | cfg | µs | TFLOP/s | err |")
    for x in results:
        err = x["err"] if isinstance(x["err"], str) else f"{x['err']:.2g}"
        print(f"| {x['preset']} | {x['T']} | {x['scheme']} | {x['kernel']} | {x['variant']} | {x['cfg'][-40:]} | "
              f"{x['us']:.0f} | {x['tflops']:.0f} | {err[:80]} |")


if __name__ == "__main__":
    main()
