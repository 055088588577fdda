"""`moeflow selftest` on a GPU: every cell the planner accepts passes (exit 0), the Triton runner's cells among them
where the planner builds it (sm_90), and the reference runner checked against the CPU's; the JSON names the GPU.
Run: pytest -m gpu tests/gpu/test_gpu_selftest.py"""
import json

import pytest
import torch

from moeflow import MoEConfig
from moeflow.capabilities import Environment
from moeflow.cli import main
from moeflow.planner import cell_status
from moeflow.quant import SCHEMES
from moeflow.selftest import SHAPE

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_selftest_on_the_gpu_runs_the_triton_cells(tmp_path, capsys):
    device = torch.device("cuda", torch.cuda.current_device())
    triton_ok = cell_status(MoEConfig(**SHAPE, runner="triton", device=device), Environment.detect(device)) == "ok"
    out = tmp_path / "selftest.json"
    assert main(["selftest", "--device", "cuda", "--json", str(out)]) == 0, capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["passed"] and doc["name"] == torch.cuda.get_device_name(device)
    assert doc["capability"] == "{}.{}".format(*torch.cuda.get_device_capability(device))
    print(f"selftest: {doc['seconds']:.1f} s on {doc['name']}")  # the brief: within 60 s on a GPU (warm Triton cache)
    cells = doc["cells"]
    assert not [c for c in cells if c["status"] == "FAIL"]
    reference = [c for c in cells if c["runner"] == "reference"]
    # the reference runner against the CPU's (the comparand unchecked only where the two layers' schemes differ)
    assert reference and all(c["status"] in ("pass", "comparand") for c in reference)
    assert any(c["status"] == "pass" for c in reference)
    if not triton_ok:
        pytest.skip(f"the planner does not build the triton runner on {doc['name']} ({doc['planner']})")
    triton = [c for c in cells if c["runner"] == "triton"]
    want = {(s, d) for s in SCHEMES.names() for d in ("bfloat16", "float16", "float32")}
    assert {(c["scheme"], c["dtype"]) for c in triton if c["status"] == "pass"} == want
    for c in triton:
        assert len(c["errors"]) == 3 and c["rel_err"] <= c["tol"]
