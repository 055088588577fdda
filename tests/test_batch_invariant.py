"""Batch-invariant mode (MoEConfig.batch_invariant) on the CPU: a token's output row has the same bits alone, inside
batches of 7, 128, 1,000 and 4,096 tokens, at any position, and call after call; the planner's refusals (MF212); the
fixed-order arithmetic of moeflow.invariant against plain torch; the Triton runner's one tile for every T and the
fixed-tile linear kernel under Triton's interpreter. Expert parallelism: tests/dispatch/test_ep_batch_invariant.py.
GPU: tests/gpu/test_gpu_batch_invariant.py.
"""
import pytest
import torch

from moeflow import MoE, MoEConfig
from moeflow.capabilities import Environment
from moeflow.errors import MoeflowError
from moeflow.invariant import fixed_apply, fixed_matmul, fixed_softmax, fixed_sum, fixed_topk
from moeflow.planner import plan
from oracle import assert_close, bits, layer_oracle
from tolerances import rel_tol

SIZES = (1, 7, 128, 1000, 4096)
SHAPE = dict(num_experts=8, hidden_size=64, intermediate_size=96, top_k=2, device="cpu")
DEEPSEEK_LIKE = dict(num_experts=16, hidden_size=128, intermediate_size=128, top_k=4, scoring="sigmoid",
                     num_expert_groups=4, topk_groups=2, use_correction_bias=True, routed_scaling_factor=2.5,
                     num_shared_experts=1, shared_intermediate_size=64, device="cpu")
QWEN2_LIKE = dict(num_experts=8, hidden_size=128, intermediate_size=128, top_k=2, renormalize=False,
                  num_shared_experts=1, shared_intermediate_size=96, shared_expert_gate=True, device="cpu")


def check_invariant(layer, sizes=SIZES[:-1], probes: int = 3, seed: int = 0):
    """The probe tokens' rows must carry the same bits computed alone, inside one batch of each size in ``sizes`` at
    random positions (the other rows random tokens), and in the largest batch computed twice. -> (that batch's
    output, its x, its logits)."""
    g = torch.Generator().manual_seed(seed)
    cfg = layer.config
    pool = max(sizes)
    x = torch.randn(pool, cfg.hidden_size, generator=g).to(cfg.dtype)
    logits = torch.randn(pool, cfg.num_experts, generator=g)
    full = layer(x, logits)
    assert torch.equal(bits(layer(x, logits)), bits(full)), "the same batch twice"
    chosen = torch.randperm(pool, generator=g)[:probes]
    for t in sizes:
        rows = torch.randint(0, pool, (t,), generator=g)
        at = torch.randperm(t, generator=g)[:probes]
        rows[at] = chosen[:len(at)]
        out = layer(x[rows], logits[rows])
        for a, p in zip(at.tolist(), chosen.tolist()):
            assert torch.equal(bits(out[a]), bits(full[p])), f"token {p} at position {a} of {t} differs"
    return full, x, logits


@pytest.mark.parametrize("scheme,dtype", [("none", torch.bfloat16), ("none", torch.float16), ("none", torch.float32),
                                          ("fp8-channel", torch.bfloat16), ("fp8-channel", torch.float32),
                                          ("fp8-block", torch.bfloat16), ("fp8-block", torch.float16)], ids=str)
def test_layer_rows_do_not_depend_on_the_batch(scheme, dtype):
    fields = dict(SHAPE, hidden_size=128, intermediate_size=128) if scheme == "fp8-block" else SHAPE
    layer = MoE(MoEConfig(**fields, quant=scheme, dtype=dtype, batch_invariant=True))
    assert layer.plan.batch_invariant and not layer.plan.fused_layer
    full, x, logits = check_invariant(layer)
    # and still the layer: against the float64 oracle on the router's own choice
    ids, w = layer.router(logits[:300].float(), None)
    assert_close(full[:300], layer_oracle(layer, x[:300], ids, w), rel_tol(scheme, dtype), f"{scheme} {dtype}")


@pytest.mark.parametrize("fields", [DEEPSEEK_LIKE, QWEN2_LIKE], ids=["grouped-sigmoid-shared", "shared-gate"])
def test_routing_variants_and_shared_experts(fields):
    layer = MoE(MoEConfig(**fields, dtype=torch.bfloat16, batch_invariant=True))
    check_invariant(layer, sizes=(1, 7, 300))


def test_a_batch_of_4096():
    """The largest batch the issue names, once (the reference runner's fixed-order products are slow on a CPU)."""
    layer = MoE(MoEConfig(**SHAPE, dtype=torch.bfloat16, batch_invariant=True))
    check_invariant(layer, sizes=(1, 4096), probes=4)


