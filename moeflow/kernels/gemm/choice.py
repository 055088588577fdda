"""The kernel choice of the two grouped GEMMs: per call, which kernel runs a fitted tile (tiles.py).

``choose_gate_up`` and ``choose_down`` return a ``GemmChoice``; the launchers (gate_up.py, down.py) dispatch on
its ``kernel`` and nothing else decides. The order of preference, the architecture rules (the Gluon kernels run on
Hopper, sm_90, outside Triton's interpreter) and the handling of a tuned kernel a call cannot run (a warning, once
per reason, then the Triton kernel) live here. ``describe`` gives the same choice without tensors (`moeflow check`).
"""
from __future__ import annotations

import enum
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ... import env as moeflow_env
from ...targets import kernel_target
from ..common import RowLayout, cdiv, expert_rows, tma_rows
from ..configs import GemmConfig


class GemmKernel(str, enum.Enum):
    """The kernels that run a grouped GEMM (gate_up: x @ W13^T with the activation; down: inter @ W2^T)."""

    TRITON = "triton"  # gate_up.py / down.py: one program per output tile
    TRITON_SPLIT_K = "triton-split-k"  # the same with K split over split_k programs, then one summing launch
    TRITON_PERSISTENT = "triton-persistent"  # down.py: programs_per_sm programs an SM loop over the tiles (TMA)
    GLUON_WGMMA = "gluon-wgmma"  # fp8-block, Hopper: each step's scaling overlapped with the next wgmma
    GLUON_WGMMA_PERSISTENT = "gluon-wgmma-persistent"  # the down's form of it as a persistent grid
    GLUON_WARP_SPECIALIZED = "gluon-warp-specialized"  # Hopper: a TMA loader warp and two consumer warpgroups


GLUON = frozenset({GemmKernel.GLUON_WGMMA, GemmKernel.GLUON_WGMMA_PERSISTENT, GemmKernel.GLUON_WARP_SPECIALIZED})


@dataclass(frozen=True)
class GemmChoice:
    """kernel: what runs; split_k: programs per tile along K (> 1 only for TRITON_SPLIT_K); rows_in_order: gate_up
    copies rows given by index into layout order first (the kernel reads rows through TMA); reason: why, in words."""

    kernel: GemmKernel
    split_k: int = 1
    rows_in_order: bool = False
    reason: str = ""


@dataclass(frozen=True)
class CallFacts:
    """What the choice reads of a call besides its tile. ``gluon``: why no Gluon kernel runs on this device, or None
    (Hopper, Gluon importable, not interpreting). ``blocker(kernel)``: why the call's operands rule that Gluon kernel
    out, or None; asked only for the kernels the tile names, in order (the checks read strides on the hot path).
    ``tma_rows`` / ``tma_weights``: the down's input rows / weights TMA-addressable."""

    rows: int
    k: int
    scheme: str
    masked: bool
    float32: bool
    gluon: str | None
    blocker: Callable[[GemmKernel], str | None]
    tma_rows: bool = False
    tma_weights: bool = False


_warned: set = set()


def _fallback(op: str, wanted: GemmKernel, why: str) -> str:
    """The reason text for a tuned kernel the call cannot run; warns once per (op, kernel, reason)."""
    text = f"the tuned {op} kernel {wanted.value} cannot run this call ({why}): running triton instead"
    if (op, wanted, why) not in _warned:
        _warned.add((op, wanted, why))
        warnings.warn(f"moeflow: {text}", stacklevel=4)
    return text


def _rule(facts: CallFacts) -> str | None:
    """Why no Gluon kernel runs here by rule, not by a fault of the call: the device, or a masked batch (the Gluon
    kernels read sorted rows only)."""
    return facts.gluon or ("a masked batch (the Gluon kernels read sorted batches)" if facts.masked else None)


def _first_runnable(op: str, wanted: list, facts: CallFacts) -> tuple[GemmKernel | None, str]:
    """The first of the tuned Gluon kernels ``wanted`` (in preference order) the call can run, with the reason; or
    None and why none runs: a rule (the device, a masked batch) stops the search, a call's blocker warns once
    (_fallback) and passes to the next."""
    reason = ""
    for kernel in wanted:
        why = _rule(facts)
        if why:
            return None, f"{kernel.value} tuned, but {why}"
        why = facts.blocker(kernel)
        if why is None:
            return kernel, "the tuned entry's kernel"
        reason = _fallback(op, kernel, why)
    return None, reason


