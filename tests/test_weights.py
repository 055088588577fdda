"""load_weights: Hugging Face names and layouts, coded errors (MF401-MF404), pre-quantized FP8
checkpoints (kept bit-exact when the layer's scheme matches, dequantized otherwise), full-E
tensors into a layer holding a subset of the experts, and whole transformers MoE blocks
(Qwen2-MoE, DeepSeek-V3, Mixtral) loaded by their own state_dict names and run side by side."""
import pytest
import torch

from moeflow import MoE, MoeflowError
from moeflow.dispatch.local import LocalDispatcher
from moeflow.quant import FP8_DTYPE, create_scheme
from oracle import assert_close, bits, layer_oracle, route_for
from tolerances import rel_tol

E, H, I, K, S = 4, 64, 32, 2, 24
FULL = dict(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K, scoring="sigmoid", use_correction_bias=True,
            num_shared_experts=1, shared_intermediate_size=S, shared_expert_gate=True)


def raises_code(code, fn, *args, **kwargs):
    with pytest.raises(MoeflowError) as info:
        fn(*args, **kwargs)
    assert info.value.code == code and isinstance(info.value, ValueError), str(info.value)
    return str(info.value)


# ---------------------------------------------------------------- names and layouts
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_hf_names_load_exactly(dtype, weights_for):
    layer = MoE(**FULL, dtype=dtype)
    state = weights_for(layer.config)
    layer.load_weights(state)
    params = dict(layer.state_dict())
    assert set(params) == set(state)  # state_dict() keys are checkpoint keys
    for name, value in state.items():
        want = value.float() if name == "e_score_correction_bias" else value.to(dtype)
        assert torch.equal(params[name], want), name


def test_qwen2_moe_shared_expert_spelling(weights_for):
    layer = MoE(**FULL, dtype=torch.float32)
    state = weights_for(layer.config)
    renamed = {k.replace("shared_experts.", "shared_expert."): v for k, v in state.items()}
    assert renamed != state
    layer.load_weights(renamed)
    assert torch.equal(layer.shared_experts.up_proj.weight, state["shared_experts.up_proj.weight"])


@pytest.mark.parametrize("scheme", ("fp8-tensor", "fp8-channel", "fp8-block"))
def test_high_precision_weights_are_quantized_on_load(scheme, weights_for):
    layer = MoE(num_experts=E, hidden_size=128, intermediate_size=128, top_k=K, quant=scheme, dtype=torch.bfloat16)
    state = weights_for(layer.config)
    layer.load_weights(state)
    for name in ("gate_up_proj", "down_proj"):
        q, s = create_scheme(scheme).quantize_weight(state[name].to(torch.bfloat16))
        assert torch.equal(bits(getattr(layer, name)), bits(q)) and torch.equal(getattr(layer, name + "_scale_inv"), s)


@pytest.mark.parametrize("scheme", ("none", "fp8-tensor", "fp8-channel", "fp8-block"))
def test_state_dict_round_trip(scheme, make_layer):
    """A layer's own state_dict loads into a fresh layer bit-exactly; the two compute the same."""
    a = make_layer(**{**FULL, "hidden_size": 128, "intermediate_size": 128}, quant=scheme, dtype=torch.float32)
    b = MoE(a.config)
    b.load_weights(a.state_dict())
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for name in sa:
        assert torch.equal(bits(sa[name]), bits(sb[name])), name
    x, logits = torch.randn(7, 128), torch.randn(7, E)
    assert torch.equal(a(x, logits), b(x, logits))


# ---------------------------------------------------------------- coded errors
def test_missing_weight_is_mf401(weights_for):
    layer = MoE(**FULL, dtype=torch.float32)
    state = weights_for(layer.config)
    for name in ("down_proj", "e_score_correction_bias", "shared_expert_gate.weight", "shared_experts.up_proj.weight"):
        partial = {k: v for k, v in state.items() if k != name}
        assert name in raises_code("MF401", layer.load_weights, partial)


