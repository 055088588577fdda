"""Search kernel configs for one shape on the current GPU (behind `moeflow tune`).

For each token count T (tune()): every gate_up and every down candidate (candidates()) is timed alone on sorted
batches of T * top_k copies with uniform random routing, and the fastest whose output passes tune/verify.py wins.
Timing (graph_time_ms) replays a CUDA graph of the GEMM launched back to back on batches_for(T) batches of
different routing, as the layer runs them: from a graph (no host launch time), weights cold. Small single-process
batches (tune/fused.py) also time the one-launch layer against the separate launches.
Candidates are compiled first in parallel worker processes (precompile; Triton's on-disk cache is shared).
"""
from __future__ import annotations

import math
import os
from concurrent.futures import ProcessPoolExecutor

import torch

from ..errors import error
from ..kernels.configs import FusedConfig, GemmConfig, MoEKernelConfig
from ..kernels.gemm.tiles import fit
from ..layouts import SORTED, ExpertBatch
from ..quant import FP8_DTYPE, create_scheme
from . import verify
from .fused import (
    FUSED_MAX_REL_ERR,
    fused_candidates,
    fused_searched,
    layer_times,
    pick_fused,
    usable,
)
from .timing import Shape, graph_time_ms

# the warp-specialized fp8-block down (gemm/warp_specialized.py): 64 x 128 tiles, 5-7 stages (4 and 8 run slower);
# and its wide 64 x 256 tiles in quarters (4-5 stages of 40 KB), for large T
WS_FP8_DOWN = ([GemmConfig(64, 128, 128, 8, 4, s, warp_specialize=1) for s in (5, 6, 7)]
               + [GemmConfig(64, 256, 128, g, 4, s, warp_specialize=1) for g, s in ((8, 4), (8, 5), (16, 4))])
# the warp-specialized fp8-block gate_up: 64 x 128 tiles, 4-5 stages of 40 KB (it pays on short K loops; longer
# ones favour the per-tile Gluon kernel's 128-row tiles)
WS_FP8_GATE_UP = [GemmConfig(64, 128, 128, g, 4, s, warp_specialize=1) for g, s in ((8, 4), (16, 4), (8, 5))]
# its 128 x 128 tiles shared by the two consumers (COOP), 3 stages: for many rows an expert (large T)
WS_FP8_GATE_UP_COOP = [GemmConfig(128, 128, 128, g, 4, 3, warp_specialize=1) for g in (8, 16)]
# the wide down at 128 x 256 shared by the two consumers (COOP), 3 stages (4 run slower): for large T
WS_FP8_DOWN_COOP = [GemmConfig(128, 256, 128, g, 4, 3, warp_specialize=1) for g in (8, 16)]
# bf16 / fp16 (BLOCK_K 64): the tiles a consumer by turns, 128 x 64 gate_up and 128 x 128 down, 5-6 stages; the
# 64 x 128 gate_up by turns (5 stages) and the COOP tiles of 256 accumulator columns (the two consumers 64 rows each:
# the 128 x 128 gate_up, the 128 x 256 down), 3-4 stages of 48 KB
WS_BF16_GATE_UP = ([GemmConfig(128, 64, 64, 8, 4, s, warp_specialize=1) for s in (5, 6)]
                   + [GemmConfig(64, 128, 64, 8, 4, 5, warp_specialize=1)]
                   + [GemmConfig(128, 128, 64, g, 4, s, warp_specialize=1) for g, s in ((8, 3), (8, 4), (16, 4))])
WS_BF16_DOWN = ([GemmConfig(128, 128, 64, 8, 4, s, warp_specialize=1) for s in (5, 6)]
                + [GemmConfig(128, 256, 64, g, 4, 4, warp_specialize=1) for g in (8, 16)])


