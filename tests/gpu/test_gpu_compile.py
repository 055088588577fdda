"""torch.compile through moeflow layers on the GPU (moeflow.ops): inductor's default mode and mode="reduce-overhead"
(inductor's CUDA graphs, which record the op's launches) give the bits of the eager layer on fresh inputs, hold the
layer's graph-safe op, and keep a plan that is not graph-safe out of their CUDA graphs.
Run: pytest -m gpu tests/gpu/test_gpu_compile.py
"""
import pytest
import torch
from torch import nn

from moeflow import MoE
from oracle import assert_close, layer_oracle, route_for
from tolerances import rel_tol

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = dict(num_experts=16, hidden_size=256, intermediate_size=256, top_k=4, dtype=torch.bfloat16, device="cuda")


class Stack(nn.Module):
    """Two layers: x -> x + moe(x, gate(x)), then x + moe.forward_topk(x, top-k of the second gate's softmax);
    -> (the output, the second layer's ids and weights)."""

    def __init__(self, a: MoE, b: MoE):
        super().__init__()
        self.a, self.b = a, b
        self.gate_a = nn.Linear(256, 16, bias=False, device="cuda", dtype=torch.bfloat16)
        self.gate_b = nn.Linear(256, 16, bias=False, device="cuda", dtype=torch.bfloat16)

    def forward(self, x):
        x = x + self.a(x, self.gate_a(x))
        w, ids = torch.softmax(self.gate_b(x).float(), dim=-1).topk(4, dim=-1)
        return x + self.b.forward_topk(x, ids, w), ids, w


def run_compiled(compiled, model: Stack, x):
    """-> (the compiled stack's output, the eager stack's on the compiled routing). Inductor's own softmax may
    differ from eager's by an ulp (seen on an H200 at 51f3d1d: one weight of 400 by 1.5e-8, traced part by part
    on an H100 on 2026-12-05), which is not moeflow's to match; so the second layer's eager reference
    takes the compiled ids and weights, after a check that those weights are eager's softmax at those ids within two
    ulps. Everything moeflow computes must then match bit for bit."""
    y, ids, w = (t.clone() for t in compiled(x))  # reduce-overhead's outputs live in its pool until the next call
    h = x + model.a(x, model.gate_a(x))
    probs = torch.softmax(model.gate_b(h).float(), dim=-1)
    torch.testing.assert_close(w, probs.gather(1, ids), rtol=2.5e-7, atol=0)
    return y, h + model.b.forward_topk(h, ids, w)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles new modules through the same forward code: start from dynamo's empty caches, so that the
    recompiles of earlier tests do not count against this one's recompile limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def stack(make_layer, **fields):
    return Stack(make_layer(**SHAPE, **fields), make_layer(**SHAPE, **fields)).requires_grad_(False).eval()


def cudagraph_skips() -> int:
    from torch._dynamo.utils import counters
    return counters["inductor"]["cudagraph_skips"]


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("scheme", ["none", "fp8-block"])
def test_compiled_stack_gives_the_eager_bits(make_layer, scheme, mode):
    model = stack(make_layer, quant=scheme, runner="triton")
    assert model.a.plan.graph_safe
    compiled = torch.compile(model, mode=mode, fullgraph=True)
    skips = cudagraph_skips()
    with torch.inference_mode():
        for t in (1, 3, 16, 100, 16):  # 16 twice: a second replay of the same shape on fresh inputs
            y, ref = run_compiled(compiled, model, torch.randn(t, 256, device="cuda", dtype=torch.bfloat16))
            assert torch.equal(y, ref), f"{scheme} {mode} T={t}"
    assert cudagraph_skips() == skips  # reduce-overhead: every graph was captured, none skipped


def test_compiled_layer_against_oracle(make_layer):
    moe = make_layer(**SHAPE, quant="fp8-block", runner="triton")
    compiled = torch.compile(moe, mode="reduce-overhead", fullgraph=True)
    with torch.inference_mode():
        for t in (2, 37):
            x, logits = torch.randn(t, 256, device="cuda", dtype=torch.bfloat16), torch.randn(t, 16, device="cuda")
            y = compiled(x, logits).clone()
            ids, w = route_for(moe.config, logits, moe.e_score_correction_bias)
            assert_close(y, layer_oracle(moe, x, ids, w), rel_tol("fp8-block", torch.bfloat16), f"T={t}")


def test_plan_not_graph_safe_stays_out_of_cuda_graphs(make_layer):
    """The reference runner is not graph-safe: its op carries torch.Tag.cudagraph_unsafe, and reduce-overhead runs
    it outside its graphs (skipped or partitioned) and still gives the eager bits."""
    model = stack(make_layer, runner="reference")
    assert not model.a.plan.graph_safe
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.inference_mode():
        for t in (3, 3, 8):
            y, ref = run_compiled(compiled, model, torch.randn(t, 256, device="cuda", dtype=torch.bfloat16))
            assert torch.equal(y, ref), f"T={t}"


