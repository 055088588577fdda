"""Bad input: each user mistake raises its coded error (and the builtin a Python user expects),
before any kernel runs; NaN in the input propagates and is never hidden."""
import math

import pytest
import torch

from moeflow import MoE, MoEConfig, MoeflowError
from oracle import assert_close, layer_oracle

E, H, I, K, T = 6, 32, 16, 2, 9
EXPECTED_BUILTIN = {"MF301": ValueError, "MF302": TypeError, "MF303": TypeError, "MF304": ValueError,
                    "MF305": ValueError}


@pytest.fixture(scope="module")
def layer():
    return MoE(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K, dtype=torch.float32)


def raises_code(code, fn, *args):
    with pytest.raises(MoeflowError) as info:
        fn(*args)
    assert info.value.code == code, str(info.value)
    if code in EXPECTED_BUILTIN:
        assert isinstance(info.value, EXPECTED_BUILTIN[code])
    return str(info.value)


def good():
    ids = torch.rand(T, E).topk(K, dim=1).indices
    return torch.randn(T, H), torch.randn(T, E), ids, torch.rand(T, K)


# ---------------------------------------------------------------- forward inputs
FORWARD_BAD = {
    # name: (code, make(x, logits) -> (x, logits))
    "hidden-wrong-H": ("MF301", lambda x, l: (torch.randn(T, H + 1), l)),
    "hidden-3d": ("MF301", lambda x, l: (x[None], l)),
    "hidden-1d": ("MF301", lambda x, l: (x[0], l)),
    "logits-wrong-E": ("MF301", lambda x, l: (x, torch.randn(T, E + 1))),
    "logits-wrong-T": ("MF301", lambda x, l: (x, torch.randn(T + 1, E))),
    "hidden-fp16": ("MF302", lambda x, l: (x.half(), l)),
    "hidden-int": ("MF302", lambda x, l: (x.int(), l)),
    "hidden-not-a-tensor": ("MF302", lambda x, l: (x.tolist(), l)),
    "logits-int": ("MF302", lambda x, l: (x, l.long())),
    "hidden-other-device": ("MF303", lambda x, l: (x.to("meta"), l)),
    "logits-other-device": ("MF303", lambda x, l: (x, l.to("meta"))),
}


@pytest.mark.parametrize("case", FORWARD_BAD)
def test_forward_rejects(layer, case):
    code, make = FORWARD_BAD[case]
    x, logits, _, _ = good()
    raises_code(code, layer, *make(x, logits))


def test_forward_accepts_any_float_logits(layer):
    x, logits, _, _ = good()
    ref = layer(x, logits)
    assert torch.equal(layer(x, logits.double()), ref)  # routing runs in float32 either way


FORWARD_TOPK_BAD = {
    # name: (code, make(x, ids, w) -> (x, ids, w))
    "ids-wrong-K": ("MF301", lambda x, i, w: (x, torch.cat([i, i[:, :1]], 1), w)),
    "weights-wrong-K": ("MF301", lambda x, i, w: (x, i, w[:, :1])),
    "ids-wrong-T": ("MF301", lambda x, i, w: (x, i[:-1], w)),
    "weights-1d": ("MF301", lambda x, i, w: (x, i, w[:, 0])),
    "hidden-bf16": ("MF302", lambda x, i, w: (x.bfloat16(), i, w)),
    "ids-float": ("MF302", lambda x, i, w: (x, i.float(), w)),
    "ids-bool": ("MF302", lambda x, i, w: (x, i > 2, w)),
    "weights-int": ("MF302", lambda x, i, w: (x, i, i)),
    "ids-other-device": ("MF303", lambda x, i, w: (x, i.to("meta"), w)),
    "weights-other-device": ("MF303", lambda x, i, w: (x, i, w.to("meta"))),
    "id-too-large": ("MF304", lambda x, i, w: (x, _set(i, 4, 1, E), w)),
    "id-negative": ("MF304", lambda x, i, w: (x, _set(i, 0, 0, -1), w)),
    "duplicate-expert": ("MF305", lambda x, i, w: (x, _set(i, 3, 1, int(i[3, 0])), w)),
}


def _set(ids, row, col, value):
    ids = ids.clone()
    ids[row, col] = value
    return ids


