"""fp8-block decode: the activation quantization inside gate_up's K loop (configs.quantizes_x) against
the separate quantization kernel before it, whole layer replayed as a CUDA graph (bench_layer's
graph_us), the two alternated twice in one process; outputs must be bit-equal.

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD python benchmarks/experiments/fused_x_quant.py [OUT.json]
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from bench_layer import Case, graph_us  # noqa: E402
from moeflow.experts import create_runner  # noqa: E402
from moeflow.kernels import configs  # noqa: E402

ON = configs.FUSED_X_QUANT_MAX_BLOCK_M


def main():
    out = []
    for preset in ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3"):
        case = Case(preset, "fp8-block")
        runner = create_runner("triton", case.cfg.replace(runner="triton"), case.scheme)
        for t in (1, 16, 128):
            x, logits = case.inputs(t, 1)[0]
            fn = lambda: case.layer(runner, x, logits)  # noqa: E731
            us = {"fused": [], "separate": []}
            ys = {}
            for _ in range(2):
                for mode, limit in (("fused", ON), ("separate", 0)):
                    configs.FUSED_X_QUANT_MAX_BLOCK_M = limit
                    ys[mode] = fn()
                    us[mode].append(graph_us(fn))
            configs.FUSED_X_QUANT_MAX_BLOCK_M = ON
            gu = runner.kernel_config(case.dispatcher.dispatch(x, *case.router(logits, case.bias))[0], case.weights).gate_up
            row = dict(preset=preset, T=t, gate_up=str(gu), fused_us=us["fused"], separate_us=us["separate"],
                       fuses=configs.quantizes_x("fp8-block", gu), bit_equal=torch.equal(ys["fused"], ys["separate"]))
            out.append(row)
            print(f"{preset:14s} T={t:4d} fuses={row['fuses']!s:5s} fused {min(us['fused']):8.1f} us  "
                  f"separate {min(us['separate']):8.1f} us  bit-equal {row['bit_equal']}", flush=True)
        del case, runner
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
