"""Expert-parallel load balancing in one process (moeflow.balance; the multi-process side runs in the gloo groups of
tests/dispatch/test_ep_cpu.py): Placement's checks (MF510), the replica rule and the load counter against plain
Python references with their edge cases, plan_placement's balance on Zipf-skewed routing, and a layer with replicas:
the same outputs as without, its state_dict, its load counter (MF512), a rebalance."""
import pytest
import torch

from moeflow import MoE, MoEConfig, MoeflowError
from moeflow.balance import Placement, count_copies, imbalance, plan_placement, rank_loads
from moeflow.balance.rebalance import transfers
from moeflow.balance.slots import ExpertSlots
from oracle import bits, rel_err
from tolerances import rel_tol

SMALL = dict(num_experts=8, hidden_size=64, intermediate_size=32, top_k=2, device="cpu")


def raises(code, fn, *args, **kwargs):
    with pytest.raises(MoeflowError) as info:
        fn(*args, **kwargs)
    assert info.value.code == code, info.value
    return info.value


def zipf_routing(e, k, t, s, seed=0):
    """[t, k] ids: each token's k distinct experts drawn by Zipf popularity (expert of popularity rank i: weight
    1 / (i + 1)^s, ranks shuffled), Gumbel top-k without replacement."""
    g = torch.Generator().manual_seed(seed)
    logp = -s * torch.log(torch.arange(1, e + 1, dtype=torch.float64))[torch.randperm(e, generator=g)]
    gumbel = -torch.log(-torch.log(torch.rand(t, e, generator=g, dtype=torch.float64)))
    return (logp + gumbel).topk(k, dim=1).indices


# ---------------------------------------------------------------- Placement
def test_placement_checks():
    p = Placement.contiguous(4, 6, 2)
    assert p.experts == (0, 1, 2, 3, 0, 1) and p.ranks == (0, 0, 0, 1, 1, 1)
    assert p.local_experts(1) == [3, 0, 1] and p.local_slots(1) == [3, 4, 5] and p.replica_table(4) == (
        [0, 2, 4, 5], [2, 2, 1, 1], [0, 4, 1, 5, 2, 3])
    assert p.check(4, 6, 2) is p and not p.identity and Placement.of_ranks([1, 0]).identity
    assert "2 experts and 1 ranks" in str(raises("MF510", Placement, (0, 1), (0,)))
    raises("MF510", Placement, (0, -1), (0, 0))
    raises("MF510", Placement, (0, 0.5), (0, 0))
    raises("MF510", Placement, "01", (0, 0))
    assert "num_redundant_experts=2" in str(raises("MF510", p.check, 4, 4))
    assert "expert 5" in str(raises("MF510", Placement((0, 1, 2, 5), (0, 0, 1, 1)).check, 4, 4))
    assert "expert 3 no replica" in str(raises("MF510", Placement((0, 1, 2, 2), (0, 0, 1, 1)).check, 4, 4))
    assert "rank 2, outside" in str(raises("MF510", Placement((0, 1, 2, 3), (0, 0, 1, 2)).check, 4, 4, 2))
    assert "rank 1 no slot" in str(raises("MF510", Placement((0, 1, 2, 3), (0, 0, 2, 2)).check, 4, 4, 3))


def test_config_takes_placements_with_replicas():
    p = Placement.contiguous(8, 10, 1)
    cfg = MoEConfig(**SMALL, num_redundant_experts=2, placement=p)
    assert cfg.placement is p and cfg.to_dict()["placement"] == {"experts": p.experts, "ranks": p.ranks}
    assert "no room" in str(raises("MF510", MoEConfig, **SMALL, num_redundant_experts=2, placement=[0] * 8))
    raises("MF510", MoEConfig, **SMALL, placement=p)  # 10 slots, num_redundant_experts=0
    raises("MF101", MoEConfig, **SMALL, num_redundant_experts=-1)
    raises("MF102", MoEConfig, **SMALL, record_expert_load="yes")
    assert "outside the group" in str(raises("MF510", MoE, **SMALL, num_redundant_experts=2,
                                             placement=Placement(p.experts, (0,) * 9 + (1,))))
    from moeflow.integrations.path import ExpertsPath
    raises("MF510", ExpertsPath, MoEConfig(**SMALL, num_redundant_experts=2))


