"""Experiment (GPU): the Gluon fp8-block gate_up with pair tiles (blocks of at most 64 rows over two column tiles,
kernels/gate_up_wgmma.py, MOEFLOW_TRITON_PAIR_TILES) against every block as a 128-row tile, the kernel alone on
each preset's shape where the shipped table takes the Gluon kernel at 128 rows. Each output is compared bit for bit
with the Triton kernel's; both forms are timed by turns (ROUNDS rounds), in a CUDA graph.

    PYTHONPATH=$PWD python benchmarks/experiments/pair_tiles.py [OUT_DIR] [preset:T ...]
"""
import json
import os
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


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", ".")
    cases = [(p, int(t)) for p, t in (c.split(":") for c in sys.argv[2:])] or CASES
    dev = torch.device("cuda")
    results = []
    for preset, t in cases:
        shape, batch, layout, kcfg, w, xq, xs = fp8_block_case(preset, t, dev)
        cfg = kcfg.gate_up if kcfg.gate_up.scale_overlap else replace(kcfg.gate_up, block_m=128, num_warps=8,
                                                                      num_stages=3, scale_overlap=1)
        r, i = xq.shape[0], shape.inter
        sizes = (layout.meta[1:] - layout.meta[:-1]).tolist()
        pairs = sum(1 for n in sizes if 0 < n % 128 <= 64)
        row = dict(preset=preset, T=t, cfg=str(cfg), blocks=sum((n + 127) // 128 for n in sizes), pair_blocks=pairs)
        want = gate_up(xq, xs, w.w13, w.w13_scale, layout, "fp8-block", "silu", torch.bfloat16,
                       replace(cfg, scale_overlap=0))
        inter = torch.empty(r, i, dtype=torch.float8_e4m3fn, device=dev)
        scale = torch.empty(r, i // 128, dtype=torch.float32, device=dev)
        run = lambda: gate_up_wgmma.launch(xq, xs, w.w13, w.w13_scale, layout, ACT_CODES["silu"], torch.bfloat16,
                                           cfg, inter, scale)
        for rnd in range(ROUNDS):
            for name, on in (("full", "0"), ("pairs", "1")):
                os.environ[moeflow_env.TRITON_PAIR_TILES.name] = on
                inter.view(torch.uint8).fill_(0x7F)  # NaN
                scale.fill_(float("nan"))
                res, _ = time_variant(run, layout, (inter, scale), want)
                row.setdefault(name, []).append(res)
        os.environ.pop(moeflow_env.TRITON_PAIR_TILES.name)
        results.append(row)
        us = lambda n: [x.get("us") for x in row[n]]
        print(f"{preset:14} T={t:6} blocks {row['blocks']:5} pair blocks {pairs:4}  full {us('full')}  "
              f"pairs {us('pairs')}  bit-equal {[x.get('bit_equal') for x in row['full'] + row['pairs']]}", flush=True)
        del w, xq, xs, want, inter, scale
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "pair_tiles.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
