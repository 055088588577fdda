"""Shared setup of the GEMM experiments (GPU): a preset's shape, a random sorted batch of T tokens
(uniform routing), its row layout, and the kernel configs the triton runner picks for it (the
shipped tuned tables, fitted as the layer fits them); fp8_block_case adds random weights and the
batch's rows quantized."""
from types import SimpleNamespace

import torch

from moeflow.kernels.autotune import Shape, _layer_parts, graph_time_ms, random_batch
from moeflow.kernels.common import RowLayout
from moeflow.presets import PRESETS


def gemm_case(preset: str, scheme: str, tokens: int, device):
    """-> (Shape, ExpertBatch, RowLayout, MoEKernelConfig) of the preset at T = tokens."""
    p = PRESETS[preset]
    e, h, i, k = p["num_experts"], p["hidden_size"], p["intermediate_size"], p["top_k"]
    shape = Shape(e, h, i, k, scheme)
    batch = random_batch(shape, tokens, device)
    shapes_only = SimpleNamespace(w13=torch.empty(e, 2 * i, h, device="meta"), w2=torch.empty(e, h, i, device="meta"))
    return shape, batch, RowLayout.of(batch), _layer_parts(shape)[1].kernel_config(batch, shapes_only)


def fp8_block_case(preset: str, tokens: int, device):
    """gemm_case in fp8-block, plus random ExpertWeights and the batch's rows quantized in 1x128 groups
    -> (Shape, ExpertBatch, RowLayout, MoEKernelConfig, ExpertWeights, x [R, H] fp8, x scale [R, H/128])."""
    from moeflow.kernels.autotune import random_weights
    from moeflow.kernels.quant import quantize_rows
    shape, batch, layout, kcfg = gemm_case(preset, "fp8-block", tokens, device)
    xq, xs = quantize_rows(batch.hidden, "fp8-block", layout)
    return shape, batch, layout, kcfg, random_weights(shape, device), xq, xs


def time_variant(run, layout, got, want):
    """Run a GEMM variant once (run: no arguments; it writes the tensors of got, poisoned by the caller), compare
    got's valid rows bit for bit with want's (tensors of the same shapes: fp8 compared as bytes), then time it in a
    CUDA graph -> (dict(us, bit_equal), what run returned), or (dict(error), None) where it does not compile or run
    (recorded, not fatal)."""
    try:
        handle = run()
        torch.cuda.synchronize()
        valid = layout.valid_rows()
        as_bits = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t
        bits = all(torch.equal(as_bits(g)[valid], as_bits(w)[valid]) for g, w in zip(got, want, strict=True))
        return dict(us=round(graph_time_ms([run], 40) * 1e3, 1), bit_equal=bits), handle
    except Exception as exc:
        return dict(error=repr(exc)[:300]), None


def preset_weights(preset: str, scheme: str, cache: dict, device):
    """-> (the preset's Shape in ``scheme``, random ExpertWeights of it), the weights kept in ``cache`` for the
    preset last asked for only (DeepSeek-V3's fp8 experts take 11 GB): experiments walking rows preset by preset."""
    from moeflow.kernels.autotune import random_weights
    p = PRESETS[preset]
    shape = Shape(p["num_experts"], p["hidden_size"], p["intermediate_size"], p["top_k"], scheme)
    if (preset, scheme) not in cache:
        cache.clear()
        torch.cuda.empty_cache()
        cache[(preset, scheme)] = random_weights(shape, device)
    return shape, cache[(preset, scheme)]