# ---------------------------------------------------------------- the replica rule and the counter
def slots_reference(ids, placement, num_experts, rank=0):
    """to_slots in plain Python: copy (t, k) of expert e -> its replica (t + k + rank) mod count, slots ascending."""
    out = []
    for t, row in enumerate(ids.tolist()):
        out.append([-1 if e < 0 else [s for s, x in enumerate(placement.experts) if x == e][(t + k + rank) % sum(
            x == e for x in placement.experts)] for k, e in enumerate(row)])
    return torch.tensor(out, dtype=torch.int32).view(ids.shape)


@pytest.mark.parametrize("case", ["random", "empty", "one-expert", "dropped", "rank-3"])
def test_to_slots_matches_the_reference(case):
    e, k = 6, 3
    p = Placement((5, 0, 1, 2, 0, 3, 4, 0, 5), (0, 0, 0, 1, 1, 1, 2, 2, 2))  # expert 0: 3 replicas, 5: 2
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(13)]).to(torch.int32)
    rank = 0
    if case == "empty":
        ids = ids[:0]
    elif case == "one-expert":  # every token's first choice is expert 0
        ids[:, 0] = 0
        ids[:, 1:] = torch.tensor([1, 2], dtype=torch.int32)
    elif case == "dropped":
        ids[::2, 1] = -1
    elif case == "rank-3":
        rank = 3
    table = ExpertSlots(p, e, "cpu", rank=rank)
    got = table(ids)
    assert got.dtype == torch.int32 and got.shape == ids.shape
    assert torch.equal(got, slots_reference(ids, p, e, rank))
    held = torch.tensor(p.experts)[got.long().clamp(min=0)]
    assert torch.equal(torch.where(got >= 0, held, -1), ids.long())  # each copy reaches its own expert
    if case == "one-expert":  # 13 copies of expert 0 over 3 replicas: 5, 4, 4
        assert sorted(torch.bincount(got[:, 0].long(), minlength=9)[[1, 4, 7]].tolist()) == [4, 4, 5]


def test_identity_placement_hands_the_ids_on():
    ids = torch.randint(0, 8, (5, 2), dtype=torch.int32)
    assert ExpertSlots(Placement.of_ranks([0] * 8), 8, "cpu")(ids) is ids


@pytest.mark.parametrize("case", ["random", "empty", "one-expert", "dropped", "padded"])
def test_count_copies_matches_bincount(case):
    e = 7
    ids = torch.stack([torch.randperm(e - 1)[:2] for _ in range(11)])  # expert 6 never chosen: its count stays 0
    valid = None
    if case == "empty":
        ids = ids[:0]
    elif case == "one-expert":
        ids[:, 0] = 3
    elif case == "dropped":
        ids[1:4, 1] = -1
    elif case == "padded":
        valid = torch.tensor([6])
    load = torch.full((e,), 5, dtype=torch.int64)  # accumulates onto what was there
    count_copies(ids.to(torch.int32), load, valid)
    kept = ids[:6] if valid is not None else ids
    want = 5 + torch.bincount(kept[kept >= 0].flatten(), minlength=e)
    assert torch.equal(load, want) and int(load[e - 1]) == 5


