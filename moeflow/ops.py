"""The layer's forward as a torch custom op, so that torch.compile compiles models that hold moeflow layers.

Why: torch.compile's tracer (dynamo) cannot follow a layer's forward. The forward is planner data, Triton
launches with host-side config lookups and eager-graph caches. Traced directly, it failed: on CPU in grouped_mm's
fake kernel, which refuses float32 (tests/test_compile.py has the model that showed it). A model holding a
moeflow layer could not be compiled, which is how serving engines and transformers' static-cache generation run
models.
How: while torch.compile traces (torch.compiler.is_compiling()), MoE.forward / forward_topk, transformers'
"moeflow" experts and ExpertsPath call ``torch.ops.moeflow.layer(hidden, routing, owner, weights)`` instead:

    hidden [T, H] float, routing: [router_logits [T, E]] or [topk_ids [T, K], topk_weights [T, K]] (ExpertsPath:
    then the caller's weights w13, w2 and their scales), owner: the key of the layer (or experts module, or path)
    and of its eager function, weights: the owner's parameters that require grad, with grad mode on (else empty;
    read by autograd only) -> [T, H], hidden's dtype, a new contiguous tensor

The op's fake implementation gives that shape, so the compiled graph holds one opaque node per layer. At run time
the op calls the owner's eager function, launch by launch: the layer's own eager graphs (moeflow.graphs) stand
aside, since mode="reduce-overhead" warms up and records in a memory pool that a graph of theirs would outlive. A
compiled model without CUDA graphs (the default mode) therefore pays each launch's host cost, as an eager model with
MOEFLOW_EAGER_GRAPHS=0 does, and the op's own Python dispatch on top: 90-150 µs more a layer call than eager on the
lent H200's host, with no synchronization (benchmarks/results/compile_2026-12-03_h200.md). The input checks run in
the eager function too: dynamo cannot build moeflow's coded errors, so a bad input raises its code when the
compiled graph runs, not when it is traced.
Owners: an owner is registered outside tracing (register: a layer or an ExpertsPath when it is built or copied, a
transformers experts module when its path is planned), under a key made of its identity (id) and its eager function,
held weakly: a copy of a layer has its own key, and an op whose owner is gone (an exported graph run in another process)
raises MF306. Tracing reads the key and the owner's graph safety from the registry. An owner not registered yet (a
transformers experts module never called before the model was compiled) runs its eager function outside the graph:
the compiled model is right but broken into pieces around each such call, and stays so. Planning the experts before
compiling (moeflow.integrations.hf.prepare_experts, or one eager call) registers them and avoids the breaks.
CUDA graphs: torch.compile(mode="reduce-overhead") records the op's launches in its own graphs. A plan that is not
graph-safe (Plan.graph_safe False: the reference runner, the expert-parallel dispatchers, their host
synchronization) calls ``torch.ops.moeflow.layer_host_sync`` instead, the same op tagged
torch.Tag.cudagraph_unsafe. Inductor then keeps that op out of its CUDA graphs.
Not supported: gradients (moeflow is for inference). With grad mode on, the owner's parameters that require grad
are inputs of the op too (``weights``), and the op's backward is one op, refuse_gradient, whose fake gives the
gradients' shapes (so the compile succeeds and the forward computes, as an eager call) and which raises MF307 when
a backward runs, as an eager call's backward does. Nor torch.export of a model for use in another process (the owner
key names a layer of this process).
"""
from __future__ import annotations

import itertools
import weakref
from typing import Callable

import torch
from torch import Tensor

from . import graphs
from .errors import error

_OWNERS: dict[str, tuple[weakref.ref, Callable]] = {}  # key -> (owner, eager fn)
_GRAPH_SAFE: dict[str, bool] = {}  # key -> whether the owner's calls may be captured (what tracing reads)


def owner_key(owner, fn: Callable) -> str:
    """The key the op names ``fn(owner, hidden, *routing)`` by: the owner's class, fn's name and the owner's id.
    Traceable: dynamo folds id() of an object it guards to a constant."""
    return type(owner).__name__ + "." + fn.__name__ + "@" + str(id(owner))


def register(owner, fn: Callable, graph_safe: bool) -> None:
    """Make ``fn(owner, hidden, *routing)`` callable by the op (outside tracing). graph_safe: the owner's
    Plan.graph_safe. The entry goes when the owner does."""
    key = owner_key(owner, fn)
    _OWNERS[key] = (weakref.ref(owner, lambda _, k=key: _forget(k)), fn)
    _GRAPH_SAFE[key] = graph_safe


def registered(owner, fn: Callable) -> bool:
    return owner_key(owner, fn) in _GRAPH_SAFE


def _forget(key: str) -> None:
    _OWNERS.pop(key, None)
    _GRAPH_SAFE.pop(key, None)


def _run(hidden: Tensor, routing: list[Tensor], owner: str, weights: list[Tensor]) -> Tensor:
    """The op at run time: the owner's eager function on hidden and routing (``weights`` are inputs for autograd's
    sake only: the owner reads its own)."""
    entry = _OWNERS.get(owner)
    target = entry[0]() if entry else None
    if target is None:
        raise error("MF306", owner=owner)
    with graphs.standing_aside():  # the compiled model's CUDA graphs, if any, are its own (moeflow.graphs)
        return entry[1](target, hidden, *routing)


def _fake(hidden: Tensor, routing: list[Tensor], owner: str, weights: list[Tensor]) -> Tensor:
    return hidden.new_empty(hidden.shape)


