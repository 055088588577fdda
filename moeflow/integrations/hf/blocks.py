"""replace_moe_blocks: each sparse MoE block of a transformers model -> a MoeflowBlock, which keeps the block's
router module and hands routing, the experts and the shared experts to one ``moeflow.MoE``.

Families (FAMILIES): Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3; any other module holding a ``gate`` and an
``experts`` module is refused with MF702.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ... import env as moeflow_env
from ...capabilities import Environment
from ...config import DTYPES, MoEConfig, parse_dtype
from ...errors import error
from ...experts import ExpertWeights
from ...invariant_linear import invariant_linear
from ...layer import MoE, adopting
from ...planner import plan as make_plan
from ...weights import expected_names
from .experts import _check_features, _check_fp8, _local, activation_of, expert_weights, is_experts_module


def _softmax(block: nn.Module, renormalize: bool | None = None) -> dict:
    gate = block.gate
    renorm = bool(gate.norm_topk_prob) if renormalize is None else renormalize
    return dict(top_k=int(gate.top_k), scoring="softmax", renormalize=renorm)


def _deepseek_v3(block: nn.Module) -> dict:
    gate = block.gate
    return dict(top_k=int(gate.top_k), scoring="sigmoid", renormalize=bool(gate.norm_topk_prob),
                num_expert_groups=int(gate.num_group), topk_groups=int(gate.topk_group), use_correction_bias=True,
                routed_scaling_factor=float(gate.routed_scaling_factor))


@dataclass(frozen=True)
class Family:
    routing: Callable[[nn.Module], dict]  # block -> MoEConfig routing fields
    shared: str | None = None  # attribute holding the shared-expert MLP (gate_proj/up_proj/down_proj)
    shared_gate: str | None = None  # attribute holding the shared expert's sigmoid gate Linear(H, 1)
    router_fp32: bool = False  # router logits computed in float32 from float32 weights


# block class -> routing as MoEConfig fields, following transformers' modeling code:
#   MixtralSparseMoeBlock   softmax top-k, always renormalized
#   Qwen2MoeSparseMoeBlock  softmax top-k, renormalized iff norm_topk_prob; shared_expert with a sigmoid gate
#   Qwen3MoeSparseMoeBlock  softmax top-k, renormalized iff norm_topk_prob
#   OlmoeSparseMoeBlock     softmax top-k, renormalized iff norm_topk_prob
#   DeepseekV3MoE           sigmoid, grouped top-k (n_group, topk_group) chosen with e_score_correction_bias,
#                           renormalized iff norm_topk_prob, x routed_scaling_factor; shared_experts;
#                           router logits in float32
FAMILIES: dict[str, Family] = {
    "MixtralSparseMoeBlock": Family(lambda b: _softmax(b, renormalize=True)),
    "Qwen2MoeSparseMoeBlock": Family(_softmax, shared="shared_expert", shared_gate="shared_expert_gate"),
    "Qwen3MoeSparseMoeBlock": Family(_softmax),
    "OlmoeSparseMoeBlock": Family(_softmax),
    "DeepseekV3MoE": Family(_deepseek_v3, shared="shared_experts", router_fp32=True),
}


def supported_blocks() -> list[str]:
    return list(FAMILIES)


class MoeflowBlock(nn.Module):
    """Drop-in for a sparse MoE block: hidden_states [..., H] -> [..., H], same dtype.

    gate: the block's own router module (its [E, H] ``weight``; kept as ``gate``, so the state_dict keeps the
    model's ``...gate.weight`` names); moe: the moeflow layer doing routing, experts and shared experts;
    router_fp32: compute the logits in float32 (DeepSeek-V3) instead of the input dtype.

    The logits are ``x @ gate.weight.T``, computed here. When something hooks the router module (transformers'
    ``output_router_logits=True`` records its output through a forward hook), the router module runs instead, as in
    the block replaced, and its logits (output 0, the same values) feed moeflow's routing.
    """

    def __init__(self, moe: MoE, gate: nn.Module, router_fp32: bool, source: str, names: dict[str, str] | None = None):
        super().__init__()
        self.moe = moe
        self.gate = gate
        self.router_fp32 = router_fp32
        self.source = source
        self.names = dict(names or {})  # moe's state_dict key -> the replaced block's (block_names)
        self.register_state_dict_post_hook(_save_block_names)
        self.register_load_state_dict_pre_hook(_read_block_names)

    def saves_block_names(self) -> bool:
        """Whether state_dict() names the tensors as the replaced block did: the layer keeps the block's format
        (no FP8 of moeflow's making) and all of its experts, and the block's names are known (block_names)."""
        moe = self.moe
        return bool(self.names) and not moe.scheme.quantized and len(moe.local_experts) == moe.config.num_experts

    def forward(self, hidden_states: Tensor) -> Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        if self.gate._forward_hooks or self.gate._forward_pre_hooks:  # observed: run the router module itself
            logits = self.gate(x)[0]  # [T, E]
        elif self.moe.config.batch_invariant:  # one fixed tile for every T (F.linear's kernel follows T)
            w = self.gate.weight
            logits = invariant_linear(x.float(), w.float()) if self.router_fp32 else \
                invariant_linear(x, w.to(x.dtype)).to(x.dtype)
        elif self.router_fp32:
            logits = F.linear(x.float(), self.gate.weight.float())  # [T, E]
        else:
            logits = F.linear(x, self.gate.weight.to(x.dtype))
        return self.moe(x.to(self.moe.config.dtype), logits).to(hidden_states.dtype).reshape(shape)

    def extra_repr(self) -> str:
        return f"replaces {self.source}, router_fp32={self.router_fp32}"


def block_names(block: nn.Module, family: Family) -> dict[str, str]:
    """moe state_dict key -> the key of the same tensor in ``block``, for a MoeflowBlock to save and load under the
    block's names (so a replaced model's save_pretrained writes a checkpoint transformers reads back). Empty where the
    layer's tensors are not the block's in its layout: transposed or FP8 experts, FP8 shared-expert weights."""
    experts = block.experts
    shared = getattr(block, family.shared) if family.shared else None
    if getattr(experts, "is_transposed", False) or expert_weights(experts).w13_scale is not None or (
            shared is not None and any(getattr(getattr(shared, p), "weight_scale_inv", None) is not None
                                       for p in ("gate_proj", "up_proj", "down_proj"))):
        return {}
    names = {"gate_up_proj": "experts.gate_up_proj", "down_proj": "experts.down_proj"}
    if shared is not None:
        names.update({f"shared_experts.{p}.weight": f"{family.shared}.{p}.weight"
                      for p in ("gate_proj", "up_proj", "down_proj")})
    if family.shared_gate:
        names["shared_expert_gate.weight"] = f"{family.shared_gate}.weight"
    return names


def _save_block_names(block: MoeflowBlock, state: dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook: the layer's tensors under the replaced block's names (MoeflowBlock.saves_block_names);
    the layer's float32 copy of the correction bias is left out where the router module holds the bias."""
    if not block.saves_block_names():
        return
    for ours, theirs in block.names.items():
        if prefix + "moe." + ours in state:
            state[prefix + theirs] = state.pop(prefix + "moe." + ours)
    if prefix + "gate.e_score_correction_bias" in state:
        state.pop(prefix + "moe.e_score_correction_bias", None)


