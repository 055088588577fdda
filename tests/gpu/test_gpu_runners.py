"""The other runners on a real GPU through MoE(..., device="cuda") against the float64 oracle:
"grouped_mm" (torch._grouped_mm bf16; torch._scaled_grouped_mm fp8-tensor / fp8-channel) and
"reference" (every scheme). Also what "auto" picks on this GPU. Run: pytest -m gpu tests/gpu
"""
import pytest
import torch

from oracle import assert_close, layer_oracle, route_for
from tolerances import rel_tol

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = dict(num_experts=8, hidden_size=256, intermediate_size=256, top_k=2)


def routing(t, e, k):
    ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k].to(torch.int32)
    return ids, torch.rand(t, k, device="cuda") + 0.1


@pytest.mark.parametrize("t", [1, 64, 700])
@pytest.mark.parametrize("scheme", ["none", "fp8-tensor", "fp8-channel"])
def test_grouped_mm(make_layer, poison, scheme, t):
    layer = make_layer(**SHAPE, quant=scheme, dtype=torch.bfloat16, device="cuda", runner="grouped_mm")
    x = torch.randn(t, 256, device="cuda", dtype=torch.bfloat16)
    ids, w = routing(t, 8, 2)
    out = layer.forward_topk(x, ids, w)
    assert_close(out, layer_oracle(layer, x, ids, w), rel_tol(scheme, torch.bfloat16), f"grouped_mm {scheme} T={t}")


@pytest.mark.parametrize("scheme", ["none", "fp8-tensor", "fp8-channel", "fp8-block"])
def test_reference_on_cuda(make_layer, poison, scheme):
    layer = make_layer(**SHAPE, quant=scheme, dtype=torch.bfloat16, device="cuda", runner="reference")
    x = torch.randn(33, 256, device="cuda", dtype=torch.bfloat16)
    ids, w = routing(33, 8, 2)
    assert_close(layer.forward_topk(x, ids, w), layer_oracle(layer, x, ids, w), rel_tol(scheme, torch.bfloat16), scheme)


def test_auto_prefers_triton(make_layer):
    for scheme in ("none", "fp8-tensor", "fp8-channel", "fp8-block"):
        layer = make_layer(**SHAPE, quant=scheme, dtype=torch.bfloat16, device="cuda")
        assert layer.plan.runner == "triton", layer.plan


