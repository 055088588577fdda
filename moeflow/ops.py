"""The layer's forward as a torch custom op, so that torch.compile compiles models that hold moeflow layers.

dynamo cannot trace the forward (planner data, Triton launches, host-side config lookups, eager-graph caches), so
while torch.compile traces, MoE.forward / forward_topk, transformers' "moeflow" experts and ExpertsPath go through
``call``: one opaque node a layer, ``torch.ops.moeflow.layer`` (graph-safe plans) or ``layer_host_sync`` (tagged
cudagraph_unsafe: plans that synchronize with the host), whose fake gives the output's shape. At run time the op
finds its owner by an anchor tensor (register) and runs the owner's eager function launch by launch. Inference
only: a backward through the op, or through an eager call whose inputs require grad, raises MF307. Not supported:
torch.export of a model for use in another process (the op finds its owner among this process's).
"""
from __future__ import annotations

import itertools
import weakref
from typing import Callable

import torch
from torch import Tensor

from . import graphs
from .errors import error

_OWNERS: dict[str, weakref.WeakSet] = {}  # op key -> the live owners registered under it
_FNS: dict[str, Callable] = {}  # op key -> the owners' eager function
_SERIALS: dict[int, weakref.ref] = {}  # anchor serial -> its owner
_BY_ADDRESS: dict[tuple[str, int], weakref.ref] = {}  # (op key, anchor's address) -> its owner, as last resolved
_NEXT_SERIAL = itertools.count(1)
ANCHOR = "_moeflow_anchor"  # the owner's anchor: [1] int64 holding its serial
REGISTERED = "_moeflow_registered"  # the owner's registrations: eager function name -> graph safety
SERIAL = "_moeflow_serial"  # the serial the owner's anchor holds (int)
HOLDER = "_moeflow_anchor_holder"  # where an owner that is not a module keeps its anchor (_AnchorHolder)


class _Registrations(dict):
    """An owner's registrations (eager function name -> graph safety). A copy of the owner starts without any: a
    copied layer registers itself (MoE.__setstate__), a copied transformers experts module runs outside the graph
    until it is planned, as one never planned does."""

    def __copy__(self):
        return _Registrations()

    def __deepcopy__(self, memo):
        return _Registrations()

    def __reduce__(self):
        return _Registrations, ()


class _AnchorHolder(torch.nn.Module):
    """Holds the anchor of an owner that is not a module (ExpertsPath) as a module buffer: dynamo treats the tensors
    of modules as static inputs, which CUDA graph trees do not copy, so the op sees the anchor itself."""

    def __init__(self, anchor: Tensor):
        super().__init__()
        self.register_buffer(ANCHOR, anchor, persistent=False)


def op_key(owner, fn: Callable) -> str:
    """The key the op names ``fn(owner, hidden, *routing)`` by: the owner's class and fn's name. Instances share it
    and the op finds its owner by the anchor, because a key naming the owner would make dynamo guard each compiled
    frame on the layer's identity: layers compiled one by one (block.compile() for each decoder block) would each
    recompile the same code, and past dynamo's recompile limit (8) run eagerly."""
    return type(owner).__name__ + "." + fn.__name__


def anchor_of(owner) -> Tensor:
    """The owner's anchor [1] int64 (register)."""
    holder = owner if isinstance(owner, torch.nn.Module) else owner.__dict__[HOLDER]
    return getattr(holder, ANCHOR)


def _give_anchor(owner, device) -> None:
    """A new serial for the owner (SERIAL), in a new anchor on ``device``, or written into the one it has: a copy's
    anchor came with it, holding its original's serial."""
    serial = next(_NEXT_SERIAL)
    holder = owner if isinstance(owner, torch.nn.Module) else owner.__dict__.get(HOLDER)
    current = None if holder is None else getattr(holder, ANCHOR, None)
    if current is not None:
        current.fill_(serial)
    else:
        anchor = torch.full((1,), serial, dtype=torch.int64, device=device)
        if holder is None:
            owner.__dict__[HOLDER] = _AnchorHolder(anchor)
        else:
            holder.register_buffer(ANCHOR, anchor, persistent=False)
    owner.__dict__[SERIAL] = serial
    _SERIALS[serial] = weakref.ref(owner, lambda _, s=serial: _SERIALS.pop(s, None))


def register(owner, fn: Callable, graph_safe: bool, device) -> None:
    """Make ``fn(owner, hidden, *routing)`` callable by the op (outside tracing): a layer or an ExpertsPath when it
    is built or copied, a transformers experts module when its path is planned. graph_safe: the owner's
    Plan.graph_safe, read when tracing picks the op (call). The owner is held weakly under op_key(owner, fn); the
    entry goes when the owner does.

    Anchor: [1] int64 on ``device`` holding a serial of the owner's own, a non-persistent buffer of the owner (so it
    moves with it) or, for an owner that is not a module, of a holder module (dynamo takes module tensors as static
    inputs, which CUDA graph trees never copy). The traced graph holds the key as a constant and the anchor as an
    input; at run time the op finds the owner by the anchor's address, or outside graph capture by its serial. A
    copy of an owner gets its own serial here."""
    ref = _SERIALS.get(owner.__dict__.get(SERIAL))
    if ref is None or ref() is not owner:  # no anchor yet, or a copy's
        _give_anchor(owner, device)
    owner.__dict__.setdefault(REGISTERED, _Registrations())[fn.__name__] = graph_safe
    key = op_key(owner, fn)
    _OWNERS.setdefault(key, weakref.WeakSet()).add(owner)
    _FNS[key] = fn


