"""Arguments shared by the subcommands that build a layer configuration."""
from __future__ import annotations

import argparse
import os

import torch

from ..config import MoEConfig
from ..presets import PRESETS, preset_config


def add_layer_args(p: argparse.ArgumentParser, default_preset: str = "small") -> None:
    g = p.add_argument_group("layer")
    g.add_argument("--preset", default=default_preset, help=f"model shape: {', '.join(PRESETS)} (default {default_preset})")
    g.add_argument("--experts", type=int_at_least(1), help="override num_experts")
    g.add_argument("--hidden", type=int_at_least(1), help="override hidden_size")
    g.add_argument("--inter", type=int_at_least(1), help="override intermediate_size")
    g.add_argument("--topk", type=int_at_least(1), help="override top_k")
    g.add_argument("--quant", default="none", help="none | fp8-tensor | fp8-channel | fp8-block")
    g.add_argument("--runner", default="auto")
    g.add_argument("--dispatcher", default="auto")
    g.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | float32")
    g.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")


def int_at_least(low: int):
    """argparse type: an integer >= low (a bad value is argparse's usage error, exit 2, before anything runs)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


def int_list(low: int):
    """argparse type: comma-separated integers >= low ("1,16,128") -> list[int]."""
    one = int_at_least(low)

    def parse(text: str) -> list[int]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError("no value given")
        return [one(t) for t in items]
    parse.__name__ = f"comma-separated integers >= {low}"
    return parse


def writable_path(text: str) -> str:
    """argparse type: an output file whose directory exists or can be made now (not after a long run)."""
    parent = os.path.dirname(os.path.abspath(text))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {exc.strerror}") from None
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: its directory is not writable")
    return text


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def config_from_args(args, **overrides) -> MoEConfig:
    sizes = {k: v for k, v in (("num_experts", args.experts), ("hidden_size", args.hidden),
                               ("intermediate_size", args.inter), ("top_k", args.topk)) if v is not None}
    fields = dict(quant=args.quant, runner=args.runner, dispatcher=args.dispatcher, dtype=args.dtype,
                  device=args.device or default_device())
    fields.update(sizes)
    fields.update(overrides)
    return preset_config(args.preset, **fields)
