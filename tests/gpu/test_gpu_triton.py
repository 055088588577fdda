"""The "triton" runner on a real GPU: bf16/fp16 and every FP8 scheme against the float64 oracle
and the reference runner, fresh random data, NaN-poisoned allocations, odd shapes, both layouts,
the tile families the default configs pick (T=1: 16-row blocks; T=1024: 128x128 wgmma tiles),
and CUDA-graph capture and replay of a decode call. Run: pytest -m gpu tests/gpu
"""
import pytest
import torch

from moeflow.errors import UnsupportedError
from moeflow.experts.reference import ReferenceRunner
from moeflow.targets import kernel_target
from moeflow.tune.autotune import Shape, random_weights
from moeflow.layouts import sorted_to_masked
from moeflow.quant import payload_scheme
from oracle import assert_close, layer_oracle
from tolerances import rel_tol

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ALIGNED = dict(num_experts=8, hidden_size=256, intermediate_size=256, top_k=2)
ODD = dict(num_experts=5, hidden_size=200, intermediate_size=72, top_k=3)  # K tails, partial tiles
SCHEMES = ("none", "fp8-tensor", "fp8-channel", "fp8-block")


def routing(t, e, k):
    ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k].to(torch.int32)
    return ids, torch.rand(t, k, device="cuda") + 0.1


def preset_case(preset, t, scheme):
    """A preset's shape at T = t tokens in ``scheme`` -> (its MoEConfig, random ExpertWeights, a random sorted batch
    (uniform routing), the scheme), seeded by t."""
    from moeflow.tune.autotune import random_batch
    from moeflow.presets import preset_config
    from moeflow.quant import create_scheme
    c = preset_config(preset)
    shape = Shape(c.num_experts, c.hidden_size, c.intermediate_size, c.top_k, scheme)
    return c, random_weights(shape, "cuda", seed=t), random_batch(shape, t, "cuda", seed=t), create_scheme(scheme)


def gate_up_inputs(c, sch, batch, t):
    """The two row layouts the GEMM tests run gate_up on, each with fresh tokens quantized by the scheme: yields
    (layout, rows by index or None, x [T or R, H], its scale or None, valid rows [R] bool). Sorted: the batch's
    R rows by a random index into T tokens; masked: its slots, rows in place."""
    from moeflow.kernels.common import RowLayout
    src = torch.randint(0, t, (batch.num_rows,), device="cuda")
    for lay, rows in ((RowLayout.of(batch), src), (RowLayout.of(sorted_to_masked(batch)[0]), None)):
        x = torch.randn(t if rows is not None else lay.rows, c.hidden_size, device="cuda").to(torch.bfloat16)
        xq, xs = sch.quantize_activation(x) if sch.quantized else (x, None)
        yield lay, rows, xq, xs, lay.valid_rows()


def dequantized(sch, pair):
    """gate_up's (inter, extra) as float32: fp8 intermediates dequantized by their group scales."""
    return sch.dequantize_activation(*pair) if pair[0].dtype == torch.float8_e4m3fn else pair[0].float()


@pytest.mark.parametrize("t", [1, 1024])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_layer_bf16_vs_oracle(make_layer, poison, scheme, t):
    layer = make_layer(**ALIGNED, quant=scheme, dtype=torch.bfloat16, device="cuda", runner="triton")
    assert layer.plan.runner == "triton"
    x = torch.randn(t, 256, device="cuda", dtype=torch.bfloat16)
    ids, w = routing(t, 8, 2)
    out = layer.forward_topk(x, ids, w)
    assert_close(out, layer_oracle(layer, x, ids, w), rel_tol(scheme, torch.bfloat16), f"{scheme} T={t}")


@pytest.mark.parametrize("scheme,dtype", [("none", torch.float16), ("none", torch.float32),
                                          ("fp8-block", torch.float16), ("fp8-channel", torch.float32)])
def test_layer_other_dtypes(make_layer, poison, scheme, dtype):
    layer = make_layer(**ALIGNED, quant=scheme, dtype=dtype, device="cuda", runner="triton")
    x = torch.randn(77, 256, device="cuda", dtype=dtype)
    ids, w = routing(77, 8, 2)
    assert_close(layer.forward_topk(x, ids, w), layer_oracle(layer, x, ids, w), rel_tol(scheme, dtype), str(dtype))


@pytest.mark.parametrize("scheme", ["none", "fp8-tensor", "fp8-channel"])
def test_odd_shapes(make_layer, poison, scheme):
    layer = make_layer(**ODD, quant=scheme, dtype=torch.bfloat16, device="cuda", runner="triton")
    x = torch.randn(37, 200, device="cuda", dtype=torch.bfloat16)
    ids, w = routing(37, 5, 3)
    assert_close(layer.forward_topk(x, ids, w), layer_oracle(layer, x, ids, w), rel_tol(scheme, torch.bfloat16), "odd")


# shapes no tuned table covers (kernels/gemm/sm90_tiles.py picks their tiles on Hopper): K loops of at most 16 steps
# of 128 (the warp-specialized tiles), and longer ones (fp8-block's per-tile Gluon kernels; bf16's 128 x 256 down)
UNTUNED = {"short-k": dict(num_experts=16, hidden_size=1536, intermediate_size=1408, top_k=4),
           "long-k": dict(num_experts=8, hidden_size=4608, intermediate_size=2304, top_k=2)}


