"""Bucketed eager graphs (MOEFLOW_EAGER_BUCKETS, default 2048): an eager call of more tokens than
MOEFLOW_EAGER_GRAPHS, up to that variable, is padded to a bucket (bucket_of: the next power of two) and replays that
bucket's graph, so calls of any token count (prefill) share a few graphs, kept by moeflow.graphs.GraphCache beside
the graphs of exact small shapes.

Bucketed: an entry's padded form. Arena: what every bucket graph on one (device, stream) shares. BucketCall: one
bucket's captured call. A bucketed call costs the host one replay at any T; the padding (up to as many rows as the
call's own) costs GPU time, which outweighs that saving on GPU-bound calls past the default of 2048 tokens.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from . import env as moeflow_env

MAX_BUCKET_GRAPHS = 16  # bucket graphs one cache keeps (powers of two from 32 to 4096 are 8 an entry)
_ARENAS: "weakref.WeakValueDictionary[tuple, Arena]" = weakref.WeakValueDictionary()  # (device, stream) -> Arena
_ARENAS_LOCK = threading.Lock()


def bucket_of(tokens: int) -> int | None:
    """The rows a call of ``tokens`` tokens is padded to: the next power of two, at most MOEFLOW_EAGER_BUCKETS, for
    MOEFLOW_EAGER_GRAPHS < tokens <= MOEFLOW_EAGER_BUCKETS; else None (also when MOEFLOW_EAGER_GRAPHS is 0)."""
    most, exact = moeflow_env.EAGER_BUCKETS.get_count(), moeflow_env.EAGER_GRAPHS.get_count()
    if not exact or not exact < tokens <= most:  # MOEFLOW_EAGER_GRAPHS=0 turns every eager graph off
        return None
    return min(1 << (tokens - 1).bit_length(), most)


@dataclass(frozen=True)
class Bucketed:
    """An entry's padded form: fn(*inputs, valid) -> the first input's shape and dtype ([rows, H]), the inputs
    [rows, ...] the call's own rows then zero rows, valid [1] int64 on the device, the call's token count; its first
    rows must be the unpadded call's result. The padding tokens are routed to no expert: the plan's dispatcher drops
    their copies (Plan.bucketed: its sort reads the rows from valid on as ids -1), so the expert GEMMs compute only
    the call's copies, while the routing, sort, shared experts and top-k sum also see the padding rows."""

    fn: Callable[..., Tensor]


def arena_key(device: torch.device) -> tuple:
    """The (device, stream) whose arena a call on ``device`` uses: its current CUDA stream; one arena elsewhere."""
    if device.type != "cuda":
        return (device.type, None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return ("cuda", index, torch.cuda.current_stream(index).cuda_stream)


def arena_for(key: tuple) -> "Arena":
    """The live arena of ``key`` (arena_key), made if none: the bucket graphs holding it keep it alive."""
    with _ARENAS_LOCK:
        arena = _ARENAS.get(key)
        if arena is None:
            arena = _ARENAS[key] = Arena(key[0])
        return arena


class Arena:
    """What every bucket graph of a process on one (device, stream) shares: one memory pool, one static tensor per
    (input position, bucket rows, trailing shape, dtype), one output tensor per (rows, trailing shape, dtype), and
    ``valid``. A graph copies its output into the arena's at its end, so it keeps no tensor of the pool alive and the
    pool holds about the intermediates of the largest graph, not those of every layer's (a model of 48 layers would
    otherwise hold 48 layers' intermediates of the largest bucket). A call copies its rows into the arena's inputs,
    zeroes the rows a previous call wrote past its own, sets ``valid``, replays and copies out its rows, all under
    ``lock``, so that calls from two threads on one stream do not interleave; another stream has its own arena."""

    def __init__(self, device_type: str):
        self.pool = torch.cuda.graph_pool_handle() if device_type == "cuda" else None
        self.lock = threading.RLock()  # a call's copies, replay and output copy; a capture
        self._tensors: dict[tuple, Tensor] = {}
        self._written: dict[tuple, int] = {}  # rows of an input tensor past which it is zero

    def inputs(self, like: tuple[Tensor, ...], rows: int) -> tuple[tuple, ...]:
        """The keys of the static inputs a bucket of ``rows`` reads for inputs shaped as ``like`` (made zero once)."""
        keys = []
        for i, x in enumerate(like):
            key = ("in", i, rows, tuple(x.shape[1:]), x.dtype, x.device)
            if key not in self._tensors:
                self._tensors[key] = x.new_zeros((rows, *x.shape[1:]))
                self._written[key] = 0
            keys.append(key)
        return tuple(keys)

    def tensor(self, key: tuple) -> Tensor:
        return self._tensors[key]

    def valid(self, device: torch.device) -> Tensor:
        """[1] int64 on ``device``: the token count of the call being replayed."""
        key = ("valid", device)
        if key not in self._tensors:
            self._tensors[key] = torch.zeros(1, dtype=torch.int64, device=device)
        return self._tensors[key]

    def output(self, like: Tensor) -> Tensor:
        """The arena's output tensor of like's shape, dtype and device (made now, on the caller's stream, outside any
        capture: the graphs write it at their end)."""
        key = ("out", tuple(like.shape), like.dtype, like.device)
        if key not in self._tensors:
            self._tensors[key] = torch.empty_like(like)
        return self._tensors[key]

    def fill(self, keys: tuple[tuple, ...], inputs: tuple[Tensor, ...], valid: Tensor) -> None:
        """The call's rows into the static inputs, zero past them where an earlier call wrote more; valid = T."""
        t = inputs[0].shape[0]
        for key, x in zip(keys, inputs):
            static = self._tensors[key]
            static[:t].copy_(x)
            if self._written[key] > t:
                static[t:self._written[key]].zero_()
            self._written[key] = t
        valid.fill_(t)


class BucketCall:
    """A bucket's captured padded form, reading and writing its arena's tensors (its output: the padded hidden's shape
    and dtype, Bucketed's contract). capture: as GraphCache's (capture(fn, inputs, pool, own_inputs=False): fn reads
    ``inputs`` themselves, not copies of them)."""

    def __init__(self, capture, fn: Callable[..., Tensor], inputs: tuple[Tensor, ...], rows: int, arena: Arena):
        self.arena = arena
        with arena.lock:  # the arena's tensors are made once, whichever thread comes first
            self.keys = arena.inputs(inputs, rows)
            statics = tuple(arena.tensor(k) for k in self.keys)
            self.valid = valid = arena.valid(inputs[0].device)
            out = arena.output(statics[0])

            def into_arena(*args: Tensor) -> Tensor:  # the output copied into the arena's: no pool tensor stays alive
                return out.copy_(fn(*args))

            arena.fill(self.keys, inputs, valid)
            self.captured = capture(into_arena, (*statics, valid), arena.pool, own_inputs=False)

    def __call__(self, inputs: tuple[Tensor, ...]) -> Tensor:
        t = inputs[0].shape[0]
        with self.arena.lock:
            self.arena.fill(self.keys, inputs, self.valid)
            return self.captured.replay()[:t].clone()