class Residual(nn.Module):
    """x -> x + moe(x, gate(x))."""

    def __init__(self, moe: MoE):
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(256, 16, bias=False, device="cuda", dtype=torch.bfloat16)

    def forward(self, x):
        return x + self.moe(x, self.gate(x))


def test_layers_compiled_one_by_one_with_cuda_graphs(make_layer):
    """Regional compilation with mode="reduce-overhead": ten blocks compiled one by one share one compiled frame
    (the op finds each layer by its anchor, a static input of inductor's graphs), each replays its own layer's bits,
    and no CUDA graph is skipped. With the layer's id in the op, each block had compiled the same frame again and
    from the ninth the blocks ran eagerly."""
    from torch._dynamo.utils import counters
    blocks = [Residual(make_layer(**SHAPE, quant="fp8-block", runner="triton")).requires_grad_(False)
              for _ in range(10)]
    for b in blocks:
        b.compile(mode="reduce-overhead", fullgraph=True)
    graphs, skips = counters["stats"]["unique_graphs"], cudagraph_skips()
    with torch.inference_mode():
        for _ in range(3):  # warm-up, recording, replay
            x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
            y, want = x, x
            for b in blocks:
                y, want = b(y).clone(), b.forward(want)
            assert torch.equal(y, want)
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert cudagraph_skips() == skips


def test_transformers_model_compiled_with_cuda_graphs():
    pytest.importorskip("transformers")
    from moeflow.integrations.hf import prepare_experts
    from moeflow.integrations.hf.tiny import tiny_model
    model = tiny_model("qwen3_moe", size="fp8", dtype=torch.bfloat16).cuda()
    model.set_experts_implementation("moeflow")
    assert prepare_experts(model) == 2  # registers the experts modules with moeflow.ops: one graph, no breaks
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    skips = cudagraph_skips()
    with torch.inference_mode():
        for _ in range(3):
            ids = torch.randint(0, 256, (2, 9), device="cuda")
            ref = model(ids).logits
            out = compiled(ids).logits.clone()
            assert_close(out, ref, 2e-2, "qwen3_moe logits, compiled against eager")  # inductor fuses the rest
    assert cudagraph_skips() == skips


def test_transformers_generate_with_static_cache_compiles():
    """transformers' generate with a static cache compiles the decoding forward itself: with moeflow experts it must
    compile without graph breaks and give the tokens of the uncompiled generate (float32: the compiled rest of the
    model moves logits by ~1e-6, far below the greedy margins of this model)."""
    pytest.importorskip("transformers")
    from torch._dynamo.utils import counters
    from moeflow.integrations.hf.tiny import tiny_model
    model = tiny_model("qwen3_moe", dtype=torch.float32).cuda()
    model.set_experts_implementation("moeflow")
    ids = torch.randint(0, 256, (2, 9), device="cuda")
    with torch.inference_mode():
        ref = model.generate(ids, max_new_tokens=12, do_sample=False)
        counters.clear()
        out = model.generate(ids, max_new_tokens=12, do_sample=False, cache_implementation="static")
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])  # generate compiled its decoding step
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.equal(out, ref)


def test_experts_path_compiled_with_cuda_graphs(make_layer):
    """ExpertsPath on a model library's own weights, compiled with mode="reduce-overhead": the eager bits, no CUDA
    graph skipped (the weights are inputs of the op, so inductor's graphs hold them as static inputs)."""
    from moeflow.experts import ExpertWeights
    from moeflow.integrations.path import ExpertsPath
    moe = make_layer(**SHAPE, quant="fp8-block", runner="triton")
    path = ExpertsPath(moe.config)
    weights = ExpertWeights(moe.gate_up_proj, moe.down_proj, moe.gate_up_proj_scale_inv, moe.down_proj_scale_inv)
    compiled = torch.compile(lambda x, i, w: path(x, i, w, weights), mode="reduce-overhead", fullgraph=True)
    skips = cudagraph_skips()
    with torch.inference_mode():
        for t in (1, 7, 7, 40):
            x, logits = torch.randn(t, 256, device="cuda", dtype=torch.bfloat16), torch.randn(t, 16, device="cuda")
            ids, w = route_for(moe.config, logits, moe.e_score_correction_bias)
            assert torch.equal(compiled(x, ids, w).clone(), path(x, ids, w, weights)), f"T={t}"
    assert cudagraph_skips() == skips
