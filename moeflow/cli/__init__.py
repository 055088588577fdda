"""The ``moeflow`` command line. One module per subcommand; each exposes ``add_parser(subparsers)``
which registers its parser and sets ``func`` (called with the parsed args, returns an exit code).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..errors import MoeflowError

# subcommand modules, in the order `moeflow --help` lists them
COMMANDS = ("matrix", "check", "selftest", "explain", "bench", "env", "generate", "tune")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeflow", description="MoE layer for LLM inference: plans, checks, benchmarks.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MoeflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left early (`moeflow explain | head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot raise again
        return 141  # 128 + SIGPIPE, what a shell reports for a writer its pipe's reader left


if __name__ == "__main__":
    sys.exit(main())
