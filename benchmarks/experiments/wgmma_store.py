"""Experiment (GPU): kernels/down_wgmma.py's epilogue storing from the wgmma register layout (4 bytes a
thread per row; GemmConfig.scale_overlap 1) against a layout converted for 16-byte stores (2), on the
tiles the tuner offers. (Measured at b38c3eb, where a module switch chose the store.)

    PYTHONPATH=$PWD python benchmarks/experiments/wgmma_store.py [OUT_DIR]
"""
import json
import os
import sys

import torch

from moeflow.kernels.autotune import graph_time_ms, random_weights
from moeflow.kernels.configs import GemmConfig
from moeflow.kernels.down import down
from moeflow.kernels.quant import quantize_rows

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import gemm_case  # noqa: E402

out_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", ".")
dev = torch.device("cuda")
rows = []
for preset, t in (("mixtral-8x7b", 1024), ("mixtral-8x7b", 16384), ("deepseek-v3", 16384), ("qwen3-30b-a3b", 16384)):
    shape, batch, layout, _ = gemm_case(preset, "fp8-block", t, dev)
    i = shape.inter
    w = random_weights(shape, dev)
    a, a_s = quantize_rows(torch.randn(layout.rows, i, device=dev).bfloat16(), "fp8-block", layout)
    rw = batch.weights.float()
    line = f"{preset:13} T={t:<6}"
    res = dict(preset=preset, T=t, us={})
    for bm, warps in ((128, 8), (64, 4)):
        outs = []
        for mode in (1, 2):  # stores from the wgmma layout, 16-byte stores
            cfg = GemmConfig(bm, 128, 128, 8, warps, 4, scale_overlap=mode)
            fn = lambda: down(a, a_s, w.w2, w.w2_scale, rw, layout, "fp8-block", torch.bfloat16, cfg)
            outs.append(fn())
            us = graph_time_ms([fn], 40) * 1e3
            key = f"{bm}x128w{warps}s4 {'16B' if mode == 2 else 'wgmma'}"
            res["us"][key] = round(us, 1)
            line += f" | {key} {us:8.1f}"
        assert torch.equal(outs[0], outs[1])
    print(line, flush=True)
    rows.append(res)
json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(os.path.join(out_dir, "wgmma_store.json"), "w"),
          indent=1)
