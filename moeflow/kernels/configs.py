"""Kernel configurations: tuned JSON files keyed by device and shape, and documented defaults.

File name (written by `moeflow tune`):  E={E},N={I},K={H},device={GPU name},scheme={scheme}.json
    E local experts, N the expert intermediate size I, K the hidden size H, the GPU name with
    spaces as "_" (torch.cuda.get_device_name), scheme the quant scheme ("none" covers bf16/fp16).
Content: {"device", "capability", "E", "N", "K", "scheme", "dtype", "top_k", "triton_version", "gate_up_rows",
          "configs": {"<T>": {"gate_up": {GemmConfig fields}, "down": {...}}, ...}, "measured_us": {...}}
    capability: the GPU's compute capability [major, minor] (files without it are never borrowed by another GPU).
    gate_up_rows: how the tuner fed gate_up its rows, "by index" (single-process layer) or "in order"
    (expert parallelism); files written before it existed were timed in order. Other keys are free-form notes
    (fused_source, edits: entries set from a measurement other than the tuner's); --merge keeps them (table_notes).
    where <T> is a token count (tokens per rank, before top-k). A lookup takes the entry whose T
    is nearest to the batch's in log scale. Directories searched, first hit wins:
    $MOEFLOW_KERNEL_CONFIG_DIR, then moeflow/kernels/configs/ (shipped).
No file for this E: a file of the same device, N, K and scheme with the nearest expert count is
borrowed, its token counts rescaled to the same rows per expert (expert parallelism runs a tuned
model's shape with E / W local experts); a warning names the missing file. No file of this device at all: one of
another GPU with the same compute capability is borrowed the same way (the H200 tables serve an H100 or an H20).
Defaults (no such file; a warning names the missing file): see ``default_config`` (on Hopper,
kernels/sm90_defaults.py).
"""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path

from .. import env as moeflow_env
from ..errors import error

