"""Where a decode layer's time goes: the kernels of one CUDA-graph replay of the whole layer, each with
its start offset and duration (mean over replays), and the gaps between them.

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD python benchmarks/experiments/decode_timeline.py [OUT.json]
Each replay is synchronized on its own (the layer as a decode step sees it: nothing queued behind it).
"span" runs from the first kernel's start to the last kernel's end; "graph" is bench_layer's figure
(L2 flushed, median), which also holds the graph launch itself; "b2b" is 50 replays back to back
(events around all, no flush) / 50; "synced" the median of single replays between events, each
followed by a synchronize.
"""
import json
import os
import sys

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from bench_layer import Case, graph_us  # noqa: E402
from moeflow.experts import create_runner  # noqa: E402
from moeflow.kernels.autotune import capture_graph  # noqa: E402

CASES = [("qwen3-30b-a3b", "none", 1), ("qwen3-30b-a3b", "fp8-block", 1), ("mixtral-8x7b", "fp8-block", 1),
         ("deepseek-v3", "fp8-block", 1), ("qwen3-30b-a3b", "fp8-block", 16)]
REPLAYS = 20


def timeline(fn):
    g = capture_graph(fn, warmups=2)
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(REPLAYS):
            g.replay()
            torch.cuda.synchronize()
    ev = sorted((e for e in p.events() if e.device_type == DeviceType.CUDA and e.time_range.elapsed_us() > 0),
                key=lambda e: e.time_range.start)
    n = len(ev) // REPLAYS
    runs = [ev[r * n:(r + 1) * n] for r in range(REPLAYS)]
    rows = []
    for j in range(n):
        start = sum(run[j].time_range.start - run[0].time_range.start for run in runs) / REPLAYS
        dur = sum(run[j].time_range.elapsed_us() for run in runs) / REPLAYS
        rows.append(dict(kernel=runs[0][j].name[:60], start_us=round(start, 2), dur_us=round(dur, 2)))
    span = sum(run[-1].time_range.end - run[0].time_range.start for run in runs) / REPLAYS
    return rows, span, g


def event_us(g):
    """(back-to-back µs per replay, median µs of single synchronized replays)"""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(50):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    b2b = a.elapsed_time(b) * 1e3 / 50
    single = []
    for _ in range(50):
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        single.append(a.elapsed_time(b) * 1e3)
    return b2b, sorted(single)[25]


def layer_cases(rows):
    """(name, Case, triton runner, x, logits) for each (preset, scheme, T) in rows, one Case (random weights) alive
    at a time."""
    cases = {}
    for preset, scheme, t in rows:
        if (preset, scheme) not in cases:
            cases.clear()
            torch.cuda.empty_cache()
            cases[(preset, scheme)] = Case(preset, scheme)
        case = cases[(preset, scheme)]
        runner = create_runner("triton", case.cfg.replace(runner="triton"), case.scheme)
        x, logits = case.inputs(t, 1)[0]
        yield f"{preset} {scheme} T={t}", case, runner, x, logits


def layer_calls(rows):
    """(name, whole layer of the triton runner as a call) for each (preset, scheme, T) in rows (layer_cases)."""
    for name, case, runner, x, logits in layer_cases(rows):
        yield name, (lambda c=case, r=runner, a=x, lg=logits: c.layer(r, a, lg))


def main():
    out = {}
    for name, fn in layer_calls(CASES):
        rows, span, graph = timeline(fn)
        b2b, synced = event_us(graph)
        g = graph_us(fn)
        out[name] = dict(graph_us=round(g, 2), span_us=round(span, 2), b2b_us=round(b2b, 2), synced_us=round(synced, 2),
                         kernels=rows)
        print(f"\n== {name}: graph {g:.1f} us, span {span:.1f} us, b2b {b2b:.1f} us, synced {synced:.1f} us, "
              f"{len(rows)} kernels, "
              f"sum {sum(r['dur_us'] for r in rows):.1f} us")
        prev_end = 0.0
        for r in rows:
            print(f"  start {r['start_us']:7.2f}  gap {r['start_us'] - prev_end:6.2f}  dur {r['dur_us']:7.2f}  {r['kernel']}")
            prev_end = r["start_us"] + r["dur_us"]
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