@pytest.mark.parametrize("case", FORWARD_TOPK_BAD)
def test_forward_topk_rejects(layer, case):
    code, make = FORWARD_TOPK_BAD[case]
    x, _, ids, w = good()
    msg = raises_code(code, layer.forward_topk, *make(x, ids, w))
    if case == "id-too-large":
        assert f"0..{E - 1}" in msg and str(E) in msg
    if case == "duplicate-expert":
        assert "token 3" in msg


def test_meta_device_is_a_stand_in_for_another_device(layer):
    """MF303 is simulated with the meta device on CPU-only machines; the message names both."""
    x, logits, _, _ = good()
    msg = raises_code("MF303", layer, x.to("meta"), logits)
    assert "meta" in msg and "cpu" in msg


def test_validation_can_be_switched_off(monkeypatch):
    """MOEFLOW_VALIDATE_INPUTS=0 skips the checks (the id check reads ids on the host): a row that
    repeats an expert then simply counts it twice."""
    monkeypatch.setenv("MOEFLOW_VALIDATE_INPUTS", "0")
    layer = MoE(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K, dtype=torch.float32, runner="reference")
    x, _, ids, w = good()
    ids = _set(ids, 3, 1, int(ids[3, 0]))
    assert_close(layer.forward_topk(x, ids, w), layer_oracle(layer, x, ids, w), 1e-5)


# ---------------------------------------------------------------- NaN propagates, never hidden
@pytest.mark.parametrize("scheme,runner,row_local", (
    ("none", "reference", True), ("none", "grouped_mm", True), ("fp8-channel", "reference", True),
    ("fp8-block", "reference", True),
    ("fp8-tensor", "reference", False),  # one scale for the whole tensor: every row becomes NaN
))
def test_nan_input_propagates(scheme, runner, row_local, make_layer, poison):
    layer = make_layer(num_experts=E, hidden_size=128, intermediate_size=128, top_k=K, quant=scheme, runner=runner,
                       dtype=torch.float32, num_shared_experts=1, shared_intermediate_size=16)
    x, logits = torch.randn(T, 128), torch.randn(T, E)
    clean = layer(x, logits)
    assert not clean.isnan().any()
    x[3, 5] = float("nan")
    out = layer(x, logits)
    assert out[3].isnan().all()  # the poisoned token's row is NaN, not zero, not finite
    if row_local:
        others = torch.arange(T) != 3
        assert not out[others].isnan().any()
        torch.testing.assert_close(out[others], clean[others], rtol=1e-6, atol=1e-6)
    else:
        assert out.isnan().all()


# ---------------------------------------------------------------- configuration errors
BASE = dict(num_experts=8, hidden_size=64, intermediate_size=32, top_k=2)
CONFIG_BAD = {
    # name: (code, changes, text the message must contain)
    "zero-experts": ("MF101", dict(num_experts=0), "num_experts=0"),
    "negative-hidden": ("MF101", dict(hidden_size=-64), "hidden_size=-64"),
    "float-intermediate": ("MF101", dict(intermediate_size=32.0), "intermediate_size=32.0"),
    "bool-top-k": ("MF101", dict(top_k=True), "top_k=True"),
    "top-k-above-E": ("MF101", dict(top_k=9), "top_k=9"),
    "zero-capacity": ("MF101", dict(max_tokens_per_rank=0), "max_tokens_per_rank=0"),
    "negative-shared": ("MF101", dict(num_shared_experts=-1), "num_shared_experts=-1"),
    "shared-count-without-size": ("MF101", dict(num_shared_experts=1), "shared_intermediate_size=0"),
    "shared-size-without-count": ("MF101", dict(shared_intermediate_size=16), "shared_intermediate_size=16"),
    "shared-gate-without-shared": ("MF101", dict(shared_expert_gate=True), "shared_expert_gate"),
    "unknown-scoring": ("MF102", dict(scoring="relu"), "'relu'"),
    "unknown-activation": ("MF102", dict(activation="swiglu"), "'swiglu'"),
    "unknown-quant": ("MF102", dict(quant="int4"), "'int4'"),
    "unknown-dispatch-payload": ("MF102", dict(dispatch_payload="int8"), "'int8'"),
    "string-switch": ("MF102", dict(renormalize="no"), "renormalize='no'"),  # would read as True
    "none-switch": ("MF102", dict(shared_expert_gate=None), "shared_expert_gate=None"),
    "groups-not-dividing-E": ("MF103", dict(num_expert_groups=3), "num_expert_groups=3"),
    "zero-topk-groups": ("MF103", dict(num_expert_groups=4, topk_groups=0), "topk_groups=0"),
    "topk-groups-above-groups": ("MF103", dict(num_expert_groups=2, topk_groups=3), "topk_groups=3"),
    "kept-groups-too-small": ("MF103", dict(num_expert_groups=4, topk_groups=1, top_k=3), "fewer than top_k=3"),
    "fraction-topk-groups": ("MF103", dict(num_expert_groups=2, topk_groups=1.5), "topk_groups must be an integer"),
    "string-topk-groups": ("MF103", dict(num_expert_groups=2, topk_groups="1"), "topk_groups must be an integer"),
    "bool-groups": ("MF103", dict(num_expert_groups=True), "num_expert_groups=True"),
    "bias-with-one-expert-groups": ("MF103", dict(num_expert_groups=8, topk_groups=2, scoring="sigmoid",
                                                  use_correction_bias=True), "two"),
    "int-dtype": ("MF104", dict(dtype=torch.int8), "int8"),
    "fp8-dtype": ("MF104", dict(dtype=torch.float8_e4m3fn), "float8_e4m3fn"),
    "float64-dtype": ("MF104", dict(dtype=torch.float64), "float64"),
    "unknown-dtype-name": ("MF104", dict(dtype="fp8"), "'fp8'"),
    "zero-scaling": ("MF105", dict(routed_scaling_factor=0.0), "routed_scaling_factor=0.0"),
    "nan-scaling": ("MF105", dict(routed_scaling_factor=math.nan), "routed_scaling_factor=nan"),
    "inf-scaling": ("MF105", dict(routed_scaling_factor=math.inf), "routed_scaling_factor=inf"),
    "string-scaling": ("MF105", dict(routed_scaling_factor="2.5"), "'2.5'"),
    "bool-scaling": ("MF105", dict(routed_scaling_factor=True), "routed_scaling_factor=True"),
    "bias-with-softmax": ("MF105", dict(use_correction_bias=True), "use_correction_bias"),
    "unparsable-device": ("MF106", dict(device="tpu:x"), "'tpu:x'"),
}


