"""The one-launch small-batch layer's part of `moeflow tune` (tune/autotune.py runs it): which tile sets
(kernels/gemm/fused_layer.py) are timed for a shape and T, and the rule that records one. For T <=
FUSED_TUNE_MAX_TOKENS of a single-process layer the whole layer after routing is timed both ways on the same
routings, from a CUDA graph as autotune times the GEMMs, as layer.routed_experts runs it (``layer_times``); the
entry gets the fastest tile set only where it beat the separate launches (``pick_fused``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..benchmark import poisoned_allocations, relative_error
from ..kernels.configs import FusedConfig, MoEKernelConfig
from ..kernels.gemm.tiles import fit_fused

if TYPE_CHECKING:
    from .timing import Shape

# larger T is not searched: each copy reads its expert's weights, so as T grows the copies of T tokens read their
# experts' weights up to T * K / experts-hit times, and the separate launches win
FUSED_TUNE_MAX_TOKENS = 16
# fp8-block and fp8-channel (BLOCK_N1, BLOCK_N2, stages, SPLIT1, SPLIT2), BLOCK_K 128: tiles of 64 rows or more run
# wgmma; SPLIT2 a multiple of top-k: each down program reads one copy (or part of one), so it waits for that copy's
# gate_up tiles only
FUSED_FP8 = [(64, 64, 4, 1, 8), (64, 64, 4, 2, 8), (128, 128, 3, 2, 8), (64, 128, 4, 1, 8), (64, 64, 4, 4, 8),
             (128, 64, 3, 2, 8), (64, 64, 4, 2, 4), (128, 128, 3, 2, 4), (64, 64, 6, 2, 16), (128, 128, 3, 1, 16)]
# scheme none, 2-byte layers (BN1, BK1, BN2, BK2, stages, SPLIT1, SPLIT2)
FUSED_BF16 = [(64, 128, 64, 128, 3, 2, 8), (64, 128, 64, 128, 3, 1, 8), (64, 64, 64, 64, 4, 2, 8),
              (64, 128, 128, 128, 3, 2, 8), (128, 64, 64, 64, 4, 2, 8), (64, 128, 64, 128, 3, 2, 4),
              (64, 64, 64, 64, 4, 4, 8), (64, 128, 64, 128, 3, 2, 16), (64, 128, 128, 64, 4, 1, 16),
              (64, 64, 64, 64, 6, 2, 8)]


def fused_candidates(shape: Shape, tokens: int) -> list[FusedConfig]:
    """One-launch tile sets (gemm/fused_layer.py) for T = tokens, fitted (tiles.fit_fused) and deduplicated;
    [] where the runner never runs the one launch: a scheme outside fused_layer.FUSED_SCHEMES, T outside
    1 .. FUSED_MAX_TOKENS, or a float32 layer (the tiles were sized for 2-byte weights: a stage of 64 x 128 gate
    and up tiles is 64 KB in float32, and fit_fused does not fit stages to shared memory)."""
    from ..experts.triton import FUSED_MAX_TOKENS
    from ..kernels.gemm.fused_layer import FUSED_SCHEMES
    if shape.scheme not in FUSED_SCHEMES or not 0 < tokens <= FUSED_MAX_TOKENS:
        return []
    if shape.scheme in ("fp8-block", "fp8-channel"):
        tiles = [dict(block_n1=n1, block_k1=128, block_n2=n2, block_k2=128, num_stages=s, split1=s1, split2=s2)
                 for n1, n2, s, s1, s2 in FUSED_FP8]
    elif shape.dtype.itemsize == 2:
        tiles = [dict(block_n1=n1, block_k1=k1, block_n2=n2, block_k2=k2, num_stages=s, split1=s1, split2=s2)
                 for n1, k1, n2, k2, s, s1, s2 in FUSED_BF16]
    else:
        return []
    out = []
    for t in tiles:
        f = fit_fused(FusedConfig(num_warps=4, **t), shape.scheme)
        if f not in out:
            out.append(f)
    return out


def fused_searched(shape: Shape, tokens: int, indexed_rows: bool) -> bool:
    """Whether tune() times the one launch at T = tokens: a single-process layer (indexed_rows: expert
    parallelism always runs the separate launches), T <= FUSED_TUNE_MAX_TOKENS, and tile sets that run it."""
    return indexed_rows and tokens <= FUSED_TUNE_MAX_TOKENS and bool(fused_candidates(shape, tokens))


# a tile set whose one launch differs more than this from the separate launches' output (relative, first routing) is
# never recorded: the two differ by rounding only (a few 1e-3), so more is a fault
FUSED_MAX_REL_ERR = 3e-2


def usable(timed: list[tuple[FusedConfig, float, float]]) -> list[tuple[FusedConfig, float]]:
    """[(tile set, ms)] of ``timed`` [(tile set, ms, relative error against the separate launches)] whose error is
    within FUSED_MAX_REL_ERR (NaN never is): the only ones pick_fused may record."""
    return [(f, ms) for f, ms, err in timed if err <= FUSED_MAX_REL_ERR]


def pick_fused(separate_ms: float, timed: list[tuple[FusedConfig, float, float]]) -> FusedConfig | None:
    """The fastest of ``timed`` [(tile set, ms, relative error against the separate launches)] among the usable
    ones if it is faster than ``separate_ms`` (the separate launches on the same routings), else None (a tie
    keeps the separate launches)."""
    ok = usable(timed)
    if not ok:
        return None
    best, ms = min(ok, key=lambda c: c[1])
    return best if ms < separate_ms else None


def layer_times(parts, weights, routings, pair: MoEKernelConfig, fused: list[FusedConfig], rep_ms: float):
    """The layer after routing, each way a single-process layer runs it (layer.routed_experts), timed on the same
    routings [(x [T, H], topk_ids [T, K] int32, topk_weights [T, K] float32)] -> (ms of the separate launches: the
    local dispatcher's sort, the runner's GEMMs with ``pair``, the top-k sum; [(tile set, ms of its one launch, its
    output's relative error against the separate launches' on the first routing, its buffers NaN-poisoned first
    (moeflow.benchmark.poisoned_allocations: a launch reusing the memory of the one before could otherwise leave
    an unwritten element holding a right value)] for each of ``fused``).
    parts: autotune._layer_parts(shape), made once (the runner's fused counters with it)."""
    from .timing import graph_time_ms
    dispatcher, runner = parts

    def separate(x, ids, w):
        batch, handle = dispatcher.dispatch(x, ids, w)
        return dispatcher.combine(runner.run_with(batch, weights, pair), handle)

    sep = graph_time_ms([lambda r=r: separate(*r) for r in routings], rep_ms)
    ref = separate(*routings[0])

    def checked(f) -> float:
        with poisoned_allocations():
            return relative_error(runner.run_fused(*routings[0], weights, f), ref)

    return sep, [(f, graph_time_ms([lambda f=f, r=r: runner.run_fused(*r, weights, f) for r in routings], rep_ms),
                  checked(f)) for f in fused]
