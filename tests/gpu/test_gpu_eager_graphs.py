"""Eager calls replayed from CUDA graphs (moeflow.graphs) on the GPU: a replayed call must give the bits of the same
call made launch by launch (MOEFLOW_EAGER_GRAPHS=0), on fresh inputs each time, through MoE.forward, forward_topk
and ExpertsPath (transformers' experts call); weights loaded in place must be read anew; outputs must not alias the
graph's buffers; a call inside the caller's own capture must not capture a graph of its own.
Run: pytest -m gpu tests/gpu/test_gpu_eager_graphs.py
"""
import pytest
import torch

from moeflow.experts import ExpertWeights
from moeflow.integrations.path import ExpertsPath
from oracle import assert_close, layer_oracle, route_for
from tolerances import rel_tol

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = dict(num_experts=16, hidden_size=256, intermediate_size=384, top_k=4, dtype=torch.bfloat16, device="cuda")


def launched(monkeypatch, fn, variable="MOEFLOW_EAGER_GRAPHS", on="16"):
    """fn() with eager graphs (or, variable="MOEFLOW_EAGER_BUCKETS", their buckets) off: the call launch by launch;
    the variable is ``on`` again after."""
    monkeypatch.setenv(variable, "0")
    try:
        return fn()
    finally:
        monkeypatch.setenv(variable, on)


@pytest.mark.parametrize("t", [1, 3, 16])
@pytest.mark.parametrize("scheme,runner", [("none", "triton"), ("fp8-block", "triton"), ("fp8-channel", "triton"),
                                           ("none", "grouped_mm")])
def test_replayed_calls_equal_launched_calls(make_layer, monkeypatch, scheme, runner, t):
    monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", "16")
    layer = make_layer(**SHAPE, quant=scheme, runner=runner, num_shared_experts=1, shared_intermediate_size=128)
    assert layer.plan.graph_safe
    outs = []
    for _ in range(3):  # fresh inputs every call: the graph must read them, not the first call's
        x = torch.randn(t, 256, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(t, 16, device="cuda")
        ids, w = route_for(layer.config, logits, layer.e_score_correction_bias)
        out = layer(x, logits)
        topk = layer.forward_topk(x, ids.long(), w)
        assert torch.equal(out, launched(monkeypatch, lambda: layer(x, logits))), f"{scheme} {runner} T={t}"
        assert torch.equal(topk, launched(monkeypatch, lambda: layer.forward_topk(x, ids.long(), w)))
        assert_close(out, layer_oracle(layer, x, ids, w), rel_tol(scheme, torch.bfloat16), f"{scheme} T={t}")
        outs.append((out, out.clone()))
    assert len(layer._graphs) == 2  # forward and forward_topk at this T, each captured once
    for out, copy in outs:  # later replays did not overwrite earlier outputs
        assert torch.equal(out, copy)


def test_weights_loaded_in_place_are_read_anew(make_layer, monkeypatch):
    from conftest import random_state
    monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", "16")
    layer = make_layer(**SHAPE, quant="fp8-block", runner="triton")
    x, logits = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16), torch.randn(2, 16, device="cuda")
    before = layer(x, logits)
    layer.load_weights(random_state(layer.config))
    after = layer(x, logits)
    assert len(layer._graphs) == 1 and not torch.equal(before, after)
    assert torch.equal(after, launched(monkeypatch, lambda: layer(x, logits)))


def test_larger_batches_and_own_captures_run_launch_by_launch(make_layer, monkeypatch):
    monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", "4")
    monkeypatch.setenv("MOEFLOW_EAGER_BUCKETS", "0")  # T=5 runs launch by launch
    layer = make_layer(**SHAPE, quant="none", runner="triton")
    x, logits = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16), torch.randn(5, 16, device="cuda")
    layer(x, logits)
    assert len(layer._graphs) == 0
    x1, logits1 = x[:1].clone(), logits[:1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(x1, logits1)  # the caller's warm-up: an eager call, replayed from a graph of ours
    torch.cuda.current_stream().wait_stream(side)
    assert len(layer._graphs) == 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x1, logits1)  # inside the caller's capture: its launches are captured, no graph of ours
    assert len(layer._graphs) == 1
    x1.copy_(torch.randn_like(x1))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, launched(monkeypatch, lambda: layer(x1, logits1)))


