"""The compile matrix (moeflow/tune/compile_matrix.py): for each GPU architecture moeflow's kernels are built for,
every kernel and tile the planner can pick there, compiled for that target on this CPU, fits its shared memory and
registers. Several minutes a target: marked ``targets`` (skipped unless the -m expression names it); .ci/run runs the
compile tier as its own step: python -m pytest -q -m targets -n auto
"""
import json
import os
import subprocess
import sys

import pytest

from moeflow.targets import TARGETS

pytestmark = pytest.mark.targets


@pytest.mark.parametrize("arch", [t.arch for t in TARGETS])
def test_every_picked_kernel_compiles_and_fits(arch, tmp_path):
    out = tmp_path / "matrix.json"
    env = dict(os.environ, TRITON_INTERPRET="0")
    env.pop("MOEFLOW_KERNEL_ARCH", None)
    res = subprocess.run([sys.executable, "-m", "moeflow.tune.compile_matrix", "--arch", arch, "--json", str(out)],
                         capture_output=True, text=True, env=env, timeout=3000)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads(out.read_text())
    names = {r["kernel"] for r in rows}
    assert {"_gate_up_kernel", "_down_kernel", "_route_kernel", "_moe_sum_kernel", "_pack_rows_kernel",
            "_scatter_rows_kernel", "_rank_rows_kernel", "_blank_rows_kernel"} <= names, names
    limit = next(t.shared_bytes for t in TARGETS if t.arch == arch)
    assert all(r["fits"] and r["shared_bytes"] <= limit for r in rows)
    assert len(rows) >= 20, len(rows)
