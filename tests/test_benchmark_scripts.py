"""The benchmark and experiment scripts (benchmarks/, run on a GPU through the device tool) still name what
moeflow has: every `from moeflow... import name` in them resolves. They run only on a GPU, so a renamed
helper would otherwise break them unseen until a device call (9d6da12 renamed autotune._runner; eight scripts
still imported it)."""
import ast
import importlib
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").rglob("*.py"))


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
