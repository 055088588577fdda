"""`moeflow env`: the environment variables moeflow reads, their values and defaults."""
from __future__ import annotations

from .. import env as moeflow_env


def add_parser(sub) -> None:
    p = sub.add_parser("env", help="list the environment variables moeflow reads")
    p.set_defaults(func=run)


def run(args) -> int:
    for var in moeflow_env.ALL:
        print(f"{var.name}={var.get()!r} (default {var.default!r})\n    {var.help}")
    return 0
