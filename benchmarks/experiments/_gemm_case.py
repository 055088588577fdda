"""Shared setup of the GEMM experiments (GPU): a preset's shape, a random sorted batch of T tokens
(uniform routing), its row layout, and the kernel configs the triton runner picks for it (the
shipped tuned tables, fitted as the layer fits them)."""
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
