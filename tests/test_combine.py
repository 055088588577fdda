"""The combine in the experts' stage (Plan.fused_combine, TritonRunner.run_combined, kernels/down.Combine) under
Triton's CPU interpreter, and how the plan and the runner decide to use it.

On a GPU the warp-specialized down sums each token's copies in its epilogue (kernels/warp_specialized._combine_tile:
tests/gpu/test_gpu_warp_specialized.py). No other down kernel does, so here (the interpreter never runs Gluon) the
runner sums after its down launch with reduce.moe_sum: these tests hold that path, which every non-warp-specialized
batch takes on a GPU too, to the local dispatcher's combine bit for bit, on fresh random data with the outputs
poisoned first: fp16 / fp32 / fp8, one token, every token's first choice one expert, top-1 with every token on one
expert (the others with none), non-power-of-two sizes, and an empty batch.
"""
import pytest
import torch

from triton_interp import SKIP_REASON

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))

if SKIP_REASON is None:
    from moeflow.experts.triton import TritonRunner
    from moeflow.kernels.configs import GemmConfig, MoEKernelConfig
    from moeflow.kernels.down import Combine

from moeflow import MoEConfig
from moeflow.capabilities import Environment
from moeflow.planner import plan
from oracle import assert_close, layer_oracle
from tolerances import rel_tol

ALIGNED = dict(num_experts=4, hidden_size=128, intermediate_size=128, top_k=2)
ODD = dict(num_experts=3, hidden_size=48, intermediate_size=40, top_k=2)


def configs(scheme):
    return MoEKernelConfig(GemmConfig(16, 128 if scheme == "fp8-block" else 32, 64), GemmConfig(16, 32, 64))


def routed(t, e, k, one_expert=False):
    ids = torch.rand(t, e).argsort(dim=1)[:, :k]
    if one_expert:  # every token's first choice is expert e - 1; with k < e some expert may get nothing
        ids = torch.rand(t, e).add(3.0 * (torch.arange(e) == e - 1)).argsort(dim=1, descending=True)[:, :k]
    return ids.to(torch.int32), torch.rand(t, k) + 0.1


def indexed_layer(make_layer, fields, scheme, dtype):
    layer = make_layer(**fields, quant=scheme, dtype=dtype, runner="reference")
    layer.dispatcher.indexed_rows = True  # as with the triton runner: copy_rows and source_rows in the batch
    return layer, TritonRunner(layer.config, layer.scheme)


@pytest.mark.parametrize("scheme,dtype", [("none", torch.float32), ("none", torch.float16),
                                          ("fp8-channel", torch.float32), ("fp8-block", torch.float16)], ids=str)
@pytest.mark.parametrize("t,fields,one_expert", [(9, ALIGNED, False), (1, ALIGNED, False), (7, ODD, True),
                                                 (5, dict(ODD, top_k=1), True)], ids=str)
def test_combined_is_the_dispatchers_combine(make_layer, scheme, dtype, t, fields, one_expert):
    if scheme == "fp8-block" and fields["hidden_size"] % 128:
        fields = dict(fields, hidden_size=128, intermediate_size=128)  # fp8-block needs multiples of 128
    layer, runner = indexed_layer(make_layer, fields, scheme, dtype)
    x = torch.randn(t, layer.config.hidden_size).to(dtype)
    ids, w = routed(t, layer.config.num_experts, layer.config.top_k, one_expert)
    batch, handle = layer.dispatcher.dispatch(x, ids, w)
    weights = layer.expert_weights()
    separate = layer.dispatcher.combine(runner.run_with(batch, weights, configs(scheme), poison=True), handle)
    combined = runner.run_with(batch, weights, configs(scheme), poison=True, combine=True)
    assert combined.shape == (t, layer.config.hidden_size) and combined.dtype == dtype
    assert torch.equal(combined, separate)  # no NaN survives: every element written, the same bits
    assert_close(combined, layer_oracle(layer, x, ids, w), rel_tol(scheme, dtype), f"{scheme} {dtype}")


def test_empty_batch_combines_to_zero_rows(make_layer):
    layer, runner = indexed_layer(make_layer, ALIGNED, "none", torch.float32)
    batch, _ = layer.dispatcher.dispatch(torch.randn(0, 128), torch.zeros(0, 2, dtype=torch.int32),
                                         torch.zeros(0, 2))
    out = runner.run_with(batch, layer.expert_weights(), configs("none"), poison=True, combine=True)
    assert out.shape == (0, 128)


def test_run_combined_chooses_its_batches(make_layer, monkeypatch):
    """run_combined sums a sorted batch given by index with MOEFLOW_TRITON_COMBINE=1; with the switch at its
    default (0), or rows gathered (no copy_rows), -> None: run() and the dispatcher's combine follow."""
    layer, runner = indexed_layer(make_layer, ALIGNED, "none", torch.float32)
    monkeypatch.setattr(runner, "kernel_config", lambda batch, weights: configs("none"))
    x = torch.randn(6, 128)
    ids, w = routed(6, 4, 2)
    weights = layer.expert_weights()
    batch, handle = layer.dispatcher.dispatch(x, ids, w)
    monkeypatch.delenv("MOEFLOW_TRITON_COMBINE", raising=False)
    assert runner.run_combined(batch, weights) is None  # off by default
    monkeypatch.setenv("MOEFLOW_TRITON_COMBINE", "1")
    got = runner.run_combined(batch, weights)
    assert torch.equal(got, layer.dispatcher.combine(runner.run_with(batch, weights, configs("none")), handle))
    layer.dispatcher.indexed_rows = False  # rows gathered: no copy_rows in the batch
    assert runner.run_combined(layer.dispatcher.dispatch(x, ids, w)[0], weights) is None


def test_combine_counts_start_at_zero():
    c = Combine(torch.zeros(6, dtype=torch.int64), torch.zeros(3, 2, dtype=torch.int64), torch.empty(3, 16))
    counts = c.counts(5)
    assert counts.shape == (3, 5) and counts.dtype == torch.int32 and not counts.any() and not c.done


def test_plan_combines_only_declared_cells():
    env = Environment("cuda", (9, 0))
    base = dict(num_experts=8, hidden_size=256, intermediate_size=128, top_k=2, device="cpu")
    for scheme in ("none", "fp8-tensor", "fp8-channel", "fp8-block"):
        p = plan(MoEConfig(**base, quant=scheme, runner="triton", dispatcher="local"), env)
        assert p.fused_combine and any("may sum each token's copies" in r for r in p.reasons)
    for runner in ("grouped_mm", "reference"):  # runners that do not combine
        assert not plan(MoEConfig(**base, runner=runner, dispatcher="local"), env).fused_combine
    ep = Environment("cuda", (9, 0), world_size=2)  # expert parallelism: the combine moves tokens
    assert not plan(MoEConfig(**base, runner="triton", dispatcher="alltoall"), ep).fused_combine
