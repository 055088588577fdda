"""Decode (T=1, 16) GEMM tiles: the shipped BLOCK_M=16 configs (fp8 converted to f16 for mma.sync)
against BLOCK_M=64 tiles (wgmma on fp8 directly), graph-timed as the tuner does. One H200.

    PYTHONPATH=$PWD OUT=DIR python benchmarks/experiments/decode_m64.py
"""
import json, os, sys
import torch
from moeflow.kernels.autotune import Shape, random_weights, random_batch, batches_for, graph_time_ms
from moeflow.kernels.configs import GemmConfig, fit
from moeflow.kernels.common import RowLayout
from moeflow.kernels.gate_up import gate_up
from moeflow.kernels.down import down
from moeflow.kernels.quant import down_input, quantize_rows
from moeflow.presets import PRESETS

dev = torch.device("cuda")
res = []
for preset in ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3"):
    p = PRESETS[preset]
    for scheme in ("fp8-block",):
        shape = Shape(p["num_experts"], p["hidden_size"], p["intermediate_size"], p["top_k"], scheme)
        w = random_weights(shape, dev)
        nb = 1 if scheme != "none" else shape.dtype.itemsize
        for t in (1, 16):
            inputs = []
            for b in range(batches_for(t)):
                batch = random_batch(shape, t, dev, seed=t * 1000 + b)
                lay = RowLayout.of(batch)
                xq, xs = quantize_rows(batch.hidden, scheme, lay) if scheme != "none" else (batch.hidden, None)
                inputs.append((batch, lay, xq, xs))
            cands = [GemmConfig(16, bn, 128, 1, 4, s) for bn, s in ((32, 8), (64, 6), (128, 3))] + \
                    [GemmConfig(64, bn, 128, 1, 4, s) for bn, s in ((32, 8), (64, 6), (64, 4), (128, 4), (128, 3))]
            for kind in ("gate_up", "down"):
                for c in cands:
                    c = fit(c, fused_pair=kind == "gate_up", scheme=scheme, elem_bytes=nb,
                            n_size=shape.inter if kind == "gate_up" else shape.hidden)
                    def gu(c, inp):
                        _, lay, xq, xs = inp
                        inter, extra = gate_up(xq, xs, w.w13, w.w13_scale, lay, scheme, "silu", shape.dtype, c)
                        return down_input(inter, extra, scheme) if scheme == "fp8-block" else (inter, extra)
                    try:
                        if kind == "gate_up":
                            us = graph_time_ms([lambda c=c, i=i: gu(c, i) for i in inputs], 15) * 1e3
                        else:
                            d_in = []
                            for inp in inputs:
                                a, a_s = down_input(*gu(GemmConfig(16, 64, 128, 1, 4, 6), inp), scheme) if scheme == "fp8-block" else gu(GemmConfig(16, 64, 128, 1, 4, 6), inp)
                                if scheme == "none":
                                    a_s = None
                                d_in.append((a, a_s, inp[0].weights, inp[1]))
                            us = graph_time_ms([lambda c=c, d=d: down(d[0], d[1], w.w2, w.w2_scale, d[2], d[3], scheme, shape.dtype, c)
                                                for d in d_in], 15) * 1e3
                    except Exception as exc:
                        us = repr(exc)[:120]
                    res.append(dict(preset=preset, scheme=scheme, T=t, kernel=kind, config=str(c), us=us))
                    print(preset, scheme, t, kind, c, us if isinstance(us, str) else f"{us:.1f}", flush=True)
        del w
        torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "decode_m64.json"), "w"), indent=1)
