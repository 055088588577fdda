"""One check of the one-launch small-batch layer (kernels/gemm/fused_layer.py), shared by its CPU-interpreter suite
(tests/kernels/test_fused_layer.py) and its GPU suite (tests/gpu/test_gpu_fused_layer.py): fresh random weights and
routing, outputs poisoned, the launch against its torch reference and the float64 oracle."""
import torch

from oracle import assert_close, oracle_moe
from tolerances import rel_tol

# against fused_layer_torch (the same float32 math in the same order), by dtype: (scheme none, fp8-block). float32:
# sums in another order; fp8-block: an intermediate value may round to the neighbouring fp8 step
TIGHT = {torch.float32: (1e-6, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (6e-3, 1.8e-2)}


def weights(scheme, dtype, e, h, i, device="cpu"):
    """Random expert weights scaled like nn.Linear, quantized by the scheme -> (w13, s13, w2, s2)."""
    from moeflow.quant import create_scheme
    sch = create_scheme(scheme)
    w13 = (torch.rand(e, 2 * i, h, device=device) * 2 - 1) / h ** 0.5
    w2 = (torch.rand(e, h, i, device=device) * 2 - 1) / i ** 0.5
    if sch.quantized:
        (w13, s13), (w2, s2) = sch.quantize_weight(w13), sch.quantize_weight(w2)
        return w13, s13, w2, s2
    return w13.to(dtype), None, w2.to(dtype), None


def routing(t, e, k, one_expert=None, device="cpu"):
    """Distinct ids per token [T, K] int32 and weights [T, K] float32; one_expert=j: expert j in every token."""
    score = torch.rand(t, e, device=device)
    if one_expert is not None:
        score[:, one_expert] += 2
    ids = score.argsort(dim=1, descending=True)[:, :k]
    return ids.to(torch.int32).contiguous(), (torch.rand(t, k, device=device) + 0.1).contiguous()


def check_fused(scheme, dtype, t, e, h, i, k, cfg, one_expert=None, activation="silu", repeats=1, device="cpu"):
    """fused_layer at these sizes with FusedConfig ``cfg`` (fitted here): shape and dtype, the same bits on every
    one of ``repeats`` launches, the counters left zero, close to fused_layer_torch (TIGHT) and to the oracle
    (the scheme's tolerance) -> the output."""
    from moeflow.kernels.gemm.tiles import fit_fused
    from moeflow.kernels.gemm.fused_layer import counters_size, fused_layer, fused_layer_torch
    from moeflow.quant import create_scheme
    w13, s13, w2, s2 = weights(scheme, dtype, e, h, i, device)
    x = torch.randn(t, h, device=device).to(dtype)
    ids, w = routing(t, e, k, one_expert, device)
    cfg = fit_fused(cfg, scheme)
    sync = torch.zeros(counters_size(t, k, h, i, cfg), dtype=torch.int32, device=device)
    out = fused_layer(x, ids, w, w13, s13, w2, s2, scheme, activation, dtype, cfg, sync, poison=True)
    assert out.shape == (t, h) and out.dtype == dtype
    for _ in range(repeats - 1):  # the same bits every launch: no race between the items
        again = fused_layer(x, ids, w, w13, s13, w2, s2, scheme, activation, dtype, cfg, sync, poison=True)
        assert torch.equal(again, out), f"{scheme} {dtype} T={t}: a repeated launch differs"
    assert torch.equal(sync, torch.zeros_like(sync)), "the launch must leave its counters zero"
    ref = fused_layer_torch(x, ids, w, w13, s13, w2, s2, scheme, activation, dtype)
    assert_close(out, ref, TIGHT[dtype][scheme != "none"], f"{scheme} {dtype} T={t} vs its torch reference")
    sch = create_scheme(scheme)
    oracle = oracle_moe(x, ids, w, sch.dequantize_weight(w13, s13), sch.dequantize_weight(w2, s2), activation, sch,
                        dtype)
    assert_close(out, oracle, rel_tol(scheme, dtype), f"{scheme} {dtype} T={t} vs the float64 oracle")
    return out
