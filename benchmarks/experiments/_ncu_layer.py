"""Runs the whole layer (triton runner) eagerly 4 times for a profiler to attach to:

    ncu --kernel-name regex:NAME python benchmarks/experiments/_ncu_layer.py PRESET SCHEME T
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from bench_layer import Case  # noqa: E402
from moeflow.experts import create_runner  # noqa: E402
preset, scheme, t = sys.argv[1], sys.argv[2], int(sys.argv[3])
case = Case(preset, scheme)
runner = create_runner("triton", case.cfg.replace(runner="triton"), case.scheme)
x, lg = case.inputs(t, 1)[0]
for _ in range(4):
    case.layer(runner, x, lg)
torch.cuda.synchronize()
