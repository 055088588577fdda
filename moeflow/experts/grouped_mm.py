"""runner="grouped_mm": torch._grouped_mm (bf16/fp16/fp32) and torch._scaled_grouped_mm (FP8
row-wise scales: per-tensor and per-channel weights × per-token activations; the CUTLASS path on
Hopper), on the sorted layout.

No FP8 block-scale mode exists in torch._scaled_grouped_mm, so fp8-block is declared unsupported
(the planner refuses it with MF202). On CPU only the unquantized path exists.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..capabilities import RunnerCaps, Slower, Support
from ..layouts import SORTED, ExpertBatch
from ..quant import row_local
from .base import ExpertRunner, ExpertWeights, empty_output, gated_activation

_FP8_ROWWISE = frozenset({"fp8-tensor", "fp8-channel"})


_HOPPER = frozenset({"sm_90"})  # torch's grouped GEMMs were run and checked on sm_90 only (moeflow.targets)


class GroupedMMRunner(ExpertRunner):
    name = "grouped_mm"
    caps = RunnerCaps(
        layouts=(SORTED,),
        support=(
            # torch._grouped_mm on CPU too needs 16-byte row strides: hidden_size and intermediate_size
            # (the two GEMMs' K) multiples of 4 fp32 / 8 bf16 or fp16 elements, else it raises at run time
            Support("cpu", frozenset({"none"}), frozenset({torch.float32}), align=4),
            Support("cpu", frozenset({"none"}), frozenset({torch.bfloat16, torch.float16}), align=8),
            # CUDA: 16-byte aligned rows (8 bf16 / 16 fp8 elements); CUTLASS grouped GEMM on sm90.
            Support("cuda", frozenset({"none"}), frozenset({torch.bfloat16}), min_cc=(9, 0), archs=_HOPPER, align=8),
            Support("cuda", _FP8_ROWWISE, frozenset({torch.bfloat16}), min_cc=(9, 0), archs=_HOPPER, align=16),
        ),
        priority=20,
        note="torch._grouped_mm / torch._scaled_grouped_mm (row-wise FP8)",
        graph_safe=True,  # device offsets, no host reads (`moeflow bench` captures it, every scheme)
        # torch._grouped_mm's bf16 / fp16 on a CPU without their matrix instructions is slower than the reference
        # runner (float32 MKL matmuls) from 128 tokens on, so "auto" takes the reference there (``factor`` and ``at``:
        # what the plan's reason quotes)
        slower=(Slower("cpu", frozenset({torch.bfloat16}), frozenset({"avx512_bf16", "amx_bf16", "bf16", "sve_bf16"}),
                       than="reference", lacking="AVX512-BF16 / AMX-BF16",
                       factor="2.2-6.8x", at="from 128 tokens on, AVX2 CPU"),
                Slower("cpu", frozenset({torch.float16}), frozenset({"avx512_fp16", "amx_fp16", "fp16_arith"}),
                       than="reference", lacking="AVX512-FP16 / AMX-FP16",
                       factor="1.9-5.5x", at="from 128 tokens on, AVX2 CPU")),
    )

    def __init__(self, config, scheme):
        super().__init__(config, scheme)
        self._row_local = row_local(scheme)

    def run(self, batch: ExpertBatch, weights: ExpertWeights) -> Tensor:
        batch = batch.gathered()  # rows given by index (not declared, but never misread)
        cfg = self.config
        if batch.hidden.shape[0] == 0:
            return empty_output(batch, cfg.hidden_size, cfg.dtype)
        offs = batch.offsets[1:].to(torch.int32)  # cumulative row ends per local expert
        xq, xs = self.input_activations(batch.hidden, batch.hidden_scale)
        h = self._gemm(xq, xs, weights.w13, weights.w13_scale, offs)  # [N, 2I]
        a = gated_activation(h, cfg.activation).to(cfg.dtype)
        del h  # each intermediate freed once used: the peak holds two of them, not all
        if batch.padded and not self._row_local:  # one scale over the batch: padding rows' (unspecified) outputs must not count
            a = a.masked_fill((torch.arange(a.shape[0], device=a.device) >= batch.offsets[-1])[:, None], 0)
        aq, as_ = self.scheme.quantize_activation(a)
        del a
        y = self._gemm(aq, as_, weights.w2, weights.w2_scale, offs)  # [N, H]
        del aq
        return y.float().mul_(batch.weights[:, None]).to(cfg.dtype)  # float() of its own GEMM output: free to change

    def _gemm(self, x: Tensor, x_scale: Tensor | None, w: Tensor, w_scale: Tensor | None, offs: Tensor) -> Tensor:
        """x [M, K] @ w[e].T for each expert's rows -> [M, N] in the layer dtype.

        w: [E_local, N, K]; its transpose is the column-major [E, K, N] operand the kernels want.
        """
        if x_scale is None:
            return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
        e, n, _ = w.shape
        row_scale_b = w_scale.float()
        if row_scale_b.dim() == 1:  # per-tensor weight scale [E] -> row-wise [E, N]
            row_scale_b = row_scale_b[:, None].expand(e, n)
        return torch._scaled_grouped_mm(
            x, w.transpose(1, 2), x_scale.reshape(-1).float(), row_scale_b.contiguous(),
            offs=offs, out_dtype=self.config.dtype)
