"""Tile rules of the two grouped GEMMs: defaults for untuned shapes, and fitting a tuned entry to a scheme.

``default_config`` gives the tiles where no tuned table covers a shape; ``fit`` / ``fit_fused`` make any entry
valid for the scheme, the shared memory and the registers; ``ws_fits``, ``wgmma_gate_up_fits`` and
``wgmma_down_fits`` say which tiles the Gluon kernels run (choice.py decides per call which kernel runs).
"""
from __future__ import annotations

from dataclasses import replace

from ..configs import FusedConfig, GemmConfig, MoEKernelConfig

_SMEM_BUDGET = 200 * 1024  # bytes of shared memory a tile may plan for (Hopper allows 227 KB; the rest: epilogues)


def default_config(tokens: int, top_k: int, num_experts: int, scheme: str, *, hidden: int = 0, inter: int = 0,
                   capability: tuple[int, int] | None = None) -> MoEKernelConfig:
    """Tiles for a shape no tuned table covers, by rows per expert m = tokens * top_k / E (uniform routing).

    Hopper (``capability`` (9, x), ``hidden`` H and ``inter`` I given): the rules of sm90_tiles.py. Elsewhere the
    generic tiles: m <= 16: BLOCK_M 16, 64-wide N, 128-deep K (weight streaming, many programs); m <= 128: BLOCK_M
    64, grouped order (row blocks of one expert share weight tiles in L2); larger: gate_up 64 x 128 with 8 warps
    (two accumulators; larger tiles spill), down 64 x 256.
    One token, schemes none and fp8-block: also the one-launch layer's tiles (fused_layer.py; down programs of one
    copy each, gate_up's K steps in two halves). fp8-channel's one launch was no faster than its separate launches,
    so only a tuned table sets it.
    """
    fp8 = scheme != "none"
    bk = 128 if fp8 else 64
    m = tokens * top_k / max(num_experts, 1)
    fused = (FusedConfig(128 if fp8 else 64, 128, 128, 128, 4, 3, 2, 8)
             if tokens == 1 and scheme in ("none", "fp8-block") else None)
    if capability is not None and capability[0] == 9 and hidden and inter:
        from .sm90_tiles import sm90_gemm_configs
        return MoEKernelConfig(*sm90_gemm_configs(m, scheme, hidden, inter), fused)
    if m <= 16:  # (fp8-block: gate_up 128 wide, its groups quantized in the epilogue)
        return MoEKernelConfig(GemmConfig(16, 128 if scheme == "fp8-block" else 64, 128, 1, 4, 4),
                               GemmConfig(16, 64, 128, 1, 4, 4), fused)
    if m <= 128:
        return MoEKernelConfig(GemmConfig(64, 128 if scheme == "fp8-block" else 64, bk, 4, 4, 3),
                               GemmConfig(64, 128, bk, 4, 4, 3))
    return MoEKernelConfig(GemmConfig(64, 128, bk, 8, 8, 3), GemmConfig(64, 256, bk, 8, 8, 3))