def decide_gate_up(cfg: GemmConfig, facts: CallFacts) -> GemmChoice:
    """gate_up's kernel for a fitted tile. Preference: the Gluon wgmma kernel (cfg.scale_overlap; fp8-block whose
    epilogue quantizes whole 128-column groups), then the warp-specialized one (cfg.warp_specialize; bf16/fp16 or
    that fp8-block epilogue), then Triton (split K where cfg.split_k > 1 still splits the K loop)."""
    split = min(cfg.split_k, cdiv(facts.k, cfg.block_k)) if facts.rows else 1
    fused_groups = facts.scheme == "fp8-block" and (cfg.block_n % 128 == 0 or split > 1)
    wanted = []
    if cfg.scale_overlap and fused_groups and split == 1:
        wanted.append(GemmKernel.GLUON_WGMMA)
    if cfg.warp_specialize and (facts.scheme == "none" or fused_groups and split == 1) and facts.rows:
        wanted.append(GemmKernel.GLUON_WARP_SPECIALIZED)
    kernel, reason = _first_runnable("gate_up", wanted, facts)
    if kernel is not None:
        return GemmChoice(kernel, rows_in_order=True, reason=reason)
    in_order = bool(cfg.x_tma) and not facts.masked and facts.rows > 0
    if split > 1:
        return GemmChoice(GemmKernel.TRITON_SPLIT_K, split, in_order, reason or f"split_k {split}")
    return GemmChoice(GemmKernel.TRITON, 1, in_order, reason or "the tuned entry's kernel")


def decide_down(cfg: GemmConfig, facts: CallFacts, h: int) -> GemmChoice:
    """down's kernel for a fitted tile (h: output columns H). Split K first (cfg.split_k > 1 splitting the K loop);
    else the warp-specialized kernel (cfg.warp_specialize), the Gluon wgmma kernel (cfg.scale_overlap; persistent
    with cfg.programs_per_sm when its stages fit the K steps), the persistent Triton kernel (cfg.programs_per_sm, a
    sorted batch, TMA operands, not float32), the per-tile Triton kernel."""
    steps = cdiv(facts.k, cfg.block_k)
    split = min(cfg.split_k, steps)
    if split > 1 and facts.rows and h:
        return GemmChoice(GemmKernel.TRITON_SPLIT_K, split, reason=f"split_k {split}")
    wanted = []
    if cfg.warp_specialize:
        wanted.append(GemmKernel.GLUON_WARP_SPECIALIZED)
    if cfg.scale_overlap:
        wanted.append(GemmKernel.GLUON_WGMMA)
    kernel, reason = _first_runnable("down", wanted, facts)
    if kernel is GemmKernel.GLUON_WGMMA and cfg.programs_per_sm and cfg.num_stages <= steps:
        kernel = GemmKernel.GLUON_WGMMA_PERSISTENT
    if kernel is not None:
        return GemmChoice(kernel, reason=reason)
    if cfg.programs_per_sm:
        why = ("a masked batch" if facts.masked else "float32 dots" if facts.float32 else
               None if facts.tma_rows and facts.tma_weights else "operands not TMA-addressable")
        if why is None:
            return GemmChoice(GemmKernel.TRITON_PERSISTENT, reason=reason or "the tuned entry's kernel")
        reason = reason or f"triton-persistent tuned, but {why} (the persistent grid reads both operands by TMA)"
    return GemmChoice(GemmKernel.TRITON, reason=reason or "the tuned entry's kernel")


