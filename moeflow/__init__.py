"""moeflow: the Mixture-of-Experts layer for LLM inference, every accepted combination of
quantization scheme × expert runner × token dispatcher working and tested, every refused one
refused at construction with a coded error.

    from moeflow import MoE
    moe = MoE(num_experts=8, hidden_size=4096, intermediate_size=14336, top_k=2, device="cuda")
    y = moe(x, router_logits)
"""
from .config import MoEConfig
from .errors import MoeflowError
from .layer import MoE
from .layouts import ExpertBatch
from .planner import Plan
from .integrations import install_import_hooks as _install_import_hooks

_install_import_hooks()  # "moeflow" joins transformers' experts interfaces when transformers loads them

__version__ = "0.1.0"
__all__ = ["MoE", "MoEConfig", "MoeflowError", "ExpertBatch", "Plan", "__version__"]
