"""Where a bucketed eager call (MOEFLOW_EAGER_BUCKETS, moeflow.graph_buckets) spends GPU time that the same call
launched one by one does not: the kernels of each, side by side.

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD [CASES=preset:scheme,...] [TOKENS=2048,4096] \
        python benchmarks/experiments/bucket_kernels.py [OUT_DIR]

Per case and T, under torch.profiler (CUDA kernels; the calls launched, not replayed, so that every kernel is seen):
    launched   MoE._route_and_run(x, logits): the layer's eager call, launch by launch
    padded     MoE._route_and_run with valid, on the inputs padded to the bucket (the next power of two), as a
               bucket graph runs it, plus the copies graph_buckets.BucketCall adds around it (the inputs into the
               arena, the output into the arena's, the caller's copy of its rows)
    padded_gather  the same without the dropping batch's copy_rows (as before 2026-12-06): the gate_up's row copy
               gathers each copy's row where the padded form scatters each token's once
µs per call of each kernel name (the sum over CALLS calls / CALLS), and each form's total; also each form captured as
a CUDA graph and replayed (graph_us, what the bucket costs the GPU in the end). Writes OUT_DIR/bucket_kernels.json
and prints, per case, the kernels whose time differs by more than 1 µs.
"""
from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

import torch
from moeflow.dispatch.local import LocalDispatcher
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from eager_overhead import gpu_us, layer_case, layer_inputs, results_header  # noqa: E402

CASES = [tuple(c.split(":")) for c in os.environ.get("CASES", "qwen3-30b-a3b:none,qwen3-30b-a3b:fp8-block,"
                                                               "mixtral-8x7b:fp8-block").split(",")]
TOKENS = tuple(int(t) for t in os.environ.get("TOKENS", "1000,2048,4096").split(","))
CALLS = 10


def kernel_us(fn) -> dict[str, float]:
    """µs per call of each CUDA kernel fn launches (CALLS calls under the profiler, after two warm-up calls)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            totals[ev.name[:90]] += ev.device_time / CALLS  # device_time: µs
    return dict(totals)


def padded_call(moe, x, logits, rows: int):
    """The bucket graph's work for x [T, H] padded to ``rows``, launched: BucketCall's copies around the entry's
    padded form (graph_buckets.BucketCall.__call__ and its capture's into_arena)."""
    t = x.shape[0]
    xs = x.new_zeros((rows, x.shape[1]))
    ls = logits.new_zeros((rows, logits.shape[1]))
    valid = torch.zeros(1, dtype=torch.int64, device=x.device)
    out = torch.empty_like(xs)

    def call():
        xs[:t].copy_(x)
        ls[:t].copy_(logits)
        valid.fill_(t)
        out.copy_(moe._route_and_run(xs, ls, valid))
        return out[:t].clone()
    return call


def without_copy_rows(fn):
    """fn with the local dispatcher's dropping batches made without copy_rows (the row copy then gathers)."""
    batch = LocalDispatcher._batch

    def gathering(self, *args):
        made = batch(self, *args)
        made.copy_rows = None if self.drops else made.copy_rows
        return made

    def call():
        LocalDispatcher._batch = gathering
        try:
            return fn()
        finally:
            LocalDispatcher._batch = batch
    return call


def run_case(preset: str, scheme: str) -> list[dict]:
    moe, _, _ = layer_case(preset, scheme)
    os.environ["MOEFLOW_VALIDATE_INPUTS"] = "0"  # graph capture cannot read ids on the host
    rows = []
    for t in TOKENS:
        x, logits, _, _ = layer_inputs(moe, t)
        bucket = 1 << (t - 1).bit_length()
        padded = padded_call(moe, x, logits, bucket)
        forms = {"launched": lambda: moe._route_and_run(x, logits), "padded": padded,
                 "padded_gather": without_copy_rows(padded)}
        want = forms["launched"]().float()
        diffs = [float((forms[f]().float() - want).abs().max()) for f in ("padded", "padded_gather")]
        row = dict(preset=preset, scheme=scheme, T=t, bucket=bucket, max_abs_diff=max(diffs))
        for name, fn in forms.items():
            row[f"{name}_kernels"] = kernel_us(fn)
            row[f"{name}_kernel_sum_us"] = sum(row[f"{name}_kernels"].values())
            row[f"{name}_graph_us"] = gpu_us(fn)
        rows.append(row)
        print(f"\n{preset} {scheme} T={t} (bucket {bucket}), µs launched / padded / padded_gather: kernels "
              + " / ".join(f"{row[f + '_kernel_sum_us']:.1f}" for f in forms) + "; graphs "
              + " / ".join(f"{row[f + '_graph_us']:.1f}" for f in forms) + f"; max |diff| {row['max_abs_diff']:.2e}",
              flush=True)
        a, b, c = (row[f + "_kernels"] for f in forms)
        for name in sorted(set(a) | set(b) | set(c), key=lambda n: -abs(b.get(n, 0) - a.get(n, 0))):
            if max(abs(b.get(name, 0) - a.get(name, 0)), abs(c.get(name, 0) - a.get(name, 0))) > 1:
                print(f"  {a.get(name, 0):8.1f} {b.get(name, 0):8.1f} {c.get(name, 0):8.1f}  {name}", flush=True)
    return rows


def main() -> int:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    res = results_header()
    for preset, scheme in CASES:
        res["rows"] += run_case(preset, scheme)
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "bucket_kernels.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
