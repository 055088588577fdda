"""The whole layer (route -> local dispatch -> triton experts -> combine) captured in one CUDA
graph and replayed: no host synchronization anywhere on the path. Replays on new inputs copied
into the captured buffers must equal eager calls, bit for bit (same kernels, same order).
Run: pytest -m gpu tests/gpu
"""
import pytest
import torch

from oracle import assert_close, captured, layer_oracle, replayed, route_for
from tolerances import rel_tol

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("t", [1, 16, 300])
@pytest.mark.parametrize("scheme", ["none", "fp8-channel", "fp8-block"])
def test_whole_layer_graph_replay(make_layer, scheme, t):
    layer = make_layer(num_experts=16, hidden_size=256, intermediate_size=256, top_k=4, quant=scheme,
                       dtype=torch.bfloat16, device="cuda", runner="triton", num_shared_experts=1,
                       shared_intermediate_size=128)
    x = torch.randn(t, 256, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(t, 16, device="cuda")
    graph, out = captured(lambda: layer(x, logits))  # a warm-up (compile) call, then the capture
    for _ in range(3):  # fresh inputs into the captured buffers
        x.copy_(torch.randn_like(x))
        logits.copy_(torch.randn_like(logits))
        out.fill_(float("nan"))  # poison: replay must rewrite every element
        graph.replay()
        torch.cuda.synchronize()
        eager = layer(x, logits)
        assert torch.equal(out, eager), f"graph replay differs from eager ({scheme}, T={t})"
        ids, w = route_for(layer.config, logits, layer.e_score_correction_bias)
        assert_close(out, layer_oracle(layer, x, ids, w), rel_tol(scheme, torch.bfloat16), f"{scheme} T={t}")


@pytest.mark.parametrize("t", [1, 64, 2000])
@pytest.mark.parametrize("scheme", ["none", "fp8-block"])
def test_pdl_chain_matches_plain_launches(make_layer, scheme, t, monkeypatch):
    """Programmatic dependent launch (MOEFLOW_TRITON_PDL=1, the default on Hopper) lets each kernel
    start while the one before finishes. A chain of layers, each routed by logits of the previous
    output, replayed from one graph with PDL must give the bits of plain eager launches: a kernel
    that read its inputs (or wrote a buffer still being read) before the kernel before it ended
    would change them."""
    torch.manual_seed(0)
    layer = make_layer(num_experts=16, hidden_size=256, intermediate_size=256, top_k=4, quant=scheme,
                       dtype=torch.bfloat16, device="cuda", runner="triton")
    gate = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16) / 16

    def chain(x):
        for _ in range(6):
            x = layer(x, (x @ gate.T).float())
            x = x / (x.float().abs().amax(dim=1, keepdim=True) + 1e-3).to(x.dtype)
        return x

    x = torch.randn(t, 256, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv("MOEFLOW_TRITON_PDL", "0")
    want = chain(x)
    monkeypatch.setenv("MOEFLOW_TRITON_PDL", "1")
    assert torch.equal(chain(x), want), "eager with PDL differs from plain launches"
    graph, out = captured(lambda: chain(x))
    for _ in range(5):
        out.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want), f"graph replay with PDL differs ({scheme}, T={t})"


@pytest.mark.parametrize("t", [1, 16, 300])
@pytest.mark.parametrize("scheme,runner", [("fp8-channel", "triton"), ("fp8-block", "triton"), ("fp8-tensor", "triton"),
                                           ("fp8-channel", "reference"), ("fp8-block", "reference"),
                                           ("fp8-tensor", "reference"), ("fp8-channel", "grouped_mm"),
                                           ("fp8-tensor", "grouped_mm")])  # grouped_mm: no fp8-block on CUDA
