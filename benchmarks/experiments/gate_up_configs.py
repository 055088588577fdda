"""Experiment (GPU): the Gluon fp8-block gate_up (kernels/gate_up_wgmma.py) alone at variants of each shape's shipped
128-row config (stages, tile order, loop body, pair tiles off), timed by turns in one process, each output compared bit
for bit with the Triton kernel's; CUDA graph, ROUNDS rounds.

    PYTHONPATH=$PWD ROUNDS=3 python benchmarks/experiments/gate_up_configs.py OUT_DIR [preset:T ...]
"""
import json
import os
import statistics
import sys
from dataclasses import replace

import torch

from moeflow import env as moeflow_env
from moeflow.kernels import gate_up_wgmma
from moeflow.kernels.common import ACT_CODES
from moeflow.kernels.gate_up import gate_up

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import fp8_block_case, time_variant  # noqa: E402

CASES = [("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384), ("mixtral-8x7b", 1024), ("mixtral-8x7b", 4096),
         ("deepseek-v3", 4096), ("deepseek-v3", 16384)]
ROUNDS = int(os.environ.get("ROUNDS", "3"))
# name -> (config fields replaced, MOEFLOW_TRITON_PAIR_TILES, most steps a loop body)
VARIANTS = {"shipped": ({}, "1", 8), "no_pairs": ({}, "0", 8), "s2": ({"num_stages": 2}, "1", 8),
            "s4": ({"num_stages": 4}, "1", 8), "g4": ({"group_m": 4}, "1", 8), "g16": ({"group_m": 16}, "1", 8),
            "u4": ({}, "1", 4)}


def main():
    out_dir = sys.argv[1]
    cases = [(p, int(t)) for p, t in (c.split(":") for c in sys.argv[2:])] or CASES
    dev = torch.device("cuda")
    results = []
    for preset, t in cases:
        shape, batch, layout, kcfg, w, xq, xs = fp8_block_case(preset, t, dev)
        base = kcfg.gate_up if kcfg.gate_up.scale_overlap else replace(kcfg.gate_up, block_m=128, num_warps=8,
                                                                       num_stages=3, scale_overlap=1)
        r, i = xq.shape[0], shape.inter
        row = dict(preset=preset, T=t, cfg=str(base))
        want = gate_up(xq, xs, w.w13, w.w13_scale, layout, "fp8-block", "silu", torch.bfloat16,
                       replace(base, scale_overlap=0))
        inter = torch.empty(r, i, dtype=torch.float8_e4m3fn, device=dev)
        scale = torch.empty(r, i // 128, dtype=torch.float32, device=dev)
        for _ in range(ROUNDS):
            for name, (fields, pairs, most) in VARIANTS.items():
                cfg = replace(base, **fields)
                os.environ[moeflow_env.TRITON_PAIR_TILES.name] = pairs
                run = lambda cfg=cfg, most=most: gate_up_wgmma.launch(
                    xq, xs, w.w13, w.w13_scale, layout, ACT_CODES["silu"], torch.bfloat16, cfg, inter, scale,
                    most_unroll=most)
                inter.view(torch.uint8).fill_(0x7F)  # NaN
                scale.fill_(float("nan"))
                res, _ = time_variant(run, layout, (inter, scale), want)
                row.setdefault(name, []).append(res)
        os.environ.pop(moeflow_env.TRITON_PAIR_TILES.name)
        us = {n: [x.get("us") for x in row[n]] for n in VARIANTS}
        row["median_us"] = {n: statistics.median(v) if None not in v else None for n, v in us.items()}
        results.append(row)
        ok = all(x.get("bit_equal") for n in VARIANTS for x in row[n])
        print(f"{preset:14} T={t:6} bit-equal {ok}  " + "  ".join(f"{n} {row['median_us'][n]}" for n in VARIANTS),
              flush=True)
        del w, xq, xs, want, inter, scale
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "gate_up_configs.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
