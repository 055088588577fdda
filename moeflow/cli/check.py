"""`moeflow check`: validate a configuration on this machine; print the plan or the coded error."""
from __future__ import annotations

from ..capabilities import Environment
from ..planner import plan
from .common import add_layer_args, config_from_args


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="validate a configuration on this machine and print the plan")
    add_layer_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    cfg = config_from_args(args)  # MF1xx errors surface here
    env = Environment.detect(cfg.device)
    print(plan(cfg, env))  # MF2xx errors surface here; cli.main prints them with exit code 2
    return 0
