"""The top-k sum in the warp-specialized down's epilogue (kernels/warp_specialized._combine_tile, kernels/down.Combine,
MOEFLOW_TRITON_COMBINE) on a Hopper GPU: on fresh random routings, outputs NaN-poisoned first, the summed rows are
reduce.moe_sum's bits over the same down output (so every element is written, each token's K rows summed once, in k
order), the counts are left zero for the next launch, and a layer with the switch on gives the bits it gives with it
off, also replayed from a CUDA graph. bf16 128 x 128 tiles and the fp8-block 64 x 128, 128 x 64 and wide 64 x 256
tiles; grids of 3 programs (each running many tiles through both consumers) and one a SM; top-8, top-2 with every
token's first choice one expert, top-1 with every token on one expert, one token, H off the bf16 tiles.
Run: pytest -m gpu tests/gpu
"""
import pytest
import torch

from moeflow.kernels.configs import GemmConfig
from moeflow.layouts import offsets_from_counts
from gluon_hopper import MARKS
from oracle import replayed

pytestmark = MARKS

if torch.cuda.is_available():
    from moeflow.kernels import warp_specialized as down_ws
    from moeflow.kernels.common import RowLayout
    from moeflow.kernels.down import Combine, down
    from moeflow.kernels.reduce import moe_sum
    from test_gpu_down_wgmma import SCH

CASES = [  # scheme, tile
    ("none", GemmConfig(128, 128, 64, 8, 4, 2, warp_specialize=1)),
    ("none", GemmConfig(128, 128, 64, 8, 4, 5, warp_specialize=1)),
    ("fp8-block", GemmConfig(64, 128, 128, 8, 4, 4, warp_specialize=1)),
    ("fp8-block", GemmConfig(128, 64, 128, 8, 4, 6, warp_specialize=1)),
    ("fp8-block", GemmConfig(64, 256, 128, 8, 4, 5, warp_specialize=1)),
]


def routed(t, e, k, one_expert):
    """Routing of t tokens -> (counts [E], source [R] int64: the token of each sorted row, copy_rows [T, K] int64)."""
    ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k]
    if one_expert:  # every token's first choice is the last expert; with k = 1 the others get nothing
        bias = 3.0 * (torch.arange(e, device="cuda") == e - 1)
        ids = torch.rand(t, e, device="cuda").add(bias).argsort(dim=1, descending=True)[:, :k]
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    row_of_copy = torch.empty_like(order)
    row_of_copy[order] = torch.arange(order.numel(), device="cuda")
    return torch.bincount(flat, minlength=e), order // k, row_of_copy.view(t, k)


def operands(scheme, counts, h, i):
    r, e = int(counts.sum()), counts.numel()
    layout = RowLayout(False, offsets_from_counts(counts.to(torch.int32)), e, 0, r)
    w = torch.randn(e, h, i, device="cuda") / i ** 0.5
    a = torch.randn(r, i, device="cuda").bfloat16()
    rw = torch.rand(r, device="cuda")
    if scheme == "none":
        return layout, a, None, w.bfloat16(), None, rw
    q2, s2 = SCH.quantize_weight(w.bfloat16())
    a8, a_s = SCH.quantize_activation(a)
    return layout, a8, a_s, q2, s2, rw


@pytest.mark.parametrize("scheme,cfg", CASES, ids=lambda v: f"{v.block_m}x{v.block_n}s{v.num_stages}"
                         if isinstance(v, GemmConfig) else v)