def candidates(shape: Shape, tokens: int, budget: int | None = None) -> tuple[list[GemmConfig], list[GemmConfig]]:
    """(gate_up candidates, down candidates) for T = tokens, fitted (to ``budget`` bytes of shared memory: the GPU's
    Target.tile_budget, moeflow.targets; None: Hopper's) and deduplicated.
    Rows per expert m = T * top_k / E picks the family: weight streaming (m <= 16), middle, large tiles.
    Down candidates with programs_per_sm > 0 time the persistent down kernel; candidates of either
    GEMM with split_k > 1 (decode) the split K loop and its sum."""
    m = tokens * shape.top_k / shape.num_experts
    bk = 128 if shape.scheme != "none" else 64
    if m <= 16:
        # narrow N tiles: more programs streaming weights (fp8-block gate_up below 128: unfused quantization);
        # deep pipelines keep more bytes in flight per program where fp8-block caps BLOCK_K at 128
        base = [GemmConfig(16, bn, k, 1, 4, s) for bn, k, s in ((32, 128, 4), (64, 128, 4), (64, 256, 3), (128, 128, 3),
                                                               (32, 256, 4), (16, 128, 4), (16, 256, 4), (32, 128, 8),
                                                               (64, 128, 6), (16, 128, 8))]
        # also split over K: more programs when few experts' tiles carry long K loops (Mixtral's down:
        # 2 experts x 4096 / 64 tiles over I = 14336 at T=1; Qwen3's gate_up: 8 experts x 768 / 64)
        gu = base + [GemmConfig(16, bn, 128, 1, 4, s, 0, sk) for bn, s, sk in ((64, 4, 2), (64, 4, 4), (128, 3, 2),
                                                                               (32, 4, 2))]
        dn = base + [GemmConfig(16, bn, 128, 1, 4, s, 0, sk) for bn, s, sk in ((64, 6, 2), (128, 4, 2), (64, 6, 4),
                                                                               (128, 4, 4))]
        # tiles computed transposed (swap_ab): the weight rows the wgmma's M, the block's 16 rows its N
        swapped = [GemmConfig(16, bn, 128, 1, 4, s, swap_ab=1) for bn, s in ((64, 4), (64, 6), (128, 3), (128, 4))]
        gu, dn = gu + _precise(swapped, shape.scheme), dn + _precise(swapped, shape.scheme)
    elif m <= 96:
        gu = [GemmConfig(bm, bn, k, 4, w, s) for bm, bn, k, w, s in
              ((32, 64, 128, 4, 4), (32, 128, 128, 4, 3), (64, 64, bk, 4, 4), (64, 128, bk, 8, 3), (16, 64, 128, 4, 4),
               (16, 128, 128, 4, 4))]
        dn = [GemmConfig(bm, bn, k, 4, w, s, p) for bm, bn, k, w, s, p in
              ((32, 64, 128, 4, 4, 0), (32, 128, 128, 4, 3, 0), (64, 64, bk, 4, 4, 0), (64, 128, bk, 4, 4, 0),
               (16, 128, 128, 4, 4, 0), (64, 128, bk, 4, 4, 2))]
        # transposed tiles (swap_ab): blocks of 16-32 rows as the wgmma's N, no 64-row padding
        swapped = [GemmConfig(bm, bn, 128, 4, 4, s, swap_ab=1) for bm, bn, s in
                   ((32, 64, 4), (32, 128, 3), (32, 128, 4), (16, 128, 4))]
        gu, dn = gu + _precise(swapped, shape.scheme), dn + _precise(swapped, shape.scheme)
        if shape.scheme == "fp8-block":  # the persistent Gluon down (gemm/down_wgmma_persistent.py)
            dn.append(GemmConfig(64, 128, 128, 4, 4, 4, 2, scale_overlap=2))
            dn += WS_FP8_DOWN
            # the Gluon gate_up at 64 rows (gemm/gate_up_wgmma.py): faster than the Triton tiles on some shapes,
            # slower on others
            gu += [GemmConfig(64, 128, 128, g, 4, s, scale_overlap=1) for g, s in ((4, 4), (8, 4), (8, 5))]
            gu += WS_FP8_GATE_UP
        if shape.scheme == "none":  # the warp-specialized Gluon kernels (gemm/warp_specialized.py)
            gu += WS_BF16_GATE_UP
            dn += WS_BF16_DOWN
    else:  # registers: gate_up holds two accumulators, so its big tiles need 8 warps (ptxas: no spills)
        gu = [GemmConfig(bm, bn, k, 8, w, s) for bm, bn, k, w, s in
              ((64, 128, bk, 8, 4), (64, 128, bk, 8, 3), (128, 64, bk, 8, 4), (128, 128, 64, 8, 3), (64, 64, bk, 4, 4),
               (32, 128, 128, 4, 3), (128, 128, bk, 8, 3), (128, 128, 64, 8, 4), (128, 128, bk, 8, 4))]
        dn = [GemmConfig(bm, bn, k, 8, w, s, p) for bm, bn, k, w, s, p in
              ((128, 128, bk, 8, 3, 0), (64, 256, bk, 8, 3, 0), (128, 256, 64, 8, 3, 0), (64, 128, bk, 4, 4, 0),
               (128, 64, bk, 4, 4, 0), (64, 128, bk, 4, 4, 2), (128, 128, bk, 8, 4 if bk == 64 else 3, 1))]
        if shape.scheme == "none":  # token rows through TMA: a gathered copy first, 172 registers instead of 255
            gu += [GemmConfig(128, 128, 64, 8, 8, s, x_tma=1) for s in (3, 4)]
            gu += WS_BF16_GATE_UP  # gemm/warp_specialized.py
            dn += WS_BF16_DOWN
        if shape.scheme == "fp8-block":  # the Gluon K loops that overlap the scaling (gemm/*_wgmma.py)
            gu += [GemmConfig(128, 128, 128, 8, 8, s, scale_overlap=1) for s in (3, 4)] + WS_FP8_GATE_UP
            gu += WS_FP8_GATE_UP_COOP
            dn += [GemmConfig(bm, 128, 128, 8, w, s, p, scale_overlap=so) for bm, w, s, p, so in
                   ((128, 8, 4, 0, 1), (128, 8, 4, 0, 2), (128, 8, 3, 0, 1), (64, 4, 4, 0, 2),
                    (64, 4, 4, 2, 2), (64, 4, 3, 2, 2), (128, 8, 4, 1, 2))]  # p > 0: down_wgmma_persistent.py
            dn += WS_FP8_DOWN + WS_FP8_DOWN_COOP
    nbytes = 1 if shape.scheme != "none" else shape.dtype.itemsize

    def fitted(cfgs, pair, n):
        out = []
        for c in cfgs:
            f = fit(c, fused_pair=pair, scheme=shape.scheme, elem_bytes=nbytes, n_size=n,
                    **({} if budget is None else dict(budget=budget)))
            if f not in out:
                out.append(f)
        return out

    return fitted(gu, True, shape.inter), fitted(dn, False, shape.hidden)


