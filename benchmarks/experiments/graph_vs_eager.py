"""Experiment (GPU): why does bench_layer.py time GPU-bound rows slower as a graph replay than as eager calls?

bench_layer.py's headline, layer_graph_us, replays the whole layer (route -> combine) as one CUDA graph of input 0;
its layer_us calls the same layer eagerly, rotating over 4 inputs. Over the 26 committed 36-row runs
(benchmarks/results/triton_2026-12-0*_h200_*_bench.csv) the graph was the slower of the two on the GPU-bound rows: the
median graph / eager ratio is 1.078 on DeepSeek-V3 bf16 T=16384 (above 1 in 26 of 26 runs), 1.054 on Qwen3 bf16
T=16384 (24 of 26), 1.048 on Mixtral bf16 T=1024 (25 of 26), 1.03-1.04 on DeepSeek-V3 and Mixtral T=4096 (both
schemes), but 1.005 on DeepSeek-V3 fp8-block T=16384 (`--ratios` below prints every row).
Three explanations, which this separates:
  (a) order under the power cap: bench_layer times eager first and the graph 1-3 s of heavy work later, and the
      H200's SM clock keeps falling at its 700 W cap for seconds (power_clocks_2026-12-02_h200_b11282f.md);
  (b) routing: the graph replays input 0 alone, eager rotates over four routings (padding rows differ);
  (c) the graph itself: its programmatic-dependent-launch edges, its memory pool.
Per row, ROUNDS rounds time each mode below once, in reversed order every other round, each after SETTLE_S seconds
idle, with triton's do_bench (L2 flushed before each call, median) over REP_MS; nvidia-smi samples the SM clock and
power every 100 ms, reported per timing window:
  eager-rot   bench_layer's layer_us: eager calls rotating over the 4 inputs
  eager-0     eager calls of input 0 only
  graph-0     bench_layer's layer_graph_us: one graph of input 0
  graph-rot   one graph per input, replayed in turn
  graph-0-nopdl  graph-0 captured with MOEFLOW_TRITON_PDL=0 (every kernel launched plainly)
Reading: (a) predicts equal times once equally settled, each following its window's clock; (b) eager-0 and graph-0
apart from the rotated modes; (c) graph-0 slower than eager-0 at the same clock, and graph-0-nopdl different.

    PYTHONPATH=$PWD OUT=DIR [SETTLE_S=1] [REP_MS=300] [ROUNDS=2] python benchmarks/experiments/graph_vs_eager.py \
        [preset:scheme:T ...]
Writes OUT/graph_vs_eager.json and OUT/smi.csv; prints a table last (median µs over the rounds, and each mode over
eager-rot; the SM clock's median over the mode's windows).

    python benchmarks/experiments/graph_vs_eager.py --ratios     # no GPU: the ratios above, from the committed runs
    python benchmarks/experiments/graph_vs_eager.py --padding    # no GPU: how far one routing's work can stray
--padding bounds (b): per row, the rows the H200 tables' tiles compute (each expert's count rounded up to the tile's
rows; gate_up weighted 2, down 1) over 64 random routings (top-k of N(0, 1) logits), as their spread around the mean.
"""
import datetime
import glob
import itertools
import json
import os
import statistics
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import Case  # noqa: E402
from power_clocks import smi_window, start_smi  # noqa: E402
from target_gaps import RESULTS, read_run  # noqa: E402

from moeflow.experts import create_runner  # noqa: E402
from moeflow.kernels.autotune import capture_graph  # noqa: E402

ROWS = ["deepseek-v3:none:16384", "deepseek-v3:none:4096", "deepseek-v3:fp8-block:4096", "mixtral-8x7b:none:1024",
        "mixtral-8x7b:fp8-block:4096", "mixtral-8x7b:fp8-block:1024", "qwen3-30b-a3b:none:16384",
        "qwen3-30b-a3b:none:4096", "qwen3-30b-a3b:fp8-block:16384"]
MODES = ["eager-rot", "eager-0", "graph-0", "graph-rot", "graph-0-nopdl"]
SETTLE_S, REP_MS = float(os.environ.get("SETTLE_S", 1)), float(os.environ.get("REP_MS", 300))
ROUNDS = int(os.environ.get("ROUNDS", 2))


def graph_without_pdl(fn):
    """fn captured as a CUDA graph with MOEFLOW_TRITON_PDL=0 (the switch is read at each launch)."""
    old = os.environ.get("MOEFLOW_TRITON_PDL")
    os.environ["MOEFLOW_TRITON_PDL"] = "0"
    try:
        return capture_graph(fn, warmups=2)
    finally:
        if old is None:
            del os.environ["MOEFLOW_TRITON_PDL"]
        else:
            os.environ["MOEFLOW_TRITON_PDL"] = old


def mode_fns(case: Case, t: int) -> dict:
    """The five modes' calls (module docstring) on one row's four inputs."""
    runner = create_runner("triton", case.cfg.replace(runner="triton"), case.scheme)
    ins = case.inputs(t)
    calls = [lambda x=x, lg=lg: case.layer(runner, x, lg) for x, lg in ins]
    graphs = [capture_graph(c, warmups=2) for c in calls]
    nopdl = graph_without_pdl(calls[0])
    rot, grot = itertools.cycle(calls), itertools.cycle(graphs)
    return {"eager-rot": lambda: next(rot)(), "eager-0": calls[0], "graph-0": graphs[0].replay,
            "graph-rot": lambda: next(grot).replay(), "graph-0-nopdl": nopdl.replay}


