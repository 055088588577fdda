"""Experiment (GPU): kernels/down_wgmma.py's loop body length (UNROLL, at most 4 or 8 steps) on the
long-K down GEMM (Mixtral, 112 K steps) and DeepSeek-V3's (16 steps), against the Triton kernel.

    PYTHONPATH=$PWD python benchmarks/experiments/wgmma_unroll.py [OUT_DIR]
"""
import json
import os
import sys

import torch

from moeflow.kernels import down_wgmma
from moeflow.kernels.autotune import graph_time_ms, random_weights
from moeflow.kernels.configs import GemmConfig
from moeflow.kernels.down import down
from moeflow.kernels.quant import quantize_rows

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import gemm_case  # noqa: E402

out_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", ".")
dev = torch.device("cuda")
rows = []
plain_unroll = down_wgmma.unroll
for preset, t in (("mixtral-8x7b", 4096), ("mixtral-8x7b", 16384), ("deepseek-v3", 16384)):
    shape, batch, layout, kcfg = gemm_case(preset, "fp8-block", t, dev)
    i = shape.inter
    shipped = kcfg.down
    w = random_weights(shape, dev)
    a, a_s = quantize_rows(torch.randn(layout.rows, i, device=dev).bfloat16(), "fp8-block", layout)
    rw = batch.weights.float()
    run = lambda cfg: down(a, a_s, w.w2, w.w2_scale, rw, layout, "fp8-block", torch.bfloat16, cfg)
    base = graph_time_ms([lambda: run(shipped)], 40) * 1e3
    line = f"{preset:13} T={t:<6} shipped {base:8.1f} us"
    res = dict(preset=preset, T=t, shipped=shipped.to_dict(), shipped_us=round(base, 1), wgmma={})
    for most in (8, 4, 2):
        down_wgmma.unroll = lambda n, most=most: plain_unroll(n, most)
        for stages in (3, 4):
            cfg = GemmConfig(128, 128, 128, 8, 8, stages, scale_overlap=1)
            us = graph_time_ms([lambda: run(cfg)], 40) * 1e3
            res["wgmma"][f"u{most}s{stages}"] = round(us, 1)
            line += f" | u{most} s{stages} {us:8.1f} ({base / us:.2f}x)"
    down_wgmma.unroll = plain_unroll
    print(line, flush=True)
    rows.append(res)
json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(os.path.join(out_dir, "wgmma_unroll.json"), "w"),
          indent=1)
