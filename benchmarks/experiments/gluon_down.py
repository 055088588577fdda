"""Experiment (GPU): the Gluon fp8-block down GEMM (kernels/down_wgmma.py, GemmConfig.scale_overlap)
against the Triton kernel with the shipped tuned configs, on each preset's shape at mid and large T; per-tile
and persistent grids.
Each output is compared with the Triton kernel's (max abs difference: 0 expected, the same sums in
the same order).

    PYTHONPATH=$PWD python benchmarks/experiments/gluon_down.py [OUT_DIR]

The prototype this kernel grew from, and the measurements that chose its loop
(benchmarks/results/gluon_down_2026-11-30_h200.md), are in commit 01da845 of this file.
"""
import json
import os
import sys
from dataclasses import replace

import torch

from moeflow.kernels.autotune import graph_time_ms
from moeflow.kernels.down import down
from moeflow.kernels.gate_up import gate_up
from moeflow.kernels.quant import down_input

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import fp8_block_case  # noqa: E402

CASES = [("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384), ("mixtral-8x7b", 1024), ("mixtral-8x7b", 4096),
         ("mixtral-8x7b", 16384), ("deepseek-v3", 4096), ("deepseek-v3", 16384)]
# (block_m, warps, stages, programs_per_sm), block_n 128, block_k 128; programs_per_sm > 0: the persistent
# grid (kernels/down_wgmma_persistent.py)
TILES = ((64, 4, 4, 0), (128, 8, 3, 0), (128, 8, 4, 0), (64, 4, 4, 2), (64, 4, 3, 2), (128, 8, 3, 1), (128, 8, 4, 1))


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", ".")
    dev = torch.device("cuda")
    rows = []
    for preset, t in CASES:
        _, batch, layout, kcfg, w, xq, xs = fp8_block_case(preset, t, dev)
        a, a_s = down_input(*gate_up(xq, xs, w.w13, w.w13_scale, layout, "fp8-block", "silu", torch.bfloat16,
                                     kcfg.gate_up), "fp8-block")
        rw = batch.weights.float()
        triton_cfg = replace(kcfg.down, scale_overlap=0)
        run = lambda cfg: down(a, a_s, w.w2, w.w2_scale, rw, layout, "fp8-block", torch.bfloat16, cfg)
        ref = run(triton_cfg)
        base = graph_time_ms([lambda: run(triton_cfg)], 40) * 1e3
        res = dict(preset=preset, T=t, triton_cfg=triton_cfg.to_dict(), triton_us=round(base, 1), gluon={})
        line = f"{preset:14} T={t:<6} triton {base:9.1f} us"
        for bm, warps, stages, progs in TILES:
            for mode in (1, 2):
                cfg = replace(triton_cfg, block_m=bm, block_n=128, block_k=128, num_warps=warps, num_stages=stages,
                              programs_per_sm=progs, split_k=1, scale_overlap=mode)
                diff = (run(cfg).float() - ref.float()).abs().max().item()
                us = graph_time_ms([lambda: run(cfg)], 40) * 1e3
                key = f"{bm}x128w{warps}s{stages}o{mode}" + (f"p{progs}" if progs else "")
                res["gluon"][key] = dict(us=round(us, 1), diff=diff)
                line += f" | {key} {us:8.1f} ({base / us:.2f}x)"
        print(line, flush=True)
        rows.append(res)
    json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(os.path.join(out_dir, "gluon_down.json"), "w"),
              indent=1)


if __name__ == "__main__":
    main()
