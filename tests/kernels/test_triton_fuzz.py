"""The Triton runner's kernels under the CPU interpreter over random shapes, tiles and routings (the suites beside it
take chosen ones): the separate launches (gate_up, down, the FP8 quantizations) in the sorted, by-index and masked
layouts and with the runner's own default tiles, and the one-launch small-batch layer. Sizes down to 1 and K tails,
1-9 experts, every token on one expert, split K loops, outputs poisoned; against the float64 oracle (the one-launch
layer also against its torch reference: tests/fused_cases.py). bf16 is left to tests/gpu/ (no bf16 in the
interpreter)."""
import random

import pytest
import torch

from triton_interp import SKIP_REASON

pytestmark = [pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON)), pytest.mark.slow]

if SKIP_REASON is None:
    from moeflow.experts.triton import TritonRunner
    from moeflow.kernels.configs import FusedConfig, GemmConfig, MoEKernelConfig
    from moeflow.layouts import masked_output_to_sorted, sorted_to_masked
    from fused_cases import check_fused

from moeflow import MoE
from oracle import assert_close, layer_oracle
from tolerances import FEW_ELEMENTS, rel_tol

CASES = [("none", torch.float32), ("none", torch.float16), ("fp8-tensor", torch.float16),
         ("fp8-channel", torch.float32), ("fp8-channel", torch.float16), ("fp8-block", torch.float16),
         ("fp8-block", torch.float32)]
FUSED_CASES = [c for c in CASES if c[0] != "fp8-tensor"]
ODD = (1, 8, 16, 24, 40, 48, 72, 128, 136)


def sizes(rng, scheme):
    if scheme == "fp8-block":  # its 128 x 128 weight blocks (the planner refuses other sizes: MF206)
        return rng.choice([128, 256]), rng.choice([128, 256])
    return rng.choice(ODD), rng.choice(ODD)


def routing(rng, t, e, k):
    """Distinct ids [T, K] int32 (a third of the draws put every token on expert 0) and weights [T, K] float32."""
    score = torch.rand(t, e) + (2 * (torch.arange(e) == 0) if rng.random() < 0.3 else 0)
    return score.argsort(dim=1, descending=True)[:, :k].to(torch.int32), torch.rand(t, k) + 0.1


def tiles(rng, scheme):
    """A random MoEKernelConfig the runner fits to the scheme (fp8-block: 128-wide gate_up columns and K steps)."""
    blk = scheme == "fp8-block"
    bm = rng.choice([16, 32, 64])
    bk = 128 if blk else rng.choice([16, 32, 64])
    gate_up = GemmConfig(bm, 128 if blk else rng.choice([16, 32, 64]), bk, group_m=rng.choice([1, 2]),
                         split_k=rng.choice([1, 1, 2]))
    down = GemmConfig(bm, 128 if blk else rng.choice([16, 32, 64]), bk, group_m=rng.choice([1, 2]),
                      split_k=rng.choice([1, 1, 2]))
    return MoEKernelConfig(gate_up, down)


@pytest.mark.filterwarnings("ignore:moeflow. no tuned Triton MoE config")
@pytest.mark.parametrize("seed", range(3))
def test_separate_launches_on_random_shapes(seed):
    rng = random.Random(seed)
    for n in range(24):
        scheme, dtype = rng.choice(CASES)
        e = rng.choice([1, 2, 3, 5])
        k = rng.randint(1, min(e, 3))
        h, i = sizes(rng, scheme)
        layer = MoE(num_experts=e, hidden_size=h, intermediate_size=i, top_k=k, quant=scheme, dtype=dtype,
                    runner="reference")  # its weights and local dispatcher; the planner keeps triton to CUDA
        runner = TritonRunner(layer.config, layer.scheme)
        t = rng.choice([0, 1, 3, 17, 40])
        x = torch.randn(t, h).to(dtype)
        if t > 1 and rng.random() < 0.5:
            x[rng.randrange(t)] = 0  # a padding token: an FP8 scale of zero must not divide by zero
        ids, w = routing(rng, t, e, k)
        layout, kcfg = rng.choice(["sorted", "indexed", "masked", "runner's own tiles"]), tiles(rng, scheme)
        what = f"seed {seed} #{n}: {scheme} {dtype} E={e} H={h} I={i} K={k} T={t} {layout} {kcfg}"
        layer.dispatcher.indexed_rows = layout == "indexed"
        batch, handle = layer.dispatcher.dispatch(x, ids, w)
        if layout == "masked":
            masked, slot = sorted_to_masked(batch, rng.choice([max(1, t), t + 3]))
            out = masked_output_to_sorted(runner.run_with(masked, layer.expert_weights(), kcfg, poison=True), slot)
        elif layout == "runner's own tiles":
            out = runner.run(batch, layer.expert_weights())
        else:
            out = runner.run_with(batch, layer.expert_weights(), kcfg, poison=True)
        y = layer.dispatcher.combine(out, handle)
        assert y.shape == (t, h) and y.dtype == dtype, what
        assert_close(y, layer_oracle(layer, x, ids, w), rel_tol(scheme, dtype, y.numel()), what)


@pytest.mark.parametrize("seed", range(2))
def test_one_launch_layer_on_random_shapes(seed):
    rng = random.Random(100 + seed)
    for n in range(3):  # each seed's first three draws cover none, fp8-block and fp8-channel
        scheme, dtype = rng.choice(FUSED_CASES)
        e = rng.choice([1, 2, 3, 5, 9])
        k = rng.randint(1, min(e, 4))
        h, i = sizes(rng, scheme)
        h, i = max(h, 8), max(i, 8)  # the one launch's items are at least 8 wide (fit_fused)
        cfg = FusedConfig(rng.choice([16, 32, 64]), rng.choice([16, 32, 64, 128]), rng.choice([16, 32, 64]),
                          rng.choice([16, 32, 64, 128]), num_stages=rng.choice([1, 2]), split1=rng.choice([1, 2, 3]),
                          split2=rng.choice([1, 2, 3]))
        t = rng.choice([1, 2, 5, 16, 33])
        if scheme == "fp8-block":  # its 128-wide shapes with 16-wide tiles run ~1 min a draw in the interpreter at T=16
            t = min(t, 5)
        if scheme != "none" and t * h < FEW_ELEMENTS:
            t = -(-FEW_ELEMENTS // h)  # enough output elements for the scheme's own tolerance (check_fused holds it)
        check_fused(scheme, dtype, t, e, h, i, k, cfg, one_expert=0 if rng.random() < 0.3 else None,
                    activation=rng.choice(["silu", "gelu", "gelu_tanh"]))