def _precise(swapped: list[GemmConfig], scheme: str) -> list[GemmConfig]:
    """The swapped candidates the tuner may time for ``scheme``: none for fp8-tensor and fp8-channel. A swapped fp8
    tile is an fp8 wgmma, whose accumulator keeps fewer bits than float32; fp8-block adds each 128-deep step's
    product into a float32 sum, but the per-tensor and per-channel schemes accumulate their whole K loop inside the
    wgmma: swapped, fp8-tensor's gate_up error against float64 grows noticeably (fp8-block's does not), for layer
    gains of a percent at most. The unswapped 16-row tiles they would replace run mma.sync on operands converted to
    fp16, with float32 sums."""
    return [] if scheme in ("fp8-tensor", "fp8-channel") else swapped


def random_weights(shape: Shape, device, seed: int = 0, chunk: int = 8, chunk_bytes: int = 512 << 20):
    """ExpertWeights of random values (uniform ±1/sqrt(fan_in), as MoE.reset_parameters), quantized
    by the scheme a few experts at a time: at most ``chunk``, and at most ``chunk_bytes`` of high-precision draw
    (FP8 quantization makes several float32 copies of what it is given: whole-tensor quantization of DeepSeek-V3's
    experts would need ~100 GB of temporaries)."""
    from ..experts.base import ExpertWeights
    gen = torch.Generator(device=device).manual_seed(seed)
    sch = create_scheme(shape.scheme)
    e, h, i = shape.num_experts, shape.hidden, shape.inter
    out = []
    for n, k in ((2 * i, h), (h, i)):
        q = torch.empty((e, n, k), dtype=FP8_DTYPE if sch.quantized else shape.dtype, device=device)
        s = torch.empty(sch.weight_scale_shape(e, n, k), dtype=torch.float32, device=device) if sch.quantized else None
        step = max(1, min(chunk, chunk_bytes // max(1, n * k * shape.dtype.itemsize)))
        for lo in range(0, e, step):
            w = torch.empty((min(step, e - lo), n, k), dtype=shape.dtype, device=device)
            w.uniform_(-1, 1, generator=gen).mul_(1 / math.sqrt(k))
            wq, ws = sch.quantize_weight(w)
            q[lo:lo + len(w)] = wq
            if s is not None:
                s[lo:lo + len(w)] = ws
        out += [q, s]
    return ExpertWeights(out[0], out[2], out[1], out[3])


def random_routing(shape: Shape, tokens: int, device, seed: int = 0):
    """-> (x [T, H] shape.dtype, topk_ids [T, top_k] int32: distinct experts, uniform at random, topk_weights
    [T, top_k] float32 uniform in [0, 1)), as a router hands them to the layer."""
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(tokens, shape.num_experts, generator=gen, device=device).topk(shape.top_k, dim=1).indices
    x = torch.randn(tokens, shape.hidden, generator=gen, device=device).to(shape.dtype)
    w = torch.rand(tokens, shape.top_k, generator=gen, device=device)
    return x, ids.to(torch.int32), w


def sorted_batch(shape: Shape, x, topk_ids, topk_weights, indexed: bool = False) -> ExpertBatch:
    """The sorted batch of a routing's T * top_k copies (x [T, H], topk_ids [T, top_k], topk_weights [T, top_k]);
    indexed: its rows given by index (hidden the T tokens, source_rows [T * top_k], copy_rows [T, top_k]), as the
    local dispatcher hands them."""
    from ..dispatch.expert_sort import (
        sort_by_expert_torch,  # the local dispatcher's sort, in torch
    )
    offsets, counts, copy_rows, source, sorted_w = sort_by_expert_torch(topk_ids, topk_weights, shape.num_experts)
    if indexed:
        return ExpertBatch(SORTED, x, sorted_w, counts, offsets, source_rows=source, copy_rows=copy_rows)
    return ExpertBatch(SORTED, x[source], sorted_w, counts, offsets)


def random_batch(shape: Shape, tokens: int, device, seed: int = 0, indexed: bool = False) -> ExpertBatch:
    """sorted_batch of random_routing(shape, tokens, device, seed)."""
    return sorted_batch(shape, *random_routing(shape, tokens, device, seed), indexed=indexed)


def tuner_routings(shape: Shape, tokens: int, device) -> list:
    """The routings tune() times T = tokens on: batches_for(T) of random_routing's, seeded by T and the batch."""
    return [random_routing(shape, tokens, device, seed=tokens * 1000 + b) for b in range(batches_for(tokens))]


def gemm_inputs(shape: Shape, routings: list, indexed_rows: bool) -> list:
    """Per routing (random_routing's triple), what tune() feeds gate_up: (ExpertBatch, RowLayout, x [R or T, H] as
    the scheme quantizes it, its scale or None). indexed_rows: the batch's rows by index and the tokens quantized
    once (the local sort's launch does it in the layer), else rows in order, quantized per row."""
    from ..kernels.common import RowLayout
    from ..kernels.rows.quant import quantize_activation, quantize_rows
    inputs = []
    for r in routings:
        batch = sorted_batch(shape, *r, indexed=indexed_rows)
        layout = RowLayout.of(batch)
        if shape.scheme == "none":
            xq, xs = batch.hidden, None
        elif indexed_rows:
            xq, xs = quantize_activation(batch.hidden, shape.scheme)
        else:
            xq, xs = quantize_rows(batch.hidden, shape.scheme, layout)
        inputs.append((batch, layout, xq, xs))
    return inputs


def _layer_parts(shape: Shape):
    """-> (the local dispatcher handing rows by index, the triton runner) of a single-process layer of this shape."""
    from ..config import MoEConfig
    from ..dispatch import create_dispatcher
    from ..experts.triton import TritonRunner
    cfg = MoEConfig(num_experts=shape.num_experts, hidden_size=shape.hidden, intermediate_size=shape.inter,
                    top_k=shape.top_k, quant=shape.scheme, dtype=shape.dtype)
    scheme = create_scheme(shape.scheme)
    return create_dispatcher("local", cfg, scheme, indexed_rows=True), TritonRunner(cfg, scheme)


def expanded_weights(shape: Shape, device):
    """Weights of shape.num_experts experts that are all one random expert (expert stride 0):
    the same kernel specialization as real weights, 1/E of the memory. For compiling, not timing."""
    from ..experts.base import ExpertWeights
    one = random_weights(Shape(1, shape.hidden, shape.inter, 1, shape.scheme, shape.dtype), device)
    e = shape.num_experts
    return ExpertWeights(*(None if t is None else t.expand(e, *t.shape[1:])
                           for t in (one.w13, one.w2, one.w13_scale, one.w2_scale)))


def _compile_job(jobs: list[tuple[Shape, MoEKernelConfig | FusedConfig, bool]]) -> int:
    """Worker: run each (shape, configs, rows by index) once on a 1-token batch: a MoEKernelConfig's GEMMs with
    every copy routed to expert 0, a FusedConfig's one launch (rows by index always) on a random routing."""
    dev = torch.device("cuda")
    for shape, cfg, indexed in jobs:
        w = expanded_weights(shape, dev)
        runner = _layer_parts(shape)[1]
        if isinstance(cfg, FusedConfig):
            x, ids, rw = random_routing(shape, 1, dev)
            runner.run_fused(x, ids, rw, w, cfg)
            continue
        batch = random_batch(shape, 1, dev, indexed=indexed)
        batch.offsets = torch.zeros_like(batch.offsets)
        batch.offsets[1:] = batch.weights.numel()  # every copy to expert 0, the only real one
        runner.run_with(batch, w, cfg)
    torch.cuda.synchronize()
    return len(jobs)


def precompile(jobs: list[tuple[Shape, MoEKernelConfig | FusedConfig, bool]], workers: int | None = None) -> None:
    """Compile the kernels of every (shape, configs, rows by index) in worker processes (fills Triton's on-disk
    cache, which the timing process then reads): a MoEKernelConfig's two GEMMs, a FusedConfig's one launch."""
    import multiprocessing as mp
    jobs = sorted(set(jobs), key=str)
    if not jobs:
        return
    workers = workers or max(1, min(12, (os.cpu_count() or 2) - 2, len(jobs)))
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_compile_job, [jobs[i::workers] for i in range(workers)]))