@pytest.mark.parametrize("shape", UNTUNED)
@pytest.mark.parametrize("scheme,m", [(s, m) for s in ("none", "fp8-block") for m in (4, 32, 75, 256, 500)]
                         + [("fp8-channel", 75), ("fp8-tensor", 256)])
def test_hopper_defaults_on_untuned_shapes(make_layer, poison, shape, scheme, m):
    """m rows an expert (uniform routing) of a shape without a tuned table: the runner warns, takes the Hopper rules'
    tiles (their Gluon flags kept by fit) and matches the float64 oracle."""
    from moeflow.kernels.gemm import tiles
    from moeflow.kernels.gemm.sm90_tiles import sm90_gemm_configs
    c = UNTUNED[shape]
    e, k, h, i = c["num_experts"], c["top_k"], c["hidden_size"], c["intermediate_size"]
    t = m * e // k
    layer = make_layer(**c, quant=scheme, dtype=torch.bfloat16, device="cuda", runner="triton")
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ids, w = routing(t, e, k)
    with pytest.warns(UserWarning, match="using defaults"):
        out = layer.forward_topk(x, ids, w)
    want = layer_oracle(layer, x, ids, w, grouped=True)
    assert_close(out, want, rel_tol(scheme, torch.bfloat16), f"{shape} {scheme} m={m}")
    if kernel_target(torch.device("cuda")).arch != "sm_90":
        return  # another target's rules forced (MOEFLOW_KERNEL_ARCH): its own defaults, not the Hopper ones below
    batch, _ = layer.dispatcher.dispatch(x, ids, w)
    used = layer.runner.kernel_config(batch, layer.expert_weights())
    nbytes = 1 if scheme != "none" else 2
    for got, want, pair, n in zip((used.gate_up, used.down), sm90_gemm_configs(t * k / e, scheme, h, i), (True, False),
                                  (i, h)):
        assert got == tiles.fit(want, fused_pair=pair, scheme=scheme, elem_bytes=nbytes, n_size=n)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_pointer_loads(make_layer, poison, scheme, monkeypatch):
    """MOEFLOW_TRITON_TMA=0: the weight tiles through pointer loads (the path of weights TMA cannot
    address), 128-row tiles and small ones."""
    monkeypatch.setenv("MOEFLOW_TRITON_TMA", "0")
    layer = make_layer(**ALIGNED, quant=scheme, dtype=torch.bfloat16, device="cuda", runner="triton")
    for t in (3, 700):
        x = torch.randn(t, 256, device="cuda", dtype=torch.bfloat16)
        ids, w = routing(t, 8, 2)
        assert_close(layer.forward_topk(x, ids, w), layer_oracle(layer, x, ids, w), rel_tol(scheme, torch.bfloat16),
                     f"{scheme} T={t} pointers")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_masked_layout(make_layer, scheme):
    """Masked batch with NaN/huge garbage in empty slots: valid slots match the reference runner,
    empty slots are exactly zero; poisoned intermediates (run_with(poison=True))."""
    layer = make_layer(**ALIGNED, quant=scheme, dtype=torch.bfloat16, device="cuda", runner="triton",
                       dispatch_payload="dtype")  # layer-dtype rows (huge garbage below); FP8 rows: test_cuda_graph_decode
    x = torch.randn(50, 256, device="cuda", dtype=torch.bfloat16)
    ids, w = routing(50, 8, 2)
    batch, _ = layer.dispatcher.dispatch(x, ids, w)
    mb, _ = sorted_to_masked(batch, capacity=64)
    valid = torch.arange(64, device="cuda")[None, :] < mb.counts[:, None].long()
    garbage = torch.full_like(mb.hidden[~valid], 3e4)
    garbage[::2] = float("nan")
    mb.hidden[~valid] = garbage
    kcfg = layer.runner.kernel_config(mb, layer.expert_weights())
    out = layer.runner.run_with(mb, layer.expert_weights(), kcfg, poison=True)
    ref = ReferenceRunner(layer.config, layer.scheme).run(mb, layer.expert_weights())
    assert_close(out[valid], ref[valid], rel_tol(scheme, torch.bfloat16), "masked valid slots")
    assert not out[~valid].any()


def test_prequantized_payload(make_layer):
    layer = make_layer(**ALIGNED, quant="fp8-block", dtype=torch.bfloat16, device="cuda", runner="triton")
    x = torch.randn(40, 256, device="cuda", dtype=torch.bfloat16)
    ids, w = routing(40, 8, 2)
    batch, _ = layer.dispatcher.dispatch(x, ids, w)
    assert batch.source_rows is not None  # the plan (local + triton) hands rows by index
    batch.hidden, batch.hidden_scale = payload_scheme(layer.scheme).quantize_activation(batch.hidden)
    out = layer.runner.run(batch, layer.expert_weights())
    ref = ReferenceRunner(layer.config, layer.scheme).run(batch, layer.expert_weights())
    assert_close(out, ref, rel_tol("fp8-block", torch.bfloat16), "payload")