@pytest.mark.parametrize("build", ("MoEConfig", "MoE"))
@pytest.mark.parametrize("case", CONFIG_BAD)
def test_config_rejects(case, build):
    code, changes, text = CONFIG_BAD[case]
    with pytest.raises(MoeflowError) as info:
        (MoEConfig if build == "MoEConfig" else MoE)(**{**BASE, **changes})
    err = info.value
    assert err.code == code and isinstance(err, ValueError), str(err)
    assert text in str(err), f"message does not name the offending value ({text}): {err}"


PLACEMENT_BAD = {
    # name: (placement for E=8, text the message must contain)
    "short": ((0,) * 7, "7 entries"),
    "negative": ((0,) * 7 + (-1,), "rank -1"),
    "fraction": ((0,) * 7 + (0.5,), "0.5"),
    "string": ("00000000", "'00000000'"),
    "scalar": (0, "is 0"),
    "other-rank-in-one-process": ((0,) * 7 + (1,), "one process"),  # forgot torchrun: refused, not ignored
}


@pytest.mark.parametrize("case", PLACEMENT_BAD)
def test_bad_placement_is_mf504(case):
    placement, text = PLACEMENT_BAD[case]
    with pytest.raises(MoeflowError) as info:
        MoE(**BASE, placement=placement)
    assert info.value.code == "MF504" and text in str(info.value), str(info.value)


@pytest.mark.parametrize("placement", (None, (0, 1, 2)))
def test_fewer_experts_than_ranks_names_the_fix(placement):
    """3 experts over 4 ranks: no placement works (one rank per expert leaves a rank without); MF504 says to use a
    smaller group, where it named no way out (checked on the placement itself: a 4-rank group is a test_ep_cpu job)."""
    from moeflow import MoEConfig
    from moeflow.dispatch._ep_base import expert_placement
    cfg = MoEConfig(num_experts=3, hidden_size=64, intermediate_size=32, top_k=2, placement=placement)
    with pytest.raises(MoeflowError) as info:
        expert_placement(cfg, 4)
    assert info.value.code == "MF504" and "at most 3 ranks" in str(info.value), str(info.value)


def test_numpy_numbers_are_read_as_python_numbers():
    """numpy integers for the sizes and a numpy float for the scaling factor, as a config parsed from arrays gives."""
    import numpy as np
    cfg = MoEConfig(num_experts=np.int64(8), hidden_size=np.int32(64), intermediate_size=np.uint16(32),
                    top_k=np.int8(2), num_expert_groups=np.int64(2), topk_groups=np.int64(1),
                    routed_scaling_factor=np.float32(2.5))
    assert cfg == MoEConfig(**BASE, num_expert_groups=2, topk_groups=1, routed_scaling_factor=2.5)
    assert type(cfg.num_experts) is int and type(cfg.routed_scaling_factor) is float