def run_row(case: Case, t: int) -> dict:
    fns = mode_fns(case, t)
    out = {m: [] for m in MODES}
    for r in range(ROUNDS):
        for m in (MODES if r % 2 == 0 else MODES[::-1]):
            torch.cuda.synchronize()
            time.sleep(SETTLE_S)
            lo = datetime.datetime.now().isoformat()
            us = do_bench(fns[m], warmup=10, rep=REP_MS, return_mode="median") * 1e3
            out[m].append(dict(us=round(us, 1), lo=lo, hi=datetime.datetime.now().isoformat(), round=r))
    return out


def ratios(pattern: str = "triton_2026-12-0*_h200_*_bench.csv") -> list[dict]:
    """The committed 36-row runs (benchmarks/results/PATTERN) -> per row with a graph time: the runs, and the median,
    least and largest layer_graph_us / layer_us and the runs where it is above 1."""
    by = {}
    for path in sorted(glob.glob(os.path.join(RESULTS, pattern))):
        for key, r in read_run(path).items():  # the triton rows, times as floats
            if r.get("layer_graph_us") and r.get("layer_us"):
                by.setdefault(key, []).append(r["layer_graph_us"] / r["layer_us"])
    return [dict(preset=p, scheme=s, T=t, runs=len(v), median=sorted(v)[len(v) // 2], least=min(v), most=max(v),
                 above_1=sum(x > 1 for x in v)) for (p, s, t), v in sorted(by.items())]


def padding_spread(routings: int = 64) -> list[dict]:
    """Per 36-row row at T >= 1024: the padded rows the shipped H200 tables' tiles compute, over ``routings`` random
    routings -> mean padded / real rows, and the standard deviation, least and largest as fractions of the mean."""
    from moeflow.kernels.configs import find_table
    from moeflow.presets import PRESETS
    gen, out = torch.Generator().manual_seed(0), []
    for preset in ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3"):
        p = PRESETS[preset]
        e, k = p["num_experts"], p["top_k"]
        for scheme in ("none", "fp8-block"):
            table = find_table("NVIDIA H200", e, p["intermediate_size"], p["hidden_size"], scheme)
            for t in (1024, 4096, 16384):
                cfg = table[t]
                work = []
                for _ in range(routings):
                    ids = torch.randn(t, e, generator=gen).topk(k, dim=1).indices
                    counts = torch.bincount(ids.flatten(), minlength=e).tolist()
                    pad = lambda bm: sum(-(-n // bm) * bm for n in counts)
                    work.append((2 * pad(cfg.gate_up.block_m) + pad(cfg.down.block_m)) / (3 * t * k))
                mean = sum(work) / routings
                sd = (sum((w - mean) ** 2 for w in work) / routings) ** 0.5
                out.append(dict(preset=preset, scheme=scheme, T=t, padded_over_real=mean, sd=sd / mean,
                                least=min(work) / mean, most=max(work) / mean))
    return out


def print_rows(rows: list[dict], cols: list[tuple[str, str, str]]) -> None:
    """A table of --ratios' or --padding's rows: the row's name, then each (header, key, format spec) column."""
    print(f"{'row':36s} " + " ".join(f"{h:>11s}" for h, _, _ in cols))
    for r in rows:
        name = f"{r['preset']} {r['scheme']} T={r['T']}"
        print(f"{name:36s} " + " ".join(f"{format(r[k], spec):>11s}" for _, k, spec in cols))


def main():
    if sys.argv[1:] == ["--padding"]:
        return print_rows(padding_spread(), [("padded/real", "padded_over_real", ".3f"), ("sd", "sd", ".2%"),
                                             ("least", "least", ".3f"), ("most", "most", ".3f")])
    if sys.argv[1:] == ["--ratios"]:
        return print_rows(ratios(), [("runs", "runs", "d"), ("graph/eager", "median", ".3f"), ("least", "least", ".3f"),
                                     ("most", "most", ".3f"), ("above 1", "above_1", "d")])
    out_dir = os.environ.get("OUT", ".")
    os.makedirs(out_dir, exist_ok=True)
    smi_path = os.path.join(out_dir, "smi.csv")
    smi = start_smi(smi_path)
    res, case = {}, None
    try:
        for spec in sys.argv[1:] or ROWS:
            preset, scheme, t = spec.split(":")
            if case is None or (case.preset, case.cfg.quant) != (preset, scheme):
                case = None  # one preset's weights at a time
                torch.cuda.empty_cache()
                case = Case(preset, scheme)
            res[spec] = run_row(case, int(t))
            print(spec, {m: [w["us"] for w in v] for m, v in res[spec].items()}, flush=True)
    finally:
        time.sleep(0.3)
        smi.terminate()
        smi.wait()
    med = lambda v: statistics.median(v) if v else None
    for windows in (w for row in res.values() for w in row.values()):
        for w in windows:
            w.update(smi_window(smi_path, w["lo"], w["hi"]))
    with open(os.path.join(out_dir, "graph_vs_eager.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n{'row':32s} " + " ".join(f"{m:>22s}" for m in MODES))
    for spec, row in res.items():
        base = med([w["us"] for w in row["eager-rot"]])
        cells = []
        for m in MODES:
            us, mhz = med([w["us"] for w in row[m]]), med([w["sm_mhz"] or 0 for w in row[m]])
            cells.append(f"{us:9.1f} {us / base:5.3f} {mhz:5d}")
        print(f"{spec:32s} " + " ".join(f"{c:>22s}" for c in cells))


if __name__ == "__main__":
    main()
