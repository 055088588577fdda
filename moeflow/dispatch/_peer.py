"""Buffers every rank of a group maps (torch symmetric memory) and the barrier over them: the
transport of the peer-to-peer dispatcher (alltoall_p2p.py).

Each named buffer exists once per rank at the same size; ``table(name, rows)`` gives the addresses
a kernel stores through to reach block ``rank`` (``rows`` rows long) of that buffer on every rank.
``barrier()`` is kernels/peer.barrier on this rank's stream (no host synchronization, capturable);
a peer that does not answer within MOEFLOW_DIST_TIMEOUT_S ends the wait and leaves a flag in pinned
host memory, which ``check()`` turns into MF502 without a device synchronization.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..distributed import all_gather_host, timeout_s
from ..errors import error


class PeerBuffers:
    """buffers: name -> (shape, dtype). Collective: every rank of ``group`` builds it, in the same order."""

    def __init__(self, name: str, group, rank: int, world: int, device: torch.device,
                 buffers: dict[str, tuple[tuple[int, ...], torch.dtype]], alternatives: list[str]):
        self.rank, self.world, self.device = rank, world, device
        self.local: dict[str, Tensor] = {}
        self._addresses: dict[str, list[int]] = {}
        try:
            import torch.distributed._symmetric_memory as symm_mem

            for key, (shape, dtype) in {**buffers, "_pads": ((world,), torch.int64)}.items():
                t = symm_mem.empty(*shape, dtype=dtype, device=device)
                handle = symm_mem.rendezvous(t, group)
                self.local[key], self._addresses[key] = t, list(handle.buffer_ptrs)
        except (ImportError, RuntimeError, AttributeError, ValueError) as exc:
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise error("MF507", name=name, rank=rank, why=why, valid=alternatives) from exc
        self.local["_pads"].zero_()
        self._pads = self.table("_pads", 0)
        self._epoch = torch.zeros(1, dtype=torch.int64, device=device)
        self._status = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # 1 + a silent rank, written by the device
        self._status_addr = torch.tensor([self._status.data_ptr()], dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)  # every pad is zero before any rank's first barrier
        all_gather_host(torch.zeros(1, device=device), group, f"{name}: mapping the peers' buffers")
        self._what = f"{name}'s barrier"

    def table(self, name: str, rows: int) -> Tensor:
        """[W] int64 on this device: the address of block ``rank`` (``rows`` rows from row rank*rows)
        of buffer ``name`` on every rank."""
        t = self.local[name]
        row_bytes = t[0].numel() * t.element_size() if t.dim() > 1 else t.element_size()
        return torch.tensor([a + self.rank * rows * row_bytes for a in self._addresses[name]],
                            dtype=torch.int64, device=self.device)

    def barrier(self) -> None:
        """Wait (on the stream) until every rank has entered this round; their earlier stores are visible."""
        from ..kernels.peer import barrier

        barrier(self._pads, self._epoch, self._status_addr, self.rank, self.world, timeout_s())

    def check(self) -> None:
        """MF502 if an earlier barrier stopped waiting for a silent rank (read from pinned memory: no sync)."""
        silent = int(self._status[0])
        if silent:
            raise error("MF502", what=f"{self._what} (rank {silent - 1} never arrived)", seconds=timeout_s(),
                        rank=self.rank)