def test_local_sort_quantizes_decode_tokens(make_layer, weights_for, scheme, t, runner, monkeypatch):
    """The local dispatcher's Triton sorts also quantize the tokens (the one-launch sort at T * K <=
    128 copies, here T = 1 and 16 with K = 4; the segment sort's histogram launch at T = 300): the
    runner gets an FP8 batch and the layer's output is bit for bit the one with
    dispatch_payload="dtype" (the runner quantizing the same rows). fp8-tensor only up to
    TENSOR_QUANT_IN_SORT_MAX elements (T = 300 here is past it: the runner quantizes). The separate launches
    throughout: at T=1 an fp8-block triton layer would otherwise run its one-launch form, which has no sort
    (tests/gpu/test_gpu_fused_layer.py)."""
    from moeflow.config import MoEConfig
    from moeflow.dispatch.expert_sort import TENSOR_QUANT_IN_SORT_MAX
    monkeypatch.setenv("MOEFLOW_TRITON_FUSED", "0")
    monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", "0")  # counts the runner's calls: an eager graph's first call makes two
    cfg = MoEConfig(num_experts=16, hidden_size=384, intermediate_size=256, top_k=4, quant=scheme,
                    dtype=torch.bfloat16, device="cuda", runner=runner)
    state = weights_for(cfg)
    fused, plain = make_layer(cfg), make_layer(cfg.replace(dispatch_payload="dtype"))
    fused.load_weights(state)
    plain.load_weights(state)
    seen = []
    run = fused.runner.run
    fused.runner.run = lambda batch, w: seen.append(batch.hidden_scale is not None) or run(batch, w)
    x = torch.randn(t, 384, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(t, 16, device="cuda")
    out = fused(x, logits)
    assert seen == [scheme != "fp8-tensor" or x.numel() <= TENSOR_QUANT_IN_SORT_MAX]
    assert torch.equal(out, plain(x, logits))
    if runner == "triton":  # the others' accuracy: tests/gpu/test_gpu_runners.py
        ids, w = route_for(cfg, logits, fused.e_score_correction_bias)
        assert_close(out, layer_oracle(fused, x, ids, w), rel_tol(scheme, torch.bfloat16), f"{scheme} T={t}")


@pytest.mark.parametrize("scheme,gate_up_cfg", [
    ("none", dict(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4, x_tma=1)),
    ("fp8-block", dict(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3, scale_overlap=1))])
def test_rows_copied_into_order_by_scatter(make_layer, scheme, gate_up_cfg, tmp_path, monkeypatch):
    """Where gate_up reads its rows in order (bf16 with x_tma; fp8-block's Gluon tile), the local dispatcher's
    inverse map (ExpertBatch.copy_rows) scatters the copy into order: the layer's output is bit-equal to the
    gather's, close to the oracle, and the same from a CUDA graph. A tuned file in MOEFLOW_KERNEL_CONFIG_DIR
    makes the runner pick those tiles for this small shape."""
    from moeflow.kernels import configs as kc
    from moeflow.kernels.gemm import gate_up as gate_up_mod
    e, h, i, k, t = 8, 256, 256, 2, 300
    down_k = 128 if scheme != "none" else 64
    pair = kc.MoEKernelConfig(kc.GemmConfig(**gate_up_cfg), kc.GemmConfig(64, 128, down_k, 8, 4, 3))
    name = kc.file_name(torch.cuda.get_device_name(), e, i, h, scheme)
    kc.write_table(tmp_path / name, dict(device=torch.cuda.get_device_name(), E=e, N=i, K=h, scheme=scheme), {t: pair})
    monkeypatch.setenv("MOEFLOW_KERNEL_CONFIG_DIR", str(tmp_path))
    layer = make_layer(num_experts=e, hidden_size=h, intermediate_size=i, top_k=k, quant=scheme,
                       dtype=torch.bfloat16, device="cuda", runner="triton")
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand(t, k, device="cuda") + 0.1
    calls = []
    scatter = gate_up_mod._rows_in_order
    monkeypatch.setattr(gate_up_mod, "_rows_in_order", lambda *a: calls.append(a[3] is not None) or scatter(*a))
    got = layer.forward_topk(x, ids, w)
    monkeypatch.setattr(gate_up_mod, "_rows_in_order",
                        lambda xq, xs, src, _: calls.append(False) or scatter(xq, xs, src, None))
    want = layer.forward_topk(x, ids, w)
    assert calls == [True, False], "the runner did not copy rows into order through the tuned tile"
    assert torch.equal(got, want)
    assert_close(got, layer_oracle(layer, x, ids, w), rel_tol(scheme, torch.bfloat16), f"{scheme} rows scattered")
    monkeypatch.setattr(gate_up_mod, "_rows_in_order", scatter)
    assert torch.equal(replayed(lambda: layer.forward_topk(x, ids, w)), want), "graph replay"
