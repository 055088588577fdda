"""torch.compile through moeflow layers (moeflow.ops): a compiled model holds each layer as one op of its graph,
with no graph break, and computes what the eager model computes.

Before moeflow.ops, compiling the model below failed in dynamo (grouped_mm's fake kernel refuses float32). CPU
plans are not graph-safe, so these graphs hold the cudagraph-unsafe form of the op (layer_host_sync); the GPU
suite (tests/gpu/test_gpu_compile.py) covers the graph-safe form and mode="reduce-overhead".
"""
import copy
import gc
import shutil

import pytest
import torch
from torch import nn

from moeflow import MoE, MoeflowError
from moeflow import ops
from oracle import assert_close, layer_oracle, route_for
from tolerances import rel_tol

E, H, I, K = 8, 64, 96, 2


class Block(nn.Module):
    """x -> linear -> MoE (routing inside) + MoE.forward_topk (routing by the caller), residual."""

    def __init__(self, moe: MoE):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.gate = nn.Linear(H, E, bias=False)
        self.moe = moe

    def forward(self, x):
        h = self.lin(x)
        logits = self.gate(h)
        y = self.moe(h, logits)
        w, ids = torch.softmax(logits, dim=-1).topk(K, dim=-1)
        return x + y + self.moe.forward_topk(h, ids, w)


def block(seed=0, **fields) -> Block:
    torch.manual_seed(seed)
    moe = MoE(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K, dtype=torch.float32, device="cpu",
              **fields)
    return Block(moe).requires_grad_(False).eval()


class GraphRecorder:
    """A torch.compile backend that keeps each FX graph it is given and runs it as traced (aot_eager's forward)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def targets(self):
        return [str(n.target) for g in self.graphs for n in g.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("runner", ["auto", "reference"])
def test_compiled_block_matches_eager_one_graph(runner):
    model = block(runner=runner)
    rec = GraphRecorder()
    compiled = torch.compile(model, backend=rec, fullgraph=True, dynamic=True)
    for t in (5, 7, 13, 1, 0):  # one dynamic-shape graph for T >= 2; dynamo specializes T = 1 and T = 0
        x = torch.randn(t, H)
        y = compiled(x)
        ref = model(x)
        assert y.shape == ref.shape == (t, H)
        assert torch.equal(y, ref), f"T={t}"
    assert len(rec.graphs) == 3
    names = rec.targets()
    assert names.count("moeflow.layer_host_sync.default") == 2 * 3, names  # CPU plans are not graph-safe
    assert not any("grouped_mm" in n for n in names)  # the layer's insides stay out of the graph


def test_compiled_layer_matches_float64_oracle(make_layer):
    moe = make_layer(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K, dtype=torch.float32, device="cpu")
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)
    x, logits = torch.randn(13, H), torch.randn(13, E)
    ids, w = route_for(moe.config, logits, moe.e_score_correction_bias)
    assert_close(compiled(x, logits), layer_oracle(moe, x, ids, w), rel_tol("none", torch.float32), "compiled")


def test_each_layer_keeps_its_own_anchor():
    """A copy of a layer (same code, other weights) gets its own key: the compiled op runs the layer it was traced
    for, never the original."""
    a = block(seed=1)
    b = copy.deepcopy(a)
    b.moe.load_weights({"gate_up_proj": b.moe.gate_up_proj * 2, "down_proj": b.moe.down_proj})
    f = torch.compile(lambda m, x: m(x), backend="aot_eager", fullgraph=True)
    x = torch.randn(4, H)
    assert torch.equal(f(a, x), a(x))
    assert torch.equal(f(b, x), b(x))
    assert not torch.equal(a(x), b(x))
    assert ops.anchor_of(a.moe).data_ptr() != ops.anchor_of(b.moe).data_ptr()  # its own anchor
    assert ops.registered(b.moe, MoE._forward_eager)  # the copy registered itself (MoE.__setstate__)


def test_blocks_compiled_one_by_one_share_their_compiled_code():
    """Regional compilation (each block compiled on its own, block.compile(), as for a model's repeated decoder
    layers): the blocks share one compiled frame, each op running its own layer. The op had named its layer by id,
    and dynamo guarded each frame on that layer: every block recompiled the same code, and from the ninth (dynamo's
    recompile limit, 8) the blocks ran eagerly."""
    blocks = [block(seed=i) for i in range(11)]
    torch._dynamo.reset()
    rec = GraphRecorder()
    for b in blocks:
        b.compile(backend=rec, fullgraph=True)
    with torch.inference_mode():
        x = torch.randn(5, H)
        y, want = x, x
        for b in blocks:
            y, want = b(y), b.forward(want)  # the compiled call, and the eager forward
    assert torch.equal(y, want)
    assert len(rec.graphs) == 1  # one compile for all 11 (8 compiles, then eager, before)
    assert rec.targets().count("moeflow.layer_host_sync.default") == 2  # forward and forward_topk, one graph


def test_transformers_layers_compiled_one_by_one_share_their_compiled_code():
    """A transformers model's decoder layers compiled one by one, with moeflow experts planned (prepare_experts): one
    compiled graph for both layers, whose op takes each layer's experts anchor as an input (two graphs before)."""
    pytest.importorskip("transformers")
    from moeflow.integrations.hf import prepare_experts
    from moeflow.integrations.hf.tiny import tiny_model
    model = tiny_model("qwen3_moe")
    model.set_experts_implementation("moeflow")
    assert prepare_experts(model) == 2
    ids = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        torch._dynamo.reset()
        rec = GraphRecorder()
        for layer in model.model.layers:
            layer.compile(backend=rec)
        got = model(ids, use_cache=False).logits
    assert torch.equal(got, want)
    assert len(rec.graphs) == 1 and rec.targets().count("moeflow.layer_host_sync.default") == 1


