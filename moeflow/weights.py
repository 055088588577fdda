"""load_weights: Hugging Face names and layouts into a moeflow layer (load_layer_weights has the names;
``MoE.load_state_dict`` reads the same names the same way). Expert tensors may hold all E experts (a rank keeps its
own) or exactly this rank's E_local; high-precision ones are quantized by the layer's scheme, FP8 ones kept as they
are where their scale has the layer scheme's shape (load_expert_weight).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from .errors import error
from .quant import FP8_DTYPE, SCHEMES, create_scheme

EXPERT_NAMES = ("gate_up_proj", "down_proj")


def expert_matrix(cfg, name: str) -> tuple[int, int]:
    """One expert's matrix of expert weight ``name`` (Hugging Face layout): gate_up_proj (2I, H), down_proj (H, I)."""
    return {"gate_up_proj": (2 * cfg.intermediate_size, cfg.hidden_size),
            "down_proj": (cfg.hidden_size, cfg.intermediate_size)}[name]


SHARED_NAMES = ("shared_experts.gate_proj.weight", "shared_experts.up_proj.weight", "shared_experts.down_proj.weight")


def expected_names(cfg) -> list[str]:
    """Names load_weights requires for a layer of configuration ``cfg`` (scales are optional companions)."""
    names = list(EXPERT_NAMES)
    if cfg.use_correction_bias:
        names.append("e_score_correction_bias")
    if cfg.shared_size:
        names += SHARED_NAMES
    if cfg.shared_expert_gate:
        names.append("shared_expert_gate.weight")
    return names


def _canonical(name: str) -> str:
    return "shared_experts." + name[len("shared_expert."):] if name.startswith("shared_expert.") else name


def shared_shapes(cfg) -> dict[str, tuple[int, int]]:
    """The shared-expert weights' shapes, by name: gate_proj / up_proj (S, H), down_proj (H, S)."""
    s, h = cfg.shared_size, cfg.hidden_size
    return dict(zip(SHARED_NAMES, ((s, h), (s, h), (h, s))))


def _spellings(state, prefix: str, cfg) -> dict[str, str]:
    """{key under ``prefix`` spelled ``shared_expert.`` (Qwen2-MoE): the same key spelled ``shared_experts.``};
    MF403 where ``state`` gives both (which one to load is not ours to guess)."""
    renamed = {k: prefix + _canonical(k[len(prefix):]) for k in state if k.startswith(prefix + "shared_expert.")}
    twice = [f"{k} (also given as {ours})" for k, ours in renamed.items() if ours in state]
    if twice:
        raise error("MF403", names=twice, valid=expected_names(cfg))
    return renamed


def canonical_state(state: dict[str, Tensor], prefix: str, cfg) -> None:
    """For load_state_dict, in place: the tensors under ``prefix`` other than the expert weights read as load_weights
    reads them. ``shared_expert.`` keys (Qwen2-MoE) renamed ``shared_experts.``; the correction bias, the shared-expert
    weights (an FP8 one dequantized with its ``.weight_scale_inv``, whose key is removed) and the shared gate replaced
    by the layer's dtypes on the layer's device (dense_tensors), so ``assign=True`` keeps the layer's dtypes too."""
    for key, t in state.items():
        if key.startswith(prefix) and isinstance(t, Tensor):
            _holds_values(key[len(prefix):], t)
    for key, ours in _spellings(state, prefix, cfg).items():
        state[ours] = state.pop(key)
    own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    for name in SHARED_NAMES if cfg.shared_size else ():  # as the expert weights' (MoE._load_from_state_dict)
        if name + "_scale_inv" in own and name not in own:
            raise error("MF404", name=name + "_scale_inv", why=f"given without {name}: a scale is read with its "
                                                               "weight (give both, or neither)")
    for name, t in dense_tensors(own, cfg).items():
        state[prefix + name] = t
        if own[name].dtype == FP8_DTYPE:  # dequantized: its scale is consumed
            state.pop(prefix + name + "_scale_inv", None)


def dense_tensors(state: dict[str, Tensor], cfg) -> dict[str, Tensor]:
    """The tensors of ``state`` (canonical names) that are not expert weights, as the layer stores them: the
    correction bias float32 [E], the shared-expert weights (dequantized where FP8) and the shared gate [1, H] in the
    layer dtype; all on the layer's device. Only the names the configuration has; MF402 / MF404 where a tensor cannot
    be read so."""
    out = {}
    if cfg.use_correction_bias and "e_score_correction_bias" in state:
        bias = _floating("e_score_correction_bias", state["e_score_correction_bias"])
        _expect_shape("e_score_correction_bias", bias, (cfg.num_experts,))
        out["e_score_correction_bias"] = bias.to(device=cfg.device, dtype=torch.float32)
    if cfg.shared_size:
        for name, shape in shared_shapes(cfg).items():
            if name in state:
                w = _dense(name, state[name], state.get(name + "_scale_inv"), shape)
                out[name] = w.to(device=cfg.device, dtype=cfg.dtype)
    if cfg.shared_expert_gate and "shared_expert_gate.weight" in state:
        w = _floating("shared_expert_gate.weight", state["shared_expert_gate.weight"])
        _expect_shape("shared_expert_gate.weight", w, (1, cfg.hidden_size))
        out["shared_expert_gate.weight"] = w.to(device=cfg.device, dtype=cfg.dtype)
    return out


