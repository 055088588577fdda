"""Run one shipped GEMM of a preset once, fp8-block, after a warm-up, for a profiler to catch (ncu -k NAME -s 1 -c 1).

    PYTHONPATH=$PWD ncu --clock-control none -k regex:gate_up -s 1 -c 1 python benchmarks/experiments/one_gemm.py \
        qwen3-30b-a3b 4096 gate_up
CFG='{"block_m": 128, ...}' (GemmConfig's fields, JSON) runs that tile instead of the shipped one.
"""
import json
import os
import sys
from dataclasses import replace

import torch

from moeflow.kernels.configs import GemmConfig
from moeflow.kernels.down import down
from moeflow.kernels.gate_up import gate_up

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import fp8_block_case  # noqa: E402


def main():
    preset, t, which = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    _, batch, layout, kcfg, w, xq, xs = fp8_block_case(preset, t, torch.device("cuda"))
    if os.environ.get("CFG"):
        forced = GemmConfig(**json.loads(os.environ["CFG"]))
        kcfg = replace(kcfg, **{"gate_up" if which == "gate_up" else "down": forced})
    run_gu = lambda: gate_up(xq, xs, w.w13, w.w13_scale, layout, "fp8-block", "silu", torch.bfloat16, kcfg.gate_up)
    inter, inter_s = run_gu()
    if which == "gate_up":
        run = run_gu
    else:
        rw = torch.rand(xq.shape[0], device="cuda")
        run = lambda: down(inter, inter_s, w.w2, w.w2_scale, rw, layout, "fp8-block", torch.bfloat16, kcfg.down)
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    print("config", kcfg.gate_up if which == "gate_up" else kcfg.down)


if __name__ == "__main__":
    main()
