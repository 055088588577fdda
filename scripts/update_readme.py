"""Regenerate the generated sections of the documentation from the code.

    python scripts/update_readme.py          # rewrite docs/reference.md and README.md in place
    python scripts/update_readme.py --check  # exit 1 if either is stale (tests/test_readme.py does this)

A generated section sits between two markers in a document:

    <!-- BEGIN NAME (generated: scripts/update_readme.py) -->
    ...
    <!-- END NAME -->

docs/reference.md holds the references (MATRIX: the capability matrix, ERRORS: the error codes, ENV: the
environment variables, TOLERANCES: the test tolerances); README.md holds RUNS, the compact table of which runner
runs which scheme and dtype on which device. Every section must appear in one of the documents.
"""
from __future__ import annotations

import contextlib
import io
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moeflow.cli import main as cli_main  # noqa: E402
from moeflow.errors import CATALOGUE  # noqa: E402

DOCUMENTS = ("README.md", "docs/reference.md")
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _cli(*argv: str) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        cli_main(list(argv))
    return buf.getvalue().strip()


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _tolerances() -> dict:
    """REL_TOL, the one tolerance table (moeflow/tolerances.py; tests/tolerances.py re-exports it)."""
    from moeflow.tolerances import REL_TOL
    return REL_TOL


def tolerance_table() -> str:
    import torch

    rel_tol = _tolerances()
    dtypes = ["float32", "float16", "bfloat16"]
    keys = list(dict.fromkeys(k for k, _ in rel_tol))
    lines = ["| scheme | " + " | ".join(dtypes) + " |", "|---|" + "---|" * len(dtypes)]
    for key in keys:
        cells = [f"{rel_tol[(key, d)]:g}" if (key, d) in rel_tol else "—"
                 for d in (getattr(torch, n) for n in dtypes)]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def error_table() -> str:
    lines = ["| code | raised as | meaning |", "|---|---|---|"]
    lines += [f"| {c} | {s.builtin.__name__} | {_cell(s.title)} |" for c, s in CATALOGUE.items()]
    return "\n".join(lines)


def env_table() -> str:
    from moeflow import env

    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for var in env.ALL:
        default = f"`{var.default}`" if var.default else "—"
        lines.append(f"| `{var.name}` | {default} | {_cell(var.help)} |")
    return "\n".join(lines)


def runs_table() -> str:
    """Which runner runs which scheme, in which layer dtypes, on which device (one process, local dispatcher):
    computed by the planner, as `moeflow matrix` is. A cell lists the dtypes accepted, or the code refusing all
    three; schemes with the same cells share a row."""
    from moeflow.capabilities import Environment
    from moeflow.experts import RUNNERS
    from moeflow.planner import matrix
    from moeflow.presets import preset_config

    devices = (("CPU", Environment("cpu", None, 1)),
               ("CUDA sm_90 (Hopper)", Environment("cuda", (9, 0), 1)),
               ("CUDA sm_80 (Ampere)", Environment("cuda", (8, 0), 1)),
               ("CUDA sm_89 (Ada)", Environment("cuda", (8, 9), 1)),
               ("CUDA sm_120 (Blackwell)", Environment("cuda", (12, 0), 1)))
    status = {}  # (runner, scheme, device) -> {dtype: "ok" | code}
    for dtype in SHORT:
        template = preset_config("small", dtype=dtype)
        for title, environment in devices:
            for scheme, runner, dispatcher, st in matrix(template, environment):
                if dispatcher == "local":
                    status.setdefault((runner, scheme, title), {})[dtype] = st
    schemes = list(dict.fromkeys(s for _, s, _ in status))

    def cell(runner, scheme, title):
        by_dtype = status[(runner, scheme, title)]
        ok = [SHORT[d] for d, st in by_dtype.items() if st == "ok"]
        return ", ".join(ok) if ok else next(iter(by_dtype.values()))

    lines = ["| runner | schemes | " + " | ".join(t for t, _ in devices) + " |",
             "|---|---|" + "---|" * len(devices)]
    for runner in reversed(RUNNERS.names()):  # highest priority first, as "auto" picks
        if not any(r == runner for r, _, _ in status):
            continue
        rows: dict[tuple, list[str]] = {}
        for scheme in schemes:
            rows.setdefault(tuple(cell(runner, scheme, t) for t, _ in devices), []).append(scheme)
        for cells, names in rows.items():
            label = "all four" if len(names) == len(schemes) else ", ".join(names)
            lines.append(f"| `{runner}` | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gpus_table() -> str:
    """The GPU architectures the Triton kernels are built for (moeflow.targets): what runs there and how it was
    checked."""
    from moeflow.targets import TARGETS

    lines = ["| family | arch | GPUs | Triton runner | FP8 checkpoints | shared memory (tiles) | checked |",
             "|---|---|---|---|---|---|---|"]
    for t in TARGETS:
        kernels = "Hopper kernels (TMA, wgmma, warp-specialized)" if t.gluon else \
            "portable kernels" + (" + TMA" if t.tma else "")
        fp8 = "FP8 tensor cores" if t.fp8_dots else "weight-only (dequantized in the GEMMs)"
        grade = "validated (GPU suite, `moeflow selftest`)" if t.validated else "compiled (CI); its rules run on an H100"
        lines.append(f"| {t.family} | {t.arch} | {t.gpus} | {kernels} | {fp8} | {t.shared_bytes // 1024} KB "
                     f"({t.tile_budget // 1024} KB) | {grade} |")
    return "\n".join(lines)


SECTIONS = {"RUNS": runs_table, "GPUS": gpus_table, "MATRIX": lambda: _cli("matrix", "--standard", "--markdown"),
            "ERRORS": error_table, "ENV": env_table, "TOLERANCES": tolerance_table}


def markers(name: str) -> tuple[str, str]:
    return f"<!-- BEGIN {name} (generated: scripts/update_readme.py) -->", f"<!-- END {name} -->"


def render(text: str, bodies: dict[str, str]) -> tuple[str, set[str]]:
    """``text`` with every generated section it holds rewritten; and the names of those sections."""
    found = set()
    for name, body in bodies.items():
        start, end = markers(name)
        if start not in text:
            continue
        head, rest = text.split(start, 1)
        if end not in rest:
            raise SystemExit(f"{start} has no {end}")
        _, tail = rest.split(end, 1)
        text = f"{head}{start}\n{body}\n{end}{tail}"
        found.add(name)
    return text, found


def main(argv: list[str]) -> int:
    bodies = {name: make() for name, make in SECTIONS.items()}
    stale, seen = [], set()
    for doc in DOCUMENTS:
        path = ROOT / doc
        old = path.read_text()
        new, found = render(old, bodies)
        seen |= found
        if new != old:
            stale.append(doc)
            if "--check" not in argv:
                path.write_text(new)
    missing = sorted(set(SECTIONS) - seen)
    if missing:
        print(f"no document holds the generated section(s) {missing}", file=sys.stderr)
        return 1
    if "--check" in argv and stale:
        print(f"stale: {', '.join(stale)}: run python scripts/update_readme.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
