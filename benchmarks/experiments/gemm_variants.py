"""Experiment (GPU): main-loop variants of the large-T gate_up and down GEMMs, timed against the
shipped kernels on the same sorted batch. Not part of the library; it decides what the library does.

    PYTHONPATH=$PWD python benchmarks/experiments/gemm_variants.py --out $OUT/variants

Variants:
  gate_up cur   kernels/gate_up.py as shipped (two accumulators, pointer loads), shipped tuned config
  gate_up il    one accumulator over interleaved gate/up columns (col 2j = gate row j, 2j+1 = up row j),
                pointer loads, split in the epilogue; fp8-block: output quantized in the epilogue when
                BLOCK_N/2 is a multiple of 128, else bf16 out (+ the separate quant kernel's time added)
  gate_up tma   two accumulators, weights through a TMA tensor descriptor ([E*2I, H] view)
  down cur / tma  the same for down
Each kernel's output is checked against the shipped kernel's (max abs diff printed).
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
from moeflow.kernels.configs import GemmConfig
from moeflow.kernels.down import down
from moeflow.kernels.gate_up import gate_up
from moeflow.kernels.quant import quantize_groups, quantize_rows
from moeflow.presets import preset_config


@triton.jit
def _gu_il(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, outs_ptr, meta_ptr, num_experts, num_blocks_m, I, H,
           stride_x, stride_xs, stride_we, stride_wn, stride_wse, stride_wsn, stride_out, stride_outs,
           Q: tl.constexpr, OUT_FP8: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    HALF: tl.constexpr = BLOCK_N // 2
    pid_m, pid_n = tile_ids(num_blocks_m, 2 * I, BLOCK_N, GROUP_M)
    expert, row_start, row_end, _ = block_rows(pid_m, meta_ptr, num_experts, 1, BLOCK_M, E_POW2, False)
    if row_start >= row_end:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    rows_ld = tl.minimum(rows, row_end - 1)
    j = tl.arange(0, BLOCK_N)
    wrow = (pid_n * HALF + j // 2) % I + (j % 2) * I
    rk = tl.arange(0, BLOCK_K)
    w_e = w_ptr + expert.to(tl.int64) * stride_we
    ws_e = ws_ptr + expert.to(tl.int64) * stride_wse
    x_ptrs = x_ptr + rows_ld[:, None] * stride_x + rk[None, :]
    b_ptrs = w_e + wrow[None, :].to(tl.int64) * stride_wn + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(H, BLOCK_K)):
        a = tl.load(x_ptrs)
        b = tl.load(b_ptrs)
        if Q == 3:
            kg = (kb * BLOCK_K) // 128
            a_s = tl.load(xs_ptr + rows_ld * stride_xs + kg)
            b_s = tl.load(ws_e + (wrow // 128) * stride_wsn + kg)
            acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    g, u = tl.split(tl.reshape(acc, (BLOCK_M, HALF, 2)))
    h = gated_act(g, u, 0).to(tl.bfloat16)
    cols = pid_n * HALF + tl.arange(0, HALF)
    ok = row_ok[:, None] & (cols < I)[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_out + cols[None, :]
    if OUT_FP8:
        hf = tl.reshape(h.to(tl.float32), (BLOCK_M, HALF // 128, 128))
        scale = fp8_scale(tl.max(tl.abs(hf), axis=2))
        q = tl.reshape(to_fp8(hf, scale[:, :, None], False), (BLOCK_M, HALF))
        tl.store(out_ptrs, q, mask=ok)
        groups = pid_n * (HALF // 128) + tl.arange(0, HALF // 128)
        tl.store(outs_ptr + rows[:, None] * stride_outs + groups[None, :], scale, mask=row_ok[:, None])
    else:
        tl.store(out_ptrs, h, mask=ok)


@triton.jit
def _gu_tma(x_ptr, xs_ptr, w_desc, ws_ptr, out_ptr, outs_ptr, meta_ptr, num_experts, num_blocks_m, I, H,
            stride_x, stride_xs, stride_wse, stride_wsn, stride_out, stride_outs,
            Q: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = tile_ids(num_blocks_m, I, BLOCK_N, GROUP_M)
    expert, row_start, row_end, _ = block_rows(pid_m, meta_ptr, num_experts, 1, BLOCK_M, E_POW2, False)
    if row_start >= row_end:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    rows_ld = tl.minimum(rows, row_end - 1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows_ld[:, None] * stride_x + rk[None, :]
    g_row = (expert * 2 * I + pid_n * BLOCK_N).to(tl.int32)
    u_row = g_row + I
    ws_e = ws_ptr + expert.to(tl.int64) * stride_wse
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(H, BLOCK_K)):
        a = tl.load(x_ptrs)
        bg = w_desc.load([g_row, kb * BLOCK_K]).T
        bu = w_desc.load([u_row, kb * BLOCK_K]).T
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
        x_ptrs += BLOCK_K
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
def _dn_tma(a_ptr, as_ptr, w_desc, ws_ptr, rw_ptr, out_ptr, meta_ptr, num_experts, num_blocks_m, H, I,
            stride_a, stride_as, stride_wse, stride_wsn, stride_out,
            Q: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = tile_ids(num_blocks_m, H, BLOCK_N, GROUP_M)
    expert, row_start, row_end, _ = block_rows(pid_m, meta_ptr, num_experts, 1, BLOCK_M, E_POW2, False)
    if row_start >= row_end:
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    rows_ld = tl.minimum(rows, row_end - 1)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_ld[:, None] * stride_a + rk[None, :]
    w_row = (expert * H + pid_n * BLOCK_N).to(tl.int32)
    ws_e = ws_ptr + expert.to(tl.int64) * stride_wse
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(I, BLOCK_K)):
        a = tl.load(a_ptrs)
        b = w_desc.load([w_row, kb * BLOCK_K]).T
        if Q == 3:
            kg = (kb * BLOCK_K) // 128
            a_s = tl.load(as_ptr + rows_ld * stride_as + kg)
            b_s = tl.load(ws_e + (cols // 128) * stride_wsn + kg)
            acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
    route_w = tl.load(rw_ptr + rows_ld)
    y = (acc * route_w[:, None]).to(tl.bfloat16)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y, mask=row_ok[:, None] & (cols < H)[None, :])


def bench(fn):
    from triton.testing import do_bench
    return do_bench(fn, warmup=5, rep=60, return_mode="median") * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/variants")
    ap.add_argument("--cases", default="qwen3-30b-a3b:16384,qwen3-30b-a3b:4096,deepseek-v3:16384,deepseek-v3:4096,mixtral-8x7b:16384")
    ap.add_argument("--schemes", default="none,fp8-block")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for case in args.cases.split(","):
        preset, t = case.split(":")
        t = int(t)
        cfg = preset_config(preset)
        for scheme in args.schemes.split(","):
            shape = Shape(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k, scheme)
            w = random_weights(shape, dev)
            batch = random_batch(shape, t, dev)
            layout = RowLayout.of(batch)
            runner = _layer_parts(shape)[1]
            e, i, h = shape.num_experts, shape.inter, shape.hidden
            x = batch.hidden.reshape(-1, h)
            q = 3 if scheme == "fp8-block" else 0
            if q:
                xq, xs = quantize_rows(x, scheme, layout)
            else:
                xq, xs = x, None
            xs_ = xs if xs is not None else xq
            kc = runner.kernel_config(batch, w)
            flops_gu = 2 * x.shape[0] * h * 2 * i
            flops_dn = 2 * x.shape[0] * h * i
            ref_inter, ref_extra = gate_up(xq, xs, w.w13, w.w13_scale, layout, scheme, "silu", torch.bfloat16, kc.gate_up)
            t_cur = bench(lambda: gate_up(xq, xs, w.w13, w.w13_scale, layout, scheme, "silu", torch.bfloat16, kc.gate_up))
            row = dict(preset=preset, T=t, scheme=scheme, kernel="gate_up", variant="cur", cfg=str(kc.gate_up), us=t_cur,
                       tflops=flops_gu / t_cur * 1e-6, err=0.0)
            results.append(row)
            print(row, flush=True)
            ref_f = ref_inter.float() if not q else (ref_inter.float().view(-1, i // 128, 128) * ref_extra[:, :, None]).view(-1, i)
            ws = w.w13_scale if q else xq
            wse, wsn = (ws.stride(0), ws.stride(1)) if q else (0, 0)
            bk = 128 if q else 64
            il_cfgs = [(64, 256, bk, 8, 3), (64, 256, bk, 8, 4), (128, 256, bk, 8, 3), (128, 128, bk, 8, 4),
                       (128, 128, bk, 4, 4), (64, 128, bk, 4, 4)]
            for bm, bn, bkk, nw, ns in il_cfgs:
                out_fp8 = q == 3 and (bn // 2) % 128 == 0
                inter = torch.empty((x.shape[0], i), dtype=torch.float8_e4m3fn if out_fp8 else torch.bfloat16, device=dev)
                iscale = torch.empty((x.shape[0], i // 128), dtype=torch.float32, device=dev)
                nbm = layout.num_row_blocks(bm)
                grid = (nbm * triton.cdiv(2 * i, bn),)

                def run():
                    _gu_il[grid](xq, xs_, w.w13, ws, inter, iscale, layout.meta, e, nbm, i, h,
                                 xq.stride(0), xs_.stride(0), w.w13.stride(0), w.w13.stride(1), wse, wsn,
                                 inter.stride(0), iscale.stride(0), Q=q, OUT_FP8=out_fp8, E_POW2=layout.e_pow2,
                                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bkk, GROUP_M=8, num_warps=nw, num_stages=ns)
                try:
                    run()
                    us = bench(run)
                    got = inter.float() if not out_fp8 else (inter.float().view(-1, i // 128, 128) * iscale[:, :, None]).view(-1, i)
                    if q == 3 and not out_fp8:
                        us_q = bench(lambda: quantize_groups(inter))
                        us += us_q
                    err = float((got - ref_f).abs().max())
                except Exception as exc:  # noqa: BLE001 - record and go on
                    us, err = float("nan"), repr(exc)[:200]
                row = dict(preset=preset, T=t, scheme=scheme, kernel="gate_up", variant="il" + ("" if out_fp8 or not q else "+quant"),
                           cfg=f"{bm}x{bn}x{bkk} w{nw} s{ns}", us=us, tflops=flops_gu / us * 1e-6, err=err)
                results.append(row)
                print(row, flush=True)
            w13_2d = w.w13.view(e * 2 * i, h)
            tma_cfgs = [(64, 128, bk, 8, 3), (64, 128, bk, 8, 4), (128, 128, bk, 8, 3), (128, 64, bk, 8, 4), (64, 64, bk, 4, 4)]
            for bm, bn, bkk, nw, ns in tma_cfgs:
                desc = TensorDescriptor.from_tensor(w13_2d, [bn, bkk])
                inter = torch.empty((x.shape[0], i), dtype=torch.float8_e4m3fn if q else torch.bfloat16, device=dev)
                iscale = torch.empty((x.shape[0], i // 128), dtype=torch.float32, device=dev)
                nbm = layout.num_row_blocks(bm)
                grid = (nbm * triton.cdiv(i, bn),)
                if q == 3 and bn % 128:
                    continue

                def run():
                    _gu_tma[grid](xq, xs_, desc, ws, inter, iscale, layout.meta, e, nbm, i, h,
                                  xq.stride(0), xs_.stride(0), wse, wsn, inter.stride(0), iscale.stride(0),
                                  Q=q, E_POW2=layout.e_pow2, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bkk, GROUP_M=8,
                                  num_warps=nw, num_stages=ns)
                try:
                    run()
                    us = bench(run)
                    got = inter.float() if not q else (inter.float().view(-1, i // 128, 128) * iscale[:, :, None]).view(-1, i)
                    err = float((got - ref_f).abs().max())
                except Exception as exc:  # noqa: BLE001
                    us, err = float("nan"), repr(exc)[:200]
                row = dict(preset=preset, T=t, scheme=scheme, kernel="gate_up", variant="tma",
                           cfg=f"{bm}x{bn}x{bkk} w{nw} s{ns}", us=us, tflops=flops_gu / us * 1e-6, err=err)
                results.append(row)
                print(row, flush=True)
            # down
            a, a_s = ref_inter, ref_extra if q else None
            a_s_ = a_s if a_s is not None else a
            rw = batch.weights.reshape(-1).float().contiguous()
            ref_out = down(a, a_s, w.w2, w.w2_scale, rw, layout, scheme, torch.bfloat16, kc.down)
            t_cur = bench(lambda: down(a, a_s, w.w2, w.w2_scale, rw, layout, scheme, torch.bfloat16, kc.down))
            row = dict(preset=preset, T=t, scheme=scheme, kernel="down", variant="cur", cfg=str(kc.down), us=t_cur,
                       tflops=flops_dn / t_cur * 1e-6, err=0.0)
            results.append(row)
            print(row, flush=True)
            w2_2d = w.w2.view(e * h, i)
            ws2 = w.w2_scale if q else a
            wse2, wsn2 = (ws2.stride(0), ws2.stride(1)) if q else (0, 0)
            for bm, bn, bkk, nw, ns in [(64, 128, bk, 4, 4), (128, 128, bk, 8, 3), (128, 256, bk, 8, 3), (64, 256, bk, 8, 3),
                                        (128, 128, bk, 4, 4)]:
                desc = TensorDescriptor.from_tensor(w2_2d, [bn, bkk])
                o = torch.empty((x.shape[0], h), dtype=torch.bfloat16, device=dev)
                nbm = layout.num_row_blocks(bm)
                grid = (nbm * triton.cdiv(h, bn),)

                def run():
                    _dn_tma[grid](a, a_s_, desc, ws2, rw, o, layout.meta, e, nbm, h, i, a.stride(0), a_s_.stride(0),
                                  wse2, wsn2, o.stride(0), Q=q, E_POW2=layout.e_pow2, BLOCK_M=bm, BLOCK_N=bn,
                                  BLOCK_K=bkk, GROUP_M=8, num_warps=nw, num_stages=ns)
                try:
                    run()
                    us = bench(run)
                    err = float((o.float() - ref_out.float()).abs().max())
                except Exception as exc:  # noqa: BLE001
                    us, err = float("nan"), repr(exc)[:200]
                row = dict(preset=preset, T=t, scheme=scheme, kernel="down", variant="tma",
                           cfg=f"{bm}x{bn}x{bkk} w{nw} s{ns}", us=us, tflops=flops_dn / us * 1e-6, err=err)
                results.append(row)
                print(row, flush=True)
            del w, batch
            torch.cuda.empty_cache()
            (out / "variants.json").write_text(json.dumps(results, indent=1))
    print("\n| preset | T | scheme | kernel | variant | cfg | µs | TFLOP/s | err |")
    for r in results:
        err = r["err"] if isinstance(r["err"], str) else f"{r['err']:.2g}"
        print(f"| {r['preset']} | {r['T']} | {r['scheme']} | {r['kernel']} | {r['variant']} | {r['cfg']} | "
              f"{r['us']:.0f} | {r['tflops']:.0f} | {err} |")


if __name__ == "__main__":
    main()
