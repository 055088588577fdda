"""Experiment (GPU): each bf16 GEMM of the layer alone against torch._grouped_mm (CUTLASS, PERF.md's anchor) on the
same rows: µs and TFLOP/s of the shipped table's gate_up and down (gemm_sweep's routings and graph timing) and of
torch._grouped_mm over the same rows without padding (gate_up: x [R, H] @ gate_up_proj[e].T -> [R, 2I], no
activation; down: [R, I] @ down_proj[e].T -> [R, H], no routing weight), plus the 8192^3 dense bf16 matmul as the
run's ceiling. The anchor does less work (no activation, no routing weight), so it is a bound to beat, not a twin.

    PYTHONPATH=$PWD python benchmarks/experiments/bf16_gemms.py OUT.json [preset:T,...]
"""
import json
import os
import sys

import torch

from moeflow.kernels.autotune import graph_time_ms

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import gemm_case, gemm_rows, gemm_runner, preset_weights  # noqa: E402

ROWS = [("deepseek-v3", 4096), ("deepseek-v3", 16384), ("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384),
        ("mixtral-8x7b", 1024), ("mixtral-8x7b", 16384)]


def main():
    out_path = sys.argv[1]
    rows = ROWS if len(sys.argv) < 3 else [(p, int(t)) for p, t in (r.split(":") for r in sys.argv[2].split(","))]
    dev = torch.device("cuda")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    dense_tf = 2 * 8192 ** 3 / (graph_time_ms([lambda: a @ b], 200) * 1e-3) / 1e12
    del a, b
    result = dict(dense_bf16_tflops=round(dense_tf, 1), rows=[])
    print(f"dense bf16 8192^3: {dense_tf:.0f} TFLOP/s")
    cache = {}
    for preset, t in rows:
        shape, w = preset_weights(preset, "none", cache, dev)
        kcfg = gemm_case(preset, "none", t, dev)[3]
        for gemm in ("gate_up", "down"):
            d = gemm_rows(shape, t, gemm, dev)[0]
            x, _, lay, _ = d
            run = gemm_runner(gemm, w, "none")
            gcfg = getattr(kcfg, gemm)
            ours = graph_time_ms([lambda: run(d, gcfg)], 100) * 1e3
            offs = lay.meta[1:].to(torch.int32)  # sorted layout: expert e's rows meta[e]:meta[e + 1], no padding
            wt = (w.w13 if gemm == "gate_up" else w.w2).transpose(-2, -1)
            anchor = graph_time_ms([lambda: torch._grouped_mm(x, wt, offs=offs)], 100) * 1e3
            n_out = 2 * shape.inter if gemm == "gate_up" else shape.hidden
            k_in = shape.hidden if gemm == "gate_up" else shape.inter
            flops = 2 * lay.rows * n_out * k_in
            row = dict(preset=preset, T=t, gemm=gemm, config=str(gcfg), ours_us=round(ours, 1),
                       grouped_mm_us=round(anchor, 1), ours_tflops=round(flops / ours / 1e6, 1),
                       grouped_mm_tflops=round(flops / anchor / 1e6, 1))
            result["rows"].append(row)
            print(f"{preset} T={t} {gemm}: ours {ours:.1f} us ({row['ours_tflops']} TF/s), grouped_mm {anchor:.1f} us "
                  f"({row['grouped_mm_tflops']} TF/s); {gcfg}", flush=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
