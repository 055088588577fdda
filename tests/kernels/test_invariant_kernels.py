"""Batch-invariant mode's Triton paths under Triton's CPU interpreter (fp16 / fp32: the interpreter has no bf16): the
Triton runner keeps one tile set for every T (no split K, no Gluon kernel) and a token's row has the same bits alone
and at other positions of larger batches; the fixed-tile linear kernel against its torch reference, and its rows
the same at any M. The interpreter computes tl.dot with numpy's matmul, whose BLAS rounds a row differently at
another position of the tile (seen here: 28 of 50 random tiles); these tests make it a row at a time (rowwise_dots),
so what they check is the kernels' own order (tiles, K loop, sums), and the GPU checks the tensor cores' in bf16
(tests/gpu/test_gpu_batch_invariant.py)."""
import pytest
import torch

from triton_interp import SKIP_REASON

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))

if SKIP_REASON is None:
    from moeflow.experts.triton import TritonRunner
    from moeflow.kernels.gemm.linear import linear, linear_torch

import numpy as np

from oracle import assert_close, bits, layer_oracle
from tolerances import rel_tol

SHAPE = dict(num_experts=4, hidden_size=128, intermediate_size=128, top_k=2)


@pytest.fixture(autouse=True)
def rowwise_dots(monkeypatch):
    """The interpreter's tl.dot one row at a time, each row copied to its own array first (one BLAS call shape and
    alignment for every row), so a row's product no longer depends on its place in the tile."""
    from triton.runtime import interpreter
    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim != 2:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        a_data, b_data = a.data, b.data
        if any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b)):
            a_data = interpreter._convert_float(a_data, a.dtype, interpreter.tl.float16, None).view(np.float16)
            b_data = interpreter._convert_float(b_data, b.dtype, interpreter.tl.float16, None).view(np.float16)
        b_data = np.ascontiguousarray(b_data)
        rows = [np.matmul(np.array(r, copy=True), b_data, dtype=d.data.dtype) for r in a_data]
        return interpreter.TensorHandle(np.stack(rows) + d.data, d.dtype.scalar)

    monkeypatch.setattr(builder, "create_dot", create_dot)


def through_runner(layer, runner, x, ids, w):
    batch, handle = layer.dispatcher.dispatch(x, ids, w)
    return layer.dispatcher.combine(runner.run(batch, layer.expert_weights()), handle), batch


@pytest.mark.parametrize("scheme,dtype", [("none", torch.float32), ("none", torch.float16),
                                          ("fp8-block", torch.float16), ("fp8-channel", torch.float32)],
                         ids=lambda v: str(v).removeprefix("torch."))
def test_triton_runner_rows_do_not_depend_on_the_batch(make_layer, scheme, dtype):
    layer = make_layer(**SHAPE, quant=scheme, dtype=dtype, runner="reference", batch_invariant=True)
    runner = TritonRunner(layer.config, layer.scheme)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 128, generator=g).to(dtype)
    ids = torch.rand(40, 4, generator=g).argsort(dim=1)[:, :2].to(torch.int32)
    w = torch.rand(40, 2, generator=g) + 0.1
    full, big = through_runner(layer, runner, x, ids, w)
    assert_close(full, layer_oracle(layer, x, ids, w), rel_tol(scheme, dtype), f"{scheme} {dtype}")
    cfg = runner.kernel_config(big, layer.expert_weights())
    assert all(c.split_k == 1 and not c.scale_overlap and not c.warp_specialize for c in (cfg.gate_up, cfg.down))
    for rows in ([7], [7, 0, 1], list(range(39, 20, -1))):  # alone, first of three, in the middle of 19
        out, small = through_runner(layer, runner, x[rows], ids[rows], w[rows])
        assert runner.kernel_config(small, layer.expert_weights()) == cfg, "one tile set for every T"
        at = rows.index(7) if 7 in rows else None
        for pos, tok in enumerate(rows):
            assert torch.equal(bits(out[pos]), bits(full[tok])), f"token {tok} at {pos} of {len(rows)} ({at})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_linear_kernel(dtype):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(70, 100, generator=g).to(dtype)  # M past one 64-row tile, K past one 64-wide step, N < 128
    w = torch.randn(90, 100, generator=g).to(dtype)
    out = linear(x, w)
    assert out.dtype == torch.float32 and out.shape == (70, 90)
    assert_close(out, linear_torch(x, w), 1e-6 if dtype == torch.float32 else 2e-3, "linear")
    for rows in ([5], [69, 5, 0]):
        assert torch.equal(bits(linear(x[rows], w)), bits(out[rows]))
    assert linear(x[:0], w).shape == (0, 90) and not linear(x[:, :0], w[:, :0]).any()
