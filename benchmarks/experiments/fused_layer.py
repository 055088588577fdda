"""The one-launch small-batch layer (kernels/fused_layer.py) against the shipped separate launches: the whole
layer (route -> dispatch -> experts -> combine) replayed from a CUDA graph, L2 flushed (bench_layer.py's
headline method), PERF.md's shapes. One H200.

    PYTHONPATH=$PWD OUT=DIR python benchmarks/experiments/fused_layer.py [--tokens 1,2,4,8,16] [preset ...]

Per preset, scheme (none = bf16, fp8-block) and T: the shipped layer (its table: separate launches), each
candidate tile set forced into the runner, then the shipped layer again (the drift between the two shipped
timings bounds what a difference means); each candidate's error against the shipped layer's output. Candidates
are compiled first in worker processes. Writes fused_layer.json under OUT; prints a table last.
"""
import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# (BLOCK_N1, BLOCK_N2, stages, SPLIT1, SPLIT2), BLOCK_K 128: tiles of 64 rows or more run wgmma; SPLIT2 a multiple
# of top-k: each down program reads one copy (or part of one), so it waits for that copy's gate_up tiles only
FP8 = [(64, 64, 4, 1, 8), (64, 64, 4, 2, 8), (128, 128, 3, 2, 8), (64, 128, 4, 1, 8), (64, 64, 4, 4, 8),
       (128, 64, 3, 2, 8), (64, 64, 4, 2, 4), (128, 128, 3, 2, 4), (64, 64, 6, 2, 16), (128, 128, 3, 1, 16)]
# (BN1, BK1, BN2, BK2, stages, SPLIT1, SPLIT2)
BF16 = [(64, 128, 64, 128, 3, 2, 8), (64, 128, 64, 128, 3, 1, 8), (64, 64, 64, 64, 4, 2, 8), (64, 128, 128, 128, 3, 2, 8),
        (128, 64, 64, 64, 4, 2, 8), (64, 128, 64, 128, 3, 2, 4), (64, 64, 64, 64, 4, 4, 8), (64, 128, 64, 128, 3, 2, 16),
        (64, 128, 128, 64, 4, 1, 16), (64, 64, 64, 64, 6, 2, 8)]


def candidates(scheme):
    from moeflow.kernels.configs import FusedConfig, fit_fused
    if scheme == "fp8-block":
        return [fit_fused(FusedConfig(n1, 128, n2, 128, 4, s, s1, s2), scheme) for n1, n2, s, s1, s2 in FP8]
    return [fit_fused(FusedConfig(n1, k1, n2, k2, 4, s, s1, s2), scheme) for n1, k1, n2, k2, s, s1, s2 in BF16]


def _compile(jobs):
    """Worker: one launch of each (preset, scheme, FusedConfig) on expanded weights (Triton's disk cache)."""
    from moeflow.kernels.autotune import Shape, expanded_weights
    from moeflow.kernels.fused_layer import counters_size, fused_layer
    from moeflow.presets import PRESETS
    for preset, scheme, cfg in jobs:
        p = PRESETS[preset]
        shape = Shape(p["num_experts"], p["hidden_size"], p["intermediate_size"], p["top_k"], scheme)
        w = expanded_weights(shape, "cuda")
        x = torch.randn(1, shape.hidden, device="cuda", dtype=torch.bfloat16)
        ids = torch.arange(shape.top_k, device="cuda", dtype=torch.int32)[None]
        rw = torch.rand(1, shape.top_k, device="cuda")
        sync = torch.zeros(counters_size(1, shape.top_k, shape.hidden, shape.inter, cfg), dtype=torch.int32,
                           device="cuda")
        fused_layer(x, ids, rw, w.w13, w.w13_scale, w.w2, w.w2_scale, scheme, "silu", torch.bfloat16, cfg, sync)
    torch.cuda.synchronize()
    return len(jobs)


def main():
    import multiprocessing as mp
    from bench_layer import Case, ceilings, graph_us
    from moeflow.benchmark import Ceilings, roofline_seconds
    from moeflow.experts import create_runner
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,2,4,8,16")
    p.add_argument("presets", nargs="*", default=["qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"])
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    out_dir = os.environ.get("OUT", ".")
    start = time.time()
    jobs = [(pr, s, c) for pr in args.presets for s in ("none", "fp8-block") for c in candidates(s)]
    with ProcessPoolExecutor(12, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_compile, [jobs[i::12] for i in range(12)]))
    print(f"compiled {len(jobs)} in {time.time() - start:.0f}s", file=sys.stderr, flush=True)
    ceil = ceilings()
    rows = []
    for preset in args.presets:
        for scheme in ("none", "fp8-block"):
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
                for cfg in candidates(scheme):
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
