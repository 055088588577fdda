"""The "triton" runner under Triton's CPU interpreter (TRITON_INTERPRET=1), at tiny shapes.

The planner refuses "triton" on CPU (it declares CUDA only), so these tests build a layer with
the reference runner for its weights and local dispatcher, and call TritonRunner directly on the
dispatcher's batch: whole layer (dispatch -> triton -> combine) vs the float64 oracle, and the
runner vs the reference runner on the same batch, in both layouts. bf16 is not run: the
interpreter has no bf16 (tests/gpu/ covers it).
"""
import pytest
import torch

from triton_interp import SKIP_REASON

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))

if SKIP_REASON is None:
    from moeflow import MoEConfig
    from moeflow.experts.reference import ReferenceRunner
    from moeflow.experts.triton import TritonRunner
    from moeflow.kernels.configs import GemmConfig, MoEKernelConfig
    from moeflow.layouts import masked_output_to_sorted, sorted_to_masked
    from moeflow.quant import payload_scheme

from oracle import assert_close, layer_oracle
from tolerances import rel_tol

ALIGNED = dict(num_experts=4, hidden_size=128, intermediate_size=128, top_k=2)  # every scheme's rules hold
ODD = dict(num_experts=3, hidden_size=48, intermediate_size=40, top_k=2)  # non-power-of-two, K tails
CASES = [("none", torch.float32), ("none", torch.float16), ("fp8-tensor", torch.float16),
         ("fp8-channel", torch.float32), ("fp8-channel", torch.float16), ("fp8-block", torch.float16),
         ("fp8-block", torch.float32)]


def small_config(scheme):
    """Small tiles keep the interpreter quick; fp8-block's gate_up needs BLOCK_N = 128."""
    return MoEKernelConfig(GemmConfig(16, 128 if scheme == "fp8-block" else 32, 64), GemmConfig(16, 32, 64, group_m=2))


def build(make_layer, fields, scheme, dtype, **extra):
    layer = make_layer(**fields, quant=scheme, dtype=dtype, runner="reference", **extra)
    return layer, TritonRunner(layer.config, layer.scheme)


def route(t, e, k, skew=None):
    """Distinct top-k ids [T, K] and weights [T, K]; skew=j sends every token to expert j first."""
    ids = torch.rand(t, e).argsort(dim=1)[:, :k]
    if skew is not None:
        ids = torch.rand(t, e).add(torch.arange(e) == skew).argsort(dim=1, descending=True)[:, :k]
    return ids.to(torch.int32), torch.rand(t, k) + 0.1


def layer_through_triton(layer, runner, x, ids, w, masked=False, capacity=None, indexed=True, kcfg=None):
    """dispatch -> triton -> combine. indexed: the sorted rows by index (ExpertBatch.source_rows),
    as a layer whose plan has indexed_rows dispatches for this runner. kcfg: default small_config."""
    layer.dispatcher.indexed_rows = indexed and not masked
    batch, handle = layer.dispatcher.dispatch(x, ids, w)
    assert (batch.source_rows is not None) == (indexed and not masked)
    kcfg = kcfg or small_config(layer.scheme.name)
    if masked:
        mbatch, slot = sorted_to_masked(batch, capacity)
        out = masked_output_to_sorted(runner.run_with(mbatch, layer.expert_weights(), kcfg, poison=True), slot)
    else:
        out = runner.run_with(batch, layer.expert_weights(), kcfg, poison=True)
    return layer.dispatcher.combine(out, handle)


