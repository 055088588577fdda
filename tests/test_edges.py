"""Edge shapes, each named for what it exercises, through every runner x scheme the planner
accepts on CPU (local dispatcher), against the float64 oracle, with NaN-poisoned allocations."""
import pytest
import torch

from moeflow import MoE, MoEConfig, MoeflowError
from moeflow.capabilities import Environment
from moeflow.planner import matrix
from oracle import assert_close, layer_oracle, route_for
from tolerances import rel_tol

CPU = Environment("cpu", None, world_size=1)
CELLS = [(s, r) for s, r, d, st in
         matrix(MoEConfig(num_experts=8, hidden_size=128, intermediate_size=128, top_k=2, dtype=torch.float32), CPU)
         if st == "ok" and d == "local"]


def distinct_ids(t, e, k, allowed=None):
    """[T, K] distinct random experts per row, drawn from ``allowed`` (default all)."""
    r = torch.rand(t, e)
    if allowed is not None:
        mask = torch.ones(e, dtype=torch.bool)
        mask[list(allowed)] = False
        r[:, mask] = -1.0
    return r.topk(k, dim=1).indices


# id: (T, E, K, ids(T, E, K) or None to route with the layer's router)  # what it exercises
EDGES = {
    "T0": (0, 8, 2, None),  # no tokens: every expert empty, zero-row GEMMs, empty combine
    "T1": (1, 8, 2, None),  # a single token: K copies, one row per GEMM
    "T37": (37, 8, 2, None),  # odd token count
    "idle-experts": (24, 8, 2, lambda t, e, k: distinct_ids(t, e, k, (1, 2, 3, 5, 6))),  # experts 0, 4, 7 get nothing
    "all-to-one-expert": (20, 8, 1, lambda t, e, k: torch.full((t, 1), 3)),  # K=1, every id 3: one full group
    "all-to-same-k": (20, 8, 2, lambda t, e, k: torch.tensor([[5, 2]]).expand(t, 2)),  # 2 busy experts, 6 idle
    "K=E": (9, 5, 5, None),  # maximum routing density: every expert sees every token
    "E1-K1": (6, 1, 1, None),  # a single expert
    "T64-E2": (64, 2, 1, None),  # many tokens per expert
    "E7-K3": (21, 7, 3, None),  # non-power-of-two expert count (with H=96, I=40 where allowed)
}


def sizes(scheme):
    # non-power-of-two H and I where the scheme allows it; fp8-block needs multiples of 128
    return (384, 128) if scheme == "fp8-block" else (96, 40)


def run_edge(layer, t, ids_fn):
    cfg = layer.config
    x = torch.randn(t, cfg.hidden_size).to(cfg.dtype)
    if ids_fn is None:
        logits = torch.randn(t, cfg.num_experts) * 2
        out = layer(x, logits)
        ids, w = route_for(cfg, logits)
    else:
        ids = ids_fn(t, cfg.num_experts, cfg.top_k)
        w = torch.rand(t, cfg.top_k) + 0.1
        out = layer.forward_topk(x, ids, w)
    assert out.shape == (t, cfg.hidden_size) and out.dtype == cfg.dtype
    ref = layer_oracle(layer, x, ids, w)
    if t == 0:
        return
    assert_close(out, ref, rel_tol(cfg.quant, cfg.dtype), what=f"{layer.plan.runner}/{cfg.quant}")


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("cell", CELLS, ids="-".join)
def test_edge_shape(cell, edge, make_layer, poison):
    scheme, runner = cell
    t, e, k, ids_fn = EDGES[edge]
    h, i = sizes(scheme)
    layer = make_layer(num_experts=e, hidden_size=h, intermediate_size=i, top_k=k, quant=scheme, runner=runner,
                       dtype=torch.float32)
    run_edge(layer, t, ids_fn)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("edge", ("T0", "T1", "idle-experts"))
