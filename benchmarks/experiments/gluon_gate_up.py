"""Experiment (GPU): the Gluon fp8-block gate_up GEMM (kernels/gate_up_wgmma.py) against the Triton
kernel with the shipped tuned configs, on each preset's shape at mid and large T, for several tiles
and loop-body lengths. Each output (fp8 intermediate and its group scales) is compared bit for bit
with the Triton kernel's (the same sums in the same order).

    PYTHONPATH=$PWD python benchmarks/experiments/gluon_gate_up.py [OUT_DIR] [preset:T ...]
"""
import json
import os
import sys
from dataclasses import replace

import torch

from moeflow.kernels import gate_up_wgmma
from moeflow.kernels.autotune import graph_time_ms
from moeflow.kernels.common import ACT_CODES
from moeflow.kernels.gate_up import gate_up

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import fp8_block_case, time_variant  # noqa: E402

CASES = [("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384), ("mixtral-8x7b", 1024), ("mixtral-8x7b", 4096),
         ("mixtral-8x7b", 16384), ("deepseek-v3", 4096), ("deepseek-v3", 16384)]
VARIANTS = ((128, 8, 4, 2), (128, 8, 3, 2), (128, 8, 3, 4), (128, 8, 4, 1), (64, 4, 4, 2), (64, 4, 5, 1))
# (block_m, warps, stages, most steps a loop body)


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", ".")
    cases = [(a.split(":")[0], int(a.split(":")[1])) for a in sys.argv[2:]] or CASES
    dev = torch.device("cuda")
    rows = []
    for preset, t in cases:
        _, batch, layout, kcfg, w, xq, xs = fp8_block_case(preset, t, dev)
        triton_cfg = replace(kcfg.gate_up, scale_overlap=0)
        ref, ref_s = gate_up(xq, xs, w.w13, w.w13_scale, layout, "fp8-block", "silu", torch.bfloat16, triton_cfg)
        base = graph_time_ms([lambda: gate_up(xq, xs, w.w13, w.w13_scale, layout, "fp8-block", "silu", torch.bfloat16,
                                              triton_cfg)], 40) * 1e3
        res = dict(preset=preset, T=t, triton_cfg=triton_cfg.to_dict(), triton_us=round(base, 1), gluon={})
        line = f"{preset:14} T={t:<6} triton {base:9.1f} us"
        for bm, warps, stages, most in VARIANTS:
            cfg = replace(triton_cfg, block_m=bm, block_n=128, block_k=128, num_warps=warps, num_stages=stages,
                          split_k=1, scale_overlap=1)
            key = f"{bm}w{warps}s{stages}u{most}"
            assert gate_up_wgmma.usable(xq, xs, w.w13, w.w13_scale, layout, "fp8-block", cfg)
            inter = torch.full_like(ref, float("nan"))
            sc = torch.full_like(ref_s, float("nan"))
            run = lambda: gate_up_wgmma.launch(xq, xs, w.w13, w.w13_scale, layout, ACT_CODES["silu"], torch.bfloat16,
                                               cfg, inter, sc, most)
            rec, _ = time_variant(run, layout, (inter, sc), (ref, ref_s))
            res["gluon"][key] = rec
            line += (f" | {key} {rec['us']:8.1f} ({base / rec['us']:.2f}x{'' if rec['bit_equal'] else ' DIFF'})"
                     if "us" in rec else f" | {key} error")
        print(line, flush=True)
        rows.append(res)
    json.dump(dict(device=torch.cuda.get_device_name(), rows=rows),
              open(os.path.join(out_dir, "gluon_gate_up.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
