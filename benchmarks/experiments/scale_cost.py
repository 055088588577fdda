"""Experiment (GPU): what fp8-block's per-K-step scaling costs the shipped GEMM kernels. Each GEMM
runs with fp8-block's tuned config twice on the same shape and routing: as fp8-block (the
wgmma result scaled by the 1x128 x 128x128 scales every K step) and as fp8-channel (one fp8
accumulator, scales applied once in the epilogue). Timed as the tuner times (CUDA graph, median).

    PYTHONPATH=$PWD python benchmarks/experiments/scale_cost.py [OUT_DIR]
"""
import json
import os
import sys

import torch

from moeflow.kernels.autotune import Shape, graph_time_ms, random_weights
from moeflow.kernels.down import down
from moeflow.kernels.gate_up import gate_up
from moeflow.kernels.quant import down_input, quantize_rows

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import gemm_case  # noqa: E402

CASES = [("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384), ("mixtral-8x7b", 4096), ("mixtral-8x7b", 16384),
         ("deepseek-v3", 4096), ("deepseek-v3", 16384)]


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", ".")
    dev = torch.device("cuda")
    rows = []
    for preset, t in CASES:
        block, batch, layout, kcfg = gemm_case(preset, "fp8-block", t, dev)
        e, h, i, k = block.num_experts, block.hidden, block.inter, block.top_k
        res = dict(preset=preset, T=t, gate_up_cfg=kcfg.gate_up.to_dict(), down_cfg=kcfg.down.to_dict())
        for scheme in ("fp8-block", "fp8-channel"):
            shape = Shape(e, h, i, k, scheme)
            w = random_weights(shape, dev)
            xq, xs = quantize_rows(batch.hidden, scheme, layout)
            inter, extra = gate_up(xq, xs, w.w13, w.w13_scale, layout, scheme, "silu", torch.bfloat16, kcfg.gate_up)
            a, a_s = down_input(inter, extra, scheme)
            rw = batch.weights.float()
            gu = graph_time_ms([lambda: gate_up(xq, xs, w.w13, w.w13_scale, layout, scheme, "silu", torch.bfloat16,
                                                kcfg.gate_up)], 40) * 1e3
            dn = graph_time_ms([lambda: down(a, a_s, w.w2, w.w2_scale, rw, layout, scheme, torch.bfloat16,
                                             kcfg.down)], 40) * 1e3
            res[scheme] = dict(gate_up_us=round(gu, 1), down_us=round(dn, 1))
            torch.cuda.empty_cache()
        flop = 2 * t * k * h * i
        res["gate_up_tflops"] = {s: round(2 * flop / res[s]["gate_up_us"] / 1e6) for s in ("fp8-block", "fp8-channel")}
        res["down_tflops"] = {s: round(flop / res[s]["down_us"] / 1e6) for s in ("fp8-block", "fp8-channel")}
        rows.append(res)
        print(f"{preset:14} T={t:<6} gate_up block {res['fp8-block']['gate_up_us']:8.1f} us "
              f"({res['gate_up_tflops']['fp8-block']} TF)  channel {res['fp8-channel']['gate_up_us']:8.1f} us "
              f"({res['gate_up_tflops']['fp8-channel']} TF) | down block {res['fp8-block']['down_us']:8.1f} "
              f"({res['down_tflops']['fp8-block']} TF)  channel {res['fp8-channel']['down_us']:8.1f} "
              f"({res['down_tflops']['fp8-channel']} TF)", flush=True)
    json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(os.path.join(out_dir, "scale_cost.json"), "w"),
              indent=1)


if __name__ == "__main__":
    main()
