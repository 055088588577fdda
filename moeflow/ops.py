"""The layer's forward as a torch custom op, so that torch.compile compiles models that hold moeflow layers.

Why: torch.compile's tracer (dynamo) cannot follow a layer's forward. The forward is planner data, Triton
launches with host-side config lookups and eager-graph caches. Traced directly, it failed: on CPU in grouped_mm's
fake kernel, which refuses float32 (tests/test_compile.py has the model that showed it). A model holding a
moeflow layer could not be compiled, which is how serving engines and transformers' static-cache generation run
models.
How: while torch.compile traces (torch.compiler.is_compiling()), MoE.forward / forward_topk and transformers'
"moeflow" experts call ``torch.ops.moeflow.layer(hidden, routing, owner)`` instead of running:

    hidden [T, H] float, routing: [router_logits [T, E]] or [topk_ids [T, K], topk_weights [T, K]],
    owner: the key of the layer (or experts module) and of its eager function -> [T, H], hidden's dtype,
    a new contiguous tensor

The op's fake implementation gives that shape, so the compiled graph holds one opaque node per layer. At run time
the op calls the owner's eager function, eager graphs and all. The input checks run there too: dynamo cannot build
moeflow's coded errors, so a bad input raises its code when the compiled graph runs, not when it is traced. Owners are keyed by identity when
first traced (owner_key; a copy of a layer gets its own key) and held weakly: an op whose owner is gone, such as
an exported graph run in another process, raises MF306.
CUDA graphs: torch.compile(mode="reduce-overhead") records the op's launches in its own graphs. A plan that is not
graph-safe (Plan.graph_safe False: the reference runner, the expert-parallel dispatchers, their host
synchronization) calls ``torch.ops.moeflow.layer_host_sync`` instead, the same op tagged
torch.Tag.cudagraph_unsafe. Inductor then keeps that op out of its CUDA graphs.
Not supported: gradients (moeflow is for inference: the op's backward raises MF307, which torch.compile reaches
when it compiles a model with grad mode on; compile under torch.no_grad() or torch.inference_mode()), and
torch.export of a model for use in another process (the owner key names a layer of this process).
"""
from __future__ import annotations

import itertools
import weakref
from typing import Callable

import torch
from torch import Tensor

from .errors import error

_KEYS: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()  # owner -> {eager fn: key}
_OWNERS: dict[str, tuple[weakref.ref, Callable]] = {}  # key -> (owner, eager fn)
_NUMBERS = itertools.count()


@torch.compiler.assume_constant_result
def owner_key(owner, fn: Callable) -> str:
    """The key the op names ``fn(owner, hidden, *routing)`` by; registered on first use. Runs at trace time, once a
    compiled graph (its result is a constant of the graph)."""
    keys = _KEYS.setdefault(owner, {})
    if fn not in keys:
        key = f"{type(owner).__name__}.{fn.__name__}.{next(_NUMBERS)}"
        keys[fn] = key
        _OWNERS[key] = (weakref.ref(owner, lambda _, k=key: _OWNERS.pop(k, None)), fn)
    return keys[fn]


def _run(hidden: Tensor, routing: list[Tensor], owner: str) -> Tensor:
    entry = _OWNERS.get(owner)
    target = entry[0]() if entry else None
    if target is None:
        raise error("MF306", owner=owner)
    return entry[1](target, hidden, *routing)


def _fake(hidden: Tensor, routing: list[Tensor], owner: str) -> Tensor:
    return hidden.new_empty(hidden.shape)


def _define(name: str, tags: tuple):
    op = torch.library.custom_op(f"moeflow::{name}", _run, mutates_args=(), tags=tags)
    op.register_fake(_fake)

    def backward(ctx, grad):
        raise error("MF307", op=name)

    op.register_autograd(backward)
    return op


_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)  # torch versions without the tag: no tag
layer = _define("layer", ())
layer_host_sync = _define("layer_host_sync", (_UNSAFE,) if _UNSAFE is not None else ())


def call(owner, fn: Callable, hidden: Tensor, routing: tuple[Tensor, ...], graph_safe: bool) -> Tensor:
    """fn(owner, hidden, *routing) as one op of the traced graph (module docstring). graph_safe: the owner's
    Plan.graph_safe (False takes the op tagged cudagraph_unsafe)."""
    op = layer if graph_safe else layer_host_sync
    return op(hidden, list(routing), owner_key(owner, fn))
