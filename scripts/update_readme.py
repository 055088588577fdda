"""Regenerate the generated sections of README.md from the code (capability matrix, error codes).

    python scripts/update_readme.py          # rewrite README.md in place
    python scripts/update_readme.py --check  # exit 1 if README.md is stale (tests/test_readme.py does this)
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


def _cli(*argv: str) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        cli_main(list(argv))
    return buf.getvalue().strip()


def tolerance_table() -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    from tolerances import REL_TOL  # noqa: E402 (the one table, in tests/)

    dtypes = ["float32", "float16", "bfloat16"]
    keys = list(dict.fromkeys(k for k, _ in REL_TOL))
    lines = ["| scheme | " + " | ".join(dtypes) + " |", "|---|" + "---|" * len(dtypes)]
    for key in keys:
        cells = [f"{REL_TOL[(key, d)]:g}" if (key, d) in REL_TOL else "—"
                 for d in (getattr(__import__("torch"), n) for n in dtypes)]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sections() -> dict[str, str]:
    codes = ["| code | raised as | meaning |", "|---|---|---|"]
    codes += [f"| {c} | {s.builtin.__name__} | {s.title} |" for c, s in CATALOGUE.items()]
    return {"MATRIX": _cli("matrix", "--standard", "--markdown"), "ERRORS": "\n".join(codes),
            "TOLERANCES": tolerance_table()}


def render(text: str) -> str:
    for name, body in sections().items():
        start, end = f"<!-- BEGIN {name} (generated: scripts/update_readme.py) -->", f"<!-- END {name} -->"
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{start}\n{body}\n{end}{tail}"
    return text


if __name__ == "__main__":
    path = ROOT / "README.md"
    old = path.read_text()
    new = render(old)
    if "--check" in sys.argv:
        sys.exit(0 if new == old else 1)
    path.write_text(new)
