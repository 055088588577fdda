"""The GPU architectures as the planner sees them (moeflow.targets): which runners build where, weight-only FP8 where
there are no FP8 tensor cores, the "compiled" grade's reason and its once-per-process warning, MF210 on a GPU no
kernel is built for, and the kernel choice's per-target rules (shared-memory budgets, TMA, Gluon)."""
import warnings

import pytest
import torch

from moeflow import MoEConfig, planner
from moeflow.capabilities import Environment
from moeflow.kernels.configs import GemmConfig
from moeflow.kernels.gemm import tiles
from moeflow.planner import check_runner, plan
from moeflow.quant import create_scheme
from moeflow.targets import BY_ARCH, TARGETS, nearest, target_of

FP8 = ["fp8-tensor", "fp8-channel", "fp8-block"]


def config(quant="none", dtype=torch.bfloat16):
    return MoEConfig(num_experts=8, hidden_size=256, intermediate_size=256, top_k=2, quant=quant, dtype=dtype)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.arch)
@pytest.mark.parametrize("quant", ["none", *FP8])
def test_triton_builds_on_every_target(target, quant):
    p = plan(config(quant), Environment("cuda", target.capability))
    assert p.runner == "triton" and p.router == "triton", p
    assert p.weight_only == (quant != "none" and not target.fp8_dots)
    assert p.fused_layer == (quant != "fp8-tensor" and not p.weight_only)  # it dots FP8 activations (no fp8-tensor)
    assert bool(p.unvalidated) == (not target.validated)
    if p.unvalidated:
        assert target.arch in p.unvalidated and "moeflow selftest" in p.unvalidated and p.unvalidated in p.reasons
    if p.weight_only:
        assert any("weight-only FP8" in r and "no FP8 tensor cores" in r for r in p.reasons), p.reasons


def test_only_hopper_is_validated_and_fp8_dots_from_ada():
    assert [t.arch for t in TARGETS if t.validated] == ["sm_90"]
    assert [t.arch for t in TARGETS if not t.fp8_dots] == ["sm_80", "sm_86"]
    assert [t.arch for t in TARGETS if t.gluon] == ["sm_90"]
    for t in TARGETS:
        assert t.tile_budget < t.shared_bytes and target_of(t.capability) is t
    assert nearest((10, 3)) is BY_ARCH["sm_100"] and nearest((12, 1)) is BY_ARCH["sm_120"]
    assert nearest((7, 5)) is BY_ARCH["sm_80"] and target_of((10, 3)) is None


@pytest.mark.parametrize("cc", [(10, 3), (11, 0), (12, 1)])
def test_a_gpu_no_kernel_is_built_for_is_mf210(cc, monkeypatch):
    err = check_runner("triton", config(), Environment("cuda", cc))
    assert err.code == "MF210" and "sm_80, sm_86, sm_89, sm_90, sm_100, sm_120" in str(err)
    assert f"sm_{cc[0]}{cc[1]}" in str(err) and "valid runners here: ['reference']" in str(err)
    assert plan(config(), Environment("cuda", cc)).runner == "reference"
    monkeypatch.setenv("MOEFLOW_ALLOW_UNVALIDATED_GPU", "1")
    p = plan(config("fp8-block"), Environment("cuda", cc))
    assert p.runner == "triton" and "no kernels are built for it" in p.unvalidated and not p.weight_only


def test_older_gpus_are_mf204():
    err = check_runner("triton", config(), Environment("cuda", (7, 5)))
    assert err.code == "MF204" and "8.0" in str(err)


def test_unvalidated_warning_once_per_process(monkeypatch):
    monkeypatch.setattr(planner, "_warned_unvalidated", set())
    p = plan(config(), Environment("cuda", (8, 6)))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        planner.warn_unvalidated(p)
        planner.warn_unvalidated(p)
        planner.warn_unvalidated(plan(config(), Environment("cuda", (9, 0))))
    assert len(seen) == 1 and "sm_86" in str(seen[0].message) and "moeflow selftest" in str(seen[0].message)


@pytest.mark.parametrize("quant", FP8)
def test_weight_only_scheme_keeps_weights_and_leaves_activations(quant):
    inner, wo = create_scheme(quant), create_scheme(quant, weight_only=True)
    assert wo.name == quant and wo.quantized and not wo.activations_quantized and inner.activations_quantized
    w = torch.randn(2, 256, 256)
    q, s = wo.quantize_weight(w)
    q2, s2 = inner.quantize_weight(w)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    assert wo.weight_scale_shape(2, 256, 256) == inner.weight_scale_shape(2, 256, 256)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    xq, xs = wo.quantize_activation(x)
    assert xq is x and xs is None and torch.equal(wo.fake_quantize_activation(x), x.float())
    assert create_scheme("none", weight_only=True).name == "none"  # nothing to do without FP8 weights


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90", "sm_120"])
def test_tiles_fit_each_targets_budget(arch):
    """tiles.fit drops stages (then halves a tile) until the operand ring fits the target's tile budget."""
    budget = BY_ARCH[arch].tile_budget
    for cfg, pair in ((GemmConfig(128, 256, 64, 8, 8, 5), True), (GemmConfig(128, 256, 128, 8, 8, 6), False)):
        for elem in (1, 2, 4):
            f = tiles.fit(cfg, fused_pair=pair, scheme="none" if elem > 1 else "fp8-channel", elem_bytes=elem,
                          n_size=4096, budget=budget)
            ring = f.num_stages * (f.block_m * f.block_k + (2 if pair else 1) * f.block_k * f.block_n) * elem
            assert ring <= budget, (arch, cfg, elem, f)


def test_kernel_arch_forces_the_kernel_rules(monkeypatch):
    """MOEFLOW_KERNEL_ARCH makes the kernel choice follow that target's rules: no Gluon off sm_90, no TMA on Ampere."""
    from moeflow.kernels.common import tma_rows
    from moeflow.kernels.gemm.choice import _gluon_blocker
    from moeflow.targets import kernel_target
    cpu = torch.device("cpu")
    assert kernel_target(cpu).arch == "interpreter"
    monkeypatch.setenv("MOEFLOW_KERNEL_ARCH", "sm_80")
    assert kernel_target(cpu) is BY_ARCH["sm_80"] and not tma_rows(torch.zeros(4, 64), 64)
    monkeypatch.setenv("MOEFLOW_KERNEL_ARCH", "sm_100")
    assert tma_rows(torch.zeros(4, 64), 64)
    assert "no Gluon kernel runs on cpu" in _gluon_blocker(cpu)


def test_amd_gpus_are_refused_the_triton_backends():
    """A ROCm device (torch's "cuda") gets MF211 for the Triton runner and router, whatever capability it reports (an
    MI250's 9.0 is an H100's); the reference runner and the torch router serve it, FP8 as the scheme says."""
    for cc, arch in (((9, 4), "gfx942"), ((9, 0), "gfx90a")):
        env = Environment("cuda", cc, rocm=arch)
        err = check_runner("triton", config("fp8-block"), env)
        assert err.code == "MF211" and arch in str(err) and "valid runners here: ['reference']" in str(err)
        p = plan(config("fp8-block"), env)
        assert (p.runner, p.router, p.weight_only, p.unvalidated) == ("reference", "torch", False, "")
        assert "skipped triton (MF211)" in str(p) and f"{arch} (ROCm)" in p.environment
        assert check_runner("grouped_mm", config(), env).code == "MF211"
