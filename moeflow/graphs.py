"""Eager calls replayed from CUDA graphs: a layer called outside any capture, at a small batch, runs as one graph
replay instead of its launches one by one (issued eagerly, they cost the host more than the GPU needs at decode
sizes; a replay costs the host one call whatever the launches).

GraphCache (one a layer) keeps a graph per entry, input shapes and dtypes, weights' layouts and path switches.
Calls of up to MOEFLOW_EAGER_GRAPHS (default 16) tokens replay a graph of their exact shape; larger ones, up to
MOEFLOW_EAGER_BUCKETS, a padded bucket's (moeflow.graph_buckets). capture_graph is the capture the tuner and the
benchmarks share too. Not supported: calls of one layer on two streams at once.
"""
from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections import OrderedDict
from typing import Callable

import torch
from torch import Tensor

from . import env as moeflow_env
from . import graph_buckets
from .graph_buckets import Bucketed, BucketCall, arena_for, arena_key, bucket_of

MAX_GRAPHS = 8  # graphs one cache keeps (one per token count and entry, in practice)
# set while torch.compile's op runs a layer (moeflow.ops): the compiled model's own CUDA graphs (mode="reduce-overhead")
# warm up and record in their memory pool, where a graph of ours (its static inputs) would outlive the recording
_STAND_ASIDE = contextvars.ContextVar("moeflow_eager_graphs_stand_aside", default=False)
MAX_EVICTIONS = 32  # graphs one cache may drop to make room; past that it captures no new ones (see GraphCache)


def graph_tokens() -> int:
    """MOEFLOW_EAGER_GRAPHS as an int >= 0 (MF107 otherwise)."""
    return moeflow_env.EAGER_GRAPHS.get_count()


def layout_key(tensors) -> tuple:
    """What a graph assumes of tensors it reads in place (weights): address, shape, strides, dtype; None kept."""
    return tuple(None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in tensors)


def capture_graph(fn, warmups: int = 1, pool=None, capture_error_mode: str = "global") -> torch.cuda.CUDAGraph:
    """fn (zero arguments) captured once as a CUDA graph, after ``warmups`` calls on a side stream
    outside the capture (compiles, allocator pools), on the current device. pool and capture_error_mode: as
    torch.cuda.graph's. The eager graphs', the tuner's and the benchmarks' capture."""
    cur = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    cur.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_error_mode):
        fn()
    return graph


@contextlib.contextmanager
def standing_aside():
    """Within it, no GraphCache replays or captures (calls run launch by launch): torch.compile's op (moeflow.ops)."""
    token = _STAND_ASIDE.set(True)
    try:
        yield
    finally:
        _STAND_ASIDE.reset(token)


class _Captured:
    """One captured call: its graph, the static inputs it reads and the output it writes."""

    def __init__(self, fn: Callable[..., Tensor], inputs: tuple[Tensor, ...], pool=None, own_inputs: bool = True):
        """own_inputs: read copies of ``inputs`` (made now), else the tensors themselves (graph_buckets' arenas)."""
        self.inputs = tuple(x.clone() for x in inputs) if own_inputs else tuple(inputs)
        outputs = []  # the warm-up's output, then the captured call's (the last)
        with torch.cuda.device(inputs[0].device):
            self.graph = capture_graph(lambda: outputs.append(fn(*self.inputs)), pool=pool,
                                       capture_error_mode="thread_local")
        self.output = outputs[-1]

    def replay(self) -> Tensor:
        """Replay on the static inputs as they are -> the graph's own output (the next replay overwrites it)."""
        self.graph.replay()
        return self.output

    def __call__(self, inputs: tuple[Tensor, ...]) -> Tensor:
        for static, x in zip(self.inputs, inputs):
            static.copy_(x)
        return self.replay().clone()


