"""Where an eager (not graph-captured) layer call spends its time at decode sizes: the host's cost of
issuing the launches, against the GPU's time for them. transformers' generate runs layers eagerly, so at a
handful of tokens the host's cost, not the kernels', sets tokens/s (hf_bench_2026-11-30_h200_dc5fb36.md:
decode batch 1 148 tokens/s with moeflow against 190 with transformers' grouped_mm).

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD python benchmarks/experiments/eager_overhead.py [OUT_DIR]

Per preset, scheme, T and entry point (MoE.forward with router logits; MoE.forward_topk with the default input
checks and with MOEFLOW_VALIDATE_INPUTS=0; the ExpertsPath of transformers' "moeflow" experts call, and that call as it was
before it took the layer's path, the separate launches at every T), each with eager graphs (moeflow.graphs, the
here at T <= 64) and, "_launched", without (MOEFLOW_EAGER_GRAPHS=0):
    gpu_us    the same call captured as a CUDA graph, 50 replays back to back / 50 (no flush): the GPU's time
    host_us   median wall time of one call, not synchronized, 20 calls after warm-up (what the host spends
              issuing it; a call that synchronizes the host waits for the GPU here)
    eager_us  100 calls back to back, then one synchronize, / 100: what a model loop gets, max(host, GPU)
Also the wall time of launching one empty Triton kernel (1 and 24 arguments) and of one tiny torch op, and a
cProfile of 200 forward calls per case, with and without eager graphs (OUT_DIR/eager_profile_*.txt, top 30 by own time).
"""
from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

from moeflow import MoE
from moeflow.experts import ExpertWeights
from moeflow.integrations.path import ExpertsPath
from moeflow.kernels.autotune import capture_graph
from moeflow.presets import preset_config

CASES = [("qwen3-30b-a3b", "none"), ("qwen3-30b-a3b", "fp8-block"), ("mixtral-8x7b", "fp8-block")]
TOKENS = (1, 4, 16, 64)


@triton.jit
def _empty1(a):
    pass


@triton.jit
def _empty24(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11,
             C0: tl.constexpr, C1: tl.constexpr):
    pass


def separate(path, x, ids, w, weights):
    """ExpertsPath's call before it went through layer.routed_experts: dispatch, experts, combine, always."""
    return path._run(x, ids.to(torch.int32), w.float(), weights)


def host_us(fn, calls=20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def eager_us(fn, calls=100, warmups=1) -> float:
    for _ in range(warmups):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def gpu_us(fn, replays=50) -> float:
    g = capture_graph(fn, warmups=2)
    g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = []
    for _ in range(3):
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        best.append(a.elapsed_time(b) * 1e3 / replays)
    return statistics.median(best)


def profile_text(fn, calls=200, sorts=("tottime",), lines=30) -> str:
    """cProfile of ``calls`` calls of fn (after one), the top ``lines`` by each of ``sorts`` (pstats keys)."""
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s)
    for key in sorts:
        stats.sort_stats(key).print_stats(lines)
    return s.getvalue()


def layer_case(preset: str, scheme: str):
    """-> (MoE, ExpertsPath, its ExpertWeights) of one preset and scheme, bf16 on CUDA, seeded."""
    torch.manual_seed(0)
    moe = MoE(preset_config(preset, dtype=torch.bfloat16, device="cuda", quant=scheme))
    weights = ExpertWeights(moe.gate_up_proj, moe.down_proj, moe.gate_up_proj_scale_inv, moe.down_proj_scale_inv)
    return moe, ExpertsPath(moe.config), weights


