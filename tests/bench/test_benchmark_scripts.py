"""The maintained benchmark scripts (benchmarks/: bench_layer.py, bench_ep.py, bench_hf.py, compare_runs.py,
anchor_sglang.py, portable_report.py and gpu_run.sh) run only on a GPU machine, so a renamed helper or a broken option would otherwise go unseen until then:
every `from moeflow... import name` in them resolves, each Python script parses its options (--help), and
gpu_run.sh parses, selects its steps by name and leaves its output as the GPU machine can return it. eplb_sim.py (a CPU
simulation) is held to the same checks."""
import ast
import importlib
import importlib.util
import os
import pathlib
import subprocess
import sys
import tarfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "benchmarks").rglob("*.py"))
GPU_RUN = ROOT / "benchmarks" / "gpu_run.sh"


def test_only_the_maintained_scripts_are_left():
    assert [p.name for p in SCRIPTS] == ["anchor_sglang.py", "bench_ep.py", "bench_hf.py", "bench_layer.py",
                                         "compare_runs.py", "eplb_sim.py", "portable_report.py"]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_script_imports_resolve(path):
    pytest.importorskip("triton")
    missing = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "moeflow":
            module = importlib.import_module(node.module)
            missing += [f"{node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)
                        and not (hasattr(module, "__path__") and importlib.util.find_spec(f"{node.module}.{a.name}"))]
    assert not missing, f"{path.name} imports names moeflow no longer has: {missing}"


@pytest.mark.parametrize("script,options", [
    ("bench_layer.py", ["--presets", "--schemes", "--runners", "--tokens", "--out", "--deadline-s"]),
    ("anchor_sglang.py", ["--presets", "--schemes", "--tokens", "--out", "--anchor-dir", "--deadline-s"]),
    ("portable_report.py", ["--hopper", "--portable", "--weight-only", "--anchor"]),
    ("bench_ep.py", ["--tokens", "--skip", "--profile", "--small", "--out"]),
    ("bench_hf.py", ["--impls", "--prefill", "--decode", "--commit", "--small", "--out"]),
    ("eplb_sim.py", ["--tokens", "--seed", "--out"]),
])
@pytest.mark.slow
def test_script_parses_its_options(script, options):
    """--help imports the script (moeflow, torch; transformers for bench_hf) and exits before any GPU work."""
    pytest.importorskip("triton")
    if script == "bench_hf.py":
        pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert all(o in done.stdout for o in options), done.stdout


def test_gpu_run_parses():
    subprocess.run(["bash", "-n", str(GPU_RUN)], check=True)


def test_gpu_run_without_selected_steps_leaves_returnable_output(tmp_path):
    """With no step selected (ONLY matches none), the script still writes its summary, the packed results and the
    Triton cache's parts under $OUT: at most 8 files, none named with '=' or ','."""
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), ONLY="^no-such-step$", MOEFLOW_COMMIT="abc1234",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    done = subprocess.run(["bash", str(GPU_RUN)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    names = sorted(p.name for p in out.iterdir())
    assert "results.tgz" in names and "summary.txt" in names and len(names) <= 8, names
    assert not any("=" in n or "," in n for n in names), names
    summary = (out / "summary.txt").read_text()
    assert summary.startswith("commit abc1234, ") and "skipped" not in summary
    with tarfile.open(out / "results.tgz") as tar:
        assert "./summary.txt" in tar.getnames()
