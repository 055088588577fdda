"""Routing of large batches: each token's row streamed through the registers of a few threads.

    logits [T, E] float (any), bias [E] float32 or None
    -> ids [T, K] int32 (descending choice order), weights [T, K] float32, the ids of routing/route.py's kernel
Torch reference: moeflow/routing/torch_topk.py. Kernel: _route_stream_kernel (semantics and method: its docstring);
launcher: stream_launch (stream_shape picks its threads a token); which kernel runs: route.route, by streams() and
stream_pays(). Why: route.py gives each token a warp and runs K argmax reductions over it, each a chain of shuffles
of 64-bit keys, bound by instructions at large T; here each thread keeps its columns' K best with no shuffles.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..common import NEG_INF, cdiv, exact_sigmoid, key_value, next_pow2, order_key, pdl_start


@triton.jit
def _insert(vals, ids, s, si, K: tl.constexpr):
    """(s, si) into the descending lists vals, ids (tuples of K tensors) -> the K best of the K + 1. s enters
    only above a strictly smaller value: the lists hold the lowest index first among equal values when the
    columns come in increasing order."""
    nv = ()
    ni = ()
    for k in tl.static_range(K):
        gt = s > vals[k]
        nv = nv + (tl.where(gt, s, vals[k]),)
        ni = ni + (tl.where(gt, si, ids[k]),)
        s = tl.where(gt, vals[k], s)
        si = tl.where(gt, ids[k], si)
    return nv, ni


@triton.jit
def _split4(x):
    """[A, B, 4] -> its four [A, B] slices, columns 0, 1, 2, 3 (the last axis stays in each thread)."""
    a, b = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], 2, 2)))  # a: columns 0 and 2, b: 1 and 3
    a0, a2 = tl.split(a)
    b1, b3 = tl.split(b)
    return a0, b1, a2, b3


@triton.jit
def _chunk(row, bias_ptr, c0, E, SCORES: tl.constexpr, HAS_BIAS: tl.constexpr, LANES: tl.constexpr):
    """The choices of columns c0 .. c0 + 4 * LANES - 1 of the rows (row: [BLOCK_T] pointers) -> [BLOCK_T,
    4 * LANES] float32: the logit, or SCORES sigmoid(x) (+ bias); NEG_INF past E. Loaded as one run of 4 * LANES
    columns, so that lane l's 4l .. 4l + 3 come in one 16-byte load and stay in its thread (_columns)."""
    cols = c0 + tl.arange(0, 4 * LANES)
    ok = cols < E
    x = tl.load(row[:, None] + cols[None, :], mask=ok[None, :], other=NEG_INF).to(tl.float32)
    if SCORES:  # sigmoid scores (streams() sends softmax with a bias or groups to routing/route.py)
        x = exact_sigmoid(x)
        if HAS_BIAS:
            x = x + tl.load(bias_ptr + cols, mask=ok, other=0.0)[None, :]
        x = tl.where(ok[None, :], x, NEG_INF)
    return x


@triton.jit
def _columns(x, c0, LANES: tl.constexpr, BLOCK_T: tl.constexpr):
    """A chunk of _chunk at column c0 -> its lanes' 4 columns, each [BLOCK_T, LANES], and the lanes' first
    column [BLOCK_T, LANES] int32."""
    x0, x1, x2, x3 = _split4(tl.reshape(x, (BLOCK_T, LANES, 4)))
    col = tl.broadcast_to((c0 + tl.arange(0, LANES) * 4)[None, :], (BLOCK_T, LANES))
    return x0, x1, x2, x3, col


@triton.jit
def _insert4(vals, ids, x0, x1, x2, x3, col, K: tl.constexpr):
    """A chunk's 4 columns (_chunk) into a lane's lists, in column order."""
    vals, ids = _insert(vals, ids, x0, col, K)
    vals, ids = _insert(vals, ids, x1, col + 1, K)
    vals, ids = _insert(vals, ids, x2, col + 2, K)
    return _insert(vals, ids, x3, col + 3, K)


@triton.jit
def _top2(t1, t2, x):
    """A lane's two best so far (t1 >= t2) with x seen -> the new two; an x equal to t1 becomes t2."""
    return tl.maximum(t1, x), tl.where(x > t1, t1, tl.maximum(t2, x))


@triton.jit
def _group_score(t1, t2, lane, HAS_BIAS: tl.constexpr, LANES: tl.constexpr):
    """A group's score from its lanes' two best [BLOCK_T, LANES] -> [BLOCK_T]: with a bias the sum of the group's
    two best entries (the lane holding the best gives its second, the others their best), else its best."""
    if HAS_BIAS:
        key = order_key(t1, lane[None, :], LANES)
        best = tl.max(key, axis=1)
        second = tl.max(tl.where(key == best[:, None], t2, t1), axis=1)
        return key_value(best) + second
    else:
        return tl.max(t1, axis=1)


