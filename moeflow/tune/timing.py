"""What a tuning run is for (``Shape``) and how it times a candidate (``graph_time_ms``: replayed CUDA graphs)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..graphs import capture_graph


@dataclass(frozen=True)
class Shape:
    num_experts: int  # local experts
    hidden: int  # H
    inter: int  # I
    top_k: int
    scheme: str
    dtype: torch.dtype = torch.bfloat16


def graph_time_ms(calls, rep_ms: float, min_replays: int = 5, max_replays: int = 500) -> float:
    """Median time (ms) per call of ``calls`` (zero-argument callables), captured back to back into
    one CUDA graph and replayed: enough replays to fill ~rep_ms, at least min_replays."""
    graph = capture_graph(lambda: [c() for c in calls])
    graph.replay()
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    first.record()
    graph.replay()
    last.record()
    torch.cuda.synchronize()
    n = max(min_replays, min(max_replays, int(rep_ms / max(first.elapsed_time(last), 1e-3))))
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in ev:
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in ev)
    del graph
    return times[n // 2] / len(calls)
