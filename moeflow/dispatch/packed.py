"""``Rows``: the views of a packed row buffer (uint8 [R, row_bytes]) that _ep_rows.RowCodec.unpack returns and the
expert-parallel row kernels (kernels/rows/ep_rows.py) and their torch references (_ep_reference.py) write."""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class Rows:
    """Views into a packed buffer of R rows."""

    ids: Tensor  # [R, K] int32
    weights: Tensor  # [R, K] float32
    scale: Tensor | None  # [R, G] float32
    hidden: Tensor  # [R, token_bytes / word size] words (see RowCodec.word)