SHIPPED_DIR = Path(__file__).with_name("configs")
_SMEM_BUDGET = 200 * 1024  # bytes of shared memory a config may plan for (H100/H200 allow 227 KB)


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and launch options of one grouped GEMM kernel."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    # down GEMM, sorted batches with TMA operands: > 0 runs a persistent grid of this many programs
    # per SM looping over the tiles (kernels/down.py; with scale_overlap, the Gluon kernel's persistent
    # form, kernels/down_wgmma_persistent.py); 0: one program per tile. gate_up ignores it.
    programs_per_sm: int = 0
    # one program per tile: > 1 splits the K loop (down: I; gate_up: H) over this many programs per
    # tile, whose float32 partial tiles one more launch adds up in a fixed order (kernels/down.py,
    # kernels/gate_up.py, which then runs its epilogue there): more programs streaming weights when a
    # decode batch has few tiles with long K loops.
    split_k: int = 1
    # fp8-block, sorted batches on Hopper: > 0 runs the Gluon kernel whose K loop scales each step's
    # product while the next step's wgmma runs (down: kernels/down_wgmma.py, 1 storing the output from the
    # wgmma register layout, 2 in 16-byte stores; gate_up: kernels/gate_up_wgmma.py, 1). JSON true reads
    # as 1. fit() sets 0 where that kernel cannot run the tile.
    scale_overlap: int = 0
    # gate_up, sorted batches: 1 loads the token rows through a TMA descriptor, rows in layout order (a
    # batch whose rows come by index is first copied into that order, one launch); 0 loads them by
    # pointer (by index: in place, no copy). The fp8-block Gluon kernel reads its rows this way always.
    # down ignores it (its input is in layout order: TMA wherever TMA can address it).
    x_tma: int = 0
    # sorted batches on Hopper, layer dtype bf16/fp16 or the fp8-block down: 1 runs the persistent
    # warp-specialized Gluon kernel (kernels/warp_specialized.py: a TMA loader warp and two consumer warpgroups by
    # turns; gate_up reads its rows in order, copied into order first where they come by index). fit() sets 0
    # where that kernel cannot run the tile (ws_fits).
    warp_specialize: int = 0
    # the Triton kernels (kernels/gate_up.py, kernels/down.py, not the Gluon ones above): 1 computes each tile
    # transposed, weight rows as the MMA's M and the block's token rows as its N (common.tile_dot): a block of
    # 16-32 rows then runs Hopper wgmma straight from shared memory instead of mma.sync, or a 64-row wgmma half
    # padding. fit() sets 0 where scale_overlap or warp_specialize hands the tile to a Gluon kernel. An fp8 wgmma's
    # accumulator keeps fewer bits than float32: fp8-block adds each step's product into float32 (error against
    # float64 unchanged), fp8-tensor/-channel accumulate the K loop in it, so the tuner offers swapped tiles for
    # none and fp8-block only (autotune._precise).
    swap_ab: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class FusedConfig:
    """Tiles of the one-launch small-batch layer (kernels/fused_layer.py): gate_up items of BLOCK_N1 intermediate
    columns of one copy, K steps of BLOCK_K1 along H, the steps split over SPLIT1 programs; down items of BLOCK_N2
    output columns of one token, steps of BLOCK_K2 along I (all K copies' steps in one loop), split over SPLIT2
    programs (the last of a tile's programs to finish adds the float32 partials in split order). fp8-block: both
    BLOCK_K 128 (one activation group a step), both BLOCK_N dividing 128. BLOCK_N of 64 or more runs Hopper wgmma
    (the weight tile is the dot's M), narrower tiles mma.sync."""

    block_n1: int = 64
    block_k1: int = 128
    block_n2: int = 64
    block_k2: int = 128
    num_warps: int = 4
    num_stages: int = 4
    split1: int = 1
    split2: int = 1

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MoEKernelConfig:
    gate_up: GemmConfig
    down: GemmConfig
    # a single-process layer of this many tokens runs dispatch, both GEMMs and the combine in one launch with these
    # tiles (kernels/fused_layer.py) where the runner and dispatcher allow it (Plan.fused_layer); None: separate
    # launches (sort, gate_up, down, top-k sum) with the two configs above. `moeflow tune` sets it where the one launch
    # measured faster than the separate launches on the same routings (single-process layers, T <=
    # tune_fused.FUSED_TUNE_MAX_TOKENS; --no-fused skips the search; --merge keeps an entry's old tiles where the run
    # did not search them). The shipped H200 tables' entries came from benchmarks/experiments/fused_layer.py.
    fused: FusedConfig | None = None

    def to_dict(self) -> dict:
        d = {"gate_up": self.gate_up.to_dict(), "down": self.down.to_dict()}
        if self.fused is not None:
            d["fused"] = self.fused.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "MoEKernelConfig":
        """A tuned file's entry -> the configs; ValueError / TypeError / KeyError naming what a hand-edited entry got
        wrong (the lookup turns them into MF603 at the layer's first forward, not a compile error inside it)."""
        return cls(checked(GemmConfig, d["gate_up"], "gate_up"), checked(GemmConfig, d["down"], "down"),
                   checked(FusedConfig, d["fused"], "fused") if d.get("fused") else None)


# what a tuned file's fields may hold (fit() and fit_fused() then adapt them to the scheme and shared memory):
# block sizes powers of two up to 256, the rest integers in these ranges; JSON true / false read as 1 / 0
_POW2 = ("block_m", "block_n", "block_k", "block_n1", "block_k1", "block_n2", "block_k2")
_RANGES = {"group_m": (1, 64), "num_stages": (1, 8), "programs_per_sm": (0, 8), "split_k": (1, 64),
           "scale_overlap": (0, 2), "x_tma": (0, 1), "warp_specialize": (0, 1), "swap_ab": (0, 1), "split1": (1, 64),
           "split2": (1, 64)}