@triton.jit
def _route_stream_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, T, E, stride_l, scale,
                         K: tl.constexpr, E_POW2: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr,
                         HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                         LANES: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr = False):
    """BLOCK_T = 32 * num_warps / LANES tokens a program, LANES threads a token. Semantics (torch_topk's):
      no bias, no groups: the top-k of the logits (softmax and sigmoid are monotone: torch_topk._select_on_logits);
        softmax weights exp(v_k - v_0) / sum_j exp(v_j - v_0) over the K picked when renormalizing, else over the
        whole row (a second pass for its sum); sigmoid weights sigmoid(v_k);
      sigmoid with a bias or groups: the top-k of sigmoid(x) (+ bias), among the TOPK_GROUPS best of the GROUPS
        groups (a first pass scores them: the sum of a group's two best choices with a bias, else its best; ties
        to the lowest group); weights the unbiased sigmoid(x);
    sigmoid weights renormalized (sum + 1e-20) if RENORM; then times ``scale``. Ties pick the lowest index.
    Sigmoids are torch's float32 bits (common.exact_sigmoid), so the ids are torch's but at exact ties.
    Method: each thread issues the loads of its share of the row at once (16-byte loads of 4: lane l takes columns
    4l .. 4l + 3 of every 4 * LANES, E_POW2 / LANES values a thread; waiting for one chunk at a time is slower),
    keeps the K best in registers by a sorted insertion (_insert: K compares and selects a column, no shuffles),
    and the lanes' K lists merge at the end in K rounds of one max over the LANES lanes (common.order_key's keys:
    value, then lowest index). GROUPS > 1 (sigmoid, E == E_POW2, 4 * LANES <= E / GROUPS): a first pass scores
    the groups, the second streams only the TOPK_GROUPS best."""
    pdl_start(PDL)
    # choices: the logits themselves (monotone in the scores: routing/torch_topk._select_on_logits), or the
    # sigmoid scores (+ bias) where a bias or the groups need them (as torch_topk then ranks)
    SCORES: tl.constexpr = HAS_BIAS or GROUPS > 1
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ld = tl.minimum(t, T - 1)  # rows past T repeat the last token; never stored
    row = logits_ptr + t_ld * stride_l  # [BLOCK_T]
    lane = tl.arange(0, LANES)
    vals = ()
    ids = ()
    for k in tl.static_range(K):
        vals = vals + (tl.full((BLOCK_T, LANES), NEG_INF, tl.float32),)
        ids = ids + (tl.zeros((BLOCK_T, LANES), tl.int32),)
    # every chunk's loads issued at once (the whole row: E_POW2 / LANES values a thread), then taken in column order
    W: tl.constexpr = 4 * LANES
    xs = ()
    for c in tl.static_range(E_POW2 // W):
        xs = xs + (_chunk(row, bias_ptr, c * W, E, SCORES, HAS_BIAS, LANES),)
    if GROUPS > 1:
        CPG: tl.constexpr = E_POW2 // GROUPS // W  # chunks a group
        sel = ()  # the TOPK_GROUPS best groups: scores and indices, [BLOCK_T] each
        sel_g = ()
        for s in tl.static_range(TOPK_GROUPS):
            sel = sel + (tl.full((BLOCK_T,), NEG_INF, tl.float32),)
            sel_g = sel_g + (tl.full((BLOCK_T,), -1, tl.int32),)
        for g in tl.static_range(GROUPS):
            t1 = tl.full((BLOCK_T, LANES), NEG_INF, tl.float32)
            t2 = tl.full((BLOCK_T, LANES), NEG_INF, tl.float32)
            for i in tl.static_range(CPG):
                x0, x1, x2, x3, col = _columns(xs[g * CPG + i], 0, LANES, BLOCK_T)
                t1, t2 = _top2(t1, t2, x0)
                t1, t2 = _top2(t1, t2, x1)
                t1, t2 = _top2(t1, t2, x2)
                t1, t2 = _top2(t1, t2, x3)
            sel, sel_g = _insert(sel, sel_g, _group_score(t1, t2, lane, HAS_BIAS, LANES),
                                 tl.full((BLOCK_T,), g, tl.int32), TOPK_GROUPS)
        for g in tl.static_range(GROUPS):
            keep = sel_g[0] == g
            for s in tl.static_range(1, TOPK_GROUPS):
                keep = keep | (sel_g[s] == g)
            keep = keep[:, None]
            for i in tl.static_range(CPG):
                x0, x1, x2, x3, col = _columns(xs[g * CPG + i], (g * CPG + i) * W, LANES, BLOCK_T)
                vals, ids = _insert4(vals, ids, tl.where(keep, x0, NEG_INF), tl.where(keep, x1, NEG_INF),
                                     tl.where(keep, x2, NEG_INF), tl.where(keep, x3, NEG_INF), col, K)
    else:
        for c in tl.static_range(E_POW2 // W):
            x0, x1, x2, x3, col = _columns(xs[c], c * W, LANES, BLOCK_T)
            vals, ids = _insert4(vals, ids, x0, x1, x2, x3, col, K)
    # the lanes' lists merged: K rounds, each the best head over the lanes, whose lane then drops it; the K
    # results as a tuple of [BLOCK_T] tensors, in the lanes' layout (no layout conversion)
    out_ids = ()
    out_v = ()
    for k in tl.static_range(K):
        key = order_key(vals[0], ids[0], E_POW2)
        best = tl.max(key, axis=1)
        win = key == best[:, None]
        out_ids = out_ids + ((E_POW2 - 1 - (best & 0xFFFFFFFF)).to(tl.int32),)
        out_v = out_v + (key_value(best),)
        shifted = ()
        sh_ids = ()
        for j in tl.static_range(K - 1):
            shifted = shifted + (tl.where(win, vals[j + 1], vals[j]),)
            sh_ids = sh_ids + (tl.where(win, ids[j + 1], ids[j]),)
        vals = shifted + (tl.where(win, NEG_INF, vals[K - 1]),)
        ids = sh_ids + (ids[K - 1],)
    wts = ()
    total = tl.full((BLOCK_T,), 0.0 if RENORM else 1.0, tl.float32)  # the weights' divisor
    if not SIGMOID and not RENORM:  # the softmax over the whole row: its sum in a second pass
        acc = tl.zeros((BLOCK_T, W), tl.float32)
        for c in tl.static_range(E_POW2 // W):  # the logits still in registers
            acc += tl.exp(xs[c] - out_v[0][:, None])
        total = tl.sum(tl.sum(tl.reshape(acc, (BLOCK_T, LANES, 4)), axis=2), axis=1)
    for k in tl.static_range(K):
        if HAS_BIAS:  # the unbiased score of the picked expert, from its logit
            w_k = exact_sigmoid(tl.load(logits_ptr + t_ld * stride_l + out_ids[k]).to(tl.float32))
        elif SCORES:  # the choices were the scores
            w_k = out_v[k]
        elif SIGMOID:
            w_k = exact_sigmoid(out_v[k])
        else:  # softmax: exp(v_k - v_0), over the sum of the K picked (RENORM) or of the whole row
            w_k = tl.exp(out_v[k] - out_v[0])
        if RENORM:
            total += w_k
        wts = wts + (w_k,)
    if RENORM and (SIGMOID or HAS_BIAS):
        total += 1e-20
    ok = (t < T)[:, None] & (lane == 0)[None, :]  # stored by each token's first lane, in the lanes' layout
    dst = t[:, None] * K + tl.zeros((1, LANES), tl.int64)
    for k in tl.static_range(K):
        tl.store(ids_ptr + dst + k, out_ids[k][:, None], mask=ok)
        tl.store(w_ptr + dst + k, (wts[k] / total * scale)[:, None], mask=ok)


def stream_shape(t: int, e_pow2: int, num_groups: int = 1) -> tuple[int, int]:
    """(LANES, warps) of the streaming kernel: threads a token and warps a program. One warp a program; 8 threads
    a token below T = 8192, from there as many as give each thread 32 of the row's values (at least 4); at most
    E_POW2 / 16 threads and a group's experts / 4 (a lane's 4 columns lie in one group)."""
    lanes = 8 if t < 8192 else max(4, e_pow2 // 32)
    return max(1, min(lanes, e_pow2 // 16, e_pow2 // num_groups // 4)), 1


def stream_launch(logits, bias, ids, w, top_k: int, scoring: str, renormalize: bool, num_groups: int,
                  topk_groups: int, scaling: float, lanes: int, num_warps: int, pdl_kw: dict) -> None:
    """Launch _route_stream_kernel into ids [T, K] int32 and w [T, K] float32 (route.route checked the case)."""
    t, e = logits.shape
    e_pow2 = next_pow2(e)
    if lanes < 1 or 4 * lanes > e_pow2 // num_groups or 32 * num_warps % lanes:
        raise ValueError(f"{lanes} threads a token do not fit {e} experts in {num_groups} groups and {num_warps} warps")
    block_t = 32 * num_warps // lanes
    _route_stream_kernel[(cdiv(t, block_t),)](
        logits, bias if bias is not None else w, ids, w, t, e, logits.stride(0), float(scaling),
        K=top_k, E_POW2=e_pow2, SIGMOID=scoring == "sigmoid", RENORM=renormalize, HAS_BIAS=bias is not None,
        GROUPS=num_groups, TOPK_GROUPS=topk_groups, LANES=lanes, BLOCK_T=block_t, num_warps=num_warps, **pdl_kw)


def streams(scoring: str, has_bias: bool, num_groups: int) -> bool:
    """Whether the streaming kernel computes this router: softmax without a bias and without expert groups, or
    sigmoid (with or without a bias, groups or not)."""
    return scoring == "sigmoid" or not (has_bias or num_groups > 1)


def stream_pays(t: int, e_pow2: int, num_groups: int = 1) -> bool:
    """Whether route.route runs the streaming kernel for T tokens of E_POW2 experts in num_groups groups
    (launch_shape's kernel otherwise). It holds a whole row in registers: E_POW2 / LANES values a thread, up to 256
    experts; a lane loads 4 columns of one group, so a group holds at least 4 experts (groups of 1 or 2, which a
    biased grouped router allows, run the one-warp kernel: stream_launch refused them)."""
    return t >= 2048 and 64 <= e_pow2 <= 256 and e_pow2 // num_groups >= 4
