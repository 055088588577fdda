"""Timing shared by the EP experiments (ep_overlap.py, ep_p2p.py): every rank runs the same calls."""
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_ep import capture  # noqa: E402,F401  (fn captured in a CUDA graph after a side-stream warm-up)


def t_us(fn, n=20):
    """Median over 5 repetitions of the mean time (µs) of n calls, each repetition opened by a
    synchronization and a barrier, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize(); dist.barrier()
    out = []
    for _ in range(5):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        torch.cuda.synchronize(); dist.barrier()
        a.record()
        for _ in range(n):
            fn()
        b.record(); b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / n)
    return statistics.median(out)