# ---------------------------------------------------------------- planning
def test_plan_placement_balances_zipf_routing():
    """E=64, top-8, 16 ranks, Zipf 1.2 popularity: contiguous placement max/mean ~2+; 16 redundant slots (one a
    rank) bring it under 1.1, and rank loads stay as planned on routing drawn afresh from the same popularity."""
    e, k, world = 64, 8, 16
    load = torch.bincount(zipf_routing(e, k, 8192, 1.2).flatten(), minlength=e)
    before = imbalance(Placement.of_ranks([x * world // e for x in range(e)]), load)
    after = plan_placement(load, world, world)
    after.check(e, e + world, world)
    assert after.slot_counts(world) == [(e + world) // world] * world
    assert before > 1.5 and imbalance(after, load) < 1.1, (before, imbalance(after, load))
    fresh = torch.bincount(zipf_routing(e, k, 8192, 1.2, seed=0).flatten(), minlength=e)
    assert imbalance(after, fresh) < 1.1
    no_replicas = plan_placement(load, world, 0)  # rearranging alone helps less
    assert imbalance(after, load) < imbalance(no_replicas, load) < before
    assert plan_placement(load, world, world) == after  # deterministic
    hot = int(load.argmax())
    assert len({r for x, r in zip(after.experts, after.ranks) if x == hot}) == after.experts.count(hot) > 1
    assert abs(sum(rank_loads(after, load)) - float(load.sum())) < 1e-6


def test_plan_placement_keeps_groups_on_a_node():
    """DeepSeek-like groups: 8 groups of 4 experts, 2 nodes of 4 ranks: each group's replicas stay on one node."""
    load = torch.bincount(zipf_routing(32, 4, 4096, 1.0, seed=3).flatten(), minlength=32)
    p = plan_placement(load, 8, 8, group_size=4, ranks_per_node=4)
    p.check(32, 40, 8)
    for g in range(8):
        nodes = {r // 4 for x, r in zip(p.experts, p.ranks) if x // 4 == g}
        assert len(nodes) == 1, (g, p)
    assert imbalance(p, load) < imbalance(Placement.of_ranks([x // 4 for x in range(32)]), load)


def test_plan_placement_edges_and_refusals():
    uniform = plan_placement(torch.zeros(8), 4, 0)  # no load yet: a valid placement all the same
    uniform.check(8, 8, 4)
    assert imbalance(uniform, torch.zeros(8)) == 1.0
    one_hot = torch.zeros(8)
    one_hot[2] = 100
    p = plan_placement(one_hot, 4, 4)  # all tokens to one expert: a replica on every rank (a fifth would double up)
    assert p.experts.count(2) == 4 and sorted(p.ranks[i] for i, x in enumerate(p.experts) if x == 2) == [0, 1, 2, 3]
    assert imbalance(p, one_hot) == 1.0
    assert "multiple of 3" in str(raises("MF513", plan_placement, torch.ones(8), 3, 0))
    raises("MF513", plan_placement, torch.ones(2, 4), 2, 0)
    raises("MF513", plan_placement, torch.tensor([1.0, -1.0]), 2, 0)
    raises("MF513", plan_placement, torch.ones(8), 2, 0, group_size=4)
    raises("MF513", plan_placement, torch.ones(8), 4, 0, group_size=4, ranks_per_node=1)  # 2 groups, 4 nodes
    raises("MF513", plan_placement, "load", 2, 0)


def test_transfers_take_the_holders_in_turn():
    old = Placement((0, 1, 2, 3), (0, 0, 1, 1))
    new = Placement((0, 2, 2, 3, 1, 2), (0, 0, 1, 1, 2, 2))
    moves = transfers(old, new, 3)
    assert moves[(0, 0)] == [(0, 0)] and moves[(1, 0)] == [(0, 1)]  # rank 0 keeps 0, receives 2
    assert moves[(1, 1)] == [(0, 0), (1, 1)] and moves[(0, 2)] == [(1, 0)] and moves[(1, 2)] == [(0, 1)]


# ---------------------------------------------------------------- a layer with replicas, one process
def _pair(quant="none", runner="reference", dtype=torch.float32, **fields):
    cfg = MoEConfig(**SMALL, quant=quant, runner=runner, dtype=dtype)
    state = {"gate_up_proj": torch.randn(8, 64, 64) / 8, "down_proj": torch.randn(8, 64, 32) / 32 ** 0.5}
    plain, replicated = MoE(cfg), MoE(cfg.replace(num_redundant_experts=4, record_expert_load=True, **fields))
    for layer in (plain, replicated):
        layer.load_weights(state)
    return plain, replicated


@pytest.mark.parametrize("quant,runner,dtype", [("none", "reference", torch.float32),
                                                ("none", "grouped_mm", torch.bfloat16),
                                                ("fp8-block", "reference", torch.bfloat16)])
def test_layer_with_replicas_equals_the_layer_without(quant, runner, dtype):
    h = 128 if quant == "fp8-block" else 64
    cfg = MoEConfig(**{**SMALL, "hidden_size": h, "intermediate_size": 128 if quant == "fp8-block" else 32},
                    quant=quant, runner=runner, dtype=dtype)
    state = {"gate_up_proj": torch.randn(8, 2 * cfg.intermediate_size, h) / h ** 0.5,
             "down_proj": torch.randn(8, h, cfg.intermediate_size) / cfg.intermediate_size ** 0.5}
    plain, replicated = MoE(cfg), MoE(cfg.replace(num_redundant_experts=4))
    for layer in (plain, replicated):
        layer.load_weights(state)
    assert replicated.local_experts == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert torch.equal(bits(replicated.gate_up_proj[8:]), bits(replicated.gate_up_proj[:4]))  # replicas filled
    x, logits = torch.randn(21, h).to(dtype), torch.randn(21, 8)
    logits[:, 1] += 3  # expert 1 (two replicas) in most tokens
    tol = rel_tol(quant, dtype)
    assert rel_err(replicated(x, logits), plain(x, logits)) <= tol
    ids, w = replicated.router(logits, None)
    assert rel_err(replicated.forward_topk(x, ids, w), plain.forward_topk(x, ids, w)) <= tol
    for t in (0, 1):
        assert replicated(x[:t], logits[:t]).shape == (t, h)


def test_state_dict_writes_logical_experts_and_loads_back():
    plain, replicated = _pair(quant="fp8-channel", dtype=torch.bfloat16)
    saved = replicated.state_dict()
    assert saved["gate_up_proj"].shape[0] == 8 and saved["down_proj_scale_inv"].shape[0] == 8
    for name, t in saved.items():
        assert torch.equal(bits(t), bits(plain.state_dict()[name])), name
    twin = MoE(replicated.config, init_weights=False)
    twin.load_state_dict(saved)
    x, logits = torch.randn(9, 64).to(torch.bfloat16), torch.randn(9, 8)
    assert torch.equal(twin(x, logits), replicated(x, logits))
    fresh = MoE(replicated.config)  # a random init: replicas hold their expert's draw
    assert torch.equal(bits(fresh.gate_up_proj[8:]), bits(fresh.gate_up_proj[:4]))


def test_expert_load_counts_and_resets():
    plain, replicated = _pair()
    raises("MF512", plain.expert_load)
    x, logits = torch.randn(10, 64), torch.randn(10, 8)
    logits[:, 6] = -100  # expert 6 gets no token
    replicated(x, logits)
    replicated(x[:3], logits[:3])
    ids, _ = replicated.router(torch.cat([logits, logits[:3]]), None)
    want = torch.bincount(ids.long().flatten(), minlength=8)
    assert int(want[6]) == 0
    assert torch.equal(replicated.expert_load(), want)
    assert torch.equal(replicated.expert_load(reset=True, all_ranks=True), want)  # one rank: the sum is its own
    assert int(replicated.expert_load().sum()) == 0


def test_rebalance_in_one_process():
    """A planned placement (the hot expert replicated) moves the weights within the process: outputs and
    weights as before; the config holds it, so a dtype conversion keeps it; a wrong slot count is MF510."""
    plain, replicated = _pair()
    x, logits = torch.randn(30, 64), torch.randn(30, 8)
    logits[:, 3] += 4
    before = replicated(x, logits)
    placement = plan_placement(replicated.expert_load(reset=True), 1, 4)
    assert placement.experts.count(3) == 2 and placement != replicated.placement
    replicated.rebalance(placement)
    assert replicated.placement == placement and replicated.local_experts == list(placement.experts)
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(getattr(replicated, name), getattr(plain, name)[list(placement.experts)])
    assert rel_err(replicated(x, logits), before) <= rel_tol("none", torch.float32)
    replicated.bfloat16()
    assert replicated.placement == placement and replicated.local_experts == list(placement.experts)
    assert rel_err(replicated(x.bfloat16(), logits), plain.bfloat16()(x.bfloat16(), logits)) <= rel_tol(
        "none", torch.bfloat16)
    raises("MF510", replicated.rebalance, Placement.contiguous(8, 8, 1))
    raises("MF510", replicated.rebalance, [0] * 12)


def test_rebalance_of_a_layer_without_replicas():
    """A layer built without a Placement (no mapping) rearranged: the mapping starts, the eager graphs are dropped."""
    cfg = MoEConfig(**SMALL, runner="reference", dtype=torch.float32)
    layer = MoE(cfg)
    x, logits = torch.randn(7, 64), torch.randn(7, 8)
    want = layer(x, logits)
    graphs = layer._graphs
    layer.rebalance(Placement(tuple(reversed(range(8))), (0,) * 8))
    assert layer.expert_slots.maps and layer._graphs is not graphs
    assert rel_err(layer(x, logits), want) <= rel_tol("none", torch.float32)
