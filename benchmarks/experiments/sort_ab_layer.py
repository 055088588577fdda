"""Experiment (GPU): benchmarks/bench_layer.py with the local dispatcher's segment sort in one form or the other,
for an A/B of the whole layer.

    PYTHONPATH=$PWD python benchmarks/experiments/sort_ab_layer.py table|scan BENCH_LAYER_ARGS...

  table  kernels/ep_sort in its two-launch form at every size (one histogram table read by every place program)
         and torch's sort where ep_sort.sort_pays says no: the dispatcher before the scan launch
  scan   the scan launch past segment_size's table, and the Triton sort at every size (sort_pays always yes)
"""
import os
import runpy
import sys

from moeflow.kernels import ep_sort

arm = sys.argv.pop(1)
if arm == "table":
    ep_sort._SCAN_SEG = 1 << 40
elif arm == "scan":
    ep_sort._SORT_WORK = 1 << 62
else:
    raise SystemExit(f"arm must be table or scan, got {arm!r}")
sys.argv[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench_layer.py")
runpy.run_path(sys.argv[0], run_name="__main__")