def _refuse(op: str, grad: Tensor, like: list[Tensor]) -> list[Tensor]:
    """The layer op's backward, run: MF307 (moeflow computes inference only). ``grad``, the output's gradient, ties
    the op to the backward: without it AOTAutograd's partitioner ran it in the forward graph."""
    raise error("MF307", op=op)


def _refuse_fake(op: str, grad: Tensor, like: list[Tensor]) -> list[Tensor]:
    return [t.new_empty(t.shape) for t in like]


# the backward's one op: traced (fake) it gives a gradient for each floating input, so torch.compile compiles a model
# with grad mode on as eager runs it, and the backward graph keeps it (its outputs are the gradients); run, it raises
# MF307, as an eager call's backward does (inference_only), instead of failing the compile inside torch's
# BackendCompilerFailed or, where only the weights required grad, leaving them without gradients
refuse_gradient = torch.library.custom_op("moeflow::refuse_gradient", _refuse, mutates_args=())
refuse_gradient.register_fake(_refuse_fake)


def _define(name: str, tags: tuple):
    op = torch.library.custom_op(f"moeflow::{name}", _run, mutates_args=(), tags=tags)
    op.register_fake(_fake)

    def setup_context(ctx, inputs, output):
        hidden, routing, _owner, weights = inputs
        ctx.save_for_backward(hidden, *routing, *weights)
        ctx.routing = len(routing)

    def backward(ctx, grad):
        saved = ctx.saved_tensors
        floating = [i for i, t in enumerate(saved) if t.is_floating_point()]
        grads = [None] * len(saved)
        for i, g in zip(floating, refuse_gradient(name, grad, [saved[i] for i in floating])):
            grads[i] = g
        return grads[0], grads[1:1 + ctx.routing], None, grads[1 + ctx.routing:]

    op.register_autograd(backward, setup_context=setup_context)
    return op


_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)  # torch versions without the tag: no tag
layer = _define("layer", ())
layer_host_sync = _define("layer_host_sync", (_UNSAFE,) if _UNSAFE is not None else ())


_UNREGISTERED_REASON = ("moeflow: a layer's first call before it is registered with moeflow.ops (a transformers "
                        "experts module not yet planned, or a copy of a planned one: call "
                        "moeflow.integrations.hf.prepare_experts(model) before torch.compile)")


def _unregistered(owner, fn: Callable, hidden: Tensor, routing: tuple[Tensor, ...]) -> Tensor:
    return fn(owner, hidden, *routing)


_DISABLED: list = []  # _unregistered wrapped by torch.compiler.disable, made outside tracing (prepare_tracing)


def prepare_tracing() -> None:
    """Wrap the function unregistered owners run through with torch.compiler.disable now, outside tracing (the
    transformers integration does when it registers "moeflow"; transformers has imported dynamo by then). Wrapped
    inside tracing, dynamo stopped at the disable call itself, and its message, fullgraph=True's error among them,
    dropped moeflow's reason (prepare_experts)."""
    if not _DISABLED:
        _DISABLED.append(torch.compiler.disable(_unregistered, reason=_UNREGISTERED_REASON))


def call(owner, fn: Callable, hidden: Tensor, routing: tuple[Tensor, ...], weights: Callable = tuple) -> Tensor:
    """fn(owner, hidden, *routing) as one op of the traced graph (module docstring): the graph-safe op or the one
    tagged cudagraph_unsafe, as registered; run outside the graph where the owner is not registered. ``weights()``:
    the owner's parameters, which it reads itself (called with grad mode on only); those that require grad become
    inputs of the op, so that a backward reaches the op's (MF307) where they alone require grad."""
    key = owner_key(owner, fn)
    if key not in _GRAPH_SAFE:  # run outside the graph (not disabled at import: that would import dynamo)
        run = _DISABLED[0] if _DISABLED else torch.compiler.disable(_unregistered, reason=_UNREGISTERED_REASON)
        return run(owner, fn, hidden, routing)
    op = layer if _GRAPH_SAFE[key] else layer_host_sync
    trainable = [w for w in weights() if w.requires_grad] if torch.is_grad_enabled() else []
    return op(hidden, list(routing), key, trainable)


# ---------------------------------------------------------------- eager calls with grad mode on
def grad_inputs(*tensors, weights=()) -> tuple[Tensor, ...]:
    """The inputs, then the ``weights`` (an iterable, read only with grad mode on), that require grad with grad mode
    on: an eager call's output would join an autograd graph through them (inference_only). Empty with grad mode off
    (inference_mode, no_grad, transformers' generate), at the cost of one check."""
    if not torch.is_grad_enabled():
        return ()
    return tuple(t for t in itertools.chain(tensors, weights) if isinstance(t, Tensor) and t.requires_grad)


class _InferenceOnly(torch.autograd.Function):
    """fn()'s output, computed with no autograd graph, whose backward raises MF307 (as the compiled op's does)."""

    @staticmethod
    def forward(ctx, fn, op, *inputs):
        ctx.op = op
        return fn()

    @staticmethod
    def backward(ctx, *grads):
        raise error("MF307", op=ctx.op)


def inference_only(fn: Callable, op: str, *inputs: Tensor) -> Tensor:
    """An eager call whose ``inputs`` require grad (grad_inputs): fn() as without grad, and a backward through it
    raises MF307 instead of gradients that stop silently at the layer (the Triton kernels have no backward; the CPU
    runners' torch ops would have given untested ones)."""
    return _InferenceOnly.apply(fn, op, *inputs)
