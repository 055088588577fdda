"""Routing in torch, float32: softmax or sigmoid scores, optional grouped top-k with a selection
bias (DeepSeek-V3's noaux_tc), renormalization and routed scaling.

Matches Hugging Face's routers: Mixtral and Qwen3-MoE (softmax -> top-k -> optional renormalize)
and DeepSeek-V3 (sigmoid -> +bias for choice -> groups ranked by the sum of their top-2 ->
top-k among kept groups -> weights are the *unbiased* scores -> renormalize -> × scaling).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..capabilities import RouterCaps
from ..invariant import fixed_apply, fixed_softmax, fixed_sum, fixed_topk
from .base import Router


class _Ops:
    """The reductions the router uses: torch's own (fast), or with MoEConfig.batch_invariant the fixed-order ones of
    moeflow.invariant (ties to the lower expert index, sums in one order, every element on one code path)."""

    def __init__(self, invariant: bool):
        self.topk = fixed_topk if invariant else (lambda x, k: torch.topk(x, k, dim=-1, sorted=True))
        self.softmax = fixed_softmax if invariant else (lambda x: x.softmax(dim=-1))
        self.sigmoid = (lambda x: fixed_apply(torch.sigmoid, x)) if invariant else torch.sigmoid
        self.sum = (lambda x: fixed_sum(x)[..., None]) if invariant else (lambda x: x.sum(dim=-1, keepdim=True))


_OPS = {False: _Ops(False), True: _Ops(True)}


class TorchTopK(Router):
    name = "torch"
    caps = RouterCaps(devices=frozenset({"cpu", "cuda"}), note="torch ops, float32; any expert count", graph_safe=True,
                      batch_invariant=True)  # with MoEConfig.batch_invariant: moeflow.invariant's reductions

    def __call__(self, router_logits: Tensor, correction_bias: Tensor | None):
        cfg = self.config
        ops = _OPS[cfg.batch_invariant]
        logits = router_logits.float()
        if not cfg.grouped and correction_bias is None and (cfg.renormalize or cfg.scoring == "sigmoid"):
            return self._select_on_logits(logits, ops)
        scores = ops.softmax(logits) if cfg.scoring == "softmax" else ops.sigmoid(logits)
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if cfg.grouped:
            choice = self._mask_groups(choice, correction_bias is not None, ops)
        ids = ops.topk(choice, cfg.top_k)[1]
        weights = scores.gather(1, ids)
        if cfg.renormalize:
            weights = weights / (ops.sum(weights) + 1e-20)
        if cfg.routed_scaling_factor != 1.0:
            weights = weights * cfg.routed_scaling_factor
        return ids.to(torch.int32), weights

    def _select_on_logits(self, logits: Tensor, ops: _Ops) -> tuple[Tensor, Tensor]:
        """Plain top-k, fewer kernels (the eager decode path): softmax and sigmoid are monotonic,
        so the top-k logits pick the same experts as the top-k scores; the renormalized softmax
        of the K picked is the softmax over their logits alone. Same values to fp32 rounding.
        Where float32 sigmoids saturate (1.0 from a logit of about 16.6) the scores tie and the logits
        still order the experts: the Triton routers rank the logits there too (kernels/routing/route.py)."""
        cfg = self.config
        vals, ids = ops.topk(logits, cfg.top_k)
        if cfg.scoring == "softmax":
            weights = ops.softmax(vals)
        else:
            weights = ops.sigmoid(vals)
            if cfg.renormalize:
                weights = weights / (ops.sum(weights) + 1e-20)
        if cfg.routed_scaling_factor != 1.0:
            weights = weights * cfg.routed_scaling_factor
        return ids.to(torch.int32), weights

    def _mask_groups(self, choice: Tensor, biased: bool, ops: _Ops) -> Tensor:
        """Keep the topk_groups best of num_expert_groups groups; others get -inf.

        choice: [T, E] float32. A group's score is the sum of its two best entries when a
        correction bias is used (DeepSeek-V3), else its best entry (DeepSeek-V2).
        """
        cfg = self.config
        t, e = choice.shape
        g = cfg.num_expert_groups
        grouped = choice.view(t, g, e // g)
        if biased:  # the sum of the group's two best: best + second, one addition
            best = ops.topk(grouped, 2)[0]
            group_scores = best[..., 0] + best[..., 1]
        else:
            group_scores = grouped.amax(-1)
        keep = ops.topk(group_scores, cfg.topk_groups)[1]
        mask = torch.zeros(t, g, dtype=torch.bool, device=choice.device).scatter_(1, keep, True)
        return grouped.masked_fill(~mask[:, :, None], float("-inf")).view(t, e)
