"""Arguments shared by the subcommands that build a layer configuration."""
from __future__ import annotations

import argparse

import torch

from ..config import MoEConfig
from ..presets import PRESETS, preset_config


def add_layer_args(p: argparse.ArgumentParser, default_preset: str = "small") -> None:
    g = p.add_argument_group("layer")
    g.add_argument("--preset", default=default_preset, help=f"model shape: {', '.join(PRESETS)} (default {default_preset})")
    g.add_argument("--experts", type=int, help="override num_experts")
    g.add_argument("--hidden", type=int, help="override hidden_size")
    g.add_argument("--inter", type=int, help="override intermediate_size")
    g.add_argument("--topk", type=int, help="override top_k")
    g.add_argument("--quant", default="none", help="none | fp8-tensor | fp8-channel | fp8-block")
    g.add_argument("--runner", default="auto")
    g.add_argument("--dispatcher", default="auto")
    g.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | float32")
    g.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")


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
