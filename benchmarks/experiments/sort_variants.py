"""Sort token copies by expert (the local dispatcher's glue) on the GPU: three ways, each replayed
from a CUDA graph (20 calls per graph, median of 5 replays), µs per call.

    PYTHONPATH=$PWD python benchmarks/experiments/sort_variants.py [OUT.json]

  torch     dispatch/expert_sort.sort_by_expert_torch (torch.sort + searchsorted + index kernels)
  one       kernels/align.sort_copies: one launch, O(copies^2) comparisons (copies <= 2048 only)
  segment   kernels/ep_sort.sort_copies_by_expert: two launches, a histogram per segment of copies,
            then each segment sorted in registers (alltoall's receiver sort; the same stable order)
At 323572f a third way ran beside them ("scan": one program per (expert, segment) reading every
copy of its segment, work growing with E; sort_variants_2026-11-30_h200_323572f.json): it lost to
"segment" from 1024 copies up and was removed.
Chooses expert_sort.ONE_LAUNCH_COPIES and ep_sort.sort_pays: which way each size takes.
"""
import json
import statistics
import sys

import torch

from moeflow.dispatch.expert_sort import sort_by_expert_torch
from moeflow.kernels.align import MAX_FUSED_COPIES, sort_copies
from moeflow.kernels.ep_sort import sort_copies_by_expert


def graph_us(fn, calls=20, reps=5):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(out)


def main():
    rows = []
    for e, k in ((8, 2), (128, 8), (256, 8)):
        for t in (16, 128, 256, 1024, 2048, 4096, 8192, 16384):
            ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k].to(torch.int32).contiguous()
            w = torch.rand(t, k, device="cuda")
            bounds = torch.arange(e + 1, dtype=ids.dtype, device="cuda")
            n = t * k
            row = dict(E=e, K=k, T=t, copies=n,
                       torch=graph_us(lambda: sort_by_expert_torch(ids, w, e, bounds)),
                       segment=graph_us(lambda: sort_copies_by_expert(ids, w, e, n)))
            if n <= MAX_FUSED_COPIES:
                row["one"] = graph_us(lambda: sort_copies(ids, w, e))
            rows.append(row)
            print(" ".join(f"{k_}={v:.1f}" if isinstance(v, float) else f"{k_}={v}" for k_, v in row.items()), flush=True)
    if len(sys.argv) > 1:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