@pytest.mark.parametrize("t", [1, 300])
@pytest.mark.parametrize("scheme", ["none", "fp8-block"])
def test_qwen3_shape(scheme, t):
    """The Qwen3-30B-A3B expert shape (E=128, H=2048, I=768, K=8) vs the reference runner."""
    from moeflow import MoEConfig
    from moeflow.experts.triton import TritonRunner
    from moeflow.tune.autotune import random_batch
    from moeflow.quant import create_scheme
    shape = Shape(128, 2048, 768, 8, scheme)
    cfg = MoEConfig(num_experts=128, hidden_size=2048, intermediate_size=768, top_k=8, quant=scheme,
                    dtype=torch.bfloat16, device="cuda", runner="triton")
    weights, batch = random_weights(shape, "cuda", seed=t), random_batch(shape, t, "cuda", seed=t)
    runner = TritonRunner(cfg, create_scheme(scheme))
    out = runner.run_with(batch, weights, runner.kernel_config(batch, weights), poison=True)
    ref = ReferenceRunner(cfg, create_scheme(scheme)).run(batch, weights)
    assert_close(out, ref, rel_tol(scheme, torch.bfloat16), f"qwen3 {scheme} T={t}")


@pytest.mark.parametrize("preset,t", [("qwen3-30b-a3b", 4096), ("deepseek-v3", 1024), ("mixtral-8x7b", 300)])
@pytest.mark.parametrize("scheme", ["none", "fp8-tensor", "fp8-block"])
def test_down_persistent_on_gpu(preset, t, scheme):
    """The persistent down kernel at the presets' shapes, 1 and 2 programs per SM: bit for bit the
    one-program-per-tile kernel (the same tile code); that one is checked against the reference
    by the tests above."""
    from dataclasses import replace

    from moeflow.kernels.common import RowLayout
    from moeflow.kernels.configs import GemmConfig
    from moeflow.kernels.gemm.down import down
    c, w, batch, sch = preset_case(preset, t, scheme)
    layout = RowLayout.of(batch)
    a, a_s = sch.quantize_activation(torch.randn(layout.rows, c.intermediate_size, device="cuda").to(torch.bfloat16))
    bk = 64 if scheme == "none" else 128
    for cfg in (GemmConfig(128, 128, bk, 8, 8, 3), GemmConfig(64, 128, bk, 8, 4, 4)):
        want = down(a, a_s, w.w2, w.w2_scale, batch.weights, layout, scheme, torch.bfloat16, cfg, poison=True)
        for programs_per_sm in (1, 2):
            got = down(a, a_s, w.w2, w.w2_scale, batch.weights, layout, scheme, torch.bfloat16,
                       replace(cfg, programs_per_sm=programs_per_sm), poison=True)
            assert torch.equal(got, want), (cfg, programs_per_sm)


@pytest.mark.parametrize("preset,t", [("mixtral-8x7b", 1), ("deepseek-v3", 1), ("qwen3-30b-a3b", 16)])
@pytest.mark.parametrize("scheme", ["none", "fp8-channel", "fp8-block"])
def test_down_split_k_on_gpu(preset, t, scheme):
    """Split K (GemmConfig.split_k) at decode, the presets' shapes, bf16 (which the interpreter cannot
    run): against the reference, and within float32 rounding of one program per tile; masked too;
    and replayed from a CUDA graph (the workspace comes from the graph's pool)."""
    from moeflow.kernels.common import RowLayout
    from moeflow.kernels.configs import GemmConfig
    from moeflow.kernels.gemm.down import down, down_torch
    c, w, batch, sch = preset_case(preset, t, scheme)
    bk = 64 if scheme == "none" else 128
    for lay in (RowLayout.of(batch), RowLayout.of(sorted_to_masked(batch)[0])):
        a, a_s = sch.quantize_activation(torch.randn(lay.rows, c.intermediate_size, device="cuda").to(torch.bfloat16))
        rw = torch.rand(lay.rows, device="cuda")
        want = down_torch(a, a_s, w.w2, w.w2_scale, rw, lay, scheme, torch.bfloat16)
        one = down(a, a_s, w.w2, w.w2_scale, rw, lay, scheme, torch.bfloat16, GemmConfig(16, 64, bk, 1, 4, 4), poison=True)
        for split in (2, 4):
            cfg = GemmConfig(16, 64, bk, 1, 4, 4, split_k=split)
            got = down(a, a_s, w.w2, w.w2_scale, rw, lay, scheme, torch.bfloat16, cfg, poison=True)
            assert_close(got, want, rel_tol(scheme, torch.bfloat16), f"{preset} {scheme} split {split}")
            assert_close(got, one, 1e-2, f"{preset} {scheme} split {split} vs one program per tile")
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        down(a, a_s, w.w2, w.w2_scale, rw, lay, scheme, torch.bfloat16, cfg)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        y = down(a, a_s, w.w2, w.w2_scale, rw, lay, scheme, torch.bfloat16, cfg)
    rw.copy_(torch.rand_like(rw))  # new routing weights, read by the replay
    graph.replay()
    torch.cuda.synchronize()
    assert_close(y, down(a, a_s, w.w2, w.w2_scale, rw, lay, scheme, torch.bfloat16, cfg), 1e-6, "graph replay")