def test_a_copied_anchor_finds_its_layer_off_capture():
    """The op finds its layer by the anchor's address, and given a copy of the anchor (torch.library.opcheck passes
    copies) by the serial it holds; a copy of a layer gets a serial of its own."""
    moe = block().moe
    twin = copy.deepcopy(moe)
    key = ops.op_key(moe, MoE._forward_eager)
    x, logits = torch.randn(3, H), torch.randn(3, E)
    for layer in (moe, twin):
        anchor = ops.anchor_of(layer)
        assert torch.equal(ops.layer_host_sync(x, [logits], key, anchor.clone(), []), layer(x, logits))
    assert int(ops.anchor_of(moe)) != int(ops.anchor_of(twin))
    twin.load_weights({"gate_up_proj": twin.gate_up_proj * 3, "down_proj": twin.down_proj})
    assert not torch.equal(ops.layer_host_sync(x, [logits], key, ops.anchor_of(twin).clone(), []), moe(x, logits))


def test_op_of_a_deleted_layer_raises_mf306():
    moe = block().moe
    key, anchor = ops.op_key(moe, MoE._forward_eager), ops.anchor_of(moe)
    x, logits = torch.randn(2, H), torch.randn(2, E)
    assert torch.equal(ops.layer_host_sync(x, [logits], key, anchor, []), moe(x, logits))
    del moe
    gc.collect()
    with pytest.raises(MoeflowError) as err:
        ops.layer_host_sync(x, [logits], key, anchor, [])
    assert err.value.code == "MF306"
    with pytest.raises(MoeflowError, match="MF306"):
        ops.layer(x, [logits], key, torch.zeros(1, dtype=torch.int64), [])  # no live layer's anchor (serial 0)
    with pytest.raises(MoeflowError, match="MF306"):
        ops.layer(x, [logits], "MoE.no_such_function", anchor, [])


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("trainable", ["all", "experts only"])
def test_compiled_with_grad_computes_and_its_backward_raises_mf307(backend, trainable):
    """Compiled with grad mode on, as eager calls: the forward computes as eager, and a backward through the layers
    raises MF307 as a MoeflowError, at run time, in every backend. Where only the experts' weights require grad (the
    input does not: a frozen model around unfrozen experts) the backward had gone through and left them no
    gradient; where the input did, aot_eager and inductor had failed the compile inside BackendCompilerFailed."""
    model = block()
    (model if trainable == "all" else model.moe).requires_grad_(True)
    head = nn.Linear(H, 1)  # something trainable after the layers, so that a backward runs at all
    x = torch.randn(3, H)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    y = compiled(x)
    assert_close(y.detach(), model(x).detach(), 1e-5, backend)  # inductor fuses the linears and softmax its own way
    with pytest.raises(MoeflowError) as info:
        head(y).sum().backward()
    assert info.value.code == "MF307"
    assert model.moe.gate_up_proj.grad is None
    with torch.no_grad():  # inference, the documented way
        assert_close(compiled(x), model(x), 1e-5, backend)


