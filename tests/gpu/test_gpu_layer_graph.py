"""The whole layer (route -> local dispatch -> triton experts -> combine) captured in one CUDA
graph and replayed: no host synchronization anywhere on the path. Replays on new inputs copied
into the captured buffers must equal eager calls, bit for bit (same kernels, same order).
Run: pytest -m gpu tests/gpu
"""
import pytest
import torch

from oracle import assert_close, layer_oracle, route_for
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
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile) outside the capture
        layer(x, logits)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x, logits)
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
