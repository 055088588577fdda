"""Dispatch stage: ``DISPATCHERS`` registry and ``create_dispatcher``.

Backends: "local" (one process); expert parallel on torch.distributed: "alltoall" (prefill,
sorted), "allgather" (simple, sorted), "lowlatency" (decode, masked, CUDA-graph capturable).
"auto" in a group of W > 1 ranks picks by priority: alltoall > allgather > lowlatency.
"""
from ..registry import Registry
from .base import Dispatcher
from .allgather import AllGatherDispatcher
from .alltoall import AllToAllDispatcher
from .local import LocalDispatcher
from .lowlatency import LowLatencyDispatcher

DISPATCHERS: Registry[Dispatcher] = Registry("dispatcher")
DISPATCHERS.register(LocalDispatcher)
for _cls in (AllToAllDispatcher, AllGatherDispatcher, LowLatencyDispatcher):
    DISPATCHERS.register(_cls)


def create_dispatcher(name, config, scheme, process_group=None, indexed_rows: bool = False) -> Dispatcher:
    """indexed_rows: hand sorted rows by index (Plan.indexed_rows; only where caps.indexed_rows)."""
    d = DISPATCHERS.get(name)(config, scheme, process_group)
    d.indexed_rows = indexed_rows and d.caps.indexed_rows
    return d


__all__ = ["DISPATCHERS", "Dispatcher", "create_dispatcher"]
