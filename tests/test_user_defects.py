"""Five defects a new user found, each pinned by a test (CPU, fast, fresh random data):

1. runner "auto" on a CPU without bf16 / fp16 matrix instructions picks the reference runner (grouped_mm's bf16 /
   fp16 was measured 2-5x slower there), and the plan says why; elsewhere (and on CUDA) it picks as before;
2. load_weights refuses shared-expert names (scales included) on a layer without shared experts (MF403), and a scale
   given without its weight (MF404);
3. the meta device (torch's default inside ``with torch.device("meta")``, or passed) and device types no backend runs
   on are MF106 at construction, naming the meta device and device= first;
4. transformers experts that are not gated (Nemotron-H: up_proj / down_proj) are MF704 at the first bind, not an
   AttributeError;
5. the neighbours: .to("meta"), .to_empty(device="meta"), moeflow check --device meta, load_state_dict's lone scale.
"""
import pytest
import torch
from torch import nn

from moeflow import MoE, MoEConfig, MoeflowError, capabilities
from moeflow.capabilities import Environment
from moeflow.cli import main
from moeflow.planner import plan
from moeflow.quant import create_scheme
from oracle import assert_close, layer_oracle, route_for
from tolerances import rel_tol

E, H, I, K, S = 4, 64, 32, 2, 24
BASE = dict(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K)

AVX2 = frozenset({"avx", "avx2", "fma3", "f16c"})  # this machine's kind: no bf16 / fp16 matrix instructions
SAPPHIRE = AVX2 | {"avx512_f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16"}


def raises_code(code, fn, *args, **kwargs):
    with pytest.raises(MoeflowError) as info:
        fn(*args, **kwargs)
    assert info.value.code == code, str(info.value)
    return str(info.value)


def runner_reason(p) -> str:
    return next(r for r in p.reasons if r.startswith("runner "))


# ---------------------------------------------------------------- 1. CPU "auto" runner by measured speed
@pytest.fixture
def cpu_has(monkeypatch):
    """cpu_has(features): the CPU feature query Environment.detect makes answers ``features``."""
    def set_(features):
        monkeypatch.setattr(capabilities, "cpu_features", lambda: frozenset(features))
    return set_


@pytest.mark.parametrize("dtype,lacking", [(torch.bfloat16, "AVX512-BF16"), (torch.float16, "AVX512-FP16")], ids=str)
def test_auto_picks_reference_for_half_precision_on_an_avx2_cpu(cpu_has, dtype, lacking, make_layer):
    cpu_has(AVX2)
    layer = make_layer(**BASE, dtype=dtype)
    assert layer.plan.runner == "reference", layer.plan
    why = runner_reason(layer.plan)
    assert why.startswith("runner 'auto' -> 'reference': grouped_mm's") and f"no {lacking}" in why, why
    assert "measured" in why and "x slower than 'reference'" in why, why
    assert why in str(layer.plan) and "environment: cpu (avx2)" in str(layer.plan)
    x = torch.randn(5, H, dtype=dtype)
    logits = torch.randn(5, E)
    ref = layer_oracle(layer, x, *route_for(layer.config, logits))
    assert_close(layer(x, logits), ref, rel_tol("none", dtype), "auto -> reference")
    explicit = MoE(**BASE, dtype=dtype, runner="grouped_mm")  # a named runner is still honoured
    assert explicit.plan.runner == "grouped_mm"


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_auto_keeps_grouped_mm_where_the_cpu_has_the_instructions(cpu_has, dtype):
    cpu_has(SAPPHIRE)
    layer = MoE(**BASE, dtype=dtype)
    assert layer.plan.runner == "grouped_mm" and "highest priority" in runner_reason(layer.plan)
    cpu_has(AVX2 | {"avx512_bf16", "amx_bf16"})  # bf16 instructions only: fp16 still goes to the reference runner
    want = "grouped_mm" if dtype == torch.bfloat16 else "reference"
    assert MoE(**BASE, dtype=dtype).plan.runner == want


def test_auto_float32_and_cuda_choices_unchanged(cpu_has):
    cpu_has(AVX2)
    assert MoE(**BASE, dtype=torch.float32).plan.runner == "grouped_mm"  # measured as fast or faster in fp32
    cfg = MoEConfig(**BASE, dtype=torch.bfloat16)
    for cc in ((9, 0), (8, 0), (10, 0)):  # the rule is the CPU's: CUDA picks as it did
        cuda = Environment("cuda", cc)
        assert plan(cfg, cuda).runner == plan(cfg, Environment("cuda", cc, cpu_features=AVX2)).runner
    assert plan(cfg, Environment("cuda", (9, 0))).runner == "triton"
    # a hypothetical CPU (the matrix's): its features unknown, the declared priority stands
    assert plan(cfg, Environment("cpu")).runner == "grouped_mm"
    assert plan(cfg, Environment("cpu", cpu_features=AVX2)).runner == "reference"


