"""Experiment (GPU): the Gluon fp8-block gate_up with pair tiles (blocks of at most 64 rows over two column tiles,
kernels/gate_up_wgmma.py, MOEFLOW_TRITON_PAIR_TILES) against every block as a 128-row tile, the kernel alone on
each preset's shape where the shipped table takes the Gluon kernel at 128 rows. Each output is compared bit for bit
with the Triton kernel's; both forms are timed by turns (ROUNDS rounds), in a CUDA graph.

    PYTHONPATH=$PWD python benchmarks/experiments/pair_tiles.py [OUT_DIR] [preset:T ...]
"""
import json
import os
import sys

import torch

from moeflow import env as moeflow_env
from moeflow.kernels import gate_up_wgmma

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import gluon_gate_up_case, time_gluon_gate_up  # noqa: E402

CASES = [("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384), ("mixtral-8x7b", 1024), ("mixtral-8x7b", 4096),
         ("deepseek-v3", 4096), ("deepseek-v3", 16384)]
ROUNDS = int(os.environ.get("ROUNDS", "3"))


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", ".")
    cases = [(p, int(t)) for p, t in (c.split(":") for c in sys.argv[2:])] or CASES
    dev = torch.device("cuda")
    results = []
    for preset, t in cases:
        case = gluon_gate_up_case(preset, t, dev)
        sizes = (case.layout.meta[1:] - case.layout.meta[:-1]).tolist()
        pairs = sum(1 for n in sizes if 0 < n % 128 <= 64)
        row = dict(preset=preset, T=t, cfg=str(case.cfg), blocks=sum((n + 127) // 128 for n in sizes),
                   pair_blocks=pairs)
        for rnd in range(ROUNDS):
            for name, on in (("full", "0"), ("pairs", "1")):
                os.environ[moeflow_env.TRITON_PAIR_TILES.name] = on
                row.setdefault(name, []).append(time_gluon_gate_up(case, gate_up_wgmma, case.cfg))
        os.environ.pop(moeflow_env.TRITON_PAIR_TILES.name)
        results.append(row)
        us = lambda n: [x.get("us") for x in row[n]]
        print(f"{preset:14} T={t:6} blocks {row['blocks']:5} pair blocks {pairs:4}  full {us('full')}  "
              f"pairs {us('pairs')}  bit-equal {[x.get('bit_equal') for x in row['full'] + row['pairs']]}", flush=True)
        del case
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "pair_tiles.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
