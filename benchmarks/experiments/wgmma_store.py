"""Experiment (GPU): kernels/down_wgmma.py's epilogue storing from the wgmma register layout (4 bytes a
thread per row) against a layout converted for 16-byte stores, on the tiles the tuner offers.

    PYTHONPATH=$PWD python benchmarks/experiments/wgmma_store.py [OUT_DIR]
"""
import json
import os
import sys

import torch

from moeflow.kernels import down_wgmma
from moeflow.kernels.autotune import Shape, graph_time_ms, random_batch, random_weights
from moeflow.kernels.common import RowLayout
from moeflow.kernels.configs import GemmConfig
from moeflow.kernels.down import down
from moeflow.kernels.quant import quantize_rows
from moeflow.presets import PRESETS

out_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", ".")
dev = torch.device("cuda")
rows = []
for preset, t in (("mixtral-8x7b", 1024), ("mixtral-8x7b", 16384), ("deepseek-v3", 16384), ("qwen3-30b-a3b", 16384)):
    p = PRESETS[preset]
    e, h, i, k = p["num_experts"], p["hidden_size"], p["intermediate_size"], p["top_k"]
    shape = Shape(e, h, i, k, "fp8-block")
    batch = random_batch(shape, t, dev)
    layout = RowLayout.of(batch)
    w = random_weights(shape, dev)
    a, a_s = quantize_rows(torch.randn(layout.rows, i, device=dev).bfloat16(), "fp8-block", layout)
    rw = batch.weights.float()
    line = f"{preset:13} T={t:<6}"
    res = dict(preset=preset, T=t, us={})
    for cfg in (GemmConfig(128, 128, 128, 8, 8, 4, scale_overlap=True), GemmConfig(64, 128, 128, 4, 4, 4, scale_overlap=True)):
        outs = []
        for coalesced in (False, True):
            down_wgmma.COALESCED_STORE = coalesced
            fn = lambda: down(a, a_s, w.w2, w.w2_scale, rw, layout, "fp8-block", torch.bfloat16, cfg)
            outs.append(fn())
            us = graph_time_ms([fn], 40) * 1e3
            key = f"{cfg.block_m}x{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages} {'16B' if coalesced else 'wgmma'}"
            res["us"][key] = round(us, 1)
            line += f" | {key} {us:8.1f}"
        assert torch.equal(outs[0], outs[1])
    down_wgmma.COALESCED_STORE = False
    print(line, flush=True)
    rows.append(res)
json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(os.path.join(out_dir, "wgmma_store.json"), "w"),
          indent=1)