def test_config_that_is_not_a_moeconfig_is_mf101():
    with pytest.raises(MoeflowError) as info:
        MoE(dict(BASE))
    assert info.value.code == "MF101" and "MoE(**fields)" in str(info.value)


def test_cpu_index_is_the_cpu():
    """device="cpu:0" (torch's CPU tensors carry no index) is the CPU: the layer runs CPU tensors."""
    for device in ("cpu:0", torch.device("cpu", 0)):
        layer = MoE(**BASE, dtype=torch.float32, device=device)
        assert layer.config.device == torch.device("cpu")
        assert layer(torch.randn(3, 64), torch.randn(3, 8)).shape == (3, 64)


def test_coded_errors_survive_pickle_and_copy():
    """A worker process's coded error reaches its pool's caller as the same error (pickled), not a TypeError."""
    import copy
    import pickle
    with pytest.raises(MoeflowError) as info:
        MoE(**{**BASE, "top_k": 9})
    for again in (pickle.loads(pickle.dumps(info.value)), copy.copy(info.value), copy.deepcopy(info.value)):
        assert type(again) is type(info.value) and again.code == "MF101"
        assert str(again) == str(info.value) and again.detail == info.value.detail


def test_switches_and_placements_of_other_types_are_read():
    """numpy / 0-1 switches and integer placements of numpy or torch are taken as the bools and ints they are."""
    import numpy as np
    cfg = MoEConfig(**BASE, renormalize=np.bool_(False), placement=np.zeros(8, dtype=np.int64))
    assert cfg.renormalize is False and cfg.placement == (0,) * 8
    cfg = MoEConfig(**BASE, renormalize=0, placement=torch.zeros(8, dtype=torch.int32))
    assert cfg.renormalize is False and cfg.placement == (0,) * 8 and type(cfg.placement[0]) is int
    assert MoE(**BASE, placement=[0] * 8).config.placement == (0,) * 8  # one process: every expert on rank 0


def test_cuda_device_without_cuda_is_mf106():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: a CUDA device is valid here")
    with pytest.raises(MoeflowError) as info:
        MoE(**BASE, device="cuda")
    assert info.value.code == "MF106" and "not available" in str(info.value)


def test_cuda_index_past_the_devices_is_mf106(monkeypatch):
    """device="cuda:N" naming a GPU the machine does not have: MF106 at build, naming the valid range, instead of
    torch's "invalid device ordinal" from the first tensor (a one-GPU machine is simulated here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(MoeflowError) as info:
        MoEConfig(**BASE, device="cuda:1")
    assert info.value.code == "MF106" and "cuda:0 to cuda:0" in str(info.value)
    assert MoEConfig(**BASE, device="cuda:0").device == torch.device("cuda", 0)


def test_valid_dtype_names_are_accepted():
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("float32", torch.float32),
                        ("torch.bfloat16", torch.bfloat16), (torch.float16, torch.float16)):
        assert MoEConfig(**BASE, dtype=name).dtype == dtype


# ---------------------------------------------------------------- ExpertsPath (weights the caller owns)
def test_experts_path_inputs_are_checked():
    """moeflow.integrations.path.ExpertsPath checks a call's inputs and weights as a layer checks its own."""
    from moeflow.experts import ExpertWeights
    from moeflow.integrations.path import ExpertsPath
    path = ExpertsPath(MoEConfig(**BASE, dtype=torch.float32))
    x, ids, w = torch.randn(3, 64), torch.tensor([[0, 1], [2, 3], [1, 7]]), torch.rand(3, 2)
    good = ExpertWeights(torch.randn(8, 64, 64), torch.randn(8, 64, 32))
    assert path(x, ids, w, good).shape == (3, 64)
    bad = {
        "hidden dtype": ("MF302", (x.bfloat16(), ids, w, good), "hidden"),
        "hidden size": ("MF301", (torch.randn(3, 60), ids, w, good), "[T, 64]"),
        "ids columns": ("MF301", (x, torch.zeros(3, 3, dtype=torch.int64), torch.rand(3, 3), good), "topk_ids"),
        "ids dtype": ("MF302", (x, ids.float(), w, good), "integer"),
        "w13 shape": ("MF301", (x, ids, w, ExpertWeights(torch.randn(8, 60, 64), good.w2)), "[8, 64, 64]"),
        "w2 experts": ("MF301", (x, ids, w, ExpertWeights(good.w13, torch.randn(7, 64, 32))), "[8, 64, 32]"),
        "weight dtype": ("MF302", (x, ids, w, ExpertWeights(good.w13.half(), good.w2.half())), "weights.w13"),
        "scale without FP8": ("MF302", (x, ids, w, ExpertWeights(good.w13, good.w2, torch.ones(8), torch.ones(8))),
                              "w13_scale"),
    }
    for case, (code, args, text) in bad.items():
        with pytest.raises(MoeflowError) as info:
            path(*args)
        assert info.value.code == code and text in str(info.value), f"{case}: {info.value}"
    # an expert-parallel rank (valid_below): more id columns than its plan's top_k, ids >= valid_below dropped
    more = torch.tensor([[0, 9, 1], [8, 2, 3], [9, 9, 4]])
    assert path(x, more, torch.rand(3, 3), good, valid_below=8).shape == (3, 64)


