"""load_fp8_model: a fine-grained FP8 checkpoint whose routed experts stay FP8 (moeflow fp8-block) on any device.

Checkpoint format (DeepSeek-V3, Qwen3-*-FP8, transformers' own FP8 quantizer): config.json has
``quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128], ...}``; a quantized Linear weight
``<name>.weight`` [N, K] is float8_e4m3fn, beside ``<name>.weight_scale_inv`` [ceil(N/128), ceil(K/128)] float32
(real ≈ q * scale, per 128x128 block). Routed experts are stored per expert,
``<block>.experts.<e>.{gate_proj|up_proj|down_proj}.weight`` (Mixtral: ``block_sparse_moe.experts.<e>.{w1|w3|w2}``),
or fused as ``<block>.experts.gate_up_proj``. Why a loader of its own: without a GPU, transformers dequantizes such a
checkpoint to bf16 (on a GPU it keeps FP8, and experts_implementation="moeflow" runs FP8Experts: experts.py).
"""
from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from pathlib import Path

import torch
from torch import Tensor

from ...errors import error
from ...quant.fp8_block import BLOCK, FP8Block
from .requires import require_transformers
from .blocks import replace_moe_blocks

_BLOCKS = FP8Block()  # the one definition of 128x128 block dequantization

_PER_EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)"
                         r"\.(?P<kind>weight|weight_scale_inv)$")
_FUSED = re.compile(r"^(?P<block>.+)\.experts\.(?P<name>gate_up_proj|down_proj(?:_scale_inv)?|gate_up_proj_scale_inv)$")
_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_RENAMES = ((".block_sparse_moe.", ".mlp."),)  # Mixtral checkpoint names -> transformers 5 module names


def load_fp8_model(path, dtype=None, device="cpu", runner: str = "auto", progress=None):
    """path: checkpoint directory; dtype: activation / non-expert dtype (default: config's, else
    bfloat16); device: where the model lives; progress: optional callable(done, total, what).
    -> a transformers causal LM in eval mode whose MoE blocks are MoeflowBlocks with fp8-block experts.

      1. the model is built from config.json without its quantization_config, weights uninitialized, the routed
         experts on the meta device (never allocated in the activation dtype);
      2. every other tensor is loaded, FP8 ones dequantized (attention, dense MLPs, shared experts:
         moeflow keeps only the routed experts in FP8);
      3. each block's experts are stacked into gate_up_proj [E, 2I, H] / down_proj [E, H, I] with
         block scales [E, 2I/128, H/128] / [E, H/128, I/128] (gate and up scales stack exactly since
         I is a multiple of 128) and given to replace_moe_blocks: fp8-block layers adopt them as is."""
    transformers = require_transformers("load_fp8_model()")
    root = Path(path)
    files = sorted(root.glob("*.safetensors"))
    if not (root / "config.json").is_file() or not files:
        raise error("MF705", path=str(path), why="expected a directory with config.json and *.safetensors")
    config = transformers.AutoConfig.from_pretrained(root)
    scale_fmt = _check_quantization(config, root)
    dtype = dtype or (config.dtype if isinstance(config.dtype, torch.dtype) else torch.bfloat16)
    experts, rest = _read(files, device, dtype, scale_fmt, root)
    model = _build(transformers, config, dtype, device, {f"{block}.experts" for block in experts})
    result = model.load_state_dict(rest, strict=False)  # host tensors copied into the model's, one at a time
    del rest
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = [k for k in result.missing_keys if ".experts." not in k and k not in tied]
    if missing or result.unexpected_keys:
        raise error("MF705", path=str(path), why=f"names do not match the model: missing {missing[:4]}, "
                                                 f"unexpected {result.unexpected_keys[:4]}")
    stacked = _BlockExperts(experts, str(path), device)
    replaced = replace_moe_blocks(model, runner=runner, dtype=dtype, experts=stacked, progress=progress)
    if set(replaced) != set(stacked):
        raise error("MF705", path=str(path), why=f"expert blocks in the checkpoint {sorted(stacked)[:3]} do not "
                                                 f"match the model's MoE blocks {sorted(replaced)[:3]}")
    unbuilt = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if unbuilt:  # nothing is left on meta by the names above; a model class that does so is refused, not half-built
        raise error("MF705", path=str(path), why=f"tensors left without memory after loading: {unbuilt[:4]}")
    return model.eval()


