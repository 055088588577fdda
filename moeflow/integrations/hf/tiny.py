"""Small random-weight models of the five supported families, built from configs (nothing is
downloaded), and a byte-level tokenizer for them.

``tiny_model("qwen3_moe")`` is a two-layer model that runs in milliseconds on a CPU; tests save it
with ``save_pretrained`` and reload it. ``tiny_model("qwen3_moe", size="small")`` is the model
``moeflow generate`` builds when no --model is given. Weights are drawn with a larger standard
deviation than transformers' default (0.02), so that router scores and logits are not nearly flat
and a comparison between implementations means something; DeepSeek-V3's correction bias is random.
"""
from __future__ import annotations

import torch

from ...errors import error
from .requires import require_transformers

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")
VOCAB = 260  # 256 bytes + bos/eos/pad/unk: the ByteTokenizer's ids fit

# hidden, layers, heads, head_dim, experts, top_k, expert intermediate
_SIZES = {"tiny": (64, 2, 4, 16, 8, 2, 32), "fp8": (128, 2, 4, 32, 4, 2, 128), "small": (256, 4, 4, 64, 16, 4, 128)}


def tiny_config(family: str, size: str = "tiny", **overrides):
    """A transformers config of ``family`` (one of FAMILIES) at ``size`` ("tiny", "fp8": hidden and
    intermediate sizes multiples of 128, "small")."""
    transformers = require_transformers("tiny_config()")
    h, layers, heads, hd, e, k, i = _SIZES[size]
    common = dict(vocab_size=VOCAB, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=heads // 2, max_position_embeddings=512, initializer_range=0.1,
                  num_experts_per_tok=k, tie_word_embeddings=False, bos_token_id=256, eos_token_id=257,
                  pad_token_id=258)
    if family == "mixtral":
        cfg = transformers.MixtralConfig(**common, head_dim=hd, intermediate_size=i, num_local_experts=e)
    elif family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**common, intermediate_size=2 * i, moe_intermediate_size=i, num_experts=e,
                                          shared_expert_intermediate_size=i, norm_topk_prob=False)
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=hd, intermediate_size=2 * i, moe_intermediate_size=i,
                                          num_experts=e, norm_topk_prob=True)
    elif family == "olmoe":
        cfg = transformers.OlmoeConfig(**common, intermediate_size=i, num_experts=e, norm_topk_prob=False)
    elif family == "deepseek_v3":
        common["num_key_value_heads"] = heads
        cfg = transformers.DeepseekV3Config(
            **common, intermediate_size=2 * i, moe_intermediate_size=i, n_routed_experts=e, n_shared_experts=1,
            n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
            kv_lora_rank=hd, q_lora_rank=2 * hd, qk_rope_head_dim=hd // 2, qk_nope_head_dim=hd // 2, v_head_dim=hd)
    else:
        raise error("MF102", field="family", value=family, valid=list(FAMILIES))
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


@torch.no_grad()
def tiny_model(family: str, size: str = "tiny", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A random-weight causal LM of ``family`` in eval mode (see tiny_config)."""
    transformers = require_transformers("tiny_model()")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, size, **overrides), dtype=dtype)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.rand_like(buf) * 0.2)
    return model.eval()


class ByteTokenizer:
    """Text <-> ids: UTF-8 bytes are ids 0..255; 256 bos, 257 eos, 258 pad, 259 unk.

    The tokenizer of the random-weight models (a real checkpoint brings its own); generated ids
    that are not bytes decode to nothing.
    """

    bos_token_id, eos_token_id, pad_token_id = 256, 257, 258

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id, *text.encode("utf-8")]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")