@pytest.mark.parametrize("preset,t", [("qwen3-30b-a3b", 1), ("deepseek-v3", 1), ("mixtral-8x7b", 16)])
@pytest.mark.parametrize("scheme", ["none", "fp8-channel", "fp8-block"])
def test_gate_up_split_k_on_gpu(preset, t, scheme):
    """gate_up split over K (GemmConfig.split_k) at decode, the presets' shapes, bf16: against the
    reference and the one-launch form, rows by index and masked slots, and replayed from a CUDA graph."""
    from moeflow.kernels.configs import GemmConfig
    from moeflow.kernels.gemm.gate_up import gate_up, gate_up_torch
    c, w, batch, sch = preset_case(preset, t, scheme)

    for lay, rows, xq, xs, valid in gate_up_inputs(c, sch, batch, t):
        ref = gate_up_torch(xq, xs, w.w13, w.w13_scale, lay, scheme, "silu", torch.bfloat16, rows)[valid]
        one = dequantized(sch, gate_up(xq, xs, w.w13, w.w13_scale, lay, scheme, "silu", torch.bfloat16, GemmConfig(16, 64, 128),
                          True, rows))[valid]
        for split in (2, 4):
            cfg = GemmConfig(16, 64, 128, 1, 4, 4, split_k=split)
            got = dequantized(sch, gate_up(xq, xs, w.w13, w.w13_scale, lay, scheme, "silu", torch.bfloat16, cfg, True, rows))[valid]
            tol = 6e-2 if scheme == "fp8-block" else rel_tol(scheme, torch.bfloat16)
            assert_close(got, ref.float(), tol, f"{preset} {scheme} split {split}")
            assert_close(got, one, tol, f"{preset} {scheme} split {split} vs one launch")
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gate_up(xq, xs, w.w13, w.w13_scale, lay, scheme, "silu", torch.bfloat16, cfg)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        y = gate_up(xq, xs, w.w13, w.w13_scale, lay, scheme, "silu", torch.bfloat16, cfg)
    for buf in (xq, xs):  # new rows, read by the replay
        if buf is not None:
            buf.copy_(buf.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    want = gate_up(xq, xs, w.w13, w.w13_scale, lay, scheme, "silu", torch.bfloat16, cfg)
    for got_t, want_t in zip(y, want):
        if want_t is not None:
            assert torch.equal(got_t[valid].view(torch.uint8), want_t[valid].view(torch.uint8)), "graph replay"


def _differences(got, want, lay) -> str:
    """Where two outputs [R, ...] differ, for a failure's message: how many elements, NaNs in each (unwritten), the
    first rows with their expert and place in its rows, and the largest difference (an intermittent failure of
    test_gate_up_rows_through_tma_on_gpu on an H100, 2026-12-05, left no more than its name)."""
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    bad = (~same).reshape(same.shape[0], -1).any(1).nonzero().flatten()
    offsets = lay.meta.to(torch.int64).cpu() if not lay.masked else None
    rows = []
    for r in bad[:6].tolist():
        e = int(torch.searchsorted(offsets, torch.tensor(r), right=True)) - 1 if offsets is not None else -1
        rows.append(f"row {r} (expert {e}, its row {r - int(offsets[e]) if e >= 0 else '?'})")
    diff = (got.double() - want.double()).abs().nan_to_num(float("inf"))
    return (f"{int((~same).sum())} elements in {bad.numel()} rows differ; NaN {int(torch.isnan(got).sum())} here, "
            f"{int(torch.isnan(want).sum())} in the pointer form; {', '.join(rows)}; largest difference "
            f"{diff.max().item():.3g}")


@pytest.mark.parametrize("preset,t", [("mixtral-8x7b", 1024), ("deepseek-v3", 300), ("qwen3-30b-a3b", 4096)])
@pytest.mark.parametrize("scheme", ["none", "fp8-channel"])
@pytest.mark.parametrize("stages", [3, 4])
def test_gate_up_rows_through_tma_on_gpu(preset, t, scheme, stages):
    """GemmConfig.x_tma (token rows gathered in order, then read through TMA) at the tuner's 128x128 tile,
    bf16, rows by index and in order: bit-equal to the pointer loads, and against the reference."""
    from moeflow.kernels.common import RowLayout
    from moeflow.kernels.configs import GemmConfig
    from moeflow.kernels.gemm.gate_up import gate_up, gate_up_torch
    c, w, batch, sch = preset_case(preset, t, scheme)
    lay = RowLayout.of(batch)
    bk = 64 if scheme == "none" else 128
    for rows in (torch.randint(0, t, (batch.num_rows,), device="cuda"), None):
        x = torch.randn(t if rows is not None else lay.rows, c.hidden_size, device="cuda").to(torch.bfloat16)
        xq, xs = sch.quantize_activation(x) if sch.quantized else (x, None)
        base = GemmConfig(128, 128, bk, 8, 8, stages)
        want, want_x = gate_up(xq, xs, w.w13, w.w13_scale, lay, scheme, "silu", torch.bfloat16, base, True, rows)
        got, got_x = gate_up(xq, xs, w.w13, w.w13_scale, lay, scheme, "silu", torch.bfloat16,
                             GemmConfig(128, 128, bk, 8, 8, stages, x_tma=1), True, rows)
        where = f"{preset} {scheme} T={t} rows {'by index' if rows is not None else 'in order'}"
        assert torch.equal(got, want), f"{where}: {_differences(got, want, lay)}"
        assert (want_x is None and got_x is None) or torch.equal(got_x, want_x), \
            f"{where}, the row amax: {_differences(got_x, want_x, lay)}"
        ref = gate_up_torch(xq, xs, w.w13, w.w13_scale, lay, scheme, "silu", torch.bfloat16, rows)
        assert_close(got, ref.float(), rel_tol(scheme, torch.bfloat16), f"{preset} {scheme} T={t}")


@pytest.mark.parametrize("layout", ["masked", "sorted"])
@pytest.mark.parametrize("scheme", ["none", "fp8-tensor", "fp8-block"])
def test_cuda_graph_decode(make_layer, scheme, layout):
    """Capture one runner call, then refill the static inputs with new tokens and new routing
    (same shapes) and replay: the replay matches the reference on the new data."""
    layer = make_layer(**ALIGNED, quant=scheme, dtype=torch.bfloat16, device="cuda", runner="triton")
    wts = layer.expert_weights()

    def make_batch():
        x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
        b, _ = layer.dispatcher.dispatch(x, *routing(4, 8, 2))
        return sorted_to_masked(b, capacity=8)[0] if layout == "masked" else b

    static = make_batch()
    fresh = [make_batch() for _ in range(2)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer.runner.run(static, wts)  # warm-up: compile, config lookup
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer.runner.run(static, wts)
    for new in fresh:
        for name in ("hidden", "hidden_scale", "weights", "counts", "offsets", "source_rows"):
            if getattr(static, name) is not None:
                getattr(static, name).copy_(getattr(new, name))
        graph.replay()
        torch.cuda.synchronize()
        ref = ReferenceRunner(layer.config, layer.scheme).run(new, wts)
        assert_close(out, ref, rel_tol(scheme, torch.bfloat16), f"graph replay {layout}")


@pytest.mark.parametrize("t,k,e", [(1, 8, 128), (16, 8, 256), (256, 8, 256), (37, 2, 8)])
def test_sort_copies_on_gpu(t, k, e):
    """The local dispatcher's one-launch sort (decode-sized batches) equals the torch sort exactly."""
    from moeflow.dispatch.expert_sort import sort_by_expert_torch
    from moeflow.kernels.rows.align import sort_copies
    ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand(t, k, device="cuda")
    for got, want in zip(sort_copies(ids, w, e), sort_by_expert_torch(ids, w, e), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("t,k,e", [(1, 8, 128), (16, 8, 256), (128, 2, 8), (128, 8, 128), (256, 8, 256), (1024, 2, 8),
                                   (300, 8, 128),
                                   (4096, 8, 256), (16384, 2, 8), (16384, 8, 128)])
def test_sort_by_expert_on_gpu(t, k, e):
    """The local dispatcher's sort on CUDA (one launch, the whole sort, the segment sort, or torch, by size)
    equals the torch sort exactly."""
    from moeflow.dispatch.expert_sort import sort_by_expert, sort_by_expert_torch
    ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand(t, k, device="cuda")
    for got, want in zip(sort_by_expert(ids, w, e), sort_by_expert_torch(ids, w, e), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("t,e,h,scheme", [(4096, 128, 2048, "fp8-block"), (16384, 128, 2048, "fp8-block"),
                                         (4096, 256, 7168, "fp8-block"), (3000, 8, 4096, "fp8-block"),
                                         (1024, 8, 4096, "fp8-channel")])
def test_sort_and_quantize_on_gpu(t, e, h, scheme):
    """The local dispatcher's sort with the tokens' quantization at the presets' sizes (several tokens a quantizing
    part past align._QUANT_PARTS parts, a part-filled last one at T = 3000): the sort equals the torch sort and the
    tokens are bit for bit kernels/quant.quantize_activation's."""
    from moeflow.dispatch.expert_sort import sort_and_quantize, sort_by_expert_torch
    from moeflow.kernels.rows.quant import quantize_activation
    k = 8 if e > 8 else 2
    ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand(t, k, device="cuda")
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16) * torch.rand(t, 1, device="cuda", dtype=torch.bfloat16)
    got = sort_and_quantize(ids, w, e, x, scheme)
    for g, want in zip(got[:5], sort_by_expert_torch(ids, w, e), strict=True):
        assert torch.equal(g, want)
    q, sc = quantize_activation(x, scheme)
    assert torch.equal(got[5].view(torch.uint8), q.view(torch.uint8)) and torch.equal(got[6], sc)


def test_exact_sigmoid_gives_torchs_bits_on_gpu():
    """kernels/common.exact_sigmoid on CUDA: torch.sigmoid's float32 bits on fresh randn * 8 and on every 37th
    float32 pattern (with abs <= 100, a random start) wherever 1 + exp(-x) < 2**126; 0 beyond, where torch's result
    is subnormal or 0. Output poisoned with NaN first."""
    import triton
    import triton.language as tl

    from moeflow.kernels.common import exact_sigmoid

    @triton.jit
    def _kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, exact_sigmoid(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)

    start = int(torch.randint(0, 37, ()))
    grid = torch.arange(-(1 << 31) + start, (1 << 31) - 1, 37, device="cuda", dtype=torch.int64).to(torch.int32)
    f = grid.view(torch.float32)
    for x in (torch.randn(1 << 22, device="cuda") * 8, f[torch.isfinite(f) & (f.abs() <= 100)].contiguous()):
        got = torch.full_like(x, float("nan"))
        _kernel[(triton.cdiv(x.numel(), 1024),)](x, got, x.numel(), BLOCK=1024)
        normal = 1 + torch.exp(-x) < 2.0 ** 126  # float32, as the kernel tests it (torch's exp is CUDA's expf)
        assert torch.equal(got[normal].view(torch.int32), torch.sigmoid(x[normal]).view(torch.int32))
        assert bool((got[~normal] == 0).all()) and bool((torch.sigmoid(x[~normal]) < 2.0 ** -125).all())


def _exact_ties(cfg, logits, bias):
    """Rows where two of the K + 1 best float32 choices, as the torch router ranks them (the logits, or the scores +
    bias), are equal, or grouped, the topk_groups-th and next group's: there torch.topk may order or pick either,
    where the kernels take the lowest index."""
    x = logits.float()
    on_logits = not cfg.grouped and bias is None and (cfg.renormalize or cfg.scoring == "sigmoid")
    choice = x if on_logits else (x.softmax(-1) if cfg.scoring == "softmax" else x.sigmoid())
    if bias is not None:
        choice = choice + bias.float()
    tie = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    if cfg.grouped:
        g = choice.view(x.shape[0], cfg.num_expert_groups, -1)
        gs = g.topk(2, -1).values.sum(-1) if bias is not None else g.amax(-1)
        top = gs.topk(cfg.topk_groups + 1, -1).values
        tie |= top[:, -2] == top[:, -1]
        keep = gs.topk(cfg.topk_groups, -1).indices
        mask = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, keep, True)
        choice = g.masked_fill(~mask[:, :, None], float("-inf")).view_as(choice)
    top = choice.topk(cfg.top_k + 1, -1).values
    return tie | (top[:, :-1] == top[:, 1:]).any(-1)


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3"])
@pytest.mark.parametrize("t", [1, 37, 4096, 16384])
def test_triton_router_on_gpu(preset, t):
    """routing/triton_topk.py on CUDA, the presets' real routing: ids equal the torch router's and weights to
    float32 rounding. The sigmoid scores are torch's bits (common.exact_sigmoid), so the ids must be equal in every
    row but those with an exact float32 tie among their K + 1 best choices (_exact_ties: torch.topk's order among
    ties is unspecified), which must be fewer than 1 in 1000. T >= 2048 of Qwen3 and DeepSeek-V3 runs
    routing/route_stream.py, whose ids must also equal routing/route.py's (the same float32 choices) in every row."""
    from moeflow.kernels.routing.route import route
    from moeflow.presets import preset_config
    from moeflow.routing import create_router
    cfg = preset_config(preset, device="cuda")
    logits = torch.randn(t, cfg.num_experts, device="cuda") * 4
    bias = (torch.rand(cfg.num_experts, device="cuda") - 0.5) * 0.1 if cfg.use_correction_bias else None
    ids, w = create_router(cfg, "triton")(logits, bias)
    want_ids, want_w = create_router(cfg, "torch")(logits, bias)
    clear = ~_exact_ties(cfg, logits, bias)
    assert int((~clear).sum()) * 1000 <= t
    wrong = ((ids != want_ids).any(1) & clear).nonzero().flatten()[:3].tolist()
    assert not wrong, [(r, ids[r].tolist(), want_ids[r].tolist()) for r in wrong]
    torch.testing.assert_close(w[clear], want_w[clear], rtol=1e-5, atol=1e-6)
    warp_ids, warp_w = route(logits, bias, cfg.top_k, cfg.scoring, cfg.renormalize, cfg.num_expert_groups,
                             cfg.topk_groups, cfg.routed_scaling_factor, lanes=0)
    wrong = (ids != warp_ids).any(1).nonzero().flatten()[:3].tolist()
    assert not wrong, [(r, ids[r].tolist(), warp_ids[r].tolist()) for r in wrong]
    torch.testing.assert_close(w, warp_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t", [37, 4096])
def test_sigmoid_routers_agree_where_the_scores_saturate_on_gpu(t):
    """Sigmoid without a bias, every row with six experts past the logit (about 16.6) where float32 sigmoids are 1.0:
    the torch router, routing/route.py (T=37) and the streaming kernel (T=4096, 128 experts) pick the same largest
    logits, with the same weights."""
    from moeflow import MoEConfig
    from moeflow.kernels.routing.route import route
    from moeflow.routing import create_router
    cfg = MoEConfig(num_experts=128, hidden_size=128, intermediate_size=128, top_k=4, scoring="sigmoid",
                    device="cuda")
    logits = torch.randn(t, 128, device="cuda")
    cols = torch.stack([torch.randperm(128, device="cuda")[:6] for _ in range(t)])
    logits.scatter_(1, cols, 17.0 + 30.0 * torch.rand(t, 6, device="cuda"))
    want_ids, want_w = create_router(cfg, "torch")(logits, None)
    assert torch.equal(want_ids.long().sort(1).values, logits.topk(4, 1).indices.sort(1).values)
    for lanes in (0, None):  # kernels/routing/route.py, and what route() picks (the streaming kernel at T=4096)
        ids, w = route(logits, None, 4, "sigmoid", True, lanes=lanes)
        assert torch.equal(ids, want_ids), lanes
        torch.testing.assert_close(w, want_w, rtol=1e-6, atol=0)


@pytest.mark.parametrize("payload", [None, "fp8-block"])
def test_ep_row_kernels_on_gpu(payload):
    """kernels/rows/ep_rows.py at the benchmark's sizes (H=7168, top-8, 256 rows, 128 local experts) on
    CUDA: bit for bit the torch code of the dispatchers (pack_rows_torch, masked_batch_torch)."""
    from moeflow.dispatch._ep_reference import masked_batch_torch, pack_rows_torch
    from moeflow.dispatch._ep_rows import RowCodec
    from moeflow.kernels.rows.ep_rows import masked_scatter, pack_rows
    from moeflow.quant import create_scheme
    codec = RowCodec(7168, 8, torch.bfloat16, payload and create_scheme(payload))
    t, world, e = 256, 2, 256
    tokens, scale = codec.encode(torch.randn(t, 7168, device="cuda").to(torch.bfloat16))
    ids, w = routing(t, e, 8)
    rank = torch.arange(e, device="cuda") % world
    local = torch.arange(e, device="cuda") // world
    home = torch.randperm(t * world, device="cuda").view(t, world)
    bufs = [torch.full((t * world, codec.row_bytes), 0x7F, dtype=torch.uint8, device="cuda") for _ in range(2)]
    for fn, buf in zip((pack_rows, pack_rows_torch), bufs):
        fn(codec.unpack(buf), tokens, scale, ids, w, home, rank, local)
    assert torch.equal(bufs[0], bufs[1])
    rows = codec.unpack(bufs[0])
    experts = torch.where(rows.ids >= 0, rows.ids, 128).long().flatten()
    batch, slot = masked_batch_torch(codec, rows, experts, 128, t * world)
    hidden, weights, sc, counts, copy_slot = masked_scatter(rows, experts, 128, t * world)
    assert torch.equal(copy_slot, slot.flatten()) and torch.equal(counts, batch.counts)
    assert torch.equal(weights, batch.weights)
    valid = torch.arange(t * world, device="cuda")[None, :] < counts[:, None]
    assert torch.equal(hidden[valid], batch.hidden.contiguous().view(torch.uint8).view(codec.word)[valid])
    assert sc is None or torch.equal(sc[valid], batch.hidden_scale[valid])


@pytest.mark.parametrize("r,e_local", [(8192, 128), (300, 5), (16384, 256), (2048, 8), (128, 128), (256, 256)])
def test_ep_sort_on_gpu(r, e_local):
    """kernels/rows/ep_sort.py at alltoall's size (8192 received rows, top-8, 128 local experts; ids in a
    strided view as received) on CUDA: bit for bit the torch reference."""
    from moeflow.dispatch._ep_reference import sort_copies_by_expert_torch
    from moeflow.kernels.rows.ep_sort import sort_copies_by_expert
    buf = torch.zeros(r, 40, dtype=torch.int32, device="cuda")
    choice = torch.rand(r, 2 * e_local, device="cuda").argsort(dim=1)[:, :8]
    buf[:, :8] = torch.where(choice < e_local, choice, -1).to(torch.int32)
    buf[:, 8:16] = torch.rand(r, 8, device="cuda").view(torch.int32)
    ids, w = buf[:, :8], buf[:, 8:16].view(torch.float32)
    n = int((ids >= 0).sum())
    got = sort_copies_by_expert(ids, w, e_local, n)
    want = sort_copies_by_expert_torch(ids, w, e_local, n)
    for name, g, x in zip(("source", "weights", "counts", "offsets", "copy_pos"), got, want):
        assert g.dtype == x.dtype and torch.equal(g, x), name


def refused_without_fp8_dots(shape) -> bool:
    """On a target without FP8 dots (sm_80 / sm_86 forced by MOEFLOW_KERNEL_ARCH) an FP8 search is refused with
    MF204 (weight-only FP8 runs the default tiles): check that and say so (True)."""
    from moeflow.tune.autotune import tune
    if shape.scheme == "none" or kernel_target(torch.device("cuda")).fp8_dots:
        return False
    with pytest.raises(UnsupportedError, match="MF204"):
        tune(shape, [1], rep_ms=2, log=lambda s: None)
    return True


def test_tune_small_shape_on_gpu():
    """`moeflow tune`'s search on a tiny shape: graph-timed candidates, a config per T that the
    runner then runs correctly, positive times; a sleep kernel of known length times as that length."""
    from moeflow.tune.autotune import graph_time_ms, tune
    shape = Shape(8, 256, 128, 2, "fp8-block")
    if refused_without_fp8_dots(shape):
        return
    table, measured = tune(shape, [1, 300], rep_ms=2, log=lambda s: None)
    assert set(table) == {1, 300} and all(v["gate_up"] > 0 and v["down"] > 0 for v in measured.values())
    assert all(c.fused is None for c in table.values())  # rows in order (expert parallelism): never searched
    cycles = 2_000_000  # ~1 ms at H200's ~2 GHz; the measurement must be per call, not per graph
    per_call = graph_time_ms([lambda: torch.cuda._sleep(cycles)] * 3, rep_ms=5)
    whole = graph_time_ms([lambda: torch.cuda._sleep(3 * cycles)], rep_ms=5)
    assert 0.25 < per_call / whole < 0.42, (per_call, whole)


@pytest.mark.parametrize("scheme", ["none", "fp8-channel", "fp8-block"])
def test_tune_searches_one_launch_tiles_on_gpu(scheme):
    """A single-process shape (rows by index): at T <= FUSED_TUNE_MAX_TOKENS tune times the whole layer after
    routing both ways and records fused tiles exactly where the one launch measured faster; a recorded tile set
    runs, poisoned, to the reference's output; above the limit nothing is searched."""
    from moeflow.tune.autotune import tune
    from moeflow.tune.fused import FUSED_TUNE_MAX_TOKENS
    shape = Shape(16, 256, 128, 4, scheme)
    if refused_without_fp8_dots(shape):
        return
    big = FUSED_TUNE_MAX_TOKENS * 2
    table, measured = tune(shape, [1, big], rep_ms=2, log=lambda s: None, indexed_rows=True)
    m = measured["1"]
    assert m["layer_separate"] > 0 and m.get("layer_fused", 0) > 0, f"every one-launch tile set refused: {m}"
    # measured holds µs rounded to 0.01; the pick compared the unrounded times, so a rounded tie allows either
    if table[1].fused is not None:
        assert m["layer_fused"] <= m["layer_separate"], m
    else:
        assert m["layer_fused"] >= m["layer_separate"], m
    assert table[big].fused is None and "layer_fused" not in measured[str(big)]
    if table[1].fused is not None:  # the recorded tiles run right (fresh weights, poisoned, repeated, oracle)
        from fused_cases import check_fused
        check_fused(scheme, torch.bfloat16, 3, 16, 256, 128, 4, table[1].fused, repeats=3, device="cuda")


@pytest.mark.parametrize("preset,t", [("qwen3-30b-a3b", 16), ("mixtral-8x7b", 128), ("deepseek-v3", 128)])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_swapped_tiles_on_gpu(preset, t, scheme):
    """Transposed tiles (GemmConfig.swap_ab: weights as the wgmma's M, 16-32 token rows as its N) at the presets'
    shapes, bf16 (which the interpreter cannot run): gate_up and down against their references and within float32
    rounding of the same tiles unswapped, outputs NaN-poisoned, rows by index (sorted) and masked slots; the down's
    split K and persistent forms too."""
    from moeflow.kernels.configs import GemmConfig
    from moeflow.kernels.gemm.down import down, down_torch
    from moeflow.kernels.gemm.gate_up import gate_up, gate_up_torch
    c, w, batch, sch = preset_case(preset, t, scheme)
    bk = 64 if scheme == "none" else 128
    tol = 6e-2 if scheme == "fp8-block" else rel_tol(scheme, torch.bfloat16)

    for lay, rows, xq, xs, valid in gate_up_inputs(c, sch, batch, t):
        ref = gate_up_torch(xq, xs, w.w13, w.w13_scale, lay, scheme, "silu", torch.bfloat16, rows)[valid].float()
        for bm, bn in ((16, 128), (32, 64)):
            plain = GemmConfig(bm, bn, bk, 1, 4, 3)
            one = dequantized(sch, gate_up(xq, xs, w.w13, w.w13_scale, lay, scheme, "silu", torch.bfloat16, plain, True, rows))
            got = dequantized(sch, gate_up(xq, xs, w.w13, w.w13_scale, lay, scheme, "silu", torch.bfloat16,
                              GemmConfig(bm, bn, bk, 1, 4, 3, swap_ab=1), True, rows))
            assert_close(got[valid], ref, tol, f"{preset} {scheme} gate_up {bm}x{bn} swapped")
            assert_close(got[valid], one[valid], tol, f"{preset} {scheme} gate_up {bm}x{bn} swapped vs unswapped")
        a, a_s = sch.quantize_activation(torch.randn(lay.rows, c.intermediate_size, device="cuda").to(torch.bfloat16))
        rw = torch.rand(lay.rows, device="cuda")
        want = down_torch(a, a_s, w.w2, w.w2_scale, rw, lay, scheme, torch.bfloat16)
        one = down(a, a_s, w.w2, w.w2_scale, rw, lay, scheme, torch.bfloat16, GemmConfig(32, 128, bk, 1, 4, 3),
                   poison=True)
        forms = [dict(), dict(split_k=2)] + ([dict(programs_per_sm=2)] if not lay.masked else [])
        for kw in forms:
            got = down(a, a_s, w.w2, w.w2_scale, rw, lay, scheme, torch.bfloat16,
                       GemmConfig(32, 128, bk, 1, 4, 3, swap_ab=1, **kw), poison=True)
            assert_close(got, want, rel_tol(scheme, torch.bfloat16), f"{preset} {scheme} down swapped {kw}")
            assert_close(got, one, 1e-2, f"{preset} {scheme} down swapped {kw} vs unswapped")
