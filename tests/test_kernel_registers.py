"""Register pressure of the large-tile GEMMs on Hopper, checked without a GPU: Triton compiles
for sm_90a and the ptxas inside the triton wheel reports registers and spills
(moeflow/kernels/registers.py). Guards the tiles the tuned H200 configs rely on; an index
expression that defeats Triton's constancy analysis (the fp8-block weight-scale index once cost
~80 registers: 253 instead of 174) fails here, not only in a benchmark.

Compiled in a subprocess: the interpreter tests switch TRITON_INTERPRET on for this process.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CASES = [  # (kernel, scheme, (block_m, block_n, block_k, group_m, warps, stages), most registers allowed)
    ("gate_up", "fp8-block", (64, 128, 128, 8, 8, 4), 200),
    ("gate_up", "none", (128, 128, 64, 8, 8, 3), 255),
    ("down", "fp8-block", (128, 128, 128, 8, 8, 3), 240),
    ("down", "none", (128, 256, 64, 8, 8, 3), 255),
]

SCRIPT = """
import json, sys, torch
from moeflow.kernels.configs import GemmConfig
from moeflow.kernels.registers import ptxas_path, register_usage
if ptxas_path() is None:
    print(json.dumps(None)); sys.exit(0)
cases = json.loads(sys.argv[1])
print(json.dumps([register_usage(k, s, torch.bfloat16, GemmConfig(*c)) for k, s, c, _ in cases]))
"""


def test_large_tiles_fit_in_registers():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    usage = json.loads(res.stdout.strip().splitlines()[-1])
    if usage is None:
        pytest.skip("this triton build ships no ptxas")
    for (kernel, scheme, cfg, most), (regs, spill) in zip(CASES, usage):
        tile = "x".join(map(str, cfg[:3]))
        assert spill == 0, f"{kernel} {scheme} {tile}: {spill} bytes of register spills"
        assert regs <= most, f"{kernel} {scheme} {tile}: {regs} registers > {most}"
