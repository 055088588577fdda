"""nn.Module conversions of a built layer: .to(dtype), .half(), .bfloat16(), .float(), .to_empty(), inside a parent
module, and load_state_dict.

A conversion plans the layer again for the new dtype (and device: tests/gpu/test_gpu_runners.py moves a CPU-built
layer to CUDA), with construction's coded errors raised before any tensor changes; FP8 weights and the float32
scales and correction bias keep their dtypes and bits. load_state_dict converts expert weights as load_weights does
(a plain nn.Module would round a bf16 checkpoint into FP8 parameters without scales)."""
import pytest
import torch
from torch import nn

from moeflow import MoE, MoeflowError
from oracle import assert_close, bits, layer_oracle, route_for
from tolerances import rel_tol

SCHEMES = ("none", "fp8-tensor", "fp8-channel", "fp8-block")
E, H, I, K, S = 6, 256, 128, 2, 24  # fp8-block needs multiples of 128
FULL = dict(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K, scoring="sigmoid", use_correction_bias=True,
            num_shared_experts=1, shared_intermediate_size=S, shared_expert_gate=True)
KEPT = ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")


def kept_tensors(layer) -> dict:
    """The parameters whose dtype is the scheme's (FP8 weights, float32 scales, the float32 bias): their bits."""
    names = (KEPT if layer.scheme.quantized else ()) + ("e_score_correction_bias",)
    return {n: (getattr(layer, n).dtype, bits(getattr(layer, n)).clone()) for n in names}


def check_against_oracle(layer, tokens=(0, 1, 7)):
    """Fresh inputs in the layer dtype; outputs poisoned by the caller's fixture; float64 oracle."""
    cfg = layer.config
    for t in tokens:
        x = torch.randn(t, cfg.hidden_size).to(cfg.dtype)
        logits = torch.randn(t, cfg.num_experts)
        out = layer(x, logits)
        assert out.dtype == cfg.dtype and out.shape == (t, cfg.hidden_size)
        ids, w = route_for(cfg, logits, layer.e_score_correction_bias)
        assert_close(out, layer_oracle(layer, x, ids, w), rel_tol(cfg.quant, cfg.dtype), f"T={t}")


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("convert,dtype", [(lambda m: m.half(), torch.float16),
                                           (lambda m: m.to(torch.bfloat16), torch.bfloat16),
                                           (lambda m: m.bfloat16().float(), torch.float32)],
                         ids=("half", "to-bf16", "bf16-then-float"))
def test_dtype_conversion_plans_again_and_keeps_fp8_storage(scheme, convert, dtype, make_layer, poison):
    layer = make_layer(**FULL, quant=scheme, dtype=torch.float32)
    kept, plan = kept_tensors(layer), layer.plan
    assert convert(layer) is layer
    assert layer.config.dtype == dtype and layer.plan is not plan
    assert layer.runner.config.dtype == dtype and layer.dispatcher.config.dtype == dtype
    for name, (dt, b) in kept.items():
        assert getattr(layer, name).dtype == dt and torch.equal(bits(getattr(layer, name)), b), name
    if not layer.scheme.quantized:
        assert layer.gate_up_proj.dtype == dtype
    assert layer.shared_experts.gate_proj.weight.dtype == dtype
    assert f"dtype={str(dtype).removeprefix('torch.')}" in repr(layer)
    check_against_oracle(layer)


@pytest.mark.parametrize("scheme", ("none", "fp8-block"))
def test_refused_conversion_is_coded_and_changes_nothing(scheme, make_layer):
    layer = make_layer(**FULL, quant=scheme, dtype=torch.bfloat16)
    x, logits = torch.randn(5, H).to(torch.bfloat16), torch.randn(5, E)
    before = layer(x, logits)
    state = {k: bits(v).clone() for k, v in layer.state_dict().items()}
    plan = layer.plan
    with pytest.raises(MoeflowError) as info:
        layer.double()  # float64 is no layer dtype
    assert info.value.code == "MF104"
    assert layer.plan is plan and layer.config.dtype == torch.bfloat16
    for k, v in layer.state_dict().items():
        assert torch.equal(bits(v), state[k]), k
    assert torch.equal(layer(x, logits), before)


def test_refused_device_move_is_coded_and_changes_nothing(make_layer):
    """The device path of a conversion on a CPU-only machine: the meta device holds no data (MF106, named first)."""
    layer = make_layer(**FULL, quant="fp8-channel", dtype=torch.float32)
    plan = layer.plan
    with pytest.raises(MoeflowError) as info:
        layer.to("meta")
    assert info.value.code == "MF106" and "the meta device is not supported" in str(info.value)
    assert layer.plan is plan and layer.config.device.type == "cpu"
    assert all(p.device.type == "cpu" for p in layer.parameters())


