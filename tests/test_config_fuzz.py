"""The promise over random configurations, not only the registry's standard shapes: every configuration moeflow
accepts runs right, and every one it refuses is refused when the layer is built, with a coded error.

Each seed draws a few hundred configurations (odd sizes down to 1, every scheme, runner, dispatcher, routing form,
activation and dtype, shared experts) and builds each. A refusal must be a MoeflowError with a catalogued code; an
accepted layer must run forward (T = 0, 1, 7, 33) and forward_topk within the scheme's tolerance of the float64 oracle,
its outputs poisoned first, one token all zeros (padding). Found this way: torch._grouped_mm on the CPU needs 16-byte
rows, which the runner did not declare, so a layer with hidden_size=100 in bf16 was accepted and raised inside torch
at its first call."""
import random

import pytest
import torch

from moeflow import MoE, MoeflowError
from moeflow.errors import CATALOGUE
from oracle import assert_close, layer_oracle, route_for
from tolerances import rel_tol

CONFIGS_PER_SEED = 600


def draw(rng: random.Random) -> dict:
    e = rng.choice([1, 2, 3, 5, 8, 16])
    f = dict(num_experts=e, top_k=rng.randint(1, e),
             hidden_size=rng.choice([1, 2, 3, 4, 8, 12, 16, 100, 128, 136, 256, 384]),
             intermediate_size=rng.choice([1, 4, 5, 8, 24, 64, 128, 200, 256]),
             quant=rng.choice(["none", "fp8-tensor", "fp8-channel", "fp8-block"]),
             runner=rng.choice(["auto", "reference", "grouped_mm", "triton"]),
             dispatcher=rng.choice(["auto", "auto", "local", "alltoall"]),
             dtype=rng.choice([torch.float32, torch.bfloat16, torch.float16]),
             scoring=rng.choice(["softmax", "sigmoid"]), renormalize=rng.random() < 0.5,
             activation=rng.choice(["silu", "gelu", "gelu_tanh"]),
             routed_scaling_factor=rng.choice([1.0, 1.0, 2.5]))
    g = rng.choice([1, 1, 2, 4])
    if g > 1:
        f.update(num_expert_groups=g, topk_groups=rng.randint(1, g))
    if f["scoring"] == "sigmoid" and rng.random() < 0.5:
        f["use_correction_bias"] = True
    if rng.random() < 0.3:
        f.update(num_shared_experts=rng.randint(1, 2), shared_intermediate_size=rng.choice([3, 32]),
                 shared_expert_gate=rng.random() < 0.5)
    return f


def check_layer(layer: MoE, what: str) -> None:
    cfg = layer.config
    if cfg.use_correction_bias:
        with torch.no_grad():
            layer.e_score_correction_bias.copy_(torch.rand(cfg.num_experts) - 0.5)
    for t in (0, 1, 7, 33):
        x = torch.randn(t, cfg.hidden_size).to(cfg.dtype)
        if t > 1:
            x[t // 2] = 0  # a padding token: an FP8 scale of zero must not divide by zero
        logits = torch.randn(t, cfg.num_experts) * 2
        out = layer(x, logits)
        assert out.shape == (t, cfg.hidden_size) and out.dtype == cfg.dtype, what
        tol = rel_tol(cfg.quant, cfg.dtype, out.numel())  # one FP8 step for few elements (tests/tolerances.py)
        ids, w = route_for(cfg, logits, layer.e_score_correction_bias)
        want = layer_oracle(layer, x, ids, w)
        assert_close(out, want, tol, f"{what} T={t}")
        assert_close(layer.forward_topk(x, ids, w), want, tol, f"{what} forward_topk T={t}")


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_every_accepted_configuration_runs_and_every_refusal_is_coded(seed, poison):
    rng = random.Random(seed)
    accepted, codes = 0, set()
    for n in range(CONFIGS_PER_SEED):
        fields = draw(rng)
        what = f"seed {seed} #{n}: {fields}"
        try:
            layer = MoE(**fields)
        except MoeflowError as err:
            assert err.code in CATALOGUE, what
            codes.add(err.code)
            continue
        accepted += 1
        check_layer(layer, what)
    # the draw must exercise both sides: many layers run, and the planner's refusals of several kinds
    assert accepted >= CONFIGS_PER_SEED // 8, accepted
    assert {"MF203", "MF206"} <= codes, codes
