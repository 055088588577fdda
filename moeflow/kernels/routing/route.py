"""Routing in one launch: scores, optional grouped selection with a correction bias, top-k,
renormalization and scaling, a block of tokens per program, each top-k step a single max over (score, index) keys.

    logits [T, E] float (any), bias [E] float32 or None
    -> ids [T, K] int32 (descending choice order), weights [T, K] float32
Kernel: _route_kernel; launcher: route() (semantics: its docstring), which runs batches of 2048 tokens or more of
64-256 experts on routing/route_stream.py instead (the same ids). Torch reference: moeflow/routing/torch_topk.py;
the router backend around it, with what it supports: moeflow/routing/triton_topk.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..common import NEG_INF, cdiv, exact_sigmoid, key_value, next_pow2, order_key, pdl, pdl_start
from .route_stream import stream_launch, stream_pays, stream_shape, streams


@triton.jit
def _argmax_first(x, idx, N: tl.constexpr):
    """(max key, lowest index holding the max value) along the last axis of a [BLOCK_T, N] block,
    in one reduction (see common.order_key)."""
    key = tl.max(order_key(x, idx[None, :], N), axis=1)
    return key, (N - 1 - (key & 0xFFFFFFFF)).to(tl.int32)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, T, E, stride_l, scale,
                  K: tl.constexpr, K_POW2: tl.constexpr, E_POW2: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr,
                  HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr, BLOCK_T: tl.constexpr,
                  PDL: tl.constexpr = False):
    """BLOCK_T tokens per program (launch_shape), one row of E_POW2 experts each (E <= 1024, held in registers):
    every reduction runs along one token's row, each top-k step a single max over order_key's keys."""
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    t_ld = tl.minimum(t, T - 1)  # rows past T repeat the last token; never stored
    e = tl.arange(0, E_POW2)
    ok = e < E
    x = tl.load(logits_ptr + t_ld[:, None] * stride_l + e[None, :], mask=ok[None, :], other=NEG_INF).to(tl.float32)
    if SIGMOID:
        score = tl.where(ok[None, :], exact_sigmoid(x), NEG_INF)
    else:
        mx = tl.max(x, axis=1)
        ex = tl.where(ok[None, :], tl.exp(x - mx[:, None]), 0.0)
        score = tl.where(ok[None, :], ex / tl.sum(ex, axis=1)[:, None], NEG_INF)
    LOGITS: tl.constexpr = SIGMOID and not HAS_BIAS and GROUPS == 1  # the choice is the logit (route's docstring)
    choice = score
    if HAS_BIAS:
        choice = tl.where(ok[None, :], score + tl.load(bias_ptr + e, mask=ok, other=0.0)[None, :], NEG_INF)
    elif LOGITS:
        choice = x  # NEG_INF past E
    if GROUPS > 1:  # keep the TOPK_GROUPS best groups (E % GROUPS == 0, E_POW2 == E here)
        PER: tl.constexpr = E_POW2 // GROUPS
        c3 = tl.reshape(choice, (BLOCK_T, GROUPS, PER))
        j = tl.arange(0, PER)
        if HAS_BIAS:  # sum of the two best (the first max removed once)
            top = tl.max(order_key(c3, j[None, None, :], PER), axis=2)
            first = PER - 1 - (top & 0xFFFFFFFF)
            second = tl.max(tl.where(j[None, None, :] == first[:, :, None], NEG_INF, c3), axis=2)
            gscore = key_value(top) + second
        else:
            gscore = tl.max(c3, axis=2)
        g = tl.arange(0, GROUPS)
        keep = tl.zeros((BLOCK_T, GROUPS), dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUPS):
            _, gi = _argmax_first(tl.where(keep, NEG_INF, gscore), g, GROUPS)
            keep = keep | (g[None, :] == gi[:, None])
        choice = tl.reshape(tl.where(keep[:, :, None], c3, NEG_INF), (BLOCK_T, E_POW2))
    kk = tl.arange(0, K_POW2)
    ids = tl.zeros((BLOCK_T, K_POW2), dtype=tl.int32)
    wts = tl.zeros((BLOCK_T, K_POW2), dtype=tl.float32)
    taken = choice
    for k in tl.static_range(K):
        key, i = _argmax_first(taken, e, E_POW2)
        hit = e[None, :] == i[:, None]
        ids = tl.where(kk[None, :] == k, i[:, None], ids)
        if HAS_BIAS or LOGITS:  # the (unbiased) score of the chosen expert
            w_k = tl.sum(tl.where(hit, score, 0.0), axis=1)
        else:  # the choice is the score itself
            w_k = key_value(key)
        wts = tl.where(kk[None, :] == k, w_k[:, None], wts)
        taken = tl.where(hit, NEG_INF, taken)
    if RENORM:
        wts = wts / (tl.sum(wts, axis=1)[:, None] + 1e-20)
    out = t[:, None] * K + kk[None, :]
    store_ok = t_ok[:, None] & (kk < K)[None, :]
    tl.store(ids_ptr + out, ids, mask=store_ok)
    tl.store(w_ptr + out, wts * scale, mask=store_ok)


def route(logits: Tensor, bias: Tensor | None, top_k: int, scoring: str, renormalize: bool,
          num_groups: int = 1, topk_groups: int = 1, scaling: float = 1.0,
          block_t: int | None = None, num_warps: int | None = None, lanes: int | None = None) -> tuple[Tensor, Tensor]:
    """logits [T, E] float (any), bias [E] or None -> (ids [T, K] int32, weights [T, K] float32), with the
    semantics of moeflow/routing/torch_topk.py (its torch code is the reference): choice = score (+ bias), but
    sigmoid without a bias or groups ranks the logits (float32 sigmoids saturate to 1.0 from a logit of about 16.6:
    the scores tie there, the logits do not, and the other two routers rank the logits); grouped (num_groups > 1,
    E a power of two): a group's score is the sum of its two best choices (with a bias) or its best, the
    topk_groups best groups stay; ids = top-k of the choice among kept experts, in descending choice order;
    weights = the unbiased scores of those ids, renormalized (sum + 1e-20) if asked, times ``scaling``
    (routed_scaling_factor). Ties pick the lowest index (torch.topk's order among exact ties is unspecified).
    Sigmoid scores are torch's float32 bits (common.exact_sigmoid), so the ids are torch's wherever the float32
    choices do not tie exactly. One launch, no host synchronization.
    Large batches run route_stream.py's kernel where it computes the router (streams, stream_pays).
    block_t, num_warps: override launch_shape's choice; lanes: run the streaming kernel with this many threads a
    token (and num_warps, default stream_shape's) where it applies, 0 never (for benchmarks and tests)."""
    t, e = logits.shape
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    w = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    if t == 0:
        return ids, w
    e_pow2 = next_pow2(e)  # grouped: E a power of two (routing/triton_topk.py's caps)
    if streams(scoring, bias is not None, num_groups) and (stream_pays(t, e_pow2, num_groups) if lanes is None
                                                          else lanes > 0):
        auto_lanes, auto_warps = stream_shape(t, e_pow2, num_groups)
        stream_launch(logits, bias, ids, w, top_k, scoring, renormalize, num_groups, topk_groups, scaling,
                      lanes or auto_lanes, num_warps or auto_warps, pdl(logits.device))
        return ids, w
    b = bias.float().contiguous() if bias is not None else w
    auto_t, auto_w = launch_shape(e_pow2)
    block_t, num_warps = block_t or auto_t, num_warps or auto_w
    _route_kernel[(cdiv(t, block_t),)](
        logits, b, ids, w, t, e, logits.stride(0), float(scaling),
        K=top_k, K_POW2=next_pow2(top_k), E_POW2=e_pow2, SIGMOID=scoring == "sigmoid", RENORM=renormalize,
        HAS_BIAS=bias is not None, GROUPS=num_groups, TOPK_GROUPS=topk_groups, BLOCK_T=block_t,
        num_warps=num_warps, **pdl(logits.device))
    return ids, w


def launch_shape(e_pow2: int) -> tuple[int, int]:
    """(tokens per program, warps) for E_POW2 experts; T plays no part.

    Up to 256 experts: one warp, so every reduction along a row stays in shuffles, with about 128
    scores per program (one token of 128 or 256 experts, 16 of 8; at most 32 tokens). More experts:
    8 warps and rows of 2048 scores."""
    if e_pow2 <= 256:
        return max(1, min(32, 128 // e_pow2)), 1
    return max(1, 2048 // e_pow2), 8
