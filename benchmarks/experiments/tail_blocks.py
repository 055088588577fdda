"""Experiment (GPU): each GEMM in one launch (the shipped tuned config) against two launches (each
expert's whole BLOCK_M blocks, then its rows past them in smaller blocks: GemmConfig.tail_block_m),
timed as the tuner times them (kernels/autotune.py: CUDA graphs over 1-4 random sorted batches).

    PYTHONPATH=$PWD python benchmarks/experiments/tail_blocks.py [--out DIR] [--cases qwen3-30b-a3b:fp8-block:4096,...]

Uniform random routing gives each expert about T * top_k / E rows: a part-filled last block whose
tile costs as much as a whole one (DeepSeek-V3 T=4096: 128 +- 11 rows per expert, so half the
experts run a second 128-row tile for a few rows). Prints one row per (case, GEMM, variant) with its
time and its max abs difference from the shipped config's output.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from types import SimpleNamespace

import torch

from moeflow.kernels.autotune import Shape, graph_time_ms, precompile, random_batch, random_weights, _runner
from moeflow.kernels.common import RowLayout
from moeflow.kernels.configs import MoEKernelConfig
from moeflow.kernels.down import down
from moeflow.kernels.gate_up import gate_up
from moeflow.kernels.quant import down_input, quantize_rows
from moeflow.presets import PRESETS

CASES = ["deepseek-v3:fp8-block:4096", "qwen3-30b-a3b:fp8-block:4096", "qwen3-30b-a3b:none:4096",
         "mixtral-8x7b:fp8-block:1024", "mixtral-8x7b:none:1024", "deepseek-v3:none:4096",
         "qwen3-30b-a3b:fp8-block:1024", "qwen3-30b-a3b:none:1024", "deepseek-v3:fp8-block:1024",
         "qwen3-30b-a3b:fp8-block:16384", "deepseek-v3:fp8-block:16384", "qwen3-30b-a3b:none:16384",
         "mixtral-8x7b:fp8-block:4096", "deepseek-v3:none:16384"]
TAILS = ((64, 4), (32, 4), (16, 4))


def variants(cfg):
    out = [cfg]
    for bm, w in TAILS:
        if bm < cfg.block_m:
            out.append(replace(cfg, tail_block_m=bm, tail_num_warps=w))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--budget-s", type=float, default=480)
    args = ap.parse_args()
    start = time.time()
    dev = torch.device("cuda")
    cases = []
    for c in args.cases.split(","):
        preset, scheme, t = c.split(":")
        p = PRESETS[preset]
        shape = Shape(p["num_experts"], p["hidden_size"], p["intermediate_size"], p["top_k"], scheme)
        cases.append((preset, shape, int(t)))
    plans = {}
    jobs = []
    for preset, shape, t in cases:
        batch = random_batch(shape, t, dev)
        runner = _runner(shape)
        shapes_only = SimpleNamespace(w13=torch.empty(shape.num_experts, 2 * shape.inter, shape.hidden, device="meta"),
                                      w2=torch.empty(shape.num_experts, shape.hidden, shape.inter, device="meta"))
        kc = runner.kernel_config(batch, shapes_only)  # the shipped tuned configs, fitted as the layer fits them
        gu, dn = variants(kc.gate_up), variants(kc.down)
        plans[(preset, shape, t)] = (gu, dn)
        for j in range(max(len(gu), len(dn))):
            jobs.append((shape, MoEKernelConfig(gu[min(j, len(gu) - 1)], dn[min(j, len(dn) - 1)])))
    precompile(jobs)
    print(f"compiled {len(set(jobs))} pairs in {time.time() - start:.0f} s", flush=True)
    rows = []
    for preset, shape, t in cases:
        if time.time() - start > args.budget_s:
            print(f"budget spent: {preset} {shape.scheme} T={t} not run", flush=True)
            continue
        weights = random_weights(shape, dev)
        inputs = []
        for b in range(4 if t <= 1024 else 1):
            batch = random_batch(shape, t, dev, seed=t * 1000 + b)
            layout = RowLayout.of(batch)
            xq, xs = quantize_rows(batch.hidden, shape.scheme, layout) if shape.scheme != "none" else (batch.hidden, None)
            inputs.append((batch, layout, xq, xs))
        gu_c, dn_c = plans[(preset, shape, t)]

        def run_gu(c, inp):
            _, layout, xq, xs = inp
            inter, extra = gate_up(xq, xs, weights.w13, weights.w13_scale, layout, shape.scheme, "silu", shape.dtype, c)
            return down_input(inter, extra, shape.scheme)

        ref_gu = [run_gu(gu_c[0], i) for i in inputs]
        for c in gu_c:
            us = graph_time_ms([lambda c=c, i=i: run_gu(c, i) for i in inputs], 30) * 1e3
            got = run_gu(c, inputs[0])
            diff = (got[0].float() - ref_gu[0][0].float()).abs().max().item()
            rows.append(dict(preset=preset, scheme=shape.scheme, T=t, gemm="gate_up", cfg=c.to_dict(), us=round(us, 1),
                             diff=diff))
            print(f"{preset:14} {shape.scheme:9} T={t:<6} gate_up bm{c.block_m:<4} tail {c.tail_block_m:>3}/w{c.tail_num_warps}"
                  f"  {us:9.1f} us  diff {diff:.3g}", flush=True)
        down_in = [(*ref_gu[j], inputs[j][0].weights, inputs[j][1]) for j in range(len(inputs))]

        def run_dn(c, a, a_s, route_w, layout):
            return down(a, a_s, weights.w2, weights.w2_scale, route_w, layout, shape.scheme, shape.dtype, c)

        ref_dn = run_dn(dn_c[0], *down_in[0])
        for c in dn_c:
            us = graph_time_ms([lambda c=c, d=d: run_dn(c, *d) for d in down_in], 30) * 1e3
            diff = (run_dn(c, *down_in[0]).float() - ref_dn.float()).abs().max().item()
            rows.append(dict(preset=preset, scheme=shape.scheme, T=t, gemm="down", cfg=c.to_dict(), us=round(us, 1),
                             diff=diff))
            print(f"{preset:14} {shape.scheme:9} T={t:<6} down    bm{c.block_m:<4} tail {c.tail_block_m:>3}/w{c.tail_num_warps}"
                  f"  {us:9.1f} us  diff {diff:.3g}", flush=True)
        del weights, inputs, ref_gu, down_in, ref_dn
        torch.cuda.empty_cache()
    json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(os.path.join(args.out, "tail_blocks.json"), "w"),
              indent=1)
    print("\nbest per (case, gemm): shipped us -> best us (tail)")
    seen = {}
    for r in rows:
        seen.setdefault((r["preset"], r["scheme"], r["T"], r["gemm"]), []).append(r)
    for k, rs in seen.items():
        best = min(rs, key=lambda r: r["us"])
        print(f"{k[0]:14} {k[1]:9} T={k[2]:<6} {k[3]:8} {rs[0]['us']:9.1f} -> {best['us']:9.1f}  "
              f"({rs[0]['us'] / best['us']:.3f}x, tail {best['cfg']['tail_block_m']}/w{best['cfg']['tail_num_warps']})")


if __name__ == "__main__":
    main()
