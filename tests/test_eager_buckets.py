"""moeflow.graph_buckets on the CPU (MOEFLOW_EAGER_BUCKETS): which calls pad to which bucket, what the padded form
sees (the call's rows, then zero rows; valid = its token count), that one graph serves a bucket, and that a layer's
padded call (the padding tokens routed to no expert, the local dispatcher's dropping form) gives the unpadded call's
result, for MoE.forward, forward_topk and ExpertsPath; the arena the caches share. The capture is faked
(graph_fakes.FakeCapture); the CUDA graphs themselves: tests/gpu/test_gpu_eager_graphs.py."""
import dataclasses

import pytest
import torch

from graph_fakes import FakeCapture
from moeflow.capabilities import Environment
from moeflow.config import MoEConfig
from moeflow.dispatch import create_dispatcher
from moeflow.experts import ExpertWeights
from moeflow.graph_buckets import MAX_BUCKET_GRAPHS, Bucketed, bucket_of
from moeflow.graphs import GraphCache
from moeflow.integrations.path import ExpertsPath
from moeflow.planner import plan
from moeflow.quant import create_scheme


@pytest.fixture
def buckets(monkeypatch):
    FakeCapture.made = []
    monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", "16")
    monkeypatch.setenv("MOEFLOW_EAGER_BUCKETS", "256")
    return GraphCache(True, device_type="cpu", capture=FakeCapture)


@pytest.mark.parametrize("graphs,most,expected", [
    ("16", "4096", {1: None, 16: None, 17: 32, 32: 32, 33: 64, 1000: 1024, 4096: 4096, 4097: None}),
    ("16", "100", {17: 32, 64: 64, 65: 100, 100: 100, 101: None}),
    ("16", "0", {17: None, 100: None}),
    ("0", "64", {0: None, 1: None, 3: None, 64: None}),  # MOEFLOW_EAGER_GRAPHS=0: no eager graph at all
    ("64", "32", {17: None, 40: None}),
])
def test_bucket_of(monkeypatch, graphs, most, expected):
    monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", graphs)
    monkeypatch.setenv("MOEFLOW_EAGER_BUCKETS", most)
    assert {t: bucket_of(t) for t in expected} == expected


def padded_double(seen):
    """A padded form that records what it sees and marks its padding rows' outputs NaN (the cache must cut them)."""
    def fn(x, valid):
        t = int(valid)
        seen.append((x.shape[0], t, bool((x[t:] == 0).all())))
        out = x * 2
        out[t:] = float("nan")
        return out
    return Bucketed(fn)


def test_calls_of_a_bucket_share_one_graph_and_see_zero_padding(buckets):
    w = (torch.randn(4),)
    seen = []
    for t in (30, 17, 32, 20, 31):  # one bucket (32); each call shorter than the last one sees zeros past its rows
        x = torch.randn(t, 4) + 1
        out = buckets("f", lambda x: x * 2, (x,), lambda: w, padded_double(seen))
        torch.testing.assert_close(out, x * 2, rtol=0, atol=0)
    assert len(FakeCapture.made) == 1 and FakeCapture.made[0].replays == 5
    assert [s[0] for s in seen] == [32] * 5 and all(s[2] for s in seen)
    assert [s[1] for s in seen] == [30, 17, 32, 20, 31]


def test_one_graph_per_bucket_entry_and_weights(buckets):
    w = torch.randn(4)
    seen = []
    for t in (17, 33, 100, 200, 256):  # buckets 32, 64, 128, 256, 256
        buckets("f", lambda x: x * 2, (torch.randn(t, 4),), lambda: (w,), padded_double(seen))
    assert len(FakeCapture.made) == 4 and len(buckets) == 4
    buckets("g", lambda x: x * 2, (torch.randn(20, 4),), lambda: (w,), padded_double(seen))  # another entry
    w2 = torch.randn(4)
    buckets("f", lambda x: x * 2, (torch.randn(20, 4),), lambda: (w2,), padded_double(seen))  # other weights
    assert len(FakeCapture.made) == 6


