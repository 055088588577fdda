"""Hugging Face transformers integration (optional: ``pip install moeflow[transformers]``). Importing this package
does not import transformers; the functions that need it raise MF701 when it is missing. Three ways in:

    import moeflow   # registers "moeflow" with transformers' experts interfaces when they are imported
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moeflow")
    model.set_experts_implementation("moeflow")   # or switch a loaded model: routing stays in transformers (experts.py)
    replace_moe_blocks(model)                     # router + experts + shared experts in moeflow (blocks.py)
    model = load_fp8_model(path)                  # fine-grained FP8 checkpoint, any device, experts stay FP8 (fp8.py)
"""
from __future__ import annotations

import importlib

from ... import ops
from .blocks import MoeflowBlock, replace_moe_blocks, supported_blocks
from .experts import moeflow_experts_forward, prepare_experts
from .requires import require_transformers

IMPLEMENTATION = "moeflow"

# transformers module -> the experts interface class it defines
_INTERFACES = {"transformers.integrations.moe": "ExpertsInterface",
               "transformers.integrations.finegrained_fp8": "FP8ExpertsInterface"}


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
