"""runner="reference": torch on any device, float32 math, one expert at a time.

The oracle every other runner is tested against; it follows the numerics contract in
experts/base.py literally (dequantize, matmul in float32) and consumes both layouts natively.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..capabilities import Support, RunnerCaps
from ..layouts import MASKED, SORTED, ExpertBatch
from ..quant import SCHEMES
from ..invariant import fixed_gated_activation, fixed_matmul
from .base import ExpertRunner, ExpertWeights, empty_output, gated_activation

_ALL = frozenset(SCHEMES.names())


class ReferenceRunner(ExpertRunner):
    name = "reference"
    caps = RunnerCaps(
        layouts=(SORTED, MASKED),
        support=(Support("cpu", _ALL), Support("cuda", _ALL)),
        priority=0,
        note="float32 torch loop over experts; the oracle, slow",
        batch_invariant=True,  # with MoEConfig.batch_invariant its products are summed in a fixed order (invariant.py)
    )

    def run(self, batch: ExpertBatch, weights: ExpertWeights) -> Tensor:
        batch = batch.gathered()  # rows given by index (not declared, but never misread)
        cfg, scheme = self.config, self.scheme
        out = empty_output(batch, cfg.hidden_size, cfg.dtype)
        flat_out = out.view(-1, cfg.hidden_size)
        rows = _valid_rows(batch)  # [(local expert, flat row indices)]
        if not rows:
            return out
        index = torch.cat([r for _, r in rows])
        hidden = batch.hidden.reshape(-1, cfg.hidden_size)[index]
        scale = None if batch.hidden_scale is None else batch.hidden_scale.reshape(-1, batch.hidden_scale.shape[-1])[index]
        xq, xs = self.input_activations(hidden, scale)
        x = scheme.dequantize_activation(xq, xs)  # [N_valid, H] float32
        inter = torch.empty(x.shape[0], cfg.intermediate_size, dtype=torch.float32, device=x.device)
        spans = _spans(rows)
        # batch-invariant: each row's dot products in a fixed order and the activation on one code path (a BLAS and
        # torch's SIMD loops pick their paths by the batch's size), slower
        matmul = fixed_matmul if cfg.batch_invariant else _matmul
        act = fixed_gated_activation if cfg.batch_invariant else gated_activation
        for e, lo, hi in spans:
            w13 = scheme.dequantize_expert(weights.w13, weights.w13_scale, e)
            inter[lo:hi] = act(matmul(x[lo:hi], w13), cfg.activation)
        a = scheme.fake_quantize_activation(inter.to(cfg.dtype))  # rounded to dtype, then quantized
        route_w = batch.weights.reshape(-1)[index].float()
        for e, lo, hi in spans:
            w2 = scheme.dequantize_expert(weights.w2, weights.w2_scale, e)
            y = matmul(a[lo:hi], w2) * route_w[lo:hi, None]
            flat_out[index[lo:hi]] = y.to(cfg.dtype)
        return out


def _matmul(x: Tensor, w: Tensor) -> Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] (float32 operands: float32)."""
    return x @ w.T


def _valid_rows(batch: ExpertBatch) -> list[tuple[int, Tensor]]:
    """Per local expert with copies: the flat row indices of its copies in ``batch.hidden``."""
    counts = batch.host_counts()
    dev = batch.hidden.device
    if batch.layout == SORTED:
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        return [(e, torch.arange(starts[e], starts[e] + c, device=dev)) for e, c in enumerate(counts) if c]
    capacity = batch.hidden.shape[1]
    return [(e, e * capacity + torch.arange(c, device=dev)) for e, c in enumerate(counts) if c]


def _spans(rows: list[tuple[int, Tensor]]) -> list[tuple[int, int, int]]:
    """[(expert, lo, hi)] positions of each expert's rows in the concatenated valid rows."""
    spans, lo = [], 0
    for e, r in rows:
        spans.append((e, lo, lo + r.numel()))
        lo += r.numel()
    return spans