def test_bad_input_raises_its_code_when_run():
    """dynamo cannot build the coded errors, so the checks run inside the op: the compiled call raises them."""
    moe = block().moe
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)
    with pytest.raises(MoeflowError) as err:
        compiled(torch.randn(3, H, dtype=torch.float64), torch.randn(3, E))
    assert err.value.code == "MF302"
    with pytest.raises(MoeflowError) as err:
        compiled(torch.randn(3, H + 1), torch.randn(3, E))
    assert err.value.code == "MF301"


def test_ids_checked_at_run_time():
    """forward_topk's id-range check reads the ids on the host: inside the op, at run time, as in eager."""
    moe = block().moe
    compiled = torch.compile(moe.forward_topk, backend="aot_eager", fullgraph=True)
    x, w = torch.randn(2, H), torch.rand(2, K)
    ok = torch.tensor([[0, 1], [2, 3]])
    assert torch.equal(compiled(x, ok, w), moe.forward_topk(x, ok, w))
    with pytest.raises(MoeflowError) as err:
        compiled(x, torch.tensor([[0, 1], [2, E]]), w)
    assert err.value.code == "MF304"


def test_opcheck():
    moe = block().moe
    x, logits = torch.randn(6, H), torch.randn(6, E)
    ids = torch.randint(0, E, (6, 1)).expand(6, K).contiguous() + torch.arange(K)
    checks = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    anchor = ops.anchor_of(moe)
    torch.library.opcheck(ops.layer_host_sync, (x, [logits], ops.op_key(moe, MoE._forward_eager), anchor, []),
                          test_utils=checks)
    torch.library.opcheck(ops.layer_host_sync, (x, [ids % E, torch.rand(6, K)],
                                                ops.op_key(moe, MoE._forward_topk_eager), anchor, []),
                          test_utils=checks)
    # with the weights as inputs for autograd's sake, and an input that requires grad: the schema, the fake and the
    # autograd registration (running the backward, as test_aot_dispatch_dynamic does, raises MF307 by design)
    weights = [p.detach().requires_grad_(True) for p in moe.parameters()]
    torch.library.opcheck(ops.layer_host_sync, (x.clone().requires_grad_(True), [logits],
                                                ops.op_key(moe, MoE._forward_eager), anchor, weights),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                    reason="inductor on CPU compiles C++: no compiler here")
def test_inductor_compiles_the_block():
    model = block(seed=5)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(9, H)
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)  # inductor may fuse the linears' math


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "qwen2_moe", "olmoe"])
def test_transformers_model_compiles_with_moeflow_experts(family):
    """experts_implementation="moeflow": the whole transformers model is one graph, each experts call one op."""
    pytest.importorskip("transformers")
    from moeflow.integrations.hf.tiny import tiny_model
    model = tiny_model(family)
    model.set_experts_implementation("moeflow")
    ids = torch.randint(0, 256, (2, 7))
    rec = GraphRecorder()
    with torch.no_grad():
        ref = model(ids).logits
        out = torch.compile(model, backend=rec, fullgraph=True)(ids).logits
    assert torch.equal(out, ref)
    moe_layers = model.config.num_hidden_layers - (family == "deepseek_v3")  # its first layer is dense
    assert len(rec.graphs) == 1
    assert rec.targets().count("moeflow.layer_host_sync.default") == moe_layers


@pytest.mark.slow
def test_transformers_experts_not_planned_before_compiling():
    """A model compiled before any eager call: its experts modules are not registered, so the compiled model runs
    them outside its graphs (graph breaks; they register then). The results are right; prepare_experts() before
    compiling gives the one graph."""
    pytest.importorskip("transformers")
    from moeflow.integrations.hf import prepare_experts
    from moeflow.integrations.hf.tiny import tiny_model
    ids = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        model = tiny_model("qwen3_moe")
        model.set_experts_implementation("moeflow")
        rec = GraphRecorder()
        compiled = torch.compile(model, backend=rec)
        first, second = compiled(ids).logits, compiled(ids).logits
        assert len(rec.graphs) > 1  # broken around the experts calls
        ref = model(ids).logits
        assert torch.equal(first, ref) and torch.equal(second, ref)

        fresh = tiny_model("qwen3_moe")
        fresh.set_experts_implementation("moeflow")
        assert prepare_experts(fresh) == 2
        rec = GraphRecorder()
        out = torch.compile(fresh, backend=rec, fullgraph=True)(ids).logits
        assert len(rec.graphs) == 1 and rec.targets().count("moeflow.layer_host_sync.default") == 2
        assert torch.equal(out, ref)


