"""A small batch's whole single-process layer after routing in one launch: no sort, no top-k sum launch.

x [T, H] layer dtype, topk_ids [T, K] int32, topk_weights [T, K] fp32, w13 gate_up_proj [E, 2I, H], w2 down_proj
[E, H, I] (+ scheme scales; FUSED_SCHEMES) -> out [T, H] layer dtype:
out[t] = sum over k (in k order, fp32) of w[t, k] * down_e(act(gate_e(x[t])) * up_e(x[t])).
Kernel: _fused_layer_kernel (work items, ordering, counters, quantization: its docstring). Launcher: fused_layer();
torch reference: fused_layer_torch. Copies that share an expert read its weights once each, so it is for batches of
about one copy per expert hit; the tuned tables say where (MoEKernelConfig.fused, kernels/configs.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..common import (QUANT_CODES, cdiv, fp8_scale, gated_act, interpreting, next_pow2, pdl, pdl_launch, pdl_wait,
                     to_fp8, weight_operand)

FUSED_SCHEMES = ("none", "fp8-channel", "fp8-block")  # QUANT codes 0, 2 and 3 below; TritonRunner declares the same
_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _row_operand(vals, row_scale, QUANT: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """One K step of one row, vals [BLOCK_K] -> (the dot's B operand [BLOCK_K, 16]: the row in every column,
    its scale): fp8-block quantizes the step's 1x128 group (BLOCK_K == 128) as rows/quant.quantize_groups;
    fp8-channel quantizes with the whole row's scale ``row_scale``; else the values themselves and 1."""
    if QUANT == 3:
        v = vals.to(tl.float32)
        scale = fp8_scale(tl.max(tl.abs(v), axis=0))
        b = tl.broadcast_to(to_fp8(v, scale, ROUND_IN_FP32)[:, None], (v.shape[0], 16))
    elif QUANT == 2:
        scale = row_scale
        b = tl.broadcast_to(to_fp8(vals.to(tl.float32), scale, ROUND_IN_FP32)[:, None], (vals.shape[0], 16))
    else:
        scale = 1.0
        b = tl.broadcast_to(vals[:, None], (vals.shape[0], 16))
    return b, scale


