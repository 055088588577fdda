"""Why a decode layer's single graph replay takes longer than its kernels' span (decode_timeline.py:
Qwen3 bf16 T=1 44.7 µs synchronized against a 33.3 µs span; Mixtral none). Graphs of growing
prefixes of the layer (route; + sort; + gate_up; + down; + top-k sum), each timed three ways, with
programmatic dependent launch on and off:
    bench   triton's do_bench (L2 flushed before each replay, median): bench_layer's method
    synced  events around one replay, synchronized after each (median of 50)
    b2b     50 replays back to back between two events, / 50

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD python benchmarks/experiments/graph_gap.py [OUT.json]
"""
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from bench_layer import Case  # noqa: E402
from decode_timeline import event_us  # noqa: E402  (this script's directory is on sys.path)
from moeflow.experts import create_runner  # noqa: E402
from moeflow.kernels.autotune import capture_graph  # noqa: E402
from moeflow.layouts import run_in_layout  # noqa: E402


def timings(g):
    b2b, synced = event_us(g)
    bench = do_bench(g.replay, warmup=10, rep=30, return_mode="median") * 1e3
    return dict(bench=round(bench, 2), synced=round(synced, 2), b2b=round(b2b, 2))


def main():
    out = {}
    z = torch.zeros(1, device="cuda")
    out["one tiny kernel"] = timings(capture_graph(lambda: z.add_(1), warmups=2))
    print("one tiny kernel", out["one tiny kernel"], flush=True)
    for preset, scheme in (("qwen3-30b-a3b", "none"), ("mixtral-8x7b", "none"), ("deepseek-v3", "fp8-block")):
        case = Case(preset, scheme)
        runner = create_runner("triton", case.cfg.replace(runner="triton"), case.scheme)
        case.use(runner)
        x, logits = case.inputs(1, 1)[0]
        d = case.dispatcher
        steps = {
            "route": lambda: case.router(logits, case.bias),
            "+sort": lambda: d.dispatch(x, *case.router(logits, case.bias)),
            "+experts": lambda: run_in_layout(runner, d.dispatch(x, *case.router(logits, case.bias))[0], case.weights),
            "layer": lambda: case.layer(runner, x, logits),
        }
        for pdl in ("1", "0"):
            os.environ["MOEFLOW_TRITON_PDL"] = pdl
            for name, fn in steps.items():
                key = f"{preset} {scheme} T=1 pdl={pdl} {name}"
                out[key] = timings(capture_graph(fn, warmups=2))
                print(f"{key:50s} " + "  ".join(f"{k} {v:7.2f}" for k, v in out[key].items()), flush=True)
        os.environ["MOEFLOW_TRITON_PDL"] = "1"
        del case, runner
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
