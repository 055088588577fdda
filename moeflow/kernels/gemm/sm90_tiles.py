"""Kernel configurations for Hopper (compute capability 9.x) where no tuned table matches the shape.

The rules are what the twelve tuned H200 tables (``configs/``: three model shapes, four schemes, T = 1-16384) agree
on, read by rows per expert m = T * top_k / E (uniform routing):

- m <= 16 (weight streaming): 16-row tiles, every scheme; 128-wide down tiles.
- 16 < m <= 48: 64-row tiles; fp8-block runs its Gluon gate_up (one 64-row tile a warpgroup, the step scales
  overlapped) and the warp-specialized down.
- larger m: bf16/fp16 and fp8-block run the warp-specialized kernels (kernels/warp_specialized.py), 128-row tiles
  shared by the two consumers (COOP) past m = 384 (bf16/fp16: also from 48 to 96); fp8-tensor and fp8-channel
  128 x 128 gate_up tiles of 8 warps.

Three shape conditions the tables also agree on:
- fp8-block, a K loop of more than 16 steps of 128 (Mixtral's and DeepSeek-V3's gate_up, H > 2048; Mixtral's down,
  I > 2048): the per-tile Gluon kernels, whose 128-row tiles read fewer operand bytes a multiply-add, beat the
  warp-specialized 64-row ones there (benchmarks/results/ws_fp8_gate_up_2026-12-03_h200.md);
- bf16/fp16 gate_up, H > 4096 (DeepSeek-V3's 7168): the 128-row COOP tile from m = 48 on;
- bf16/fp16 down, H >= 4096: the 128 x 256 COOP tile past m = 96 (DeepSeek-V3, Mixtral; Qwen3's H = 2048 keeps
  128 x 128).

Each rule picks tiles; ``configs.fit`` then makes them valid for the shape (a Gluon kernel that cannot run a shape
hands the tile to the Triton kernel). How these rules compare with the tables and with the generic defaults, on the
three tuned shapes and on shapes no table covers: docs/performance.md ("Untuned shapes").
"""
from __future__ import annotations

import math

from .configs import GemmConfig as G

WS = dict(warp_specialize=1)
SO = dict(scale_overlap=1)

# (m upper bound, gate_up, down); the first row whose bound is >= m. A pair is (default, alternative), the
# alternative for the shapes _ALTERNATIVE names: a long K loop (fp8-block; the bf16/fp16 gate_up) or a wide output
# (the bf16/fp16 down).
_UNSCALED = (
    (16, G(16, 64, 128, 1, 4, 4), G(16, 128, 128, 1, 4, 3)),
    (48, G(64, 64, 64, 4, 4, 4), G(64, 128, 64, 4, 4, 4)),
    (96, G(128, 128, 64, 8, 4, 4, **WS), G(128, 128, 64, 8, 4, 5, **WS)),
    (384, (G(64, 128, 64, 8, 4, 5, **WS), G(128, 128, 64, 8, 4, 4, **WS)),
     (G(128, 128, 64, 8, 4, 5, **WS), G(128, 256, 64, 16, 4, 4, **WS))),
    (math.inf, G(128, 128, 64, 8, 4, 3, **WS), (G(128, 128, 64, 8, 4, 5, **WS), G(128, 256, 64, 16, 4, 4, **WS))),
)
_FP8_BLOCK = (
    (16, G(16, 128, 128, 1, 4, 4), G(16, 128, 128, 1, 4, 3)),
    (48, G(64, 128, 128, 4, 4, 4, **SO), G(64, 128, 128, 8, 4, 6, **WS)),
    (96, (G(64, 128, 128, 8, 4, 5, **WS), G(64, 128, 128, 8, 4, 5, **SO)), G(64, 128, 128, 8, 4, 6, **WS)),
    (384, (G(64, 128, 128, 8, 4, 4, **WS), G(128, 128, 128, 8, 8, 3, **SO)),
     (G(64, 256, 128, 16, 4, 4, **WS), G(128, 128, 128, 8, 8, 4, scale_overlap=2))),
    (math.inf, (G(128, 128, 128, 8, 4, 3, **WS), G(128, 128, 128, 8, 8, 3, **SO)),
     (G(64, 256, 128, 16, 4, 4, **WS), G(128, 128, 128, 8, 8, 4, scale_overlap=2))),
)
_FP8_PER_ROW = (  # fp8-tensor and fp8-channel (no Gluon kernel runs them)
    (16, G(16, 64, 256, 1, 4, 3), G(16, 128, 128, 1, 4, 3)),
    (96, G(64, 64, 128, 4, 4, 4), G(64, 128, 128, 4, 4, 4, programs_per_sm=2)),
    (math.inf, G(128, 128, 128, 8, 8, 4), G(64, 128, 128, 8, 4, 4, programs_per_sm=2)),
)
RULES = {"none": _UNSCALED, "fp8-block": _FP8_BLOCK, "fp8-tensor": _FP8_PER_ROW, "fp8-channel": _FP8_PER_ROW}
_LONG_K = 16 * 128  # fp8-block: a K loop of more than 16 steps of 128
# scheme -> (gate_up takes the alternative, down takes it), each a predicate of (H, I)
_ALTERNATIVE = {
    "none": (lambda h, i: h > 4096, lambda h, i: h >= 4096),  # a long gate_up K loop; a wide down output
    "fp8-block": (lambda h, i: h > _LONG_K, lambda h, i: i > _LONG_K),  # long K loops
}


def sm90_gemm_configs(rows_per_expert: float, scheme: str, hidden: int, inter: int) -> tuple[G, G]:
    """(gate_up, down) tiles for a batch of ``rows_per_expert`` rows an expert on Hopper; hidden H, inter I (the
    gate_up's K loop runs along H, the down's along I and its output is H wide)."""
    _, gate_up, down = next(row for row in RULES[scheme] if rows_per_expert <= row[0])
    gate_up_alt, down_alt = _ALTERNATIVE.get(scheme, (lambda h, i: False, lambda h, i: False))
    return _pick(gate_up, gate_up_alt(hidden, inter)), _pick(down, down_alt(hidden, inter))


def _pick(choice, alternative: bool) -> G:
    return choice[1 if alternative else 0] if isinstance(choice, tuple) else choice