def test_conversion_of_a_parent_module(make_layer, poison):
    """model.to(dtype) reaches the layer through nn.Module's recursion."""
    model = nn.Sequential(nn.Linear(H, H, bias=False), nn.Identity())
    model.moe = make_layer(**FULL, quant="fp8-block", dtype=torch.float32)
    model.to(torch.float16)
    assert model[0].weight.dtype == torch.float16 and model.moe.config.dtype == torch.float16
    assert model.moe.gate_up_proj.dtype == torch.float8_e4m3fn
    assert model.moe.down_proj_scale_inv.dtype == torch.float32
    check_against_oracle(model.moe, tokens=(3,))


def test_same_dtype_and_device_keeps_the_plan(make_layer):
    layer = make_layer(**FULL, quant="fp8-channel", dtype=torch.bfloat16)
    plan, runner = layer.plan, layer.runner
    layer.to("cpu").to(torch.bfloat16).share_memory()
    assert layer.plan is plan and layer.runner is runner
    assert layer.gate_up_proj.dtype == torch.float8_e4m3fn


def test_to_empty_keeps_fp8_dtypes():
    layer = MoE(**FULL, quant="fp8-block", dtype=torch.bfloat16)
    layer.to_empty(device="cpu")
    assert layer.gate_up_proj.dtype == torch.float8_e4m3fn and layer.gate_up_proj_scale_inv.dtype == torch.float32


def test_device_omitted_is_torchs_default_device(poison):
    """device= omitted takes torch's default device, as nn.Linear's parameters do: the CPU here, and inside a
    meta-device block "meta", refused at build with MF106 (the meta device named first, device= as the fix). A
    layer given device="cpu" inside that block is built on the CPU and runs once outside it."""
    fields = dict(FULL, quant="fp8-channel", dtype=torch.float32)
    assert MoE(**fields).config.device == torch.device("cpu")
    with torch.device("meta"):
        with pytest.raises(MoeflowError) as info:
            MoE(**fields)
        assert info.value.code == "MF106" and "the meta device is not supported" in str(info.value)
        assert "device=" in str(info.value)
        layer = MoE(**fields, device="cpu")
    assert layer.config.device == torch.device("cpu") and layer.gate_up_proj.device.type == "cpu"
    check_against_oracle(layer)


# ---------------------------------------------------------------- load_state_dict
@pytest.mark.parametrize("target", SCHEMES)
@pytest.mark.parametrize("source", ("none", "fp8-block", "fp8-channel"))
def test_load_state_dict_converts_as_load_weights(source, target, make_layer, poison):
    """Any scheme's state_dict into any scheme's layer: the same bits as load_weights of the same dict."""
    src = make_layer(**FULL, quant=source, dtype=torch.bfloat16)
    state = src.state_dict()
    by_state_dict = MoE(**FULL, quant=target, dtype=torch.bfloat16, init_weights=False)
    assert not by_state_dict.load_state_dict(state).missing_keys
    by_weights = MoE(**FULL, quant=target, dtype=torch.bfloat16, init_weights=False)
    by_weights.load_weights(state)
    a, b = by_state_dict.state_dict(), by_weights.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k])), k
    check_against_oracle(by_state_dict, tokens=(4,))


def test_load_state_dict_refusals_are_coded(make_layer):
    fp8 = make_layer(**FULL, quant="fp8-block", dtype=torch.bfloat16)
    plain = MoE(**FULL, dtype=torch.bfloat16)
    no_scale = {k: v for k, v in fp8.state_dict().items() if not k.endswith("_scale_inv")}
    with pytest.raises(MoeflowError) as info:
        plain.load_state_dict(no_scale)
    assert info.value.code == "MF404"
    wrong = dict(plain.state_dict(), down_proj=torch.randn(E, H, I + 1))
    with pytest.raises(MoeflowError) as info:
        fp8.load_state_dict(wrong)
    assert info.value.code == "MF402"


def test_load_state_dict_scale_without_its_weight_is_mf404(make_layer):
    """A partial state_dict with down_proj_scale_inv but not down_proj: refused, where the new scale was put on the
    stale FP8 weight (one process) or failed in torch's size check (an expert-parallel rank)."""
    state = make_layer(**FULL, quant="fp8-block", dtype=torch.bfloat16).state_dict()
    del state["down_proj"]
    layer = MoE(**FULL, quant="fp8-block", dtype=torch.bfloat16)
    before = bits(layer.down_proj_scale_inv).clone()
    with pytest.raises(MoeflowError) as info:
        layer.load_state_dict(state, strict=False)
    assert info.value.code == "MF404" and "down_proj_scale_inv" in str(info.value)
    assert torch.equal(bits(layer.down_proj_scale_inv), before)


