"""Experiment (GPU): benchmarks/bench_layer.py with the local dispatcher's segment sort in one form or the other,
for an A/B of the whole layer.

    PYTHONPATH=$PWD python benchmarks/experiments/sort_ab_layer.py table|scan BENCH_LAYER_ARGS...

  table  kernels/ep_sort in its two-launch form at every size (one histogram table read by every place program)
         and torch's sort past copies x bins = 2^24: the dispatcher before the scan launch (1c1c8bc)
  scan   the sort as shipped (segment_size, sort_pays). At 1c1c8bc, where the results
         sort_scan_ab_2026-12-01_h200_1c1c8bc_* come from, this arm took the scan launch from 512-copy segments
         and the Triton sort at every size; the shipped thresholds came from those results.
"""
import os
import runpy
import sys

import triton

from moeflow.kernels import ep_sort

arm = sys.argv.pop(1)
if arm == "table":
    ep_sort._TABLE_SEG = 1 << 40
    ep_sort.sort_pays = lambda copies, e_local: copies * triton.next_power_of_2(e_local + 1) <= 1 << 24
elif arm != "scan":
    raise SystemExit(f"arm must be table or scan, got {arm!r}")
sys.argv[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench_layer.py")
runpy.run_path(sys.argv[0], run_name="__main__")
