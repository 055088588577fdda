"""The batch-invariant dense product x @ w.T (shared experts, their gate, a replaced block's router): the fixed-tile
Triton kernel (kernels/gemm/linear.py) on a GPU its kernels are checked on, moeflow.invariant.fixed_matmul elsewhere."""
from __future__ import annotations

from torch import Tensor

from .capabilities import triton_glue
from .invariant import fixed_matmul


def invariant_linear(x: Tensor, w: Tensor) -> Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] float32, each row computed the same way at every M and position."""
    if triton_glue(x):
        try:
            from .kernels.gemm.linear import linear
        except ImportError:  # triton missing: the torch form below
            pass
        else:
            return linear(x, w)
    return fixed_matmul(x, w)
