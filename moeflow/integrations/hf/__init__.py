"""Hugging Face transformers integration (optional: ``pip install moeflow[transformers]``).

Three ways to run a transformers MoE model with moeflow:

    import moeflow   # registers "moeflow" with transformers' experts interfaces when they are imported
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moeflow")
    model.set_experts_implementation("moeflow")          # or switch a loaded model
        # routing stays in transformers; the experts (bf16/fp16/fp32, or FP8Experts' 128x128 blocks)
        # run in moeflow on the module's own weights (experts.py)

    replace_moe_blocks(model)                             # router + experts + shared experts in moeflow
        # Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3; other blocks refused with MF702 (blocks.py)

    model = load_fp8_model(path)                          # a fine-grained FP8 checkpoint on any device:
        # experts stay float8_e4m3fn in fp8-block layers, never dequantized (fp8.py)

Importing this package does not import transformers; the functions that need it raise MF701 when it
is missing.
"""
from __future__ import annotations

import importlib

from ... import ops
from ...errors import error
from .blocks import MoeflowBlock, replace_moe_blocks, supported_blocks
from .experts import moeflow_experts_forward, prepare_experts

IMPLEMENTATION = "moeflow"

# transformers module -> the experts interface class it defines
_INTERFACES = {"transformers.integrations.moe": "ExpertsInterface",
               "transformers.integrations.finegrained_fp8": "FP8ExpertsInterface"}


def require_transformers(what: str):
    """Import and return transformers, or raise MF701 naming ``what`` needed it."""
    try:
        return importlib.import_module("transformers")
    except Exception as exc:
        raise error("MF701", what=what, why=f"{type(exc).__name__}: {exc}") from None


def register_module(module_name: str) -> bool:
    """Register "moeflow" with the interface ``module_name`` defines (imported if needed).
    -> False when this transformers version has no such interface."""
    interface = getattr(importlib.import_module(module_name), _INTERFACES[module_name], None)
    if interface is None:
        return False
    interface.register(IMPLEMENTATION, moeflow_experts_forward)
    ops.prepare_tracing()  # an experts module compiled before it is planned: torch.compile's message names the fix
    return True


def register() -> list[str]:
    """Register "moeflow" with every experts interface of the installed transformers (bf16 and FP8).
    ``import moeflow`` already does this lazily; calling it again is harmless. -> interfaces registered."""
    require_transformers("moeflow.integrations.hf.register()")
    done = []
    for module_name, interface in _INTERFACES.items():
        try:
            if register_module(module_name):
                done.append(interface)
        except ImportError:  # an older transformers without this module
            continue
    return done


def load_fp8_model(path, dtype=None, device="cpu", runner: str = "auto", progress=None):
    """Load a fine-grained FP8 checkpoint with moeflow fp8-block experts (see ``fp8.load_fp8_model``)."""
    require_transformers("load_fp8_model()")
    from .fp8 import load_fp8_model as load
    return load(path, dtype=dtype, device=device, runner=runner, progress=progress)


__all__ = ["IMPLEMENTATION", "register", "register_module", "require_transformers", "replace_moe_blocks",
           "supported_blocks", "MoeflowBlock", "prepare_experts", "load_fp8_model", "moeflow_experts_forward"]
