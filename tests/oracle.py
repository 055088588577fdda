"""Independent float64 oracle of one MoE layer (an einsum MoE, gpt-fast style) and shared checks.

The oracle shares nothing with moeflow's runners except the quantization scheme objects (used
to fake-quantize activations the same way: quantize, then dequantize) and the dequantized weights.
"""
import torch
import torch.nn.functional as F

ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}


def oracle_moe(x, ids, w, w13, w2, activation, scheme, dtype):
    """x [T,H] (layer dtype), ids [T,K], w [T,K], w13 [E,2I,H] / w2 [E,H,I] float (dequantized)
    -> [T,H] float64. scheme: a moeflow QuantScheme (activation fake-quantization)."""
    t, k = ids.shape
    xq = scheme.fake_quantize_activation(x).double()                        # [T, H]
    h = torch.einsum("th,tknh->tkn", xq, w13.double()[ids.long()])          # [T, K, 2I]
    g, u = h.chunk(2, dim=-1)
    a = (ACTS[activation](g) * u).to(dtype)                                  # rounded like the runners
    aq = scheme.fake_quantize_activation(a.reshape(t * k, -1)).double().view(t, k, -1)
    y = torch.einsum("tki,tkhi->tkh", aq, w2.double()[ids.long()])           # [T, K, H]
    return torch.einsum("tkh,tk->th", y, w.double())


def rel_err(out, ref):
    """‖out − ref‖ / ‖ref‖ in float64 (NaN when out has NaN)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out, ref, tol, what=""):
    err = rel_err(out, ref)
    if not err <= tol:  # also catches NaN
        diff = (out.double() - ref.double()).abs()
        where = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0]) if diff.numel() else ()
        raise AssertionError(f"{what}: relative error {err:.3e} > {tol:.1e}; worst at {where}: "
                             f"out={out.double()[where].item() if where else None} ref={ref.double()[where].item() if where else None}")
