"""The whole layer against the float64 oracle (tests/oracle.py), for every (scheme, runner,
dispatcher, dtype) cell the planner accepts on this CPU machine.

Routing for the oracle comes from the independent Hugging Face-style router (oracle.route_for),
not from moeflow's; FP8 cells compare against the dequantized stored weights with activations
fake-quantized by the layer's scheme. Every torch.empty / empty_like is NaN-poisoned (``poison``).
"""
import random

import pytest
import torch

from moeflow import MoE, MoEConfig
from moeflow.capabilities import Environment
from moeflow.planner import matrix
from oracle import assert_close, layer_oracle, route_for
from tolerances import rel_tol

CPU = Environment("cpu", None, world_size=1)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def accepted_cells():
    """[(scheme, runner, dispatcher, dtype)] the planner accepts on CPU, one process."""
    cells = []
    for dtype in DTYPES:
        template = MoEConfig(num_experts=8, hidden_size=128, intermediate_size=128, top_k=2, dtype=dtype)
        cells += [(s, r, d, dtype) for s, r, d, status in matrix(template, CPU) if status == "ok"]
    return cells


CELLS = accepted_cells()


def cell_id(cell):
    s, r, d, dtype = cell
    return f"{s}-{r}-{d}-{str(dtype).removeprefix('torch.')}"


# Routing/MLP feature sets, each named for the model family whose layer it mimics.
FEATURES = {
    # softmax -> top-2 -> renormalize, SiLU, no shared experts
    "mixtral": dict(num_experts=8, top_k=2, scoring="softmax", renormalize=True, activation="silu"),
    # no renormalization (norm_topk_prob=False), exact GELU, one gated shared expert (Qwen2-MoE)
    "qwen-shared-gate": dict(num_experts=12, top_k=4, scoring="softmax", renormalize=False, activation="gelu",
                             num_shared_experts=1, shared_intermediate_size=48, shared_expert_gate=True),
    # sigmoid, grouped top-k with correction bias, routed scaling, two ungated shared experts, tanh GELU
    "deepseek-v3": dict(num_experts=16, top_k=4, scoring="sigmoid", num_expert_groups=4, topk_groups=2,
                        use_correction_bias=True, routed_scaling_factor=2.5, activation="gelu_tanh",
                        num_shared_experts=2, shared_intermediate_size=32),
}


def sizes(scheme: str, rng: random.Random) -> dict:
    if scheme == "fp8-block":  # 128x128 blocks: H and I multiples of 128
        return dict(hidden_size=rng.choice((128, 256)), intermediate_size=128)
    return dict(hidden_size=rng.choice((64, 96, 128, 200)), intermediate_size=rng.choice((32, 40, 64, 96)))


def check_layer(layer: MoE, num_tokens: int) -> None:
    """Random input through forward and forward_topk, both against the oracle."""
    cfg = layer.config
    x = torch.randn(num_tokens, cfg.hidden_size).to(cfg.dtype)
    logits = torch.randn(num_tokens, cfg.num_experts) * 2
    ids, w = route_for(cfg, logits, layer.e_score_correction_bias)
    ref = layer_oracle(layer, x, ids, w)
    tol = rel_tol(cfg.quant, cfg.dtype)
    out = layer(x, logits)
    assert out.shape == (num_tokens, cfg.hidden_size) and out.dtype == cfg.dtype
    assert_close(out, ref, tol, what=f"forward {layer.plan.runner}/{cfg.quant}/{cfg.dtype}")
    out_topk = layer.forward_topk(x, ids, w)
    assert_close(out_topk, ref, tol, what=f"forward_topk {layer.plan.runner}/{cfg.quant}/{cfg.dtype}")


def test_cpu_accepts_the_expected_cells():
    """Guards the parametrization below against a planner that silently refuses everything."""
    got = {(s, r, dtype) for s, r, _, dtype in CELLS}
    for dtype in DTYPES:
        for scheme in ("none", "fp8-tensor", "fp8-channel", "fp8-block"):
            assert (scheme, "reference", dtype) in got  # the reference runner runs every scheme anywhere
        assert ("none", "grouped_mm", dtype) in got  # torch._grouped_mm has CPU kernels


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("cell", CELLS, ids=cell_id)
def test_layer_matches_oracle(cell, features, make_layer, poison):
    scheme, runner, dispatcher, dtype = cell
    rng = random.Random(f"{cell_id(cell)}-{features}")
    layer = make_layer(**FEATURES[features], **sizes(scheme, rng), quant=scheme, runner=runner,
                       dispatcher=dispatcher, dtype=dtype)
    assert (layer.plan.scheme, layer.plan.runner, layer.plan.dispatcher) == (scheme, runner, dispatcher)
    check_layer(layer, num_tokens=rng.randint(1, 40))


