"""moeflow/tune/registers.py compiles for targets other than Hopper: a small bf16 gate_up tile for sm_80 (the
wheel's ptxas) and sm_120a (ptxas-blackwell), with shared memory, registers and spills in its CompileReport.
Compiled in a subprocess: the interpreter tests switch TRITON_INTERPRET on for this process."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
              pytest.mark.targets]  # the compile tier (.ci/run's 2nd step)

COMPILE = r'''
import json, torch
from moeflow.kernels.configs import GemmConfig
from moeflow.tune.registers import gemm_report, gpu_name, ptxas_path
out = {}
for arch in (80, 120):
    if ptxas_path(arch) is None:
        print(json.dumps(None)); raise SystemExit
    r = gemm_report("gate_up", "none", torch.bfloat16, GemmConfig(16, 64, 64, 1, 4, 2), arch, tma=False)
    out[arch] = dict(arch=r.arch, shared=r.shared_bytes, regs=r.registers, spill=r.spill_bytes, name=gpu_name(arch),
                     ptxas=ptxas_path(arch).rsplit("/", 1)[-1], target=f".target {gpu_name(arch)}" in r.ptx)
print(json.dumps(out))
'''


def test_gate_up_tile_compiles_for_ampere_and_blackwell():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    found = json.loads(res.stdout.strip().splitlines()[-1])
    if found is None:
        pytest.skip("this triton build ships no ptxas")
    assert found["80"]["name"] == "sm_80" and found["80"]["ptxas"] == "ptxas"
    assert found["120"]["name"] == "sm_120a" and found["120"]["ptxas"] == "ptxas-blackwell"
    for arch, got in found.items():
        assert got["arch"] == int(arch) and got["target"], got
        assert got["shared"] > 0 and 0 < got["regs"] <= 255 and got["spill"] >= 0, got
