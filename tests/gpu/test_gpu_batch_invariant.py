"""Batch-invariant mode on a GPU (MoEConfig.batch_invariant): with the Triton runner and router in bf16 (and FP8), a
token's output row has the same bits alone, inside batches of 7, 128, 1,000 and 4,096 at random positions, twice in
a row, and replayed from a CUDA graph; the reference runner on CUDA too; the fixed-tile linear kernel (shared experts)
against its reference and at every M. Run: pytest -m gpu tests/gpu/test_gpu_batch_invariant.py
"""
import pytest
import torch

from oracle import assert_close, bits, layer_oracle, replayed
from tolerances import rel_tol

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SIZES = (1, 7, 128, 1000, 4096)
QWEN_LIKE = dict(num_experts=64, hidden_size=1024, intermediate_size=384, top_k=8)
DEEPSEEK_LIKE = dict(num_experts=64, hidden_size=1024, intermediate_size=256, top_k=6, scoring="sigmoid",
                     num_expert_groups=8, topk_groups=4, use_correction_bias=True, routed_scaling_factor=2.5,
                     num_shared_experts=1, shared_intermediate_size=512)


def check_invariant(layer, sizes=SIZES, probes: int = 4):
    """As tests/test_batch_invariant.py: the probes' rows alone, inside one batch of each size, in the largest batch
    twice, and the largest batch replayed from a CUDA graph, all the same bits. -> (output, x, logits)."""
    cfg = layer.config
    pool = max(sizes)
    x = torch.randn(pool, cfg.hidden_size, device="cuda").to(cfg.dtype)
    logits = torch.randn(pool, cfg.num_experts, device="cuda")
    full = layer(x, logits)
    assert torch.equal(bits(layer(x, logits)), bits(full)), "the same batch twice"
    assert torch.equal(bits(replayed(lambda: layer(x, logits))), bits(full)), "replayed from a CUDA graph"
    chosen = torch.randperm(pool, device="cuda")[:probes]
    for t in sizes:
        rows = torch.randint(0, pool, (t,), device="cuda")
        at = torch.randperm(t, device="cuda")[:probes]
        rows[at] = chosen[:len(at)]
        out = layer(x[rows], logits[rows])
        small = replayed(lambda: layer(x[rows], logits[rows])) if t <= 128 else out
        for a, p in zip(at.tolist(), chosen.tolist()):
            assert torch.equal(bits(out[a]), bits(full[p])), f"token {p} at position {a} of {t} differs"
            assert torch.equal(bits(small[a]), bits(full[p])), f"token {p} at {a} of {t}, graph replay, differs"
    return full, x, logits


@pytest.mark.parametrize("scheme", ["none", "fp8-block", "fp8-channel"])
def test_triton_rows_do_not_depend_on_the_batch(make_layer, scheme):
    layer = make_layer(**QWEN_LIKE, quant=scheme, dtype=torch.bfloat16, device="cuda", batch_invariant=True)
    assert (layer.plan.runner, layer.plan.router, layer.plan.fused_layer) == ("triton", "triton", False)
    full, x, logits = check_invariant(layer)
    ids, w = layer.router(logits[:512], None)
    assert_close(full[:512], layer_oracle(layer, x[:512], ids, w, grouped=True), rel_tol(scheme, torch.bfloat16),
                 f"batch-invariant {scheme} vs the oracle")


@pytest.mark.parametrize("router", ["triton", "torch"])
def test_grouped_routing_and_shared_experts(make_layer, monkeypatch, router):
    """DeepSeek-style routing (sigmoid, groups, correction bias) and a shared expert (the fixed-tile linear)."""
    if router == "torch":  # the torch router's fixed-order reductions on CUDA: the Triton router declared CPU-only
        from dataclasses import replace

        from moeflow.routing import ROUTERS
        cls = ROUTERS.get("triton")
        monkeypatch.setattr(cls, "caps", replace(cls.caps, devices=frozenset({"cpu"})))
    layer = make_layer(**DEEPSEEK_LIKE, quant="fp8-block", dtype=torch.bfloat16, device="cuda", batch_invariant=True)
    assert layer.plan.router == router
    check_invariant(layer, sizes=(1, 7, 1000))


def test_reference_runner_on_cuda(make_layer):
    layer = make_layer(num_experts=8, hidden_size=256, intermediate_size=128, top_k=2, dtype=torch.float32,
                       device="cuda", runner="reference", batch_invariant=True)
    check_invariant(layer, sizes=(1, 7, 300))


def test_linear_kernel():
    from moeflow.kernels.gemm.linear import linear, linear_torch
    x = torch.randn(3000, 1024, device="cuda").bfloat16()
    w = torch.randn(700, 1024, device="cuda").bfloat16()
    out = linear(x, w)
    assert_close(out, x.double() @ w.double().T, 1e-5, "linear bf16")
    assert_close(linear(x[:64], w), linear_torch(x[:64], w), 1e-5, "linear vs its reference")
    for rows in ([17], [2999, 17, 5], list(range(100, 37, -1))):
        assert torch.equal(bits(linear(x[rows], w)), bits(out[rows]))
