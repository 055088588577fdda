"""experts_implementation="moeflow": transformers' experts modules computed by moeflow.

transformers (>= 5) decorates each model's experts class with ``@use_experts_implementation`` and calls
``interface[config._experts_implementation](module, hidden_states, top_k_index, top_k_weights)``; fine-grained FP8
models use ``FP8Experts`` with the FP8 interface. Both land in :func:`moeflow_experts_forward`, which runs an
ExpertsPath on the module's own weights (bf16 / fp16 / fp32, or FP8Experts' 128x128 blocks as fp8-block) as
views, never copied. Anything moeflow cannot compute exactly is refused with MF704.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ... import env as moeflow_env
from ... import ops
from ...config import MoEConfig
from ...errors import error
from ...experts import ExpertWeights
from ..path import ExpertsPath

_ACTIVATIONS = {  # class name of transformers' act_fn -> moeflow activation
    "SiLUActivation": "silu", "SiLU": "silu",
    "GELUActivation": "gelu",
    "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh",
    "FastGELUActivation": "gelu_tanh",
}
_FUNCTIONS = {F.silu: "silu", F.gelu: "gelu"}  # act_fn given as a torch function
_FP8_GATE_OPTIONS = ("swiglu_alpha", "swiglu_limit", "limit", "gate_softcap")  # FP8Experts' gate variants


def activation_of(act_fn, owner: str) -> str:
    """transformers activation module -> "silu" | "gelu" | "gelu_tanh", else MF704."""
    name = type(act_fn).__name__
    if act_fn in _FUNCTIONS:  # a torch function itself (LFM2-MoE: act_fn = F.silu), not a module
        return _FUNCTIONS[act_fn]
    if isinstance(act_fn, nn.GELU):
        return "gelu" if act_fn.approximate == "none" else "gelu_tanh"
    if name not in _ACTIVATIONS:
        raise error("MF704", cls=owner, feature=f"act_fn {name}",
                    fix="moeflow computes silu, gelu and gelu_tanh (gelu_pytorch_tanh / gelu_new)")
    return _ACTIVATIONS[name]


def _local(t: Tensor) -> Tensor:
    """The rank-local shard of a DTensor parameter (expert parallelism), else ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


_LAYOUT = ("moeflow runs gated experts: gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I], or their "
           "transposes with is_transposed; use experts_implementation='grouped_mm' or 'eager' for this model")


def _check_features(module: nn.Module) -> None:
    """MF704 for an experts module moeflow cannot compute exactly: checked before any of its tensors is read."""
    cls = type(module).__name__
    if getattr(module, "has_gate", True) is False:  # Nemotron-H: act(up(x)), no gate
        raise error("MF704", cls=cls, feature=f"has_gate=False (experts that are not gated: {_tensors(module)}, no "
                                              "gate_up_proj)", fix=_LAYOUT)
    refusals = [("has_bias", True, "expert biases"),
                ("is_concatenated", False, "interleaved gate/up rows"),
                ("has_post_expert_norm", True, "a norm after each expert")]
    for attr, bad, what in refusals:
        if getattr(module, attr, not bad) == bad:
            raise error("MF704", cls=cls, feature=f"{attr}={bad} ({what})", fix="use experts_implementation='grouped_mm'")
    missing = [name for name in ("gate_up_proj", "down_proj") if not isinstance(getattr(module, name, None), Tensor)]
    if missing:  # another attribute layout, whatever its flags say
        raise error("MF704", cls=cls, feature=f"an experts module without {' / '.join(missing)} "
                                              f"(its tensors: {_tensors(module)})", fix=_LAYOUT)
    gate = getattr(type(module), "_apply_gate", None)
    qual = getattr(gate, "__qualname__", "_default_apply_gate")
    fp8_variant = qual == "FP8Experts._apply_gate" and any(getattr(module, a, None) is not None for a in _FP8_GATE_OPTIONS)
    if qual not in ("_default_apply_gate", "FP8Experts._apply_gate") or fp8_variant:
        raise error("MF704", cls=cls, feature=f"a custom gate function ({qual}: clamped or soft-capped SwiGLU)",
                    fix="moeflow computes act(gate) * up exactly; use experts_implementation='grouped_mm'")


def _tensors(module: nn.Module) -> str:
    """The module's own parameters and buffers with their shapes: "up_proj [4, 32, 64], down_proj [4, 64, 32]"."""
    own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    return ", ".join(f"{name} {list(t.shape)}" for name, t in own) or "none"


def experts_config(module: nn.Module, dtype: torch.dtype, top_k: int, runner: str = "auto",
                   batch_invariant: bool | None = None) -> MoEConfig:
    """The moeflow layer configuration an experts module computes with activations of ``dtype``; batch_invariant
    (MoEConfig's): None reads MOEFLOW_BATCH_INVARIANT."""
    if batch_invariant is None:
        batch_invariant = moeflow_env.BATCH_INVARIANT.get_bool()
    _check_features(module)
    cls = type(module).__name__
    w13, w2 = _local(module.gate_up_proj), _local(module.down_proj)
    transposed = bool(getattr(module, "is_transposed", False))
    e, h, i = w13.shape[0], (w13.shape[1] if transposed else w13.shape[2]), (w2.shape[1] if transposed else w2.shape[2])
    fields = dict(num_experts=e, hidden_size=h, intermediate_size=i, top_k=min(top_k, e), runner=runner,
                  activation=activation_of(module.act_fn, cls), device=w13.device, batch_invariant=batch_invariant)
    if w13.dtype == torch.float8_e4m3fn:
        _check_fp8(module, cls, transposed)
        return MoEConfig(**fields, quant="fp8-block", dtype=dtype)
    if not w13.dtype.is_floating_point or w13.element_size() == 1:
        raise error("MF704", cls=cls, feature=f"expert weights of dtype {w13.dtype} (FP4 or integer packing)",
                    fix="moeflow reads high-precision or float8_e4m3fn expert weights")
    return MoEConfig(**fields, quant="none", dtype=w13.dtype)


