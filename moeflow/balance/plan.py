"""plan_placement: a Placement with replicas from measured load, in the spirit of DeepSeek's published expert-parallel
load balancer (EPLB): replicate the heaviest experts, then pack the replicas so every rank's expected load is even,
optionally keeping groups of experts on one node first. Pure Python on the host; deterministic (ties: lowest index).
rank_loads / imbalance: what a placement is expected to give a rank, each replica taking an equal share.
"""
from __future__ import annotations

import heapq
import math

import torch

from ..errors import error
from .placement import Placement


def replicate(load: list[float], num_slots: int, most: int | None = None) -> list[int]:
    """[E] replica counts summing to ``num_slots``: each expert one, then each extra slot to the expert with the
    highest load per replica (load / count) at that point (ties: the lower expert id). most: no expert gets more
    replicas than that (the ranks they spread over: a replica more than ranks doubles up on one, whose share then
    grows) while another can take the slot."""
    counts = [1] * len(load)
    heap = [(-w, e) for e, w in enumerate(load)]
    heapq.heapify(heap)
    for _ in range(num_slots - len(load)):
        if not heap:  # every expert at ``most``: the cap cannot hold
            heap = [(-load[e] / counts[e], e) for e in range(len(load))]
            heapq.heapify(heap)
            most = None
        _, e = heapq.heappop(heap)
        counts[e] += 1
        if most is None or counts[e] < most:
            heapq.heappush(heap, (-load[e] / counts[e], e))
    return counts


def pack(weights: list[float], num_bins: int, per_bin: int, tags: list[int] | None = None) -> list[int]:
    """Greedy balanced packing with equal counts: -> the bin of each item (len(weights) == num_bins * per_bin).
    Items in decreasing weight go to the lightest bin with room; with ``tags`` (the logical expert of each item), to
    the lightest bin with room that holds no item of the same tag, where one has room (replicas on distinct ranks)."""
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    loads, sizes = [0.0] * num_bins, [0] * num_bins
    held: list[set] = [set() for _ in range(num_bins)]
    bins = [0] * len(weights)
    for i in order:
        room = [b for b in range(num_bins) if sizes[b] < per_bin]
        if tags is not None:
            room = [b for b in room if tags[i] not in held[b]] or room
        b = min(room, key=lambda c: (loads[c], c))
        bins[i] = b
        loads[b] += weights[i]
        sizes[b] += 1
        if tags is not None:
            held[b].add(tags[i])
    return bins


def _load_list(load) -> list[float]:
    """load [E] (a tensor or a sequence) as finite non-negative floats; MF513 otherwise."""
    try:
        t = torch.as_tensor(load).detach().to("cpu", torch.float64)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise error("MF513", why=f"load must be a tensor or sequence of numbers [E], not {type(load).__name__}: "
                                 f"{exc}") from None
    values = t.tolist()
    if t.dim() != 1 or not values:
        raise error("MF513", why=f"load must be one dimensional [E], got shape {tuple(t.shape)}")
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise error("MF513", why="load must hold finite numbers >= 0 (token counts)")
    return values


def _positive(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise error("MF513", why=f"{name}={value!r} must be an integer >= {minimum}")
    return value


def plan_placement(load, num_ranks: int, num_redundant: int, *, group_size: int | None = None,
                   ranks_per_node: int | None = None) -> Placement:
    """load [E] (tokens per logical expert, e.g. ``layer.expert_load(all_ranks=True)``) -> a Placement of
    E + num_redundant slots over ``num_ranks`` ranks, (E + num_redundant) / num_ranks slots on each.

    1. With ``group_size`` and ``ranks_per_node`` (both or neither): the E / group_size groups of consecutive experts
       (DeepSeek-V3's routing groups) are packed onto the nodes, the same number of groups on each, balancing their
       load; each node then gets as many slots as it has ranks, and 2-3 run per node on its experts only (replicas
       never leave their node: the all-to-all of a group's tokens stays inside it).
    2. Replication: the extra slots go one by one to the expert with the highest load per replica, at most one
       replica per rank of the node while another expert can take the slot (``replicate``).
    3. Packing: replicas, each carrying load / count, go heaviest first to the lightest rank with room, avoiding a
       rank that holds the same expert (``pack``).
    Slots come out rank by rank, each rank's sorted by logical expert. MF513 for arguments that cannot be planned."""
    weights = _load_list(load)
    e = len(weights)
    _positive("num_ranks", num_ranks)
    _positive("num_redundant", num_redundant, 0)
    slots = e + num_redundant
    if slots % num_ranks:
        raise error("MF513", why=f"num_experts + num_redundant = {slots} slots do not split evenly over {num_ranks} "
                                 f"ranks; use a num_redundant that makes it a multiple of {num_ranks}")
    if (group_size is None) != (ranks_per_node is None):
        raise error("MF513", why="group_size and ranks_per_node go together (groups of experts kept on one node)")
    if group_size is None:
        group_size, ranks_per_node = e, num_ranks
    _positive("group_size", group_size)
    _positive("ranks_per_node", ranks_per_node)
    if e % group_size or num_ranks % ranks_per_node:
        raise error("MF513", why=f"group_size={group_size} must divide num_experts={e} and ranks_per_node="
                                 f"{ranks_per_node} must divide num_ranks={num_ranks}")
    nodes, groups = num_ranks // ranks_per_node, e // group_size
    if groups % nodes:
        raise error("MF513", why=f"{groups} groups of experts do not split evenly over {nodes} nodes")
    group_load = [sum(weights[g * group_size:(g + 1) * group_size]) for g in range(groups)]
    node_of_group = pack(group_load, nodes, groups // nodes)
    per_rank = slots // num_ranks
    experts, ranks = [], []
    for node in range(nodes):
        mine = [x for g in range(groups) if node_of_group[g] == node
                for x in range(g * group_size, (g + 1) * group_size)]
        counts = replicate([weights[x] for x in mine], per_rank * ranks_per_node, most=ranks_per_node)
        items = [(x, weights[x] / c) for x, c in zip(mine, counts) for _ in range(c)]
        bins = pack([w for _, w in items], ranks_per_node, per_rank, tags=[x for x, _ in items])
        for local_rank in range(ranks_per_node):
            held = sorted(x for (x, _), b in zip(items, bins) if b == local_rank)
            experts += held
            ranks += [node * ranks_per_node + local_rank] * len(held)
    return Placement(tuple(experts), tuple(ranks))


def rank_loads(placement: Placement, load, world: int | None = None) -> list[float]:
    """[W] expected load of each rank: every replica of expert e takes load[e] / (replicas of e), as the replica
    rule spreads an expert's copies evenly (balance/slots.to_slots)."""
    weights = _load_list(load)
    world = world or max(placement.ranks) + 1
    count = [0] * len(weights)
    for x in placement.experts:
        count[x] += 1
    out = [0.0] * world
    for x, r in zip(placement.experts, placement.ranks):
        out[r] += weights[x] / count[x]
    return out


def imbalance(placement: Placement, load, world: int | None = None) -> float:
    """max / mean of rank_loads (1.0: even; the slowest rank sets a layer's time); 1.0 for zero load."""
    loads = rank_loads(placement, load, world)
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0
