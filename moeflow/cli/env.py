"""`moeflow env`: the environment variables moeflow reads, their values and defaults; a value moeflow cannot read is
shown with its MF107 error, and the command then exits 2."""
from __future__ import annotations

import sys

from .. import env as moeflow_env
from ..errors import MoeflowError


def add_parser(sub) -> None:
    p = sub.add_parser("env", help="list the environment variables moeflow reads")
    p.set_defaults(func=run)


def run(args) -> int:
    bad = 0
    for var in moeflow_env.ALL:
        print(f"{var.name}={var.get()!r} (default {var.default!r})\n    {var.help}")
        try:
            var.read()
        except MoeflowError as exc:
            print(f"    invalid: {exc}")
            bad += 1
    if bad:
        print(f"moeflow env: {bad} variable(s) hold a value moeflow cannot read", file=sys.stderr)
        return 2
    return 0
