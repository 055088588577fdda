"""`moeflow matrix`: the capability matrix, computed from the registry by the planner.

Each cell is "✓" (the planner builds it; on a GPU whose kernels are only compiled-for, not run: "✓ compiled"; FP8
weights with unquantized activations: "w8") or the error code that refuses it. docs/reference.md's matrix is this
command's ``--standard --markdown`` output (a test keeps them equal).
"""
from __future__ import annotations

import argparse

from ..capabilities import Environment
from ..config import device_named
from ..dispatch import DISPATCHERS
from ..planner import matrix, plan
from ..presets import preset_config
from .common import int_at_least

# the environments the README documents: (title, Environment)
STANDARD = (
    ("CPU, one process", Environment("cpu", None, 1)),
    ("CPU, expert-parallel (gloo, 2+ ranks)", Environment("cpu", None, 2)),
    ("CUDA sm_90 (H100/H200), one process", Environment("cuda", (9, 0), 1)),
    ("CUDA sm_90, expert-parallel (NCCL, 2+ ranks)", Environment("cuda", (9, 0), 2)),
    ("CUDA sm_80 (A100), one process: FP8 schemes weight-only (no FP8 tensor cores)", Environment("cuda", (8, 0), 1)),
    ("CUDA sm_89 (L4, L40S, RTX 4090), one process", Environment("cuda", (8, 9), 1)),
    ("CUDA sm_100 (B200), one process", Environment("cuda", (10, 0), 1)),
    ("CUDA sm_120 (RTX 5090), one process", Environment("cuda", (12, 0), 1)),
    ("CUDA sm_75 (T4), one process: no kernels built for it", Environment("cuda", (7, 5), 1)),
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
    cells = {(s, r, d): _mark(template.replace(quant=s, runner=r, dispatcher=d), env, status)
             for s, r, d, status in matrix(template, env)}
    dispatchers = DISPATCHERS.names()
    header = ["quant", "runner", *dispatchers]
    rows = []
    for (s, r) in dict.fromkeys((s, r) for s, r, _ in cells):
        rows.append([s, r, *(cells[(s, r, d)] for d in dispatchers)])
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
        lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in [header, *rows]]
    return "\n".join(lines)


def _mark(cfg, env: Environment, status: str) -> str:
    """A cell's text: the refusing code, or ✓ with its grade (Plan.unvalidated: "compiled") and "w8" for weight-only
    FP8 (Plan.weight_only)."""
    if status != "ok":
        return status
    planned = plan(cfg, env)
    return "✓" + (" compiled" if planned.unvalidated else "") + (" w8" if planned.weight_only else "")


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
    note = (f"(cells checked at preset {args.preset!r}, dtype {args.dtype}; ✓: built and validated on such a GPU; "
            "✓ compiled: its kernels compiled and checked for that GPU, not run on one (`moeflow selftest` checks it); "
            "w8: FP8 weights, activations in the layer dtype; `moeflow explain CODE` explains a refusal)")
    print("\n\n".join(blocks) + "\n\n" + note)
    return 0
