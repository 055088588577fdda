"""Routing in one launch: scores, optional grouped selection with a correction bias, top-k,
renormalization and scaling, one program per token (E <= 1024 experts held in registers).

    logits [T, E] float (any), bias [E] float32 or None
    -> ids [T, K] int32 (descending choice order), weights [T, K] float32
Semantics are those of routing/torch_topk.py (its torch code is the reference): choice = score
(+ bias); grouped: a group's score is the sum of its two best choices (with a bias) or its best,
the topk_groups best groups stay; ids = top-k of the choice among kept experts; weights = the
unbiased scores of those ids, renormalized (sum + 1e-20) and times routed_scaling_factor.
Ties pick the lowest index (torch.topk's order among exact ties is unspecified).
The router backend around it, with what it supports, is routing/triton_topk.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

NEG = tl.constexpr(float("-inf"))


@triton.jit
def _argmax_first(x, idx, N: tl.constexpr):
    """(max value, lowest index holding it) of a 1-D block."""
    m = tl.max(x, axis=0)
    i = tl.min(tl.where(x == m, idx, N), axis=0)
    return m, i


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, E, stride_l, scale,
                  K: tl.constexpr, K_POW2: tl.constexpr, E_POW2: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr,
                  HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_POW2)
    ok = e < E
    x = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=NEG).to(tl.float32)
    if SIGMOID:
        score = tl.where(ok, tl.sigmoid(x), NEG)
    else:
        mx = tl.max(x, axis=0)
        ex = tl.where(ok, tl.exp(x - mx), 0.0)
        score = tl.where(ok, ex / tl.sum(ex, axis=0), NEG)
    choice = score
    if HAS_BIAS:
        choice = tl.where(ok, score + tl.load(bias_ptr + e, mask=ok, other=0.0), NEG)
    if GROUPS > 1:  # keep the TOPK_GROUPS best groups (E % GROUPS == 0, E_POW2 == E here)
        PER: tl.constexpr = E_POW2 // GROUPS
        c2 = tl.reshape(choice, (GROUPS, PER))
        j = tl.arange(0, PER)
        best = tl.max(c2, axis=1)
        if HAS_BIAS:  # sum of the two best (the first max removed once)
            first = tl.min(tl.where(c2 == best[:, None], j[None, :], PER), axis=1)
            second = tl.max(tl.where(j[None, :] == first[:, None], NEG, c2), axis=1)
            gscore = best + second
        else:
            gscore = best
        g = tl.arange(0, GROUPS)
        keep = g < 0  # all False
        for _ in tl.static_range(TOPK_GROUPS):
            _, gi = _argmax_first(tl.where(keep, NEG, gscore), g, GROUPS)
            keep = keep | (g == gi)
        choice = tl.reshape(tl.where(keep[:, None], c2, NEG), (E_POW2,))
    kk = tl.arange(0, K_POW2)
    ids = tl.zeros((K_POW2,), dtype=tl.int32)
    wts = tl.zeros((K_POW2,), dtype=tl.float32)
    taken = choice
    for k in tl.static_range(K):
        _, i = _argmax_first(taken, e, E_POW2)
        ids = tl.where(kk == k, i, ids)
        wts = tl.where(kk == k, tl.sum(tl.where(e == i, score, 0.0), axis=0), wts)
        taken = tl.where(e == i, NEG, taken)
    if RENORM:
        wts = wts / (tl.sum(wts, axis=0) + 1e-20)
    tl.store(ids_ptr + t * K + kk, ids, mask=kk < K)
    tl.store(w_ptr + t * K + kk, wts * scale, mask=kk < K)


def route(logits: Tensor, bias: Tensor | None, top_k: int, scoring: str, renormalize: bool,
          num_groups: int = 1, topk_groups: int = 1, scaling: float = 1.0) -> tuple[Tensor, Tensor]:
    """logits [T, E], bias [E] or None -> (ids [T, K] int32, weights [T, K] float32) (module docstring)."""
    t, e = logits.shape
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    w = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    if t == 0:
        return ids, w
    e_pow2 = triton.next_power_of_2(e)  # grouped: E a power of two (routing/triton_topk.py's caps)
    b = bias.float().contiguous() if bias is not None else w
    _route_kernel[(t,)](logits, b, ids, w, e, logits.stride(0), float(scaling),
                        K=top_k, K_POW2=triton.next_power_of_2(top_k), E_POW2=e_pow2, SIGMOID=scoring == "sigmoid", RENORM=renormalize,
                        HAS_BIAS=bias is not None, GROUPS=num_groups, TOPK_GROUPS=topk_groups,
                        num_warps=4 if e_pow2 <= 256 else 8)
    return ids, w