@pytest.mark.parametrize("sms", [None, 3])
@pytest.mark.parametrize("t,e,k,h,i,one_expert", [
    (300, 16, 8, 512, 768, False),   # top-8 of 16: many rows a token, 6 (fp8) or 12 (bf16) K steps
    (1, 4, 2, 256, 256, False),      # one token
    (257, 8, 2, 512, 384, True),     # every token's first choice one expert
    (100, 5, 1, 256, 128, True),     # top-1, every token on one expert: the others empty
])
def test_summed_rows_are_moe_sums_bits(scheme, cfg, sms, t, e, k, h, i, one_expert, monkeypatch):
    if sms is not None:  # few programs: each runs many tiles, its consumers by turns
        monkeypatch.setattr(down_ws, "num_sms", lambda device: sms)
    counts, source, copy_rows = routed(t, e, k, one_expert)
    layout, a, a_s, w2, s2, rw = operands(scheme, counts, h, i)
    assert down_ws.usable(a, a_s, w2, layout, scheme, cfg, w_scale=s2)
    for launch in range(2):  # the second launch reuses nothing but must again leave its counts zero
        combine = Combine(source, copy_rows, torch.full((t, h), float("nan"), dtype=torch.bfloat16, device="cuda"))
        y = down(a, a_s, w2, s2, rw, layout, scheme, torch.bfloat16, cfg, poison=True, combine=combine)
        assert combine.done and not y.isnan().any()
        assert torch.equal(combine.out, moe_sum(y, copy_rows.view(-1), k)), f"launch {launch}"
        assert not combine.cnt.any(), "counts left non-zero"


def test_bf16_h_off_the_tiles():
    """H = 200: the last column tile part-filled; its columns past H are neither summed nor stored."""
    cfg = CASES[0][1]
    counts, source, copy_rows = routed(90, 3, 2, False)
    layout, a, _, w2, _, rw = operands("none", counts, 200, 72)
    combine = Combine(source, copy_rows, torch.full((90, 200), float("nan"), dtype=torch.bfloat16, device="cuda"))
    y = down(a, None, w2, None, rw, layout, "none", torch.bfloat16, cfg, poison=True, combine=combine)
    assert combine.done and torch.equal(combine.out, moe_sum(y, copy_rows.view(-1), 2))


@pytest.mark.parametrize("scheme", ["none", "fp8-block"])
def test_layer_with_the_switch_on_gives_the_same_bits(make_layer, tmp_path, monkeypatch, scheme):
    """A layer whose tuned file picks the warp-specialized down: MOEFLOW_TRITON_COMBINE=1 runs the sum in its launch
    (no moe_sum launch) and gives the bits of the switch off, eagerly and from a CUDA graph."""
    from moeflow.kernels import configs as kc
    from moeflow.kernels import reduce
    e, h, i, k, t = 16, 512, 384, 4, 1000
    pair = (kc.MoEKernelConfig(kc.GemmConfig(64, 128, 64, 8, 4, 3), CASES[1][1]) if scheme == "none" else
            kc.MoEKernelConfig(kc.GemmConfig(64, 128, 128, 8, 4, 3), CASES[2][1]))
    name = kc.file_name(torch.cuda.get_device_name(), e, i, h, scheme)
    kc.write_table(tmp_path / name, dict(device=torch.cuda.get_device_name(), E=e, N=i, K=h, scheme=scheme), {t: pair})
    monkeypatch.setenv("MOEFLOW_KERNEL_CONFIG_DIR", str(tmp_path))
    layer = make_layer(num_experts=e, hidden_size=h, intermediate_size=i, top_k=k, quant=scheme,
                       dtype=torch.bfloat16, device="cuda", runner="triton")
    assert layer.plan.fused_combine
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand(t, k, device="cuda") + 0.1
    monkeypatch.setenv("MOEFLOW_TRITON_COMBINE", "0")
    want = layer.forward_topk(x, ids, w)
    monkeypatch.setenv("MOEFLOW_TRITON_COMBINE", "1")
    sums = []
    moe_sum_launch = reduce.moe_sum
    monkeypatch.setattr(reduce, "moe_sum", lambda *a, **kw: sums.append(1) or moe_sum_launch(*a, **kw))
    got = layer.forward_topk(x, ids, w)
    assert not sums, "a top-k sum launch ran beside the combined down"
    assert torch.equal(got, want)
    assert torch.equal(replayed(lambda: layer.forward_topk(x, ids, w)), want), "graph replay"