def _check_fp8(module: nn.Module, cls: str, transposed: bool) -> None:
    block = tuple(getattr(module, "block_size", None) or ())
    scheme = getattr(module, "activation_scheme", "dynamic")
    scale = _local(module.gate_up_proj_scale_inv)
    problems = [(block != (128, 128), f"block_size={list(block) or None}", "moeflow's fp8-block uses 128x128 blocks"),
                (scheme != "dynamic", f"activation_scheme={scheme!r}", "moeflow quantizes activations dynamically"),
                (scale.dtype != torch.float32, f"scales of dtype {scale.dtype} (scale_fmt)", "moeflow reads float32 scales"),
                (transposed, "is_transposed=True with FP8 weights", "FP8 experts are stored [E, N, K]")]
    for bad, feature, fix in problems:
        if bad:
            raise error("MF704", cls=cls, feature=feature, fix=fix)


def expert_weights(module: nn.Module) -> ExpertWeights:
    """Views of the module's tensors in moeflow's layout: [E, 2I, H], [E, H, I] (+ FP8 scales)."""
    w13, w2 = _local(module.gate_up_proj), _local(module.down_proj)
    if getattr(module, "is_transposed", False):
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    if w13.dtype != torch.float8_e4m3fn:
        return ExpertWeights(w13, w2)
    return ExpertWeights(w13, w2, _local(module.gate_up_proj_scale_inv), _local(module.down_proj_scale_inv))


def experts_path(module: nn.Module, dtype: torch.dtype, top_k: int) -> ExpertsPath:
    """The cached ExpertsPath of ``module`` for activations of ``dtype`` (planned on first use)."""
    cache = module.__dict__.setdefault("_moeflow_paths", {})
    if not cache:  # first bound: MF704 for what moeflow cannot run, before its tensors are read
        _check_features(module)
    w13 = _local(module.gate_up_proj)
    invariant = moeflow_env.BATCH_INVARIANT.get_bool()
    key = (dtype, w13.device, w13.dtype, top_k, invariant)
    if key not in cache:
        cache[key] = ExpertsPath(experts_config(module, dtype, top_k, batch_invariant=invariant))
    if not ops.registered(module, experts_forward_eager):  # torch.compile's op runs it (moeflow.ops)
        # the expert-parallel sentinels are dropped after a host sync: not capturable
        safe = cache[key].plan.graph_safe and not getattr(module, "_is_expert_parallel", False)
        ops.register(module, experts_forward_eager, safe, w13.device)
    return cache[key]


def moeflow_experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """The function registered as "moeflow":

        hidden_states [T, H] model dtype, top_k_index [T, K] int64, top_k_weights [T, K] float
        -> [T, H] in hidden_states.dtype

    Expert-parallel sentinel: when ``self._is_expert_parallel``, ids >= ``self.num_experts`` (the local expert
    count) mark copies whose expert lives on another rank, with weight 0; they are dropped and contribute exactly
    zero (after a host synchronization: such a module is not CUDA-graph safe).
    Weights, the module's own tensors as views: gate_up_proj [E, 2I, H] (gate rows first; ``is_transposed``:
    [E, H, 2I]) and down_proj [E, H, I] ([E, I, H]); FP8 weights are float8_e4m3fn with ``*_scale_inv``
    [E, 2I/128, H/128] float32 block scales -> quant "fp8-block". Refused with MF704: no gate, biases, interleaved
    gate/up, a post-expert norm, a custom gate function, other activations, static FP8 activation scales, FP4,
    other block sizes or scale formats. The plan is cached on the module per (activation dtype, device, weight
    dtype, K); the weights are read again on every call, so reloading or moving them is safe.
    Under torch.compile's tracing, one op of the compiled graph (moeflow.ops) that runs it."""
    if torch.compiler.is_compiling():
        return ops.call(self, experts_forward_eager, hidden_states, (top_k_index, top_k_weights), self.parameters)
    return experts_forward_eager(self, hidden_states, top_k_index, top_k_weights)


def experts_forward_eager(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """moeflow_experts_forward outside torch.compile's tracing."""
    path = experts_path(self, hidden_states.dtype, top_k_index.shape[-1])
    x = hidden_states.to(path.config.dtype)
    sentinel = self.num_experts if getattr(self, "_is_expert_parallel", False) else None
    out = path(x, top_k_index, top_k_weights, expert_weights(self), valid_below=sentinel)
    return out.to(hidden_states.dtype)


def is_experts_module(module: nn.Module) -> bool:
    """True for modules built by transformers' @use_experts_implementation (or FP8Experts)."""
    return hasattr(module, "has_gate") and hasattr(module, "down_proj") and hasattr(module, "act_fn")


def prepare_experts(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Plan every experts module of ``model`` now, so refusals (MF704, MF2xx) come at load time and
    not on the first forward. dtype: the activations' dtype (default: the model's). -> modules planned."""
    dtype = dtype or getattr(model, "dtype", torch.bfloat16)
    count = 0
    for module in model.modules():
        if is_experts_module(module):
            top_k = getattr(module.config, "num_experts_per_tok", 1) if hasattr(module, "config") else 1
            experts_path(module, dtype, top_k)
            count += 1
    return count
