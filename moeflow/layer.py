"""moeflow.MoE: the MoE layer as an nn.Module. Every backend is chosen by the planner when the layer is built
(``layer.plan``); nothing in the forward path branches on backend names.

    hidden [T, H], router_logits [T, E]
      -> route     : topk_ids [T, K] int32, topk_weights [T, K] float32      (routing/)
      -> dispatch  : ExpertBatch for this rank's experts                    (dispatch/)
      -> experts   : w * down(act(gate(x)) * up(x)) per copy                (experts/)
      -> combine   : sum of the K copies on the token's rank -> [T, H]      (dispatch/)
      (+ shared experts on every token)
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import env as moeflow_env
from . import ops
from .balance import rebalance as balancing
from .balance.placement import Placement
from .balance.slots import ExpertSlots
from .capabilities import Environment
from .config import MoEConfig
from .dispatch import create_dispatcher
from .distributed import resolve_group
from .errors import MoeflowError, error
from .experts import ExpertWeights, create_runner, gated_activation
from .graph_buckets import Bucketed
from .graphs import GraphCache
from .invariant import fixed_apply, fixed_gated_activation
from .invariant_linear import invariant_linear
from .layouts import run_in_layout
from .planner import plan as make_plan, warn_unvalidated
from .quant import create_scheme
from .routing import create_router
from .weights import EXPERT_NAMES, canonical_state, load_expert_weight, load_layer_weights


_ADOPTING: contextvars.ContextVar[dict | None] = contextvars.ContextVar("moeflow_adopting", default=None)


@contextlib.contextmanager
def adopting(tensors: dict[str, Tensor]):
    """Layers built inside with ``init_weights=False`` take ``tensors`` (by parameter name: gate_up_proj, down_proj,
    their _scale_inv, e_score_correction_bias) as those parameters where they already have the parameter's shape,
    dtype and device and are contiguous: neither allocated nor copied. integrations.hf.blocks builds its layers so:
    allocating first and swapping the checkpoint's tensors in after held one block's experts twice."""
    token = _ADOPTING.set(tensors)
    try:
        yield
    finally:
        _ADOPTING.reset(token)


class MoE(nn.Module):
    """A Mixture-of-Experts layer.

    Build from a :class:`MoEConfig` or its fields as keywords::

        moe = MoE(num_experts=8, hidden_size=4096, intermediate_size=14336, top_k=2,
                  dtype=torch.bfloat16, device="cuda", quant="fp8-block")
        moe.load_weights({"gate_up_proj": w13, "down_proj": w2})   # [E, 2I, H], [E, H, I]
        y = moe(x, router_logits)                                  # [T, H], [T, E] -> [T, H]

    Weights start random (uniform ±1/sqrt(fan_in), like nn.Linear) until ``load_weights``;
    ``init_weights=False`` skips that (the parameters are then uninitialized memory: load weights
    before the first forward; this saves time and memory when a checkpoint follows at once).
    Parameters use Hugging Face names, so ``state_dict()`` keys are checkpoint keys.
    """

    def __init__(self, config: MoEConfig | None = None, *, process_group=None, init_weights: bool = True,
                 **fields):
        super().__init__()
        if config is None:
            config = MoEConfig(**fields)
        elif not isinstance(config, MoEConfig):
            raise error("MF101", field="config", value=type(config).__name__,
                        why="must be a MoEConfig; pass a dict of its fields as keywords: MoE(**fields)")
        elif fields:
            config = config.replace(**fields)
        self.__dict__.update(_built(config, process_group))
        self._make_parameters(None if init_weights else _ADOPTING.get())
        if init_weights:
            self.reset_parameters()
        self._register_ops()

    def __setstate__(self, state):  # copies (copy.deepcopy) and unpickled layers: their own keys in moeflow.ops
        super().__setstate__(state)
        self._register_ops()

    def __deepcopy__(self, memo):
        """copy.deepcopy: a layer in a process group of one rank shares the group with its copy (torch's groups cannot
        be copied); an expert-parallel layer is MF508."""
        group = self._group_for("copying")
        if group is not None:
            memo[id(group)] = group
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(super().__getstate__(), memo))
        return copied

    def __getstate__(self):
        """pickle / torch.save of the layer: MF508 where it holds a process group (torch's cannot be pickled)."""
        if self._group_for("pickling") is not None:
            raise error("MF508", how="pickling", name=self.plan.dispatcher, world=1,
                        why="its process group cannot be pickled; save its state_dict")
        return super().__getstate__()

    def _group_for(self, how: str):
        """The dispatcher's process group (None without one); MF508 for an expert-parallel layer."""
        world = self.environment.world_size
        if world > 1:
            raise error("MF508", how=how, name=self.plan.dispatcher, world=world,
                        why="the copy would exchange with no other rank's layer")
        return self.dispatcher.process_group

    def _apply(self, fn, recurse=True):
        """nn.Module's .to(device / dtype), .cuda(), .cpu(), .half(), .bfloat16(), .float(), .to_empty(): the layer is
        planned again for the device and dtype ``fn`` gives a floating tensor, with construction's checks and coded
        errors (MF104, MF106, MF2xx), raised before any tensor moves. The FP8 weights and the float32 scales and
        correction bias move but keep their dtypes (a plain nn.Module would round them to the new dtype). An
        expert-parallel layer's conversion builds its dispatcher again, which is collective as at construction: every
        rank of the group converts its layer (a rank left out ends the others' wait in MF502)."""
        cfg = self.config
        here = torch.empty(0, dtype=cfg.dtype, device=cfg.device)  # device "cuda" reads as cuda:N here
        probe = fn(here)
        rebuilt = None
        if (probe.dtype, probe.device) != (here.dtype, here.device):
            # a payload set with dispatcher.with_payload(...) carries over (the dispatcher is built from the config)
            payload = getattr(self.dispatcher, "payload", cfg.dispatch_payload)
            rebuilt = _built(cfg.replace(dtype=probe.dtype, device=probe.device, dispatch_payload=payload),
                             self.dispatcher.process_group)
        keep = {id(t) for t in self._stored_dtypes()}

        def convert(t: Tensor) -> Tensor:
            if id(t) in keep:
                target = fn(t.new_empty(0))
                if target.dtype != t.dtype:
                    return t.to(device=target.device)
            return fn(t)

        super()._apply(convert, recurse)
        if rebuilt is not None:
            self.__dict__.update(rebuilt)
            self._register_ops()
        return self

    def _stored_dtypes(self) -> list[Tensor]:
        """The parameters whose dtype is the scheme's, not the layer dtype's: FP8 weights, their float32 scales,
        the float32 correction bias."""
        names = ["e_score_correction_bias"]
        if self.scheme.quantized:
            names += ["gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv"]
        return [t for t in (getattr(self, n) for n in names) if t is not None]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """load_state_dict: the expert weights go through load_weights' conversions (moeflow.weights), so a
        high-precision checkpoint quantizes into an FP8 layer, an FP8 one of another scheme is requantized, an FP8
        one dequantizes into a layer without FP8, and all E experts give an expert-parallel rank its own; torch's
        plain copy would round the values into the parameter's dtype and keep stale scales. Misshaped or
        scale-less FP8 weights raise MF402 / MF404. The other tensors are read as load_weights reads them too
        (weights.canonical_state: Qwen2-MoE's ``shared_expert.`` spelling, FP8 shared weights dequantized, the layer's
        dtypes and device, also under ``assign=True``); ``state_dict``, torch's copy of the caller's, is changed in
        place, before torch hands the children their keys."""
        canonical_state(state_dict, prefix, self.config)
        own = {k: v for k, v in state_dict.items() if k.startswith(prefix)}
        for name in EXPERT_NAMES:
            if prefix + name + "_scale_inv" in own and prefix + name not in own:  # a new scale on a stale weight
                raise error("MF404", name=name + "_scale_inv",
                            why=f"given without {name}: a scale is read with its weight (give both, or neither)")
            if prefix + name in own:
                load_expert_weight(self, name, own[prefix + name], own.get(prefix + name + "_scale_inv"))
                own[prefix + name] = getattr(self, name).detach()  # stored: torch's copy below is of itself
                scale = getattr(self, name + "_scale_inv")
                if scale is not None:
                    own[prefix + name + "_scale_inv"] = scale.detach()
                else:
                    own.pop(prefix + name + "_scale_inv", None)
        super()._load_from_state_dict(own, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _register_ops(self) -> None:
        """Make this layer's eager forwards callable by torch.compile's op (moeflow.ops)."""
        for fn in (MoE._forward_eager, MoE._forward_topk_eager):
            ops.register(self, fn, self.plan.graph_safe, self.config.device)

    # ---------------------------------------------------------------- parameters
    def _make_parameters(self, adopt: dict[str, Tensor] | None = None):
        """The parameters, uninitialized; those ``adopt`` holds in their shape, dtype and device (contiguous) are
        its tensors themselves (adopting)."""
        cfg = self.config
        e, h, i = len(self.local_experts), cfg.hidden_size, cfg.intermediate_size
        store = torch.float8_e4m3fn if self.scheme.quantized else cfg.dtype
        device = torch.empty(0, device=cfg.device).device  # "cuda" as cuda:N, as the tensors report theirs
        adopt = adopt or {}

        def param(name, *shape, dtype):
            t = adopt.get(name)
            if (t is not None and (tuple(t.shape), t.dtype, t.device) == (shape, dtype, device)
                    and t.is_contiguous()):
                return nn.Parameter(t, requires_grad=False)
            return nn.Parameter(torch.empty(shape, dtype=dtype, device=cfg.device), requires_grad=False)

        self.gate_up_proj = param("gate_up_proj", e, 2 * i, h, dtype=store)
        self.down_proj = param("down_proj", e, h, i, dtype=store)
        if self.scheme.quantized:
            gate_up_scale = self.scheme.weight_scale_shape(e, 2 * i, h)
            down_scale = self.scheme.weight_scale_shape(e, h, i)
            self.gate_up_proj_scale_inv = param("gate_up_proj_scale_inv", *gate_up_scale, dtype=torch.float32)
            self.down_proj_scale_inv = param("down_proj_scale_inv", *down_scale, dtype=torch.float32)
        else:
            self.gate_up_proj_scale_inv = self.down_proj_scale_inv = None
        self.e_score_correction_bias = (param("e_score_correction_bias", cfg.num_experts, dtype=torch.float32)
                                        if cfg.use_correction_bias else None)
        if cfg.shared_size:
            self.shared_experts = _SharedMLP(h, cfg.shared_size, cfg.dtype, cfg.device)
            self.shared_expert_gate = (nn.Linear(h, 1, bias=False, dtype=cfg.dtype, device=cfg.device).requires_grad_(False)
                                       if cfg.shared_expert_gate else None)
        else:
            self.shared_experts = self.shared_expert_gate = None

    @torch.no_grad()
    def reset_parameters(self):
        """Random weights: uniform ±1/sqrt(fan_in) in high precision, quantized by the scheme; drawn one expert at
        a time (a whole high-precision draw would be a second copy of the layer's weights)."""
        cfg = self.config
        h, i = cfg.hidden_size, cfg.intermediate_size
        for name, shape, fan_in in (("gate_up_proj", (2 * i, h), h), ("down_proj", (h, i), i)):
            def draw(e, shape=shape, fan_in=fan_in):
                w = torch.empty(shape, dtype=cfg.dtype, device=cfg.device)
                return w.uniform_(-1, 1).mul_(1 / math.sqrt(fan_in))
            self._store_expert_weight(name, draw)
        balancing.share_replicas(self)  # a replica holds its expert's weights, not a draw of its own
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.zero_()
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters()
            if self.shared_expert_gate is not None:
                self.shared_expert_gate.reset_parameters()

    def _store_expert_weight(self, name: str, values: Callable[[int], Tensor]) -> None:
        """Store expert weight ``name`` quantized by the scheme, one local expert at a time: ``values(e)`` -> [N, K]
        high-precision weight of local expert e (any device). Every scheme's scale is per expert, so this stores the
        same bits as quantizing the whole [E_local, N, K] at once, whose float32 temporaries would be several times
        the weight (about 60 GB for DeepSeek-V3's gate_up)."""
        dst, dst_scale = getattr(self, name), getattr(self, name + "_scale_inv")
        for e in range(dst.shape[0]):
            q, scale = self.scheme.quantize_weight(values(e)[None].to(self.config.device))
            dst.data[e:e + 1].copy_(q)
            if scale is not None:
                dst_scale.data[e:e + 1].copy_(scale)

    def load_weights(self, state: dict[str, Tensor], strict: bool = True) -> None:
        """Load Hugging Face names and layouts (``moeflow.weights.load_layer_weights`` lists them)."""
        load_layer_weights(self, state, strict)

    def expert_weights(self) -> ExpertWeights:
        return ExpertWeights(self.gate_up_proj, self.down_proj, self.gate_up_proj_scale_inv, self.down_proj_scale_inv)

    # ---------------------------------------------------------------- load balancing (docs/load-balancing.md)
    @property
    def placement(self) -> Placement:
        """The layer's physical expert slots now: slot -> (logical expert, rank), replicas included."""
        return self.expert_slots.placement

    def expert_load(self, reset: bool = False, all_ranks: bool = False) -> Tensor:
        """[E] int64 on the layer's device: token copies routed to each logical expert since the last reset (the
        window), counted on the device in the forward (record_expert_load=True, else MF512). reset: zero the counter
        after reading it. all_ranks: summed over the expert-parallel group (collective: every rank calls it)."""
        return balancing.expert_load(self, reset, all_ranks)

    def rebalance(self, placement: Placement) -> None:
        """Move the experts to ``placement`` (moeflow.balance.plan_placement makes one) without rebuilding the layer:
        collective over the layer's group, every rank with the same placement (MF511), each keeping its slot count
        (MF510); weights move by torch.distributed and every table is rewritten in place."""
        balancing.rebalance(self, placement)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """state_dict: one row per logical expert this rank holds (ascending; all E in one process), the replicas
        left out; without replicas the parameters as they are."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        rows = balancing.logical_rows(self.local_experts)
        for name in balancing.EXPERT_TENSORS if rows is not None else ():
            if prefix + name in destination:
                t = getattr(self, name)
                destination[prefix + name] = t.detach()[rows]

    # ---------------------------------------------------------------- forward
    def forward(self, hidden_states: Tensor, router_logits: Tensor) -> Tensor:
        """hidden_states [T, H] layer dtype, router_logits [T, E] any float -> [T, H] layer dtype."""
        if torch.compiler.is_compiling():  # one op of the compiled graph: _forward_eager at run time (moeflow.ops)
            return ops.call(self, MoE._forward_eager, hidden_states, (router_logits,), self.parameters)
        grads = ops.grad_inputs(hidden_states, router_logits, weights=self.parameters())
        if grads:  # inference only: a backward through the output raises MF307 (moeflow.ops.inference_only)
            return ops.inference_only(lambda: self._forward_eager(hidden_states, router_logits), "layer", *grads)
        return self._forward_eager(hidden_states, router_logits)

    def forward_topk(self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        """hidden_states [T, H], topk_ids [T, K] int, topk_weights [T, K] float -> [T, H].

        The caller routed: weights are used as given (no renormalization or scaling here).
        """
        if torch.compiler.is_compiling():  # one op of the compiled graph: _forward_topk_eager at run time
            return ops.call(self, MoE._forward_topk_eager, hidden_states, (topk_ids, topk_weights), self.parameters)
        grads = ops.grad_inputs(hidden_states, topk_weights, weights=self.parameters())
        if grads:  # inference only: a backward through the output raises MF307 (moeflow.ops.inference_only)
            return ops.inference_only(lambda: self._forward_topk_eager(hidden_states, topk_ids, topk_weights),
                                      "layer", *grads)
        return self._forward_topk_eager(hidden_states, topk_ids, topk_weights)

    def _forward_eager(self, hidden_states: Tensor, router_logits: Tensor) -> Tensor:
        """forward() outside torch.compile's tracing (which cannot build the coded errors: the checks run here, when
        a compiled graph's op runs). The environment is read once for the call (moeflow.env.one_reading)."""
        cfg = self.config
        with moeflow_env.one_reading():
            if _validating():
                with self._refusal_takes_part():
                    check_input(hidden_states, "hidden_states", (None, cfg.hidden_size), cfg)
                    check_input(router_logits, "router_logits", (hidden_states.shape[0], cfg.num_experts), cfg,
                                dtype_ok=lambda d: d.is_floating_point, dtype_desc="a floating dtype")
            with own_precision(hidden_states):
                return self._graphs("forward", self._route_and_run, (hidden_states, router_logits),
                                    self._weight_tensors, self._bucketed(self._route_and_run))

    def _forward_topk_eager(self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        """forward_topk() outside torch.compile's tracing (as _forward_eager)."""
        cfg = self.config
        with moeflow_env.one_reading():
            if _validating():
                with self._refusal_takes_part():
                    t = hidden_states.shape[0] if hidden_states.dim() == 2 else None
                    check_input(hidden_states, "hidden_states", (None, cfg.hidden_size), cfg)
                    check_input(topk_ids, "topk_ids", (t, cfg.top_k), cfg, dtype_ok=ID_DTYPES.__contains__,
                                dtype_desc=ID_DTYPES_DESC)
                    check_input(topk_weights, "topk_weights", (t, cfg.top_k), cfg,
                                dtype_ok=lambda d: d.is_floating_point, dtype_desc="a floating dtype")
                    if not _capturing(hidden_states):
                        _check_ids(topk_ids, cfg.num_experts)
            with own_precision(hidden_states):
                return self._graphs("forward_topk", self._run_topk, (hidden_states, topk_ids, topk_weights),
                                    self._weight_tensors, self._bucketed(self._run_topk))

    @contextlib.contextmanager
    def _refusal_takes_part(self):
        """Around a call's input checks: on an expert-parallel rank, a refused call (MF30x) first takes its part in
        the call's collectives with no tokens, so the other ranks' call completes with their right results (instead
        of pairing with this rank's next call, a silent mismatch), then the refusal is raised, as MF503's overflow
        does. One process: the refusal alone."""
        try:
            yield
        except MoeflowError:
            if self.environment.world_size > 1:
                cfg, k = self.config, self.config.top_k
                self._run(torch.empty(0, cfg.hidden_size, dtype=cfg.dtype, device=cfg.device),
                          torch.empty(0, k, dtype=torch.int32, device=cfg.device),
                          torch.empty(0, k, dtype=torch.float32, device=cfg.device))
            raise

    def _route_and_run(self, hidden: Tensor, router_logits: Tensor, valid: Tensor | None = None) -> Tensor:
        """Route, then _run. valid: as _run's (a bucket's inputs padded with zero rows past valid[0] tokens)."""
        topk_ids, topk_weights = self.router(router_logits, self.e_score_correction_bias)
        return self._run(hidden, topk_ids, topk_weights, valid)

    def _run_topk(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, valid: Tensor | None = None) -> Tensor:
        """_run on the caller's routing, in the dtypes the dispatchers take. valid: as _run's."""
        return self._run(hidden, topk_ids.to(torch.int32), topk_weights.float(), valid)

    def _bucketed(self, fn) -> Bucketed | None:
        """fn (an entry taking ``valid`` last) as the eager graphs' padded form where the plan allows buckets
        (Plan.bucketed), else None."""
        return Bucketed(fn) if self.plan.bucketed else None

    def _weight_tensors(self) -> tuple:
        """Every tensor a forward reads in place (the parameters), for the eager graphs' keys."""
        return tuple(self.parameters())

    def _run(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, valid: Tensor | None = None) -> Tensor:
        """The layer after routing. valid: a bucketed call's token count, the rows past it padding (routed_experts)."""
        topk_ids = self.expert_slots(topk_ids, valid)  # counted; logical experts -> physical slots (moeflow.balance)
        out, shared = routed_experts(self.plan, self.dispatcher, self.runner, hidden, topk_ids, topk_weights,
                                     self.expert_weights(), lambda: self._shared(hidden), valid)
        if shared is not None:
            out = (out.float() + shared).to(self.config.dtype)
        return out

    def _shared(self, hidden: Tensor) -> Tensor | None:
        """Shared experts on every token: [T, H] float32, or None without shared experts."""
        if self.shared_experts is None:
            return None
        cfg = self.config
        shared = self.shared_experts(hidden, cfg.activation, cfg.batch_invariant)
        if self.shared_expert_gate is not None:
            if cfg.batch_invariant:  # a fixed-tile product and one code path for the sigmoid (moeflow.invariant)
                logit = invariant_linear(hidden, self.shared_expert_gate.weight).to(cfg.dtype).float()
                return shared * fixed_apply(torch.sigmoid, logit)
            shared = shared * torch.sigmoid(self.shared_expert_gate(hidden).float())
        return shared

    def extra_repr(self) -> str:
        c = self.config
        return (f"E={c.num_experts} (local {len(self.local_experts)}), H={c.hidden_size}, I={c.intermediate_size}, "
                f"K={c.top_k}, quant={self.plan.scheme}, runner={self.plan.runner}, dispatcher={self.plan.dispatcher}, "
                f"dtype={str(c.dtype).removeprefix('torch.')}, device={c.device}")


def routed_experts(plan, dispatcher, runner, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                   weights: ExpertWeights, between=None, valid: Tensor | None = None) -> tuple[Tensor, object]:
    """The layer after routing -> (out [T, H] layer dtype, between()'s result or None).

    Where the plan allows it (Plan.fused_layer) and the runner's tuned data has a one-launch config for T
    tokens, the runner runs dispatch, experts and combine together; else dispatch -> experts (in the
    runner's layout) -> combine. between (no arguments): work to overlap with the dispatch exchange (the
    shared experts), called once either way. valid: [1] int64 on the device, or None: the inputs of a bucketed call
    (moeflow.graph_buckets, Plan.bucketed), whose rows from valid[0] on are padding: their copies go to no expert in the
    dispatcher's dropping form, and the separate launches run (the one-launch layer routes every row)."""
    if valid is not None:
        dispatcher = dispatcher.dropping(valid)
    fused = runner.fused_config(hidden.shape[0], weights) if plan.fused_layer and valid is None else None
    if fused is not None:
        out = runner.run_fused(hidden, topk_ids, topk_weights, weights, fused)
        return out, between() if between else None
    pending = dispatcher.dispatch_start(hidden, topk_ids, topk_weights)
    extra = between() if between else None
    batch, handle = dispatcher.dispatch_wait(pending)
    expert_out = run_in_layout(runner, batch, weights)
    return dispatcher.combine_wait(dispatcher.combine_start(expert_out, handle)), extra


class _SharedMLP(nn.Module):
    """Shared experts merged into one gated MLP: gate_proj/up_proj [S, H], down_proj [H, S]."""

    def __init__(self, hidden: int, size: int, dtype, device):
        super().__init__()
        make = lambda i, o: nn.Linear(i, o, bias=False, dtype=dtype, device=device).requires_grad_(False)
        self.gate_proj, self.up_proj, self.down_proj = make(hidden, size), make(hidden, size), make(size, hidden)

    def reset_parameters(self):
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            lin.reset_parameters()

    def forward(self, x: Tensor, activation: str, invariant: bool = False) -> Tensor:
        """x [T, H] -> [T, H] float32 (the intermediate rounded to the layer dtype, as routed experts). invariant
        (MoEConfig.batch_invariant): the three products in one fixed tile for every T and the activation on one code
        path (moeflow.invariant), the same roundings."""
        if invariant:
            mm = invariant_linear
            h = torch.cat([mm(x, self.gate_proj.weight), mm(x, self.up_proj.weight)], dim=-1).to(x.dtype)
            return mm(fixed_gated_activation(h, activation).to(x.dtype), self.down_proj.weight)
        h = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
        return F.linear(gated_activation(h, activation).to(x.dtype), self.down_proj.weight).float()


def _built(config: MoEConfig, process_group) -> dict:
    """Plan ``config`` and create its backends -> the layer attributes they set. Nothing is set here, so a
    refusal (a coded error) leaves a layer being converted (MoE._apply) as it was."""
    environment = Environment.detect(config.device, _world_size(process_group))
    plan = make_plan(config, environment)
    warn_unvalidated(plan)  # a GPU the kernels are compiled for but were never run on: once per process
    scheme = create_scheme(plan.scheme, weight_only=plan.weight_only)
    dispatcher = create_dispatcher(plan.dispatcher, config, scheme, process_group, indexed_rows=plan.indexed_rows,
                                   planned=plan)
    return dict(config=config, environment=environment, plan=plan, scheme=scheme,
                router=create_router(config, plan.router), dispatcher=dispatcher,
                runner=create_runner(plan.runner, config, scheme), local_experts=dispatcher.local_experts,
                expert_slots=ExpertSlots.of(config, dispatcher),  # replicas and the load counter (moeflow.balance)
                _graphs=GraphCache(plan.graph_safe))  # eager calls of small batches replayed (moeflow.graphs)


# ---------------------------------------------------------------- input validation
def _world_size(process_group) -> int:
    """World size of the expert-parallel group: ``process_group``, else the default group once
    torch.distributed is initialized (torchrun), else 1."""
    process_group = resolve_group(process_group)
    if process_group is not None:
        return torch.distributed.get_world_size(process_group)
    return 1


def _validating() -> bool:
    return moeflow_env.VALIDATE_INPUTS.get_bool()


def _capturing(t: Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def own_precision(t: Tensor):
    """torch.autocast off for the call where it is on for t's device: the layer computes by its numerics contract
    (README: the scheme's quantization, float32 accumulation, the intermediate in the layer dtype) in every runner,
    where autocast would have recast the torch runners' matmuls alone (reference: an fp32 layer's GEMMs in bf16)."""
    try:
        on = torch.is_autocast_enabled(t.device.type)
    except RuntimeError:  # a device type autocast does not know
        on = False
    return torch.autocast(t.device.type, enabled=False) if on else contextlib.nullcontext()


# topk_ids a caller routes with (forward_topk, ExpertsPath): any of torch's integer dtypes, read as int32
ID_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64)
ID_DTYPES_DESC = "an integer dtype (" + ", ".join(str(d).removeprefix("torch.") for d in ID_DTYPES) + ")"


def check_input(t, name, shape, cfg, dtype_ok=None, dtype_desc=None):
    """t must be a tensor of ``shape`` (sizes, None for any: T), the layer's device, and the layer dtype (or a
    dtype ``dtype_ok`` accepts, described by ``dtype_desc``); else MF301 / MF302 / MF303. shape None: any shape."""
    if not isinstance(t, Tensor):
        raise error("MF302", name=name, dtype=type(t).__name__, expected="a torch.Tensor")
    if shape is not None and (t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape))):
        expected = "[" + ", ".join("T" if s is None else str(s) for s in shape) + "]"
        raise error("MF301", name=name, shape=tuple(t.shape), expected=expected)
    ok = dtype_ok(t.dtype) if dtype_ok else t.dtype == cfg.dtype
    if not ok:
        raise error("MF302", name=name, dtype=t.dtype, expected=dtype_desc or cfg.dtype)
    if t.device.type != cfg.device.type or (cfg.device.index is not None and t.device.index != cfg.device.index):
        raise error("MF303", name=name, device=t.device, expected=cfg.device)


def _check_ids(topk_ids: Tensor, num_experts: int) -> None:
    """One host sync: range of ids, and whether any row repeats an expert."""
    if topk_ids.numel() == 0:
        return
    ids = topk_ids.to(torch.int64)
    srt = ids.sort(dim=1).values
    dup = (srt[:, 1:] == srt[:, :-1]).any(dim=1)
    lo, hi, any_dup = torch.stack([ids.min(), ids.max(), dup.any().to(torch.int64)]).tolist()
    if lo < 0 or hi >= num_experts:
        raise error("MF304", lo=lo, hi=hi, max_id=num_experts - 1)
    if any_dup:
        row = int(dup.nonzero()[0, 0])
        r = srt[row]
        expert = int(r[1:][r[1:] == r[:-1]][0])
        raise error("MF305", token=row, expert=expert)
