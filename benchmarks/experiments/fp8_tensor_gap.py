"""Why fp8-tensor layers trail fp8-channel ones past the sort's quantization limit (Qwen3 T=128 211.7 against 193.1 µs,
Mixtral T=16 348.1 against 312.1; fp8_tensor_in_sort_2026-12-01_h200_3a99d19.md): the kernels of one graph replay of
each (decode_timeline.py's CUPTI method) and the graph µs, and fp8-tensor with expert_sort.TENSOR_QUANT_IN_SORT_MAX
raised so that the sort's launch quantizes the tokens (each quantizing program then reads the whole batch for its
amax). Outputs of the raised limits are checked bit-equal to the shipped one's.

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD python benchmarks/experiments/fp8_tensor_gap.py [OUT.json [LIMIT,...]]
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from decode_timeline import layer_calls, timeline  # noqa: E402
from moeflow.benchmark import clean_graph_us, graph_us  # noqa: E402
from moeflow.dispatch import expert_sort  # noqa: E402

ROWS = [("qwen3-30b-a3b", (16, 128, 1024)), ("mixtral-8x7b", (16, 128))]
LIMITS = tuple(int(v) for v in sys.argv[2].split(":")) if len(sys.argv) > 2 else (32768, 1 << 17, 1 << 19, 1 << 21)
SHIPPED = expert_sort.TENSOR_QUANT_IN_SORT_MAX


def main():
    out = {}
    rows = [(preset, scheme, t) for preset, tokens in ROWS for scheme in ("fp8-channel", "fp8-tensor") for t in tokens]
    for name, fn in layer_calls(rows):
        limits = LIMITS if "fp8-tensor" in name else (SHIPPED,)
        ref = None
        for lim in limits:
            expert_sort.TENSOR_QUANT_IN_SORT_MAX = lim
            got = fn()
            ref = got if ref is None else ref
            assert torch.equal(got, ref), (name, lim)
            kernels, span, _ = timeline(fn)
            g = [graph_us(fn) for _ in range(2)]
            c = clean_graph_us(fn)
            key = f"{name} limit={lim}"
            out[key] = dict(graph_us=round(min(g), 2), clean_us=round(c, 2), span_us=round(span, 2), kernels=kernels)
            print(f"== {key}: graph {min(g):.1f} clean {c:.1f} span {span:.1f}: " + ", ".join(
                f"{r['kernel'][:20]} {r['dur_us']:.1f}" for r in kernels), flush=True)
        expert_sort.TENSOR_QUANT_IN_SORT_MAX = SHIPPED
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)
    print("\n| row | graph µs | clean µs | span µs |")
    for name, r in out.items():
        print(f"| {name} | {r['graph_us']:.1f} | {r['clean_us']:.1f} | {r['span_us']:.1f} |")


if __name__ == "__main__":
    main()