def random_config(rng: random.Random, scheme: str) -> dict:
    """A random but valid layer configuration touching every routing and MLP option."""
    e = rng.choice((4, 6, 8, 12, 16))
    cfg = dict(num_experts=e, activation=rng.choice(("silu", "gelu", "gelu_tanh")),
               routed_scaling_factor=rng.choice((1.0, 1.0, 2.5, 0.7)), **sizes(scheme, rng))
    if rng.random() < 0.5:
        cfg.update(scoring="softmax", renormalize=rng.random() < 0.5)
        groups = [g for g in (1, 2, 4) if e % g == 0]
    else:
        cfg.update(scoring="sigmoid", renormalize=rng.random() < 0.7, use_correction_bias=rng.random() < 0.7)
        groups = [g for g in (1, 2, 4) if e % g == 0 and e // g >= 2]
    g = rng.choice(groups)
    tg = rng.randint(1, g)
    cfg.update(num_expert_groups=g, topk_groups=tg, top_k=rng.randint(1, min(tg * (e // g), 6)))
    if rng.random() < 0.5:
        cfg.update(num_shared_experts=rng.randint(1, 2), shared_intermediate_size=rng.choice((16, 24, 64)),
                   shared_expert_gate=rng.random() < 0.5)
    return cfg


@pytest.mark.parametrize("seed", range(12))
def test_random_configuration_matches_oracle(seed, make_layer, poison):
    rng = random.Random(seed)
    scheme, runner, dispatcher, dtype = rng.choice(CELLS)
    cfg = random_config(rng, scheme)
    layer = make_layer(**cfg, quant=scheme, runner=runner, dispatcher=dispatcher, dtype=dtype)
    check_layer(layer, num_tokens=rng.randint(1, 48))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_runners_agree_with_each_other(dtype, weights_for):
    """grouped_mm and reference on the same weights (quant none): the same numbers up to GEMM order."""
    cfg = MoEConfig(num_experts=6, hidden_size=96, intermediate_size=40, top_k=3, dtype=dtype)
    state = weights_for(cfg)
    layers = [MoE(cfg, runner=r) for r in ("reference", "grouped_mm")]
    for layer in layers:
        layer.load_weights(state)
    x, logits = torch.randn(17, 96).to(dtype), torch.randn(17, 6)
    ref, out = (layer(x, logits) for layer in layers)
    assert_close(out, ref.double(), rel_tol("none", dtype), what="grouped_mm vs reference")


@pytest.mark.parametrize("scheme", ("fp8-tensor", "fp8-channel", "fp8-block"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_tolerance_catches_unquantized_activations(scheme, dtype, make_layer):
    """The FP8 rows of the tolerance table are tight enough to fail a runner that skips the
    activation quantization (so the oracle comparison above can fail for FP8)."""
    from moeflow.quant import create_scheme
    from oracle import dequantized_experts, oracle_moe, rel_err

    layer = make_layer(num_experts=8, hidden_size=128, intermediate_size=128, top_k=2, quant=scheme,
                       runner="reference", dtype=dtype)
    x, logits = torch.randn(32, 128).to(dtype), torch.randn(32, 8)
    ids, w = route_for(layer.config, logits)
    w13, w2 = dequantized_experts(layer)
    fp8_acts = oracle_moe(x, ids, w, w13, w2, "silu", layer.scheme, dtype)
    plain_acts = oracle_moe(x, ids, w, w13, w2, "silu", create_scheme("none"), dtype)
    assert rel_err(plain_acts, fp8_acts) > 1.2 * rel_tol(scheme, dtype)


@pytest.mark.parametrize("scheme", ["none", "fp8-tensor", "fp8-channel", "fp8-block"])
def test_grouped_oracle_is_the_oracle(scheme, make_layer):
    """oracle_moe_grouped (expert by expert, for batches too large to gather) computes what oracle_moe does: the same
    float64 results to rounding, an expert without tokens and one expert with most of them included."""
    from oracle import dequantized_experts, oracle_moe, oracle_moe_grouped
    layer = make_layer(num_experts=7, hidden_size=128, intermediate_size=128, top_k=2, quant=scheme)  # 6: no tokens
    x = torch.randn(23, 128)
    ids = torch.stack([torch.where(torch.rand(23) < 0.7, 0, torch.randint(1, 5, (23,))), torch.randint(1, 5, (23,))], 1)
    ids[ids[:, 0] == ids[:, 1], 1] = 5  # two distinct experts a token; expert 5 only where needed
    w = torch.rand(23, 2)
    args = (x, ids.int(), w, *dequantized_experts(layer), layer.config.activation, layer.scheme, torch.float32)
    torch.testing.assert_close(oracle_moe_grouped(*args), oracle_moe(*args), rtol=1e-12, atol=1e-12)
