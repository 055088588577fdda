#!/usr/bin/env bash
# Layer A/B of two versions of source files, interleaved in one device call (rows move ±5-8% between lent H200s,
# so a change is judged against its base on the same machine).
#
#   VARIANTS="div recip" ROUNDS=2 bash benchmarks/ab_files.sh moeflow/kernels/common.py -- \
#       --presets qwen3-30b-a3b --schemes fp8-block --runners triton --tokens 1024,4096
#
# Each variant v copies .ab/<v>/<path> over <path> for every path given (keep the versions under .ab/, which the
# device tool copies with the tree; delete it after), then runs benchmarks/bench_layer.py with the arguments after
# "--" into $OUT/<v><round>. Round 1 runs the variants in order, round 2 in order again (A B A B). The last variant's
# files stay in place. Prints and writes $OUT/ab.json: per row, each run's do_bench and clean-flush graph µs.
set -u
OUT=${OUT:-./ab-results}
paths=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do paths+=("$1"); shift; done
shift
mkdir -p "$OUT"
for r in $(seq 1 "${ROUNDS:-2}"); do
  for v in $VARIANTS; do
    for p in "${paths[@]}"; do cp ".ab/$v/$p" "$p"; done
    echo "$(date +%T) $v$r" >&2
    python benchmarks/bench_layer.py "$@" --out "$OUT/$v$r" > "$OUT/$v$r.log" 2>&1 || tail -5 "$OUT/$v$r.log" >&2
  done
done
python - "$OUT" $VARIANTS <<'PY'
import csv, glob, json, os, sys
out, variants = sys.argv[1], sys.argv[2:]
rows = {}
for v in variants:
    for f in sorted(glob.glob(os.path.join(out, v + "[0-9]*", "bench.csv"))):
        run = os.path.basename(os.path.dirname(f))
        for r in csv.DictReader(open(f)):
            if r["layer_graph_us"]:
                key = f'{r["preset"]} {r["scheme"]} T={r["T"]}'
                rows.setdefault(key, {})[run] = [float(r["layer_graph_us"]), float(r["layer_clean_us"])]
json.dump(rows, open(os.path.join(out, "ab.json"), "w"), indent=1)
runs = sorted({run for d in rows.values() for run in d}, key=lambda s: (s.lstrip("abcdefghijklmnopqrstuvwxyz_-"), s))
print("row (do_bench / clean µs)".ljust(36), *[run.rjust(15) for run in runs])
for key, d in rows.items():
    print(key.ljust(36), *[(f"{d[run][0]:7.1f}/{d[run][1]:7.1f}" if run in d else "-").rjust(15) for run in runs])
PY
