"""Placement: where a layer's expert weights live, replicas included — physical slot -> (logical expert, rank).

A layer of E logical experts and R = ``num_redundant_experts`` has P = E + R physical slots. Slot s holds a copy (a
replica) of logical expert ``experts[s]`` on rank ``ranks[s]``; a rank's local slots are its slots in ascending slot
order (local id = position). The dispatchers route to slots; the layer maps each token copy to one replica of its
logical expert (balance/slots.py). Plain data, validated here with coded errors (MF510).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

from ..errors import error


def _ints(values, name: str) -> tuple[int, ...]:
    """A sequence of non-negative ints (numpy's too) as a tuple; MF510 otherwise."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise error("MF510", why=f"{name} is {values!r}: it must be a sequence of integers, one per slot")
    out = []
    for v in values:
        try:
            out.append(operator.index(v))
        except TypeError:
            raise error("MF510", why=f"{name} has the entry {v!r}: it must hold integers") from None
    if min(out, default=0) < 0:
        raise error("MF510", why=f"{name} has the entry {min(out)}: entries are >= 0")
    return tuple(out)


@dataclass(frozen=True)
class Placement:
    """Physical expert slots of a layer. Fields (P slots):

        experts  [P] int   logical expert held by slot s (a replica of it)
        ranks    [P] int   rank holding slot s

    Valid for a layer (``check``): P == num_experts + num_redundant_experts, every logical expert in
    [0, num_experts) holds at least one slot, every rank of the group holds at least one slot and no other rank is
    named. Two replicas of one expert may share a rank (valid, but they balance nothing). Without redundant experts
    ``Placement.of_ranks(config placement)`` is the expert -> rank placement: slot e holds expert e (``identity``)."""

    experts: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self):
        experts, ranks = _ints(self.experts, "experts"), _ints(self.ranks, "ranks")
        if len(experts) != len(ranks):
            raise error("MF510", why=f"has {len(experts)} experts and {len(ranks)} ranks: one of each per slot")
        object.__setattr__(self, "experts", experts)
        object.__setattr__(self, "ranks", ranks)

    # ---------------------------------------------------------------- construction
    @classmethod
    def of_ranks(cls, ranks) -> "Placement":
        """Expert e on rank ranks[e], one slot per expert (no replicas)."""
        ranks = _ints(ranks, "ranks")
        return cls(tuple(range(len(ranks))), ranks)

    @classmethod
    def contiguous(cls, num_experts: int, num_slots: int, world: int) -> "Placement":
        """Slot s holds expert s mod num_experts; slots in contiguous blocks over ``world`` ranks, the first
        num_slots mod world ranks holding one more (without redundant slots: MoEConfig's default placement)."""
        base, extra = divmod(num_slots, world)
        ranks = tuple(r for r in range(world) for _ in range(base + (r < extra)))
        return cls(tuple(s % num_experts for s in range(num_slots)), ranks)

    # ---------------------------------------------------------------- reading
    @property
    def num_slots(self) -> int:
        return len(self.experts)

    @property
    def identity(self) -> bool:
        """Slot e holds logical expert e and there are no other slots: routing needs no mapping."""
        return self.experts == tuple(range(len(self.experts)))

    def local_slots(self, rank: int) -> list[int]:
        """The slots of ``rank`` in local order (local id = position)."""
        return [s for s, r in enumerate(self.ranks) if r == rank]

    def local_experts(self, rank: int) -> list[int]:
        """The logical expert of each local slot of ``rank`` (a replicated one may appear twice)."""
        return [self.experts[s] for s in self.local_slots(rank)]

    def slot_counts(self, world: int) -> list[int]:
        """[world] slots on each rank."""
        counts = [0] * world
        for r in self.ranks:
            if r < world:
                counts[r] += 1
        return counts

    def replica_table(self, num_experts: int) -> tuple[list[int], list[int], list[int]]:
        """CSR form of the replicas: (start [E], count [E], slots [P]); the replicas of expert e are
        slots[start[e] : start[e] + count[e]], in ascending slot order (the order the replica rule indexes)."""
        by_expert = sorted(range(self.num_slots), key=lambda s: (self.experts[s], s))
        count = [0] * num_experts
        for e in self.experts:
            count[e] += 1
        start = [0] * num_experts
        for e in range(1, num_experts):
            start[e] = start[e - 1] + count[e - 1]
        return start, count, by_expert

    def to_dict(self) -> dict:
        """JSON-able form (for the ranks' agreement check and for saving)."""
        return {"experts": list(self.experts), "ranks": list(self.ranks)}

    # ---------------------------------------------------------------- validation
    def check(self, num_experts: int, num_slots: int, world: int | None = None) -> "Placement":
        """MF510 unless this placement fits a layer of ``num_experts`` logical experts and ``num_slots`` physical
        slots (and, given ``world``, a group of that many ranks); -> self."""
        if self.num_slots != num_slots:
            raise error("MF510", why=f"has {self.num_slots} slots; the layer has num_experts + num_redundant_experts "
                                     f"= {num_slots} (pass num_redundant_experts={self.num_slots - num_experts})")
        beyond = [e for e in self.experts if e >= num_experts]
        if beyond:
            raise error("MF510", why=f"names expert {beyond[0]}; experts are 0..{num_experts - 1}")
        missing = sorted(set(range(num_experts)) - set(self.experts))
        if missing:
            raise error("MF510", why=f"gives expert {missing[0]} no replica ({len(missing)} experts have none); "
                                     "every logical expert needs at least one slot")
        if world is not None:
            outside = [r for r in self.ranks if r >= world]
            if outside:
                raise error("MF510", why=f"names rank {outside[0]}, outside the group: its ranks are 0..{world - 1}")
            idle = [r for r, n in enumerate(self.slot_counts(world)) if n == 0]
            if idle:
                raise error("MF510", why=f"gives rank {idle[0]} no slot; every rank of the group needs at least one")
        return self