def checked(cls, d: dict, what: str):
    """``cls(**d)`` (GemmConfig or FusedConfig) with every field checked: integers, block sizes powers of two in
    1..256, num_warps 1, 2, 4 or 8, the others in _RANGES; unknown or missing fields raise TypeError."""
    if not isinstance(d, dict):
        raise TypeError(f"{what}: a JSON object of fields, not {type(d).__name__}")
    for key, v in d.items():
        if not isinstance(v, int):  # bool is an int: true / false read as 1 / 0
            raise TypeError(f"{what}.{key} = {v!r}: an integer")
        if key in _POW2 and not (1 <= v <= 256 and v & (v - 1) == 0):
            raise ValueError(f"{what}.{key} = {v}: a power of two from 1 to 256 (Triton's tiles)")
        if key == "num_warps" and v not in (1, 2, 4, 8):  # 16 leaves 128 registers a thread: ptxas refused a
            raise ValueError(f"{what}.num_warps = {v}: one of 1, 2, 4, 8")  # 256-row tile's wgmma on the H200
        lo, hi = _RANGES.get(key, (v, v))
        if not lo <= v <= hi:
            raise ValueError(f"{what}.{key} = {v}: from {lo} to {hi}")
    try:
        return cls(**{k: int(v) for k, v in d.items()})
    except TypeError as exc:  # a field unknown or missing
        raise TypeError(f"{what}: {exc}") from None


def file_name(device: str, e: int, n: int, k: int, scheme: str) -> str:
    return f"E={e},N={n},K={k},device={device.replace(' ', '_')},scheme={scheme}.json"


def default_config(tokens: int, top_k: int, num_experts: int, scheme: str, *, hidden: int = 0, inter: int = 0,
                   capability: tuple[int, int] | None = None) -> MoEKernelConfig:
    """Defaults for a shape no tuned table covers. On Hopper (``capability`` (9, x); hidden H and inter I given) the
    GEMM tiles the H200 tables agree on (kernels/sm90_defaults.py); elsewhere (the CPU interpreter) the generic tiles
    below. Both by rows per expert m = tokens * top_k / E (uniform routing); generic:
    m <= 16: BLOCK_M 16, narrow N tiles (64) and deep K (128): weight streaming, many programs;
    m <= 128: BLOCK_M 64, 64-wide tiles, grouped order (row blocks of one expert share weight tiles in L2);
    larger: gate_up 64 x 128 with 8 warps (its two accumulators; larger tiles spill), down 64 x 256.
    One token: the one-launch layer too (kernels/fused_layer.py, where the plan allows it), with the tiles that
    won most of the six T=1 layers measured on H200 (benchmarks/results/fused_layer_2026-12-01_h200.json): down
    programs of one copy each (SPLIT2 8), gate_up's K steps in two halves; fp8-block 128-wide tiles, bf16 64/128.
    Not fp8-channel: its one launch (fp16 dots) measured no faster than its separate launches on the H200 presets
    (benchmarks/results/fused_fp8_channel_2026-12-04_h200.md); a tuned table may still set it.
    """
    fp8 = scheme != "none"
    bk = 128 if fp8 else 64
    m = tokens * top_k / max(num_experts, 1)
    fused = (FusedConfig(128 if fp8 else 64, 128, 128, 128, 4, 3, 2, 8)
             if tokens == 1 and scheme in ("none", "fp8-block") else None)
    if capability is not None and capability[0] == 9 and hidden and inter:
        from .sm90_defaults import sm90_gemm_configs
        return MoEKernelConfig(*sm90_gemm_configs(m, scheme, hidden, inter), fused)
    if m <= 16:  # (fp8-block: gate_up 128 wide, its groups quantized in the epilogue)
        return MoEKernelConfig(GemmConfig(16, 128 if scheme == "fp8-block" else 64, 128, 1, 4, 4),
                               GemmConfig(16, 64, 128, 1, 4, 4), fused)
    if m <= 128:
        return MoEKernelConfig(GemmConfig(64, 128 if scheme == "fp8-block" else 64, bk, 4, 4, 3),
                               GemmConfig(64, 128, bk, 4, 4, 3))
    return MoEKernelConfig(GemmConfig(64, 128, bk, 8, 8, 3), GemmConfig(64, 256, bk, 8, 8, 3))


