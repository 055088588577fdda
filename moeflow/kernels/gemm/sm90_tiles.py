"""Kernel configurations for Hopper (compute capability 9.x) where no tuned table matches the shape.

sm90_gemm_configs -> (gate_up, down) GemmConfigs from RULES, by rows per expert m = T * top_k / E (uniform
routing), with an alternative tile for long K loops or wide outputs (_ALTERNATIVE). The rules are what the tuned
H200 tables (kernels/configs/: three model shapes, four schemes, T = 1-16384) agree on; tiles.fit then makes the
tiles valid for the shape (a Gluon kernel that cannot run a shape hands the tile to the Triton kernel).
How they compare with the tables and the generic defaults: docs/performance.md ("Untuned shapes").
"""
from __future__ import annotations

import math

from ..configs import GemmConfig as G

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
    """(gate_up, down) tiles for a batch of ``rows_per_expert`` rows an expert (m) on Hopper; hidden H, inter I (the
    gate_up's K loop runs along H, the down's along I and its output is H wide). RULES, by m:
      m <= 16 (weight streaming): 16-row tiles, every scheme; 128-wide down tiles.
      16 < m <= 48: 64-row tiles; fp8-block runs its Gluon gate_up (gate_up_wgmma: one 64-row tile a warpgroup,
        the step scales overlapped) and the warp-specialized down.
      larger m: bf16/fp16 and fp8-block run the warp-specialized kernels (gemm/warp_specialized.py), 128-row tiles
        shared by the two consumers (COOP) past m = 384 (bf16/fp16: also from 48 to 96); fp8-tensor and
        fp8-channel 128 x 128 gate_up tiles of 8 warps.
    The alternatives (_ALTERNATIVE): fp8-block K loops of more than 16 steps of 128 (gate_up H > 2048, down
    I > 2048) take the per-tile Gluon kernels, whose 128-row tiles read fewer operand bytes a multiply-add than
    the warp-specialized 64-row ones; the bf16/fp16 gate_up with H > 4096 the 128-row COOP tile from m = 48 on;
    the bf16/fp16 down with H >= 4096 the 128 x 256 COOP tile past m = 96."""
    _, gate_up, down = next(row for row in RULES[scheme] if rows_per_expert <= row[0])
    gate_up_alt, down_alt = _ALTERNATIVE.get(scheme, (lambda h, i: False, lambda h, i: False))
    return _pick(gate_up, gate_up_alt(hidden, inter)), _pick(down, down_alt(hidden, inter))


def _pick(choice, alternative: bool) -> G:
    return choice[1 if alternative else 0] if isinstance(choice, tuple) else choice
