"""What the expert-parallel dispatchers share: the group, the expert placement (expert_placement), the payload
(FP8 or the layer dtype, below), and the start / wait halves of dispatch and combine (ExpertParallelDispatcher).
"""
from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..balance.placement import Placement
from ..config import PAYLOADS, MoEConfig
from ..distributed import check_agreement, comm_device, resolve_group
from ..errors import MoeflowError, error
from ..layouts import ExpertBatch
from ..quant import QuantScheme, payload_scheme, row_local
from ._ep_rows import RowCodec
from .base import Dispatcher

# MoEConfig.dispatch_payload (config.PAYLOADS), or with_payload(...):
# "auto": FP8 when the layer's scheme quantizes each row on its own (fp8-channel, fp8-block): the
#   runner would quantize the same rows the same way, so nothing is lost; else the layer dtype
#   (fp8-tensor's one scale spans the batch the GEMM sees: the runner must quantize that batch);
# "fp8": always (lossy for quant="none": per-token FP8, dequantized to the layer dtype by the
#   runner); refused with MF506 for schemes whose rows are not quantized on their own;
# "dtype": never (the layer dtype travels; the runner quantizes).


def expert_placement(config: MoEConfig, world: int) -> tuple[int, ...]:
    """expert -> rank. config.placement when given (checked: MF504), else contiguous blocks, the first
    E mod W ranks holding one expert more."""
    e = config.num_experts
    if config.placement is None:
        if e < world:  # no placement can help: one rank per expert leaves a rank without any
            raise error("MF504", why=f"cannot give each of {world} ranks an expert: num_experts={e}; build this layer "
                                    f"on a process group of at most {e} ranks (torch.distributed.new_group)")
        base, extra = divmod(e, world)
        return tuple(r for r in range(world) for _ in range(base + (r < extra)))
    p = config.placement  # one non-negative int per expert (MoEConfig checked)
    bad = [r for r in p if r >= world]
    if bad:
        raise error("MF504", why=f"names rank {bad[0]}; ranks are 0..{world - 1}")
    idle = sorted(set(range(world)) - set(p))
    if idle:
        fix = "" if e >= world else f"; with num_experts={e}, use a process group of at most {e} ranks"
        raise error("MF504", why=f"gives rank {idle[0]} no expert; every rank needs at least one{fix}")
    return p


def slot_placement(config: MoEConfig, world: int) -> Placement:
    """The layer's physical expert slots over ``world`` ranks: config.placement when it is a Placement (its ranks
    checked here: MF510); else, without redundant experts, expert e in slot e on rank expert_placement(...)[e]
    (MF504); else Placement.contiguous (slot s holds expert s mod E, contiguous blocks of slots)."""
    e, slots = config.num_experts, config.num_experts + config.num_redundant_experts
    if isinstance(config.placement, Placement):
        return config.placement.check(e, slots, world)
    if not config.num_redundant_experts:
        return Placement.of_ranks(expert_placement(config, world))
    if slots < world:
        raise error("MF504", why=f"cannot give each of {world} ranks an expert slot: num_experts + "
                                f"num_redundant_experts = {slots}; build this layer on a process group of at most "
                                f"{slots} ranks, or add redundant experts")
    return Placement.contiguous(e, slots, world)


