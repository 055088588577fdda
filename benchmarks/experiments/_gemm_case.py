"""Shared setup of the GEMM experiments (GPU): a preset's shape, a random sorted batch of T tokens
(uniform routing), its row layout, and the kernel configs the triton runner picks for it (the
shipped tuned tables, fitted as the layer fits them); fp8_block_case adds random weights and the
batch's rows quantized."""
from types import SimpleNamespace

import torch

from moeflow.kernels.autotune import Shape, _runner, random_batch
from moeflow.kernels.common import RowLayout
from moeflow.presets import PRESETS


def gemm_case(preset: str, scheme: str, tokens: int, device):
    """-> (Shape, ExpertBatch, RowLayout, MoEKernelConfig) of the preset at T = tokens."""
    p = PRESETS[preset]
    e, h, i, k = p["num_experts"], p["hidden_size"], p["intermediate_size"], p["top_k"]
    shape = Shape(e, h, i, k, scheme)
    batch = random_batch(shape, tokens, device)
    shapes_only = SimpleNamespace(w13=torch.empty(e, 2 * i, h, device="meta"), w2=torch.empty(e, h, i, device="meta"))
    return shape, batch, RowLayout.of(batch), _runner(shape).kernel_config(batch, shapes_only)


def fp8_block_case(preset: str, tokens: int, device):
    """gemm_case in fp8-block, plus random ExpertWeights and the batch's rows quantized in 1x128 groups
    -> (Shape, ExpertBatch, RowLayout, MoEKernelConfig, ExpertWeights, x [R, H] fp8, x scale [R, H/128])."""
    from moeflow.kernels.autotune import random_weights
    from moeflow.kernels.quant import quantize_rows
    shape, batch, layout, kcfg = gemm_case(preset, "fp8-block", tokens, device)
    xq, xs = quantize_rows(batch.hidden, "fp8-block", layout)
    return shape, batch, layout, kcfg, random_weights(shape, device), xq, xs
