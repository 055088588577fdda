"""The one-launch layer (kernels/fused_layer.py) with its weights asked of the L2 up front (FusedConfig.prefetch)
against the shipped tiles: the whole layer (route -> one launch) replayed from a CUDA graph, L2 flushed
(bench_layer.py's headline method). One H200.

    PYTHONPATH=$PWD OUT=DIR python benchmarks/experiments/fused_prefetch.py [preset:scheme:T ...]

Per case: the shipped table's FusedConfig, then it with prefetch 1 and 2 over a small grid of stages and
SPLIT1, in two alternating rounds (the better of the two is kept; the spread of the shipped config's two
rounds bounds what a difference means); each variant's output against the shipped config's (prefetch changes
no arithmetic: equal bits where the tiles are the same). Writes fused_prefetch.json under OUT; prints a table.
"""
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
CASES = ["qwen3-30b-a3b:none:1", "qwen3-30b-a3b:fp8-block:1", "mixtral-8x7b:none:1", "mixtral-8x7b:fp8-block:1",
         "deepseek-v3:none:1", "deepseek-v3:fp8-block:1", "qwen3-30b-a3b:none:2", "qwen3-30b-a3b:fp8-block:2",
         "qwen3-30b-a3b:none:4", "qwen3-30b-a3b:fp8-block:4"]


def variants(c0):
    out = [c0]
    for pf in (1, 2):
        for stages in (2, 3, 4):
            for split1 in sorted({c0.split1, 2 * c0.split1}):
                v = replace(c0, prefetch=pf, num_stages=stages, split1=split1)
                if v not in out:
                    out.append(v)
    return out


def _compile(jobs):
    """Worker: one launch of each (preset, scheme, T, FusedConfig) on expanded weights (Triton's disk cache)."""
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
    from bench_layer import Case, graph_us
    from moeflow.experts import create_runner
    specs = sys.argv[1:] or CASES
    cases, plan = {}, []
    for spec in specs:
        preset, scheme, t = spec.split(":")
        if (preset, scheme) not in cases:
            case = Case(preset, scheme)
            cases[preset, scheme] = (case, create_runner("triton", case.cfg.replace(runner="triton"), case.scheme))
        case, runner = cases[preset, scheme]
        plan.append((spec, preset, scheme, int(t), variants(runner.fused_config(int(t), case.weights))))
    jobs = sorted({(p, s, v) for _, p, s, _, vs in plan for v in vs}, key=str)
    with ProcessPoolExecutor(12, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_compile, [jobs[i::12] for i in range(12)]))
    rows = []
    for spec, preset, scheme, t, vs in plan:
        case, runner = cases[preset, scheme]
        x, logits = case.inputs(t, 1)[0]
        layer = lambda c: runner.run_fused(x, *case.router(logits, case.bias), case.weights, c)
        ref = layer(vs[0]).float()
        times = [[graph_us(lambda c=c: layer(c)) for c in vs] for _ in range(2)]
        for i, c in enumerate(vs):
            diff = (layer(c).float() - ref).abs().max().item()
            rows.append(dict(case=spec, cfg=c.to_dict(), us=min(times[0][i], times[1][i]), rounds=[times[0][i],
                             times[1][i]], max_abs_diff_vs_shipped=diff, shipped=i == 0))
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "fused_prefetch.json"), "w"), indent=1)
    print(f"{'case':28} {'shipped (2 rounds)':>20} {'best':>7}  best config")
    for spec, *_ in plan:
        sel = [r for r in rows if r["case"] == spec]
        s0, best = sel[0], min(sel, key=lambda r: r["us"])
        c = best["cfg"]
        print(f"{spec:28} {s0['rounds'][0]:9.1f} {s0['rounds'][1]:9.1f} {best['us']:7.1f}  pf={c['prefetch']} "
              f"st={c['num_stages']} s1={c['split1']} (diff {best['max_abs_diff_vs_shipped']:.2g})")


if __name__ == "__main__":
    main()
