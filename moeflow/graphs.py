"""Eager calls replayed from CUDA graphs: a layer called outside any capture, at a small batch, runs as one graph
replay instead of its launches one by one.

Why: issuing a layer's launches eagerly costs the host more than the GPU needs at decode sizes. On the lent H200's
host, an eager MoE.forward took 180 µs of host time at T=1 (GPU 24-33 µs) and 420-500 µs at T=16 (GPU 117-194 µs),
Qwen3-30B-A3B's shapes (benchmarks/results/eager_graphs_2026-12-02_h200.md): a model run eagerly, as
transformers' generate runs it, waits on the host. A replay costs the host one call whatever the launches.
How: GraphCache keeps one graph per (entry, input shapes and dtypes, weights' addresses and layouts, the forward
path's environment switches): on the first call of a key, the call runs once eagerly on a side stream (compiles,
allocations), then is captured reading static copies of its inputs; each call then copies its inputs into those,
replays, and returns a copy of the graph's output (the next replay overwrites the graph's own). At most MAX_GRAPHS
graphs a cache, least recently used dropped first; a cache that has dropped MAX_EVICTIONS graphs (calls cycling
through more shapes than it keeps, each paying a capture) stops capturing: new shapes then run launch by launch,
with one warning. The graphs read the weights where they were at capture: a key
holds each weight's address, shape, strides and dtype, so weights loaded in place (load_weights) are read anew, and
weights moved or replaced give a new graph.
When: MOEFLOW_EAGER_GRAPHS (default 16) is the largest token count replayed; the plan must be graph-safe
(Plan.graph_safe: every stage declares it); inputs on CUDA; not while a stream captures (the caller's own graph
then records the launches themselves), nor inside a compiled model (torch.compile's tracing, and its op at run time:
moeflow.ops; mode="reduce-overhead" gives the compiled model CUDA graphs of its own), nor with inputs that require
grad.
Measured there: replayed calls are GPU-bound from T = 4 (eager loop 9-14 µs a call over the graph's own GPU time),
against 2-7x over it launch by launch; at T = 1, 47-85 µs a call against 130-300.
Costs: the first call of each key runs twice and captures (a few ms); a copy of each input and of the output a
call; one memory pool a cache, shared by its graphs
(measured on H200 with a pool for each graph, Qwen3-30B-A3B's shapes: about 8 MB of reserved memory a layer for
the graphs of T = 1-16).
Not supported: calls of one layer on two streams at once (as for the one-launch layer's counters).
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

    def __init__(self, fn: Callable[..., Tensor], inputs: tuple[Tensor, ...], pool=None):
        self.inputs = tuple(x.clone() for x in inputs)
        outputs = []  # the warm-up's output, then the captured call's (the last)
        with torch.cuda.device(inputs[0].device):
            self.graph = capture_graph(lambda: outputs.append(fn(*self.inputs)), pool=pool,
                                       capture_error_mode="thread_local")
        self.output = outputs[-1]

    def __call__(self, inputs: tuple[Tensor, ...]) -> Tensor:
        for static, x in zip(self.inputs, inputs):
            static.copy_(x)
        self.graph.replay()
        return self.output.clone()


class GraphCache:
    """Per-layer cache of captured calls (module docstring). ``enabled``: the plan is graph-safe (Plan.graph_safe).
    device_type and capture are there for tests: the device type the cache serves, and what captures a call
    (``capture(fn, inputs, pool)`` -> a callable taking the inputs). The cache's graphs share one memory pool: they
    replay one at a time on the caller's stream, and each output is copied out at once, so one graph's intermediates
    may take another's (a layer's graphs then hold about the memory of its largest one)."""

    def __init__(self, enabled: bool, max_graphs: int = MAX_GRAPHS, device_type: str = "cuda", capture=_Captured):
        self.enabled = enabled
        self.max_graphs = max_graphs
        self.device_type = device_type
        self._capture = capture
        self._graphs: OrderedDict = OrderedDict()
        self.evictions = 0  # graphs dropped to make room (past MAX_EVICTIONS no new graph is captured)
        self._pool = None  # the graphs' shared memory pool (torch.cuda.graph_pool_handle), made at the first capture

    def __len__(self) -> int:
        return len(self._graphs)

    def __getstate__(self) -> dict:  # copies and pickles of a layer start with no graphs (a graph is neither)
        return dict(self.__dict__, _graphs=OrderedDict(), _pool=None)

    def __deepcopy__(self, memo) -> "GraphCache":
        return GraphCache(self.enabled, self.max_graphs, self.device_type, self._capture)

    @property
    def capturing(self) -> bool:
        """Whether a call of a new shape is captured (False once MAX_EVICTIONS graphs were dropped)."""
        return self.evictions < MAX_EVICTIONS

    def usable(self, inputs: tuple[Tensor, ...]) -> bool:
        """Whether a call on ``inputs`` (the first one [T, ...]) is replayed from a graph (module docstring, When)."""
        if not self.enabled:
            return False
        x = inputs[0]
        if x.device.type != self.device_type or not 0 < x.shape[0] <= graph_tokens():
            return False
        if torch.compiler.is_compiling() or _STAND_ASIDE.get():
            return False
        if self.device_type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        return not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs))

    def __call__(self, entry: str, fn: Callable[..., Tensor], inputs: tuple[Tensor, ...],
                 weights: Callable[[], tuple]) -> Tensor:
        """fn(*inputs) -> Tensor, replayed from a graph where usable(inputs), else called. fn must read nothing but
        its inputs and the tensors weights() gives (those it reads in place), and make the same launches for the same
        key: entry names the call (the layer's forward, forward_topk, ...)."""
        if not self.usable(inputs):
            return fn(*inputs)
        key = (entry, tuple((tuple(x.shape), x.dtype, x.device) for x in inputs), layout_key(weights()),
               tuple(v.get() for v in moeflow_env.PATH_SWITCHES))
        captured = self._graphs.pop(key, None)
        if captured is None:
            if not self.capturing:
                return fn(*inputs)
            while len(self._graphs) >= self.max_graphs:
                self._graphs.popitem(last=False)
                self.evictions += 1
                if not self.capturing:
                    warnings.warn(f"moeflow: eager calls cycled through more than {self.max_graphs} batch shapes "
                                  f"({MAX_EVICTIONS} graphs dropped); new shapes now run without a CUDA graph. "
                                  "Lower MOEFLOW_EAGER_GRAPHS to the batch sizes you decode at, or set it to 0.",
                                  RuntimeWarning, stacklevel=3)
                    return fn(*inputs)
            if self._pool is None and self.device_type == "cuda":
                self._pool = torch.cuda.graph_pool_handle()
            captured = self._capture(fn, inputs, self._pool)
        self._graphs[key] = captured  # most recently used last
        return captured(inputs)