def _gluon_blocker(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"no Gluon kernel runs on {device.type}"
    if moeflow_env.TRITON_INTERPRET.get_bool():
        return "Triton's interpreter runs no Gluon kernel"
    target = kernel_target(device)
    if not target.gluon:
        return f"the Gluon kernels are Hopper's (sm_90), not {target.arch}'s"
    from .down_wgmma import gluon
    return None if gluon is not None else "this triton has no Gluon"


_WEIGHT_ONLY = "weight-only FP8 (the Gluon kernels dot FP8 operands)"


def _gluon_rule(device: torch.device, tiles: tuple[GemmConfig, ...], weight_only: bool) -> str | None:
    """CallFacts.gluon: why no Gluon kernel runs here (weight-only FP8, or the device: _gluon_blocker, asked only
    where one of ``tiles`` names a Gluon kernel), or None."""
    if weight_only:
        return _WEIGHT_ONLY
    return _gluon_blocker(device) if any(c.scale_overlap or c.warp_specialize for c in tiles) else None


def _down_float32(dtype: torch.dtype, scheme: str, weight_only: bool) -> bool:
    """CallFacts.float32 of a down call: float32 operands dotted in IEEE float32 (float32 layers, but fp8-block's,
    whose FP8 operands the persistent kernel may take; weight-only FP8's operands are float32 there too)."""
    return dtype == torch.float32 and (scheme != "fp8-block" or weight_only)


def choose_gate_up(x: Tensor, x_scale: Tensor | None, w13: Tensor, w13_scale: Tensor | None, layout: RowLayout,
                   scheme: str, cfg: GemmConfig, weight_only: bool = False) -> GemmChoice:
    """The kernel for gate_up(x [S or R, H], w13 [E, 2I, H], layout) with the fitted tile ``cfg``; weight_only
    (weight-only FP8): a Triton kernel."""
    def blocker(kernel: GemmKernel) -> str | None:
        from . import gate_up_wgmma, warp_specialized  # Gluon: loaded on Hopper only
        if kernel is GemmKernel.GLUON_WGMMA:
            return gate_up_wgmma.cannot_run(x, x_scale, w13, w13_scale, cfg)
        return warp_specialized.cannot_run(x, x_scale, w13, scheme, cfg, gated=True, w_scale=w13_scale)

    facts = CallFacts(layout.rows, x.shape[1], scheme, layout.masked, False, _gluon_rule(x.device, (cfg,), weight_only),
                      blocker)
    return decide_gate_up(cfg, facts)


def choose_down(a: Tensor, a_scale: Tensor | None, w2: Tensor, w2_scale: Tensor | None, layout: RowLayout,
                scheme: str, dtype: torch.dtype, cfg: GemmConfig, weight_only: bool = False) -> GemmChoice:
    """The kernel for down(a [R, I], w2 [E, H, I], layout) in layer dtype ``dtype`` with the fitted tile ``cfg``;
    weight_only (weight-only FP8): a Triton kernel, the persistent one not for float32 (its dots are not IEEE)."""
    r, i = a.shape
    _, h, _ = w2.shape
    def blocker(kernel: GemmKernel) -> str | None:
        from . import down_wgmma, warp_specialized  # Gluon: loaded on Hopper only
        if kernel is GemmKernel.GLUON_WGMMA:
            return down_wgmma.cannot_run(a, a_scale, w2, w2_scale, scheme, cfg)
        return warp_specialized.cannot_run(a, a_scale, w2, scheme, cfg, w_scale=w2_scale)

    tma_a = tma_w = False
    if cfg.programs_per_sm:
        tma_a = r > 0 and i > 0 and tma_rows(a, a.stride(0))
        tma_w = expert_rows(w2) is not None and h > 0 and i > 0 and tma_rows(w2, w2.stride(1))
    facts = CallFacts(r, i, scheme, layout.masked, _down_float32(dtype, scheme, weight_only),
                      _gluon_rule(a.device, (cfg,), weight_only), blocker, tma_a, tma_w)
    return decide_down(cfg, facts, h)


def describe(gate_up: GemmConfig, down: GemmConfig, *, scheme: str, dtype: torch.dtype, hidden: int, inter: int,
             rows: int, masked: bool, device: torch.device, weight_only: bool = False) -> tuple[GemmChoice, GemmChoice]:
    """The choices for a call whose operands are as the layer's own (contiguous weights and rows, TMA-addressable),
    without tensors: what `moeflow check` prints."""
    gluon = _gluon_rule(device, (gate_up, down), weight_only)
    ok = lambda kernel: None  # noqa: E731 (operands as the layer's own: every Gluon kernel can read them)
    f_gate_up = CallFacts(rows, hidden, scheme, masked, False, gluon, ok)
    f_down = CallFacts(rows, inter, scheme, masked, _down_float32(dtype, scheme, weight_only), gluon, ok, rows > 0,
                       True)
    return decide_gate_up(gate_up, f_gate_up), decide_down(down, f_down, hidden)


def tile_text(cfg: GemmConfig, choice: GemmChoice) -> str:
    """A choice and its tile in one line: 'gluon-wgmma 64x128x128, 4 warps, 4 stages'."""
    return (f"{choice.kernel.value} {cfg.block_m}x{cfg.block_n}x{cfg.block_k}, {cfg.num_warps} warps, "
            f"{cfg.num_stages} stages" + (f", split_k {choice.split_k}" if choice.split_k > 1 else ""))
