"""The layer's side of load balancing: rebalance (collective: the ranks agree on the new placement, MF511, then
expert weights move between ranks by torch.distributed, FP8 weights and scales as bytes, and the tables are rewritten
in place), expert_load (the counter, all-reduced on request), and the replicas' weights (share_replicas,
logical_rows). MoE.rebalance, MoE.expert_load and MoE.state_dict call these.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed import all_gather_json, collective, comm_device, wait
from ..errors import MoeflowError, error
from .placement import Placement

EXPERT_TENSORS = ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")


def _group(layer):
    """(process group or None, rank, world) of the layer's dispatcher."""
    world = layer.environment.world_size
    if world < 2:
        return None, 0, 1
    return layer.dispatcher.process_group, layer.dispatcher.rank, world


def expert_load(layer, reset: bool = False, all_ranks: bool = False) -> Tensor:
    """[E] int64 on the layer's device: token copies routed to each logical expert since the last reset, on this
    rank (all_ranks=False) or summed over the group (all_ranks=True: collective, every rank calls it). reset: start
    a new window (the counter zeroed in place, after it is read). MF512 where the layer does not record."""
    counter = layer.expert_slots.load
    if counter is None:
        raise error("MF512", why="it was built with record_expert_load=False")
    out = counter.clone()
    if reset:
        counter.zero_()
    group, _, world = _group(layer)
    if all_ranks and world > 1:
        with collective("expert_load all-reduce", group):
            work = dist.all_reduce(out, group=group, async_op=True)
        wait(work, "expert_load all-reduce", group, out.device, host=True)
    return out


def _agree(described: dict, group, rank: int, device) -> None:
    """MF511 on every rank unless every rank described the same placement (all_gather_json, bounded by
    MOEFLOW_DIST_TIMEOUT_S: MF502 if a rank never calls)."""
    everyone = all_gather_json(described, group, "the rebalance placement check", device)
    ours = everyone[rank]
    for other, theirs in enumerate(everyone):
        if theirs != ours:
            if "unreadable" in theirs or "unreadable" in ours:
                why = (f"rank {other}'s: {theirs['unreadable']}" if "unreadable" in theirs else
                       f"rank {rank}'s: {ours['unreadable']}")
                why = "one is not a valid placement, " + why
            else:
                why = _first_difference(ours, theirs)
            raise error("MF511", rank=rank, other=other, why=why)


def _first_difference(a: dict, b: dict) -> str:
    pairs_a, pairs_b = list(zip(a["experts"], a["ranks"])), list(zip(b["experts"], b["ranks"]))
    if len(pairs_a) != len(pairs_b):
        return f"{len(pairs_a)} slots vs {len(pairs_b)}"
    s = next(i for i, (x, y) in enumerate(zip(pairs_a, pairs_b)) if x != y)
    return f"slot {s} holds (expert, rank) {pairs_a[s]} vs {pairs_b[s]}"


def rebalance(layer, placement: Placement) -> None:
    """MoE.rebalance: collective over the layer's group (every rank calls it with the same placement).

    1. The ranks compare their placements (MF511 on every rank if they differ; a rank that never calls: MF502).
    2. The placement is checked against the layer (MF510): its slot count, every expert replicated, the group's
       ranks, and each rank keeping its slot count (so every table and weight is rewritten in place).
    3. Each new local slot is filled: from this rank's own copy of the expert where it has one, else received from
       a rank that holds it (the holders taken in turn); one all_to_all_single of byte rows carries every moving
       expert's weights and scales. 4. The dispatcher's and the layer's tables follow; the layer's config holds the
       new placement (a later .to() builds the same one). The load counter is left as it is."""
    cfg = layer.config
    group, rank, world = _group(layer)
    problem = None
    try:
        if not isinstance(placement, Placement):
            raise error("MF510", why=f"is a {type(placement).__name__}; layer.rebalance takes a moeflow.balance."
                                     "Placement (plan_placement makes one)")
        described = placement.to_dict()
    except MoeflowError as exc:
        problem, described = exc, {"unreadable": exc.detail}
    if world > 1:
        _agree(described, group, rank, comm_device(cfg.device))
    if problem is not None:
        raise problem
    slots = cfg.num_experts + cfg.num_redundant_experts
    placement.check(cfg.num_experts, slots, world)
    old = layer.expert_slots.placement
    before, after = old.slot_counts(world), placement.slot_counts(world)
    changed = [r for r in range(world) if before[r] != after[r]]
    if changed:
        r = changed[0]
        raise error("MF510", why=f"gives rank {r} {after[r]} slots where it holds {before[r]}: a rebalance keeps each "
                                 "rank's slot count (weights and tables are rewritten in place); build the layer "
                                 "with this placement instead (MoEConfig.placement)")
    if placement != old:
        _move_weights(layer, old, placement, group, rank, world)
    layer.dispatcher.set_slots(placement)
    if layer.expert_slots.update(placement):
        layer._graphs = type(layer._graphs)(layer.plan.graph_safe)  # another set of launches: capture anew
    layer.config = cfg.replace(placement=placement)
    layer.dispatcher.config = layer.config  # with_payload builds from it
    layer.local_experts = layer.dispatcher.local_experts