def test_this_machines_cpu_is_read():
    """Environment.detect reads this CPU's features; the choice follows torch's own answer for AVX512-BF16."""
    env = Environment.detect(torch.device("cpu"))
    assert env.cpu_features == capabilities.cpu_features()
    assert ("avx512_bf16" in env.cpu_features) == torch.cpu._is_avx512_bf16_supported()
    assert ("avx2" in env.cpu_features) == torch.cpu._is_avx2_supported()
    bf16_fast = bool({"avx512_bf16", "amx_bf16", "bf16", "sve_bf16"} & env.cpu_features)
    want = "grouped_mm" if bf16_fast else "reference"
    assert MoE(**BASE, dtype=torch.bfloat16).plan.runner == want


def test_check_prints_why(cpu_has, capsys):
    cpu_has(AVX2)
    assert main(["check", "--device", "cpu", "--dtype", "bfloat16", "--preset", "small"]) == 0
    out = capsys.readouterr().out
    assert "runner:      reference" in out and "grouped_mm's bfloat16 on this CPU (no AVX512-BF16" in out
    cpu_has(SAPPHIRE)
    assert main(["check", "--device", "cpu", "--dtype", "bfloat16", "--preset", "small"]) == 0
    assert "runner:      grouped_mm" in capsys.readouterr().out


# ---------------------------------------------------------------- 2. load_weights: stray names
@pytest.mark.parametrize("name", ["shared_experts.gate_proj.weight_scale_inv",
                                  "shared_experts.up_proj.weight_scale_inv",
                                  "shared_experts.down_proj.weight_scale_inv",
                                  "shared_expert.gate_proj.weight_scale_inv"])  # Qwen2-MoE's spelling too
def test_shared_scale_on_a_layer_without_shared_experts_is_mf403(name, weights_for):
    layer = MoE(**BASE, dtype=torch.float32)
    before = layer.gate_up_proj.clone()
    state = weights_for(layer.config)
    state[name] = torch.rand(1)
    msg = raises_code("MF403", layer.load_weights, state)
    assert name.replace("shared_expert.", "shared_experts.") in msg
    assert "shared_experts" not in msg.split("valid names:")[1]  # no shared name offered as valid
    assert torch.equal(layer.gate_up_proj, before)  # refused before anything loads
    layer.load_weights(state, strict=False)  # strict=False: names the layer has not are left out, as documented
    assert torch.equal(layer.gate_up_proj, state["gate_up_proj"])


def test_shared_scales_still_load_where_shared_experts_exist(weights_for):
    layer = MoE(**BASE, num_shared_experts=1, shared_intermediate_size=S, dtype=torch.float32)
    state = weights_for(layer.config)
    w = state["shared_experts.gate_proj.weight"]
    q, s = create_scheme("fp8-channel").quantize_weight(w[None])
    state["shared_experts.gate_proj.weight"], state["shared_experts.gate_proj.weight_scale_inv"] = q[0], s[0]
    layer.load_weights(state)
    want = create_scheme("fp8-channel").dequantize_weight(q, s)[0]
    assert torch.equal(layer.shared_experts.gate_proj.weight, want)


@pytest.mark.parametrize("shared", (False, True))
def test_scale_without_its_weight_is_mf404(shared, weights_for):
    """strict=False keeps missing weights as they are, but a scale alone would be read onto a stale weight."""
    if shared:
        layer = MoE(**BASE, num_shared_experts=1, shared_intermediate_size=S, dtype=torch.float32)
    else:
        layer = MoE(num_experts=E, hidden_size=128, intermediate_size=128, top_k=K, quant="fp8-block")
    name = "shared_experts.up_proj.weight_scale_inv" if shared else "down_proj_scale_inv"
    state = {name: torch.rand(1)}
    assert "given without" in raises_code("MF404", layer.load_weights, state, strict=False)
    if shared:  # load_state_dict reads it as load_weights does (the expert weights' scales already were)
        assert "given without" in raises_code("MF404", layer.load_state_dict, state, strict=False)


