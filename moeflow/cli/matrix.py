"""`moeflow matrix`: the capability matrix, computed from the registry by the planner.

Each cell is "✓" (the planner builds it) or the error code that refuses it. The README's matrix
is this command's ``--standard --markdown`` output (a test keeps them equal).
"""
from __future__ import annotations

import argparse

from ..capabilities import Environment
from ..config import device_named
from ..dispatch import DISPATCHERS
from ..planner import matrix
from ..presets import preset_config
from .common import int_at_least

# the environments the README documents: (title, Environment)
STANDARD = (
    ("CPU, one process", Environment("cpu", None, 1)),
    ("CPU, expert-parallel (gloo, 2+ ranks)", Environment("cpu", None, 2)),
    ("CUDA sm_90 (H100/H200), one process", Environment("cuda", (9, 0), 1)),
    ("CUDA sm_90, expert-parallel (NCCL, 2+ ranks)", Environment("cuda", (9, 0), 2)),
    ("CUDA sm_80 (A100), one process", Environment("cuda", (8, 0), 1)),
    ("CUDA sm_100 (B200), one process: newer than the GPU runners were validated on", Environment("cuda", (10, 0), 1)),
)


def add_parser(sub) -> None:
    p = sub.add_parser("matrix", help="print the capability matrix (each cell ✓ or its error code)")
    p.add_argument("--device", default="cpu",
                   help="cpu | cuda | cuda:N: the device type the cells are checked for; a CUDA one need not be "
                        "on this machine (default cpu)")
    p.add_argument("--cc", type=_capability, default=(9, 0),
                   help="compute capability of the CUDA device (--device cuda or cuda:N; default 9.0)")
    p.add_argument("--world-size", type=int_at_least(1), default=1, help="expert-parallel ranks (default 1)")
    p.add_argument("--preset", default="small", help="shape the cells are checked at (default small)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--standard", action="store_true", help="all environments the README documents")
    p.add_argument("--markdown", action="store_true", help="markdown tables")
    p.set_defaults(func=run)


def _capability(text: str) -> tuple[int, int]:
    """argparse type: "9.0" -> (9, 0)."""
    major, dot, minor = text.partition(".")
    if not (major.isdigit() and minor.isdigit() and dot):
        raise argparse.ArgumentTypeError(f"{text!r} is not a compute capability such as 9.0")
    return int(major), int(minor)


def render(env: Environment, preset: str, dtype: str, markdown: bool) -> str:
    template = preset_config(preset, dtype=dtype)
    cells = {(s, r, d): status for s, r, d, status in matrix(template, env)}
    dispatchers = DISPATCHERS.names()
    header = ["quant", "runner", *dispatchers]
    rows = []
    for (s, r) in dict.fromkeys((s, r) for s, r, _ in cells):
        rows.append([s, r, *("✓" if cells[(s, r, d)] == "ok" else cells[(s, r, d)] for d in dispatchers)])
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
        lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in [header, *rows]]
    return "\n".join(lines)


def run(args) -> int:
    if args.standard:
        envs = STANDARD
    else:
        kind = device_named(args.device).type  # not parse_device: the matrix describes any machine from this one
        env = Environment(kind, args.cc if kind == "cuda" else None, args.world_size)
        envs = ((env.describe(), env),)
    blocks = []
    for title, env in envs:
        heading = f"**{title}**" if args.markdown else f"== {title} =="
        blocks.append(f"{heading}\n\n{render(env, args.preset, args.dtype, args.markdown)}")
    note = (f"(cells checked at preset {args.preset!r}, dtype {args.dtype}; "
            "`moeflow explain CODE` explains a refusal)")
    print("\n\n".join(blocks) + "\n\n" + note)
    return 0