@pytest.mark.parametrize("layout", ["sorted", "indexed", "masked"])
@pytest.mark.parametrize("scheme,dtype", CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_layer_vs_oracle(make_layer, scheme, dtype, layout):
    layer, runner = build(make_layer, ALIGNED, scheme, dtype)
    x = torch.randn(9, 128).to(dtype)
    ids, w = route(9, 4, 2)
    masked = layout == "masked"
    out = layer_through_triton(layer, runner, x, ids, w, masked=masked, capacity=12 if masked else None,
                               indexed=layout == "indexed")
    assert out.dtype == dtype and out.shape == (9, 128)
    assert_close(out, layer_oracle(layer, x, ids, w), rel_tol(scheme, dtype), f"triton {scheme} {dtype}")


@pytest.mark.parametrize("indexed", [False, True], ids=["gathered", "indexed"])
@pytest.mark.parametrize("scheme", ["none", "fp8-tensor", "fp8-channel"])
def test_odd_sizes_vs_reference_runner(make_layer, scheme, indexed):
    """H=48, I=40, E=3: K tails (H % BLOCK_K != 0), partial N tiles, a non-power-of-two expert count."""
    layer, runner = build(make_layer, ODD, scheme, torch.float16)
    x = torch.randn(5, 48).to(torch.float16)
    ids, w = route(5, 3, 2)
    layer.dispatcher.indexed_rows = indexed
    batch, _ = layer.dispatcher.dispatch(x, ids, w)
    out = runner.run_with(batch, layer.expert_weights(), small_config(scheme), poison=True)
    ref = ReferenceRunner(layer.config, layer.scheme).run(batch.gathered(), layer.expert_weights())
    assert_close(out, ref, rel_tol(scheme, torch.float16), "odd sizes")


@pytest.mark.parametrize("layout", ["indexed", "masked"])
def test_fp8_block_narrow_gate_up_tiles(make_layer, layout):
    """fp8-block with a gate_up BLOCK_N below 128 (decode configs: more programs): the runner
    quantizes the intermediate itself; the layer equals the oracle."""
    layer, runner = build(make_layer, ALIGNED, "fp8-block", torch.float16)
    x = torch.randn(9, 128).half()
    ids, w = route(9, 4, 2)
    masked = layout == "masked"
    narrow = MoEKernelConfig(GemmConfig(16, 32, 64), GemmConfig(16, 32, 64))
    out = layer_through_triton(layer, runner, x, ids, w, masked=masked, capacity=12 if masked else None, kcfg=narrow)
    assert_close(out, layer_oracle(layer, x, ids, w), rel_tol("fp8-block", torch.float16), "narrow gate_up tiles")


@pytest.mark.parametrize("case", ["T=1", "one-expert", "idle-experts", "K=E"])
@pytest.mark.parametrize("scheme", ["none", "fp8-block"])
def test_edge_routing(make_layer, scheme, case):
    """T=1: a single copy per expert, mostly padding; one-expert: all tokens' first choice is
    expert 2 (one long segment, several row blocks); idle-experts: top-1 of 4 experts with 3
    tokens leaves experts empty; K=E: every token visits every expert."""
    fields = dict(ALIGNED)
    t, skew = {"T=1": (1, None), "one-expert": (40, 2), "idle-experts": (3, None), "K=E": (5, None)}[case]
    fields["top_k"] = {"idle-experts": 1, "K=E": 4}.get(case, 2)
    layer, runner = build(make_layer, fields, scheme, torch.float16)
    x = torch.randn(t, 128).to(torch.float16)
    ids, w = route(t, 4, fields["top_k"], skew)
    out = layer_through_triton(layer, runner, x, ids, w)
    assert_close(out, layer_oracle(layer, x, ids, w), rel_tol(scheme, torch.float16), case)


@pytest.mark.parametrize("layout", ["sorted", "indexed", "masked"])
def test_no_tokens(make_layer, layout):
    """T=0: no copies at all; the output is empty (sorted) or all zeros (masked), never garbage."""
    layer, runner = build(make_layer, ALIGNED, "fp8-block", torch.float16)
    layer.dispatcher.indexed_rows = layout == "indexed"
    ids, w = route(0, 4, 2)
    batch, handle = layer.dispatcher.dispatch(torch.randn(0, 128).half(), ids, w)
    if layout == "masked":
        batch, _ = sorted_to_masked(batch, capacity=4)
        out = runner.run_with(batch, layer.expert_weights(), small_config("fp8-block"), poison=True)
        assert out.shape == (4, 4, 128) and not out.any()
    else:
        out = runner.run_with(batch, layer.expert_weights(), small_config("fp8-block"), poison=True)
        assert layer.dispatcher.combine(out, handle).shape == (0, 128)


@pytest.mark.parametrize("scheme", ["fp8-tensor", "fp8-block"])
def test_masked_garbage_slots(make_layer, scheme):
    """Empty masked slots full of huge values and NaN: valid rows match the reference runner
    (fp8-tensor's amax must skip them) and every empty output slot is exactly zero."""
    layer, runner = build(make_layer, ALIGNED, scheme, torch.float32)
    x = torch.randn(6, 128)
    ids, w = route(6, 4, 2)
    batch, _ = layer.dispatcher.dispatch(x, ids, w)
    mb, _ = sorted_to_masked(batch, capacity=8)
    valid = torch.arange(8)[None, :] < mb.counts[:, None].long()
    garbage = torch.full_like(mb.hidden[~valid], 1e6)
    garbage[::2] = float("nan")
    mb.hidden[~valid] = garbage
    out = runner.run_with(mb, layer.expert_weights(), small_config(scheme), poison=True)
    ref = ReferenceRunner(layer.config, layer.scheme).run(mb, layer.expert_weights())
    assert_close(out[valid], ref[valid], rel_tol(scheme, torch.float32), "valid slots")
    assert not out[~valid].any(), "empty masked slots must be zero"


@pytest.mark.parametrize("indexed", [False, True], ids=["gathered", "indexed"])
@pytest.mark.parametrize("scheme", ["none", "fp8-tensor", "fp8-channel", "fp8-block"])
def test_prequantized_payload(make_layer, scheme, indexed):
    """A dispatcher may send FP8 rows + scales (payload_scheme): used as is by FP8 layers,
    dequantized to the layer dtype by a "none" layer. Same result as the reference runner.
    Payload scales differ per row (fp8-tensor rows from different EP ranks carry different scales)."""
    layer, runner = build(make_layer, ALIGNED, scheme, torch.float16)
    x = torch.randn(7, 128).half()
    ids, w = route(7, 4, 2)
    layer.dispatcher.indexed_rows = indexed
    batch, _ = layer.dispatcher.dispatch(x, ids, w)
    sch = payload_scheme(layer.scheme)
    halves = [sch.quantize_activation(part) for part in (batch.hidden[:3], batch.hidden[3:] * 8)]  # two "ranks"
    batch.hidden = torch.cat([halves[0][0], halves[1][0]])
    batch.hidden_scale = torch.cat([halves[0][1].expand(3, -1), halves[1][1].expand(batch.hidden.shape[0] - 3, -1)])
    out = runner.run_with(batch, layer.expert_weights(), small_config(scheme), poison=True)
    ref = ReferenceRunner(layer.config, layer.scheme).run(batch.gathered(), layer.expert_weights())
    assert_close(out, ref, rel_tol(scheme, torch.float16), "fp8 payload")


def in_wider_rows(t, pad=24):
    """t [R, C] as a strided view into a wider buffer (row stride C + pad, starting 16 elements in,
    the rest poisoned): the alltoall receive buffer hands rows and scales to the runner like this."""
    buf = torch.full((t.shape[0], t.shape[1] + pad), float("nan")).to(t.dtype) if t.is_floating_point() and t.element_size() > 1 \
        else torch.zeros((t.shape[0], t.shape[1] + pad), dtype=t.dtype)
    view = buf[:, 16:16 + t.shape[1]]
    view.copy_(t)
    return view


@pytest.mark.parametrize("payload", ["layer dtype", "fp8"])
@pytest.mark.parametrize("scheme", ["none", "fp8-tensor", "fp8-channel", "fp8-block"])
def test_rows_by_index_in_a_strided_buffer(make_layer, scheme, payload):
    """Rows by index whose rows (and FP8 scales) are strided views of a wider buffer, as the
    alltoall dispatcher hands them: read in place, same result as the reference on the gathered batch."""
    if payload == "fp8" and scheme == "fp8-tensor":
        pytest.skip("fp8-tensor payloads are not row-local (MF506): the layer dtype travels")
    layer, runner = build(make_layer, ALIGNED, scheme, torch.float16)
    x = torch.randn(9, 128).half()
    ids, w = route(9, 4, 2)
    layer.dispatcher.indexed_rows = True
    batch, _ = layer.dispatcher.dispatch(x, ids, w)
    if payload == "fp8":
        q, sc = payload_scheme(layer.scheme).quantize_activation(x)
        batch.hidden, batch.hidden_scale = in_wider_rows(q.view(torch.uint8)).view(q.dtype), in_wider_rows(sc)
    else:
        batch.hidden = in_wider_rows(x)
    assert batch.hidden.stride(0) != batch.hidden.shape[1]
    out = runner.run_with(batch, layer.expert_weights(), small_config(scheme), poison=True)
    ref = ReferenceRunner(layer.config, layer.scheme).run(batch.gathered(), layer.expert_weights())
    assert_close(out, ref, rel_tol(scheme, torch.float16), f"strided rows, {payload} payload")


@pytest.mark.parametrize("scheme", ["none", "fp8-tensor", "fp8-block"])
def test_padded_batch_by_index(make_layer, scheme):
    """A batch sized by a bound, as alltoall-fixed hands it: rows past offsets[-1] are padding
    (source row 0, weight 0) and the source rows end with blank (zero) rows of the receive buffer.
    The copies' outputs equal the reference on the unpadded batch (fp8-tensor: blank rows do not
    move the tensor amax)."""
    layer, runner = build(make_layer, ALIGNED, scheme, torch.float16)
    x = torch.randn(9, 128).half()
    ids, w = route(9, 4, 2)
    layer.dispatcher.indexed_rows = True
    batch, _ = layer.dispatcher.dispatch(x, ids, w)
    n, pad = batch.num_rows, 13
    ref = ReferenceRunner(layer.config, layer.scheme).run(batch.gathered(), layer.expert_weights())
    batch.hidden = torch.cat([batch.hidden, torch.zeros(5, 128, dtype=batch.hidden.dtype)])
    batch.source_rows = torch.cat([batch.source_rows, torch.zeros(pad, dtype=torch.int64)])
    batch.weights = torch.cat([batch.weights, torch.zeros(pad)])
    batch.padded = True
    out = runner.run_with(batch, layer.expert_weights(), small_config(scheme), poison=True)
    assert out.shape == (n + pad, 128)
    assert_close(out[:n], ref, rel_tol(scheme, torch.float16), "padded batch")


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_activations(make_layer, activation):
    layer, runner = build(make_layer, ALIGNED, "none", torch.float32, activation=activation)
    x = torch.randn(4, 128)
    ids, w = route(4, 4, 2)
    out = layer_through_triton(layer, runner, x, ids, w)
    assert_close(out, layer_oracle(layer, x, ids, w), rel_tol("none", torch.float32), activation)


def test_run_uses_default_configs(make_layer, monkeypatch, tmp_path):
    """run() without explicit configs: no tuned file for the CPU 'device' -> a warning naming the
    file it looked for, defaults fitted to the scheme, the same result."""
    monkeypatch.setenv("MOEFLOW_KERNEL_CONFIG_DIR", str(tmp_path))
    layer, runner = build(make_layer, ALIGNED, "fp8-block", torch.float16)
    x = torch.randn(3, 128).half()
    ids, w = route(3, 4, 2)
    batch, _ = layer.dispatcher.dispatch(x, ids, w)
    with pytest.warns(UserWarning, match=r"E=4,N=128,K=128,device=cpu,scheme=fp8-block\.json"):
        out = runner.run(batch, layer.expert_weights())
    kcfg = runner.kernel_config(batch, layer.expert_weights())
    assert kcfg.gate_up.block_n % 128 == 0 and 128 % kcfg.gate_up.block_k == 0
    ref = ReferenceRunner(layer.config, layer.scheme).run(batch, layer.expert_weights())
    assert_close(out, ref, rel_tol("fp8-block", torch.float16), "defaults")


def test_declared_capabilities():
    """CUDA only; every scheme on the GPU targets (moeflow.targets: sm_80 to sm_120); the planner refuses it on
    CPU with MF203 and on older GPUs with MF204 at construction, and "auto" prefers it on every target."""
    from moeflow.capabilities import Environment
    from moeflow.planner import check_runner, plan
    from moeflow.targets import TARGETS
    caps = TritonRunner.caps
    assert {s.device for s in caps.support} == {"cuda"} and caps.requires == ("triton",)
    assert all(s.archs == frozenset(t.arch for t in TARGETS) for s in caps.support)
    cfg = MoEConfig(**ALIGNED, quant="fp8-block", runner="triton")
    assert check_runner("triton", cfg, Environment("cpu")).code == "MF203"
    assert check_runner("triton", cfg, Environment("cuda", (7, 5))).code == "MF204"
    for t in TARGETS:
        for scheme in ("none", "fp8-tensor", "fp8-channel", "fp8-block"):
            assert plan(cfg.replace(quant=scheme, runner="auto"), Environment("cuda", t.capability)).runner == "triton"


def test_gpus_no_kernel_is_built_for_are_refused(monkeypatch):
    """A GPU of an architecture moeflow's kernels are not built for (sm_103, sm_121): the planner refuses the Triton
    and grouped_mm runners there with MF210 naming the runners valid here, "auto" picks the reference runner, and
    MOEFLOW_ALLOW_UNVALIDATED_GPU=1 lets them through (the user's own risk)."""
    from moeflow.capabilities import Environment
    from moeflow.planner import check_runner, plan
    cfg = MoEConfig(**ALIGNED, quant="fp8-channel", dtype=torch.bfloat16, runner="triton")
    for cc in ((10, 3), (12, 1)):
        blackwell = Environment("cuda", cc)
        for name in ("triton", "grouped_mm"):
            err = check_runner(name, cfg, blackwell)
            assert err.code == "MF210" and "'reference'" in str(err) and f"sm_{cc[0]}{cc[1]}" in str(err), str(err)
        assert plan(cfg.replace(runner="auto"), blackwell).runner == "reference"
        monkeypatch.setenv("MOEFLOW_ALLOW_UNVALIDATED_GPU", "1")
        assert check_runner("triton", cfg, blackwell) is None
        assert plan(cfg.replace(runner="auto"), blackwell).runner == "triton"
        monkeypatch.delenv("MOEFLOW_ALLOW_UNVALIDATED_GPU")


def test_plan_reads_rows_by_index_only_where_both_sides_declare_it():
    """local + triton: rows by index (no permuted copy); a runner without indexed_rows, or a
    converted layout, gets ordinary batches; run_in_layout gathers for such a runner."""
    from moeflow.capabilities import Environment
    from moeflow.dispatch import create_dispatcher
    from moeflow.layouts import run_in_layout
    from moeflow.planner import plan
    from moeflow.quant import create_scheme
    hopper = Environment("cuda", (9, 0))
    cfg = MoEConfig(**ALIGNED, quant="none", runner="triton")
    p = plan(cfg, hopper)
    assert p.indexed_rows and any("rows by index" in r for r in p.reasons)
    assert not plan(cfg.replace(runner="reference"), hopper).indexed_rows
    assert not plan(cfg.replace(runner="grouped_mm", dtype=torch.bfloat16), hopper).indexed_rows
    d = create_dispatcher("local", cfg, create_scheme("none"), indexed_rows=True)
    x, (ids, w) = torch.randn(6, 128), route(6, 4, 2)
    batch, _ = d.dispatch(x, ids, w)
    assert batch.source_rows is not None and batch.hidden is x and batch.num_rows == 12
    ref_cfg = cfg.replace(runner="reference")
    ref = ReferenceRunner(ref_cfg, create_scheme("none"))
    from moeflow.experts.base import ExpertWeights
    weights = ExpertWeights(torch.randn(4, 256, 128) / 12, torch.randn(4, 128, 128) / 12, None, None)
    assert torch.equal(run_in_layout(ref, batch, weights), ref.run(batch.gathered(), weights))


@pytest.mark.filterwarnings("ignore:moeflow. no tuned")  # Ampere has no tuned tables: its default tiles are the point
@pytest.mark.parametrize("layout", ["indexed", "masked"])
@pytest.mark.parametrize("scheme,dtype", [("fp8-tensor", torch.float16), ("fp8-channel", torch.float32),
                                          ("fp8-block", torch.float16), ("fp8-block", torch.float32)],
                         ids=lambda v: str(v).removeprefix("torch."))
def test_weight_only_layer_as_on_ampere(make_layer, monkeypatch, scheme, dtype, layout):
    """An FP8 layer as an A100 runs it (MOEFLOW_KERNEL_ARCH=sm_80: Plan.weight_only, no TMA, the tiles Ampere's rules
    and tile budget give): the weight-only scheme for the dispatcher, runner and oracle alike (activations never
    quantized), dispatch -> triton -> combine against the float64 oracle."""
    from moeflow.dispatch import create_dispatcher
    from moeflow.quant import create_scheme
    monkeypatch.setenv("MOEFLOW_KERNEL_ARCH", "sm_80")
    layer = make_layer(**ALIGNED, quant=scheme, dtype=dtype, runner="reference")
    wo = create_scheme(scheme, weight_only=True)
    layer.scheme, layer.dispatcher = wo, create_dispatcher("local", layer.config, wo)
    runner = TritonRunner(layer.config, wo)
    kcfg = runner._fit(runner._entry_for(9, 4, 128, 128, torch.device("cpu")), 128, 128)  # Ampere's default tiles
    x = torch.randn(9, 128).to(dtype)
    ids, w = route(9, 4, 2, skew=1)
    masked = layout == "masked"
    out = layer_through_triton(layer, runner, x, ids, w, masked=masked, capacity=12 if masked else None,
                               indexed=not masked, kcfg=kcfg)
    ref = layer_oracle(layer, x, ids, w)
    assert_close(out, ref, rel_tol(scheme, dtype) / 10, f"weight-only {scheme} {dtype} {layout}")
