"""The combine inside the down launch (kernels/down.py, Combine; TritonRunner.run_combined) under Triton's CPU
interpreter, and how the plan and the runner decide to use it.

The combined output must be the bits the local dispatcher's combine gives (kernels/reduce.moe_sum over the same
expert rows), on fresh random data, outputs poisoned first: fp16 / fp32 / fp8 (the interpreter has no bf16:
tests/gpu/test_gpu_triton.py), one token, every token's first choice one expert, top-1 with every token on one
expert (the others with none), non-power-of-two sizes
with partial column tiles, swapped tiles, and a split-K down (whose launch cannot sum: moe_sum runs after it).
The counts are left zero for the next launch. The interpreter runs programs one after another, so only the GPU
suite has programs racing to be a token's last.
"""
import pytest
import torch

from triton_interp import SKIP_REASON

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))

if SKIP_REASON is None:
    from moeflow.experts import triton as triton_runner
    from moeflow.experts.triton import TritonRunner
    from moeflow.kernels.configs import GemmConfig, MoEKernelConfig

from moeflow import MoEConfig
from moeflow.capabilities import Environment
from moeflow.planner import plan
from oracle import assert_close, layer_oracle
from tolerances import rel_tol

ALIGNED = dict(num_experts=4, hidden_size=128, intermediate_size=128, top_k=2)
ODD = dict(num_experts=3, hidden_size=48, intermediate_size=40, top_k=2)  # 48 columns: a part-filled 32-column tile


def configs(scheme, swap=False, split=1):
    gate_up = GemmConfig(16, 128 if scheme == "fp8-block" else 32, 64)
    return MoEKernelConfig(gate_up, GemmConfig(16, 32, 64, group_m=2, swap_ab=int(swap), split_k=split))


def routed(t, e, k, one_expert=False):
    ids = torch.rand(t, e).argsort(dim=1)[:, :k]
    if one_expert:  # every token's first choice is expert e - 1; with k < e some expert may get nothing
        ids = torch.rand(t, e).add(3.0 * (torch.arange(e) == e - 1)).argsort(dim=1, descending=True)[:, :k]
    return ids.to(torch.int32), torch.rand(t, k) + 0.1


def combined_and_separate(make_layer, fields, scheme, dtype, t, kcfg, one_expert=False):
    layer = make_layer(**fields, quant=scheme, dtype=dtype, runner="reference")
    runner = TritonRunner(layer.config, layer.scheme)
    layer.dispatcher.indexed_rows = True
    x = torch.randn(t, layer.config.hidden_size).to(dtype)
    ids, w = routed(t, layer.config.num_experts, layer.config.top_k, one_expert)
    batch, handle = layer.dispatcher.dispatch(x, ids, w)
    weights = layer.expert_weights()
    separate = layer.dispatcher.combine(runner.run_with(batch, weights, kcfg, poison=True), handle)
    combined = runner.run_with(batch, weights, kcfg, poison=True, combine=True)
    return layer, runner, (x, ids, w), combined, separate


@pytest.mark.parametrize("scheme,dtype", [("none", torch.float32), ("none", torch.float16),
                                          ("fp8-tensor", torch.float16), ("fp8-channel", torch.float32),
                                          ("fp8-block", torch.float16)], ids=str)
@pytest.mark.parametrize("t,fields,one_expert", [(9, ALIGNED, False), (1, ALIGNED, False), (7, ODD, True),
                                                 (5, dict(ODD, top_k=1), True)], ids=str)
def test_combined_is_the_dispatchers_combine(make_layer, scheme, dtype, t, fields, one_expert):
    if scheme == "fp8-block" and fields["hidden_size"] % 128:
        fields = dict(fields, hidden_size=128, intermediate_size=128)  # fp8-block needs multiples of 128
    layer, runner, inputs, combined, separate = combined_and_separate(make_layer, fields, scheme, dtype, t,
                                                                     configs(scheme), one_expert)
    assert combined.shape == (t, layer.config.hidden_size) and combined.dtype == dtype
    assert torch.equal(combined, separate)  # no NaN survives: every element written, the same bits
    assert_close(combined, layer_oracle(layer, *inputs), rel_tol(scheme, dtype), f"{scheme} {dtype}")
    assert not runner._combine_counts(combined.device).any()  # left zero for the next launch


@pytest.mark.parametrize("swap,split", [(True, 1), (False, 2)], ids=["swapped", "split-k"])
def test_combined_with_other_down_forms(make_layer, swap, split):
    """Swapped tiles sum in the same epilogue; a split-K down's launch cannot (its tiles are partial), so the call
    sums by moe_sum after it: the same bits either way, and a second call (the counts reused) again."""
    kcfg = configs("none", swap, split)
    layer, runner, inputs, combined, separate = combined_and_separate(make_layer, ALIGNED, "none", torch.float16, 11,
                                                                     kcfg)
    assert torch.equal(combined, separate)
    batch, _ = layer.dispatcher.dispatch(*inputs)
    again = runner.run_with(batch, layer.expert_weights(), kcfg, poison=True, combine=True)
    assert torch.equal(again, combined)


def test_run_combined_chooses_its_batches(make_layer, monkeypatch):
    """run_combined sums batches of 1 .. COMBINE_MAX_TOKENS tokens given by index; other batches, and every batch
    with MOEFLOW_TRITON_COMBINE=0, -> None (run() and the dispatcher's combine follow)."""
    layer = make_layer(**ALIGNED, quant="none", dtype=torch.float32, runner="reference")
    runner = TritonRunner(layer.config, layer.scheme)
    runner._fitted = {}
    monkeypatch.setattr(runner, "kernel_config", lambda batch, weights: configs("none"))
    x = torch.randn(6, 128)
    ids, w = routed(6, 4, 2)
    weights = layer.expert_weights()
    layer.dispatcher.indexed_rows = True
    batch, handle = layer.dispatcher.dispatch(x, ids, w)
    got = runner.run_combined(batch, weights)
    assert torch.equal(got, layer.dispatcher.combine(runner.run_with(batch, weights, configs("none")), handle))
    monkeypatch.setattr(triton_runner, "COMBINE_MAX_TOKENS", 5)
    assert runner.run_combined(batch, weights) is None  # 6 tokens: more than the counts hold
    monkeypatch.setattr(triton_runner, "COMBINE_MAX_TOKENS", 256)
    monkeypatch.setenv("MOEFLOW_TRITON_COMBINE", "0")
    assert runner.run_combined(batch, weights) is None
    monkeypatch.delenv("MOEFLOW_TRITON_COMBINE")
    layer.dispatcher.indexed_rows = False  # rows gathered: no copy_rows in the batch
    assert runner.run_combined(layer.dispatcher.dispatch(x, ids, w)[0], weights) is None


def test_plan_combines_only_declared_cells():
    env = Environment("cuda", (9, 0))
    base = dict(num_experts=8, hidden_size=256, intermediate_size=128, top_k=2, device="cpu")
    for scheme in ("none", "fp8-tensor", "fp8-channel", "fp8-block"):
        p = plan(MoEConfig(**base, quant=scheme, runner="triton", dispatcher="local"), env)
        assert p.fused_combine and any("sums each token's copies" in r for r in p.reasons)
    for runner in ("grouped_mm", "reference"):  # runners that do not combine
        assert not plan(MoEConfig(**base, runner=runner, dispatcher="local"), env).fused_combine
    ep = Environment("cuda", (9, 0), world_size=2)  # expert parallelism: the combine moves tokens
    assert not plan(MoEConfig(**base, runner="triton", dispatcher="alltoall"), ep).fused_combine
