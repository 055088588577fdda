"""What the L2 flush itself costs the layer's timing: triton's do_bench flushes by writing 256 MB of zeros, which
leaves up to the L2's size of dirty lines that the timed kernel then writes back to HBM as its reads evict them.
Here the whole layer's CUDA graph (bench_layer.py's Case.layer) is timed three ways, median of 100 replays:
    dirty   triton.testing.do_bench as bench_layer.py uses it (256 MB zeroed before each replay)
    clean   a 1 GiB buffer read before each replay (amax): the L2 holds clean lines, nothing to write back
    both    the 256 MB zeroing, then the 1 GiB read
One H200.

    PYTHONPATH=$PWD OUT=DIR python benchmarks/experiments/flush_mode.py [--tokens 1,16,128]
Writes flush_mode.json under OUT; prints a table last.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main():
    from triton.testing import do_bench
    from bench_layer import Case
    from moeflow.benchmark import timed_after_us as timed
    from moeflow.experts import create_runner
    from moeflow.kernels.autotune import capture_graph
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,16,128")
    p.add_argument("--presets", default="qwen3-30b-a3b,mixtral-8x7b,deepseek-v3")
    args = p.parse_args()
    big = torch.ones(1 << 27, dtype=torch.int64, device="cuda")  # 1 GiB, read to leave clean lines
    zeros = torch.empty(int(256e6 // 4), dtype=torch.int32, device="cuda")  # do_bench's flush
    clean = lambda: big.amax()
    both = lambda: (zeros.zero_(), big.amax())
    rows = []
    for preset in args.presets.split(","):
        for scheme in ("none", "fp8-block"):
            case = Case(preset, scheme)
            runner = create_runner("triton", case.cfg.replace(runner="triton"), case.scheme)
            for t in (int(v) for v in args.tokens.split(",")):
                x, logits = case.inputs(t, 1)[0]
                g = capture_graph(lambda: case.layer(runner, x, logits), warmups=2)
                r = dict(preset=preset, scheme=scheme, T=t,
                         dirty=do_bench(g.replay, warmup=10, rep=50, return_mode="median") * 1e3,
                         clean=timed(g.replay, clean), both=timed(g.replay, both))
                rows.append(r)
                print(f"{preset:14} {scheme:9} T={t:5}  dirty {r['dirty']:8.1f}  clean {r['clean']:8.1f}  "
                      f"both {r['both']:8.1f} us", flush=True)
                del g
            del runner, case
            torch.cuda.empty_cache()
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "flush_mode.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
