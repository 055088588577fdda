"""ExpertsPath: moeflow's planned dispatcher + expert runner, run on weights the caller owns.

``moeflow.MoE`` owns its parameters; a model library that already holds the expert weights (a transformers experts
module) should not copy them into a second set. An ExpertsPath is planned from a :class:`MoEConfig` exactly like a
layer (same planner, same coded refusals, at construction), then called with the weights as ExpertWeights views:

    path = ExpertsPath(MoEConfig(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K, dtype=...))
    y = path(hidden [T, H], topk_ids [T, K] int, topk_weights [T, K] float, ExpertWeights(w13, w2))  # -> [T, H]

Routing is the caller's; expert ids must lie in [0, E) except where ``valid_below`` says otherwise.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import env as moeflow_env
from .. import ops
from ..capabilities import Environment
from ..config import MoEConfig
from ..dispatch import create_dispatcher
from ..dispatch.gather_sum import gather_sum
from ..errors import error
from ..experts import ExpertWeights, create_runner
from ..graph_buckets import Bucketed
from ..graphs import GraphCache
from ..layer import ID_DTYPES, ID_DTYPES_DESC, check_input, own_precision, routed_experts
from ..layouts import run_in_layout
from ..planner import plan as make_plan
from ..quant import FP8_DTYPE, create_scheme
from ..weights import expert_matrix


class ExpertsPath:
    """One planned (scheme, dispatcher, runner) for a layer shape. Between calls it keeps only the CUDA graphs of
    eager small-batch calls (moeflow.graphs), keyed by the weights they read."""

    def __init__(self, config: MoEConfig):
        if config.num_redundant_experts:  # the caller's weights hold one matrix per logical expert
            raise error("MF510", why=f"has replicas (num_redundant_experts={config.num_redundant_experts}), which an "
                                     "ExpertsPath cannot hold: it runs on the caller's weights, one per logical "
                                     "expert; use moeflow.MoE for redundant experts")
        self.config = config
        self.plan = make_plan(config, Environment.detect(config.device))
        self.scheme = create_scheme(self.plan.scheme)
        self.dispatcher = create_dispatcher(self.plan.dispatcher, config, self.scheme,
                                            indexed_rows=self.plan.indexed_rows, planned=self.plan)
        self.runner = create_runner(self.plan.runner, config, self.scheme)
        self._graphs = GraphCache(self.plan.graph_safe)  # eager calls of small batches replayed (moeflow.graphs)
        # torch.compile's op runs it (moeflow.ops)
        ops.register(self, ExpertsPath._call_op, self.plan.graph_safe, self.config.device)

    def __setstate__(self, state):  # copies: their own anchor in moeflow.ops
        self.__dict__.update(state)
        ops.register(self, ExpertsPath._call_op, self.plan.graph_safe, self.config.device)

    def __call__(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, weights: ExpertWeights,
                 valid_below: int | None = None) -> Tensor:
        """hidden [T, H] layer dtype, topk_ids [T, K] int, topk_weights [T, K] float,
        weights: the E experts' [E, 2I, H] / [E, H, I] (views are fine) -> [T, H] layer dtype.

        valid_below: when set, ids >= valid_below are sentinels (expert parallelism: a copy whose
        expert lives on another rank, weight 0). They are dropped before the experts run and
        contribute exactly zero; this costs one host synchronization (the count of valid copies).
        Under torch.compile's tracing a call is one op of the graph (moeflow.ops), the weights among its inputs; a call
        with valid_below runs outside the graph (its row count is known only on the host).
        """
        if torch.compiler.is_compiling():
            if valid_below is not None:
                return torch.compiler.disable(self._call, reason="moeflow ExpertsPath: valid_below syncs the host")(
                    hidden, topk_ids, topk_weights, weights, valid_below)
            scales = () if weights.w13_scale is None else (weights.w13_scale, weights.w2_scale)
            tensors = (topk_ids, topk_weights, weights.w13, weights.w2) + scales
            return ops.call(self, ExpertsPath._call_op, hidden, tensors)
        grads = ops.grad_inputs(hidden, topk_weights, weights.w13, weights.w2)
        if grads:  # inference only: a backward through the output raises MF307 (moeflow.ops.inference_only)
            return ops.inference_only(lambda: self._call(hidden, topk_ids, topk_weights, weights, valid_below),
                                      "experts", *grads)
        return self._call(hidden, topk_ids, topk_weights, weights, valid_below)

    def _call_op(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
                 w13_scale: Tensor | None = None, w2_scale: Tensor | None = None) -> Tensor:
        """__call__ as torch.compile's op runs it: the weights as tensors."""
        return self._call(hidden, topk_ids, topk_weights, ExpertWeights(w13, w2, w13_scale, w2_scale))

    def _call(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, weights: ExpertWeights,
              valid_below: int | None = None) -> Tensor:
        """__call__ outside torch.compile's tracing (the environment read once: moeflow.env.one_reading)."""
        with moeflow_env.one_reading():
            if moeflow_env.VALIDATE_INPUTS.get_bool():
                self._check(hidden, topk_ids, topk_weights, weights, valid_below)
            with own_precision(hidden):  # the layer's numerics, not torch.autocast's (as MoE's calls)
                return self._call_once(hidden, topk_ids, topk_weights, weights, valid_below)

    def _check(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, weights: ExpertWeights,
               valid_below: int | None) -> None:
        """Shapes, dtypes and devices of a call's inputs and weights (MF301 / MF302 / MF303), as MoE.forward_topk
        checks its own; no host synchronization (the ids are the caller's routing: their range is not read).
        With valid_below the ids may have more columns than top_k (an expert-parallel rank with fewer experts
        than the model's top_k: transformers' experts call plans top_k = min(K, E_local))."""
        cfg = self.config
        e, h = cfg.num_experts, cfg.hidden_size
        t = hidden.shape[0] if isinstance(hidden, Tensor) and hidden.dim() == 2 else None
        k = cfg.top_k if valid_below is None else None
        check_input(hidden, "hidden", (None, h), cfg)
        check_input(topk_ids, "topk_ids", (t, k), cfg, dtype_ok=ID_DTYPES.__contains__, dtype_desc=ID_DTYPES_DESC)
        check_input(topk_weights, "topk_weights", (t, k) if k else tuple(topk_ids.shape), cfg,
                    dtype_ok=lambda d: d.is_floating_point, dtype_desc="a floating dtype")
        stored = FP8_DTYPE if self.scheme.quantized else cfg.dtype
        for name, w, hf_name in (("weights.w13", weights.w13, "gate_up_proj"), ("weights.w2", weights.w2, "down_proj")):
            check_input(w, name, (e, *expert_matrix(cfg, hf_name)), cfg, dtype_ok=lambda d: d == stored,
                        dtype_desc=stored)
        for name, scale in (("weights.w13_scale", weights.w13_scale), ("weights.w2_scale", weights.w2_scale)):
            if self.scheme.quantized:
                check_input(scale, name, None, cfg, dtype_ok=lambda d: d == torch.float32, dtype_desc=torch.float32)
            elif scale is not None:
                raise error("MF302", name=name, dtype=scale.dtype, expected="None (this path's scheme is 'none')")

    def _call_once(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, weights: ExpertWeights,
                   valid_below: int | None) -> Tensor:
        if valid_below is None:  # the layer's own path: the one-launch small-batch layer where the plan has it
            def run(x, i, w, valid=None):  # valid: a bucket's padded form (moeflow.graph_buckets)
                return routed_experts(self.plan, self.dispatcher, self.runner, x, i.to(torch.int32), w.float(),
                                      weights, valid=valid)[0]
            padded = Bucketed(run) if self.plan.bucketed else None  # the padding tokens go to no expert
            return self._graphs("experts", run, (hidden, topk_ids, topk_weights),
                                lambda: (weights.w13, weights.w2, weights.w13_scale, weights.w2_scale), padded)
        ids, w = topk_ids.to(torch.int32), topk_weights.float()
        t, k = ids.shape
        flat = ids.reshape(-1)
        keep = (flat < valid_below).nonzero().squeeze(1)  # [N] flat copy indices, host sync
        rows = self._run(hidden[keep // k], flat[keep, None], w.reshape(-1)[keep, None], weights)  # [N, H]
        row_of_copy = torch.full((t * k,), -1, dtype=torch.int64, device=hidden.device)  # -1: dropped copy
        row_of_copy[keep] = torch.arange(keep.numel(), device=hidden.device)
        return gather_sum(rows, row_of_copy.view(t, k))

    def _run(self, hidden: Tensor, ids: Tensor, w: Tensor, weights: ExpertWeights) -> Tensor:
        """The separate launches (dispatch, experts, combine) for the valid copies, one a row: ids [N, 1]."""
        batch, handle = self.dispatcher.dispatch(hidden, ids, w)
        return self.dispatcher.combine(run_in_layout(self.runner, batch, weights), handle)