def batches_for(tokens: int) -> int:
    """Batches of different routing a timing graph cycles through: several for small T (one launch
    then touches only T * top_k experts' weights, which another batch's launch must not find in
    L2), one for large T (a launch streams every expert; its run time hides what L2 keeps)."""
    return 8 if tokens <= 128 else 4 if tokens <= 1024 else 1


def covering_pairs(gate_up_cfgs: list[GemmConfig], down_cfgs: list[GemmConfig]) -> list[MoEKernelConfig]:
    """Pairs of the two GEMMs' candidates in which each candidate of either appears at least once (precompile's jobs:
    one layer run compiles both of a pair's kernels)."""
    n_gu, n_dn = len(gate_up_cfgs), len(down_cfgs)
    return [MoEKernelConfig(gate_up_cfgs[min(j, n_gu - 1)], down_cfgs[min(j, n_dn - 1)]) for j in range(max(n_gu, n_dn))]


def gemm_runners(shape: Shape, weights):
    """(run_gate_up, run_down): the two GEMMs as tune() times them, on ExpertWeights ``weights``.
    run_gate_up(cfg, (batch, layout, x, x scale)) (gemm_inputs' tuple; rows by index where the batch has them) -> what
    the down takes: (inter, extra), for fp8-block its 1x128 groups quantized (narrow tiles add the separate group
    quantization, as the runner does); run_down(cfg, a, a_scale, route_w, layout) -> out [R, H]."""
    from ..kernels.gemm.down import down
    from ..kernels.gemm.gate_up import gate_up
    from ..kernels.rows.quant import down_input

    def run_gate_up(c, inp):
        batch, layout, xq, xs = inp
        inter, extra = gate_up(xq, xs, weights.w13, weights.w13_scale, layout, shape.scheme, "silu", shape.dtype, c,
                               source_rows=batch.source_rows)
        return down_input(inter, extra, shape.scheme) if shape.scheme == "fp8-block" else (inter, extra)

    def run_down(c, a, a_s, route_w, layout):
        return down(a, a_s, weights.w2, weights.w2_scale, route_w, layout, shape.scheme, shape.dtype, c)

    return run_gate_up, run_down


