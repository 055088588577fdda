"""Untuned shapes on Hopper: the whole layer with the shipped tuned table ("table"), the generic defaults ("generic",
what a shape without a table ran before kernels/sm90_defaults.py) and the Hopper defaults ("sm90"), one H200.

    PYTHONPATH=$PWD python benchmarks/experiments/default_tiles.py --out DIR [--shapes qwen3-30b-a3b,...]
        [--schemes none,fp8-block] [--tokens 128,1024,4096,16384] [--variants table,generic,sm90] [--rounds 2]

Shapes: the three presets (which have H200 tables) and model shapes no table covers (EXTRA below: Qwen3-235B-A22B,
DeepSeek-V2-Lite, gpt-oss-120b's expert sizes, Mixtral-8x22B). "table" on a shape without a table would be "sm90"
and is skipped. Each row: the layer (route -> local dispatch -> triton runner -> combine) as one CUDA graph, do_bench
µs (L2 flushed, median), the variants taking turns over --rounds rounds; the output against the reference runner's.
Every variant's kernels are compiled first in parallel processes. Prints a table per round and the best of the rounds
last; writes DIR/NAME.json (--name, default_tiles) after every (shape, scheme).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "..")]

from moeflow import presets  # noqa: E402
from moeflow.kernels import configs as kc  # noqa: E402

EXTRA = {  # routed experts only (no shared experts, softmax top-k): the shapes the layer's GEMMs see
    "qwen3-235b-a22b": dict(num_experts=128, hidden_size=4096, intermediate_size=1536, top_k=8),
    "deepseek-v2-lite": dict(num_experts=64, hidden_size=2048, intermediate_size=1408, top_k=6),
    "gpt-oss-120b": dict(num_experts=128, hidden_size=2880, intermediate_size=2880, top_k=4),
    "mixtral-8x22b": dict(num_experts=8, hidden_size=6144, intermediate_size=16384, top_k=2),
}
presets.PRESETS.update({k: v for k, v in EXTRA.items() if k not in presets.PRESETS})
_FIND, _DEFAULT = kc.find_table, kc.default_config


def use(variant: str) -> None:
    """Point the runner's config lookup (experts/triton.TritonRunner._entry reads these module attributes) at a
    variant: the tables as shipped, or no table and the generic or the Hopper defaults."""
    if variant == "table":
        kc.find_table, kc.default_config = _FIND, _DEFAULT
        return
    kc.find_table = lambda *a, **k: None
    kc.default_config = _DEFAULT if variant == "sm90" else (lambda *a, capability=None, **k: _DEFAULT(*a, **k))


def plannable(shape: str, scheme: str, env) -> bool:
    """Whether the planner builds a single-process triton layer of this shape and scheme (fp8-block needs H and I
    multiples of 128: gpt-oss-120b's 2880 is not)."""
    from moeflow.errors import MoeflowError
    from moeflow.planner import plan
    try:
        plan(presets.preset_config(shape, quant=scheme, dtype=torch.bfloat16, device="cuda", runner="triton",
                                   dispatcher="local"), env)
        return True
    except MoeflowError as exc:
        print(f"skipped {shape} {scheme}: {exc}", file=sys.stderr)
        return False


def main() -> int:
    from bench_layer import Case

    from moeflow.benchmark import graph_us
    from moeflow.capabilities import Environment
    from moeflow.experts import create_runner
    from moeflow.kernels.autotune import Shape, expanded_weights, precompile, random_batch
    from moeflow.quant import create_scheme
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b,deepseek-v3")
    p.add_argument("--schemes", default="none,fp8-block")
    p.add_argument("--tokens", default="128,1024,4096,16384")
    p.add_argument("--variants", default="table,generic,sm90")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--name", default="default_tiles", help="DIR/NAME.json")
    p.add_argument("--deadline-s", type=float, default=1e9, help="start no new (shape, scheme) after this")
    args = p.parse_args()
    start = time.time()
    env = Environment.detect(torch.device("cuda"))
    tokens = [int(t) for t in args.tokens.split(",")]
    cells = [(s, q) for s in args.shapes.split(",") for q in args.schemes.split(",") if plannable(s, q, env)]
    variants = lambda shape: [v for v in args.variants.split(",") if v != "table" or shape not in EXTRA]

    jobs = []  # every variant's GEMM configs, compiled in worker processes first
    for shape_name, scheme in cells:
        cfg = presets.preset_config(shape_name, quant=scheme, dtype=torch.bfloat16, device="cuda", runner="triton")
        shape = Shape(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k, scheme)
        w = expanded_weights(shape, "cuda")
        for v in variants(shape_name):
            use(v)
            runner = create_runner("triton", cfg, create_scheme(scheme))
            for t in tokens:
                b = random_batch(shape, 1, "cuda")
                b.hidden = b.hidden[:1].expand(t * cfg.top_k, -1)  # kernel_config reads shapes only
                jobs.append((shape, runner.kernel_config(b, w), True))
    use("table")
    precompile(jobs)
    print(f"precompiled {len(set(jobs))} configs in {time.time() - start:.0f}s", file=sys.stderr, flush=True)

    rows = []
    for shape_name, scheme in cells:
        if time.time() - start > args.deadline_s:
            print(f"deadline: stopped before {shape_name} {scheme}", flush=True)
            break
        case = Case(shape_name, scheme)
        for t in tokens:
            ins = case.inputs(t, 1)[0]
            ref = case.layer(create_runner("reference", case.cfg, case.scheme), *ins)
            runners = {}
            for v in variants(shape_name):
                use(v)
                runners[v] = create_runner("triton", case.cfg.replace(runner="triton"), case.scheme)
                out = case.layer(runners[v], *ins)  # fits and caches the variant's configs
                err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
                b, _ = case.dispatcher.dispatch(ins[0], *case.router(ins[1], case.bias))
                k = runners[v].kernel_config(b, case.weights)
                rows.append(dict(shape=shape_name, scheme=scheme, T=t, variant=v, rel_err=err, us=[],
                                 gate_up=k.gate_up.to_dict(), down=k.down.to_dict()))
            use("table")
            for _ in range(args.rounds):
                for v, runner in runners.items():
                    row = next(r for r in rows if (r["shape"], r["scheme"], r["T"], r["variant"]) ==
                               (shape_name, scheme, t, v))
                    row["us"].append(graph_us(lambda: case.layer(runner, *ins)))
            got = {r["variant"]: r for r in rows if (r["shape"], r["scheme"], r["T"]) == (shape_name, scheme, t)}
            print(f"{shape_name:17} {scheme:10} T={t:>5} " + "  ".join(
                f"{v} {min(r['us']):9.1f} ({'/'.join(f'{u:.1f}' for u in r['us'])}) err {r['rel_err']:.1e}"
                for v, r in got.items()), flush=True)
        del case
        torch.cuda.empty_cache()
        with open(os.path.join(args.out, args.name + ".json"), "w") as fh:  # after every cell: a cut run keeps them
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), fh, indent=1)
    print("\nbest of the rounds, µs (do_bench); ratio = generic / sm90 and table / sm90 (> 1: sm90 faster)")
    for shape_name, scheme in cells:
        for t in tokens:
            got = {r["variant"]: min(r["us"]) for r in rows
                   if (r["shape"], r["scheme"], r["T"]) == (shape_name, scheme, t)}
            if "sm90" not in got:
                continue
            ratios = " ".join(f"{v}/sm90 {got[v] / got['sm90']:.3f}" for v in ("generic", "table") if v in got)
            print(f"{shape_name:17} {scheme:10} T={t:>5} " + " ".join(f"{v} {u:9.1f}" for v, u in got.items())
                  + f"  {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