class GraphCache:
    """Per-layer cache of captured calls. ``enabled``: the plan is graph-safe (Plan.graph_safe).

    A key's first call runs once eagerly on a side stream (compiles, allocations), then is captured reading static
    copies of its inputs (so it runs twice); each later call copies its inputs into those, replays, and returns a
    copy of the graph's output (the next replay overwrites the graph's own). The graphs read the weights where they
    were at capture: the key holds each weight's address, shape, strides and dtype, so weights loaded in place
    (load_weights) are read anew and weights moved or replaced give a new graph. At most ``max_graphs`` graphs, least
    recently used dropped first; once MAX_EVICTIONS were dropped (calls cycling through more shapes than it keeps,
    each paying a capture) the cache stops capturing and new shapes run launch by launch, with one warning.
    The cache's graphs share one memory pool: they replay one at a time on the caller's stream, and each output is
    copied out at once, so one graph's intermediates may take another's (a layer's graphs then hold about the memory
    of its largest one). device_type and capture are there for tests: the device type the cache serves, and what
    captures a call (``capture(fn, inputs, pool)`` -> a callable taking the inputs)."""

    def __init__(self, enabled: bool, max_graphs: int = MAX_GRAPHS, device_type: str = "cuda", capture=_Captured):
        self.enabled = enabled
        self.max_graphs = max_graphs
        self.device_type = device_type
        self._capture = capture
        self._graphs: OrderedDict = OrderedDict()
        self._buckets: OrderedDict = OrderedDict()  # the bucketed calls' graphs (graph_buckets.BucketCall)
        self.evictions = 0  # graphs dropped to make room (past MAX_EVICTIONS no new graph is captured)
        self._pool = None  # the graphs' shared memory pool (torch.cuda.graph_pool_handle), made at the first capture

    def __len__(self) -> int:
        return len(self._graphs) + len(self._buckets)

    def __getstate__(self) -> dict:  # copies and pickles of a layer start with no graphs (a graph is neither)
        return dict(self.__dict__, _graphs=OrderedDict(), _buckets=OrderedDict(), _pool=None)

    def __deepcopy__(self, memo) -> "GraphCache":
        return GraphCache(self.enabled, self.max_graphs, self.device_type, self._capture)

    @property
    def capturing(self) -> bool:
        """Whether a call of a new shape is captured (False once MAX_EVICTIONS graphs were dropped)."""
        return self.evictions < MAX_EVICTIONS

    def usable(self, inputs: tuple[Tensor, ...]) -> bool:
        """Whether a call on ``inputs`` (the first one [T, ...]) is replayed from a graph of its own shape: 0 < T <=
        MOEFLOW_EAGER_GRAPHS, a graph-safe plan, inputs on the cache's device type, and none of: a stream capturing
        (the caller's own graph then records the launches), torch.compile tracing or its op running (standing_aside;
        mode="reduce-overhead" gives the compiled model graphs of its own), inputs that require grad."""
        return 0 < inputs[0].shape[0] <= graph_tokens() and self._replayable(inputs)

    def _replayable(self, inputs: tuple[Tensor, ...]) -> bool:
        """usable() but for the token bound."""
        if not self.enabled or inputs[0].device.type != self.device_type:
            return False
        if torch.compiler.is_compiling() or _STAND_ASIDE.get():
            return False
        if self.device_type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        return not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs))

    def __call__(self, entry: str, fn: Callable[..., Tensor], inputs: tuple[Tensor, ...],
                 weights: Callable[[], tuple], bucketed: Bucketed | None = None) -> Tensor:
        """fn(*inputs) -> Tensor, replayed from a graph where usable(inputs), or from a bucket's graph where
        ``bucketed`` is given and the token count has a bucket (bucket_of), else called. fn (and bucketed.fn) must
        read nothing but its inputs and the tensors weights() gives (those it reads in place), and make the same
        launches for the same key: entry names the call (the layer's forward, forward_topk, ...)."""
        rows = None  # a bucket's rows, for a padded call
        if not self.usable(inputs):
            rows = None if bucketed is None else bucket_of(inputs[0].shape[0])
            if rows is None or not self._replayable(inputs):
                return fn(*inputs)
        store = self._graphs if rows is None else self._buckets
        arena = None if rows is None else arena_key(inputs[0].device)  # a bucket's graph: its (device, stream)
        key = self._key(entry, inputs, weights, rows, arena)
        captured = store.pop(key, None)
        if captured is None:
            if not self._make_room(store, self.max_graphs if rows is None else graph_buckets.MAX_BUCKET_GRAPHS):
                return fn(*inputs)
            captured = (self._capture(fn, inputs, self._shared_pool()) if rows is None
                        else BucketCall(self._capture, bucketed.fn, inputs, rows, arena_for(arena)))
        store[key] = captured  # most recently used last
        return captured(inputs)

    def _make_room(self, store: OrderedDict, most: int) -> bool:
        """Drop ``store``'s least recently used graphs until a new one fits in ``most``; False where the cache no longer
        captures (MAX_EVICTIONS graphs dropped, counting both stores: calls cycling through more keys than it keeps,
        each paying a capture), with one warning when that happens."""
        if not self.capturing:
            return False
        while len(store) >= most:
            store.popitem(last=False)
            self.evictions += 1
            if not self.capturing:
                warnings.warn(f"moeflow: eager calls cycled through more than {most} batch shapes "
                              f"({MAX_EVICTIONS} graphs dropped); new shapes now run without a CUDA graph. "
                              "Lower MOEFLOW_EAGER_GRAPHS (and MOEFLOW_EAGER_BUCKETS) to the batch sizes you run, "
                              "or set them to 0.", RuntimeWarning, stacklevel=4)
                return False
        return True

    @staticmethod
    def _key(entry: str, inputs: tuple[Tensor, ...], weights: Callable[[], tuple], rows: int | None = None,
             arena: tuple | None = None) -> tuple:
        """A graph's key: the entry, the inputs' shapes (rows: a bucket's, in place of the token count), dtypes and
        devices, the weights' layouts, the forward path's switches, and a bucket's arena (graph_buckets.arena_key)."""
        shapes = tuple((tuple(x.shape) if rows is None else (rows, *x.shape[1:]), x.dtype, x.device) for x in inputs)
        return (entry, shapes, layout_key(weights()), tuple(v.get() for v in moeflow_env.PATH_SWITCHES), arena)

    def _shared_pool(self):
        """The graphs' memory pool (CUDA), made at the first capture; None for other device types (tests)."""
        if self._pool is None and self.device_type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool
