"""No GPU: what each missed target of issue 3 would take, from the committed measurements alone.

Reads benchmarks/results/ (nothing is timed here):
  RUN            one 36-row run (bench_layer.py's CSV; default the latest committed, b67a6e3's)
  triton_2026-12-0*_h200_*_bench.csv   every committed 36-row run: each row's spread of % of roofline between runs
  flush_mode_2026-12-01_h200_a186f5f.json   per T = 1, 16, 128 row: the layer after do_bench's flush (dirty L2)
                 and after a clean one; the difference is write-back the layer pays for the flush
  fused_parts_2026-12-01_h200_35ee490.json  a graph replay of one empty kernel under do_bench (4.2-4.3 µs)
  evict_first_probe_2026-12-05_h200_5571c33.json  a launch that only reads 38-1200 MB, after the flush and after a
                 clean one, with and without cache hints
  layer_kernels_2026-12-03_h200_dc144bb.json  per-kernel device time of the sub-60% rows at T >= 1024

Per row that misses a target in RUN: its time (graph replay, do_bench: the targets' figure), the time 60% of
roofline allows (floor / 0.6) and the anchor, each gap in µs, and the row's % of roofline over the committed runs
(least / median / most, and in how many runs it reached 60%; the floor is measured in each run, so it moves with the
machine). Then the fixed-cost bound at T <= 128: a layer that streamed its bytes as fast as the run's fastest
T = 16 or 128 row did (net of that row's fixed costs) and did nothing else would still pay the empty graph replay
and, under do_bench, the flush's write-back: at most floor / (floor / rate + empty + write-back) of roofline (without
the write-back for a clean flush). Beside it, the same bound with the least write-back the probe saw at about the
row's bytes (its evict-first hint spared part of it), and the probe's own read-only time as a % of the row's
roofline. Then, for the profiled rows: the GEMMs' and the other kernels' device time, and the GEMM time that 60%
leaves if the rest stays (profile and RUN are different runs and machines: read it as a size, not a prediction).

    python benchmarks/experiments/target_gaps.py [RUN.csv]
"""
import csv
import glob
import json
import math
import os
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results")
RUN = "triton_2026-12-04_h200_b67a6e3_bench.csv"
FLUSH, PARTS = "flush_mode_2026-12-01_h200_a186f5f.json", "fused_parts_2026-12-01_h200_35ee490.json"
PROBE = "evict_first_probe_2026-12-05_h200_5571c33.json"
KERNELS = "layer_kernels_2026-12-03_h200_dc144bb.json"
GEMMS = ("gemm", "gate_up", "down")  # kernel names holding these are GEMMs; the rest is routing, sort, copy, sum


def read_run(path: str) -> dict:
    """bench_layer CSV -> {(preset, scheme, T): row dict with floats} for the triton runner."""
    out = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            if r["runner"] == "triton":
                num = {k: float(v) if v else None for k, v in r.items() if k.endswith("_us")}
                out[(r["preset"], r["scheme"], int(r["T"]))] = dict(r, **num)
    return out


def spread(pattern: str = "triton_2026-12-0*_h200_*_bench.csv") -> dict:
    """(preset, scheme, T) -> the % of roofline of every committed run's graph time, sorted."""
    by = {}
    for path in sorted(glob.glob(os.path.join(RESULTS, pattern))):
        for key, r in read_run(path).items():
            if r.get("layer_graph_us") and r.get("floor_us"):
                by.setdefault(key, []).append(100 * r["floor_us"] / r["layer_graph_us"])
    return {k: sorted(v) for k, v in by.items()}