def _build(transformers, config, dtype, device, routed: set[str]):
    """The model of config.json with memory on ``device`` for everything but the routed experts (``routed``: their
    module paths), which stay on the meta device: their blocks are replaced by layers holding the checkpoint's FP8
    experts, so the model never holds them in the activation dtype (Qwen3-30B-A3B: 54 GiB in bf16). Built on meta,
    then given memory module by module, uninitialized (the checkpoint is loaded into it next); the non-persistent
    buffers, which no checkpoint holds (rotary inv_freq), are computed by the model's own initializer, as
    transformers' from_pretrained does; tied weights are tied again."""
    with torch.device("meta"), _no_init(transformers):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    for name, module in model.named_modules():
        if not any(name == r or name.startswith(r + ".") for r in routed):
            module.to_empty(device=device, recurse=False)
    unset = []
    for prefix, module in model.named_modules():
        own = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None]
        if own:
            for n in own:  # NaN until computed: a transformers that leaves one uncomputed is refused, not run
                if module._buffers[n].is_floating_point():
                    module._buffers[n].fill_(float("nan"))
            model._init_weights(module)
            unset += [f"{prefix}.{n}" for n in own if module._buffers[n].isnan().any()]
    if unset:
        raise error("MF705", path=str(getattr(config, "_name_or_path", "") or "the checkpoint"),
                    why=f"transformers {transformers.__version__} computed no value for {unset[:3]} on a model "
                        "built on the meta device; a newer transformers 5 does")
    model.tie_weights()
    return model


def _check_quantization(config, root: Path) -> str:
    """quantization_config must be fine-grained FP8, 128x128, dynamic; it is removed from ``config``.
    -> the scale format ("float" or "ue8m0")."""
    qc = getattr(config, "quantization_config", None)
    qc = qc if isinstance(qc, dict) else (qc.to_dict() if qc is not None else {})
    block = list(qc.get("weight_block_size") or [])
    problems = [(qc.get("quant_method") != "fp8", f"quant_method={qc.get('quant_method')!r}, not 'fp8'"),
                (block != [BLOCK, BLOCK], f"weight_block_size={block or None}; moeflow's fp8-block is [128, 128]"),
                (qc.get("activation_scheme", "dynamic") != "dynamic",
                 f"activation_scheme={qc.get('activation_scheme')!r}; moeflow quantizes activations dynamically")]
    for bad, why in problems:
        if bad:
            raise error("MF705", path=str(root), why=why)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    return qc.get("scale_fmt") or "float"


def _no_init(transformers):
    """transformers' context that skips random initialization (weights are loaded next)."""
    init = getattr(transformers, "initialization", None)
    return init.no_init_weights() if init is not None and hasattr(init, "no_init_weights") else contextlib.nullcontext()


def _scale(t: Tensor, scale_fmt: str) -> Tensor:
    """A weight_scale_inv as float32 (ue8m0 scales are powers of two stored in one byte)."""
    if t.dtype == torch.uint8 and scale_fmt == "ue8m0":
        t = t.view(torch.float8_e8m0fnu)
    return t.float()


class _BlockExperts(dict):
    """{block: its experts' checkpoint tensors (host)} whose ``get`` gives the block's stacked tensors
    (``_stack``) on ``device``, made anew at each call: replace_moe_blocks builds one block at a time, so the device
    holds one block's checkpoint experts beside the model, not every block's. Its planning pass takes ``plan``'s
    tensors instead, which have the stacked shapes and dtypes but no values: the checkpoint is read and copied to
    the device once, by the build."""

    def __init__(self, parts: dict[str, dict[str, Tensor]], path: str, device):
        super().__init__(parts)
        self.path, self.device = path, device

    def get(self, block, default=None):
        parts = super().get(block)
        if parts is None:
            return default
        return {k: v.to(self.device) for k, v in _stack(block, parts, self.path).items()}

    def plan(self, block) -> dict[str, Tensor] | None:
        """The block's stacked tensors uninitialized on ``device`` (stacked on the meta device: nothing is read, and
        the same MF705 checks run as for ``get``); None for a block the checkpoint has no experts for."""
        parts = super().get(block)
        if parts is None:
            return None
        shapes = _stack(block, {k: v.to("meta") for k, v in parts.items()}, self.path)
        return {k: torch.empty(t.shape, dtype=t.dtype, device=self.device) for k, t in shapes.items()}