@triton.jit
def _weight_tile(w, row0, rows, stride_we, stride_wn, e, k0, K_SIZE, W_TMA: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weight rows of expert e, columns k0 .. k0+BLOCK_K (zero past K_SIZE) -> [BLOCK_N, BLOCK_K], the dot's A
    operand. w: a TMA descriptor over [E * N, K] (W_TMA), read at row row0 (expert e's first row plus the
    tile's), or a pointer to [E, N, K] read at ``rows`` [BLOCK_N] (clamped in range by the caller)."""
    if W_TMA:
        tile = w.load([row0, k0])
    else:
        rk = k0 + tl.arange(0, BLOCK_K)
        ptrs = w + e.to(tl.int64) * stride_we + rows[:, None].to(tl.int64) * stride_wn + rk[None, :]
        tile = tl.load(ptrs, mask=(rk < K_SIZE)[None, :], other=0.0)
    return tile


@triton.jit
def _step(acc, a, b, s, SCALED: tl.constexpr, DOT_IEEE: tl.constexpr):
    """acc + s * (a @ b) (SCALED) or acc + a @ b; float32 layers dot in IEEE float32."""
    if SCALED:
        if DOT_IEEE:
            acc = acc + tl.dot(a, b, input_precision="ieee") * s
        else:
            acc = acc + tl.dot(a, b) * s
    elif DOT_IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _column0(acc):
    """[BLOCK_N, 16] transposed product (16 equal columns) -> its first column [BLOCK_N], exactly."""
    return tl.sum(tl.where((tl.arange(0, 16) == 0)[None, :], acc, 0.0), axis=1)


@triton.jit
def _row_amax(row_ptr, n, BLOCK: tl.constexpr):
    """max |row[0 .. n)| in float32 (fp8-channel: x[t]'s per-token scale comes from it, as
    quant.quantize_activation)."""
    m = tl.zeros((BLOCK,), dtype=tl.float32)
    for kb in range(0, tl.cdiv(n, BLOCK)):
        rk = kb * BLOCK + tl.arange(0, BLOCK)
        m = tl.maximum(m, tl.abs(tl.load(row_ptr + rk, mask=rk < n, other=0.0).to(tl.float32)))
    return tl.max(m, axis=0)


@triton.jit
def _last_of(counter_ptr, part_ptr, s, vals, SPLIT: tl.constexpr, N: tl.constexpr):
    """Split K's deterministic sum: store this split's float32 partial vals [N] in slot s of part_ptr [SPLIT, N],
    count it in at counter_ptr -> (whether this program came last, the SPLIT partials summed in slot order: valid
    for the last one only, which also zeroes the counter for the next launch)."""
    n = tl.arange(0, N)
    tl.store(part_ptr + s * N + n, vals)
    tl.debug_barrier()  # every thread's stores before the count
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel") == SPLIT - 1
    total = tl.zeros((N,), dtype=tl.float32)
    if last:
        tl.atomic_xchg(counter_ptr, 0)
        for k in tl.static_range(SPLIT):
            total += tl.load(part_ptr + k * N + n, cache_modifier=".cg")
    return last, total


@triton.jit
def _x_step(x_row, gs_ptr, us_ptr, kb, H, QUANT: tl.constexpr, BLOCK_K: tl.constexpr):
    """What gate_up's K step kb reads besides the weights: x[t, kb * BLOCK_K ..] [BLOCK_K] (zero past H) and
    (fp8-block) the gate and up weight scales of the step (else 1)."""
    rk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    vals = tl.load(x_row + rk, mask=rk < H, other=0.0)
    if QUANT == 3:
        gs, us = tl.load(gs_ptr + kb), tl.load(us_ptr + kb)
    else:
        gs, us = 1.0, 1.0
    return vals, gs, us


@triton.jit
def _inter_step(inter_ptr, ws_tile, ws_rows, stride_w2se, ids, wts, a_scales, kk, t, st, steps, I,
                TOP_K: tl.constexpr, QUANT: tl.constexpr, BLOCK_K: tl.constexpr):
    """What down's step st (copy st // steps, its K step st % steps) reads besides the weights -> (expert,
    routing weight, inter[t * K + k, ..] [BLOCK_K] (zero past I), the weight scale (fp8-block: the tile's block;
    fp8-channel: its rows' [BLOCK_N], from ws_rows, the scales of expert 0 at the tile's rows; else 1), the copy's
    inter scale from a_scales [K_POW2] (fp8-channel; else 1)). inter is read through L2 (.cg): other programs of
    this launch wrote it."""
    k = st // steps
    e = tl.sum(tl.where(kk == k, ids, 0), axis=0)
    w_k = tl.sum(tl.where(kk == k, wts, 0.0), axis=0)
    rk = (st % steps) * BLOCK_K + tl.arange(0, BLOCK_K)
    vals = tl.load(inter_ptr + (t * TOP_K + k).to(tl.int64) * I + rk, mask=rk < I, other=0.0, cache_modifier=".cg")
    a_k = 1.0
    if QUANT == 3:
        ws = tl.load(ws_tile + e.to(tl.int64) * stride_w2se + st % steps)
    elif QUANT == 2:
        ws = tl.load(ws_rows + e.to(tl.int64) * stride_w2se)
        a_k = tl.sum(tl.where(kk == k, a_scales, 0.0), axis=0)
    else:
        ws = 1.0
    return e, w_k, vals, ws, a_k


@triton.jit
def _gate_up_item(item, x_ptr, ids_ptr, w13, w13s_ptr, inter_ptr, part1_ptr, ready_ptr, amax_ptr, split1_counts,
                  H, I, w13_rows, stride_x, stride_w13e, stride_w13n, stride_w13se, stride_w13sn,
                  TOP_K: tl.constexpr, QUANT: tl.constexpr, ACT: tl.constexpr, INTER_DTYPE: tl.constexpr,
                  BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr, SPLIT1: tl.constexpr, W13_TMA: tl.constexpr,
                  DOT_IEEE: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """Gate_up work item ``item``: copy c, columns j * BLOCK_N1 .., K steps of split s (_fused_layer_kernel)."""
    tiles1 = tl.cdiv(I, BLOCK_N1)
    tile = item // SPLIT1
    s = item % SPLIT1
    c = tile // tiles1
    j = tile % tiles1
    t = c // TOP_K
    e = tl.load(ids_ptr + c)
    cols = j * BLOCK_N1 + tl.arange(0, BLOCK_N1)
    g_rows = tl.minimum(cols, I - 1)
    x_row = x_ptr + t.to(tl.int64) * stride_x
    gs_ptr = w13s_ptr + e.to(tl.int64) * stride_w13se + (j * BLOCK_N1 // 128) * stride_w13sn
    us_ptr = gs_ptr + (I // 128) * stride_w13sn
    acc_g = tl.zeros((BLOCK_N1, 16), dtype=tl.float32)  # transposed: the weight rows are the dot's M
    acc_u = tl.zeros((BLOCK_N1, 16), dtype=tl.float32)
    x_scale = 1.0
    if QUANT == 2:  # per token: the row's scale from its amax over all of H, before the K loop
        x_scale = fp8_scale(_row_amax(x_row, H, BLOCK_K1))
    g_row0 = (e * w13_rows + j * BLOCK_N1).to(tl.int32)  # TMA: rows past I are never stored
    steps = tl.cdiv(H, BLOCK_K1)
    per = tl.cdiv(steps, SPLIT1)
    # the x values and scales each step needs are loaded one step ahead: Triton pipelines the weight tiles (the
    # dots' operands) but not these, which each step would otherwise wait on from L2
    x_next, gs_next, us_next = _x_step(x_row, gs_ptr, us_ptr, tl.minimum(s * per, steps - 1), H, QUANT, BLOCK_K1)
    for kb in range(s * per, tl.minimum((s + 1) * per, steps)):
        x_cur, gs, us = x_next, gs_next, us_next
        x_next, gs_next, us_next = _x_step(x_row, gs_ptr, us_ptr, tl.minimum(kb + 1, steps - 1), H, QUANT, BLOCK_K1)
        k0 = kb * BLOCK_K1
        xb, x_s = _row_operand(x_cur, x_scale, QUANT, ROUND_IN_FP32)
        wg = _weight_tile(w13, g_row0, g_rows, stride_w13e, stride_w13n, e, k0, H, W13_TMA, BLOCK_K1)
        wu = _weight_tile(w13, g_row0 + I, g_rows + I, stride_w13e, stride_w13n, e, k0, H, W13_TMA, BLOCK_K1)
        if QUANT == 3:  # 128 % BLOCK_N1 == 0: the tile's rows share one weight-scale block
            acc_g = _step(acc_g, wg, xb, x_s * gs, True, DOT_IEEE)
            acc_u = _step(acc_u, wu, xb, x_s * us, True, DOT_IEEE)
        elif QUANT == 2:  # fp16 dots of the fp8 values (exact): the row's and weight rows' scales come at the end
            acc_g = _step(acc_g, wg.to(tl.float16), xb.to(tl.float16), 1.0, False, DOT_IEEE)
            acc_u = _step(acc_u, wu.to(tl.float16), xb.to(tl.float16), 1.0, False, DOT_IEEE)
        else:
            acc_g = _step(acc_g, wg, xb, 1.0, False, DOT_IEEE)
            acc_u = _step(acc_u, wu, xb, 1.0, False, DOT_IEEE)
    g, u = _column0(acc_g), _column0(acc_u)
    if QUANT == 2:  # the row's scale times each weight row's
        ws_row = w13s_ptr + e.to(tl.int64) * stride_w13se
        g = g * (x_scale * tl.load(ws_row + g_rows * stride_w13sn))
        u = u * (x_scale * tl.load(ws_row + (g_rows + I) * stride_w13sn))
    finish = True
    if SPLIT1 > 1:  # the last split of the tile adds the partials and finishes it
        both = tl.reshape(tl.join(g, u), (2 * BLOCK_N1,))  # g0 u0 g1 u1 ...
        finish, both = _last_of(split1_counts + tile, part1_ptr + tile.to(tl.int64) * SPLIT1 * 2 * BLOCK_N1, s,
                                both, SPLIT1, 2 * BLOCK_N1)
        g, u = tl.split(tl.reshape(both, (BLOCK_N1, 2)))
    if finish:
        h = gated_act(g, u, ACT).to(INTER_DTYPE)
        tl.store(inter_ptr + c.to(tl.int64) * I + cols, h, mask=cols < I)
        if QUANT == 2:  # the copy's inter amax, over its rounded values: non-negative floats order as their bits
            amax = tl.max(tl.where(cols < I, tl.abs(h.to(tl.float32)), 0.0), axis=0)
            tl.atomic_max(amax_ptr + c, amax.to(tl.int32, bitcast=True), sem="relaxed")
        tl.debug_barrier()  # every thread's stores before the release below
        tl.atomic_add(ready_ptr + c, 1, sem="release")


@triton.jit
def _down_item(d, ids_ptr, rw_ptr, w2, w2s_ptr, inter_ptr, part2_ptr, out_ptr, sync_ptr, ready_ptr, amax_ptr,
               split2_counts, T, H, I, w2_rows, stride_w2e, stride_w2n, stride_w2se, stride_w2sn, stride_out,
               TOP_K: tl.constexpr, K_POW2: tl.constexpr, QUANT: tl.constexpr, BLOCK_N1: tl.constexpr,
               BLOCK_N2: tl.constexpr, BLOCK_K2: tl.constexpr, SPLIT2: tl.constexpr, W2_TMA: tl.constexpr,
               DOT_IEEE: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """Down work item ``d`` (counted from the first down item): token t, columns j * BLOCK_N2 .., split s of the K
    copies' steps (k-major) (_fused_layer_kernel)."""
    tiles1 = tl.cdiv(I, BLOCK_N1)
    tiles2 = tl.cdiv(H, BLOCK_N2)
    tile = d // SPLIT2
    s = d % SPLIT2
    t = tile // tiles2
    j = tile % tiles2
    cols = j * BLOCK_N2 + tl.arange(0, BLOCK_N2)
    n_rows = tl.minimum(cols, H - 1)
    kk = tl.arange(0, K_POW2)
    ids = tl.load(ids_ptr + t * TOP_K + kk, mask=kk < TOP_K, other=0)
    wts = tl.load(rw_ptr + t * TOP_K + kk, mask=kk < TOP_K, other=0.0)
    steps = tl.cdiv(I, BLOCK_K2)
    per = tl.cdiv(TOP_K * steps, SPLIT2)
    k_lo = tl.minimum(s * per, TOP_K * steps - 1) // steps
    k_hi = tl.minimum((s + 1) * per, TOP_K * steps) - 1
    for k in range(k_lo, tl.maximum(k_hi // steps + 1, k_lo)):  # the copies this split reads: each one's gate_up done
        ready = tl.atomic_add(ready_ptr + t * TOP_K + k, 0, sem="acquire")
        while ready < tiles1:
            ready = tl.atomic_add(ready_ptr + t * TOP_K + k, 0, sem="acquire")
    a_scales = tl.zeros((K_POW2,), dtype=tl.float32)
    if QUANT == 2:  # each copy's inter scale; the counters of the copies read here are final after the waits
        bits = tl.load(amax_ptr + t * TOP_K + kk, mask=kk < TOP_K, other=0, cache_modifier=".cg")
        a_scales = fp8_scale(bits.to(tl.float32, bitcast=True))
    acc = tl.zeros((BLOCK_N2, 16), dtype=tl.float32)  # transposed, as gate_up's
    ws_tile = w2s_ptr + (j * BLOCK_N2 // 128) * stride_w2sn  # 128 % BLOCK_N2 == 0: one weight-scale block row
    ws_rows = w2s_ptr + n_rows * stride_w2sn  # fp8-channel: the tile's rows' scales (plus the expert's offset)
    last = TOP_K * steps - 1
    # copy st // steps, its K step st % steps; its inter values and weight scale loaded one step ahead (as gate_up's)
    e_next, w_next, v_next, ws_next, a_next = _inter_step(inter_ptr, ws_tile, ws_rows, stride_w2se, ids, wts, a_scales,
                                                          kk, t, tl.minimum(s * per, last), steps, I, TOP_K, QUANT,
                                                          BLOCK_K2)
    for st in range(s * per, tl.minimum((s + 1) * per, last + 1)):
        e, w_k, vals, ws, a_k = e_next, w_next, v_next, ws_next, a_next
        e_next, w_next, v_next, ws_next, a_next = _inter_step(inter_ptr, ws_tile, ws_rows, stride_w2se, ids, wts,
                                                              a_scales, kk, t, tl.minimum(st + 1, last), steps, I,
                                                              TOP_K, QUANT, BLOCK_K2)
        k0 = (st % steps) * BLOCK_K2
        ab, a_s = _row_operand(vals, a_k, QUANT, ROUND_IN_FP32)
        wt = _weight_tile(w2, (e * w2_rows + j * BLOCK_N2).to(tl.int32), n_rows, stride_w2e, stride_w2n, e, k0, I,
                          W2_TMA, BLOCK_K2)
        if QUANT == 3:
            acc = _step(acc, wt, ab, w_k * a_s * ws, True, DOT_IEEE)
        elif QUANT == 2:  # the step's rows belong to copy k's expert: its row scales, one a weight row; fp16 dot
            acc = _step(acc, wt.to(tl.float16), ab.to(tl.float16), ((w_k * a_s) * ws)[:, None], True, DOT_IEEE)
        else:  # the routing weight scales each of the copy's step products
            acc = _step(acc, wt, ab, w_k, True, DOT_IEEE)
    y = _column0(acc)
    finish = True
    if SPLIT2 > 1:
        finish, y = _last_of(split2_counts + tile, part2_ptr + tile.to(tl.int64) * SPLIT2 * BLOCK_N2, s, y, SPLIT2,
                             BLOCK_N2)
    if finish:
        tl.store(out_ptr + t.to(tl.int64) * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=cols < H)
        done = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel")
        if done == T * tiles2 - 1:  # the last tile: every ticket is taken and every count read
            tl.atomic_xchg(sync_ptr, 0)
            tl.atomic_xchg(sync_ptr + 1, 0)
            n_reset = T * TOP_K * (2 if QUANT == 2 else 1)  # the copies' counts (and fp8-channel's inter amaxes)
            for c0 in range(0, n_reset, 128):  # amax_ptr follows ready_ptr: one range
                cc = c0 + tl.arange(0, 128)
                tl.store(ready_ptr + cc, tl.zeros((128,), dtype=tl.int32), mask=cc < n_reset)


@triton.jit(do_not_specialize=["T"])
def _fused_layer_kernel(
        x_ptr, ids_ptr, rw_ptr, w13, w13s_ptr, w2, w2s_ptr, inter_ptr, part1_ptr, part2_ptr, out_ptr, sync_ptr,
        T, H, I, w13_rows, w2_rows,
        stride_x, stride_w13e, stride_w13n, stride_w13se, stride_w13sn, stride_w2e, stride_w2n, stride_w2se,
        stride_w2sn, stride_out,
        TOP_K: tl.constexpr, K_POW2: tl.constexpr, QUANT: tl.constexpr, ACT: tl.constexpr,
        INTER_DTYPE: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr, SPLIT1: tl.constexpr,
        BLOCK_N2: tl.constexpr, BLOCK_K2: tl.constexpr, SPLIT2: tl.constexpr, W13_TMA: tl.constexpr,
        W2_TMA: tl.constexpr, DOT_IEEE: tl.constexpr, ROUND_IN_FP32: tl.constexpr, PDL: tl.constexpr = False):
    """The fused layer (module docstring), one program per work item, items taken in the order programs start (a
    ticket from the atomic counter sync_ptr[0]):
      gate_up items (copy c = t * K + k, column tile j, K split s): inter[c, j*BLOCK_N1 ..] = act(x[t] @ W_gate[e].T)
        * (x[t] @ W_up[e].T) rounded to the layer dtype, e = topk_ids[c]; then ready[c] += 1 (release).
      down items (token t, column tile j, split s of the K copies' steps, k-major): wait until ready[c] ==
        cdiv(I, BLOCK_N1) for each copy c they read (acquire), then out[t, j*BLOCK_N2 ..] = sum_k w[t, k] *
        (inter[t*K + k] @ W_down[e_k].T), one fp32 K loop over the copies' steps, rounded once.
    A program waits only on items whose tickets were taken before its own, by programs already running, so the
    launch cannot deadlock whatever order the GPU starts programs in (the CPU interpreter, which runs programs one
    after another, never waits). The last down tile to finish zeroes the counters for the next launch.
    fp8-block: each 1x128 group of x (gate_up) and of inter (down) is quantized inside the K step that reads it,
    the bits rows/quant.quantize_groups gives; inter stays in the layer dtype. fp8-channel: x[t] with its row's
    scale (each gate_up item takes the row's amax over all of H before its K loop); each copy's inter row with its
    own, from the amax of its rounded values, which the gate_up items fold into amax[c] (an atomic max of the
    float's bits) before they count their tile in; the weights' per-row scales multiply the products (gate_up at
    the end, down each step: a step's rows belong to one copy's expert). Its dots run in fp16 on the fp8 values
    (exact products, fp32 sums): with one scale a row, the row's largest value decides its whole quantization, and
    the fp8 dot's narrower accumulator moves that value's rounding. Scheme none: plain dots (float32: IEEE).
    Each dot is transposed, weights [BLOCK_N, BLOCK_K] times the token's row broadcast into 16 columns [BLOCK_K, 16]:
    the weight tile is the A operand, so tiles of 64 rows or more run as Hopper wgmma from shared memory (fp8
    included; a 16-row A of tokens would be mma.sync, whose fp8 operands Triton converts to fp16 first), on the
    tensor cores (CUDA-core GEMV or FMA K loops are no faster on bf16 and slower on fp8).

    sync_ptr int32, zero at launch (counters_size): [0] tickets taken, [1] down tiles done, [2 + c] copy c's
    finished gate_up tiles (ready_ptr), [2 + T * K + c] copy c's inter amax (amax_ptr; fp8-channel: float32 bits),
    then (SPLIT1 > 1) one count per gate_up tile (split1_counts), then (SPLIT2 > 1) one per down tile.
    inter_ptr [T * K, I] scratch in the layer dtype; part1_ptr [gate_up tiles, SPLIT1, 2 * BLOCK_N1] and part2_ptr
    [down tiles, SPLIT2, BLOCK_N2] float32 split-K partials (unused without split; summed in split order,
    deterministic: _last_of). Grid: one program per work item, T * K * cdiv(I, BLOCK_N1) * SPLIT1 +
    T * cdiv(H, BLOCK_N2) * SPLIT2."""
    pdl_wait(PDL)
    tiles1 = tl.cdiv(I, BLOCK_N1)
    items1 = T * TOP_K * tiles1 * SPLIT1
    ready_ptr = sync_ptr + 2  # the regions of sync_ptr, named once (docstring above)
    amax_ptr = ready_ptr + T * TOP_K
    split1_counts = amax_ptr + T * TOP_K
    split2_counts = split1_counts + (T * TOP_K * tiles1 if SPLIT1 > 1 else 0)
    item = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    if item < items1:
        _gate_up_item(item, x_ptr, ids_ptr, w13, w13s_ptr, inter_ptr, part1_ptr, ready_ptr, amax_ptr, split1_counts,
                      H, I, w13_rows, stride_x, stride_w13e, stride_w13n, stride_w13se, stride_w13sn, TOP_K, QUANT,
                      ACT, INTER_DTYPE, BLOCK_N1, BLOCK_K1, SPLIT1, W13_TMA, DOT_IEEE, ROUND_IN_FP32)
    else:
        _down_item(item - items1, ids_ptr, rw_ptr, w2, w2s_ptr, inter_ptr, part2_ptr, out_ptr, sync_ptr, ready_ptr,
                   amax_ptr, split2_counts, T, H, I, w2_rows, stride_w2e, stride_w2n, stride_w2se, stride_w2sn,
                   stride_out, TOP_K, K_POW2, QUANT, BLOCK_N1, BLOCK_N2, BLOCK_K2, SPLIT2, W2_TMA, DOT_IEEE,
                   ROUND_IN_FP32)
    pdl_launch(PDL)


def counters_size(tokens: int, top_k: int, hidden: int, inter: int, cfg) -> int:
    """int32 counters a launch of ``tokens`` tokens with FusedConfig ``cfg`` needs (the kernel's sync_ptr)."""
    n = 2 + 2 * tokens * top_k
    if cfg.split1 > 1:
        n += tokens * top_k * cdiv(inter, cfg.block_n1)
    if cfg.split2 > 1:
        n += tokens * cdiv(hidden, cfg.block_n2)
    return n


def fused_layer(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: Tensor, w13_scale: Tensor | None, w2: Tensor,
                w2_scale: Tensor | None, scheme: str, activation: str, dtype: torch.dtype, cfg, sync: Tensor,
                poison: bool = False) -> Tensor:
    """x [T, H] ``dtype`` (columns contiguous), topk_ids [T, K] int32, topk_weights [T, K] float32, w13 [E, 2I, H],
    w2 [E, H, I] (scheme none: ``dtype``; fp8-block: float8_e4m3fn with scales [E, 2I/128, H/128], [E, H/128, I/128];
    fp8-channel: float8_e4m3fn with scales [E, 2I], [E, H])
    -> out [T, H] ``dtype`` (module docstring). cfg: a FusedConfig (configs.py). sync: int32 [counters_size(...)] or
    longer, zero, owned by the caller (launches that overlap must not share it); the launch leaves it zero.
    poison: fill the intermediate and the output with NaN first (tests)."""
    from ..common import ACT_CODES
    t, h = x.shape
    k = topk_ids.shape[1]
    i = w2.shape[2]
    q = QUANT_CODES[scheme]
    fill = torch.full if poison else (lambda shape, _v, **kw: torch.empty(shape, **kw))
    out = fill((t, h), float("nan"), dtype=dtype, device=x.device)
    if t == 0 or h == 0:
        return out.zero_()
    if sync.numel() < counters_size(t, k, h, i, cfg):
        raise ValueError(f"sync holds {sync.numel()} counters; this launch needs {counters_size(t, k, h, i, cfg)}")
    inter = fill((t * k, i), float("nan"), dtype=dtype, device=x.device)
    tiles1, tiles2 = t * k * cdiv(i, cfg.block_n1), t * cdiv(h, cfg.block_n2)
    part1 = fill((tiles1, cfg.split1, 2 * cfg.block_n1), float("nan"), dtype=torch.float32, device=x.device) \
        if cfg.split1 > 1 else out
    part2 = fill((tiles2, cfg.split2, cfg.block_n2), float("nan"), dtype=torch.float32, device=x.device) \
        if cfg.split2 > 1 else out
    w13_arg, w13_rows = weight_operand(w13, cfg.block_n1, cfg.block_k1)
    w2_arg, w2_rows = weight_operand(w2, cfg.block_n2, cfg.block_k2)
    s13 = w13_scale if w13_scale is not None else w13
    s2 = w2_scale if w2_scale is not None else w2
    _fused_layer_kernel[(tiles1 * cfg.split1 + tiles2 * cfg.split2,)](
        x, topk_ids, topk_weights, w13_arg, s13, w2_arg, s2, inter, part1, part2, out, sync,
        t, h, i, w13_rows, w2_rows,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0) if q else 0, s13.stride(1) if q else 0,
        w2.stride(0), w2.stride(1), s2.stride(0) if q else 0, s2.stride(1) if q else 0, out.stride(0),
        TOP_K=k, K_POW2=max(2, next_pow2(k)), QUANT=q, ACT=ACT_CODES[activation],
        INTER_DTYPE=_TL_DTYPE[dtype], BLOCK_N1=cfg.block_n1, BLOCK_K1=cfg.block_k1, SPLIT1=cfg.split1,
        BLOCK_N2=cfg.block_n2, BLOCK_K2=cfg.block_k2, SPLIT2=cfg.split2, W13_TMA=w13_arg is not w13,
        W2_TMA=w2_arg is not w2, DOT_IEEE=dtype == torch.float32 and q == 0, ROUND_IN_FP32=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl(x.device, early_start=False))
    return out


def fused_layer_torch(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: Tensor, w13_scale: Tensor | None,
                      w2: Tensor, w2_scale: Tensor | None, scheme: str, activation: str, dtype: torch.dtype) -> Tensor:
    """Reference of fused_layer, float32 math in its order: each copy's gate_up from x[t] (fp8-block: its groups
    quantized; fp8-channel: the row), act(gate) * up rounded to ``dtype``, down (inter quantized the same way), times
    the routing weight, summed over k in k order, rounded once -> [T, H] ``dtype``. Row-wise quantization only
    (FUSED_SCHEMES): a copy quantized alone gives what it gives among the others."""
    from ...experts.base import gated_activation
    from ...quant import create_scheme
    sch = create_scheme(scheme)
    t, k = topk_ids.shape
    fq = (lambda v: sch.fake_quantize_activation(v).float()) if sch.quantized else (lambda v: v.float())
    xq = fq(x)
    copies = torch.zeros(k, t, w2.shape[1], dtype=torch.float32, device=x.device)  # [K, T, H]: copy kk of token t
    ids = topk_ids.long()
    for e in ids.unique().tolist():  # one expert's weights in float32 at a time
        kk, tok = (ids.T == e).nonzero(as_tuple=True)
        inter = gated_activation(xq[tok] @ sch.dequantize_expert(w13, w13_scale, e).T, activation).to(dtype)
        down = fq(inter) @ sch.dequantize_expert(w2, w2_scale, e).T
        copies[kk, tok] = down * topk_weights[tok, kk].float()[:, None]
    out = torch.zeros(t, w2.shape[1], dtype=torch.float32, device=x.device)
    for kk in range(k):  # summed in k order
        out += copies[kk]
    return out.to(dtype)