@torch.no_grad()
def load_layer_weights(layer, state: dict[str, Tensor], strict: bool) -> None:
    """Load ``state`` into ``layer`` (strict: MF401 for a missing name, MF403 for an unknown one; MF404 for a value
    that is not a tensor or holds no values). Names (E experts, H hidden, I intermediate, S shared intermediate):

        gate_up_proj                [E, 2I, H]  gate rows first      (float, or float8_e4m3fn + scale)
        down_proj                   [E, H, I]
        gate_up_proj_scale_inv      scale of an FP8 gate_up_proj     (dequantization multiplier)
        down_proj_scale_inv         scale of an FP8 down_proj
        e_score_correction_bias     [E]                              (use_correction_bias=True)
        shared_experts.{gate,up}_proj.weight [S, H], shared_experts.down_proj.weight [H, S]
            (``shared_expert.`` — Qwen2-MoE's spelling — is accepted too; ``.weight_scale_inv``
            beside an FP8 shared weight is honoured by dequantizing it)
        shared_expert_gate.weight   [1, H]                           (shared_expert_gate=True)
    """
    if not isinstance(state, Mapping):
        raise error("MF404", name="state",
                    why=f"load_weights takes a dict of tensors by name, not {type(state).__name__}")
    for k, v in state.items():
        if not isinstance(v, Tensor):
            raise error("MF404", name=k, why=f"must be a torch.Tensor, not {type(v).__module__}.{type(v).__name__}")
        _holds_values(k, v)
    renamed = _spellings(state, "", layer.config)
    state = {renamed.get(k, k): v for k, v in state.items()}
    required = expected_names(layer.config)
    # the scales of the weights this layer has (no shared-expert scale where it has no shared experts: MF403)
    optional = [n + "_scale_inv" for n in required if n in EXPERT_NAMES or n in SHARED_NAMES]
    valid = required + optional
    if strict:
        missing = [n for n in required if n not in state]
        if missing:
            raise error("MF401", names=missing, valid=required)
        unknown = [n for n in state if n not in valid]
        if unknown:
            raise error("MF403", names=unknown, valid=valid)
    for scale in optional:  # as load_state_dict: a new scale on a stale weight is read as neither
        weight = scale.removesuffix("_scale_inv")
        if scale in state and weight not in state:
            raise error("MF404", name=scale, why=f"given without {weight}: a scale is read with its weight "
                                                 "(give both, or neither)")
    for name in EXPERT_NAMES:
        if name in state:
            load_expert_weight(layer, name, state[name], state.get(name + "_scale_inv"))
    for name, t in dense_tensors(state, layer.config).items():
        layer.get_parameter(name).data.copy_(t)


def _holds_values(name: str, t: Tensor) -> None:
    """MF404 for a tensor on the meta device (a lazily built checkpoint's): it has a shape and no values."""
    if t.is_meta:
        raise error("MF404", name=name, why="is on the meta device and holds no values (a lazily built checkpoint): "
                                            "load the checkpoint's tensors themselves")