def missed(run: dict, runs: dict) -> list[dict]:
    """The rows of ``run`` below 60% of roofline or slower than their anchor, with their gaps (module docstring)."""
    out = []
    for (p, s, t), r in sorted(run.items()):
        g, floor, anchor = r["layer_graph_us"], r["floor_us"], r.get("anchor_us")
        pct, allow60 = 100 * floor / g, floor / 0.6
        if pct >= 60 and (anchor is None or g <= anchor):
            continue
        v = runs.get((p, s, t), [pct])
        out.append(dict(preset=p, scheme=s, T=t, us=g, pct=pct, allow60=allow60, cut60=max(0.0, g - allow60),
                        anchor=anchor, cut_anchor=None if anchor is None else max(0.0, g - anchor),
                        least=v[0], median=v[len(v) // 2], most=v[-1], runs=len(v), runs60=sum(x >= 60 for x in v)))
    return out


def probe_rows() -> dict:
    """evict_first_probe's read-only graphs -> {MB read: (the least dirty - clean over its cache policies, the least
    dirty µs)}: what a launch that only reads that many bytes paid after do_bench's flush."""
    with open(os.path.join(RESULTS, PROBE)) as f:
        rows = json.load(f)["rows"]
    out = {}
    for r in rows:
        back, us = out.get(r["mb"], (float("inf"), float("inf")))
        out[r["mb"]] = (min(back, r["dirty_us"] - r["clean_us"]), min(us, r["dirty_us"]))
    return out


def fixed_bounds(run: dict) -> tuple[float, list[dict]]:
    """Per T <= 128 row with a flush_mode measurement: the most % of roofline its fixed costs leave (docstring)
    -> (the fastest streaming seen, as a multiple of the floor's rate, and the rows). The roofline's copy ceiling
    counts bytes read and written; the weight-streaming rows read, and some ran above 100% of roofline, so the bound
    lets the layer stream as fast as the fastest such row of the run did net of its own fixed costs. Where the
    evict-first probe read about the row's bytes (within 15%), its least write-back gives a second bound
    (bound_hint: the hint spares part of it), and its least dirty time a measured one (probe_pct: a launch that only
    read those bytes)."""
    with open(os.path.join(RESULTS, PARTS)) as f:
        empties = sorted(r["empty"] for r in json.load(f))
    empty = empties[len(empties) // 2]
    with open(os.path.join(RESULTS, FLUSH)) as f:
        flush = [(m, run[(m["preset"], m["scheme"], m["T"])]) for m in json.load(f)
                 if (m["preset"], m["scheme"], m["T"]) in run]
    probes = probe_rows()
    back = lambda m: max(0.0, m["dirty"] - m["clean"])
    stream = max(r["floor_us"] / (r["layer_graph_us"] - empty - back(m)) for m, r in flush if m["T"] >= 16)
    out = []
    for m, r in flush:
        floor = r["floor_us"]
        mb = float(r["gbs"]) * r["layer_graph_us"] * 1e-3 if r.get("gbs") else None  # GB/s x µs = kB
        probe = next((v for k, v in probes.items() if mb and abs(k - mb) <= 0.15 * k), None)
        least = back(m) if probe is None else min(back(m), max(0.0, probe[0]))
        out.append(dict(preset=m["preset"], scheme=m["scheme"], T=m["T"], floor=floor, mb=mb, empty=empty,
                        write_back=back(m), least_back=least, bound=100 * floor / (floor / stream + empty + back(m)),
                        bound_hint=100 * floor / (floor / stream + empty + least),
                        bound_clean=100 * floor / (floor / stream + empty),
                        probe_pct=None if probe is None else 100 * floor / probe[1],
                        pct=100 * floor / r["layer_graph_us"]))
    return stream, out


def profiled(run: dict) -> list[dict]:
    """Per profiled row (layer_kernels JSON): GEMM and other kernels' µs, and the GEMM µs 60% would leave."""
    with open(os.path.join(RESULTS, KERNELS)) as f:
        prof = json.load(f)
    out = []
    for name, rec in prof.items():
        p, s, t = name.split()
        r = run.get((p, s, int(t.split("=")[1])))
        if r is None or r["T"] in ("1", "16", "128") or 100 * r["floor_us"] / r["layer_graph_us"] >= 60:
            continue  # the T >= 1024 rows under 60% (at T = 1 the layer after routing is one kernel)
        gemm = sum(us for k, us, _ in rec["kernels"] if any(g in k for g in GEMMS))
        other = rec["total_kernel_us"] - gemm
        launch = max(0.0, rec["graph_us"] - rec["total_kernel_us"])
        out.append(dict(preset=p, scheme=s, T=int(t.split("=")[1]), graph=rec["graph_us"], gemm=gemm, other=other,
                        gemm60=r["floor_us"] / 0.6 - other - launch, floor=r["floor_us"]))
    return out


def geomean_need(run: dict, bounds: list[dict], goal: float = 85.0) -> dict:
    """The geometric-mean target against the fixed-cost bounds: the run's geomean, and, with every row whose do_bench
    bound is under ``goal`` at that bound, the geomean the other rows would need (and have now)."""
    pct = {k: 100 * r["floor_us"] / r["layer_graph_us"] for k, r in run.items()}
    capped = {(b["preset"], b["scheme"], b["T"]): b["bound"] for b in bounds if b["bound"] < goal}
    gm = lambda v: math.exp(sum(math.log(x) for x in v) / len(v))
    rest = [v for k, v in pct.items() if k not in capped]
    need = math.exp((len(pct) * math.log(goal) - sum(math.log(v) for v in capped.values())) / len(rest))
    small = [v for k, v in pct.items() if k[2] <= 128]
    large = [v for k, v in pct.items() if k[2] > 128]
    return dict(geomean=gm(list(pct.values())), capped=capped, rest_now=gm(rest), rest_need=need, rest=len(rest),
                small=gm(small), large=gm(large), n_small=len(small), n_large=len(large))


def main():
    run_path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(RESULTS, RUN)
    run, runs = read_run(run_path), spread()
    print(f"Rows missing a target in {os.path.basename(run_path)} (graph replay, do_bench µs):\n")
    print("| row | µs | % roofline | µs at 60% | cut for 60% | anchor | cut for anchor | % over the runs "
          "(least / median / most) | runs at ≥ 60% |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in missed(run, runs):
        anchor = "- | -" if m["anchor"] is None else f"{m['anchor']:.0f} | {m['cut_anchor']:.1f}"
        print(f"| {m['preset']} {m['scheme']} T={m['T']} | {m['us']:.1f} | {m['pct']:.1f} | {m['allow60']:.1f} | "
              f"{m['cut60']:.1f} | {anchor} | {m['least']:.1f} / {m['median']:.1f} / {m['most']:.1f} | "
              f"{m['runs60']} of {m['runs']} |")
    stream, bounds = fixed_bounds(run)
    print(f"\nFixed costs at T <= 128: the most % of roofline a layer can reach that streams its bytes at "
          f"{stream:.3f}x the roofline's rate (the fastest of this run's rows, net of their fixed costs) and does "
          "nothing else:\n")
    print("| row | MB | floor µs | empty graph µs | write-back µs (least with evict-first) | bound, do_bench "
          "(with evict-first) | bound, clean flush | read-only probe | measured |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b in bounds:
        probe = "-" if b["probe_pct"] is None else f"{b['probe_pct']:.1f}"
        print(f"| {b['preset']} {b['scheme']} T={b['T']} | {b['mb']:.0f} | {b['floor']:.1f} | {b['empty']:.1f} | "
              f"{b['write_back']:.1f} ({b['least_back']:.1f}) | {b['bound']:.1f} ({b['bound_hint']:.1f}) | "
              f"{b['bound_clean']:.1f} | {probe} | {b['pct']:.1f} |")
    g = geomean_need(run, bounds)
    names = ", ".join(f"{p} {s} T={t} ({v:.1f}%)" for (p, s, t), v in sorted(g["capped"].items()))
    print(f"\nGeometric mean: {g['geomean']:.1f}%. With the rows whose bound is under 85% at their bounds ({names}), "
          f"the other {g['rest']} would need {g['rest_need']:.1f}%; they have {g['rest_now']:.1f}%. The {g['n_small']} "
          f"rows at T <= 128 have {g['small']:.1f}%, the {g['n_large']} at T > 128 {g['large']:.1f}%.")
    print(f"\nProfiled rows ({KERNELS}; device µs, eager, one call):\n")
    print("| row | graph µs | GEMMs | other kernels | GEMMs that 60% leaves (this run's floor) |")
    print("|---|---|---|---|---|")
    for p in profiled(run):
        print(f"| {p['preset']} {p['scheme']} T={p['T']} | {p['graph']:.1f} | {p['gemm']:.1f} | {p['other']:.1f} | "
              f"{p['gemm60']:.1f} |")


if __name__ == "__main__":
    main()