def test_past_the_bound_without_a_padded_form_or_off_runs_eagerly(buckets, monkeypatch):
    w = (torch.randn(4),)
    seen = []
    calls = []
    eager = lambda x: calls.append(x.shape[0]) or x * 2
    buckets("f", eager, (torch.randn(257, 4),), lambda: w, padded_double(seen))  # past MOEFLOW_EAGER_BUCKETS
    buckets("f", eager, (torch.randn(20, 4),), lambda: w)  # no padded form
    buckets("f", eager, (torch.randn(20, 4, requires_grad=True),), lambda: w, padded_double(seen))  # grad
    monkeypatch.setenv("MOEFLOW_EAGER_BUCKETS", "0")
    buckets("f", eager, (torch.randn(20, 4),), lambda: w, padded_double(seen))
    assert calls == [257, 20, 20, 20] and not FakeCapture.made and not seen
    monkeypatch.setenv("MOEFLOW_EAGER_BUCKETS", "256")
    buckets("f", eager, (torch.randn(5, 4),), lambda: w, padded_double(seen))  # small: its own shape's graph
    assert len(FakeCapture.made) == 1 and FakeCapture.made[0].inputs[0].shape[0] == 5 and not seen


def test_least_recently_used_bucket_goes_first(buckets, monkeypatch):
    monkeypatch.setattr("moeflow.graph_buckets.MAX_BUCKET_GRAPHS", 2)
    seen = []
    for entry in ("a", "b", "a", "c", "a", "b"):  # "b" was dropped for "c" (a used since): captured again
        buckets(entry, lambda x: x * 2, (torch.randn(20, 4),), lambda: (), padded_double(seen))
    assert len(FakeCapture.made) == 4 and len(buckets) == 2
    assert MAX_BUCKET_GRAPHS >= 16  # a cache keeps 32 .. 4096 for two entries


def test_bucket_evictions_count_toward_the_cache_stopping_capture(buckets, monkeypatch):
    monkeypatch.setattr("moeflow.graph_buckets.MAX_BUCKET_GRAPHS", 2)
    monkeypatch.setattr("moeflow.graphs.MAX_EVICTIONS", 2)
    seen, calls = [], []
    eager = lambda x: calls.append(x.shape[0]) or x * 2
    with pytest.warns(RuntimeWarning, match="cycled through more than 2"):
        for entry in ("a", "b", "c", "d", "e"):  # c and d each drop one: the second drop stops capturing
            x = torch.randn(20, 4)
            torch.testing.assert_close(buckets(entry, eager, (x,), lambda: (), padded_double(seen)), x * 2)
    assert len(FakeCapture.made) == 3 and calls == [20, 20] and not buckets.capturing


def test_caches_share_their_arena_and_calls_do_not_clobber_each_other(monkeypatch):
    """Two layers' caches: their bucket graphs read the same static inputs and write the same output (one arena a
    device and stream), and each call's result is its own (copied out under the arena's lock)."""
    monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", "16")
    monkeypatch.setenv("MOEFLOW_EAGER_BUCKETS", "256")
    FakeCapture.made = []
    a, b = (GraphCache(True, device_type="cpu", capture=FakeCapture) for _ in range(2))
    seen = []
    xa, xb = torch.randn(30, 4), torch.randn(20, 4)
    ya = a("f", lambda x: x * 2, (xa,), lambda: (), padded_double(seen))
    yb = b("f", lambda x: x * 3, (xb,), lambda: (), Bucketed(lambda x, valid: x * 3))
    torch.testing.assert_close(ya, xa * 2, rtol=0, atol=0)
    torch.testing.assert_close(yb, xb * 3, rtol=0, atol=0)
    first, second = FakeCapture.made
    assert first.inputs[0] is second.inputs[0] and first.inputs[1] is second.inputs[1]  # hidden and valid
    assert next(iter(a._buckets.values())).arena is next(iter(b._buckets.values())).arena


