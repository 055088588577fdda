"""The portable kernels against the Hopper path and SGLang's Triton GEMMs, row by row, from one GPU call's files.

    python benchmarks/portable_report.py --hopper layer/bench.json --portable portable_bf16/bench.json \
        portable_fp8/bench.json [--weight-only weight_only/bench.json] [--anchor anchor_sglang/anchor.json]

Rows are (preset, scheme, T); a layer's time is its graph time (layer_graph_us), as bench_layer reports it, and the
anchor's its GEMM launches replayed as a graph where it has one (gemm_graph_us), else eager (gemm_us). Prints the
table and three lines, one a target: the portable layer / the Hopper layer (geometric mean; target <= 1.25), rows
with T >= 1024 where the portable layer is at least as fast as the anchor's GEMMs alone, and weight-only FP8 at
T <= 16: % of the bytes roofline and the time against the portable bf16 layer's at the same T.
"""
from __future__ import annotations

import argparse
import json
import math


def _rows(path: str) -> dict:
    with open(path) as f:
        data = json.load(f)
    rows = data["rows"] if isinstance(data, dict) else data
    return {(r["preset"], r["scheme"], int(r["T"])): r for r in rows if r.get("runner", "triton") == "triton"}


def _time(r: dict | None) -> float | None:
    if not r:
        return None
    return r.get("layer_graph_us") or r.get("layer_us") or r.get("gemm_graph_us") or r.get("gemm_us")


def _geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hopper", required=True)
    p.add_argument("--portable", nargs="+", required=True)
    p.add_argument("--weight-only")
    p.add_argument("--anchor")
    args = p.parse_args(argv)
    hopper = _rows(args.hopper)
    portable = {}
    for path in args.portable:
        portable.update(_rows(path))
    anchor = _rows(args.anchor) if args.anchor else {}
    print(f"{'preset':14} {'scheme':10} {'T':>6} {'hopper_us':>10} {'portable_us':>11} {'ratio':>6} "
          f"{'anchor_us':>10} {'vs anchor':>9}")
    ratios, beat, big = [], 0, 0
    for key in sorted(portable, key=lambda k: (k[0], k[1], k[2])):
        h, q, a = _time(hopper.get(key)), _time(portable[key]), _time(anchor.get(key))
        ratio = q / h if h and q else None
        if ratio:
            ratios.append(ratio)
        verdict = "-"
        if a and q:
            verdict = "faster" if q <= a else "slower"
            if key[2] >= 1024:
                big += 1
                beat += q <= a
        print(f"{key[0]:14} {key[1]:10} {key[2]:6} {h or float('nan'):10.1f} {q or float('nan'):11.1f} "
              f"{ratio or float('nan'):6.3f} {a or float('nan'):10.1f} {verdict:>9}")
    print(f"portable / hopper: geometric mean {_geomean(ratios):.3f} over {len(ratios)} rows (target <= 1.25)")
    print(f"T >= 1024: portable layer at least as fast as the anchor's GEMMs on {beat} of {big} rows (target: all)")
    if args.weight_only:
        wo = _rows(args.weight_only)
        parts = []
        for key in sorted(wo):
            bf16 = _time(portable.get((key[0], "none", key[2])))
            speed = f", {bf16 / _time(wo[key]):.2f}x the bf16 layer" if bf16 else ""
            parts.append(f"{key[0]} {key[1]} T={key[2]}: {wo[key]['roof_pct']:.0f}% of roofline{speed}")
        print("weight-only FP8 (target >= 70% of the bytes roofline at T <= 16): " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
