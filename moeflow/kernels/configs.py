"""Kernel configurations (GemmConfig, FusedConfig, MoEKernelConfig) and the tuned tables `moeflow tune` writes.

A table is a JSON file named E={E},N={I},K={H},device={GPU name, spaces as _},scheme={scheme}.json holding its header
(device, capability, E, N, K, scheme, dtype, top_k, triton_version, gate_up_rows) and "configs": {"<T>": {"gate_up":
{...}, "down": {...}, "fused": {...}}} by tokens per rank; a lookup takes the entry nearest the batch's T (log scale).
Directories searched, first hit wins: $MOEFLOW_KERNEL_CONFIG_DIR, then the shipped kernels/configs/. Without a file
for this E, one of the same N, K and scheme with the nearest expert count is borrowed (rows per expert kept); without
one for this device, one of a GPU of the same compute capability (the H200 tables serve an H100); else the defaults
of gemm/tiles.py. Each borrowing or default warns, naming the missing file.
"""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from .. import env as moeflow_env
from ..errors import error

SHIPPED_DIR = Path(__file__).with_name("configs")


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and options of one grouped GEMM; gemm/choice.py turns the options into the kernel that runs.

    programs_per_sm > 0 (down, sorted batches, TMA operands): a persistent grid of this many programs an SM.
    split_k > 1: the K loop (gate_up: H, down: I) over this many programs a tile, float32 partials summed in a fixed
        order by one more launch (more programs streaming weights for decode batches with few tiles).
    scale_overlap (fp8-block, Hopper): the Gluon kernel that scales each step while the next wgmma runs (down: 1
        stores from the wgmma registers, 2 in 16-byte stores; gate_up: 1).
    x_tma (gate_up, sorted batches): rows through TMA in layout order (rows by index are copied into order first).
    warp_specialize (Hopper; bf16/fp16, or fp8-block): the persistent warp-specialized Gluon kernel.
    swap_ab (the Triton kernels): tiles computed transposed, weight rows as the MMA's M, so 16-32-row blocks run
        Hopper wgmma. tiles.fit clears an option the tile or scheme cannot use; JSON true / false read as 1 / 0.
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 0
    split_k: int = 1
    scale_overlap: int = 0
    x_tma: int = 0
    warp_specialize: int = 0
    swap_ab: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class FusedConfig:
    """Tiles of the one-launch small-batch layer (gemm/fused_layer.py): gate_up items of BLOCK_N1 intermediate
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
    # tiles (gemm/fused_layer.py) where the runner and dispatcher allow it (Plan.fused_layer); None: separate
    # launches (sort, gate_up, down, top-k sum) with the two configs above. `moeflow tune` sets it where the one launch
    # measured faster than the separate launches on the same routings (single-process layers, T <=
    # tune/fused.FUSED_TUNE_MAX_TOKENS; --no-fused skips the search; --merge keeps an entry's old tiles where the run
    # did not search them).
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
    rules = ("the Hopper rules (kernels/gemm/sm90_tiles.py)" if capability is not None and capability[0] == 9
             else "the generic defaults (kernels/gemm/tiles.default_config)")
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
