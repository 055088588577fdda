"""Model shapes used by the command line and the benchmarks (routed experts only, unsharded)."""
from __future__ import annotations

from .config import MoEConfig
from .errors import error

PRESETS: dict[str, dict] = {
    # small: finishes `moeflow bench` in seconds on a 2-core CPU; fp8-block-compatible sizes
    "small": dict(num_experts=8, hidden_size=256, intermediate_size=128, top_k=2),
    "qwen3-30b-a3b": dict(num_experts=128, hidden_size=2048, intermediate_size=768, top_k=8),
    "deepseek-v3": dict(num_experts=256, hidden_size=7168, intermediate_size=2048, top_k=8, scoring="sigmoid",
                        num_expert_groups=8, topk_groups=4, use_correction_bias=True, routed_scaling_factor=2.5),
    "mixtral-8x7b": dict(num_experts=8, hidden_size=4096, intermediate_size=14336, top_k=2),
}


def preset_config(name: str, **overrides) -> MoEConfig:
    if name not in PRESETS:
        raise error("MF601", name=name, valid=list(PRESETS))
    return MoEConfig(**{**PRESETS[name], **overrides})