@pytest.mark.parametrize("cell", CELLS, ids="-".join)
def test_edge_shape_low_precision(cell, edge, dtype, make_layer, poison):
    scheme, runner = cell
    t, e, k, ids_fn = EDGES[edge]
    h, i = sizes(scheme)
    layer = make_layer(num_experts=e, hidden_size=h, intermediate_size=i, top_k=k, quant=scheme, runner=runner,
                       dtype=dtype)
    run_edge(layer, t, ids_fn)


def test_non_power_of_two_everything(make_layer, poison):
    """H=96, I=40, E=7, K=3 with grouped-free sigmoid routing and a shared expert of size 24."""
    layer = make_layer(num_experts=7, hidden_size=96, intermediate_size=40, top_k=3, scoring="sigmoid",
                       num_shared_experts=1, shared_intermediate_size=24, dtype=torch.float32, quant="none")
    run_edge(layer, 13, None)


@pytest.mark.parametrize("h,i,bad", ((96, 128, "hidden_size=96"), (128, 40, "intermediate_size=40"),
                                     (200, 72, "hidden_size=200")))
@pytest.mark.parametrize("runner", ("auto", "reference"))
def test_fp8_block_refuses_unaligned_sizes(h, i, bad, runner):
    """fp8-block's 128x128 blocks: sizes not divisible by 128 are refused when the layer is built."""
    with pytest.raises(MoeflowError) as info:
        MoE(num_experts=7, hidden_size=h, intermediate_size=i, top_k=2, quant="fp8-block", runner=runner)
    assert info.value.code == "MF206" and isinstance(info.value, ValueError)
    assert bad in str(info.value) and "128" in str(info.value)


@pytest.mark.parametrize("dtype,h,i,bad", ((torch.bfloat16, 100, 64, "hidden_size=100"),
                                           (torch.float16, 64, 20, "intermediate_size=20"),
                                           (torch.float32, 64, 6, "intermediate_size=6")))
def test_cpu_grouped_mm_refuses_rows_of_no_16_bytes(dtype, h, i, bad, make_layer, poison):
    """torch._grouped_mm on the CPU needs 16-byte rows (each GEMM's K): named, refused at build (MF206); "auto" then
    takes the reference runner, which runs the layer right."""
    with pytest.raises(MoeflowError) as info:
        MoE(num_experts=4, hidden_size=h, intermediate_size=i, top_k=2, dtype=dtype, runner="grouped_mm")
    assert info.value.code == "MF206" and bad in str(info.value)
    layer = make_layer(num_experts=4, hidden_size=h, intermediate_size=i, top_k=2, dtype=dtype)
    assert layer.plan.runner == "reference", layer.plan
    run_edge(layer, 9, None)


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme,runner", CELLS)
def test_autocast_leaves_the_layer_in_its_own_precision(make_layer, scheme, runner, autocast_dtype):
    """Under torch.autocast an fp32 layer computes as without it, bit for bit, through forward, forward_topk and
    transformers' experts path: the layer's numerics contract holds in every runner (the reference runner's matmuls
    had followed autocast into bf16 / fp16, 1e-2 off the oracle, where grouped_mm's did not)."""
    from moeflow.integrations.path import ExpertsPath
    layer = make_layer(num_experts=8, hidden_size=128, intermediate_size=128, top_k=2, dtype=torch.float32,
                       quant=scheme, runner=runner)
    x, logits = torch.randn(12, 128), torch.randn(12, 8)
    ids, w = distinct_ids(12, 8, 2), torch.rand(12, 2)
    path = ExpertsPath(layer.config)
    weights = layer.expert_weights()
    with torch.no_grad():
        plain = layer(x, logits), layer.forward_topk(x, ids, w), path(x, ids, w, weights)
        with torch.autocast("cpu", dtype=autocast_dtype):
            auto = layer(x, logits), layer.forward_topk(x, ids, w), path(x, ids, w, weights)
    for p, a in zip(plain, auto):
        assert a.dtype == torch.float32 and torch.equal(a, p)
