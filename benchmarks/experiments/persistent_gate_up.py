"""Experiment (GPU): the persistent gate_up (GemmConfig.programs_per_sm > 0) against one program per
tile, at the mid and large token counts where the per-tile gate_up runs short K loops many times
(Qwen3: 16 K steps per tile at H = 2048) and kernels/down.py's persistent form paid (1.2x on
Qwen3's down, benchmarks/results/persistent_down_*).

For each (preset, scheme, T): the gate_up alone, as the tuner times it (autotune.graph_time_ms over
batches_for(T) sorted batches, weights cold), for the shipped tuned config and for persistent
variants of it and of a few tiles whose registers leave room for the loop's state (ptxas:
kernels/registers.py); each persistent result is checked bit for bit against its per-tile twin.

    PYTHONPATH=$PWD python benchmarks/experiments/persistent_gate_up.py --out $OUT/pgu.json
Prints one line per (case, config) and writes the rows as JSON.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from moeflow.kernels import configs as kc
from moeflow.kernels.autotune import Shape, batches_for, graph_time_ms, precompile, random_batch, random_weights
from moeflow.kernels.common import RowLayout
from moeflow.kernels.configs import GemmConfig, MoEKernelConfig, fit
from moeflow.kernels.gate_up import gate_up
from moeflow.kernels.quant import quantize_rows
from moeflow.presets import preset_config

CASES = [("qwen3-30b-a3b", s, t) for s in ("none", "fp8-block") for t in (1024, 4096, 16384)] + \
        [("mixtral-8x7b", s, t) for s in ("none", "fp8-block") for t in (1024, 4096)] + \
        [("deepseek-v3", s, t) for s in ("none", "fp8-block") for t in (4096,)]


def variants(shipped: GemmConfig, scheme: str, inter: int) -> list[GemmConfig]:
    bk = 64 if scheme == "none" else 128
    out = [shipped, replace(shipped, programs_per_sm=1), replace(shipped, programs_per_sm=2),
           GemmConfig(64, 128, bk, 8, 8, 4, 1), GemmConfig(128, 128, bk, 8, 8, 3, 1), GemmConfig(128, 64, bk, 8, 8, 4, 1),
           GemmConfig(64, 128, bk, 8, 4, 4, 2) if scheme == "none" else GemmConfig(64, 64, bk, 8, 4, 4, 2)]
    seen = []
    for c in out:
        c = fit(c, fused_pair=True, scheme=scheme, elem_bytes=1 if scheme != "none" else 2, n_size=inter)
        if c not in seen:
            seen.append(c)
    return seen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rep-ms", type=float, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    plans = []
    for preset, scheme, t in CASES:
        c = preset_config(preset)
        shape = Shape(c.num_experts, c.hidden_size, c.intermediate_size, c.top_k, scheme)
        table = kc.find_table(torch.cuda.get_device_name(dev), c.num_experts, c.intermediate_size, c.hidden_size,
                              scheme)
        shipped = fit(kc.nearest(table, t).gate_up, fused_pair=True, scheme=scheme,
                      elem_bytes=1 if scheme != "none" else 2, n_size=c.intermediate_size)
        plans.append((preset, scheme, t, shape, variants(shipped, scheme, c.intermediate_size)))
    down = {s: GemmConfig(64, 128, 64 if s == "none" else 128, 8, 4, 4) for s in ("none", "fp8-block")}
    precompile([(shape, MoEKernelConfig(v, down[shape.scheme])) for *_, shape, vs in plans for v in vs])
    rows = []
    for preset, scheme, t, shape, vs in plans:
        weights = random_weights(shape, dev)
        inputs = []
        for b in range(batches_for(t)):
            batch = random_batch(shape, t, dev, seed=t * 1000 + b)
            layout = RowLayout.of(batch)
            xq, xs = quantize_rows(batch.hidden, scheme, layout) if scheme != "none" else (batch.hidden, None)
            inputs.append((layout, xq, xs))

        def run(cfg, inp):
            layout, xq, xs = inp
            return gate_up(xq, xs, weights.w13, weights.w13_scale, layout, scheme, "silu", torch.bfloat16, cfg)

        base = None
        for cfg in vs:
            us = graph_time_ms([lambda c=cfg, i=i: run(c, i) for i in inputs], args.rep_ms) * 1e3
            same = None
            if cfg.programs_per_sm:
                got, want = run(cfg, inputs[0]), run(replace(cfg, programs_per_sm=0), inputs[0])
                same = all(g is None or torch.equal(g.view(torch.uint8), r.view(torch.uint8)) for g, r in zip(got, want))
            base = base or us
            row = dict(preset=preset, scheme=scheme, T=t, config=str(cfg), us=round(us, 1),
                       vs_shipped=round(us / base, 3), bit_equal_per_tile=same)
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print("\ncase                          shipped us   best us  best config")
    for key in dict.fromkeys((r["preset"], r["scheme"], r["T"]) for r in rows):
        rs = [r for r in rows if (r["preset"], r["scheme"], r["T"]) == key]
        best = min(rs, key=lambda r: r["us"])
        print(f"{key[0][:8]:8} {key[1]:9} {key[2]:6}  {rs[0]['us']:10.1f} {best['us']:9.1f}  {best['config']}")


if __name__ == "__main__":
    main()