def gemm_checks(shape: Shape, weights):
    """(check_gate_up, check_down): gemm_runners' two GEMMs run once more with their outputs poisoned, against the
    reference (tune/verify.py) -> relative error.
    check_gate_up(cfg, gemm_inputs' tuple), check_down(cfg, a, a_scale, route_w, layout), sorted batches."""
    from ..kernels.gemm.down import down
    from ..kernels.gemm.gate_up import gate_up

    def check_gate_up(c, inp):
        batch, layout, xq, xs = inp
        inter, extra = gate_up(xq, xs, weights.w13, weights.w13_scale, layout, shape.scheme, "silu", shape.dtype, c,
                               poison=True, source_rows=batch.source_rows)
        rows = batch.source_rows  # rows by index: the kernel read x[rows[r]] for row r
        x_rows = (xq, xs) if rows is None else (xq[rows], None if xs is None else xs[rows])
        return verify.gemm_error("gate_up", shape.scheme, "silu", layout.meta, x_rows,
                                 (weights.w13, weights.w13_scale), (inter, extra), shape.dtype)

    def check_down(c, a, a_s, route_w, layout):
        out = down(a, a_s, weights.w2, weights.w2_scale, route_w, layout, shape.scheme, shape.dtype, c, poison=True)
        return verify.gemm_error("down", shape.scheme, "silu", layout.meta, (a, a_s, route_w),
                                 (weights.w2, weights.w2_scale), (out,), shape.dtype)

    return check_gate_up, check_down