def _read_block_names(block: MoeflowBlock, state: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook: keys under the replaced block's names read as the layer's (the layer converts them:
    MoE.load_state_dict), the router module's correction bias as the layer's where the layer's own is absent."""
    for ours, theirs in block.names.items():
        if prefix + theirs in state:
            state[prefix + "moe." + ours] = state.pop(prefix + theirs)
    bias = prefix + "gate.e_score_correction_bias"
    if bias in state and block.moe.e_score_correction_bias is not None:
        state.setdefault(prefix + "moe.e_score_correction_bias", state[bias])


def _is_moe_block(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    return isinstance(experts, nn.Module) and is_experts_module(experts) and isinstance(getattr(module, "gate", None), nn.Module)


def _state(block: nn.Module, family: Family, experts: dict[str, Tensor] | None = None) -> tuple[dict, dict[str, Tensor]]:
    """-> (MoEConfig size/activation/shared fields, tensors by moeflow.load_weights name).

    experts: the routed experts' tensors by load_weights name, used instead of the block's own
    (an FP8 checkpoint read by fp8.py)."""
    cls = type(block).__name__
    _check_features(block.experts)
    w = expert_weights(block.experts) if experts is None else ExpertWeights(
        experts["gate_up_proj"], experts["down_proj"], experts.get("gate_up_proj_scale_inv"), experts.get("down_proj_scale_inv"))
    if experts is None and w.w13_scale is not None:  # transformers' FP8Experts: block size, scale format, ...
        _check_fp8(block.experts, type(block.experts).__name__, bool(getattr(block.experts, "is_transposed", False)))
    e, i2, h = w.w13.shape
    act = activation_of(block.experts.act_fn, type(block.experts).__name__)
    fields = dict(num_experts=e, hidden_size=h, intermediate_size=i2 // 2, activation=act, **family.routing(block))
    state = {"gate_up_proj": w.w13, "down_proj": w.w2}
    if w.w13_scale is not None:
        state.update(gate_up_proj_scale_inv=w.w13_scale, down_proj_scale_inv=w.w2_scale)
    if fields.get("use_correction_bias"):
        state["e_score_correction_bias"] = block.gate.e_score_correction_bias
    if family.shared:
        mlp = getattr(block, family.shared)
        if activation_of(mlp.act_fn, type(mlp).__name__) != act:
            raise error("MF702", path=cls, cls=f"{cls} with a shared-expert activation unlike the experts'", valid=supported_blocks())
        fields.update(num_shared_experts=1, shared_intermediate_size=mlp.gate_proj.weight.shape[0],
                      shared_expert_gate=family.shared_gate is not None)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(mlp, proj)
            state[f"shared_experts.{proj}.weight"] = lin.weight
            if getattr(lin, "weight_scale_inv", None) is not None:  # an FP8Linear: dequantized by load_weights
                state[f"shared_experts.{proj}.weight_scale_inv"] = lin.weight_scale_inv
    if family.shared_gate:
        state["shared_expert_gate.weight"] = getattr(block, family.shared_gate).weight
    return fields, {k: _local(v.detach()) for k, v in state.items()}


@torch.no_grad()
def _adopt(moe: MoE, state: dict[str, Tensor]) -> None:
    """Point moe's parameters at ``state``'s tensors where shape, dtype and device already match
    (no copy); load the rest through ``load_weights`` (quantizing or converting)."""
    rest = {}
    for name, t in state.items():
        owner, _, attr = name.rpartition(".")
        module = moe.get_submodule(owner) if owner else moe
        cur = getattr(module, attr, None)
        if isinstance(cur, nn.Parameter) and (cur.shape, cur.dtype, cur.device) == (t.shape, t.dtype, t.device) \
                and t.is_contiguous():
            setattr(module, attr, nn.Parameter(t, requires_grad=False))
        else:
            rest[name] = t
    if rest:
        moe.load_weights(rest, strict=False)


def _plan_block(block: nn.Module, quant: str | None, runner: str, dtype: torch.dtype | None,
                path: str, experts: dict[str, Tensor] | None = None,
                batch_invariant: bool | None = None) -> tuple[MoEConfig, dict[str, Tensor], Family]:
    """-> (the layer configuration, its tensors, the family); refusals raise here (MF702/MF704/MF1xx/MF2xx).
    batch_invariant: MoEConfig's; None reads MOEFLOW_BATCH_INVARIANT."""
    if batch_invariant is None:
        batch_invariant = moeflow_env.BATCH_INVARIANT.get_bool()
    cls = type(block).__name__
    family = FAMILIES.get(cls)
    if family is None:
        raise error("MF702", path=path or cls, cls=cls, valid=supported_blocks())
    fields, state = _state(block, family, experts)
    fp8 = "gate_up_proj_scale_inv" in state
    layer_dtype = (dtype or torch.bfloat16) if fp8 else state["gate_up_proj"].dtype
    if layer_dtype not in DTYPES.values():
        layer_dtype = torch.bfloat16
    cfg = MoEConfig(**fields, quant=quant or ("fp8-block" if fp8 else "none"), runner=runner, dtype=layer_dtype,
                    device=state["gate_up_proj"].device, batch_invariant=batch_invariant)
    make_plan(cfg, Environment.detect(cfg.device))
    return cfg, state, family


def build_block(block: nn.Module, quant: str | None = None, runner: str = "auto", dtype: torch.dtype | None = None,
                path: str = "", experts: dict[str, Tensor] | None = None,
                batch_invariant: bool | None = None) -> MoeflowBlock:
    """One sparse MoE block -> MoeflowBlock. quant: None keeps the experts' format ("none", or
    "fp8-block" for FP8 experts); dtype: activation dtype for FP8 experts (default bfloat16);
    experts: routed-expert tensors to use instead of the block's (see _state); batch_invariant: MoEConfig's (the
    router's logits then in a fixed tile too), None reads MOEFLOW_BATCH_INVARIANT."""
    if dtype is not None:  # MF104, as replace_moe_blocks
        dtype = parse_dtype(dtype)
    cfg, state, family = _plan_block(block, quant, runner, dtype, path, experts, batch_invariant)
    # skip the random init when the block's tensors cover every weight the layer needs; then the layer takes those
    # already in its layout as its parameters at construction (adopting: no second allocation of the experts)
    init = not set(expected_names(cfg)) <= set(state)
    with adopting(state):
        moe = MoE(cfg, init_weights=init)
    _adopt(moe, state)
    names = block_names(block, family) if experts is None else {}
    return MoeflowBlock(moe, block.gate, family.router_fp32, f"{type(block).__name__} at {path or '?'}", names)


def replace_moe_blocks(model: nn.Module, quant: str | None = None, runner: str = "auto", dtype: torch.dtype | None = None,
                       skip_unknown: bool = False, progress=None, experts: dict[str, dict] | None = None,
                       batch_invariant: bool | None = None) -> list[str]:
    """Replace every sparse MoE block of ``model`` in place; -> the replaced module paths.

    The MoeflowBlock's router weight is the block's own Parameter, not a copy. Expert weights already in the
    layer's storage format are adopted (the layer's parameter points at the model's tensor); others go through
    ``MoE.load_weights`` (quantized when ``quant`` asks for FP8, kept FP8 when they already are 128x128-block
    FP8). The state_dict names the tensors as the replaced block did where the layer keeps the block's format
    (block_names), so save_pretrained round-trips.
    quant: None keeps each block's expert format; "fp8-block" etc. quantize high-precision experts.
    dtype: activation dtype of FP8 experts (default: the model's). Every block is planned before the
    first is replaced, so a refusal (MF702 unknown block, MF704 unsupported experts, MF1xx/MF2xx
    from the configuration and planner) leaves the model untouched. No block at all: MF703.
    progress: optional callable(done, total, path). experts: {block path: routed-expert tensors}
    overriding the blocks' own (fp8.py); where it also has ``plan(path)`` (fp8._BlockExperts), the planning
    pass takes that: tensors of the same shapes and dtypes whose values are never read.
    batch_invariant: plan every layer with MoEConfig.batch_invariant (a token's output the same bits whatever batch it
    came in; the router's logits too); None reads MOEFLOW_BATCH_INVARIANT.
    """
    if dtype is not None:  # an explicit activation dtype must be a layer dtype (MF104), not silently bfloat16
        dtype = parse_dtype(dtype)
    experts = experts or {}
    blocks = [(name, m) for name, m in model.named_modules() if _is_moe_block(m)]
    unknown = [(name, m) for name, m in blocks if type(m).__name__ not in FAMILIES]
    if unknown and not skip_unknown:
        name, m = unknown[0]
        raise error("MF702", path=name, cls=type(m).__name__, valid=supported_blocks())
    blocks = [(name, m) for name, m in blocks if type(m).__name__ in FAMILIES]
    if not blocks:
        raise error("MF703", model=type(model).__name__, valid=supported_blocks())
    dtype = dtype or getattr(model, "dtype", None)
    names = [name for name, _ in blocks]
    planned = getattr(experts, "plan", experts.get)  # fp8._BlockExperts: shapes and dtypes only, nothing read
    for name, m in blocks:
        _plan_block(m, quant, runner, dtype, name, planned(name), batch_invariant)
    del blocks, m  # each block is looked up when it is replaced and then dropped, so its tensors can be freed
    for done, name in enumerate(names, 1):  # (quantizing bf16 experts: one block's old and new ones at a time)
        model.set_submodule(name, build_block(model.get_submodule(name), quant, runner, dtype, name, experts.get(name),
                                              batch_invariant))
        if progress:
            progress(done, len(names), name)
    return names
