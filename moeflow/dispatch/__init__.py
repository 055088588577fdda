"""Dispatch stage: ``DISPATCHERS`` registry and ``create_dispatcher``.

Backends: "local" (one process); expert parallel on torch.distributed: "alltoall" (prefill,
sorted), "alltoall-fixed" (prefill in fixed blocks: no host sync, CUDA-graph capturable),
"alltoall-p2p" (alltoall-fixed's blocks stored straight into the peers' memory: one node, CUDA),
"allgather" (simple, sorted), "lowlatency" (decode, masked, CUDA-graph capturable).
"auto" in a group of W > 1 ranks picks by priority: alltoall > allgather > lowlatency >
alltoall-fixed > alltoall-p2p (the fixed ones need max_tokens_per_rank sized for the batches, and
alltoall-p2p one node: asked for by name).
"""
from ..registry import Registry
from .base import Dispatcher
from .allgather import AllGatherDispatcher
from .alltoall import AllToAllDispatcher
from .alltoall_fixed import AllToAllFixedDispatcher
from .alltoall_p2p import PeerAllToAllDispatcher
from .local import LocalDispatcher
from .lowlatency import LowLatencyDispatcher

DISPATCHERS: Registry[Dispatcher] = Registry("dispatcher")
DISPATCHERS.register(LocalDispatcher)
for _cls in (AllToAllDispatcher, AllGatherDispatcher, LowLatencyDispatcher, AllToAllFixedDispatcher,
             PeerAllToAllDispatcher):
    DISPATCHERS.register(_cls)


def create_dispatcher(name, config, scheme, process_group=None, indexed_rows: bool = False,
                      planned=None) -> Dispatcher:
    """indexed_rows: hand sorted rows by index (Plan.indexed_rows; only where caps.indexed_rows). planned: the
    layer's Plan, which expert-parallel dispatchers check all ranks agree on."""
    d = DISPATCHERS.get(name)(config, scheme, process_group, planned=planned)
    d.indexed_rows = indexed_rows and d.caps.indexed_rows
    return d


__all__ = ["DISPATCHERS", "Dispatcher", "create_dispatcher"]