def transfers(old: Placement, new: Placement, world: int) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """{(source rank, destination rank): [(source local slot, destination local slot)]}: where each new local slot's
    weights come from. A rank keeping the expert copies its own (source == destination); the others take the old
    holders of the expert in turn (lowest rank first), so a hot expert's new replicas are sent by several ranks."""
    first = {}
    holders = defaultdict(list)
    for r in range(world):
        for j, x in enumerate(old.local_experts(r)):
            if (r, x) not in first:
                first[(r, x)] = j
                holders[x].append(r)
    turn = defaultdict(int)
    moves = defaultdict(list)
    for dst in range(world):
        for j, x in enumerate(new.local_experts(dst)):
            if (dst, x) in first:
                src = dst
            else:
                src = holders[x][turn[x] % len(holders[x])]
                turn[x] += 1
            moves[(src, dst)].append((first[(src, x)], j))
    return moves


def _move_weights(layer, old: Placement, new: Placement, group, rank: int, world: int) -> None:
    """Rewrite this rank's expert tensors ([E_local, ...] each) in place for ``new`` (rebalance, step 3)."""
    moves = transfers(old, new, world)
    tensors = [t.data for t in (getattr(layer, n) for n in EXPERT_TENSORS) if t is not None]
    rows = [t.reshape(t.shape[0], -1).view(torch.uint8) for t in tensors]  # [E_local, bytes]: FP8 travels as bytes
    widths = [r.shape[1] for r in rows]
    dev = tensors[0].device
    received = None
    if any(src != dst and pairs for (src, dst), pairs in moves.items()):  # every rank computes the same moves
        send_idx = [i for d in range(world) if d != rank for i, _ in moves.get((rank, d), [])]
        sent = [0 if d == rank else len(moves.get((rank, d), [])) for d in range(world)]
        got = [0 if s == rank else len(moves.get((s, rank), [])) for s in range(world)]
        index = torch.tensor(send_idx, dtype=torch.int64, device=dev)
        send = torch.cat([r.index_select(0, index) for r in rows], dim=1)
        received = send.new_empty(sum(got), sum(widths))
        with collective("rebalance (expert weights)", group):
            work = dist.all_to_all_single(received, send, got, sent, group=group, async_op=True)
        wait(work, "rebalance (expert weights)", group, dev, host=True)
    # destination local slot <- own row (local) or received row, in the order the sources packed them
    own = moves.get((rank, rank), [])
    incoming = [j for s in range(world) if s != rank for _, j in moves.get((s, rank), [])]
    offset = 0
    for t, r, width in zip(tensors, rows, widths):
        fresh = torch.empty_like(r)
        if own:
            src = torch.tensor([i for i, _ in own], dtype=torch.int64, device=dev)
            dst = torch.tensor([j for _, j in own], dtype=torch.int64, device=dev)
            fresh.index_copy_(0, dst, r.index_select(0, src))
        if incoming:
            part = received[:, offset:offset + width]
            fresh.index_copy_(0, torch.tensor(incoming, dtype=torch.int64, device=dev), part)
        r.copy_(fresh)  # r is a view of the parameter: written in place
        offset += width


def share_replicas(layer) -> None:
    """Every local replica of an expert takes the weights of its first local slot (a random init drew each slot on
    its own; replicas must hold one expert's weights)."""
    local = layer.local_experts
    first = {}
    pairs = [(j, first.setdefault(x, j)) for j, x in enumerate(local)]
    pairs = [(j, f) for j, f in pairs if j != f]
    for name in EXPERT_TENSORS:
        t = getattr(layer, name)
        for j, f in pairs if t is not None else ():
            t.data[j].copy_(t.data[f])


def logical_rows(local_experts: list[int]) -> list[int] | None:
    """The local slot of each logical expert this rank holds, in ascending expert order (its first replica here):
    the rows ``state_dict`` writes. None where that is every local slot in order (no replicas here: the parameters
    are written as they are)."""
    first = {}
    for j, x in enumerate(local_experts):
        first.setdefault(x, j)
    rows = [first[x] for x in sorted(first)]
    return None if rows == list(range(len(local_experts))) else rows
