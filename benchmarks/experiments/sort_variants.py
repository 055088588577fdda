"""Sort token copies by expert (the local dispatcher's glue) on the GPU, each way replayed
from a CUDA graph (20 calls per graph, median of 5 replays), µs per call.

    PYTHONPATH=$PWD python benchmarks/experiments/sort_variants.py [OUT.json] [--small]

  --small   batches of up to 4096 copies only (the whole-sort threshold)

  torch     dispatch/expert_sort.sort_by_expert_torch (torch.sort + searchsorted + index kernels)
  one       kernels/align.sort_copies: one launch, O(copies^2) comparisons (copies <= 2048 only)
  segment   kernels/ep_sort.sort_copies_by_expert in its segment launches (whole sort off): a histogram per
            segment of copies, then each segment sorted in registers (alltoall's receiver sort; the same stable
            order); past segment_size's table a scan launch between the two
  whole     the same function's one launch, one program sorting every copy (ep_sort.whole_sort), up to 8192
  equal     whether the segment sort's outputs equal torch's, all five, exactly
  segment_table  the same in its two-launch form at every size (one histogram table read by every
            place program, segments lengthened to cap it): the form before the scan launch
At 323572f a third way ran beside them ("scan": one program per (expert, segment) reading every
copy of its segment, work growing with E; sort_variants_2026-11-30_h200_323572f.json): it lost to
"segment" from 1024 copies up and was removed.
Chooses expert_sort.ONE_LAUNCH_COPIES, ep_sort._WHOLE_COPIES and ep_sort.sort_pays: which way each size takes.
"""
import json
import statistics
import sys

import torch

from moeflow.dispatch.expert_sort import sort_by_expert_torch, sort_by_segments
from moeflow.kernels.align import MAX_FUSED_COPIES, sort_copies
from moeflow.kernels import ep_sort
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


def forced(whole: bool, fn):
    """fn() with ep_sort's whole sort forced on (every size) or off."""
    def call():
        keep, ep_sort._WHOLE_COPIES = ep_sort._WHOLE_COPIES, (1 << 40) if whole else 0
        try:
            return fn()
        finally:
            ep_sort._WHOLE_COPIES = keep
    return call


def main():
    rows = []
    small = "--small" in sys.argv
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    for e, k in ((8, 2), (128, 8), (256, 8)):
        for t in (16, 128, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536):
            if small and t * k > 4096:
                continue
            ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k].to(torch.int32).contiguous()
            w = torch.rand(t, k, device="cuda")
            bounds = torch.arange(e + 1, dtype=ids.dtype, device="cuda")
            n = t * k
            row = dict(E=e, K=k, T=t, copies=n,
                       torch=graph_us(lambda: sort_by_expert_torch(ids, w, e, bounds)),
                       segment=graph_us(forced(False, lambda: sort_copies_by_expert(ids, w, e, n))))
            want = sort_by_expert_torch(ids, w, e, bounds)
            row["equal"] = all(torch.equal(a, b) for a, b in zip(forced(False, lambda: sort_by_segments(ids, w, e))(),
                                                                 want))
            if n <= 8192:
                row["whole"] = graph_us(forced(True, lambda: sort_copies_by_expert(ids, w, e, n)))
                row["whole_equal"] = all(torch.equal(a, b) for a, b in zip(
                    forced(True, lambda: sort_by_segments(ids, w, e))(), want))
            if n <= 131072:  # past that its segments grow to 16384+ copies sorted in registers
                table_seg, ep_sort._TABLE_SEG = ep_sort._TABLE_SEG, 1 << 40  # the two-launch form at every size
                row["segment_table"] = graph_us(forced(False, lambda: sort_copies_by_expert(ids, w, e, n)))
                ep_sort._TABLE_SEG = table_seg
            if n <= MAX_FUSED_COPIES:
                row["one"] = graph_us(lambda: sort_copies(ids, w, e))
            rows.append(row)
            print(" ".join(f"{k_}={v:.1f}" if isinstance(v, float) else f"{k_}={v}" for k_, v in row.items()), flush=True)
            if args:  # after every row: a run cut short by a time limit keeps the rows it reached
                json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(args[0], "w"), indent=1)


if __name__ == "__main__":
    main()