def _fastest_correct(gemm: str, tokens: int, cfgs: list[GemmConfig], ms: list[float], check):
    """The fastest of ``cfgs`` (times ``ms``) whose output check(cfg) -> relative error passes -> (it, its ms,
    [{"gemm", "config", "rel_err" (None: not finite)}] of the faster ones refused); MF607 if none passes."""
    order = sorted(range(len(cfgs)), key=ms.__getitem__)
    best, refused = verify.first_correct(order, lambda j: check(cfgs[j]))
    notes = [{"gemm": gemm, "config": cfgs[j].to_dict(), "rel_err": float(f"{e:.3g}") if math.isfinite(e) else None}
             for j, e in refused]
    if best is None:
        worst = ", ".join(f"{cfgs[j]} ({e:.3g})" for j, e in refused[:4])
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "this machine"
        raise error("MF607", gemm=gemm, tokens=tokens, count=len(cfgs), device=device, examples=worst)
    return cfgs[best], ms[best], notes


def tune(shape: Shape, token_counts: list[int], rep_ms: float = 15, log=print, on_result=None,
         indexed_rows: bool = False, fused: bool = True):
    """-> ({T: MoEKernelConfig}, {T: {"gate_up": us, "down": us[, "layer_separate": us, "layer_fused": us]}}) for
    the current GPU (module docstring). on_result(table, measured) is called after each T (so a stopped search
    keeps what it found). indexed_rows: gate_up reads its rows as the layer that uses the table feeds them: by index
    for a single-process layer (the local dispatcher's plan: the Triton kernel gathers them itself, the Gluon
    fp8-block kernel first copies them, and that copy is timed with it), else in order (expert parallelism:
    received batches arrive sorted). Times: the median over graph replays divided by the launches, weights cold
    (the batches route to different experts, so for small T no expert's weights stay in L2 from the launch
    before); host launch time left out, which at small T would swamp the kernels' and pick decode configs on noise.
    fused: also time the one-launch layer where fused_searched (T <= FUSED_TUNE_MAX_TOKENS, rows by index, a scheme
    gemm/fused_layer.py runs): the whole layer after routing on the same routings, the separate launches with the
    chosen gate_up and down against each one-launch tile set; the entry gets the fastest tile set only where it
    beat the separate launches (the two layer figures are measured there only)."""
    from ..kernels.rows.quant import down_input
    from ..targets import kernel_target
    dev = torch.device("cuda")
    target = kernel_target(dev)
    if shape.scheme != "none" and not target.fp8_dots:  # the tuner times FP8 dots; weight-only FP8 is not searched yet
        from ..errors import error
        raise error("MF204", kind="tuner", name="moeflow tune", need="8.9", scheme=shape.scheme,
                    have=f"{target.capability[0]}.{target.capability[1]} (weight-only FP8 runs the default tiles)",
                    valid=["moeflow tune --quant none"])
    weights = random_weights(shape, dev)
    run_gu, run_dn = gemm_runners(shape, weights)
    check_gu, check_dn = gemm_checks(shape, weights)
    plans = {t: candidates(shape, t, target.tile_budget) for t in token_counts}
    fused_plans = {t: fused_candidates(shape, t) if fused and fused_searched(shape, t, indexed_rows) else []
                   for t in token_counts}
    pairs = {p for gu, dn in plans.values() for p in covering_pairs(gu, dn)}
    tile_sets = {f for fs in fused_plans.values() for f in fs}
    precompile([(shape, p, indexed_rows) for p in pairs] + [(shape, f, True) for f in tile_sets])
    parts = _layer_parts(shape)
    table, measured = {}, {}
    for t in token_counts:
        routings = tuner_routings(shape, t, dev)
        inputs = gemm_inputs(shape, routings, indexed_rows)  # per batch: (batch, layout, x, x scale)
        gu_c, dn_c = plans[t]
        gu_t = [graph_time_ms([lambda c=c, i=i: run_gu(c, i) for i in inputs], rep_ms) for c in gu_c]
        best_gu, gu_ms, refused = _fastest_correct("gate_up", t, gu_c, gu_t, lambda c: check_gu(c, inputs[0]))
        down_in = []
        for inp in inputs:
            a, a_s = down_input(*run_gu(best_gu, inp), shape.scheme)
            down_in.append((a, a_s, inp[0].weights, inp[1]))
        dn_t = [graph_time_ms([lambda c=c, d=d: run_dn(c, *d) for d in down_in], rep_ms) for c in dn_c]
        best_dn, dn_ms, refused_dn = _fastest_correct("down", t, dn_c, dn_t, lambda c: check_dn(c, *down_in[0]))
        refused += refused_dn
        table[t] = MoEKernelConfig(best_gu, best_dn)
        measured[str(t)] = {"gate_up": round(gu_ms * 1e3, 2), "down": round(dn_ms * 1e3, 2)}
        if refused:  # faster candidates whose output was wrong: a kernel or compiler fault to report
            measured[str(t)]["refused"] = refused
            for r in refused:
                log(f"  T={t:>6}: refused {r['gemm']} {GemmConfig(**r['config'])}: relative error "
                    f"{'not finite' if r['rel_err'] is None else r['rel_err']} against the reference")
        line = f"  T={t:>6}: gate_up {gu_ms * 1e3:9.1f} us {best_gu}  down {dn_ms * 1e3:9.1f} us {best_dn}"
        if fused_plans[t]:
            sep, timed = layer_times(parts, weights, routings, table[t], fused_plans[t], rep_ms)
            best = pick_fused(sep, timed)
            table[t] = MoEKernelConfig(best_gu, best_dn, fused=best)
            ok = [ms for _, ms in usable(timed)]  # the tile sets pick_fused considers
            measured[str(t)]["layer_separate"] = round(sep * 1e3, 2)
            line += f"  layer: separate {sep * 1e3:.1f} us"
            if ok:
                measured[str(t)]["layer_fused"] = round(min(ok) * 1e3, 2)
                line += f", fused {min(ok) * 1e3:.1f} us"
            if len(ok) < len(timed):  # a tile set whose output is wrong: a kernel or compiler fault to report
                line += f" ({len(timed) - len(ok)} tile sets refused: output off by > {FUSED_MAX_REL_ERR})"
            line += f" -> {'separate' if best is None else best}"
        log(line)
        if on_result:
            on_result(table, measured)
    return table, measured