# ---------------------------------------------------------------- gradients (inference only)
def test_backward_through_an_eager_layer_is_mf307():
    """With grad mode on and an input or weight that requires grad, a call runs as without grad (the same bits) and
    its output's backward raises MF307, instead of gradients stopping silently at the layer."""
    from moeflow.experts import ExpertWeights
    from moeflow.integrations.path import ExpertsPath
    layer = MoE(**BASE, dtype=torch.float32)
    x, logits = torch.randn(5, 64), torch.randn(5, 8)
    with torch.no_grad():
        want = layer(x, logits)
    ids, w = torch.stack([torch.randperm(8)[:2] for _ in range(5)]), torch.rand(5, 2)
    calls = {
        "hidden requires grad": lambda: layer(x.clone().requires_grad_(), logits),
        "logits require grad": lambda: layer(x, logits.clone().requires_grad_()),
        "routing weights require grad": lambda: layer.forward_topk(x, ids, w.clone().requires_grad_()),
    }
    for what, call in calls.items():
        out = call()
        assert out.requires_grad, what
        if "topk" not in what and "routing" not in what:
            assert torch.equal(out, want), what
        with pytest.raises(MoeflowError) as info:
            out.sum().backward()
        assert info.value.code == "MF307", what
    layer.requires_grad_(True)  # weights that require grad (fine-tuning the experts is not supported)
    with pytest.raises(MoeflowError):
        layer(x, logits).sum().backward()
    with torch.no_grad():
        assert layer(x, logits).grad_fn is None
    path = ExpertsPath(layer.config)
    weights = ExpertWeights(layer.gate_up_proj, layer.down_proj)  # require grad, as a transformers module's do
    with pytest.raises(MoeflowError) as info:
        path(x, ids, w, weights).sum().backward()
    assert info.value.code == "MF307" and "moeflow.experts" in str(info.value)


# ---------------------------------------------------------------- id dtypes
def test_every_integer_id_dtype_is_read_alike_and_others_are_mf302():
    """forward_topk and ExpertsPath accept the same id dtypes (all of torch's integer ones) and give int64 ids' bits;
    bool, floating and complex ids are MF302 naming the accepted dtypes, at both entries."""
    from moeflow.experts import ExpertWeights
    from moeflow.integrations.path import ExpertsPath
    from moeflow.layer import ID_DTYPES
    layer = MoE(**BASE, dtype=torch.float32)
    path = ExpertsPath(layer.config)
    weights = ExpertWeights(layer.gate_up_proj, layer.down_proj)
    x, w = torch.randn(4, 64), torch.rand(4, 2)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(4)])  # int64
    want_layer, want_path = layer.forward_topk(x, ids, w), path(x, ids, w, weights)
    for dtype in ID_DTYPES:
        assert torch.equal(layer.forward_topk(x, ids.to(dtype), w), want_layer), dtype
        assert torch.equal(path(x, ids.to(dtype), w, weights), want_path), dtype
    for dtype in (torch.bool, torch.float32, torch.complex64):
        for call in (lambda i: layer.forward_topk(x, i, w), lambda i: path(x, i, w, weights)):
            with pytest.raises(MoeflowError) as info:
                call(ids.to(dtype))
            assert info.value.code == "MF302" and "uint16" in str(info.value), dtype
