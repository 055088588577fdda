"""The one tolerance table: relative error ‖out − ref‖ / ‖ref‖ allowed against the float64 oracle.

Keyed by (quant scheme, layer dtype). FP8 rows compare against an oracle that quantizes the activations the same way
and uses the dequantized weights, so what remains is rounding order: float32 accumulation, the dtype rounding of the
intermediate, and FP8 values that land on the other side of a rounding boundary (one e4m3 step is 6-12% of one
element, rarely hit). The test suite (tests/tolerances.py re-exports this module) and `moeflow selftest` hold every
runner to it; docs/reference.md prints the table (scripts/update_readme.py).
"""
import torch

# Why these numbers (CPU, reference runner, H=I=128, measured): FP8 cells land at ~3e-7 (fp32), ~5e-4 (fp16) and
# ~2.5e-3 (bf16); GPU GEMMs that round the first GEMM's output to the layer dtype flip more FP8 roundings, hence the
# headroom. The FP8 rows must stay below ~4.5e-2: that is the error of a runner that forgets to quantize its
# activations, which these rows exist to catch.
REL_TOL = {
    ("none", torch.float32): 1e-5,
    ("none", torch.float16): 4e-3,
    ("none", torch.bfloat16): 2e-2,
    ("fp8-tensor", torch.float32): 5e-3,
    ("fp8-tensor", torch.float16): 1e-2,
    ("fp8-tensor", torch.bfloat16): 3e-2,
    ("fp8-channel", torch.float32): 5e-3,
    ("fp8-channel", torch.float16): 1e-2,
    ("fp8-channel", torch.bfloat16): 3e-2,
    ("fp8-block", torch.float32): 5e-3,
    ("fp8-block", torch.float16): 1e-2,
    ("fp8-block", torch.bfloat16): 3e-2,
    # Expert parallel, fp8-tensor: a dynamic per-tensor activation scale is the amax of the whole
    # batch a GEMM sees, so a token's output depends on the other tokens of its batch; in one
    # process, the same 12 tokens alone vs inside a batch of 30 differ by up to 7.2e-2 (measured,
    # H=256, I=128, E=8, K=2, fp32 and bf16). An EP rank's GEMMs see other batches than the
    # one-process layer's, so EP vs one process is held to this, not to the scheme's own row.
    ("fp8-tensor-rebatched", torch.float32): 1.2e-1,
    ("fp8-tensor-rebatched", torch.bfloat16): 1.2e-1,
    # Expert-parallel FP8 payload on a quant="none" layer (dispatcher payload="fp8"): each token is
    # rounded once to per-token FP8 before it travels; compared with the one-process layer.
    # Measured 3.4e-2 to 4.0e-2 (H=256, K=2, bf16), as one FP8 rounding of activations costs.
    ("fp8-payload", torch.bfloat16): 6e-2,
    # Whole-model logits of a tiny two-layer FP8 checkpoint (tests/integrations/test_hf_fp8.py): moeflow's
    # fp8-block experts vs transformers' eager on the same dequantized weights, which does not
    # quantize activations; the FP8 rounding of activations, amplified through the layers and the
    # routing, measured 3.1e-2 to 7.6e-2 (Qwen3-MoE, DeepSeek-V3, Mixtral; H=I=128, fp32). A scale
    # stacked onto the wrong half of gate_up_proj measured 2.4e-1 to 3.2e-1, onto the wrong expert
    # 3.9e-1 to 4.9e-1: this row sits between. (The layer itself is held to ("fp8-block", fp32).)
    ("fp8-block-model", torch.float32): 1.2e-1,
}


# The table's tolerances are norms over many elements. An FP8 output of fewer than FEW_ELEMENTS (hidden_size 1 at
# T = 1, as the random-configuration tests draw) can show one e4m3 rounding that the float64 oracle took the other way:
# up to one step, 2^-3 of a value.
FEW_ELEMENTS, FP8_STEP = 256, 0.125


def rel_tol(scheme: str, dtype: torch.dtype, elements: int | None = None) -> float:
    """The table's tolerance; given the output's ``elements``, at least one FP8 step where an FP8 scheme's output
    has fewer than FEW_ELEMENTS."""
    tol = REL_TOL[(scheme, dtype)]
    if elements is not None and elements < FEW_ELEMENTS and scheme.startswith("fp8-"):
        tol = max(tol, FP8_STEP)
    return tol