def _expect_shape(name: str, t: Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise error("MF402", name=name, shape=tuple(t.shape), expected=list(shape))


def load_expert_weight(layer, name: str, w: Tensor, scale: Tensor | None) -> None:
    """Store one expert weight of ``name`` (gate_up_proj [E or E_local, 2I, H], down_proj [E or E_local, H, I]) and
    its optional ``scale`` (``name``_scale_inv) in ``layer``, converted to the layer's scheme; MF402 / MF404 where
    that cannot be done. The tensor may hold all E experts (this rank keeps its own) or exactly the logical experts
    this rank holds, ascending (its E_local; with redundant experts each replica is filled from its expert's row, as
    ``state_dict`` writes them: moeflow.balance). High-precision weights are quantized by the layer's scheme. FP8
    weights are kept as they are when their scale has the layer scheme's shape (an fp8-block checkpoint into an
    fp8-block layer loads without dequantizing); a scale of another scheme's shape is dequantized and requantized by
    the layer's scheme."""
    cfg = layer.config
    n, k = expert_matrix(cfg, name)
    e_all, local = cfg.num_experts, layer.local_experts
    held = sorted(set(local))  # the logical experts here, ascending (replicas: a local slot each, one row of ``w``)
    if w.dim() != 3 or tuple(w.shape[1:]) != (n, k) or w.shape[0] not in (e_all, len(held)):
        raise error("MF402", name=name, shape=tuple(w.shape), expected=f"[{e_all} (or local {len(held)}), {n}, {k}]")
    row = {x: x for x in held} if w.shape[0] == e_all else {x: i for i, x in enumerate(held)}
    source_of = [row[x] for x in local]  # local slot j is w[source_of[j]]: no [E_local, N, K] copy
    pick = source_of != list(range(w.shape[0]))
    index = torch.tensor(source_of, device=w.device)
    if w.dtype == FP8_DTYPE:
        if scale is None:
            raise error("MF404", name=name, why=f"float8_e4m3fn weights need {name}_scale_inv beside them")
        if not scale.dtype.is_floating_point:
            raise error("MF404", name=name + "_scale_inv", why=f"scales must be floating, got {scale.dtype}")
        if pick and scale.dim() and scale.shape[0] == w.shape[0]:
            scale = scale.index_select(0, index.to(scale.device))
        wshape = (len(source_of), n, k)  # the local experts'
        source, scale = _scheme_of_scale(layer.scheme, scale, wshape)
        if source is None:
            raise error("MF402", name=name + "_scale_inv", shape=tuple(scale.shape), expected=_scale_shapes(wshape))
        if source.name == layer.scheme.name:
            dst = getattr(layer, name).data
            if pick:  # expert by expert: no [E_local, N, K] copy of the picked experts first
                for j, e in enumerate(source_of):
                    dst[j].copy_(w[e])
            else:
                dst.copy_(w)
            getattr(layer, name + "_scale_inv").data.copy_(scale.float())
            return
        scale = scale.float().to(w.device)  # already the local experts' (index_select above)
        # one expert in float32 at a time, rounded to the layer's dtype as a high-precision checkpoint would be
        layer._store_expert_weight(name, lambda j: source.dequantize_weight(
            w[source_of[j]][None], scale[j:j + 1]).to(cfg.dtype)[0])
        return
    if not w.dtype.is_floating_point:
        raise error("MF404", name=name, why=f"dtype {w.dtype} is neither floating nor float8_e4m3fn")
    if scale is not None:
        raise error("MF404", name=name + "_scale_inv", why=_unreadable_scale(w))
    layer._store_expert_weight(name, lambda j: w[source_of[j]].to(cfg.dtype))


def _scale_shapes(wshape) -> str:
    """The scale shapes an FP8 weight of shape ``wshape`` [E, N, K] may come with, one for each FP8 scheme."""
    return "one FP8 scheme's: " + ", ".join(
        f"{s.name} {list(s.weight_scale_shape(*wshape))}" for s in map(create_scheme, SCHEMES.names()) if s.quantized)


def _unreadable_scale(w: Tensor) -> str:
    """Why a scale beside a weight that is not float8_e4m3fn is refused (MF404)."""
    if w.dtype.itemsize == 1:  # another FP8 format (e5m2, e4m3fnuz, ...)
        return (f"the weight is {str(w.dtype).removeprefix('torch.')}: moeflow reads scaled FP8 weights as "
                "float8_e4m3fn only; dequantize it first (w.float() * scale, broadcast by block) or give it in e4m3fn")
    return "a scale was given for a high-precision weight"


def _scheme_of_scale(preferred, scale: Tensor, wshape) -> tuple[object | None, Tensor]:
    """-> (the FP8 scheme whose weight-scale shape matches ``scale``, the layer's own first;
    the scale in that scheme's shape). A trailing singleton dim is accepted too: per-channel
    scales are often stored [.., N, 1]."""
    candidates = [preferred] + [create_scheme(n) for n in SCHEMES.names() if n != preferred.name]
    forms = [scale] + ([scale.squeeze(-1)] if scale.dim() and scale.shape[-1] == 1 else [])
    for form in forms:
        for scheme in candidates:
            if scheme.quantized and tuple(scheme.weight_scale_shape(*wshape)) == tuple(form.shape):
                return scheme, form
    return None, scale


def _floating(name: str, t: Tensor) -> Tensor:
    if not t.dtype.is_floating_point or t.dtype == FP8_DTYPE:
        raise error("MF404", name=name, why=f"dtype {t.dtype} cannot be read: a floating tensor (not FP8) is needed")
    return t


def _dense(name: str, w: Tensor, scale: Tensor | None, shape: tuple) -> Tensor:
    """A 2-D shared-expert weight, dequantized when it is FP8 (any scheme's scale shape)."""
    _expect_shape(name, w, shape)
    if w.dtype != FP8_DTYPE:
        if scale is not None:  # read as values, the scale would be dropped
            raise error("MF404", name=name + "_scale_inv", why=_unreadable_scale(w))
        return _floating(name, w)
    if scale is None:
        raise error("MF404", name=name, why=f"float8_e4m3fn weights need {name}_scale_inv beside them")
    s1 = scale.reshape(1) if scale.numel() == 1 else scale.unsqueeze(0)  # as a 1-expert scale
    source, s1 = _scheme_of_scale(create_scheme("fp8-block"), s1, (1, *shape))
    if source is None:
        raise error("MF402", name=name + "_scale_inv", shape=tuple(scale.shape), expected="a block, channel or tensor scale")
    return source.dequantize_weight(w[None], s1.float().to(w.device))[0]