def test_non_strict_loads_a_subset(weights_for):
    layer = MoE(**FULL, dtype=torch.float32)
    before = layer.down_proj.clone()
    state = weights_for(layer.config)
    layer.load_weights({"gate_up_proj": state["gate_up_proj"], "typo": torch.zeros(1)}, strict=False)
    assert torch.equal(layer.gate_up_proj, state["gate_up_proj"]) and torch.equal(layer.down_proj, before)


@pytest.mark.parametrize("extra", ("gate_proj", "experts.gate_up_proj", "shared_experts.gate_proj.weight",
                                   "e_score_correction_bias"))
def test_unexpected_weight_is_mf403(extra, weights_for):
    """Names of parts the layer was not built with (no shared experts, no bias) or typos."""
    layer = MoE(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K, dtype=torch.float32)
    state = {**weights_for(layer.config), extra: torch.randn(3)}
    assert extra in raises_code("MF403", layer.load_weights, state)


MISSHAPED = {
    # name: (key, make(state) -> tensor)
    "gate_up-without-2x": ("gate_up_proj", lambda s: s["gate_up_proj"][:, :I]),
    "gate_up-wrong-H": ("gate_up_proj", lambda s: torch.randn(E, 2 * I, H + 1)),
    "gate_up-wrong-E": ("gate_up_proj", lambda s: s["gate_up_proj"][:-1]),
    "gate_up-2d": ("gate_up_proj", lambda s: s["gate_up_proj"][0]),
    "down-transposed": ("down_proj", lambda s: s["down_proj"].transpose(1, 2)),
    "bias-wrong-E": ("e_score_correction_bias", lambda s: torch.randn(E + 1)),
    "shared-wrong-size": ("shared_experts.gate_proj.weight", lambda s: torch.randn(S + 1, H)),
    "shared-gate-1d": ("shared_expert_gate.weight", lambda s: torch.randn(H)),
}


@pytest.mark.parametrize("case", MISSHAPED)
def test_misshaped_weight_is_mf402(case, weights_for):
    layer = MoE(**FULL, dtype=torch.float32)
    state = weights_for(layer.config)
    key, make = MISSHAPED[case]
    state[key] = make(state)
    assert key in raises_code("MF402", layer.load_weights, state)


@pytest.mark.parametrize("key", ("gate_up_proj", "e_score_correction_bias", "shared_experts.up_proj.weight",
                                 "shared_expert_gate.weight"))
def test_integer_weight_is_mf404(key, weights_for):
    """An integer tensor is refused by name wherever it is given (it was silently cast for the dense tensors)."""
    layer = MoE(**FULL, dtype=torch.float32)
    state = weights_for(layer.config)
    state[key] = state[key].to(torch.int32)
    assert key in raises_code("MF404", layer.load_weights, state)


@pytest.mark.parametrize("strict", (True, False))
def test_a_shared_weight_under_both_spellings_is_mf403(weights_for, strict):
    """shared_expert.X (Qwen2-MoE) beside shared_experts.X: refused, where the later one silently won."""
    layer = MoE(**FULL, dtype=torch.float32)
    state = weights_for(layer.config)
    state["shared_expert.up_proj.weight"] = torch.randn(S, H)
    text = raises_code("MF403", layer.load_weights, state, strict=strict)
    assert "shared_expert.up_proj.weight (also given as shared_experts.up_proj.weight)" in text


def test_weights_not_a_dict_of_tensors_is_mf404(weights_for):
    import numpy as np
    layer = MoE(**FULL, dtype=torch.float32)
    state = weights_for(layer.config)
    assert "list" in raises_code("MF404", layer.load_weights, list(state.items()))
    state["down_proj"] = np.zeros((E, H, I), dtype=np.float32)
    assert "numpy.ndarray" in raises_code("MF404", layer.load_weights, state)


