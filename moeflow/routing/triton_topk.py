"""router="triton": the whole routing of routing/torch_topk.py in one Triton launch on CUDA
(kernels/routing/route.py): scores, grouped selection with the correction bias, top-k, renormalization and
scaling. The same expert ids as the torch router on CUDA (its sigmoid has torch's float32 bits:
kernels/common.exact_sigmoid; rows whose choices tie exactly may order or pick them differently) and weights
to float32 rounding. Batches of 2048 tokens or more of 64-256 experts run kernels/routing/route_stream.py.
Why: at decode sizes the torch router is ~10 small kernels, whose launches dominate the routing's time.
"""
from __future__ import annotations

from torch import Tensor

from ..capabilities import TRITON_ARCHS, RouterCaps
from .base import Router


class TritonTopK(Router):
    name = "triton"
    caps = RouterCaps(devices=frozenset({"cuda"}), requires=("triton",), priority=10, max_experts=1024,
                      grouped_pow2=True, note="one launch per call; experts held in registers (E <= 1024)",
                      graph_safe=True, archs=TRITON_ARCHS,
                      # batch-invariant: the per-row kernel at every T (its launch shape depends on E alone; the
                      # streaming kernel of large batches reduces a row in another order)
                      batch_invariant=True)

    def __call__(self, router_logits: Tensor, correction_bias: Tensor | None):
        from ..kernels.routing.route import route
        cfg = self.config
        return route(router_logits, correction_bias, cfg.top_k, cfg.scoring, cfg.renormalize,
                     cfg.num_expert_groups, cfg.topk_groups, cfg.routed_scaling_factor,
                     lanes=0 if cfg.batch_invariant else None)