def registered(owner, fn: Callable) -> bool:
    return fn.__name__ in owner.__dict__.get(REGISTERED, ())


def _resolve(key: str, anchor: Tensor):
    """The live owner registered under ``key`` whose anchor is ``anchor`` (by address; else, outside graph capture,
    by the serial it holds: a copy of the anchor, as torch.library.opcheck passes), or None."""
    ptr = anchor.data_ptr()
    ref = _BY_ADDRESS.get((key, ptr))
    owner = ref() if ref is not None else None
    if owner is not None and anchor_of(owner).data_ptr() == ptr:
        return owner
    # first call, or the owner's anchor moved (module.to()): look among the owners of this key
    owner = next((o for o in _OWNERS.get(key, ()) if anchor_of(o).data_ptr() == ptr), None)
    if owner is not None:
        def forget(ref, k=(key, ptr)):
            if _BY_ADDRESS.get(k) is ref:
                del _BY_ADDRESS[k]
        _BY_ADDRESS[(key, ptr)] = weakref.ref(owner, forget)
        return owner
    if anchor.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # reading the serial would synchronize
    ref = _SERIALS.get(int(anchor.item()))
    owner = ref() if ref is not None else None
    return owner if owner is not None and owner in _OWNERS.get(key, ()) else None


def _run(hidden: Tensor, routing: list[Tensor], owner: str, anchor: Tensor, weights: list[Tensor]) -> Tensor:
    """The op at run time: the eager function of the owner registered under ``owner`` whose anchor is ``anchor``, on
    hidden and routing (``weights`` are inputs for autograd's sake only: the owner reads its own). MF306 where the
    anchor names no live owner (a deleted layer, a graph exported to another process). The layer's own eager graphs
    stand aside: mode="reduce-overhead" records in a memory pool that a graph of theirs would outlive."""
    target = _resolve(owner, anchor)
    if target is None:
        raise error("MF306", owner=owner)
    with graphs.standing_aside():  # the compiled model's CUDA graphs, if any, are its own (moeflow.graphs)
        return _FNS[owner](target, hidden, *routing)


def _fake(hidden: Tensor, routing: list[Tensor], owner: str, anchor: Tensor, weights: list[Tensor]) -> Tensor:
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
        hidden, routing, _owner, _anchor, weights = inputs
        ctx.save_for_backward(hidden, *routing, *weights)
        ctx.routing = len(routing)

    def backward(ctx, grad):
        saved = ctx.saved_tensors
        floating = [i for i, t in enumerate(saved) if t.is_floating_point()]
        grads = [None] * len(saved)
        for i, g in zip(floating, refuse_gradient(name, grad, [saved[i] for i in floating])):
            grads[i] = g
        return grads[0], grads[1:1 + ctx.routing], None, None, grads[1 + ctx.routing:]

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
    """fn(owner, hidden, *routing) as one op of the traced graph: ``layer`` or, for a plan that is not graph-safe,
    ``layer_host_sync`` (tagged cudagraph_unsafe, so inductor keeps it out of its CUDA graphs), as registered.

    hidden [T, H] float; routing: (router_logits [T, E],) or (topk_ids [T, K], topk_weights [T, K]) (ExpertsPath:
    then the caller's w13, w2 and their scales) -> [T, H], hidden's dtype, a new contiguous tensor. ``weights()``:
    the owner's parameters, which it reads itself (called with grad mode on only); those that require grad become
    inputs of the op, so that a backward reaches the op's (MF307) where they alone require grad.
    An owner not registered yet (a transformers experts module never called before compiling, or a copy of one)
    runs outside the graph, which breaks the compiled graph around each such call; prepare_experts (or one eager
    call) before compiling registers it. Without CUDA graphs (torch.compile's default mode) the compiled layer pays
    each launch's host cost, as an eager call with MOEFLOW_EAGER_GRAPHS=0 does, plus the op's own dispatch."""
    safe = owner.__dict__.get(REGISTERED, {}).get(fn.__name__)
    if safe is None:  # run outside the graph (not disabled at import: that would import dynamo)
        run = _DISABLED[0] if _DISABLED else torch.compiler.disable(_unregistered, reason=_UNREGISTERED_REASON)
        return run(owner, fn, hidden, routing)
    op = layer if safe else layer_host_sync
    trainable = [w for w in weights() if w.requires_grad] if torch.is_grad_enabled() else []
    return op(hidden, list(routing), op_key(owner, fn), anchor_of(owner), trainable)


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
