"""Tiny fine-grained FP8 checkpoints for the transformers tests (test_hf_fp8.py, gpu/test_gpu_hf.py): a saved tiny
model quantized here (plain torch, independent of moeflow's quantizer) to float8_e4m3fn weights with 128x128
weight_scale_inv, beside its dequantized twin. Expert weights are rescaled per expert and per projection before
quantizing, so a scale stacked onto the wrong expert or the wrong half of gate_up_proj shows as a large error."""
import json
import shutil

import torch

PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def quantize_blocks(w):
    """[N, K] -> (fp8 [N, K], scale [N/128, K/128] float32 = amax/448, dequantized [N, K] float32)."""
    n, k = w.shape
    scale = w.float().abs().reshape(n // 128, 128, k // 128, 128).amax(dim=(1, 3)).clamp(min=1e-12) / 448
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    q = (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def _quantizable(name, t):
    return (name.endswith(".weight") and t.dim() == 2 and t.shape[0] % 128 == 0 and t.shape[1] % 128 == 0
            and "embed" not in name and "lm_head" not in name and not name.endswith(".gate.weight"))


def write_fp8_checkpoint(root, family):
    """-> (fp8 dir, dequantized twin dir, {checkpoint name: tensor} of the FP8 files), written under ``root``."""
    import safetensors.torch as safetensors_torch

    from moeflow.integrations.hf.tiny import tiny_model
    tiny_model(family, size="fp8").save_pretrained(root / "src")
    state = safetensors_torch.load_file(root / "src" / "model.safetensors")
    quant, deq = {}, {}
    for name, t in state.items():
        parts = name.split(".")
        if "experts" in parts and parts[-2] in PROJ:  # routed expert: rescale per expert and projection
            e = int(parts[parts.index("experts") + 1])
            t = t * {"gate": 1 + e / 2, "up": 0.5, "down": 2 / (1 + e / 2)}[PROJ[parts[-2]]]
        if _quantizable(name, t):
            q, s, d = quantize_blocks(t)
            quant[name], quant[name + "_scale_inv"], deq[name] = q, s, d
        else:
            quant[name] = deq[name] = t
    for sub, tensors in (("fp8", quant), ("deq", deq)):
        shutil.copytree(root / "src", root / sub)
        safetensors_torch.save_file(tensors, root / sub / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((root / "fp8" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128],
                                  "activation_scheme": "dynamic"}
    (root / "fp8" / "config.json").write_text(json.dumps(cfg))
    return root / "fp8", root / "deq", quant
