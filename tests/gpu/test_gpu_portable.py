"""The portable Triton path on a Hopper GPU: each other architecture's rules forced (MOEFLOW_KERNEL_ARCH), the whole
layer against the float64 oracle. sm_80 / sm_86: no TMA, no PDL, no Gluon, tiles fitted to their shared memory, FP8
schemes weight-only (the oracle then leaves activations unquantized: the layer's scheme is weight_only.WeightOnly);
sm_89 / sm_120: FP8 dots, 80 KB tiles; sm_100: TMA and PDL, no Gluon. Run the module under DISABLE_MMA_V3=1 too
(benchmarks/gpu_run.sh does), so Triton emits the Ampere mma.sync instead of wgmma. Run: pytest -m gpu tests/gpu
"""
import pytest
import torch

from oracle import assert_close, layer_oracle
from tolerances import rel_tol

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCHEMES = ["none", "fp8-tensor", "fp8-channel", "fp8-block"]
SHAPE = dict(num_experts=8, hidden_size=384, intermediate_size=640, top_k=2)


def routing(t: int, e: int, k: int, one_expert: bool = False):
    ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k].to(torch.int32)
    if one_expert:  # every token's first copy to expert 3 (and expert 0 gets none)
        ids[:, 0] = 3
        ids[:, 1:] = torch.where(ids[:, 1:] == 3, 5, ids[:, 1:])
        ids = torch.where(ids == 0, 6, ids)
    return ids, torch.rand(t, k, device="cuda") + 0.1


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_100", "sm_120"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_portable_layer(make_layer, poison, monkeypatch, arch, scheme):
    monkeypatch.setenv("MOEFLOW_KERNEL_ARCH", arch)
    layer = make_layer(**SHAPE, quant=scheme, dtype=torch.bfloat16, device="cuda", runner="triton")
    wo = arch in ("sm_80", "sm_86") and scheme != "none"
    assert layer.plan.weight_only == wo and layer.scheme.activations_quantized == (scheme != "none" and not wo)
    assert arch in layer.plan.environment and "moeflow selftest" in layer.plan.unvalidated
    for t, one in ((1, False), (37, False), (300, True), (2500, False)):
        x = torch.randn(t, SHAPE["hidden_size"], device="cuda", dtype=torch.bfloat16)
        ids, w = routing(t, SHAPE["num_experts"], SHAPE["top_k"], one)
        out = layer.forward_topk(x, ids, w)
        want = layer_oracle(layer, x, ids, w, grouped=t > 256)  # the gathered oracle of T=2500 would take 18 GiB
        assert_close(out, want, rel_tol(scheme, torch.bfloat16), f"{arch} {scheme} T={t}")
    empty = layer.forward_topk(x[:0], ids[:0], w[:0])
    assert empty.shape == (0, SHAPE["hidden_size"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("scheme", ["none", "fp8-block", "fp8-channel"])
def test_weight_only_layer_dtypes(make_layer, poison, monkeypatch, scheme, dtype):
    """sm_80's weight-only FP8 (and its bf16 path's siblings) in fp16 and fp32 layers."""
    monkeypatch.setenv("MOEFLOW_KERNEL_ARCH", "sm_80")
    layer = make_layer(**SHAPE, quant=scheme, dtype=dtype, device="cuda", runner="triton")
    for t in (1, 200):
        x = torch.randn(t, SHAPE["hidden_size"], device="cuda", dtype=dtype)
        ids, w = routing(t, SHAPE["num_experts"], SHAPE["top_k"])
        out = layer.forward_topk(x, ids, w)
        assert_close(out, layer_oracle(layer, x, ids, w), rel_tol(scheme, dtype), f"sm_80 {scheme} {dtype} T={t}")