def fit(cfg: GemmConfig, *, fused_pair: bool, scheme: str, elem_bytes: int, n_size: int) -> GemmConfig:
    """Make ``cfg`` valid for the scheme and within shared memory.

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
    while stages > 1 and smem() > _SMEM_BUDGET:
        stages -= 1
    while b_tiles * bm * bn > 256 * 32 * max(cfg.num_warps, 1) and max(bm, bn) > 16:  # accumulators a thread
        bn, bm = (bn // 2, bm) if bn >= bm else (bn, bm // 2)
    while smem() > _SMEM_BUDGET:  # one stage still too big (a hand-edited file): halve K, then N, then M
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


def fit_fused(cfg: FusedConfig, scheme: str) -> FusedConfig:
    """Make ``cfg`` valid for the scheme: tiles of 16 columns at least (the dots' N), BLOCK_K of 16 at least
    (fp8: 32); fp8-block: BLOCK_K 128 and BLOCK_N at most 128 (powers of two, so dividing 128); no more stages than
    fit the shared-memory budget with 2-byte weights (fp8: 1), a gate_up item's two tiles or a down item's one (a
    tile over it at one stage, only in a hand-edited file, halves its BLOCK_K, then its BLOCK_N)."""
    bn1, bn2 = max(cfg.block_n1, 16), max(cfg.block_n2, 16)
    bk_min = 32 if scheme != "none" else 16
    bk1, bk2 = max(cfg.block_k1, bk_min), max(cfg.block_k2, bk_min)
    if scheme == "fp8-block":
        bn1, bn2, bk1, bk2 = min(bn1, 128), min(bn2, 128), 128, 128
    elem = 1 if scheme != "none" else 2
    while 2 * bn1 * bk1 * elem > _SMEM_BUDGET:  # a gate_up item's gate and up tiles (only a hand-edited file)
        bk1, bn1 = (bk1 // 2, bn1) if bk1 > bk_min else (bk1, bn1 // 2)
    while bn2 * bk2 * elem > _SMEM_BUDGET:
        bk2, bn2 = (bk2 // 2, bn2) if bk2 > bk_min else (bk2, bn2 // 2)
    per_stage = max(2 * bn1 * bk1, bn2 * bk2) * elem
    stages = max(1, min(cfg.num_stages, _SMEM_BUDGET // per_stage))
    return replace(cfg, block_n1=bn1, block_k1=bk1, block_n2=bn2, block_k2=bk2, num_stages=stages,
                   split1=max(cfg.split1, 1), split2=max(cfg.split2, 1))


def wgmma_down_fits(cfg: GemmConfig) -> bool:
    """Tiles kernels/down_wgmma.py runs: BLOCK_K 128 (one scale group per step), BLOCK_N dividing 128 (one
    weight-scale block per tile), BLOCK_M 64 or 128 with 16 rows a warp at least, 4 or 8 warps, 2-6 stages."""
    return (cfg.block_k == 128 and 128 % cfg.block_n == 0 and cfg.block_n >= 16 and cfg.block_m in (64, 128)
            and cfg.num_warps in (4, 8) and cfg.block_m >= 16 * cfg.num_warps and 2 <= cfg.num_stages <= 6)


def ws_fits(cfg: GemmConfig, gated: bool, scheme: str = "none") -> bool:
    """Tiles kernels/warp_specialized.py runs: each consumer warpgroup a whole tile, 4 warps a consumer, no split
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
# consumer thread in every tile, none spilled (tests/test_kernels_compile_sm90.py)
_WS_UNSCALED_STAGES = {
    (False, 128, 128): 6, (True, 128, 64): 6,  # a 128-row tile a consumer, by turns: 32 KB stages
    (False, 128, 256): 4, (True, 128, 128): 4,  # COOP, 64 rows a consumer: 48 KB stages (229 KB at 4 for the down)
    (False, 64, 256): 4, (True, 64, 128): 5,  # a 64-row tile a consumer, by turns: 40 KB stages (238 KB at 5: over)
}


# ws_fits for fp8-block, BLOCK_K 128 (one scale group a step): (gated, BLOCK_M, BLOCK_N) -> the most stages whose shared
# memory fits the SM's 227 KB, compiled for sm_90a (one stage more overflows it: tests/test_kernels_compile_sm90.py)
_WS_FP8_STAGES = {
    (False, 64, 128): 8, (False, 128, 64): 8,  # the down, an accumulator and two products by turns: 24 KB stages
    (True, 64, 128): 5, (False, 64, 256): 5,  # a 64-row tile a consumer in quarters (the gate_up, the wide down): 40 KB
    (True, 128, 128): 4, (False, 128, 256): 4,  # the same shared by the two consumers (COOP), 64 rows each: 48 KB
}


def wgmma_gate_up_fits(cfg: GemmConfig) -> bool:
    """Tiles kernels/gate_up_wgmma.py runs: 128 x 128 weight steps (BLOCK_N and BLOCK_K 128: one weight-scale
    block and one activation group per step), 16 rows a warp (BLOCK_M 64 with 4 warps, 128 with 8), 2-6 stages."""
    return (cfg.block_k == 128 and cfg.block_n == 128 and cfg.num_warps in (4, 8) and cfg.block_m == 16 * cfg.num_warps
            and 2 <= cfg.num_stages <= 6)


def search_dirs() -> list[Path]:
    override = moeflow_env.KERNEL_CONFIG_DIR.get().strip()
    return ([Path(override)] if override else []) + [SHIPPED_DIR]


@lru_cache(maxsize=None)
def _parsed(path: str, mtime: float) -> dict:
    """A tuned file's JSON object, read once per (path, modification time); MF603 when it does not read as one."""
    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise TypeError(f"a JSON {type(data).__name__}, not an object")
        return data
    except (OSError, ValueError, TypeError) as exc:
        raise error("MF603", path=path, why=f"{type(exc).__name__}: {exc}") from None


@lru_cache(maxsize=None)
def _load(path: str, mtime: float) -> tuple[dict[int, MoEKernelConfig], dict[str, dict]]:
    """A tuned file -> (its configs by token count, its measured_us), built once per (path, modification time)."""
    data = _parsed(path, mtime)
    try:
        return ({int(t): MoEKernelConfig.from_dict(c) for t, c in data["configs"].items()},
                dict(data.get("measured_us", {})))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise error("MF603", path=path, why=f"{type(exc).__name__}: {exc}") from None


def find_table(device: str, e: int, n: int, k: int, scheme: str,
               capability: tuple[int, int] | None = None) -> dict[int, MoEKernelConfig] | None:
    """The tuned table for this shape on ``device``; else one borrowed, with a warning naming the missing file:
    first from the same device, N, K and scheme with another expert count (expert parallelism: E local experts of a
    tuned model), its token counts rescaled to the same rows per expert (T * E_tuned / E); then from another GPU of
    the same compute ``capability`` (a file whose header records it: the H200 tables serve an H100 or H20), the
    nearest expert count first, rescaled the same way; else None (defaults, with a warning)."""
    name = file_name(device, e, n, k, scheme)
    found = _lookup(device, e, n, k, scheme, capability)
    if found is not None and found[0].name == name:
        return _load(str(found[0]), found[0].stat().st_mtime)[0]
    where = [str(d) for d in search_dirs()]
    if found is not None:
        path, e_tuned, _ = found
        table = _load(str(path), path.stat().st_mtime)[0]
        fix = f"moeflow tune --local-experts {e}" if e_tuned != e else "moeflow tune"
        warnings.warn(f"moeflow: no tuned Triton MoE config {name!r} in {where}; borrowing "
                      f"{_source(found, device, e, capability)} (run `{fix}` on this GPU to make one)", stacklevel=3)
        # entry tuned at T tokens over E_tuned experts has the rows per expert of T * E / E_tuned tokens here
        return {max(1, round(t * e / e_tuned)): c for t, c in sorted(table.items())}
    warnings.warn(f"moeflow: no tuned Triton MoE config {name!r} in {where}; "
                  f"using defaults (run `moeflow tune` to make one)", stacklevel=3)
    return None


def table_source(device: str, e: int, n: int, k: int, scheme: str,
                 capability: tuple[int, int] | None = None) -> str:
    """Where a Triton layer of this shape on ``device`` takes its tiles from, in words (`moeflow check`): its tuned
    file, a borrowed one (find_table's order), or the defaults (Hopper's rules or the generic ones)."""
    found = _lookup(device, e, n, k, scheme, capability)
    if found is not None and found[0].name == file_name(device, e, n, k, scheme):
        return f"tuned file {str(found[0])!r}"
    if found is not None:
        return f"borrowed {_source(found, device, e, capability)} (no file {file_name(device, e, n, k, scheme)!r})"
    rules = ("the Hopper rules (kernels/sm90_defaults.py)" if capability is not None and capability[0] == 9
             else "the generic defaults (configs.default_config)")
    return f"{rules}: no tuned file for this shape (run `moeflow tune` to make one)"


def _lookup(device: str, e: int, n: int, k: int, scheme: str,
            capability: tuple[int, int] | None) -> tuple[Path, int, str] | None:
    """(path, its E, the device it was tuned on) of this shape's own tuned file (first search directory that has it),
    else of the file find_table borrows (_borrowable), else None."""
    for d in search_dirs():
        p = d / file_name(device, e, n, k, scheme)
        if p.is_file():
            return p, e, device
    return _borrowable(device, e, n, k, scheme, capability)


def _source(found: tuple[Path, int, str], device: str, e: int, capability: tuple[int, int] | None) -> str:
    """A borrowed file in words: its name, the GPU it was tuned on if another, its expert count if another."""
    path, e_tuned, tuned_on = found
    whose = ("" if tuned_on == device else
             f", tuned on {tuned_on} (compute capability {capability[0]}.{capability[1]}, as this GPU's)")
    at = f" (E={e_tuned}) at the same rows per expert" if e_tuned != e else ""
    return f"{path.name!r}{whose}{at}"


def _borrowable(device: str, e: int, n: int, k: int, scheme: str,
                capability: tuple[int, int] | None) -> tuple[Path, int, str] | None:
    """(path, E, device tuned on) of the tuned file for (N, K, scheme) to borrow, or None. Files of this device
    first, then of another device whose header's "capability" is ``capability``; among them the expert count
    nearest ``e`` (log scale), then the earlier search directory, then the smaller E."""
    found = []
    pattern = file_name("*", 0, n, k, scheme).replace("E=0,", "E=*,", 1)
    for rank, d in enumerate(search_dirs()):
        for p in sorted(d.glob(pattern)):
            try:
                e_tuned = int(p.name.split(",", 1)[0].removeprefix("E="))
            except ValueError:
                continue
            named = p.name.split(",device=", 1)[1].rsplit(",scheme=", 1)[0]  # the device, spaces as "_"
            other = named != device.replace(" ", "_")
            header = _header(str(p), p.stat().st_mtime) if other else {}
            if other and (capability is None or tuple(header.get("capability") or ()) != tuple(capability)):
                continue
            tuned_on = str(header.get("device", named)) if other else device
            found.append((other, abs(math.log(e_tuned / max(e, 1))), rank, e_tuned, p, tuned_on))
    if not found:
        return None
    *_, e_tuned, path, tuned_on = min(found, key=lambda f: f[:4])
    return path, e_tuned, tuned_on


def _header(path: str, mtime: float) -> dict:
    """A tuned file's top-level fields but its configs and measured times (MF603 when it does not read)."""
    return {key: v for key, v in _parsed(path, mtime).items() if key not in ("configs", "measured_us")}


def nearest(table: dict[int, MoEKernelConfig], tokens: int) -> MoEKernelConfig:
    """The entry whose token count is nearest ``tokens`` in log scale (ties: the smaller)."""
    t = math.log(max(tokens, 1))
    return table[min(table, key=lambda key: (abs(math.log(max(key, 1)) - t), key))]


def read_table(path: Path) -> tuple[dict[int, MoEKernelConfig], dict[str, dict]]:
    """A tuned file -> (its configs by token count, its measured_us by token count as a string)."""
    table, measured = _load(str(path), path.stat().st_mtime)
    return dict(table), dict(measured)


def table_notes(path: Path) -> dict:
    """A tuned file's top-level keys but its configs and measured_us: its header and any free-form notes (fused_source,
    edits: where an entry came from other than the tuner). `moeflow tune --merge` writes them back, its own header
    over the old one's fields; a note on an entry the merge re-tunes is then stale, to be edited by hand."""
    return _header(str(path), path.stat().st_mtime)


def write_table(path: Path, meta: dict, table: dict[int, MoEKernelConfig], measured: dict | None = None) -> None:
    body = dict(meta, configs={str(t): c.to_dict() for t, c in sorted(table.items())})
    if measured:
        body["measured_us"] = measured
    path.write_text(json.dumps(body, indent=1) + "\n")
