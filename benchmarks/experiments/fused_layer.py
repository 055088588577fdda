"""The one-launch small-batch layer (kernels/fused_layer.py) against the shipped separate launches: the whole
layer (route -> dispatch -> experts -> combine) replayed from a CUDA graph, L2 flushed (bench_layer.py's
headline method), PERF.md's shapes. One H200.

    PYTHONPATH=$PWD OUT=DIR python benchmarks/experiments/fused_layer.py [--tokens 1,2,4,8,16]
        [--schemes none,fp8-block] [preset ...]

Per preset, scheme (default none = bf16 and fp8-block; fp8-channel runs it too) and T: the shipped layer (what
its table runs: on H200 the one launch at T = 1), each candidate tile set of kernels/tune_fused.py forced into the
runner, then the shipped layer again (the drift between the two shipped timings bounds what a difference means);
each candidate's error against the shipped layer's output. Candidates are compiled first in worker processes. Writes
fused_layer.json under OUT; prints a table last.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))



def _shape(preset, scheme):
    from moeflow.kernels.autotune import Shape
    from moeflow.presets import PRESETS
    p = PRESETS[preset]
    return Shape(p["num_experts"], p["hidden_size"], p["intermediate_size"], p["top_k"], scheme)


def main():
    from bench_layer import Case, ceilings, graph_us
    from moeflow.benchmark import Ceilings, roofline_seconds
    from moeflow.experts import create_runner
    from moeflow.kernels.autotune import precompile
    from moeflow.kernels.tune_fused import fused_candidates
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,2,4,8,16")
    p.add_argument("--schemes", default="none,fp8-block", help="comma-separated quantization schemes")
    p.add_argument("presets", nargs="*", default=["qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"])
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    out_dir = os.environ.get("OUT", ".")
    start = time.time()
    schemes = args.schemes.split(",")
    shapes = [_shape(pr, s) for pr in args.presets for s in schemes]
    jobs = {(sh, c, True) for sh in shapes for t in tokens for c in fused_candidates(sh, t)}
    precompile(list(jobs))
    print(f"compiled {len(jobs)} in {time.time() - start:.0f}s", file=sys.stderr, flush=True)
    ceil = ceilings()
    rows = []
    for preset in args.presets:
        for scheme in schemes:
            case = Case(preset, scheme)
            runner = create_runner("triton", case.cfg.replace(runner="triton"), case.scheme)
            e = case.cfg.num_experts
            for t in tokens:
                ins = case.inputs(t)
                want = case.layer(runner, *ins[0])
                hit = int(case.router(ins[0][1], case.bias)[0].unique().numel())
                floor = roofline_seconds(case.cfg, t, Ceilings(**ceil), hit) * 1e6
                base = graph_us(lambda: case.layer(runner, *ins[0]))
                res = []
                for cfg in fused_candidates(case.shape, t):
                    runner._fitted[("fused", t, e)] = cfg
                    err = ((case.layer(runner, *ins[0]).double() - want.double()).norm() / want.double().norm()).item()
                    res.append((graph_us(lambda: case.layer(runner, *ins[0])), err, cfg))
                runner._fitted[("fused", t, e)] = None
                base2 = graph_us(lambda: case.layer(runner, *ins[0]))
                best = min(res, key=lambda r: r[0])
                row = dict(preset=preset, scheme=scheme, T=t, shipped_us=base, shipped_again_us=base2, floor_us=floor,
                           best_us=best[0], best_err=best[1], best=best[2].to_dict(),
                           candidates=[dict(us=u, err=er, cfg=c.to_dict()) for u, er, c in res])
                rows.append(row)
                print(f"{preset:14} {scheme:9} T={t:<3} shipped {base:8.1f} / {base2:8.1f}  fused best {best[0]:8.1f} "
                      f"({100 * floor / best[0]:5.1f}% roof, err {best[1]:.1e}) {best[2]}", file=sys.stderr, flush=True)
            del case, runner
            torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "fused_layer.json"), "w") as fh:
        json.dump(dict(device=torch.cuda.get_device_name(), ceilings=ceil, rows=rows), fh, indent=1)
    print(f"{'preset':14} {'scheme':9} {'T':>3} {'shipped':>8} {'again':>8} {'fused':>8} {'x':>5} {'roof%':>6}")
    for r in rows:
        print(f"{r['preset']:14} {r['scheme']:9} {r['T']:>3} {r['shipped_us']:8.1f} {r['shipped_again_us']:8.1f} "
              f"{r['best_us']:8.1f} {min(r['shipped_us'], r['shipped_again_us']) / r['best_us']:5.2f} "
              f"{100 * r['floor_us'] / r['best_us']:6.1f}  {tuple(r['best'].values())}")


if __name__ == "__main__":
    main()