# ---------------------------------------------------------------- 3 + 5. devices
def test_meta_device_block_is_mf106_naming_meta_first():
    with torch.device("meta"):
        msg = raises_code("MF106", MoE, **BASE)
        layer = MoE(**BASE, device="cpu", dtype=torch.float32)  # device= given: built on the CPU
    head = msg.split("] ", 1)[1]
    assert head.startswith("device='meta' is invalid: the meta device is not supported"), msg
    assert "device=" in head.split("not supported", 1)[1] and "alltoall" not in msg
    assert layer.gate_up_proj.device.type == "cpu"


@pytest.mark.parametrize("device", ["meta", torch.device("meta"), "meta:0"], ids=str)
def test_meta_device_passed_is_mf106(device):
    assert "the meta device is not supported" in raises_code("MF106", MoE, **BASE, device=device)
    assert "the meta device is not supported" in raises_code("MF106", MoEConfig, **BASE, device=device)


@pytest.mark.parametrize("device", ["mps", "xla", "hpu"])
def test_device_type_no_backend_runs_on_is_mf106(device):
    msg = raises_code("MF106", MoE, **BASE, device=device)
    assert f"does not run on device type {device!r}" in msg and "['cpu', 'cuda']" in msg


def test_moving_a_layer_to_meta_is_mf106_and_changes_nothing(make_layer):
    layer = make_layer(**BASE, dtype=torch.float32)
    p, w = layer.plan, layer.gate_up_proj.clone()
    raises_code("MF106", layer.to, "meta")
    raises_code("MF106", layer.to_empty, device="meta")
    assert layer.plan is p and layer.config.device.type == "cpu" and torch.equal(layer.gate_up_proj, w)


def test_check_refuses_meta_with_mf106(capsys):
    assert main(["check", "--device", "meta"]) == 2
    err = capsys.readouterr().err
    assert "MF106" in err and "the meta device is not supported" in err and "MF209" not in err
    assert main(["explain", "MF106"]) == 0
    assert 'torch.device("meta")' in capsys.readouterr().out


# ---------------------------------------------------------------- 4. transformers experts that are not gated
@pytest.fixture(scope="module")
def nemotron_h():
    """A tiny random Nemotron-H (one MoE layer, one attention layer) from transformers' own config class (built once:
    the first import of transformers' modeling code takes seconds here, as in test_hf_integration)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "NemotronHConfig"):
        pytest.skip("this transformers has no Nemotron-H")
    cfg = transformers.NemotronHConfig(
        vocab_size=260, hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=E,
        num_experts_per_tok=K, moe_intermediate_size=I, moe_shared_expert_intermediate_size=I, n_shared_experts=1,
        layers_block_type=["moe", "full_attention"], n_group=1, topk_group=1, use_cache=False)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def test_nemotron_h_experts_are_mf704_not_attribute_error(nemotron_h):
    from moeflow.integrations.hf import prepare_experts
    model = nemotron_h
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        want = model(ids).logits
    model.set_experts_implementation("moeflow")
    for call in (lambda: prepare_experts(model), lambda: model(ids)):  # at load time, and on the first forward
        with torch.no_grad():
            msg = raises_code("MF704", call)
        assert "NemotronHExperts" in msg and "has_gate=False" in msg and "up_proj [4, 32, 64]" in msg, msg
        assert "no gate_up_proj" in msg and "grouped_mm" in msg
    model.set_experts_implementation("eager")  # the model is left as it was
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)


def _toy(flags, **tensors):
    transformers = pytest.importorskip("transformers")
    from transformers.activations import ACT2FN
    from transformers.integrations.moe import use_experts_implementation

    class ToyExperts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            for name, shape in tensors.items():
                setattr(self, name, nn.Parameter(torch.randn(*shape)))
            self.act_fn = ACT2FN["silu"]

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise AssertionError("an experts implementation should have run instead")
    config = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E)
    config._experts_implementation = "moeflow"
    return use_experts_implementation(ToyExperts, **flags)(config)


@pytest.mark.parametrize("flags,tensors,feature", [
    (dict(has_gate=False), dict(up_proj=(E, I, H), down_proj=(E, H, I)), "has_gate=False"),
    (dict(), dict(w13=(E, 2 * I, H), w2=(E, H, I)), "without gate_up_proj / down_proj (its tensors: w13"),
    (dict(), dict(gate_up_proj=(E, 2 * I, H), w2=(E, H, I)), "without down_proj"),
], ids=["not-gated", "other-names", "no-down"])
def test_fake_experts_of_another_layout_are_mf704(flags, tensors, feature):
    module = _toy(flags, **tensors)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(3)])
    msg = raises_code("MF704", module, torch.randn(3, H), ids, torch.rand(3, K))
    assert "ToyExperts" in msg and feature in msg, msg
