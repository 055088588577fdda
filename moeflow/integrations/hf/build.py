"""A tiny random model of any MoE family (families.py), built from its own config class with defaults shrunk.

``shrink(config_class)`` rewrites the default config's sizes by attribute name (SIZES, RULES: hidden 64, 8 experts,
top-2, 4 heads of 16, vocab 256, ...) and keeps a few layers: the first layer of each kind its per-layer lists name
(so an MoE layer is kept), taken at the same indices in every such list. OVERRIDES holds, as data, what a family
needs beyond that. ``tiny_family_model(fam)`` tries the family's model classes (causal LM first, then text models)
and returns the first that builds and holds an MoE layer, with random float32 weights in eval mode.
"""
from __future__ import annotations

import importlib
import inspect
import re

import torch
from torch import nn

from .families import Family

VOCAB, HIDDEN, LAYERS_MAX = 256, 64, 6

SIZES = {  # attribute -> its value in a tiny model, wherever a config has the attribute (and its default is not 0)
    "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB, "hidden_size": HIDDEN, "d_model": HIDDEN,
    "num_attention_heads": 4, "num_key_value_heads": 4, "num_heads": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 4,
    "num_sliding_attention_heads": 4, "head_dim": 16, "swa_head_dim": 16, "kv_channels": 16, "d_kv": 16,
    "kv_lora_rank": 32, "q_lora_rank": 32, "o_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "qk_head_dim": 16, "v_head_dim": 16, "rotary_dim": 8, "mrope_section": [2, 1, 1], "max_position_embeddings": 256,
    "initializer_range": 0.1, "n_group": 2, "num_expert_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "num_shared_experts": 1, "n_shared_experts": 1,
    "zero_expert_num": 2, "index_topk": 4, "index_n_heads": 2, "index_num_heads": 2, "index_head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_heads": 4, "linear_head_dim": 16, "mamba_n_heads": 8, "mamba_num_heads": 8, "mamba_d_head": 16,
    "mamba_head_dim": 16, "mamba_d_state": 16, "ssm_state_size": 16, "mamba_dt_rank": 8, "n_groups": 2,
    "router_hidden_size": 32, "hidden_size_per_layer_input": 16, "part_features": 16, "encoder_layers": 2,
    "decoder_layers": 2, "num_decoder_layers": 2,
}
RULES = [  # (attribute name pattern, value) for the int (or None) attributes SIZES does not name
    (re.compile(r"^(num_experts|n_routed_experts|num_local_experts|moe_num_experts|num_routed_experts)$"), 8),
    (re.compile(r"^(num_experts_per_tok|moe_topk|moe_k|top_k|num_experts_per_token|moe_top_k|top_k_experts)$"), 2),
    (re.compile(r"(intermediate_size|ffn_hidden_size|expert_dim|moe_hidden_size|ffn_dim|^d_ff|intermediate_size_mlp)$"),
     32),
]
OVERRIDES: dict[str, dict] = {  # family -> config fields beyond the rules (applied last; dicts merged), and why
    # transformers' default DbrxAttentionConfig lacks rope_theta, and its clip_qkv=None reaches torch.clamp
    "dbrx": dict(attn_config={"rope_theta": 10000.0, "clip_qkv": 8.0}),
    "deepseek_ocr2": dict(mlp_layer_types=["dense", "sparse"]),  # the text config's default is None
    "ernie4_5_vl_moe": dict(rope_parameters={"mrope_section": [3, 3, 2]}),  # the modeling default: head_dim 128
    "gemma4": dict(enable_moe_block=True),  # the MoE variant (Gemma 4 26B-A4B); the default config is dense
    "glm4v_moe": dict(rope_parameters={"mrope_section": [2, 1, 1]}),  # the modeling default: head_dim 128
    "glm5_next": dict(index_kpool=2),  # index_topk must be a multiple
    "granitemoehybrid": dict(layer_types=["linear_attention", "attention"]),  # default: no attention layer at all
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0),
    "kolibri1_1": dict(index_num_heads=1),  # at most the query heads of one key head
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),  # the default is None
    "mimo_v2_flash": dict(num_key_value_heads=2),  # its sliding layers have twice the key heads
    "qwen4_exp": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                      indexer_compress_ratio=2),  # its default indexed layers need the QSA fields, None by default
    "step3p7": dict(sliding_window=16),  # None by default, yet read
    "zaya": dict(num_experts_per_tok=1),  # top-1 only
}
_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _layers(cfg: dict) -> tuple[str, int]:
    for name in ("num_hidden_layers", "num_layers", "n_layer"):
        if isinstance(cfg.get(name), int):
            return name, cfg[name]
    return "", 0


