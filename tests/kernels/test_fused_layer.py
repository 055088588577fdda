"""The one-launch small-batch layer (kernels/gemm/fused_layer.py) under Triton's CPU interpreter, and how the plan
and the triton runner decide to use it.

The kernel against its torch reference (the same float32 math in the same order: near bit-exact) and against
the float64 oracle (the scheme's tolerance), outputs and intermediates poisoned first, on fresh random data:
fp16 / fp32 / fp8-block / fp8-channel (the interpreter has no bf16: tests/gpu/test_gpu_fused_layer.py), non-power-of-two
sizes with K tails, an expert shared by every token, top-1, T = 0. The interpreter runs programs one after
another in ticket order, so its down items never wait; the GPU suite covers the waiting.
"""
import pytest
import torch

from triton_interp import SKIP_REASON

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))

if SKIP_REASON is None:
    from moeflow.kernels.configs import FusedConfig, GemmConfig, MoEKernelConfig
    from moeflow.kernels.gemm.tiles import fit_fused
    from moeflow.kernels.gemm.fused_layer import FUSED_SCHEMES, counters_size, fused_layer, fused_layer_torch
    from fused_cases import check_fused as check, routing, weights

from moeflow import MoEConfig
from moeflow.capabilities import Environment
from moeflow.planner import plan
from moeflow.quant import create_scheme
from oracle import assert_close


CASES = [("none", torch.float32), ("none", torch.float16), ("fp8-block", torch.float16), ("fp8-block", torch.float32),
         ("fp8-channel", torch.float16), ("fp8-channel", torch.float32)]


