"""Arguments shared by the subcommands that build a layer configuration."""
from __future__ import annotations

import argparse
import os
import tempfile

import torch

from ..config import MoEConfig
from ..presets import PRESETS, preset_config


def add_layer_args(p: argparse.ArgumentParser, default_preset: str = "small", runner: bool = True) -> None:
    """The layer's options (config_from_args reads them); runner=False: no --runner (bench names its own)."""
    g = p.add_argument_group("layer")
    g.add_argument("--preset", default=default_preset, help=f"model shape: {', '.join(PRESETS)} (default {default_preset})")
    g.add_argument("--experts", type=int_at_least(1), help="override num_experts")
    g.add_argument("--hidden", type=int_at_least(1), help="override hidden_size")
    g.add_argument("--inter", type=int_at_least(1), help="override intermediate_size")
    g.add_argument("--topk", type=int_at_least(1), help="override top_k")
    g.add_argument("--quant", default="none", help="none | fp8-tensor | fp8-channel | fp8-block")
    if runner:
        g.add_argument("--runner", default="auto")
    g.add_argument("--dispatcher", default="auto")
    g.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | float32")
    g.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="MoEConfig.batch_invariant: a token's output the same bits whatever batch it came in")


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
    """argparse type: an output file that can be written after a long run, checked now: not a directory, not a file
    that cannot be written, and its directory either writable or possible to make (made only when the file is
    written: make_parent)."""
    path = os.path.abspath(text)
    if text.endswith(("/", os.sep)) or os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: it names a directory, not a file")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: the file is not writable")
    parent = os.path.dirname(path)
    if os.path.isdir(parent):
        if not os.access(parent, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"cannot write {text!r}: its directory is not writable")
        return text
    existing = parent
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {existing!r} is a file, not a directory")
    try:  # try to make a directory where the missing ones would go, and remove it: os.access says yes to root on /proc
        os.rmdir(tempfile.mkdtemp(prefix=".moeflow-", dir=existing))
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: cannot make directories in {existing!r}: "
                                         f"{exc.strerror}") from None
    return text


def make_parent(path: str) -> str:
    """Make the directories an output file (a writable_path) goes in; -> path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def config_from_args(args, **overrides) -> MoEConfig:
    sizes = {k: v for k, v in (("num_experts", args.experts), ("hidden_size", args.hidden),
                               ("intermediate_size", args.inter), ("top_k", args.topk)) if v is not None}
    fields = dict(quant=args.quant, runner=vars(args).get("runner", "auto"), dispatcher=args.dispatcher,
                  dtype=args.dtype, device=args.device or default_device(),
                  batch_invariant=vars(args).get("batch_invariant", False))
    fields.update(sizes)
    fields.update(overrides)
    return preset_config(args.preset, **fields)
