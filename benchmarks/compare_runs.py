"""Two runs of bench_layer.py side by side: each row's time, new over old, and both runs' target lines,
each at its own re-measured ceilings and the new run at the old run's too. A change's effect on the rows is read
from an A/B on one machine (benchmarks/gpu_run.sh with BASELINE=); this script says how far two runs moved apart,
and how much of a move in % of roofline is the re-measured ceilings rather than the times.

    python benchmarks/compare_runs.py OLD/bench.json NEW/bench.json
"""
import json
import math
import sys

from moeflow.benchmark import format_target_summary, rebased_rows, target_summary


def _ratios(old: dict, new: dict, key: str) -> list[float]:
    return [new[k][key] / old[k][key] for k in new if k in old and old[k].get(key) and new[k].get(key)]


def _spread(ratios: list[float]) -> str:
    if not ratios:
        return "-"
    gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
    return f"{min(ratios):.3f}-{max(ratios):.3f} (geometric mean {gm:.3f}) over {len(ratios)} rows"


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    runs = [json.load(open(a)) for a in args]
    key = lambda r: (r["preset"], r["scheme"], r["runner"], r["T"])
    old, new = ({key(r): r for r in run["rows"]} for run in runs)
    print(f"{'row':<40}{'old µs':>11}{'new µs':>11}{'new/old':>9}{'old %':>8}{'new %':>8}")
    for k, r in new.items():
        if k in old and old[k].get("layer_graph_us") and r.get("layer_graph_us"):
            o = old[k]
            print(f"{' '.join(map(str, k)):<40}{o['layer_graph_us']:11.1f}{r['layer_graph_us']:11.1f}"
                  f"{r['layer_graph_us'] / o['layer_graph_us']:9.3f}{o['roof_pct']:8.1f}{r['roof_pct']:8.1f}")
    print("new over old, do_bench:", _spread(_ratios(old, new, "layer_graph_us")))
    print("new over old, clean flush:", _spread(_ratios(old, new, "layer_clean_us")))
    for name, run in zip(("old", "new"), runs):
        print(f"{name} ceilings:", {c: f"{v:.3g}" for c, v in run["ceilings"].items()})
    for label, rows in (("old run", runs[0]["rows"]), ("new run", runs[1]["rows"]),
                        ("new run at the old run's ceilings", rebased_rows(runs[1]["rows"], runs[0]["ceilings"]))):
        print(format_target_summary(target_summary(rows), f"{label}, do_bench"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