@pytest.mark.parametrize("scheme,dtype", CASES, ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("t", [1, 3])
def test_against_references(scheme, dtype, t):
    check(scheme, dtype, t, e=5, h=256, i=128, k=2, cfg=FusedConfig(32, 64, 64, 64, num_stages=2))


@pytest.mark.slow
@pytest.mark.parametrize("splits", [(2, 3), (3, 1), (1, 5)])
@pytest.mark.parametrize("scheme,dtype", [("none", torch.float32), ("fp8-block", torch.float16),
                                          ("fp8-channel", torch.float16)], ids=["none", "fp8-block", "fp8-channel"])
def test_split_k(scheme, dtype, splits):
    """K steps split over programs in either GEMM, the last program of a tile adding the partials: uneven
    splits (3 of 4 gate_up steps), a split with no steps (5 of 4 down steps: I = 256 / 128 x top-2)."""
    check(scheme, dtype, 2, e=5, h=512, i=256, k=2, cfg=FusedConfig(64, 128, 64, 128, split1=splits[0],
                                                                      split2=splits[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_odd_sizes_with_k_tails(dtype):
    """H = 48, I = 40 (not multiples of the 32-wide K steps or 16-wide tiles), 3 experts of 7, top-3."""
    check("none", dtype, 3, e=7, h=48, i=40, k=3, cfg=FusedConfig(16, 32, 16, 32))


@pytest.mark.parametrize("scheme,dtype", [("none", torch.float32), ("fp8-block", torch.float16),
                                          ("fp8-channel", torch.float16)], ids=["none", "fp8-block", "fp8-channel"])
def test_every_token_on_one_expert(scheme, dtype):
    """Expert 2 in every token's top-k (its weights read by every token's copy), the others barely used."""
    check(scheme, dtype, 4, e=6, h=128, i=256, k=2, cfg=FusedConfig(64, 128, 32, 128), one_expert=2)


def test_top_1_and_other_activations():
    for act in ("gelu", "gelu_tanh"):
        check("none", torch.float32, 2, e=4, h=64, i=32, k=1, cfg=FusedConfig(16, 16, 32, 16), activation=act)


def test_no_tokens():
    w13, _, w2, _ = weights("none", torch.float32, 3, 32, 16)
    sync = torch.zeros(2, dtype=torch.int32)  # counters_size(0, ...) would be 2: nothing launched
    out = fused_layer(torch.randn(0, 32), torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, 2), w13, None, w2,
                      None, "none", "silu", torch.float32, FusedConfig(16, 16, 16, 16), sync, poison=True)
    assert out.shape == (0, 32)


def test_counters_reused_across_launches():
    """The counters one launch leaves are the next launch's: three launches of different T on one buffer."""
    w13, _, w2, _ = weights("none", torch.float32, 4, 64, 32)
    cfg = FusedConfig(16, 32, 16, 32, split1=2, split2=2)
    sync = torch.zeros(counters_size(5, 2, 64, 32, cfg), dtype=torch.int32)
    for t in (5, 1, 3):
        x = torch.randn(t, 64)
        ids, w = routing(t, 4, 2)
        out = fused_layer(x, ids, w, w13, None, w2, None, "none", "silu", torch.float32, cfg, sync, poison=True)
        assert_close(out, fused_layer_torch(x, ids, w, w13, None, w2, None, "none", "silu", torch.float32), 1e-6,
                     f"T={t}")
        assert torch.equal(sync, torch.zeros_like(sync))


def test_too_few_counters_refused():
    w13, _, w2, _ = weights("none", torch.float32, 4, 64, 32)
    cfg = FusedConfig(16, 32, 16, 32, split2=2)
    ids, w = routing(3, 4, 2)
    with pytest.raises(ValueError, match="counters"):
        fused_layer(torch.randn(3, 64), ids, w, w13, None, w2, None, "none", "silu", torch.float32, cfg,
                    torch.zeros(counters_size(3, 2, 64, 32, cfg) - 1, dtype=torch.int32))


def test_runner_declares_the_kernels_schemes():
    from moeflow.experts.triton import TritonRunner
    assert TritonRunner.caps.fused_layer == frozenset(FUSED_SCHEMES)


def test_fit_fused():
    assert fit_fused(FusedConfig(8, 8, 256, 64), "fp8-block") == FusedConfig(16, 128, 128, 128)
    assert fit_fused(FusedConfig(8, 8, 256, 64), "none") == FusedConfig(16, 16, 256, 64)
    assert fit_fused(FusedConfig(32, 16, 32, 16, num_stages=0), "fp8-tensor").block_k1 == 32
    assert fit_fused(FusedConfig(split1=0, split2=-1), "none") == FusedConfig(split1=1, split2=1)


def test_table_entry_round_trip():
    entry = MoEKernelConfig(GemmConfig(16, 64, 128), GemmConfig(16, 64, 128), FusedConfig(32, 128, 64, 128, 4, 5))
    assert MoEKernelConfig.from_dict(entry.to_dict()) == entry
    plain = MoEKernelConfig(GemmConfig(16, 64, 128), GemmConfig(16, 64, 128))
    assert "fused" not in plain.to_dict() and MoEKernelConfig.from_dict(plain.to_dict()) == plain


def test_runner_fused_config_from_the_table():
    from moeflow.experts.base import ExpertWeights
    from moeflow.experts.triton import FUSED_MAX_TOKENS, TritonRunner
    cfg = MoEConfig(num_experts=4, hidden_size=128, intermediate_size=128, top_k=2, quant="fp8-block")
    runner = TritonRunner(cfg, create_scheme("fp8-block"))
    fused = FusedConfig(64, 64, 256, 64)
    runner._table = {1: MoEKernelConfig(GemmConfig(16, 64, 128), GemmConfig(16, 64, 128), fused),
                     64: MoEKernelConfig(GemmConfig(64, 128, 128), GemmConfig(64, 128, 128))}
    w = ExpertWeights(torch.zeros(4, 256, 128), torch.zeros(4, 128, 128))
    assert runner.fused_config(1, w) == fit_fused(fused, "fp8-block")
    assert runner.fused_config(2, w) == fit_fused(fused, "fp8-block")  # nearest entry: T=1
    assert runner.fused_config(32, w) is None  # nearest entry T=64 has no fused tiles
    assert runner.fused_config(0, w) is None and runner.fused_config(FUSED_MAX_TOKENS + 1, w) is None


def test_fused_launch_switched_off(monkeypatch):
    from moeflow.experts.base import ExpertWeights
    from moeflow.experts.triton import TritonRunner
    cfg = MoEConfig(num_experts=4, hidden_size=128, intermediate_size=128, top_k=2)
    runner = TritonRunner(cfg, create_scheme("none"))
    runner._table = {}  # no tuned file: the documented defaults, fused tiles at T=1
    w = ExpertWeights(torch.zeros(4, 256, 128), torch.zeros(4, 128, 128))
    assert runner.fused_config(1, w) is not None and runner.fused_config(2, w) is None
    monkeypatch.setenv("MOEFLOW_TRITON_FUSED", "0")
    assert runner.fused_config(1, w) is None


def test_default_tiles_fuse_one_token_of_the_measured_schemes():
    """Without a tuned file the one launch runs at T=1 for none and fp8-block (measured faster on H200), not for
    fp8-channel (measured no faster: a tuned entry may set it) nor fp8-tensor (the kernel has no such scheme)."""
    from moeflow.kernels.gemm.tiles import default_config
    for scheme, fused in (("none", True), ("fp8-block", True), ("fp8-channel", False), ("fp8-tensor", False)):
        assert (default_config(1, 8, 128, scheme).fused is not None) == fused, scheme
        assert default_config(2, 8, 128, scheme).fused is None


def test_plan_fuses_only_declared_cells():
    env = Environment("cuda", (9, 0))
    base = dict(num_experts=8, hidden_size=256, intermediate_size=128, top_k=2, device="cpu")
    for scheme in ("none", "fp8-channel", "fp8-block"):
        p = plan(MoEConfig(**base, quant=scheme, runner="triton", dispatcher="local"), env)
        assert p.fused_layer and any("one 'triton' launch" in r for r in p.reasons)
    for scheme in ("fp8-tensor",):  # the kernel has no such scheme (its scales span the batch): separate launches
        assert not plan(MoEConfig(**base, quant=scheme, runner="triton", dispatcher="local"), env).fused_layer
    for runner in ("grouped_mm", "reference"):  # runners that declare no fused layer
        assert not plan(MoEConfig(**base, runner=runner, dispatcher="local"), env).fused_layer
    ep = Environment("cuda", (9, 0), world_size=2)  # expert parallelism: the dispatch moves tokens
    assert not plan(MoEConfig(**base, runner="triton", dispatcher="alltoall"), ep).fused_layer
