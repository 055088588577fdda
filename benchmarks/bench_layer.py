"""GPU benchmark of the whole MoE layer per runner (the method of docs/performance.md), and of the expert stage alone.

    python benchmarks/bench_layer.py --out $OUT [--presets ...] [--tokens ...] [--schemes ...]

Per preset, scheme (none = bf16, fp8-channel, fp8-block), runner and T:
    layer_us    route -> dispatch (local) -> experts -> combine, the same calls as MoE._run, eager,
                timed with triton's do_bench (L2 flushed before every repetition, median) on 4 rotated inputs
    layer_graph_us  the same whole layer captured once as a CUDA graph and replayed (do_bench, L2
                flushed): the method of docs/performance.md; the headline figure (runners whose call syncs the host
                cannot be captured: then "-" and the eager time counts)
    layer_clean_us  the same graph, median of 100 replays, each after a 1 GiB read instead of do_bench's
                256 MB zeroing: the L2 holds clean lines, so the layer writes back nobody's dirty data
                (do_bench's flush cost the H200 rows up to T=128 3-9 µs of write-back)
    experts_us  the runner alone on a ready batch;  graph_us: the same replayed as a CUDA graph (T <= 128); both
                the separate launches (a batch the one-launch small-batch layer takes has no such stage)
    tflops, gbs, roof_pct  FLOPs and bytes (experts actually hit x 3HI weights + activations in/out)
                over the headline time; roof_pct = floor / time with ceilings re-measured in this run
    rel_err     layer output vs the layer with the reference runner on the same weights and input
Weights are random, made a few experts at a time (moeflow.tune.autotune.random_weights) so that
DeepSeek-V3's 11-22 GB of experts need no whole-tensor temporaries. Writes bench.csv (row by
row), bench.json (with the four target lines per runner, do_bench and clean flush: benchmark.target_summary)
and bench.png under --out; prints the triton rows' table and the target lines last.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import torch

from moeflow.benchmark import (Ceilings, clean_graph_us, format_target_summary, graph_us, layer_bytes, layer_flops,
                               measure_ceilings, plot_panels, poisoned_allocations, relative_error, roofline_seconds,
                               target_summary)
from moeflow.capabilities import Environment
from moeflow.dispatch import create_dispatcher
from moeflow.experts import create_runner
from moeflow.tune.autotune import Shape, expanded_weights, precompile, random_batch, random_weights
from moeflow.layer import routed_experts
from moeflow.planner import check_runner
from moeflow.planner import plan as make_plan
from moeflow.presets import preset_config
from moeflow.quant import create_scheme
from moeflow.routing import create_router

# docs/performance.md: best anchor's GEMM-only µs, (preset, T) -> (bf16, fp8)
ANCHORS = {("qwen3-30b-a3b", 1): (35, 27), ("qwen3-30b-a3b", 128): (300, 169), ("qwen3-30b-a3b", 4096): (777, 621),
           ("qwen3-30b-a3b", 16384): (2347, 2160), ("deepseek-v3", 1): (203, 108), ("deepseek-v3", 128): (5268, 2765),
           ("deepseek-v3", 4096): (10239, 5741), ("deepseek-v3", 16384): (22764, 15453),
           ("mixtral-8x7b", 1): (188, 144), ("mixtral-8x7b", 128): (677, 376), ("mixtral-8x7b", 4096): (5088, 3325),
           ("mixtral-8x7b", 16384): (18283, 12092)}
FIELDS = ["preset", "scheme", "runner", "T", "layer_us", "layer_graph_us", "layer_clean_us", "experts_us", "graph_us",
          "tflops", "gbs", "roof_pct", "floor_us", "experts_hit", "rel_err", "anchor_us", "note"]


def bench(fn, rep_ms=50):
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=rep_ms, return_mode="median") * 1e3  # µs


def ceilings() -> dict:
    """This GPU's ceilings (moeflow.benchmark.measure_ceilings) as bench.json's "ceilings"."""
    c = measure_ceilings(torch.device("cuda"))
    return dict(bandwidth=c.bandwidth, bf16_flops=c.bf16_flops, fp8_flops=c.fp8_flops)


class Case:
    """One (preset, scheme): random weights shared by every runner, router and local dispatcher."""

    def __init__(self, preset: str, scheme: str, payload: str = "auto", batch_invariant: bool = False):
        self.preset = preset
        self.cfg = preset_config(preset, quant=scheme, dtype=torch.bfloat16, device="cuda", dispatcher="local",
                                 dispatch_payload=payload, batch_invariant=batch_invariant)
        c = self.cfg
        self.env = Environment.detect(torch.device("cuda"))  # MOEFLOW_KERNEL_ARCH: another architecture's plan
        planned = make_plan(c, self.env)
        self.scheme = create_scheme(scheme, weight_only=planned.weight_only)  # as the layer's (FP8 on sm_80: weights)
        self.shape = Shape(c.num_experts, c.hidden_size, c.intermediate_size, c.top_k, scheme)
        self.weights = random_weights(self.shape, "cuda", seed=1)
        self.router = create_router(c, planned.router)  # the layer's router (planner)
        self.bias = (torch.rand(c.num_experts, device="cuda") - 0.5) * 0.1 if c.use_correction_bias else None
        self.dispatcher = create_dispatcher("local", c, self.scheme)
        self._plans = {}  # runner name -> the Plan of (local, that runner)

    def inputs(self, t: int, n: int = 4):
        c = self.cfg
        return [(torch.randn(t, c.hidden_size, device="cuda", dtype=torch.bfloat16),
                 torch.randn(t, c.num_experts, device="cuda")) for _ in range(n)]

    def use(self, runner):
        """Hand rows the way a layer planned with this runner would (Plan.indexed_rows) -> that Plan."""
        if runner.name not in self._plans:
            self._plans[runner.name] = make_plan(self.cfg.replace(runner=runner.name), self.env)
        self.dispatcher.indexed_rows = self._plans[runner.name].indexed_rows
        return self._plans[runner.name]

    def layer(self, runner, x, logits):
        """MoE._run's path after this router: the runner's one launch where the plan and its table say so."""
        plan = self.use(runner)
        ids, w = self.router(logits, self.bias)
        return routed_experts(plan, self.dispatcher, runner, x, ids, w, self.weights)[0]


def measure(case: Case, name: str, t: int, ins, ref_out, ceil) -> dict:
    c = case.cfg
    runner = create_runner(name, c.replace(runner=name), case.scheme)
    it = iter(range(10 ** 9))
    layer_us = bench(lambda: case.layer(runner, *ins[next(it) % len(ins)]))
    case.use(runner)
    batches = [case.dispatcher.dispatch(x, *case.router(lg, case.bias))[0] for x, lg in ins[:2]]
    experts_us = bench(lambda: runner.run(batches[next(it) % 2], case.weights))
    g_us = graph_us(lambda: runner.run(batches[0], case.weights)) if name == "triton" and t <= 128 else None
    with poisoned_allocations():
        err = relative_error(case.layer(runner, *ins[0]), ref_out)
    try:
        layer_graph_us = graph_us(lambda: case.layer(runner, *ins[0]))
        layer_clean_us = clean_graph_us(lambda: case.layer(runner, *ins[0]))
    except RuntimeError:  # the runner synchronizes with the host: not capturable
        torch.cuda.synchronize()
        layer_graph_us = layer_clean_us = None
    best_us = layer_graph_us or layer_us
    hit = int(case.router(ins[0][1], case.bias)[0].unique().numel())
    fp8 = c.quant != "none"
    flops, nbytes = layer_flops(c, t), layer_bytes(c, t, hit)
    floor_s = roofline_seconds(c, t, Ceilings(**ceil), hit)
    anchor = ANCHORS.get((case.preset, t))
    return dict(runner=name, T=t, layer_us=layer_us, layer_graph_us=layer_graph_us, layer_clean_us=layer_clean_us,
                experts_us=experts_us, graph_us=g_us, tflops=flops / best_us / 1e6, gbs=nbytes / best_us / 1e3,
                roof_pct=100 * floor_s * 1e6 / best_us, floor_us=floor_s * 1e6, experts_hit=hit, rel_err=err, anchor_us=anchor and anchor[1 if fp8 else 0])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default="qwen3-30b-a3b,deepseek-v3,mixtral-8x7b")
    p.add_argument("--schemes", default="none,fp8-channel,fp8-block")
    p.add_argument("--runners", default="triton,grouped_mm")
    p.add_argument("--tokens", default="1,16,128,1024,4096,16384")
    p.add_argument("--out", default=".")
    p.add_argument("--deadline-s", type=float, default=1e9, help="start no new case after this many seconds")
    p.add_argument("--batch-invariant", action="store_true",
                   help="MoEConfig.batch_invariant: one tile set for every T, no split K, no one-launch layer")
    p.add_argument("--dispatch-payload", default="auto",
                   help='MoEConfig.dispatch_payload; "dtype": the local sort does not quantize the tokens')
    args = p.parse_args(argv)
    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    ceil = ceilings()
    print("ceilings:", {k: f"{v:.3g}" for k, v in ceil.items()}, file=sys.stderr)
    env = Environment.detect(torch.device("cuda"))
    cells = [(pr, s) for pr in args.presets.split(",") for s in args.schemes.split(",")]
    _precompile(cells, tokens, env, args.batch_invariant)
    print(f"precompiled in {time.time() - start:.0f}s", file=sys.stderr)
    rows, fh = [], open(out / "bench.csv", "w", newline="")
    writer = csv.DictWriter(fh, FIELDS)
    writer.writeheader()
    for preset, scheme in cells:
        if time.time() - start > args.deadline_s:
            break
        case = Case(preset, scheme, args.dispatch_payload, args.batch_invariant)
        names = args.runners.split(",")
        for t in tokens:
            ins = case.inputs(t)
            # (the default reference: its batch-invariant form sums products one by one, far too slow at these sizes)
            ref_out = case.layer(create_runner("reference", case.cfg.replace(batch_invariant=False), case.scheme),
                                 *ins[0])
            for name in names:
                err = check_runner(name, case.cfg.replace(runner=name), env)
                row = dict(preset=preset, scheme=scheme, runner=name, T=t)
                row.update(dict(note=f"refused {err.code}") if err else measure(case, name, t, ins, ref_out, ceil))
                rows.append(row)
                writer.writerow(row)
                fh.flush()
                print(_fmt(row), file=sys.stderr)
        del case
        torch.cuda.empty_cache()
    fh.close()
    measured = [r for r in rows if "layer_us" in r]
    summary = {f"{name} {label}": target_summary([r for r in measured if r["runner"] == name], key)
               for name in dict.fromkeys(r["runner"] for r in measured)
               for key, label in (("layer_graph_us", "do_bench"), ("layer_clean_us", "clean flush"))}
    (out / "bench.json").write_text(json.dumps(dict(ceilings=ceil, device=torch.cuda.get_device_name(),
                                                    batch_invariant=args.batch_invariant,
                                                    torch=torch.__version__, rows=rows, targets=summary), indent=1))
    _plot(rows, out / "bench.png")
    print("\n".join(_fmt(r) for r in measured if r["runner"] == "triton"))
    print("\n".join(format_target_summary(s, label) for label, s in summary.items() if s["rows"]))
    return 0


def _precompile(cells, tokens, env, batch_invariant: bool = False) -> None:
    """Compile every triton config the runs below will use, in parallel processes."""
    jobs = []
    for preset, scheme in cells:
        cfg = preset_config(preset, quant=scheme, dtype=torch.bfloat16, device="cuda", runner="triton",
                            batch_invariant=batch_invariant)
        if check_runner("triton", cfg, env):
            continue
        shape = Shape(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k, scheme)
        runner = create_runner("triton", cfg, create_scheme(scheme, weight_only=make_plan(cfg, env).weight_only))
        w = expanded_weights(shape, "cuda")
        for t in tokens:
            b = random_batch(shape, 1, "cuda")
            b.hidden = b.hidden[:1].expand(t * cfg.top_k, -1)  # kernel_config reads shapes only
            jobs.append((shape, runner.kernel_config(b, w), True))  # the local plan: gate_up rows by index
    precompile(jobs)


def _fmt(r) -> str:
    if "layer_us" not in r:
        return f"{r['preset']:>14} {r['scheme']:>11} {r['runner']:>10} T={r['T']:>5}  {r.get('note')}"
    g = f"{r['graph_us']:8.1f}" if r.get("graph_us") else "       -"
    f = f"{r['layer_graph_us']:9.1f}" if r.get("layer_graph_us") else "        -"
    c = f"{r['layer_clean_us']:9.1f}" if r.get("layer_clean_us") else "        -"
    a = f"{r['anchor_us']:>6}" if r.get("anchor_us") else "     -"
    return (f"{r['preset']:>14} {r['scheme']:>11} {r['runner']:>10} T={r['T']:>5} layer {r['layer_us']:9.1f}us "
            f"layer-graph {f} clean {c} experts {r['experts_us']:9.1f} graph {g} {r['tflops']:7.1f}TF "
            f"{r['gbs']:7.0f}GB/s roof {r['roof_pct']:5.1f}% anchor {a} err {r['rel_err']:.1e}")


def _plot(rows, path) -> None:
    """bench.png: per (preset, scheme) the headline µs against T per runner and the floor (skipped without
    matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = []
    for preset, scheme in sorted({(r["preset"], r["scheme"]) for r in rows}):
        sel = [r for r in rows if (r["preset"], r["scheme"]) == (preset, scheme) and "layer_us" in r]
        lines = {n: [(r["T"], r.get("layer_graph_us") or r["layer_us"]) for r in sel if r["runner"] == n]
                 for n in {r["runner"] for r in sel}}
        panels.append((f"{preset} {scheme}", lines, sorted({(r["T"], r["floor_us"]) for r in sel})))
    plot_panels(plt, panels, path)


if __name__ == "__main__":
    sys.exit(main())
