"""The combine's reduction, shared by every dispatcher: per output row, the sum of indexed rows."""
from __future__ import annotations

import torch
from torch import Tensor

from ..capabilities import triton_glue


def gather_sum(src: Tensor, index: Tensor) -> Tensor:
    """out[r] = sum over j of src[index[r, j]] (index -1 counts as zero), accumulated in float32
    in j order, returned in src.dtype. src [M, H], index [R, J] int64 -> [R, H].

    Reads each indexed row once: the combine's reduction without a float32 copy of src. On CUDA it
    is the Triton kernel moeflow.kernels.rows.reduce.moe_sum when present; torch otherwise.
    """
    if triton_glue(src):  # CUDA, on a GPU the kernel was checked on
        try:
            from ..kernels.rows.reduce import moe_sum
        except ImportError:  # triton (or the kernel module) missing: torch below
            pass
        else:
            return moe_sum(src, index.reshape(-1).contiguous(), index.shape[1])
    r, j = index.shape
    if src.shape[0] == 0 or j == 0:
        return src.new_zeros(r, src.shape[1])
    picked = src.index_select(0, index.clamp(min=0).reshape(-1)).view(r, j, src.shape[1])
    picked = torch.where((index >= 0)[..., None], picked, torch.zeros((), dtype=src.dtype, device=src.device))
    return ordered_sum(picked.unbind(1)).to(src.dtype)


def ordered_sum(rows) -> Tensor:
    """rows[0] + rows[1] + ... in float32, in that order, elementwise (a torch reduction may split the summed dimension
    over threads when the output is small, so its order would follow the batch's size) -> float32."""
    acc = None
    for r in rows:
        acc = r.float() if acc is None else acc + r.float()
    return acc
