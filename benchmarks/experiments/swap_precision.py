"""Experiment (GPU): are swapped tiles (GemmConfig.swap_ab) as precise as the unswapped ones? One H200.

The layer benchmark's error against the reference runner moved from ~1e-4 to ~5e-3 on the fp8-block rows whose
tiles became swapped (benchmarks/results/swap_tiles_2026-12-03_h200_6f8497e.md). Here, per preset and FP8 scheme at
T = 16 and 128, gate_up's intermediate (narrow tiles: returned in bf16, before any quantization) and down's output
from the same 16-row tile unswapped (mma.sync, fp8 operands converted to fp16) and swapped (fp8 wgmma), each against a
float64 product of the same dequantized operands; and how many of the intermediate's fp8 codes each path changes
once quantized in 1x128 groups, against the float64 intermediate quantized the same way.

    PYTHONPATH=$PWD python benchmarks/experiments/swap_precision.py OUT.json
"""
import json
import sys

import torch

from moeflow.kernels.autotune import Shape, gemm_inputs, random_weights, tuner_routings
from moeflow.kernels.configs import GemmConfig
from moeflow.kernels.down import down
from moeflow.kernels.gate_up import _expert_of_row, gate_up
from moeflow.kernels.quant import quantize_groups
from moeflow.presets import PRESETS
from moeflow.quant import create_scheme


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    rows = []
    dev = torch.device("cuda")
    for preset in ("qwen3-30b-a3b", "mixtral-8x7b"):
        p = PRESETS[preset]
        for scheme in ("fp8-block", "fp8-tensor"):
            shape = Shape(p["num_experts"], p["hidden_size"], p["intermediate_size"], p["top_k"], scheme)
            w = random_weights(shape, dev)
            sch = create_scheme(scheme)
            w13, w2 = sch.dequantize_weight(w.w13, w.w13_scale), sch.dequantize_weight(w.w2, w.w2_scale)
            for t in (16, 128):
                batch, layout, xq, xs = gemm_inputs(shape, tuner_routings(shape, t, dev)[:1], True)[0]
                xf = sch.dequantize_activation(xq, xs).double()[batch.source_rows]
                expert = _expert_of_row(layout)
                truth = torch.zeros(layout.rows, shape.inter, dtype=torch.float64, device=dev)
                for e in expert.unique().tolist():
                    sel = expert == e
                    gate, up = (xf[sel] @ w13[e].double().T).chunk(2, dim=1)
                    truth[sel] = torch.nn.functional.silu(gate) * up
                tq, ts = quantize_groups(truth.to(torch.bfloat16))
                out = dict(preset=preset, scheme=scheme, T=t)
                for name, swap in (("mma.sync", 0), ("swapped", 1)):
                    inter, _ = gate_up(xq, xs, w.w13, w.w13_scale, layout, scheme, "silu", torch.bfloat16,
                                       GemmConfig(16, 64, 128, 1, 4, 3, swap_ab=swap), source_rows=batch.source_rows)
                    q, s = quantize_groups(inter)
                    out[f"gate_up {name} rel err"] = rel(inter, truth)
                    out[f"fp8 codes changed {name}"] = (q.view(torch.uint8) != tq.view(torch.uint8)).float().mean().item()
                    if scheme == "fp8-block":  # down on this path's own quantized intermediate
                        af = sch.dequantize_activation(q, s).double()
                        d_truth = torch.zeros(layout.rows, shape.hidden, dtype=torch.float64, device=dev)
                        for e in expert.unique().tolist():
                            sel = expert == e
                            d_truth[sel] = af[sel] @ w2[e].double().T
                        got = down(q, s, w.w2, w.w2_scale, torch.ones(layout.rows, device=dev), layout, scheme,
                                   torch.bfloat16, GemmConfig(16, 128, 128, 1, 4, 3, swap_ab=swap))
                        out[f"down {name} rel err"] = rel(got, d_truth)
                rows.append(out)
                print(json.dumps({k: (f"{v:.3e}" if isinstance(v, float) else v) for k, v in out.items()}), flush=True)
            del w, w13, w2
            torch.cuda.empty_cache()
    json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