def _tiny(name: str, value):
    """The tiny value of one config field (nested configs and rope dicts field by field)."""
    if name in SIZES:  # where the default is 0 or False, the family does without (a NoPE attention): kept
        return value if value is not None and not value and not isinstance(value, list) else SIZES[name]
    if isinstance(value, dict):
        return {k: _tiny(k, v) for k, v in value.items()}
    if isinstance(value, bool) or not (value is None or isinstance(value, (int, list))):
        return value
    for pattern, tiny in RULES:
        if pattern.search(name):
            if isinstance(value, list):
                return [tiny] * len(value) if value and all(isinstance(v, int) for v in value) else value
            return tiny
    return value


def _keep_layers(fields: dict, n: int) -> tuple[list[int], dict]:
    """-> (the layer indices kept, the per-layer fields at those indices): the first layer of each value of every
    per-layer list (and of each per_layer_config entry), at most LAYERS_MAX, at least two."""
    per_layer = {k: v for k, v in fields.items() if isinstance(v, (list, tuple)) and len(v) == n and n > 1}
    overrides = {int(i): v for i, v in (fields.get("per_layer_config") or {}).items()}
    columns = [*per_layer.values(), [repr(overrides.get(i)) for i in range(n)]]
    keep = sorted({next(i for i, x in enumerate(v) if x == value) for v in columns for value in v})[:LAYERS_MAX]
    if len(keep) < 2:
        keep = sorted({*keep, 0, 1})
    out = {k: type(v)(v[i] for i in keep) for k, v in per_layer.items()}
    if overrides:
        out["per_layer_config"] = {str(new): {k: _tiny(k, v) for k, v in overrides[old].items()}
                                   for new, old in enumerate(keep) if old in overrides}
    return keep, out


def shrink(config_class, family: str = "", **overrides):
    """A tiny instance of ``config_class`` (see the module docstring); ``overrides``: fields set last."""
    fields = {k: v for k, v in config_class().to_dict().items() if not k.startswith("_")}
    kwargs = {k: _tiny(k, v) for k, v in fields.items() if k != "per_layer_config"}
    kwargs = {k: v for k, v in kwargs.items() if v != fields[k]}
    if "qk_rope_head_dim" in fields and fields.get("head_dim") == fields["qk_rope_head_dim"]:  # MLA: the rotary part
        kwargs["head_dim"] = SIZES["qk_rope_head_dim"]
    layer_key, n = _layers(fields)
    if layer_key:
        keep, per_layer = _keep_layers(fields, n)
        kwargs.update(per_layer, **{layer_key: len(keep)})
    for key, tiny in _TOKEN_IDS.items():
        value = fields.get(key)
        if isinstance(value, int) and value >= VOCAB or isinstance(value, list) and any(v >= VOCAB for v in value):
            kwargs[key] = tiny
    for key, value in {**OVERRIDES.get(family, {}), **overrides}.items():
        old = kwargs.get(key, fields.get(key))
        kwargs[key] = {**old, **value} if isinstance(value, dict) and isinstance(old, dict) else value
    return config_class(**kwargs)


def model_classes(fam: Family) -> list[type]:
    """The family's model classes that a tiny model may be built from, most wanted first: those whose config class
    stands alone (no sub-configs: a vision-language model's text part), then the others; in each, causal LMs, text
    models, other models."""
    from transformers import PreTrainedModel
    classes = {cls for mod in map(importlib.import_module, fam.modules) for cls in vars(mod).values()
               if inspect.isclass(cls) and issubclass(cls, PreTrainedModel) and cls.__module__ == mod.__name__
               and isinstance(cls.config_class, type) and not cls.__name__.endswith("PreTrainedModel")}

    def rank(cls):
        name = cls.__name__
        return (bool(getattr(cls.config_class, "sub_configs", None)), not name.endswith("ForCausalLM"),
                not name.endswith("TextModel"), not name.endswith("Model"), name)
    return sorted(classes, key=rank)


def has_experts(model: nn.Module) -> bool:
    """True when some module of ``model`` holds experts (an ``experts`` attribute that is a module)."""
    return any(isinstance(getattr(m, "experts", None), nn.Module) for m in model.modules())


@torch.no_grad()
def tiny_family_model(fam: Family, seed: int = 0):
    """-> (model, config): the first of ``model_classes(fam)`` that builds with a shrunk config and holds experts;
    float32, eval mode, every constant parameter (norm weights of ones, zero biases) perturbed so that a tensor moeflow
    ignored could not go unnoticed. Raises the first class's build error, or LookupError when none holds experts."""
    errors = []
    for cls in model_classes(fam):
        try:
            cfg = shrink(cls.config_class, fam.name)
            torch.manual_seed(seed)
            model = cls(cfg).float().eval()
        except Exception as exc:  # a class of the family that cannot be built this way: try the next
            errors.append(exc)
            continue
        if has_experts(model):
            for p in model.parameters():
                if p.numel() > 1 and p.is_floating_point() and bool((p == p.flatten()[0]).all()):
                    p.add_(torch.randn_like(p) * 0.1)
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.copy_(torch.rand_like(buf) * 0.2)
            return model, cfg
    if errors:
        raise errors[0]
    raise LookupError(f"{fam.name}: no model class built a model with experts")