class ExpertParallelDispatcher(Dispatcher):
    """Base of "allgather", "alltoall", "lowlatency".

    Construction is collective: every rank of the group must build the layer, in the same order.
    It checks the ranks agree (MF501, MF502 if one never comes) and the placement (MF504).

    Halves (DeepEP's dispatch_a / dispatch_b style)::

        pending = d.dispatch_start(hidden, topk_ids, topk_weights)  # pack, launch the collective
        shared = shared_experts(hidden)                               # overlaps the transfer
        batch, handle = d.dispatch_wait(pending)                      # finish, build the ExpertBatch
        out = runner(batch)
        pending = d.combine_start(out, handle)                         # partial sums, launch
        ...                                                            # more overlapped work
        y = d.combine_wait(pending)                                    # [T, H]

    ``dispatch`` / ``combine`` are the two halves back to back. On CUDA the collectives run on NCCL's
    stream, so work queued between start and wait runs concurrently with them; on CPU (gloo) they run
    in gloo's threads. Pending objects and handles are opaque: pass them back unchanged, once.

    The "experts" it routes are the layer's physical slots (``slots``, P = E without redundant experts: slot e is
    expert e): expert_rank: [P] int64, rank owning each slot. expert_local: [P] int64, its local id there.
    _copy_table: [P + 1] int64, entry s + 1 = local id of slot s here, or E_local (entry 0: id -1).
    """

    def __init__(self, config: MoEConfig, scheme: QuantScheme, process_group=None, payload: str | None = None,
                 planned=None):
        payload = config.dispatch_payload if payload is None else payload
        group = resolve_group(process_group)
        super().__init__(config, scheme, group, planned)
        if group is None or dist.get_world_size(group) < 2:
            raise error("MF208", name=self.name, why="needs an expert-parallel group of 2 or more ranks", valid=["local"])
        if payload not in PAYLOADS:
            raise error("MF102", field="payload", value=payload, valid=list(PAYLOADS))
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.device = comm_device(config.device)
        self.payload = payload
        check_agreement(self._description(), group, self.device)
        self.slots = slot_placement(config, self.world)
        self.expert_rank, self.expert_local, self._copy_table = (
            torch.tensor(t, dtype=torch.int64, device=self.device) for t in self._tables(self.slots))
        per_row = row_local(payload_scheme(scheme))
        if payload == "fp8" and not per_row:
            raise error("MF506", scheme=scheme.name, why="its activation scale spans the whole batch",
                        valid=["auto", "dtype"])
        compress = payload == "fp8" or (payload == "auto" and scheme.activations_quantized and per_row)
        self.codec = RowCodec(config.hidden_size, config.top_k, config.dtype,
                              payload_scheme(scheme) if compress else None)

    def _tables(self, slots: Placement) -> tuple[list[int], list[int], list[int]]:
        """Set placement (slot -> rank) and _local (this rank's slots) for ``slots``; -> the values of expert_rank,
        expert_local and _copy_table."""
        self.placement = slots.ranks
        self._local = slots.local_slots(self.rank)
        local_id = [0] * slots.num_slots
        for r in range(self.world):
            for i, s in enumerate(slots.local_slots(r)):
                local_id[s] = i
        mine = [local_id[s] if r == self.rank else len(self._local) for s, r in enumerate(self.placement)]
        return list(self.placement), local_id, [len(self._local)] + mine

    def set_slots(self, slots: Placement) -> None:
        """Route to ``slots`` from the next dispatch on (MoE.rebalance: this rank keeps its slot count, so the tables
        keep their shapes and are rewritten in place, and a captured graph reads the new ones)."""
        self.slots = slots
        for dst, values in zip((self.expert_rank, self.expert_local, self._copy_table), self._tables(slots)):
            dst.copy_(torch.tensor(values, dtype=torch.int64))

    @property
    def local_experts(self) -> list[int]:
        return [self.slots.experts[s] for s in self._local]

    def local_copies(self, gids: Tensor) -> Tensor:
        """gids [R, K] global expert ids (-1 padding) -> [R * K] int64: the local expert of each
        copy, or E_local (a sentinel that sorts last) where the copy is not for this rank."""
        return self._copy_table[gids.long().flatten() + 1]

    def with_payload(self, payload: str) -> "ExpertParallelDispatcher":
        """A new dispatcher of the same kind and group with another payload mode (collective: every
        rank must call it). ``moe.dispatcher = moe.dispatcher.with_payload("fp8")``. The new one keeps this one's
        settings made after construction (rows by index as planned for the runner, the combine's pieces)."""
        new = type(self)(self.config, self.scheme, self.process_group, payload=payload, planned=self.planned)
        for setting in ("indexed_rows", "combine_chunks"):
            if hasattr(self, setting):
                setattr(new, setting, getattr(self, setting))
        return new

    def _description(self) -> dict:
        """What ranks must agree on: the configuration, the planned backends, the group size, the payload."""
        fields = self.config.to_dict()
        try:  # the placement each rank resolves: None and the same contiguous blocks written out agree
            slots = slot_placement(self.config, dist.get_world_size(self.process_group))
            fields["placement"] = list(slots.ranks) if slots.identity else slots.to_dict()
        except MoeflowError:  # an invalid one (MF504, MF510: raised after the ranks agree) is compared as given
            pass
        p = self.planned  # the layer's plan; a dispatcher built outside a layer has none to compare
        if p is not None:
            fields.update({"plan.scheme": p.scheme, "plan.runner": p.runner, "plan.dispatcher": p.dispatcher})
        fields.update({"world_size": dist.get_world_size(self.process_group), "dispatcher.class": self.name,
                       "dispatcher.payload": self.payload})
        return fields

    # ---------------------------------------------------------------- the halves
    def dispatch(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> tuple[ExpertBatch, Any]:
        return self.dispatch_wait(self.dispatch_start(hidden, topk_ids, topk_weights))

    def combine(self, expert_out: Tensor, handle: Any) -> Tensor:
        return self.combine_wait(self.combine_start(expert_out, handle))

    @abstractmethod
    def dispatch_start(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Any:
        """hidden [T, H] layer dtype, topk_ids [T, K] int32 global ids, topk_weights [T, K] float32
        -> pending dispatch (the collective is in flight)."""

    @abstractmethod
    def dispatch_wait(self, pending: Any) -> tuple[ExpertBatch, Any]:
        """-> (ExpertBatch for this rank's experts in ``caps.layout``, handle for combine)."""

    @abstractmethod
    def combine_start(self, expert_out: Tensor, handle: Any) -> Any:
        """expert_out in the batch's layout, layer dtype, routing weights applied -> pending combine."""

    @abstractmethod
    def combine_wait(self, pending: Any) -> Tensor:
        """-> [T, H] layer dtype: the sum of each token's K weighted copies, on its own rank."""