@pytest.mark.parametrize("t", [1, 8])
def test_experts_path_replays(make_layer, monkeypatch, t):
    monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", "16")
    layer = make_layer(**SHAPE, quant="fp8-block", runner="triton")
    path = ExpertsPath(layer.config)
    weights = ExpertWeights(layer.gate_up_proj, layer.down_proj, layer.gate_up_proj_scale_inv,
                            layer.down_proj_scale_inv)
    for _ in range(2):
        x = torch.randn(t, 256, device="cuda", dtype=torch.bfloat16)
        ids, w = route_for(layer.config, torch.randn(t, 16, device="cuda"), None)
        out = path(x, ids.long(), w.bfloat16(), weights)
        assert torch.equal(out, launched(monkeypatch, lambda: path(x, ids.long(), w.bfloat16(), weights)))
        assert torch.equal(out, layer.forward_topk(x, ids.long(), w.bfloat16()))
    assert len(path._graphs) == 1


@pytest.mark.parametrize("scheme,runner", [("none", "triton"), ("fp8-block", "triton"), ("fp8-channel", "triton"),
                                           ("fp8-tensor", "triton"), ("none", "grouped_mm")])
def test_bucketed_calls_equal_launched_calls(make_layer, monkeypatch, scheme, runner):
    """MOEFLOW_EAGER_BUCKETS: calls of 17-256 tokens padded to a power of two replay its bucket's graph. Against the
    same call launch by launch (whose tuned tiles follow its own token count, so not bit for bit) and the oracle;
    calls of one bucket, longer then shorter (its padding rows zeroed again), share one graph per entry."""
    monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", "16")
    monkeypatch.setenv("MOEFLOW_EAGER_BUCKETS", "256")
    layer = make_layer(**SHAPE, quant=scheme, runner=runner, num_shared_experts=1, shared_intermediate_size=128)
    assert layer.plan.bucketed
    tol = rel_tol(scheme, torch.bfloat16)
    outs = []
    for t in (100, 70, 17, 256, 128):  # buckets 128, 128, 32, 256, 128
        x = torch.randn(t, 256, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(t, 16, device="cuda")
        ids, w = route_for(layer.config, logits, layer.e_score_correction_bias)
        out, topk = layer(x, logits), layer.forward_topk(x, ids.long(), w)
        assert out.shape == topk.shape == (t, 256), f"{scheme} {runner} T={t}"
        one_by_one = launched(monkeypatch, lambda: layer(x, logits), "MOEFLOW_EAGER_BUCKETS", "256")
        assert_close(out, one_by_one.float(), tol, f"{scheme} T={t} launched")
        ref = layer_oracle(layer, x, ids, w)  # the router's weights may differ from route_for's in the last bit
        assert_close(out, ref, tol, f"{scheme} T={t}")
        assert_close(topk, ref, tol, f"{scheme} T={t} forward_topk")
        outs.append((out, out.clone()))
    assert len(layer._graphs) == 6  # (forward, forward_topk) x buckets 32, 128, 256
    for out, copy in outs:  # later replays did not overwrite earlier outputs
        assert torch.equal(out, copy)


def test_experts_path_bucketed(make_layer, monkeypatch):
    monkeypatch.setenv("MOEFLOW_EAGER_BUCKETS", "256")
    layer = make_layer(**SHAPE, quant="fp8-block", runner="triton")
    path = ExpertsPath(layer.config)
    weights = ExpertWeights(layer.gate_up_proj, layer.down_proj, layer.gate_up_proj_scale_inv,
                            layer.down_proj_scale_inv)
    for t in (200, 130):
        x = torch.randn(t, 256, device="cuda", dtype=torch.bfloat16)
        ids, w = route_for(layer.config, torch.randn(t, 16, device="cuda"), None)
        out = path(x, ids.long(), w.bfloat16(), weights)
        assert torch.equal(out, layer.forward_topk(x, ids.long(), w.bfloat16()))
        assert_close(out, layer_oracle(layer, x, ids, w.bfloat16().float()), rel_tol("fp8-block", torch.bfloat16))
    assert len(path._graphs) == 1


def test_bucketed_layers_share_one_arena(make_layer, monkeypatch):
    """Two layers' bucket graphs read and write one arena (graph_buckets: one pool, one set of static tensors a device
    and stream); calls alternating between them, in one bucket and across two, each give their own layer's result."""
    monkeypatch.setenv("MOEFLOW_EAGER_BUCKETS", "256")
    layers = [make_layer(**SHAPE, quant="fp8-block", runner="triton") for _ in range(2)]
    for t in (100, 120, 60, 128):
        for layer in layers:
            x = torch.randn(t, 256, device="cuda", dtype=torch.bfloat16)
            logits = torch.randn(t, 16, device="cuda")
            ids, w = route_for(layer.config, logits, None)
            assert_close(layer(x, logits), layer_oracle(layer, x, ids, w), rel_tol("fp8-block", torch.bfloat16))
    a, b = (next(iter(layer._graphs._buckets.values())) for layer in layers)
    assert a.arena is b.arena and a.keys == b.keys
