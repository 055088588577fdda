"""Does the tuner pick the same tiles when the GPU is held at its power cap? One H200.

The tuner (moeflow/kernels/autotune.py) times each candidate for ~15 ms from a CUDA graph, between pauses for host
work, so mostly at the clock the GPU reaches before its power controller acts. The layer runs its compute-bound rows
at the 700 W cap with SM clocks of 1320-1635 MHz (power_clocks_2026-12-02_h200_b11282f.md). A candidate that burns
less power per byte or FLOP (fewer padded rows through the tensor cores, less operand traffic) gets a higher clock
there. This times every tuner candidate of one GEMM two ways, on the tuner's batches:
    burst      autotune.graph_time_ms after IDLE_S seconds idle (the tuner's timing)
    sustained  the same, right after WARM_S seconds of back-to-back replays of that candidate
and prints both rankings.

    PYTHONPATH=$PWD OUT=DIR python benchmarks/experiments/sustained_tiles.py [preset:scheme:T:gemm ...]

gemm is gate_up or down. Writes sustained_tiles.json under OUT; prints a table last.
"""
import json
import os
import sys
import time

import torch

from moeflow.kernels.autotune import (candidates, capture_graph, covering_pairs, gemm_inputs, graph_time_ms, precompile,
                                      tuner_routings)
from moeflow.kernels.down import down
from moeflow.kernels.gate_up import gate_up
from moeflow.kernels.quant import down_input

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import preset_weights  # noqa: E402

CASES = ["mixtral-8x7b:none:128:gate_up", "mixtral-8x7b:none:128:down", "qwen3-30b-a3b:none:4096:gate_up"]
IDLE_S, WARM_S = float(os.environ.get("IDLE_S", 1.5)), float(os.environ.get("WARM_S", 1.0))


def run_case(spec: str) -> dict:
    preset, scheme, t, gemm = spec.split(":")
    t = int(t)
    dev = torch.device("cuda")
    shape, weights = preset_weights(preset, scheme, {}, dev)
    gu_c, dn_c = candidates(shape, t)
    precompile([(shape, pair, True) for pair in covering_pairs(gu_c, dn_c)])
    ins = gemm_inputs(shape, tuner_routings(shape, t, dev), indexed_rows=True)

    def run_gu(c, inp):
        batch, layout, xq, xs = inp
        return gate_up(xq, xs, weights.w13, weights.w13_scale, layout, scheme, "silu", shape.dtype, c,
                       source_rows=batch.source_rows)

    if gemm == "gate_up":
        cands, calls = gu_c, lambda c: [lambda c=c, i=i: run_gu(c, i) for i in ins]
    else:
        dn_in = [(*down_input(*run_gu(gu_c[0], i), scheme), i[0].weights, i[1]) for i in ins]
        cands = dn_c
        calls = lambda c: [lambda c=c, d=d: down(d[0], d[1], weights.w2, weights.w2_scale, d[2], d[3], scheme,
                                                 shape.dtype, c) for d in dn_in]
    res = []
    for c in cands:
        cl = calls(c)
        time.sleep(IDLE_S)
        burst = graph_time_ms(cl, 15) * 1e3
        g = capture_graph(lambda: [f() for f in cl])
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < WARM_S:
            g.replay()
            torch.cuda.synchronize()
        del g
        sustained = graph_time_ms(cl, 15) * 1e3
        res.append(dict(cfg=str(c), burst_us=round(burst, 1), sustained_us=round(sustained, 1)))
        print(f"{spec:34s} burst {burst:9.1f}  sustained {sustained:9.1f}  {c}", flush=True)
    return dict(candidates=res)


def main():
    out = {c: run_case(c) for c in (sys.argv[1:] or CASES)}
    with open(os.path.join(os.environ.get("OUT", "."), "sustained_tiles.json"), "w") as f:
        json.dump(out, f, indent=1)
    for spec, r in out.items():
        cs = r["candidates"]
        rank = lambda key: [cs.index(x) for x in sorted(cs, key=lambda x: x[key])]
        print(f"\n{spec}: burst ranking {rank('burst_us')[:5]}, sustained ranking {rank('sustained_us')[:5]}")
        for j, x in enumerate(cs):
            print(f"  {j:2d} {x['burst_us']:9.1f} {x['sustained_us']:9.1f} {x['sustained_us'] / x['burst_us']:6.3f}  "
                  f"{x['cfg'][11:]}")


if __name__ == "__main__":
    main()