def test_fullgraph_names_prepare_experts_for_unplanned_and_copied_experts():
    """fullgraph=True over transformers' "moeflow" experts not planned yet, or copied from planned ones: torch's
    error carries moeflow's reason, naming prepare_experts (it had named only torch.compiler.disable); after
    prepare_experts the copy compiles as one graph."""
    pytest.importorskip("transformers")
    import copy as copying

    from moeflow.integrations.hf import prepare_experts
    from moeflow.integrations.hf.tiny import tiny_model
    ids = torch.randint(0, 256, (2, 7))
    unplanned = tiny_model("qwen3_moe")
    unplanned.set_experts_implementation("moeflow")
    planned = copying.deepcopy(unplanned)
    assert prepare_experts(planned) == 2
    twin = copying.deepcopy(planned)  # its experts modules are new objects, not registered
    with torch.no_grad():
        want = planned(ids).logits
        for model in (unplanned, twin):
            torch._dynamo.reset()
            with pytest.raises(Exception, match="prepare_experts"):
                torch.compile(model, backend="aot_eager", fullgraph=True)(ids)
        assert prepare_experts(twin) == 2
        torch._dynamo.reset()
        assert torch.equal(torch.compile(twin, backend="aot_eager", fullgraph=True)(ids).logits, want)


def test_transformers_experts_compiled_with_trainable_weights_refuse_the_backward():
    """transformers' "moeflow" experts, compiled with only the experts' weights (and the head) requiring grad: the
    backward raises MF307 as eagerly, where it had gone through and left the experts without gradients."""
    pytest.importorskip("transformers")
    from moeflow.integrations.hf import prepare_experts
    from moeflow.integrations.hf.tiny import tiny_model
    ids = torch.randint(0, 256, (2, 7))
    model = tiny_model("qwen3_moe")
    model.set_experts_implementation("moeflow")
    prepare_experts(model)
    model.requires_grad_(False)
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    for m in experts:
        m.requires_grad_(True)
    model.lm_head.requires_grad_(True)
    torch._dynamo.reset()
    with pytest.raises(MoeflowError) as info:
        torch.compile(model, backend="aot_eager")(ids).logits.sum().backward()
    assert info.value.code == "MF307" and all(m.gate_up_proj.grad is None for m in experts)


def test_experts_path_compiles_with_the_weights_as_inputs(make_layer):
    """ExpertsPath (a model library's own weights): one op of the graph, the weights among its inputs, so weights
    changed in place between calls are read anew; a copy gets its own key; valid_below runs outside the graph."""
    from moeflow.experts import ExpertWeights
    from moeflow.integrations.path import ExpertsPath
    moe = make_layer(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K, dtype=torch.float32, device="cpu")
    path = ExpertsPath(moe.config)
    w13, w2 = moe.gate_up_proj.detach().clone(), moe.down_proj.detach().clone()
    rec = GraphRecorder()
    f = torch.compile(lambda p, x, i, w: p(x, i, w, ExpertWeights(w13, w2)), backend=rec, fullgraph=True)
    x, logits = torch.randn(5, H), torch.randn(5, E)
    ids, w = route_for(moe.config, logits)
    assert torch.equal(f(path, x, ids, w), path(x, ids, w, ExpertWeights(w13, w2)))
    assert rec.targets().count("moeflow.layer_host_sync.default") == 1
    assert_close(f(path, x, ids, w), layer_oracle(moe, x, ids, w), rel_tol("none", torch.float32), "ExpertsPath")
    w13.mul_(2)  # in place: the compiled graph passes the tensor, the op reads its new values
    assert torch.equal(f(path, x, ids, w), path(x, ids, w, ExpertWeights(w13, w2)))
    twin = copy.deepcopy(path)
    assert ops.registered(twin, ExpertsPath._call_op) and torch.equal(f(twin, x, ids, w), f(path, x, ids, w))
    sentinel = torch.compile(lambda p, x, i, w: p(x, i, w, ExpertWeights(w13, w2), valid_below=E - 1))
    assert torch.equal(sentinel(path, x, ids, w), path(x, ids, w, ExpertWeights(w13, w2), valid_below=E - 1))
