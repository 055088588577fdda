"""Where the T=1 layer's time goes with the one launch (kernels/fused_layer.py): each part replayed alone from
a CUDA graph, L2 flushed (bench_layer.py's method). One H200.

    PYTHONPATH=$PWD OUT=DIR python benchmarks/experiments/fused_parts.py [preset:scheme:T ...]

Per case: the whole layer (route -> one launch), the route launch alone, the one launch alone (ids from one
routing), an empty kernel (what a graph replay costs with nothing to do), and the one launch alone twice in one
graph (its time without the replay's start). Writes fused_parts.json under OUT; prints a table last.
With ``--ncu`` it only runs the one launch 8 times (for ncu -k regex:_fused_layer_kernel -s 4 -c 1).
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CASES = ["qwen3-30b-a3b:none:1", "qwen3-30b-a3b:fp8-block:1", "deepseek-v3:fp8-block:1", "mixtral-8x7b:fp8-block:1"]


@triton.jit
def _nothing(p):
    if tl.program_id(0) < 0:
        tl.store(p, 0)


def main():
    from bench_layer import graph_us
    from fused_trace import routed_case
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    ncu = "--ncu" in sys.argv
    rows = []
    dummy = torch.zeros(1, device="cuda")
    for spec in args or CASES:
        preset, scheme, t = spec.split(":")
        case, runner, x, logits, ids, w, fcfg = routed_case(preset, scheme, int(t))
        fused = lambda: runner.run_fused(x, ids, w, case.weights, fcfg)
        if ncu:
            for _ in range(8):
                fused()
            torch.cuda.synchronize()
            continue
        r = dict(case=spec, fused_cfg=str(fcfg), layer=graph_us(lambda: case.layer(runner, x, logits)),
                 route=graph_us(lambda: case.router(logits, case.bias)), fused=graph_us(fused),
                 fused_twice=graph_us(lambda: (fused(), fused())), empty=graph_us(lambda: _nothing[(1,)](dummy)))
        rows.append(r)
        del runner, case
        torch.cuda.empty_cache()
    if ncu:
        return
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "fused_parts.json"), "w"), indent=1)
    print(f"{'case':28} {'layer':>7} {'route':>7} {'fused':>7} {'2xfused':>8} {'empty':>7}  (graph replay us)")
    for r in rows:
        print(f"{r['case']:28} {r['layer']:7.1f} {r['route']:7.1f} {r['fused']:7.1f} {r['fused_twice']:8.1f} "
              f"{r['empty']:7.1f}  {r['fused_cfg']}")


if __name__ == "__main__":
    main()