def test_load_state_dict_keeps_torch_key_checks(make_layer):
    layer = make_layer(**FULL, quant="fp8-block", dtype=torch.bfloat16)
    state = layer.state_dict()
    partial = {k: v for k, v in state.items() if not k.startswith("down_proj")}  # the weight and its scale
    result = MoE(**FULL, quant="fp8-block", dtype=torch.bfloat16).load_state_dict(partial, strict=False)
    assert result.missing_keys == ["down_proj", "down_proj_scale_inv"] and not result.unexpected_keys
    with pytest.raises(RuntimeError, match="Unexpected key"):
        MoE(**FULL, quant="fp8-block", dtype=torch.bfloat16).load_state_dict(dict(state, extra=torch.zeros(1)))
    # a layer without FP8: an FP8 weight's scale is consumed by the conversion, not reported as unexpected
    result = MoE(**FULL, dtype=torch.bfloat16).load_state_dict(state)
    assert not result.unexpected_keys and not result.missing_keys


def test_load_state_dict_under_a_parent_prefix(make_layer, poison):
    src = make_layer(**FULL, dtype=torch.float32)
    parent = nn.Module()
    parent.block = nn.Module()
    parent.block.moe = MoE(**FULL, quant="fp8-channel", dtype=torch.float32, init_weights=False)
    parent.load_state_dict({"block.moe." + k: v for k, v in src.state_dict().items()})
    assert parent.block.moe.gate_up_proj.dtype == torch.float8_e4m3fn
    check_against_oracle(parent.block.moe, tokens=(5,))


@pytest.mark.parametrize("prefix", ("", "block.moe."))
def test_load_state_dict_reads_shared_experts_as_load_weights(prefix, make_layer, poison):
    """Qwen2-MoE's ``shared_expert.`` spelling and FP8 shared weights with ``.weight_scale_inv`` (block and
    per-channel [S, 1] scales): load_state_dict gives load_weights' bits, under a parent's prefix too, and leaves
    the caller's dict as it was."""
    from moeflow.quant import create_scheme
    src = make_layer(**FULL, dtype=torch.float32)
    state = {k.replace("shared_experts.", "shared_expert."): v for k, v in src.state_dict().items()}
    gate_q, gate_s = create_scheme("fp8-block").quantize_weight(torch.randn(1, S, H))
    down_q, down_s = create_scheme("fp8-channel").quantize_weight(torch.randn(1, H, S))
    state.update({"shared_expert.gate_proj.weight": gate_q[0], "shared_expert.gate_proj.weight_scale_inv": gate_s[0],
                  "shared_expert.down_proj.weight": down_q[0],
                  "shared_expert.down_proj.weight_scale_inv": down_s[0][:, None]})
    given = dict(state)
    by_weights = MoE(**FULL, dtype=torch.float32, init_weights=False)
    by_weights.load_weights(state)
    layer = MoE(**FULL, dtype=torch.float32, init_weights=False)
    target = layer
    if prefix:
        target = nn.Module()
        target.block = nn.Module()
        target.block.moe = layer
    result = target.load_state_dict({prefix + k: v for k, v in state.items()})
    assert not result.missing_keys and not result.unexpected_keys
    assert state.keys() == given.keys() and all(state[k] is given[k] for k in given)
    a, b = layer.state_dict(), by_weights.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k])), k
    assert not torch.equal(layer.shared_experts.gate_proj.weight, src.shared_experts.gate_proj.weight)
    check_against_oracle(layer, tokens=(3,))


def test_load_state_dict_shared_weight_under_both_spellings_is_mf403(make_layer):
    state = make_layer(**FULL, dtype=torch.float32).state_dict()
    state["shared_expert.gate_proj.weight"] = torch.randn(S, H)
    with pytest.raises(MoeflowError) as info:
        MoE(**FULL, dtype=torch.float32).load_state_dict(state)
    assert info.value.code == "MF403" and "also given as shared_experts.gate_proj.weight" in str(info.value)


def test_load_state_dict_fp8_shared_weight_without_scale_is_mf404(make_layer):
    state = make_layer(**FULL, dtype=torch.float32).state_dict()
    state["shared_experts.up_proj.weight"] = state["shared_experts.up_proj.weight"].to(torch.float8_e4m3fn)
    with pytest.raises(MoeflowError) as info:
        MoE(**FULL, dtype=torch.float32).load_state_dict(state)
    assert info.value.code == "MF404" and "shared_experts.up_proj.weight" in str(info.value)


@pytest.mark.parametrize("target", ("none", "fp8-channel"))
def test_load_state_dict_assign_keeps_the_layers_dtypes(target, make_layer, poison):
    """assign=True takes the given tensors instead of copying into the layer's: the expert weights were converted
    already, and the dense ones (shared experts, their gate, the correction bias) now are too, to the layer's dtypes."""
    src = make_layer(**FULL, dtype=torch.bfloat16)
    layer = MoE(**FULL, quant=target, dtype=torch.float32, init_weights=False)
    assert not layer.load_state_dict(src.state_dict(), assign=True).missing_keys
    for name, p in layer.named_parameters():  # float32 but for an FP8 layer's expert weights
        fp8 = layer.scheme.quantized and name in ("gate_up_proj", "down_proj")
        assert p.dtype == (torch.float8_e4m3fn if fp8 else torch.float32), name
    check_against_oracle(layer, tokens=(3,))
