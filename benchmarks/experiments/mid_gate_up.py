"""Experiment (GPU): the fp8-block gate_up at middle batch sizes (8 < rows per expert <= 96), every candidate
`moeflow tune` offers there plus the Gluon kernel (kernels/gate_up_wgmma.py) at 64 rows and 4 warps, which the
middle family does not offer. Timed as the tuner times a gate_up (autotune.tune: rows by index as the local
dispatcher hands them, so the Gluon kernel's row copy is included; the separate group quantization included
for tiles narrower than 128), CUDA graph over the tuner's batches, median.

    PYTHONPATH=$PWD python benchmarks/experiments/mid_gate_up.py OUT.json [preset:T ...]
"""
import json
import os
import sys

import torch

from moeflow.kernels.autotune import batches_for, candidates, graph_time_ms, random_routing, sorted_batch
from moeflow.kernels.common import RowLayout
from moeflow.kernels.configs import GemmConfig, fit
from moeflow.kernels.gate_up import gate_up
from moeflow.kernels.quant import down_input, quantize_activation

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import preset_weights  # noqa: E402

CASES = [("qwen3-30b-a3b", 512), ("qwen3-30b-a3b", 1024), ("deepseek-v3", 1024), ("deepseek-v3", 2048),
         ("mixtral-8x7b", 128), ("mixtral-8x7b", 256)]
GLUON_64 = [GemmConfig(64, 128, 128, g, 4, s, scale_overlap=1) for g, s in ((8, 3), (8, 4), (8, 5), (4, 4))]


def main():
    out_path = sys.argv[1]
    cases = [(a.split(":")[0], int(a.split(":")[1])) for a in sys.argv[2:]] or CASES
    dev = torch.device("cuda")
    rows, weights = [], {}
    for preset, t in cases:
        shape, w = preset_weights(preset, "fp8-block", weights, dev)
        inputs = []
        for b in range(batches_for(t)):
            batch = sorted_batch(shape, *random_routing(shape, t, dev, seed=t * 1000 + b), indexed=True)
            inputs.append((batch, RowLayout.of(batch), *quantize_activation(batch.hidden, "fp8-block")))

        def run(c, inp):
            batch, layout, xq, xs = inp
            inter, extra = gate_up(xq, xs, w.w13, w.w13_scale, layout, "fp8-block", "silu", torch.bfloat16, c,
                                   source_rows=batch.source_rows)
            return down_input(inter, extra, "fp8-block")

        gluon = [fit(c, fused_pair=True, scheme="fp8-block", elem_bytes=1, n_size=shape.inter) for c in GLUON_64]
        timed = []
        for c in candidates(shape, t)[0] + gluon:
            try:
                us = graph_time_ms([lambda c=c, i=i: run(c, i) for i in inputs], 20) * 1e3
                timed.append(dict(cfg=c.to_dict(), us=round(us, 1)))
            except Exception as exc:  # a tile that does not compile here: recorded, not fatal
                timed.append(dict(cfg=c.to_dict(), error=repr(exc)[:200]))
        ok = [r for r in timed if "us" in r]
        best = min(ok, key=lambda r: r["us"])
        best_g = min((r for r in ok if r["cfg"]["scale_overlap"]), key=lambda r: r["us"], default=None)
        best_t = min((r for r in ok if not r["cfg"]["scale_overlap"]), key=lambda r: r["us"])
        c = lambda r: "{block_m}x{block_n}x{block_k} g{group_m} w{num_warps} s{num_stages} o{scale_overlap}".format(
            **r["cfg"])
        print(f"{preset:14} T={t:<5} best Triton {best_t['us']:8.1f} ({c(best_t)})  best Gluon-64 "
              f"{best_g['us'] if best_g else float('nan'):8.1f} ({c(best_g) if best_g else '-'})  -> {c(best)}",
              flush=True)
        rows.append(dict(preset=preset, T=t, timed=timed))
    json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