def test_calls_from_two_threads_keep_their_own_rows(monkeypatch):
    import threading
    monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", "16")
    monkeypatch.setenv("MOEFLOW_EAGER_BUCKETS", "256")
    caches = [GraphCache(True, device_type="cpu", capture=FakeCapture) for _ in range(2)]
    slow = Bucketed(lambda x, valid: (x.sin() + 1).cos() - x.cos() + x * 2)  # several ops: threads switch between
    failures = []

    def run(cache, scale):
        for i in range(150):
            x = torch.full((17 + i % 15, 64), float(scale * 1000 + i))
            y = cache("f", lambda x: (x.sin() + 1).cos() - x.cos() + x * 2, (x,), lambda: (), slow)
            if not torch.equal(y, (x.sin() + 1).cos() - x.cos() + x * 2):
                failures.append((scale, i))

    threads = [threading.Thread(target=run, args=(c, k + 1)) for k, c in enumerate(caches)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not failures


def test_an_arena_lives_as_long_as_a_graph_holds_it(monkeypatch):
    import gc

    from moeflow import graph_buckets
    monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", "16")
    monkeypatch.setenv("MOEFLOW_EAGER_BUCKETS", "256")
    gc.collect()
    before = len(graph_buckets._ARENAS)
    cache = GraphCache(True, device_type="meta", capture=FakeCapture)  # its own arena: ("meta", None)
    cache("f", lambda x: x * 2, (torch.empty(20, 4, device="meta"),), lambda: (), Bucketed(lambda x, v: x * 2))
    assert ("meta", None) in graph_buckets._ARENAS and len(graph_buckets._ARENAS) == before + 1
    del cache
    gc.collect()
    assert ("meta", None) not in graph_buckets._ARENAS


# ---------------------------------------------------------------- the local dispatcher's dropping form
SHAPE = dict(num_experts=6, hidden_size=32, intermediate_size=24, top_k=2, dtype=torch.float32, device="cpu")


def float64_layer(x, ids, w, w13, w2):
    """The routed experts in float64: a copy of id -1 adds nothing. ids [T, K], weights [T, K] -> [T, H]."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    i = w2.shape[2]
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e >= 0:
                h = w13[e] @ x[t]
                out[t] += float(w[t, k]) * (w2[e] @ (torch.nn.functional.silu(h[:i]) * h[i:]))
    return out


@pytest.mark.parametrize("runner", ["grouped_mm", "reference"])
@pytest.mark.parametrize("case", ["scattered", "all_dropped", "one_token", "one_expert"])
def test_dropping_dispatch_adds_zero_for_dropped_copies(make_layer, poison, runner, case):
    layer = make_layer(**SHAPE, runner=runner)
    t = {"one_token": 1}.get(case, 13)
    x = torch.randn(t, 32)
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(t)]).to(torch.int32)
    if case == "one_expert":
        ids[:, 0] = 4
        ids[:, 1] = -1
    drop = {"all_dropped": torch.ones(t, 2, dtype=torch.bool)}.get(case, torch.rand(t, 2) < 0.4)
    ids = ids.masked_fill(drop, -1)
    w = torch.rand(t, 2)
    dispatcher = layer.dispatcher.dropping()
    batch, handle = dispatcher.dispatch(x, ids, w)
    assert batch.padded and batch.num_rows == t * 2 and int(batch.offsets[-1]) == int((ids >= 0).sum())
    assert torch.equal(handle.row_of_copy < 0, ids < 0)
    out = dispatcher.combine(layer.runner.run(batch, layer.expert_weights()), handle)
    expected = float64_layer(x, ids, w, layer.gate_up_proj, layer.down_proj)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert not layer.dispatcher.drops  # dropping() gave a copy
    dispatcher.indexed_rows = True  # as create_dispatcher sets it for a runner that reads rows in place (triton)
    indexed, _ = dispatcher.dispatch(x, ids, w)  # its copy_rows: the runner's row scatter, skipping dropped copies
    assert torch.equal(indexed.copy_rows, handle.row_of_copy)
    assert torch.equal(indexed.hidden[indexed.source_rows], batch.hidden)


def test_only_the_local_dispatcher_drops_copies():
    cfg = MoEConfig(**SHAPE)
    assert plan(cfg.replace(runner="triton"), Environment("cuda", (9, 0))).bucketed
    assert not plan(cfg, Environment("cpu")).bucketed  # not graph-safe: no graphs on the CPU
    two = Environment("cuda", (9, 0), world_size=2)
    assert not plan(cfg.replace(runner="triton", dispatcher="alltoall-fixed", max_tokens_per_rank=8), two).bucketed
    local = create_dispatcher("local", cfg, create_scheme("none"))
    assert type(local).caps.drops_copies and local.dropping().drops


# ---------------------------------------------------------------- a layer's bucketed calls
def bucketing(monkeypatch, owner):
    """Let ``owner`` (a layer or an ExpertsPath, built on the CPU) pad calls to buckets through a faked capture."""
    FakeCapture.made = []
    monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", "16")
    monkeypatch.setenv("MOEFLOW_EAGER_BUCKETS", "64")
    owner.plan = dataclasses.replace(owner.plan, bucketed=True)
    owner._graphs = GraphCache(True, device_type="cpu", capture=FakeCapture)


def unbucketed(monkeypatch, fn):
    monkeypatch.setenv("MOEFLOW_EAGER_BUCKETS", "0")
    try:
        return fn()
    finally:
        monkeypatch.setenv("MOEFLOW_EAGER_BUCKETS", "64")


@pytest.mark.parametrize("quant", ["none", "fp8-tensor", "fp8-channel", "fp8-block"])
def test_layer_bucketed_calls_equal_unpadded_calls(make_layer, monkeypatch, quant):
    shape = dict(SHAPE, hidden_size=256, intermediate_size=128) if quant == "fp8-block" else SHAPE
    h = shape["hidden_size"]
    layer = make_layer(**shape, quant=quant, num_shared_experts=1, shared_intermediate_size=16)
    bucketing(monkeypatch, layer)
    run, batches = layer.runner.run, []
    monkeypatch.setattr(layer.runner, "run", lambda batch, weights: batches.append(batch) or run(batch, weights))
    for t in (30, 17, 64, 40):  # buckets 32, 32, 64, 64: rows of a longer call before a shorter one are zeroed
        x, logits = torch.randn(t, h), torch.randn(t, 6)
        ids, w = layer.router(logits, None)
        batches.clear()
        out, topk = layer(x, logits), layer.forward_topk(x, ids.long(), w)
        bucket = 32 if t <= 32 else 64  # the runner saw the bucket's rows, the padding tokens' copies dropped
        assert [(b.num_rows, int(b.offsets[-1]), b.padded) for b in batches] == [(bucket * 2, t * 2, True)] * 2
        assert torch.equal(out, unbucketed(monkeypatch, lambda: layer(x, logits))), f"{quant} T={t}"
        assert torch.equal(topk, unbucketed(monkeypatch, lambda: layer.forward_topk(x, ids.long(), w)))
    assert len(FakeCapture.made) == 4  # (forward, forward_topk) x (32, 64)


@pytest.mark.parametrize("routing", [
    dict(scoring="sigmoid", num_expert_groups=2, topk_groups=1, use_correction_bias=True, routed_scaling_factor=2.5,
         num_shared_experts=1, shared_intermediate_size=16),  # DeepSeek-V3's kind
    dict(renormalize=False, num_shared_experts=1, shared_intermediate_size=16, shared_expert_gate=True,
         activation="gelu_tanh"),  # Qwen2-MoE's kind, another activation
])
@pytest.mark.parametrize("runner", ["grouped_mm", "reference"])
def test_bucketed_calls_of_other_routers_and_runners(make_layer, monkeypatch, routing, runner):
    """The padding tokens' zero logits route somewhere under every router (grouped, biased, sigmoid) before
    the dropping sort sends them nowhere: the call's rows are still the unpadded call's, to the last bit but for the
    shared-expert gate, a torch nn.Linear [H, 1] whose CPU matmul rounds the last bit by the row count (seen here:
    3e-8 at T=40 against 64 rows; the routed experts and the ungated shared experts gave the same bits)."""
    layer = make_layer(**SHAPE, runner=runner, **routing)
    bucketing(monkeypatch, layer)
    for t in (40, 23):
        x, logits = torch.randn(t, 32), torch.randn(t, 6)
        out, want = layer(x, logits), unbucketed(monkeypatch, lambda: layer(x, logits))
        if layer.shared_expert_gate is None:
            assert torch.equal(out, want), f"T={t}"
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert len(FakeCapture.made) == 2  # buckets 64 and 32


def test_experts_path_bucketed_calls_equal_unpadded_calls(make_layer, monkeypatch):
    layer = make_layer(**SHAPE, quant="fp8-channel")
    path = ExpertsPath(layer.config)
    bucketing(monkeypatch, path)
    weights = ExpertWeights(layer.gate_up_proj, layer.down_proj, layer.gate_up_proj_scale_inv,
                            layer.down_proj_scale_inv)
    for t in (20, 50):
        x = torch.randn(t, 32)
        ids, w = layer.router(torch.randn(t, 6), None)
        out = path(x, ids.long(), w, weights)
        assert torch.equal(out, unbucketed(monkeypatch, lambda: path(x, ids.long(), w, weights)))
        assert torch.equal(out, layer.forward_topk(x, ids.long(), w))
    assert len(FakeCapture.made) == 2