def layer_inputs(moe, t: int):
    """-> (x [T, H] bf16, router logits [T, E], ids [T, K] int64, weights [T, K]) routed by moe's router."""
    cfg = moe.config
    x = torch.randn(t, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(t, cfg.num_experts, device="cuda")
    ids, w = moe.router(logits, moe.e_score_correction_bias)
    return x, logits, ids.to(torch.int64), w


def run_case(preset: str, scheme: str, out_dir: str) -> list[dict]:
    moe, path, weights = layer_case(preset, scheme)
    rows = []
    for t in TOKENS:
        x, logits, ids64, w = layer_inputs(moe, t)
        entries = {  # name: (call, MOEFLOW_VALIDATE_INPUTS, MOEFLOW_EAGER_GRAPHS)
            "forward": (lambda: moe(x, logits), "1", "64"),
            "forward_launched": (lambda: moe(x, logits), "1", "0"),
            "forward_topk": (lambda: moe.forward_topk(x, ids64, w), "1", "64"),
            "forward_topk_novalidate": (lambda: moe.forward_topk(x, ids64, w), "0", "64"),
            "forward_topk_novalidate_launched": (lambda: moe.forward_topk(x, ids64, w), "0", "0"),
            "experts_path": (lambda: path(x, ids64, w, weights), "1", "64"),
            "experts_path_launched": (lambda: path(x, ids64, w, weights), "1", "0"),
            "experts_path_separate": (lambda: separate(path, x, ids64, w, weights), "1", "0"),
        }
        for name, (fn, validate, graphs) in entries.items():
            os.environ["MOEFLOW_VALIDATE_INPUTS"], os.environ["MOEFLOW_EAGER_GRAPHS"] = validate, graphs
            row = dict(preset=preset, scheme=scheme, T=t, entry=name, host_us=host_us(fn), eager_us=eager_us(fn))
            os.environ["MOEFLOW_VALIDATE_INPUTS"] = "0"  # graph capture cannot read ids on the host
            row["gpu_us"] = gpu_us(fn)  # the call captured whole by the caller (eager graphs stand aside)
            os.environ["MOEFLOW_VALIDATE_INPUTS"], os.environ["MOEFLOW_EAGER_GRAPHS"] = "1", "64"
            if name == "forward":  # what the layer's graph of this T holds (its pool), beside the launches' own
                torch.cuda.synchronize()
                row["graphs"] = len(moe._graphs)
                row["reserved_mb"] = torch.cuda.memory_reserved() / 2 ** 20
            rows.append(row)
            print(f"{preset:14s} {scheme:9s} T={t:<4d} {name:24s} host {row['host_us']:7.1f}  "
                  f"eager {row['eager_us']:7.1f}  gpu {row['gpu_us']:7.1f}", flush=True)
        if t in (1, 16):
            for name in ("forward", "forward_launched"):
                os.environ["MOEFLOW_EAGER_GRAPHS"] = entries[name][2]
                text = profile_text(entries[name][0])
                os.environ["MOEFLOW_EAGER_GRAPHS"] = "64"
                with open(os.path.join(out_dir, f"eager_profile_{preset}_{scheme}_T{t}_{name}.txt"), "w") as f:
                    f.write(text)
    return rows


def results_header() -> dict:
    """What a record of these experiments starts with: the GPU, the torch and triton versions, the commit
    ($MOEFLOW_COMMIT), and no rows yet."""
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("MOEFLOW_COMMIT", "unknown"), "rows": []}


def run_all(res: dict, run_case, out_dir: str, name: str) -> int:
    """run_case(preset, scheme, out_dir)'s rows for every CASES entry into res["rows"] (the CUDA cache emptied between
    cases), then res written to out_dir/name as JSON; 0, main's exit status."""
    for preset, scheme in CASES:
        res["rows"] += run_case(preset, scheme, out_dir)
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(res, f, indent=1)
    return 0


def main() -> int:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    res = results_header()
    buf = torch.zeros(16, device="cuda")
    res["launch_empty_triton_1arg_us"] = host_us(lambda: _empty1[(1,)](buf), 200)
    ints = list(range(12))
    res["launch_empty_triton_24args_us"] = host_us(lambda: _empty24[(1,)](*([buf] * 12), *ints, C0=1, C1=2), 200)
    res["launch_torch_add_us"] = host_us(lambda: buf.add_(1), 200)
    print({k: round(v, 1) for k, v in res.items() if k.startswith("launch")}, flush=True)
    return run_all(res, run_case, out_dir, "eager_overhead.json")


if __name__ == "__main__":
    sys.exit(main())
