"""Decode layers with the routed experts' weights prefetched into L2 right after routing
(_prefetch_kernel.py beside this script), against the layer as shipped, at several L2 budgets.

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD python benchmarks/experiments/decode_prefetch.py [OUT.json]
Whole layer as one CUDA graph, bench_layer's graph_us (do_bench: L2 flushed before each replay,
median); variants alternate over two rounds; the prefetch launched between route and sort.
Outputs are checked bit-equal to the shipped layer's.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from bench_layer import Case, graph_us  # noqa: E402
from decode_timeline import timeline  # noqa: E402
from moeflow.experts import create_runner  # noqa: E402
from _prefetch_kernel import PrefetchPlan, expert_parts, prefetch_experts  # noqa: E402
from moeflow.layouts import run_in_layout  # noqa: E402

CASES = [("qwen3-30b-a3b", "fp8-block"), ("qwen3-30b-a3b", "none"), ("deepseek-v3", "fp8-block"),
         ("mixtral-8x7b", "fp8-block")]
TOKENS = (1, 16)
MB = 1 << 20
VARIANTS = [("bulk 32K 16MB", 16 * MB, dict(mode=1, chunk=32768)),
            ("bulk 4K 16MB", 16 * MB, dict(mode=1, chunk=4096)),
            ("lines 8K w4 16MB", 16 * MB, dict(mode=2, chunk=8192, warps=4)),
            ("lines 8K w4 40MB", 40 * MB, dict(mode=2, chunk=8192, warps=4)),
            ("lines 2K w1 16MB", 16 * MB, dict(mode=2, chunk=2048, warps=1))]


def layer_fn(case, runner, x, logits, plan, where, kw=None):
    kw = kw or {}

    def fn():
        case.use(runner)
        ids, w = case.router(logits, case.bias)
        if plan is not None and where == "before":
            prefetch_experts(ids, plan, case.cfg.num_experts, **kw)
        batch, handle = case.dispatcher.dispatch(x, ids, w)
        if plan is not None and where == "after":
            prefetch_experts(ids, plan, case.cfg.num_experts, **kw)
        return case.dispatcher.combine(run_in_layout(runner, batch, case.weights), handle)
    return fn


def main():
    out, lines = {}, {}
    for preset, scheme in CASES:
        torch.cuda.empty_cache()
        case = Case(preset, scheme)
        runner = create_runner("triton", case.cfg.replace(runner="triton"), case.scheme)
        w = case.weights
        parts = expert_parts([w.w13, w.w13_scale, w.w2, w.w2_scale])
        for t in TOKENS:
            x, logits = case.inputs(t, 1)[0]
            ref = layer_fn(case, runner, x, logits, None, "")()
            variants = {"shipped": (None, "", {})}
            for label, b, kw in VARIANTS:
                variants[label] = (PrefetchPlan(parts, b), "before", kw)
            times = {k: [] for k in variants}
            for k, (plan, where, kw) in variants.items():
                got = layer_fn(case, runner, x, logits, plan, where, kw)()
                assert torch.equal(got, ref), (preset, scheme, t, k)
            if t == 1 and preset == "qwen3-30b-a3b":
                for k, (plan, where, kw) in variants.items():
                    rows, span, _ = timeline(layer_fn(case, runner, x, logits, plan, where, kw))
                    lines[f"{preset} {scheme} T={t} {k}"] = dict(span=span, kernels=rows)
                    print(k, round(span, 2), [(r["kernel"][:18], r["start_us"], r["dur_us"]) for r in rows], flush=True)
            for _ in range(2):
                for k, (plan, where, kw) in variants.items():
                    times[k].append(graph_us(layer_fn(case, runner, x, logits, plan, where, kw)))
            name = f"{preset} {scheme} T={t}"
            out[name] = {k: [round(v, 2) for v in vs] for k, vs in times.items()}
            print(name, {k: min(v) for k, v in out[name].items()}, flush=True)
        del case, runner
    if len(sys.argv) > 1:
        json.dump(dict(graph_us=out, timelines=lines), open(sys.argv[1], "w"), indent=1)
    print("\n| row | " + " | ".join(next(iter(out.values())).keys()) + " |")
    for name, r in out.items():
        print(f"| {name} | " + " | ".join(f"{min(v):.1f}" for v in r.values()) + " |")


if __name__ == "__main__":
    main()
