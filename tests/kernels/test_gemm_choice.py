"""The kernel choice of the two GEMMs (moeflow/kernels/gemm/choice.py): preference order, the architecture and
layout rules, and a tuned kernel a call cannot run (a warning once, then the Triton kernel)."""
import warnings

import pytest
import torch

from moeflow.kernels.configs import GemmConfig
from moeflow.kernels.gemm import choice
from moeflow.kernels.gemm.choice import CallFacts, GemmKernel, decide_down, decide_gate_up

OK = {GemmKernel.GLUON_WGMMA: None, GemmKernel.GLUON_WARP_SPECIALIZED: None}
WGMMA_GATE_UP = GemmConfig(64, 128, 128, 8, 4, 4, scale_overlap=1)
WS_DOWN = GemmConfig(128, 128, 64, 8, 4, 5, warp_specialize=1)


def facts(scheme="fp8-block", rows=512, k=2048, masked=False, float32=False, gluon=None, blockers=OK, tma=True):
    return CallFacts(rows, k, scheme, masked, float32, gluon, dict(blockers).get, tma, tma)


@pytest.fixture(autouse=True)
def _fresh_warnings():
    choice._warned.clear()


def test_tuned_gluon_kernels_run_where_they_can():
    assert decide_gate_up(WGMMA_GATE_UP, facts()).kernel is GemmKernel.GLUON_WGMMA
    assert decide_gate_up(WGMMA_GATE_UP, facts()).rows_in_order  # rows by index are copied in order first
    ws = GemmConfig(64, 128, 64, 8, 4, 5, warp_specialize=1)
    assert decide_gate_up(ws, facts("none")).kernel is GemmKernel.GLUON_WARP_SPECIALIZED
    assert decide_down(WS_DOWN, facts("none", k=768), 2048).kernel is GemmKernel.GLUON_WARP_SPECIALIZED


def test_down_prefers_warp_specialized_then_wgmma_then_persistent():
    both = GemmConfig(64, 128, 128, 8, 4, 4, scale_overlap=1, warp_specialize=1, programs_per_sm=2)
    assert decide_down(both, facts(k=768), 2048).kernel is GemmKernel.GLUON_WARP_SPECIALIZED
    wgmma = GemmConfig(64, 128, 128, 8, 4, 4, scale_overlap=1, programs_per_sm=2)
    assert decide_down(wgmma, facts(k=768), 2048).kernel is GemmKernel.GLUON_WGMMA_PERSISTENT  # 4 stages <= 6 steps
    assert decide_down(wgmma, facts(k=384), 2048).kernel is GemmKernel.GLUON_WGMMA  # 4 stages > 3 steps: per tile
    persistent = GemmConfig(64, 128, 128, 8, 4, 4, programs_per_sm=2)
    assert decide_down(persistent, facts(k=768), 2048).kernel is GemmKernel.TRITON_PERSISTENT
    assert decide_down(persistent, facts(k=768, tma=False), 2048).kernel is GemmKernel.TRITON
    assert decide_down(persistent, facts("none", k=768, float32=True), 2048).kernel is GemmKernel.TRITON
    assert decide_down(persistent, facts(k=768, masked=True), 2048).kernel is GemmKernel.TRITON


def test_split_k():
    split = GemmConfig(16, 64, 128, 1, 4, 4, split_k=4)
    got = decide_down(split, facts("none", k=2048), 2048)
    assert (got.kernel, got.split_k) == (GemmKernel.TRITON_SPLIT_K, 4)
    assert decide_down(split, facts("none", k=256), 2048).split_k == 2  # no more programs than K steps
    assert decide_gate_up(split, facts("none", rows=0), ).kernel is GemmKernel.TRITON  # an empty batch: one program
    assert decide_gate_up(split, facts("none")).kernel is GemmKernel.TRITON_SPLIT_K


def test_architecture_and_masked_batches_run_triton_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cpu = decide_gate_up(WGMMA_GATE_UP, facts(gluon="no Gluon kernel runs on cpu"))
        assert cpu.kernel is GemmKernel.TRITON and "cpu" in cpu.reason
        masked = decide_down(WS_DOWN, facts("none", masked=True), 2048)
        assert masked.kernel is GemmKernel.TRITON and "masked" in masked.reason


def test_a_tuned_kernel_the_call_cannot_run_warns_once_and_runs_triton():
    blocked = {GemmKernel.GLUON_WGMMA: "I=700 or H=2048 not a multiple of 128", GemmKernel.GLUON_WARP_SPECIALIZED: None}
    with pytest.warns(UserWarning, match="gluon-wgmma cannot run this call .I=700"):
        got = decide_gate_up(WGMMA_GATE_UP, facts(blockers=blocked))
    assert got.kernel is GemmKernel.TRITON and "I=700" in got.reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        decide_gate_up(WGMMA_GATE_UP, facts(blockers=blocked))


def test_gate_up_falls_through_to_warp_specialized():
    both = GemmConfig(64, 128, 128, 8, 4, 4, scale_overlap=1, warp_specialize=1)
    blocked = {GemmKernel.GLUON_WGMMA: "scales not contiguous along K", GemmKernel.GLUON_WARP_SPECIALIZED: None}
    with pytest.warns(UserWarning):
        assert decide_gate_up(both, facts(blockers=blocked)).kernel is GemmKernel.GLUON_WARP_SPECIALIZED


def test_choose_on_tensors_off_hopper():
    from moeflow.kernels.common import RowLayout
    from moeflow.layouts import offsets_from_counts
    x = torch.randn(8, 256).to(torch.float8_e4m3fn)
    w = torch.randn(2, 512, 256).to(torch.float8_e4m3fn)
    layout = RowLayout(False, offsets_from_counts(torch.tensor([3, 5])), 2, 0, 8)
    got = choice.choose_gate_up(x, torch.ones(8, 2), w, torch.ones(2, 4, 2), layout, "fp8-block", WGMMA_GATE_UP)
    assert got.kernel is GemmKernel.TRITON and "cpu" in got.reason


def test_describe_kernels_names_both_gemms():
    from moeflow import MoEConfig
    from moeflow.experts.triton import TritonRunner
    from moeflow.quant import create_scheme
    cfg = MoEConfig(num_experts=8, hidden_size=256, intermediate_size=128, top_k=2, quant="fp8-block",
                    dtype=torch.bfloat16, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tuned table for this shape on this CPU
        text = TritonRunner(cfg, create_scheme("fp8-block")).describe_kernels(128, 8, masked=False, fused=False)
    assert text.startswith("gate_up triton ") and "; down triton " in text
