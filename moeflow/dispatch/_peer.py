"""Buffers every rank of a group maps, and a barrier over them: the transport of the peer-to-peer dispatcher
(alltoall_p2p.py). PeerBuffers: each named buffer exists once per rank at the same size, and every rank maps all
of them: on CUDA torch symmetric memory (NVLink / PCIe peer access, one node); on CPU files in /dev/shm (or the
temp folder) that every rank maps (one node), unlinked once all ranks have mapped them.
"""
from __future__ import annotations

import math
import os
import tempfile
import uuid
import weakref
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed import all_gather_host, all_gather_json, timeout_s
from ..errors import MoeflowError, error

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]
_SHARED: "weakref.WeakValueDictionary[tuple, PeerBuffers]" = weakref.WeakValueDictionary()


class PeerBuffers:
    """buffers: name -> (shape, dtype). Collective: every rank of ``group`` builds it, in the same order.
    ``rows_epoch`` / ``sums_epoch``: how many dispatches / combines have filled the buffers (alltoall_p2p.py)."""

    @classmethod
    def shared(cls, name: str, group, rank: int, world: int, device: torch.device, buffers: Shapes,
               alternatives: list[str]) -> "PeerBuffers":
        """The buffers of this group, device and shapes that another live layer already mapped, else new ones.
        The layers of a model run one at a time, so they can share one set: a model of L layers holds one, not L
        (DeepSeek-V3 fp8-block at 8 ranks and 4096 tokens a rank: 0.7 GB, not 41 GB). Collective: the ranks agree
        first (one small all-gather) that every one of them still holds the set, else all map a new one; a set
        that one rank's garbage collector kept longer than another's cannot split them."""
        key = (id(group), str(device), tuple(sorted((k, tuple(shape), str(dt)) for k, (shape, dt) in buffers.items())))
        found = _SHARED.get(key)
        held = all_gather_host(torch.tensor([found is not None], dtype=torch.int32, device=device), group,
                               f"{name}: looking up the buffers mapped already").tolist()
        if found is not None and all(held):
            return found
        peers = cls(name, group, rank, world, device, buffers, alternatives)
        _SHARED[key] = peers
        return peers

    def __init__(self, name: str, group, rank: int, world: int, device: torch.device, buffers: Shapes,
                 alternatives: list[str]):
        self.name, self.group, self.rank, self.world, self.device = name, group, rank, world, device
        self._views: dict[str, list[Tensor]] = {}  # name -> every rank's buffer, mapped here
        self._addresses: dict[str, list[int]] = {}  # name -> the address of every rank's buffer, mapped here
        # normal tensors even when the layer is built under torch.inference_mode: every call writes them in place,
        # and inference tensors cannot be written outside that mode
        with torch.inference_mode(False):
            try:
                if device.type == "cuda":
                    self._map_symmetric(buffers)
                else:
                    self._map_files(buffers)
            except MoeflowError:  # MF502 from a barrier (a TimeoutError, hence an OSError): not a mapping failure
                raise
            except (ImportError, RuntimeError, AttributeError, ValueError, OSError) as exc:
                why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise error("MF507", name=name, rank=rank, why=why, valid=alternatives) from exc
            self.local = {key: views[rank] for key, views in self._views.items()}
            self.rows_epoch = self.sums_epoch = 0
            self._status = torch.zeros(1, dtype=torch.int32, pin_memory=device.type == "cuda")  # 1 + a silent rank
            if device.type == "cuda":  # where the barrier kernel writes it (mapped host memory)
                self._status_at = torch.tensor([self._status.data_ptr()], dtype=torch.int64, device=device)
                self._stream = torch.cuda.Stream(device)  # the transfers' own stream (side_stream / join)

    def _all_done(self, failure: Exception | None, step: str) -> None:
        """After a local ``step`` of the mapping: every rank learns whether every rank did it (one small all-gather,
        bounded by MOEFLOW_DIST_TIMEOUT_S), before any rank enters the next collective. A rank that failed raises
        its own error, the others one naming it (both MF507 in __init__): no rank is left waiting in a collective
        that a failed peer never joins."""
        flags = all_gather_host(torch.tensor([failure is not None], dtype=torch.int32, device=self.device), self.group,
                                f"{self.name}: {step}").tolist()
        if failure is not None:
            raise failure
        if any(flags):
            raise RuntimeError(f"{step} failed on rank {flags.index(1)} (its own error names why)")

    def _map_symmetric(self, buffers: Shapes) -> None:
        failure, own = None, {}
        try:
            import torch.distributed._symmetric_memory as symm_mem

            if torch.version.hip:  # its PTX clock does not compile for AMD GPUs: LLVM would end the process (MF211)
                raise RuntimeError("the peer barrier is a Triton kernel built for NVIDIA GPUs only, not ROCm's")
            from ..kernels.rows.peer import barrier  # a Triton kernel: without triton, refused here (MF507)

            self._barrier_kernel = barrier
            for key, (shape, dtype) in {**buffers, "_pads": ((self.world,), torch.int64)}.items():
                own[key] = symm_mem.empty(*shape, dtype=dtype, device=self.device)
        except (ImportError, RuntimeError, AttributeError, ValueError, OSError) as exc:
            failure = exc
        self._all_done(failure, "allocating symmetric memory")  # rendezvous is collective: every rank or none
        handles = {}
        for key, t in own.items():  # every rendezvous on every rank, whatever failed before: they are collective
            try:
                handles[key] = symm_mem.rendezvous(t, self.group)
            except (RuntimeError, ValueError, OSError) as exc:  # raised after its own exchange (no peer access)
                failure = failure or exc
        try:
            if failure is None:
                for key, t in own.items():
                    self._addresses[key] = list(handles[key].buffer_ptrs)
                    self._views[key] = [t if r == self.rank else handles[key].get_buffer(r, list(t.shape), t.dtype)
                                        for r in range(self.world)]
        except (RuntimeError, ValueError, OSError) as exc:
            failure = exc
        self._all_done(failure, "mapping the peers' memory")
        self._views["_pads"][self.rank].zero_()
        self._pads = self.table("_pads", 0)
        self._epoch = torch.zeros(1, dtype=torch.int64, device=self.device)
        torch.cuda.synchronize(self.device)  # every pad is zero before any rank's first barrier
        all_gather_host(torch.zeros(1, device=self.device), self.group, f"{self.name}: mapping the peers' buffers")

    def _map_files(self, buffers: Shapes) -> None:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        mine = {key: os.path.join(folder, f"moeflow-{self.name}-{uuid.uuid4().hex}-{key}") for key in buffers}
        try:
            failure = None
            try:
                for key, (shape, dtype) in buffers.items():  # new files read as zeros
                    self._views[key] = [torch.from_file(mine[key], shared=True, size=math.prod(shape),
                                                        dtype=dtype).view(shape)]
            except (RuntimeError, ValueError, OSError) as exc:
                failure = exc
            self._all_done(failure, "creating the shared files")
            paths = all_gather_json(mine, self.group, f"{self.name}: mapping the peers' buffers", self.device)
            try:
                for key, (shape, dtype) in buffers.items():
                    own = self._views[key][0]
                    self._views[key] = [own if r == self.rank else torch.from_file(
                        paths[r][key], shared=True, size=math.prod(shape), dtype=dtype).view(shape)
                        for r in range(self.world)]
                    self._addresses[key] = [v.data_ptr() for v in self._views[key]]
            except (RuntimeError, ValueError, OSError) as exc:
                failure = exc
            self._all_done(failure, "mapping the peers' files")
            self._cpu_barrier()  # every rank has mapped every file
        finally:
            for path in mine.values():
                if os.path.exists(path):
                    os.unlink(path)

    def table(self, name: str, rows: int) -> Tensor:
        """[W] int64 on this device: the address of block ``rank`` (``rows`` rows from row rank*rows)
        of buffer ``name`` on every rank, as mapped here."""
        own = self._views[name][self.rank]
        row_bytes = own.stride(0) * own.element_size()
        return torch.tensor([a + self.rank * rows * row_bytes for a in self._addresses[name]], dtype=torch.int64,
                            device=self.device)

    def blocks(self, name: str, rows: int) -> list[Tensor]:
        """Block ``rank`` (``rows`` rows from row rank*rows) of buffer ``name`` on every rank, as mapped here."""
        return [v[self.rank * rows:(self.rank + 1) * rows] for v in self._views[name]]

    @contextmanager
    def side_stream(self):
        """CUDA: the block's kernels run on this transport's own stream, after everything queued on
        the current one, so work queued after the block (shared experts) runs beside them until
        ``join``. Tensors the block reads must stay referenced until then. CPU: runs in place."""
        if self.device.type != "cuda":
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            yield

    def join(self) -> None:
        """The current stream waits for what ``side_stream`` queued (nothing to do on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def barrier(self) -> None:
        """Return (CUDA: the stream waits) once every rank has entered this round; the stores each
        rank made before it are then visible to all. CUDA: kernels/rows/peer.barrier on the current stream (no
        host synchronization, capturable); a peer that does not answer within MOEFLOW_DIST_TIMEOUT_S ends the
        wait and leaves a flag in pinned host memory that ``check()`` turns into MF502. CPU: gloo's monitored
        barrier (MF502 after the same timeout)."""
        if self.device.type != "cuda":
            self._cpu_barrier()
            return
        self._barrier_kernel(self._pads, self._epoch, self._status_at, self.rank, self.world, timeout_s())

    def _cpu_barrier(self) -> None:
        what = f"{self.name}'s barrier"
        try:
            dist.monitored_barrier(self.group, timeout=timedelta(seconds=timeout_s()))
        except RuntimeError as exc:
            raise error("MF502", what=what, seconds=timeout_s(), rank=self.rank) from exc

    def check(self) -> None:
        """MF502 if an earlier barrier stopped waiting for a silent rank (read from pinned memory: no sync)."""
        silent = int(self._status[0])
        if silent:
            raise error("MF502", what=f"{self.name}'s barrier (rank {silent - 1} never arrived)", seconds=timeout_s(),
                        rank=self.rank)