def _read(files, device, dtype, scale_fmt: str, root: Path):
    """-> (experts: {block: {key: tensor}}, rest: {model name: tensor}, FP8 rest dequantized to dtype). The files
    are read memory-mapped on the host; only the FP8 rest goes to ``device`` (to dequantize it there)."""
    safetensors = _safetensors(root)
    tensors = {}
    for f in files:
        with safetensors.safe_open(str(f), framework="pt", device="cpu") as handle:
            for key in handle.keys():
                name = key
                for old, new in _RENAMES:
                    name = name.replace(old, new)
                tensors[name] = handle.get_tensor(key)
    experts, rest = defaultdict(dict), {}
    for name, t in tensors.items():
        m = _PER_EXPERT.match(name) or _FUSED.match(name)
        if m:
            experts[m["block"]][name[len(m["block"]) + len(".experts."):]] = t
        elif name.endswith("_scale_inv") or name.endswith(".activation_scale"):
            continue  # consumed beside its weight
        elif t.dtype == torch.float8_e4m3fn:
            scale = tensors.get(name + "_scale_inv")
            if scale is None:
                raise error("MF705", path=str(root), why=f"{name} is float8_e4m3fn without {name}_scale_inv")
            rest[name] = _BLOCKS.dequantize_weight(t.to(device), _scale(scale, scale_fmt).to(device)).to(dtype)  # [N, K]
        else:
            rest[name] = t
    return {b: {k: (_scale(v, scale_fmt) if k.endswith("_scale_inv") else v) for k, v in parts.items()}
            for b, parts in experts.items()}, rest


def _safetensors(root: Path):
    try:
        import safetensors
        return safetensors
    except ImportError as exc:
        raise error("MF701", what=f"reading {root}", why=f"safetensors: {exc}") from None


def _stack(block: str, parts: dict[str, Tensor], path: str) -> dict[str, Tensor]:
    """One block's expert tensors -> {"gate_up_proj", "down_proj"[, "*_scale_inv"]} in moeflow's layout."""
    if "gate_up_proj" in parts:  # already fused [E, 2I, H]
        return parts
    by = defaultdict(dict)  # (proj, kind) -> {expert: tensor}
    for key, t in parts.items():
        e, proj, kind = key.split(".")
        by[(_PROJ[proj], kind)][int(e)] = t
    num = 1 + max(max(d) for d in by.values())

    def stacked(proj: str, kind: str) -> Tensor:
        d = by.get((proj, kind), {})
        if len(d) != num:
            raise error("MF705", path=path, why=f"{block}: {proj} {kind} missing for experts "
                                                f"{sorted(set(range(num)) - set(d))[:4]}")
        return torch.stack([d[e] for e in range(num)])

    out = {"gate_up_proj": torch.cat([stacked("gate", "weight"), stacked("up", "weight")], dim=1),
           "down_proj": stacked("down", "weight")}
    if out["gate_up_proj"].dtype == torch.float8_e4m3fn:
        inter = out["down_proj"].shape[2]
        if inter % BLOCK:
            raise error("MF705", path=path, why=f"{block}: expert intermediate size {inter} is not a multiple of "
                                                f"{BLOCK}, so gate and up block scales cannot be stacked")
        out["gate_up_proj_scale_inv"] = torch.cat([stacked("gate", "weight_scale_inv"), stacked("up", "weight_scale_inv")], dim=1)
        out["down_proj_scale_inv"] = stacked("down", "weight_scale_inv")
    return out