def test_fp8_scale_of_no_scheme_is_mf402(weights_for):
    layer = MoE(num_experts=E, hidden_size=128, intermediate_size=128, top_k=K, quant="fp8-block")
    state = weights_for(layer.config)
    q, _ = create_scheme("fp8-block").quantize_weight(state["gate_up_proj"])
    state.update(gate_up_proj=q, gate_up_proj_scale_inv=torch.rand(E, 3, 3))
    assert "gate_up_proj_scale_inv" in raises_code("MF402", layer.load_weights, state)


BAD_DTYPE = {
    "int-weight": lambda s: {"gate_up_proj": s["gate_up_proj"].to(torch.int32)},
    "fp8-without-scale": lambda s: {"gate_up_proj": s["gate_up_proj"].to(FP8_DTYPE)},
    "int-scale": lambda s: {"gate_up_proj": s["gate_up_proj"].to(FP8_DTYPE),
                            "gate_up_proj_scale_inv": torch.ones(E, 1, 1, dtype=torch.int32)},
    "scale-for-high-precision": lambda s: {"gate_up_proj_scale_inv": torch.ones(E, 1, 1)},
    "scale-for-high-precision-shared": lambda s: {"shared_experts.up_proj.weight_scale_inv": torch.ones(1)},
    "scaled-e5m2": lambda s: {"gate_up_proj": s["gate_up_proj"].to(torch.float8_e5m2),
                              "gate_up_proj_scale_inv": torch.ones(E, 1, 1)},
}


@pytest.mark.parametrize("case", BAD_DTYPE)
def test_bad_dtype_is_mf404(case, weights_for):
    """A shared weight's scale beside a high-precision weight is refused as an expert's is (it had been dropped); a
    scaled FP8 weight in another format than e4m3fn is named so, not called high-precision."""
    layer = MoE(**FULL, dtype=torch.float32)
    state = weights_for(layer.config)
    state.update(BAD_DTYPE[case](state))
    message = raises_code("MF404", layer.load_weights, state, strict=False)
    assert ("float8_e5m2" in message) == (case == "scaled-e5m2")


def test_meta_tensors_are_mf404(weights_for):
    """Tensors of a lazily built checkpoint (meta device: a shape, no values) are MF404 in load_weights and
    load_state_dict, where torch's copy raised NotImplementedError."""
    layer = MoE(**FULL, dtype=torch.float32)
    meta = {k: v.to("meta") for k, v in weights_for(layer.config).items()}
    assert "meta device" in raises_code("MF404", layer.load_weights, meta)
    for assign in (False, True):
        assert "meta device" in raises_code("MF404", layer.load_state_dict, meta, assign=assign)


def test_fp8_scale_shape_message_names_every_scheme():
    """An FP8 weight's scale of no scheme's shape, into a layer without FP8: the message lists each FP8 scheme's
    shape (it had printed the layer's own scheme's, none's: 'expected []')."""
    layer = MoE(num_experts=E, hidden_size=128, intermediate_size=128, top_k=K, dtype=torch.float32)
    state = {"gate_up_proj": torch.randn(E, 256, 128).to(FP8_DTYPE), "gate_up_proj_scale_inv": torch.tensor(0.01)}
    message = raises_code("MF402", layer.load_weights, state, strict=False)
    assert f"fp8-tensor [{E}]" in message and f"fp8-channel [{E}, 256]" in message and f"fp8-block [{E}, 2, 1]" in message


