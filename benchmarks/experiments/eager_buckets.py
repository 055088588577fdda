"""Eager calls past the eager graphs' sizes, launched one by one against padded to a bucket and replayed
(MOEFLOW_EAGER_BUCKETS, moeflow.graphs' Buckets): does the replay take an eager prefill call off the host's
launch path, and what does the padding cost the GPU?

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD [CASES=preset:scheme,...] [TOKENS=24,100,...] \
        python benchmarks/experiments/eager_buckets.py [OUT_DIR]

Per preset, scheme, T and entry point (MoE.forward with router logits; the ExpertsPath of transformers' "moeflow"
experts call), MOEFLOW_EAGER_GRAPHS=16, µs per call:
    launched_*   MOEFLOW_EAGER_BUCKETS=0: the call launch by launch (host_us, eager_us as eager_overhead.py)
    bucketed_*   MOEFLOW_EAGER_BUCKETS=4096: the call padded to the next power of two and replayed
    gpu_us       the launched call captured whole as a CUDA graph (the GPU's own time, no padding)
    first_ms     the bucketed entry's first call (its warm-up run and capture), ms
    rel_diff     max |bucketed - launched| / max |launched| over the output (tiles follow the token count: not bits)
    reserved_mb  torch.cuda.memory_reserved() after the case's bucketed calls
Then, per case, the memory the bucket graphs of several layers hold (graph_buckets: one arena a device and stream, so
about the largest graph's intermediates, not every layer's): reserved MB before and after a T=4096 bucketed forward of
each of LAYERS layers, against the same for one layer.
Writes OUT_DIR/eager_buckets.json and prints one line a row.
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import eager_overhead  # noqa: E402
from eager_overhead import eager_us, gpu_us, host_us, layer_case, layer_inputs, results_header, run_all  # noqa: E402

TOKENS = tuple(int(t) for t in os.environ.get("TOKENS", "24,100,512,1000,2048,4096").split(","))
LAYERS = 4


def run_case(preset: str, scheme: str, out_dir: str) -> list[dict]:
    moe, path, weights = layer_case(preset, scheme)
    os.environ["MOEFLOW_EAGER_GRAPHS"] = "16"
    rows = []
    for t in TOKENS:
        x, logits, ids64, w = layer_inputs(moe, t)
        entries = {"forward": lambda: moe(x, logits), "experts_path": lambda: path(x, ids64, w, weights)}
        for name, fn in entries.items():
            row = dict(preset=preset, scheme=scheme, T=t, entry=name)
            os.environ["MOEFLOW_EAGER_BUCKETS"] = "0"
            launched = fn()
            row["launched_host_us"], row["launched_eager_us"] = host_us(fn), eager_us(fn)
            os.environ["MOEFLOW_VALIDATE_INPUTS"] = "0"  # graph capture cannot read ids on the host
            row["gpu_us"] = gpu_us(fn)
            os.environ["MOEFLOW_VALIDATE_INPUTS"] = "1"
            os.environ["MOEFLOW_EAGER_BUCKETS"] = "4096"
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            bucketed = fn()
            torch.cuda.synchronize()
            row["first_ms"] = (time.perf_counter() - t0) * 1e3
            row["bucketed_host_us"], row["bucketed_eager_us"] = host_us(fn), eager_us(fn)
            scale = launched.float().abs().max().clamp(min=1e-30)
            row["rel_diff"] = float((bucketed.float() - launched.float()).abs().max() / scale)
            row["reserved_mb"] = torch.cuda.memory_reserved() / 2 ** 20
            rows.append(row)
            print(f"{preset:14s} {scheme:9s} T={t:<5d} {name:13s} launched host {row['launched_host_us']:7.1f} "
                  f"eager {row['launched_eager_us']:7.1f} | bucketed host {row['bucketed_host_us']:7.1f} "
                  f"eager {row['bucketed_eager_us']:7.1f} | gpu {row['gpu_us']:7.1f} first {row['first_ms']:6.1f} ms "
                  f"diff {row['rel_diff']:.1e} {row['reserved_mb']:.0f} MB", flush=True)
    rows.append(layers_memory(preset, scheme))
    os.environ["MOEFLOW_EAGER_BUCKETS"] = "0"
    return rows


def layers_memory(preset: str, scheme: str) -> dict:
    """Reserved MB (after emptying the allocator's cache) after building LAYERS layers, then after one bucketed T=4096
    forward of the first, then of all (on a stream of their own, so in an arena of their own)."""
    torch.cuda.empty_cache()
    moes = [layer_case(preset, scheme)[0] for _ in range(LAYERS)]
    x, logits, _, _ = layer_inputs(moes[0], 4096)
    os.environ["MOEFLOW_EAGER_BUCKETS"] = "4096"
    torch.cuda.synchronize()
    def mb() -> float:  # memory held, the allocator's free cache dropped first: a graph capture empties that cache
        torch.cuda.empty_cache()  # itself (torch.cuda.graph), which read as -1448 MB for Mixtral on 2026-12-06
        return torch.cuda.memory_reserved() / 2 ** 20

    row = dict(preset=preset, scheme=scheme, T=4096, entry=f"memory_{LAYERS}_layers", built_mb=mb())
    stream = torch.cuda.Stream()  # a stream of its own: a fresh arena, not run_case's
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moes[0](x, logits)
        torch.cuda.synchronize()
        row["one_layer_mb"] = mb()
        for moe in moes[1:]:
            moe(x, logits)
        torch.cuda.synchronize()
    row["all_layers_mb"] = mb()
    first, others = row["one_layer_mb"] - row["built_mb"], row["all_layers_mb"] - row["one_layer_mb"]
    print(f"{preset:14s} {scheme:9s} {LAYERS} layers' bucket graphs at T=4096: +{first:.0f} MB for the first, "
          f"+{others:.0f} MB for the other {LAYERS - 1}", flush=True)
    return row


def main() -> int:
    if os.environ.get("CASES"):  # eager_overhead's cases by default
        eager_overhead.CASES[:] = [tuple(c.split(":")) for c in os.environ["CASES"].split(",")]
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    return run_all(results_header(), run_case, out_dir, "eager_buckets.json")


if __name__ == "__main__":
    sys.exit(main())
