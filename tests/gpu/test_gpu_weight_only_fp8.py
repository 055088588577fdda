"""Weight-only FP8 in the Triton GEMMs (gate_up / down with weight_only=True) on a GPU, in bf16, which the CPU
interpreter cannot run (tests/kernels/test_weight_only_fp8.py runs fp16 and fp32 there): the three FP8 schemes against
a float64 reference that dequantizes the weights only, sorted rows by index and masked slots, TMA and pointer weights,
one program a tile, swapped tiles and split K, outputs NaN-poisoned. The kernels decode the e4m3 bytes themselves (no
float8e4nv), so this runs on any GPU Triton compiles for. Run: pytest -m gpu tests/gpu"""
import pytest
import torch

from oracle import assert_close
from tolerances import rel_tol

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def layouts(counts, capacity):
    """The sorted layout of ``counts`` copies an expert and the masked one of the same counts."""
    from moeflow.kernels.common import RowLayout
    from moeflow.layouts import offsets_from_counts
    c = torch.tensor(counts, dtype=torch.int32, device="cuda")
    return (RowLayout(False, offsets_from_counts(c), len(counts), 0, int(c.sum())),
            RowLayout(True, c, len(counts), capacity, len(counts) * capacity))


def reference(x, q13, s13, q2, s2, route_w, layout, sch, inter):
    """float64 gate_up (silu, before the bf16 rounding) of the rows x [R, H] and down of the kernel's own inter, with
    the dequantized weights and unquantized activations, per valid row."""
    from moeflow.kernels.gemm.gate_up import _expert_of_row
    expert = _expert_of_row(layout)
    g = torch.zeros(layout.rows, q13.shape[1] // 2, dtype=torch.float64, device="cuda")
    d = torch.zeros(layout.rows, q2.shape[1], dtype=torch.float64, device="cuda")
    for e in range(q13.shape[0]):
        sel = expert == e
        gate, up = (x[sel].double() @ sch.dequantize_expert(q13, s13, e).double().T).chunk(2, dim=1)
        g[sel] = torch.nn.functional.silu(gate) * up
        d[sel] = (inter[sel].double() @ sch.dequantize_expert(q2, s2, e).double().T) * route_w[sel].double()[:, None]
    return g, d


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("t", [1, 300])
@pytest.mark.parametrize("scheme", ["fp8-tensor", "fp8-channel", "fp8-block"])
def test_weight_only_bf16(scheme, t, tma, monkeypatch):
    from moeflow.kernels.configs import GemmConfig
    from moeflow.kernels.gemm.down import down
    from moeflow.kernels.gemm.gate_up import gate_up
    from moeflow.quant import create_scheme
    monkeypatch.setenv("MOEFLOW_TRITON_TMA", "1" if tma else "0")
    sch = create_scheme(scheme)
    e, h, i, k = 8, 640, 384, 2  # fp8-block's 128 blocks; several of them along N and K
    q13, s13 = sch.quantize_weight((torch.randn(e, 2 * i, h, device="cuda") / h ** 0.5).to(torch.bfloat16))
    q2, s2 = sch.quantize_weight((torch.randn(e, h, i, device="cuda") / i ** 0.5).to(torch.bfloat16))
    counts = torch.bincount(torch.randint(0, e - 1, (t * k,)), minlength=e).tolist()  # the last expert empty
    tol = rel_tol(scheme, torch.bfloat16)
    for layout in layouts(counts, max(counts) + 3):
        src = None if layout.masked else torch.randint(0, t, (layout.rows,), device="cuda")
        x = torch.randn(t if src is not None else layout.rows, h, device="cuda").to(torch.bfloat16)
        rows = x[src] if src is not None else x
        valid = layout.valid_rows()
        route_w = torch.rand(layout.rows, device="cuda")
        for cfg in (GemmConfig(16, 64, 64, 1, 4, 3), GemmConfig(64, 128, 128, 8, 4, 3, swap_ab=1),
                    GemmConfig(16, 64, 128, 1, 4, 4, split_k=3)):
            inter, extra = gate_up(x, None, q13, s13, layout, scheme, "silu", torch.bfloat16, cfg, poison=True,
                                   source_rows=src, weight_only=True)
            assert extra is None and inter.dtype == torch.bfloat16
            out = down(inter, None, q2, s2, route_w, layout, scheme, torch.bfloat16, cfg, poison=True,
                       weight_only=True)
            ref_g, ref_d = reference(rows, q13, s13, q2, s2, route_w, layout, sch, inter)
            what = f"{scheme} T={t} {'masked' if layout.masked else 'sorted'} {cfg}"
            assert_close(inter[valid], ref_g[valid], tol, f"{what}: gate_up")
            assert_close(out[valid], ref_d[valid], tol, f"{what}: down")
            assert torch.equal(out[~valid], torch.zeros_like(out[~valid])), what
