"""Shared setup of the GEMM experiments (GPU): a preset's shape, a random sorted batch of T tokens
(uniform routing), its row layout, and the kernel configs the triton runner picks for it (the
shipped tuned tables, fitted as the layer fits them); fp8_block_case adds random weights and the
batch's rows quantized."""
from types import SimpleNamespace

import torch

from moeflow.kernels.autotune import Shape, _layer_parts, graph_time_ms, random_batch
from moeflow.kernels.common import RowLayout
from moeflow.presets import PRESETS


def gemm_case(preset: str, scheme: str, tokens: int, device, indexed: bool = False):
    """-> (Shape, ExpertBatch, RowLayout, MoEKernelConfig) of the preset at T = tokens; indexed: the batch's rows by
    index (random_batch's), as the local dispatcher hands them."""
    p = PRESETS[preset]
    e, h, i, k = p["num_experts"], p["hidden_size"], p["intermediate_size"], p["top_k"]
    shape = Shape(e, h, i, k, scheme)
    batch = random_batch(shape, tokens, device, indexed=indexed)
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


def gluon_gate_up_case(preset: str, tokens: int, device) -> SimpleNamespace:
    """fp8_block_case plus what the experiments on the Gluon fp8-block gate_up (kernels/gate_up_wgmma.py) time it
    with: cfg, the shape's 128-row Gluon config (the shipped one where the table takes the Gluon kernel, else
    128x128, 8 warps, 3 stages); want, the Triton kernel's output at that tile (the bits every version must give);
    inter and scale, the output buffers. Fields: shape, batch, layout, w, xq, xs, cfg, want, inter, scale."""
    from dataclasses import replace

    from moeflow.kernels.gate_up import gate_up
    shape, batch, layout, kcfg, w, xq, xs = fp8_block_case(preset, tokens, device)
    cfg = kcfg.gate_up if kcfg.gate_up.scale_overlap else replace(kcfg.gate_up, block_m=128, num_warps=8, num_stages=3,
                                                                  scale_overlap=1)
    want = gate_up(xq, xs, w.w13, w.w13_scale, layout, "fp8-block", "silu", torch.bfloat16,
                   replace(cfg, scale_overlap=0))
    r, i = xq.shape[0], shape.inter
    return SimpleNamespace(shape=shape, batch=batch, layout=layout, w=w, xq=xq, xs=xs, cfg=cfg, want=want,
                           inter=torch.empty(r, i, dtype=torch.float8_e4m3fn, device=device),
                           scale=torch.empty(r, i // 128, dtype=torch.float32, device=device))


def time_gluon_gate_up(case: SimpleNamespace, mod, cfg, most_unroll: int = 8) -> dict:
    """Time ``mod``.launch (a version of kernels/gate_up_wgmma.py) at ``cfg`` on a gluon_gate_up_case, its outputs
    poisoned (NaN) first and compared with case.want: time_variant's dict."""
    from moeflow.kernels.common import ACT_CODES
    c = case
    run = lambda: mod.launch(c.xq, c.xs, c.w.w13, c.w.w13_scale, c.layout, ACT_CODES["silu"], torch.bfloat16, cfg,
                             c.inter, c.scale, most_unroll=most_unroll)
    c.inter.view(torch.uint8).fill_(0x7F)  # NaN
    c.scale.fill_(float("nan"))
    return time_variant(run, c.layout, (c.inter, c.scale), c.want)[0]


def time_variant(run, layout, got, want):
    """Run a GEMM variant once (run: no arguments; it writes the tensors of got, poisoned by the caller), compare
    got's valid rows bit for bit with want's (tensors of the same shapes: fp8 compared as bytes), then time it in a
    CUDA graph -> (dict(us, bit_equal), what run returned), or (dict(error), None) where it does not compile or run
    (recorded, not fatal)."""
    try:
        handle = run()
        torch.cuda.synchronize()
        bits = same_bits(got, want, layout.valid_rows())
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


def gemm_rows(shape, tokens: int, gemm: str, device) -> list:
    """Inputs of one GEMM at T = tokens, batches_for(T) routings (as the tuner times): a list of (a, a_scale or None,
    RowLayout, routing weights [R]). gate_up: the batch's rows in order [R, H]; down: a random intermediate [R, I];
    both quantized in 1x128 groups for fp8-block, else in the layer dtype (bf16)."""
    from moeflow.kernels.autotune import batches_for
    from moeflow.quant import create_scheme
    out = []
    for b in range(batches_for(tokens)):
        batch = random_batch(shape, tokens, device, seed=tokens * 1000 + b)
        lay = RowLayout.of(batch)
        a = (torch.randn(lay.rows, shape.inter, device=device).bfloat16() if gemm == "down"
             else batch.hidden.bfloat16())
        a_s = None
        if shape.scheme == "fp8-block":
            a, a_s = create_scheme("fp8-block").quantize_activation(a)
        out.append((a, a_s, lay, batch.weights))
    return out


def gemm_runner(gemm: str, w, scheme: str):
    """-> run(inputs, cfg, poison=False) -> (out, out scale or None) of gate_up (silu) or down on gemm_rows' inputs
    with the ExpertWeights w."""
    from moeflow.kernels.down import down
    from moeflow.kernels.gate_up import gate_up
    if gemm == "down":
        return lambda d, cfg, poison=False: (down(d[0], d[1], w.w2, w.w2_scale, d[3], d[2], scheme, torch.bfloat16,
                                                  cfg, poison=poison), None)
    return lambda d, cfg, poison=False: gate_up(d[0], d[1], w.w13, w.w13_scale, d[2], scheme, "silu",
                                                torch.bfloat16, cfg, poison=poison)


def as_bytes(t):
    """fp8 tensors as their uint8 bytes (the same storage), others as they are: float8 indexing and comparison
    kernels are missing in some torch builds."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def same_bits(got, want, valid) -> bool:
    """Whether two equally long tuples of output tensors (such as (out, out scale or None)) agree bit for bit on the
    valid rows; fp8 compared as bytes, None entries of got skipped."""
    return all(torch.equal(as_bytes(g)[valid], as_bytes(x)[valid]) for g, x in zip(got, want, strict=True)
               if g is not None)
