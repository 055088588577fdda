"""The warp-specialized bf16 gate_up (kernels/warp_specialized.py, GemmConfig.warp_specialize) against the shipped
tuned gate_up, alone, rows by index as the single-process layer feeds them (the copy into order included), graph-
timed as the tuner times it; outputs compared. One H200.

    PYTHONPATH=$PWD OUT=DIR python benchmarks/experiments/ws_gate_up.py
"""
import json, os
from types import SimpleNamespace

import torch

from moeflow.kernels.autotune import Shape, _layer_parts, batches_for, graph_time_ms, random_batch, random_weights
from moeflow.kernels.common import RowLayout
from moeflow.kernels.configs import GemmConfig
from moeflow.kernels.gate_up import gate_up
from moeflow.presets import PRESETS

dev = torch.device("cuda")
ROWS = [("qwen3-30b-a3b", (4096, 16384)), ("deepseek-v3", (4096, 16384)), ("mixtral-8x7b", (16384,))]
VARIANTS = [GemmConfig(128, 64, 64, 8, 4, s, warp_specialize=1) for s in (5, 6)]
res = []
for preset, ts in ROWS:
    p = PRESETS[preset]
    shape = Shape(p["num_experts"], p["hidden_size"], p["intermediate_size"], p["top_k"], "none")
    w = random_weights(shape, dev)
    for t in ts:
        batches = [random_batch(shape, t, dev, seed=t * 1000 + b, indexed=True) for b in range(batches_for(t))]
        kcfg = _layer_parts(shape)[1].kernel_config(batches[0], SimpleNamespace(w13=w.w13, w2=w.w2))
        fl = 2 * t * shape.top_k * shape.hidden * 2 * shape.inter

        def run(b, c):
            return gate_up(b.hidden, None, w.w13, None, RowLayout.of(b), "none", "silu", torch.bfloat16, c,
                           source_rows=b.source_rows, copy_rows=b.copy_rows)[0]
        ref = run(batches[0], kcfg.gate_up)
        for name, c in [("shipped " + str(kcfg.gate_up), kcfg.gate_up)] + [(str(v), v) for v in VARIANTS]:
            try:
                out = run(batches[0], c)
                valid = RowLayout.of(batches[0]).valid_rows()
                err = ((out.float() - ref.float())[valid].abs().max() / ref.float()[valid].abs().max()).item()
                us = graph_time_ms([lambda b=b, c=c: run(b, c) for b in batches], 20) * 1e3
            except Exception as exc:
                us, err = repr(exc)[:200], float("nan")
            row = dict(preset=preset, T=t, config=name, us=us if isinstance(us, str) else round(us, 1),
                       tflops=None if isinstance(us, str) else round(fl / us / 1e6), rel_err=err)
            print(row, flush=True)
            res.append(row)
    del w
    torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "ws_gate_up.json"), "w"), indent=1)
