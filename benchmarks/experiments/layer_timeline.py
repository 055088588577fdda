"""Where a large-batch layer's time goes: the kernels of one CUDA-graph replay of the whole layer (decode_timeline.py's
method: CUPTI through torch.profiler, mean of 20 synchronized replays), for PERF.md rows below 60% of roofline.

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD python benchmarks/experiments/layer_timeline.py [OUT.json]
"""
import json
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from bench_layer import graph_us  # noqa: E402
from decode_timeline import layer_calls, timeline  # noqa: E402

CASES = [("deepseek-v3", "fp8-block", 4096), ("deepseek-v3", "fp8-block", 16384), ("qwen3-30b-a3b", "fp8-block", 1024),
         ("qwen3-30b-a3b", "fp8-block", 4096), ("qwen3-30b-a3b", "fp8-block", 16384), ("qwen3-30b-a3b", "none", 4096),
         ("qwen3-30b-a3b", "none", 16384), ("mixtral-8x7b", "fp8-block", 1024)]


def main():
    out = {}
    for name, fn in layer_calls(CASES):
        rows, span, _ = timeline(fn)
        g = graph_us(fn)
        out[name] = dict(graph_us=round(g, 1), span_us=round(span, 1), kernels=rows)
        print(f"== {name}: graph {g:.0f} us, span {span:.0f} us; " + ", ".join(
            f"{r['kernel'][:22]} {r['dur_us']:.0f}" for r in rows), flush=True)
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
