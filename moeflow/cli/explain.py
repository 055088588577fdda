"""`moeflow explain [CODE]`: print an error code's explanation, or list every code."""
from __future__ import annotations

from ..errors import CATALOGUE, explain


def add_parser(sub) -> None:
    p = sub.add_parser("explain", help="explain an error code (no code: list all codes)")
    p.add_argument("code", nargs="?", help="e.g. MF202")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.code:
        print(explain(args.code))
        return 0
    for code, spec in CATALOGUE.items():
        print(f"{code}  {spec.cls.__name__:<18} {spec.title}")
    return 0