@pytest.mark.parametrize("scheme", ["none", "fp8-tensor", "fp8-channel", "fp8-block"])
def test_layer_built_on_cpu_moves_to_cuda(make_layer, poison, scheme):
    """A layer built and loaded on the CPU, then .to("cuda", bfloat16) as a transformers model is: planned again
    there ("auto" now takes triton), FP8 weights and scales still FP8 / float32, outputs right; and back to the CPU."""
    layer = make_layer(**SHAPE, quant=scheme, dtype=torch.float32)
    assert layer.plan.runner != "triton"
    stored = layer.gate_up_proj.dtype if layer.scheme.quantized else torch.bfloat16  # FP8 stays FP8
    layer.to("cuda", torch.bfloat16)
    assert layer.plan.runner == "triton" and layer.config.device.type == "cuda", layer.plan
    assert layer.gate_up_proj.dtype == stored and layer.gate_up_proj.is_cuda
    for t in (1, 40):
        x = torch.randn(t, 256, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(t, 8, device="cuda")
        ids, w = route_for(layer.config, logits)
        out = layer(x, logits)
        assert_close(out, layer_oracle(layer, x, ids, w), rel_tol(scheme, torch.bfloat16), f"{scheme} T={t} on cuda")
    layer.cpu()
    assert layer.config.device.type == "cpu" and layer.plan.runner != "triton"
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    logits = torch.randn(5, 8)
    ids, w = route_for(layer.config, logits)
    assert_close(layer(x, logits), layer_oracle(layer, x, ids, w), rel_tol(scheme, torch.bfloat16), f"{scheme} on cpu")


@pytest.mark.parametrize("scheme", ["none", "fp8-block"])
def test_eager_call_with_grad_is_inference_only(make_layer, scheme):
    """The Triton runner's eager calls with grad mode on (a model fine-tuning other layers): the same bits as under
    no_grad, for a hidden state or expert weights that require grad, and a backward through the output raises MF307
    (the kernels record no autograd history; gradients must not stop silently)."""
    from moeflow.errors import MoeflowError
    layer = make_layer(**SHAPE, quant=scheme, dtype=torch.bfloat16, device="cuda", runner="triton")
    for t in (1, 40):
        x = torch.randn(t, 256, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(t, 8, device="cuda")
        with torch.no_grad():
            want = layer(x, logits).clone()
        out = layer(x.clone().requires_grad_(), logits)
        assert out.requires_grad and torch.equal(out, want), f"{scheme} T={t}"
        with pytest.raises(MoeflowError) as info:
            out.float().sum().backward()
        assert info.value.code == "MF307"
    for p in layer.parameters():  # the bf16 weights, or the FP8 weights' float32 scales
        if p.dtype.itemsize > 1:
            p.requires_grad_(True)
    x = torch.randn(9, 256, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(9, 8, device="cuda")
    out = layer(x, logits)
    assert out.requires_grad
    with pytest.raises(MoeflowError) as info:
        out.float().sum().backward()
    assert info.value.code == "MF307"


def test_device_omitted_inside_a_cuda_block(make_layer, poison):
    """device= omitted inside `with torch.device("cuda")` builds on CUDA, as nn.Linear would: "auto" takes triton
    and the outputs match the oracle."""
    with torch.device("cuda"):
        layer = make_layer(**SHAPE, quant="fp8-block", dtype=torch.bfloat16)
    assert layer.config.device.type == "cuda" and layer.plan.runner == "triton" and layer.gate_up_proj.is_cuda
    x = torch.randn(7, 256, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(7, 8, device="cuda")
    ids, w = route_for(layer.config, logits)
    assert_close(layer(x, logits), layer_oracle(layer, x, ids, w), rel_tol("fp8-block", torch.bfloat16), "cuda block")


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph-replay"])
def test_every_integer_id_dtype_on_cuda(make_layer, graph, monkeypatch):
    """The triton runner's layer and ExpertsPath read every accepted id dtype (unsigned ones included) as int32 ids,
    on the eager path and through the small-batch graph replay: the bits of int32 ids."""
    from moeflow.experts import ExpertWeights
    from moeflow.integrations.path import ExpertsPath
    from moeflow.layer import ID_DTYPES
    monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", "1" if graph else "0")
    layer = make_layer(**SHAPE, dtype=torch.bfloat16, device="cuda", runner="triton")
    path = ExpertsPath(layer.config)
    weights = ExpertWeights(layer.gate_up_proj, layer.down_proj)
    x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
    ids, w = routing(5, 8, 2)
    want_layer, want_path = layer.forward_topk(x, ids, w), path(x, ids, w, weights)
    for dtype in ID_DTYPES:
        assert torch.equal(layer.forward_topk(x, ids.to(dtype), w), want_layer), dtype
        assert torch.equal(path(x, ids.to(dtype), w, weights), want_path), dtype


@pytest.mark.parametrize("scheme", ["fp8-tensor", "fp8-channel", "fp8-block"])
def test_quantizing_a_layer_holds_one_expert_in_float32_on_gpu(scheme):
    """Building a quantized layer (random init) and loading another scheme's FP8 checkpoint draw and quantize one
    expert at a time: the peak above the stored weights is a few float32 copies of one expert, where drawing and
    quantizing the whole [E, N, K] at once held its high-precision draw and two float32 copies of all of it."""
    from moeflow import MoE
    from moeflow.quant import create_scheme
    e, h, i = 64, 7168, 1024  # gate_up [64, 2048, 7168]: 3.8 GB in float32, 59 MB an expert
    expert_f32 = 2 * i * h * 4
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    layer = MoE(num_experts=e, hidden_size=h, intermediate_size=i, top_k=2, quant=scheme, dtype=torch.bfloat16,
                device="cuda", runner="reference")
    stored = torch.cuda.memory_allocated() - base
    built_peak = torch.cuda.max_memory_allocated() - base
    assert built_peak <= stored + 6 * expert_f32, (built_peak, stored, expert_f32)
    other = "fp8-block" if scheme != "fp8-block" else "fp8-channel"
    src = create_scheme(other)
    ckpt = {}
    for name, (n, k) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
        w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
        ckpt[name], ckpt[name + "_scale_inv"] = src.quantize_weight(w)
        del w
    ckpt_bytes = sum(t.numel() * t.element_size() for t in ckpt.values())
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    layer.load_weights(ckpt, strict=False)
    load_peak = torch.cuda.max_memory_allocated() - before
    assert load_peak <= 6 * expert_f32, (load_peak, expert_f32, ckpt_bytes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("scheme", ["fp8-tensor", "fp8-channel", "fp8-block"])
def test_torch_quantizers_give_the_cpu_bits_on_gpu(scheme, dtype):
    """The schemes' torch quantizers on CUDA, for every input dtype (FP8 too: a payload quantized again, which
    test_prequantized_payload does, and CUDA has fewer FP8 kernels than the CPU): the CPU's bits, for
    activations [M, K] (K a multiple of 128 or not) and weights [E, N, K]."""
    from moeflow.quant import create_scheme
    s = create_scheme(scheme)
    for shape in ((37, 256), (5, 200)):
        x = (torch.randn(*shape) * torch.rand(shape[0], 1) * 100).clamp(-448, 448).to(dtype)
        q, scale = s.quantize_activation(x)
        q_gpu, scale_gpu = s.quantize_activation(x.cuda())
        assert torch.equal(q_gpu.cpu().view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale_gpu.cpu(), scale)
    w = (torch.randn(3, 256, 384) * 10).clamp(-448, 448).to(dtype)
    q, scale = s.quantize_weight(w)
    q_gpu, scale_gpu = s.quantize_weight(w.cuda())
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale_gpu.cpu(), scale)
