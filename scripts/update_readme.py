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


def sections() -> dict[str, str]:
    codes = ["| code | raised as | meaning |", "|---|---|---|"]
    codes += [f"| {c} | {s.builtin.__name__} | {s.title} |" for c, s in CATALOGUE.items()]
    return {"MATRIX": _cli("matrix", "--standard", "--markdown"), "ERRORS": "\n".join(codes)}


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
