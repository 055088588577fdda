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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import gluon_gate_up_case, time_gluon_gate_up  # noqa: E402

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
        case = gluon_gate_up_case(preset, t, dev)
        row = dict(preset=preset, T=t, cfg=str(case.cfg))
        for _ in range(ROUNDS):
            for name, (fields, pairs, most) in VARIANTS.items():
                os.environ[moeflow_env.TRITON_PAIR_TILES.name] = pairs
                row.setdefault(name, []).append(time_gluon_gate_up(case, gate_up_wgmma, replace(case.cfg, **fields),
                                                                   most))
        os.environ.pop(moeflow_env.TRITON_PAIR_TILES.name)
        us = {n: [x.get("us") for x in row[n]] for n in VARIANTS}
        row["median_us"] = {n: statistics.median(v) if None not in v else None for n, v in us.items()}
        results.append(row)
        ok = all(x.get("bit_equal") for n in VARIANTS for x in row[n])
        print(f"{preset:14} T={t:6} bit-equal {ok}  " + "  ".join(f"{n} {row['median_us'][n]}" for n in VARIANTS),
              flush=True)
        del case
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "gate_up_configs.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