def test_edge_batches():
    """T=0, one token routed to a single expert by every token of the batch (a long segment), an idle expert."""
    layer = MoE(MoEConfig(**SHAPE, dtype=torch.float32, batch_invariant=True))
    assert layer(torch.randn(0, 64), torch.randn(0, 8)).shape == (0, 64)
    x = torch.randn(300, 64)
    logits = torch.randn(300, 8)
    logits[:, 3] += 100.0  # every token's first choice: expert 3
    logits[:, 5] -= 100.0  # expert 5 idle
    full = layer(x, logits)
    for i in (0, 150, 299):
        assert torch.equal(bits(layer(x[i:i + 1], logits[i:i + 1])), bits(full[i:i + 1]))


def test_ties_go_to_the_lower_expert_index():
    """Exactly tied logits: the torch router picks the lower index, alone or among other tokens."""
    layer = MoE(MoEConfig(**SHAPE, dtype=torch.float32, batch_invariant=True))
    tied = torch.tensor([[0.5, 2.0, 1.0, 2.0, 2.0, -1.0, 0.0, 1.0]])
    ids, _ = layer.router(tied, None)
    assert ids.tolist() == [[1, 3]]
    many = torch.cat([torch.randn(50, 8), tied, torch.randn(20, 8)])
    assert layer.router(many, None)[0][50].tolist() == [1, 3]


def test_planner_refusals_and_auto():
    env = Environment("cpu")
    base = MoEConfig(**SHAPE, batch_invariant=True)
    with pytest.raises(MoeflowError, match=r"MF212.*fp8-tensor.*valid quant schemes here: \['none', 'fp8-channel', "
                                           r"'fp8-block'\]"):
        plan(base.replace(quant="fp8-tensor"), env)
    with pytest.raises(MoeflowError, match=r"MF212.*runner 'grouped_mm'.*valid runners here: \['reference'\]"):
        plan(base.replace(runner="grouped_mm"), env)
    auto = plan(base, env)  # "auto" skips what cannot promise it
    assert auto.runner == "reference" and auto.batch_invariant
    assert any(r.startswith("batch-invariant:") for r in auto.reasons)
    ep = Environment("cpu", world_size=2)
    with pytest.raises(MoeflowError, match=r"MF212.*dispatcher 'allgather'"):
        plan(base.replace(dispatcher="allgather"), ep)
    assert plan(base, ep).dispatcher == "alltoall"
    with pytest.raises(MoeflowError, match=r"MF212.*num_redundant_experts=2.*replica"):
        plan(base.replace(num_redundant_experts=2), ep)
    assert plan(base.replace(num_redundant_experts=2), env).batch_invariant  # one process: every replica here
    gpu = Environment("cuda", capability=(9, 0))  # a hypothetical H100: the Triton runner and router promise it
    hopper = plan(base.replace(device="cpu"), gpu)
    assert (hopper.runner, hopper.router, hopper.fused_layer) == ("triton", "triton", False)
    assert plan(MoEConfig(**SHAPE), gpu).fused_layer  # the default plan keeps the one-launch layer


def test_fixed_order_arithmetic():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 300, generator=g)
    w = torch.randn(50, 300, generator=g)
    assert_close(fixed_matmul(x, w), x.double() @ w.double().T, 1e-6, "fixed_matmul")
    assert torch.equal(fixed_matmul(x, w)[17:18], fixed_matmul(x[17:18], w))
    assert fixed_matmul(x[:0], w).shape == (0, 50) and not fixed_matmul(x[:, :0], w).any()
    assert_close(fixed_sum(x), x.double().sum(-1), 1e-6, "fixed_sum")
    assert torch.equal(fixed_sum(x)[5], fixed_sum(x[5:6])[0])
    assert fixed_sum(x[:, :0]).shape == (37,)
    assert_close(fixed_softmax(x), x.softmax(-1), 1e-6, "fixed_softmax")
    big = torch.randn(70001, generator=g)  # over torch's 32768-element grain: several threads' ranges
    assert torch.equal(fixed_apply(torch.exp, big)[-3:], fixed_apply(torch.exp, big[-3:]))
    assert_close(fixed_apply(torch.exp, big), big.exp(), 1e-6, "fixed_apply")
    vals, ids = fixed_topk(torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]]), 3)
    assert ids.tolist() == [[1, 2, 4]] and vals.tolist() == [[3.0, 3.0, 3.0]]
