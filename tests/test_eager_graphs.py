"""moeflow.graphs on the CPU: which calls a GraphCache replays, how it keys and drops its graphs, and which plans
declare themselves graph-safe. The capture itself (CUDA graphs) is tested on the GPU:
tests/gpu/test_gpu_eager_graphs.py."""
import copy
import pickle

import pytest
import torch

from moeflow.capabilities import Environment
from moeflow.config import MoEConfig
from moeflow.errors import MoeflowError
from moeflow.graphs import GraphCache, graph_tokens, layout_key
from moeflow.planner import plan
from graph_fakes import FakeCapture


@pytest.fixture
def cache(monkeypatch):
    FakeCapture.made = []
    monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", "16")
    return GraphCache(True, max_graphs=3, device_type="cpu", capture=FakeCapture)


def double(x):
    return x * 2


def test_replays_the_captured_call_with_the_new_inputs(cache):
    w = torch.randn(4)
    for _ in range(3):
        x = torch.randn(5, 4)
        torch.testing.assert_close(cache("f", double, (x,), lambda: (w,)), x * 2, rtol=0, atol=0)
    assert len(FakeCapture.made) == 1 and FakeCapture.made[0].replays == 3


def test_one_graph_per_shape_entry_and_dtype(cache):
    w = (torch.randn(4),)
    cache("f", double, (torch.randn(2, 4),), lambda: w)
    cache("f", double, (torch.randn(3, 4),), lambda: w)  # another T
    cache("g", double, (torch.randn(3, 4),), lambda: w)  # another entry
    cache("g", double, (torch.randn(3, 4, dtype=torch.float64),), lambda: w)  # another dtype: the oldest goes
    assert len(FakeCapture.made) == 4 and len(cache) == 3
    cache("f", double, (torch.randn(2, 4),), lambda: w)  # was dropped (least recently used): captured again
    assert len(FakeCapture.made) == 5


def test_least_recently_used_graph_is_dropped_first(cache):
    w = (torch.randn(4),)
    for t in (1, 2, 3):
        cache("f", double, (torch.randn(t, 4),), lambda: w)
    cache("f", double, (torch.randn(1, 4),), lambda: w)  # T=1 used again: T=2 is now the oldest
    cache("f", double, (torch.randn(4, 4),), lambda: w)  # drops T=2
    cache("f", double, (torch.randn(1, 4),), lambda: w)
    assert len(FakeCapture.made) == 4
    cache("f", double, (torch.randn(2, 4),), lambda: w)
    assert len(FakeCapture.made) == 5


def test_new_weights_or_switches_make_a_new_graph(cache, monkeypatch):
    w = torch.randn(4)
    x = torch.randn(2, 4)
    cache("f", double, (x,), lambda: (w,))
    w.copy_(torch.randn(4))  # loaded in place: same graph, reads the new values
    cache("f", double, (x,), lambda: (w,))
    assert len(FakeCapture.made) == 1
    cache("f", double, (x,), lambda: (w.clone(),))  # another tensor
    cache("f", double, (x,), lambda: (w[:2],))  # a view of another shape at the same address
    assert len(FakeCapture.made) == 3
    monkeypatch.setenv("MOEFLOW_TRITON_FUSED", "0")  # the forward path launches other kernels
    cache("f", double, (x,), lambda: (w,))
    assert len(FakeCapture.made) == 4


@pytest.mark.parametrize("setting", ["0", "4"])
def test_calls_past_the_token_bound_or_switched_off_run_eagerly(cache, monkeypatch, setting):
    monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", setting)
    x = torch.randn(8, 4)
    torch.testing.assert_close(cache("f", double, (x,), lambda: ()), x * 2)
    assert FakeCapture.made == []


def test_empty_batches_plans_not_graph_safe_and_grad_run_eagerly(cache, monkeypatch):
    cache("f", double, (torch.randn(0, 4),), lambda: ())
    off = GraphCache(False, device_type="cpu", capture=FakeCapture)
    off("f", double, (torch.randn(2, 4),), lambda: ())
    x = torch.randn(2, 4, requires_grad=True)
    cache("f", double, (x,), lambda: ())
    assert FakeCapture.made == []
    with torch.no_grad():
        cache("f", double, (x,), lambda: ())
    assert len(FakeCapture.made) == 1


def test_other_devices_run_eagerly(monkeypatch):
    FakeCapture.made = []
    monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", "16")
    cuda_only = GraphCache(True, capture=FakeCapture)  # the real cache serves CUDA tensors only
    cuda_only("f", double, (torch.randn(2, 4),), lambda: ())
    assert FakeCapture.made == []


@pytest.mark.parametrize("value", ["-1", "many", "1.5"])
def test_bad_setting_is_a_coded_error(monkeypatch, value):
    monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", value)
    with pytest.raises(MoeflowError) as info:
        graph_tokens()
    assert info.value.code == "MF107" and isinstance(info.value, ValueError)


def test_copies_and_pickles_start_empty(cache):
    cache("f", double, (torch.randn(2, 4),), lambda: ())
    assert len(cache) == 1
    for other in (copy.deepcopy(cache), pickle.loads(pickle.dumps(GraphCache(True, device_type="cpu")))):
        assert len(other) == 0 and other.enabled


def test_layout_key_sees_address_shape_strides_dtype():
    w = torch.randn(4, 6)
    assert layout_key([w, None]) == layout_key([w, None])
    assert layout_key([w]) != layout_key([w.t()])
    assert layout_key([w]) != layout_key([w.view(torch.int32)])
    assert layout_key([w]) != layout_key([w.clone()])


def test_graph_safe_plans():
    cfg = MoEConfig(num_experts=8, hidden_size=256, intermediate_size=128, top_k=2, device="cpu")
    cuda = Environment("cuda", (9, 0))
    for runner, safe in (("triton", True), ("grouped_mm", True), ("reference", False)):
        p = plan(cfg.replace(runner=runner), cuda)
        assert p.graph_safe is safe, runner
        assert any("CUDA-graph safe" in r for r in p.reasons) is safe
    assert not plan(cfg, Environment("cpu")).graph_safe  # the CPU has no graphs
    two_ranks = Environment("cuda", (9, 0), world_size=2)
    assert not plan(cfg.replace(runner="triton", dispatcher="alltoall-fixed", max_tokens_per_rank=8), two_ranks).graph_safe


def test_layer_on_cpu_never_captures(monkeypatch):
    from moeflow import MoE
    moe = MoE(num_experts=4, hidden_size=32, intermediate_size=16, top_k=2, dtype=torch.float32)
    x, logits = torch.randn(3, 32), torch.randn(3, 4)
    assert not moe.plan.graph_safe
    moe(x, logits)
    assert len(moe._graphs) == 0


def test_cycling_through_many_shapes_stops_capturing(cache, monkeypatch):
    import moeflow.graphs as graphs
    monkeypatch.setattr(graphs, "MAX_EVICTIONS", 5)
    w = (torch.randn(4),)
    with pytest.warns(RuntimeWarning, match="cycled through more than 3"):
        for t in range(1, 10):  # 9 shapes through a cache of 3: the 5th eviction stops capturing
            x = torch.randn(t, 4)
            torch.testing.assert_close(cache("f", double, (x,), lambda: w), x * 2)
    assert len(FakeCapture.made) == 7 and not cache.capturing
    kept = [c.inputs[0].shape[0] for c in cache._graphs.values()]
    cache("f", double, (torch.randn(kept[-1], 4),), lambda: w)  # shapes it holds still replay
    assert len(FakeCapture.made) == 7 and cache._graphs[next(reversed(cache._graphs))].replays == 2