def fit(cfg: GemmConfig, *, fused_pair: bool, scheme: str, elem_bytes: int, n_size: int,
        budget: int = _SMEM_BUDGET) -> GemmConfig:
    """Make ``cfg`` valid for the scheme and within ``budget`` bytes of shared memory (the GPU's Target.tile_budget,
    moeflow.targets; elem_bytes: an operand element's).

    fp8-block: BLOCK_K must divide 128 (one activation group per step). gate_up: BLOCK_N of 128
    or more quantizes the 1x128 groups in the epilogue (128, or 256 where n_size (I) allows);
    BLOCK_N of 16-64 (more programs for small batches) leaves that to a separate kernel.
    fp8 dots need BLOCK_K >= 32; every dot needs 16 x 16 tiles at least. Accumulators past 256 float32 registers a
    thread (gate_up holds two) halve the larger of BLOCK_N and BLOCK_M. Stages beyond the shared-memory budget are
    dropped; a tile whose single stage is over it (only a hand-edited file has one) halves BLOCK_K, then BLOCK_N,
    then BLOCK_M until it fits. scale_overlap stays only on
    an fp8-block tile the Gluon kernel runs (wgmma_gate_up_fits, wgmma_down_fits); gate_up's is 1.
    x_tma stays (as 0 or 1) on gate_up only. warp_specialize stays (as 1) only on a tile the Gluon kernel
    runs (ws_fits: bf16/fp16, or fp8-block). swap_ab stays (as 1) where neither Gluon kernel does.
    """
    bm, bn, bk = max(cfg.block_m, 16), max(cfg.block_n, 16), max(cfg.block_k, 32 if scheme != "none" else 16)
    if scheme == "fp8-block":
        bk = min(bk, 128)
        if fused_pair and bn >= 128:
            bn = 256 if bn >= 256 and n_size % 256 == 0 else 128
    stages = max(cfg.num_stages, 1)
    b_tiles = 2 if fused_pair else 1
    smem = lambda: stages * (bm * bk + b_tiles * bk * bn) * elem_bytes
    while stages > 1 and smem() > budget:
        stages -= 1
    while b_tiles * bm * bn > 256 * 32 * max(cfg.num_warps, 1) and max(bm, bn) > 16:  # accumulators a thread
        bn, bm = (bn // 2, bm) if bn >= bm else (bn, bm // 2)
    while smem() > budget:  # one stage still too big (a hand-edited file, a small GPU): halve K, then N, then M
        if bk > (128 if scheme == "fp8-block" else 32):
            bk //= 2
        elif bn > 64:
            bn //= 2
        else:
            bm //= 2
    fitted = replace(cfg, block_m=bm, block_n=bn, block_k=bk, num_stages=stages,
                     x_tma=int(bool(cfg.x_tma)) if fused_pair else 0)
    keep_ws = (elem_bytes == 2 or scheme == "fp8-block") and ws_fits(fitted, gated=fused_pair, scheme=scheme)
    fitted = replace(fitted, warp_specialize=int(bool(cfg.warp_specialize) and keep_ws))
    if fitted.scale_overlap:
        fits = wgmma_gate_up_fits(fitted) if fused_pair else wgmma_down_fits(fitted)
        keep = scheme == "fp8-block" and fits and fitted.scale_overlap in (1, 2)
        fitted = replace(fitted, scale_overlap=(1 if fused_pair else int(fitted.scale_overlap)) if keep else 0)
    return replace(fitted, swap_ab=int(bool(cfg.swap_ab) and not fitted.scale_overlap and not fitted.warp_specialize))


def fit_fused(cfg: FusedConfig, scheme: str, budget: int = _SMEM_BUDGET) -> FusedConfig:
    """Make ``cfg`` valid for the scheme: tiles of 16 columns at least (the dots' N), BLOCK_K of 16 at least
    (fp8: 32); fp8-block: BLOCK_K 128 and BLOCK_N at most 128 (powers of two, so dividing 128); no more stages than
    fit ``budget`` (Target.tile_budget) with 2-byte weights (fp8: 1), a gate_up item's two tiles or a down item's one (a
    tile over it at one stage, only in a hand-edited file, halves its BLOCK_K, then its BLOCK_N)."""
    bn1, bn2 = max(cfg.block_n1, 16), max(cfg.block_n2, 16)
    bk_min = 32 if scheme != "none" else 16
    bk1, bk2 = max(cfg.block_k1, bk_min), max(cfg.block_k2, bk_min)
    if scheme == "fp8-block":
        bn1, bn2, bk1, bk2 = min(bn1, 128), min(bn2, 128), 128, 128
    elem = 1 if scheme != "none" else 2
    while 2 * bn1 * bk1 * elem > budget:  # a gate_up item's gate and up tiles (only a hand-edited file)
        bk1, bn1 = (bk1 // 2, bn1) if bk1 > bk_min else (bk1, bn1 // 2)
    while bn2 * bk2 * elem > budget:
        bk2, bn2 = (bk2 // 2, bn2) if bk2 > bk_min else (bk2, bn2 // 2)
    per_stage = max(2 * bn1 * bk1, bn2 * bk2) * elem
    stages = max(1, min(cfg.num_stages, budget // per_stage))
    return replace(cfg, block_n1=bn1, block_k1=bk1, block_n2=bn2, block_k2=bk2, num_stages=stages,
                   split1=max(cfg.split1, 1), split2=max(cfg.split2, 1))


def wgmma_down_fits(cfg: GemmConfig) -> bool:
    """Tiles down_wgmma.py runs: BLOCK_K 128 (one scale group per step), BLOCK_N dividing 128 (one
    weight-scale block per tile), BLOCK_M 64 or 128 with 16 rows a warp at least, 4 or 8 warps, 2-6 stages."""
    return (cfg.block_k == 128 and 128 % cfg.block_n == 0 and cfg.block_n >= 16 and cfg.block_m in (64, 128)
            and cfg.num_warps in (4, 8) and cfg.block_m >= 16 * cfg.num_warps and 2 <= cfg.num_stages <= 6)


def ws_fits(cfg: GemmConfig, gated: bool, scheme: str = "none") -> bool:
    """Tiles warp_specialized.py runs: each consumer warpgroup a whole tile, 4 warps a consumer, no split
    K; the stages from 2 to the most the tile's shared memory allows. Scheme none (_WS_UNSCALED_STAGES): 128
    accumulator registers a thread, BLOCK_K 64: down 128 x 128 and 64 x 256, gate_up (gated: two accumulators, gate and
    up) 128 x 64 and 64 x 128; or the 128 x 256 down and 128 x 128 gate_up tiles shared by the two consumers (COOP,
    64 rows each). fp8-block (_WS_FP8_STAGES), BLOCK_K 128 (one scale group a step): the down an accumulator and two
    products by turns of 64 registers each, 64 x 128 or 128 x 64 tiles; the gate_up 64 x 128 tiles (one output group a
    row) and the wide down 64 x 256, four accumulator quarters and two quarter products of 32 registers each; or
    those at 128 rows shared by the two consumers (COOP: the 128 x 128 gate_up, the 128 x 256 down)."""
    if cfg.num_warps != 4 or cfg.split_k != 1:
        return False
    if scheme == "fp8-block":
        return cfg.block_k == 128 and 2 <= cfg.num_stages <= _WS_FP8_STAGES.get((gated, cfg.block_m, cfg.block_n), 0)
    most = _WS_UNSCALED_STAGES.get((gated, cfg.block_m, cfg.block_n), 0) if scheme == "none" else 0
    return cfg.block_k == 64 and 2 <= cfg.num_stages <= most


# ws_fits for scheme none (bf16, fp16), BLOCK_K 64: (gated, BLOCK_M, BLOCK_N) -> the most stages whose shared memory
# (the ring and the epilogue's layout change) fits the SM's 227 KB, compiled for sm_90a: 128 accumulator registers a
# consumer thread in every tile, none spilled (checked by compiling them, tests/kernels/test_kernels_compile_sm90.py)
_WS_UNSCALED_STAGES = {
    (False, 128, 128): 6, (True, 128, 64): 6,  # a 128-row tile a consumer, by turns: 32 KB stages
    (False, 128, 256): 4, (True, 128, 128): 4,  # COOP, 64 rows a consumer: 48 KB stages (229 KB at 4 for the down)
    (False, 64, 256): 4, (True, 64, 128): 5,  # a 64-row tile a consumer, by turns: 40 KB stages (238 KB at 5: over)
}


# ws_fits for fp8-block, BLOCK_K 128 (one scale group a step): (gated, BLOCK_M, BLOCK_N) -> the most stages whose shared
# memory fits the SM's 227 KB, compiled for sm_90a (one stage more overflows it)
_WS_FP8_STAGES = {
    (False, 64, 128): 8, (False, 128, 64): 8,  # the down, an accumulator and two products by turns: 24 KB stages
    (True, 64, 128): 5, (False, 64, 256): 5,  # a 64-row tile a consumer in quarters (the gate_up, the wide down): 40 KB
    (True, 128, 128): 4, (False, 128, 256): 4,  # the same shared by the two consumers (COOP), 64 rows each: 48 KB
}


def wgmma_gate_up_fits(cfg: GemmConfig) -> bool:
    """Tiles gate_up_wgmma.py runs: 128 x 128 weight steps (BLOCK_N and BLOCK_K 128: one weight-scale
    block and one activation group per step), 16 rows a warp (BLOCK_M 64 with 4 warps, 128 with 8), 2-6 stages."""
    return (cfg.block_k == 128 and cfg.block_n == 128 and cfg.num_warps in (4, 8) and cfg.block_m == 16 * cfg.num_warps
            and 2 <= cfg.num_stages <= 6)