# ---------------------------------------------------------------- pre-quantized FP8 checkpoints
def fp8_block_checkpoint(e, h, i):
    """A DeepSeek-V3-style checkpoint: float8_e4m3fn weights (all of e4m3's range) with float32
    scale_inv per 128x128 block, [E, ceil(N/128), ceil(K/128)]; and its dequantization, computed here."""
    def one(n, k):
        q = (torch.rand(e, n, k) * 896 - 448).to(FP8_DTYPE)
        scale = torch.rand(e, -(-n // 128), -(-k // 128)) * 1e-3 + 1e-4
        deq = q.float() * scale.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :n, :k]
        return q, scale, deq
    (q13, s13, w13), (q2, s2, w2) = one(2 * i, h), one(h, i)
    state = {"gate_up_proj": q13, "gate_up_proj_scale_inv": s13, "down_proj": q2, "down_proj_scale_inv": s2}
    return state, w13, w2


def test_fp8_block_checkpoint_loads_bit_exactly():
    layer = MoE(num_experts=E, hidden_size=256, intermediate_size=128, top_k=K, quant="fp8-block",
                dtype=torch.bfloat16, runner="reference")
    state, w13, w2 = fp8_block_checkpoint(E, 256, 128)
    assert state["gate_up_proj_scale_inv"].shape == (E, 2, 2) and state["down_proj_scale_inv"].shape == (E, 2, 1)
    layer.load_weights(state)
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(bits(getattr(layer, name)), bits(state[name])), f"{name} was requantized"
        assert torch.equal(getattr(layer, name + "_scale_inv"), state[name + "_scale_inv"])
    x, logits = torch.randn(12, 256).bfloat16(), torch.randn(12, E)
    ids, w = route_for(layer.config, logits)
    from oracle import oracle_moe
    ref = oracle_moe(x, ids, w, w13, w2, "silu", layer.scheme, torch.bfloat16)  # the checkpoint's own numbers
    assert_close(layer(x, logits), ref, rel_tol("fp8-block", torch.bfloat16))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("h,i", ((256, 128), (192, 80)))  # 192, 80: partial blocks (ceil in the scale shape)
def test_fp8_block_checkpoint_into_unquantized_layer(h, i, dtype):
    layer = MoE(num_experts=E, hidden_size=h, intermediate_size=i, top_k=K, quant="none", dtype=dtype)
    state, w13, w2 = fp8_block_checkpoint(E, h, i)
    layer.load_weights(state)
    assert torch.equal(layer.gate_up_proj, w13.to(dtype)) and torch.equal(layer.down_proj, w2.to(dtype))


@pytest.mark.parametrize("scheme", ("fp8-channel", "fp8-tensor"))
def test_fp8_block_checkpoint_into_other_fp8_scheme(scheme):
    """Another FP8 scheme: dequantized, then requantized by the layer's scheme (error within e4m3
    rounding of the checkpoint's values), and the layer runs against the oracle."""
    layer = MoE(num_experts=E, hidden_size=256, intermediate_size=128, top_k=K, quant=scheme, dtype=torch.float32,
                runner="reference")
    state, w13, w2 = fp8_block_checkpoint(E, 256, 128)
    layer.load_weights(state)
    assert layer.gate_up_proj_scale_inv.shape == layer.scheme.weight_scale_shape(E, 256, 256)
    s = layer.scheme
    # stored one expert at a time: the bits of requantizing the whole dequantized weight at once
    q, scale = s.quantize_weight(w13)
    assert torch.equal(bits(layer.gate_up_proj), bits(q)) and torch.equal(layer.gate_up_proj_scale_inv, scale)
    for got, want in ((s.dequantize_weight(layer.gate_up_proj, layer.gate_up_proj_scale_inv), w13),
                      (s.dequantize_weight(layer.down_proj, layer.down_proj_scale_inv), w2)):
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 0.05, rel  # one requantization: a few percent, not garbage
    x, logits = torch.randn(12, 256), torch.randn(12, E)
    ids, w = route_for(layer.config, logits)
    assert_close(layer(x, logits), layer_oracle(layer, x, ids, w), rel_tol(scheme, torch.float32))


def test_fp8_channel_checkpoint_into_fp8_channel_layer():
    layer = MoE(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K, quant="fp8-channel", dtype=torch.float32)
    src = torch.randn(E, 2 * I, H)
    q, scale = create_scheme("fp8-channel").quantize_weight(src)
    q2, scale2 = create_scheme("fp8-channel").quantize_weight(torch.randn(E, H, I))
    layer.load_weights({"gate_up_proj": q, "gate_up_proj_scale_inv": scale, "down_proj": q2,
                        "down_proj_scale_inv": scale2})
    assert torch.equal(bits(layer.gate_up_proj), bits(q)) and torch.equal(layer.gate_up_proj_scale_inv, scale)


def test_fp8_shared_expert_weights_are_dequantized(weights_for):
    """FP8 shared-expert weights (with .weight_scale_inv, 128x128 blocks) load into the dense MLP."""
    layer = MoE(**FULL, dtype=torch.float32)
    state = weights_for(layer.config)
    w = torch.randn(S, H)
    q = (w * 100).to(FP8_DTYPE)
    state["shared_experts.gate_proj.weight"] = q
    state["shared_experts.gate_proj.weight_scale_inv"] = torch.full((1, 1), 0.01)
    layer.load_weights(state)
    assert torch.equal(layer.shared_experts.gate_proj.weight, q.float() * 0.01)


def test_per_channel_scales_with_trailing_singleton_dim(weights_for):
    """Per-channel scales stored [N, 1] (shared experts) or [E, N, 1] (experts), as many HF
    checkpoints do, are recognised as fp8-channel scales."""
    layer = MoE(**FULL, dtype=torch.float32)
    state = weights_for(layer.config)
    ch = create_scheme("fp8-channel")
    q, scale = ch.quantize_weight(torch.randn(1, S, H))
    state["shared_experts.up_proj.weight"] = q[0]
    state["shared_experts.up_proj.weight_scale_inv"] = scale[0][:, None]  # [S, 1]
    qe, se = ch.quantize_weight(torch.randn(FULL["num_experts"], H, FULL["intermediate_size"]))
    state["down_proj"], state["down_proj_scale_inv"] = qe, se[:, :, None]  # [E, H, 1]
    layer.load_weights(state)
    assert torch.equal(layer.shared_experts.up_proj.weight, ch.dequantize_weight(q, scale)[0])
    want = ch.dequantize_weight(qe, se)
    got = layer.scheme.dequantize_weight(layer.down_proj, layer.down_proj_scale_inv)
    assert torch.equal(got, want)  # quant="none" layer: dequantized exactly


# ---------------------------------------------------------------- full-E tensors into a rank's subset
@pytest.fixture
def subset_layer(monkeypatch):
    """A layer that holds experts [1, 3, 4] of 6, as an expert-parallel rank would (simulated in
    one process by overriding the local dispatcher's expert list)."""
    monkeypatch.setattr(LocalDispatcher, "local_experts", property(lambda self: [1, 3, 4]))
    return lambda **kw: MoE(num_experts=6, hidden_size=128, intermediate_size=128, top_k=2, **kw)


def test_full_e_tensors_into_a_subset(subset_layer):
    layer = subset_layer(dtype=torch.float32)
    assert layer.gate_up_proj.shape[0] == 3
    w13, w2 = torch.randn(6, 256, 128), torch.randn(6, 128, 128)
    layer.load_weights({"gate_up_proj": w13, "down_proj": w2})
    assert torch.equal(layer.gate_up_proj, w13[[1, 3, 4]]) and torch.equal(layer.down_proj, w2[[1, 3, 4]])
    layer.load_weights({"gate_up_proj": w13[:3], "down_proj": w2[:3]})  # E_local tensors: as they are
    assert torch.equal(layer.gate_up_proj, w13[:3])
    raises_code("MF402", layer.load_weights, {"gate_up_proj": w13[:5], "down_proj": w2})


def test_full_e_fp8_block_checkpoint_into_a_subset(subset_layer):
    layer = subset_layer(quant="fp8-block", dtype=torch.bfloat16)
    state, _, _ = fp8_block_checkpoint(6, 128, 128)
    layer.load_weights(state)
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(bits(getattr(layer, name)), bits(state[name][[1, 3, 4]]))
        assert torch.equal(getattr(layer, name + "_scale_inv"), state[name + "_scale_inv"][[1, 3, 4]])


@pytest.mark.parametrize("scheme", ("none", "fp8-channel", "fp8-tensor"))
def test_full_e_fp8_block_checkpoint_requantized_into_a_subset(subset_layer, scheme):
    """A full-E checkpoint of another scheme into a rank's subset: each local expert dequantized from its own
    source expert and scale (no [E_local, N, K] copy made first), then stored in the layer's scheme."""
    layer = subset_layer(quant=scheme, dtype=torch.float32)
    state, w13, w2 = fp8_block_checkpoint(6, 128, 128)
    layer.load_weights(state)
    for name, want in (("gate_up_proj", w13), ("down_proj", w2)):
        q, s = layer.scheme.quantize_weight(want[[1, 3, 4]])
        assert torch.equal(bits(getattr(layer, name)), bits(q))
        if s is not None:
            assert torch.equal(getattr(layer, name + "_scale_inv"), s)


# ---------------------------------------------------------------- transformers' own MoE blocks
def randomize(module):
    """transformers leaves expert tensors uninitialized (torch.empty): give everything fresh values."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape) - 0.5)


def from_hf_block(block):
    """(moeflow state, router weight) from a transformers block's own state_dict names."""
    state, gate = {}, None
    for name, value in block.state_dict().items():
        if name == "gate.weight":
            gate = value
        elif name == "gate.e_score_correction_bias":
            state["e_score_correction_bias"] = value
        else:
            state[name.removeprefix("experts.")] = value
    return state, gate


def compare_with_block(block, layer):
    state, gate = from_hf_block(block)
    layer.load_weights(state)
    x = torch.randn(2, 11, layer.config.hidden_size)
    with torch.no_grad():
        want = block(x).reshape(22, -1)
    flat = x.reshape(22, -1)
    assert_close(layer(flat, flat @ gate.T), want.double(), rel_tol("none", torch.float32), what=type(block).__name__)


@pytest.mark.parametrize("norm", (True, False))
def test_matches_transformers_qwen2_moe_block(norm):
    pytest.importorskip("transformers")
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = Qwen2MoeConfig(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                         num_experts_per_tok=3, norm_topk_prob=norm, experts_implementation="eager")
    block = Qwen2MoeSparseMoeBlock(cfg)
    randomize(block)
    layer = MoE(num_experts=8, hidden_size=64, intermediate_size=32, top_k=3, renormalize=norm,
                num_shared_experts=1, shared_intermediate_size=48, shared_expert_gate=True, dtype=torch.float32)
    compare_with_block(block, layer)


def test_matches_transformers_deepseek_v3_block():
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4,
                           n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                           experts_implementation="eager")
    block = DeepseekV3MoE(cfg)
    randomize(block)
    layer = MoE(num_experts=16, hidden_size=64, intermediate_size=32, top_k=4, scoring="sigmoid", num_expert_groups=4,
                topk_groups=2, use_correction_bias=True, routed_scaling_factor=2.5, num_shared_experts=2,
                shared_intermediate_size=32, dtype=torch.float32)
    compare_with_block(block, layer)


def test_matches_transformers_mixtral_block():
    pytest.importorskip("transformers")
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=64, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2,
                        experts_implementation="eager")
    block = MixtralSparseMoeBlock(cfg).eval()
    randomize(block)
    layer = MoE(num_experts=6, hidden_size=64, intermediate_size=48, top_k=2, dtype=torch.float32)
    compare_with_block(block, layer)


def test_init_weights_false_then_load(weights_for):
    """init_weights=False skips the random init; a following load_weights gives the same layer."""
    ref = MoE(**FULL, dtype=torch.float32)
    state = weights_for(ref.config)
    ref.load_weights(state)
    lazy = MoE(ref.config, init_weights=False)
    lazy.load_weights(state)
    x, logits = torch.randn(9, H), torch.randn(9, E)
    assert torch.equal(lazy(x, logits), ref(x, logits))
