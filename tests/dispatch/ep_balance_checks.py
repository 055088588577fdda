"""Load-balancing checks run inside the expert-parallel gloo groups (tests/dispatch/test_ep_worker.py's suite; no
tests here): a layer with redundant experts (replicas) on every dispatcher, its load counter summed over the group,
a rebalance to a placement planned from skewed load (weights compared with the checkpoint, outputs with the
one-process layer without replicas), the state_dict round trip, and the coded refusals (MF510, MF511).
"""
import torch

from moeflow import MoE, MoEConfig
from moeflow.balance import Placement, plan_placement
from oracle import bits, rel_err
from tolerances import rel_tol

BASE = dict(num_experts=8, hidden_size=256, intermediate_size=128, top_k=2, max_tokens_per_rank=32)
# (dispatcher, runner, scheme, dtype): every dispatcher, both CPU runners, the FP8 schemes whose weights and scales
# move as bytes
CELLS = (("allgather", "grouped_mm", "none", torch.float32), ("alltoall", "reference", "fp8-block", torch.bfloat16),
         ("alltoall-fixed", "reference", "fp8-tensor", torch.float32),
         ("alltoall-p2p", "grouped_mm", "none", torch.bfloat16),
         ("lowlatency", "reference", "fp8-channel", torch.bfloat16))
EXPERT_TENSORS = ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")


def balance_checks(world):
    """[(name, fn(ctx))] appended to the worker's suite."""
    checks = [(f"replicas-rebalance-{d}-{r}-{s}", lambda c, cell=(d, r, s, dt): check_replicas(c, *cell))
              for d, r, s, dt in CELLS]
    checks.append(("rebalance-disagree-MF511", check_disagreement))
    checks.append(("rebalance-bad-placement-MF510", check_bad_placement))
    return checks


def _state(cfg):
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    return {"gate_up_proj": torch.randn(e, 2 * i, h) / h ** 0.5, "down_proj": torch.randn(e, h, i) / i ** 0.5}


def _skewed(t, e):
    """Router logits where experts 0 and 5 take most tokens (each token's top-2 is mostly {0, 5})."""
    return torch.randn(t, e) + 4.0 * ((torch.arange(e) == 0) | (torch.arange(e) == 5))


def _same_expert_weights(ep, one):
    """Every local slot of ``ep`` holds exactly the one-process layer's (checkpoint's) weights of its logical expert
    (FP8 weights bit for bit, scales too)."""
    idx = torch.tensor(ep.local_experts)
    for name in EXPERT_TENSORS:
        mine, full = getattr(ep, name), getattr(one, name)
        if mine is None:
            continue
        assert torch.equal(bits(mine), bits(full[idx])), f"{name}: a slot does not hold its expert's weights"


def check_replicas(c, dispatcher, runner, quant, dtype):
    """An EP layer with W redundant slots (one a rank) equals the one-process layer without replicas; the load
    counter summed over the group is the routing of all tokens; rebalanced to a placement planned from that skewed
    load (the hot experts replicated), each slot holds its expert's checkpoint weights and the outputs still equal
    the one-process layer's; state_dict writes the logical experts, and a layer built with the new placement loads
    it back to the same outputs."""
    cfg = MoEConfig(**BASE, dispatcher=dispatcher, runner=runner, quant=quant, dtype=dtype,
                    num_redundant_experts=c.world, record_expert_load=True)
    state = _state(cfg)
    ep = MoE(cfg)
    one = MoE(cfg.replace(dispatcher="auto", num_redundant_experts=0, record_expert_load=False),
              process_group=c.solo[c.rank])
    for layer in (ep, one):
        layer.load_weights(state)
    assert ep.gate_up_proj.shape[0] == (cfg.num_experts + c.world) // c.world, ep.gate_up_proj.shape
    _same_expert_weights(ep, one)
    tokens = [5 + 3 * r for r in range(c.world)]
    x = torch.randn(sum(tokens), cfg.hidden_size).to(dtype)
    logits = _skewed(sum(tokens), cfg.num_experts)
    lo = sum(tokens[:c.rank])
    mine = slice(lo, lo + tokens[c.rank])
    scheme = "fp8-tensor-rebatched" if quant == "fp8-tensor" else quant
    tol = rel_tol(scheme, dtype)
    want = one(x, logits)[mine]
    err = rel_err(ep(x[mine], logits[mine]), want)
    assert err <= tol, f"with replicas: relative error {err:.2e} > {tol:.1e}"
    load = ep.expert_load(reset=True, all_ranks=True)
    ids, _ = one.router(logits, None)
    assert torch.equal(load, torch.bincount(ids.long().flatten(), minlength=cfg.num_experts)), (load, ids)
    assert int(ep.expert_load().sum()) == 0  # reset: a new window
    placement = plan_placement(load, c.world, c.world)
    hot = max(range(cfg.num_experts), key=lambda e: int(load[e]))
    assert placement.experts.count(hot) > 1, (placement, load)
    before = ep.placement
    ep.rebalance(placement)
    assert ep.placement == placement and ep.config.placement == placement and ep.placement != before
    _same_expert_weights(ep, one)
    got = ep(x[mine], logits[mine])
    err = rel_err(got, want)
    assert err <= tol, f"after the rebalance: relative error {err:.2e} > {tol:.1e}"
    assert int(ep.expert_load().sum()) == tokens[c.rank] * cfg.top_k  # counted by logical expert, as before
    saved = ep.state_dict()
    held = sorted(set(ep.local_experts))
    for name in ("gate_up_proj", "down_proj"):
        assert saved[name].shape[0] == len(held), (name, saved[name].shape, held)
        assert torch.equal(bits(saved[name]), bits(getattr(one, name)[held])), name
    twin = MoE(cfg.replace(placement=placement), init_weights=False)
    twin.load_state_dict(saved)
    assert torch.equal(twin(x[mine], logits[mine]), got)


def check_disagreement(c):
    """Ranks given different placements: every rank raises MF511 at once and no weight moves; the layer still
    runs right afterwards."""
    cfg = MoEConfig(**BASE, dispatcher="alltoall", runner="reference", dtype=torch.float32,
                    num_redundant_experts=c.world)
    ep = MoE(cfg)
    ep.load_weights(_state(cfg))
    before = ep.gate_up_proj.clone()
    load = (torch.arange(cfg.num_experts).roll(3 * c.rank) + 1.0) ** 3  # each rank's own counts: other plans
    exc = c.expect("MF511", lambda: ep.rebalance(plan_placement(load, c.world, c.world)))
    assert "slot" in str(exc), str(exc)
    assert torch.equal(ep.gate_up_proj, before)
    wrong = "not a placement" if c.rank == 0 else plan_placement(torch.ones(cfg.num_experts), c.world, c.world)
    exc = c.expect("MF511", lambda: ep.rebalance(wrong))
    assert "not a valid placement" in str(exc), str(exc)
    x, logits = torch.randn(4, cfg.hidden_size), torch.randn(4, cfg.num_experts)
    assert ep(x, logits).shape == (4, cfg.hidden_size)


def check_bad_placement(c):
    """Placements all ranks agree on but the layer cannot take: MF510 on every rank (a rank outside the group, an
    expert with no replica, a rank's slot count changed); a Placement for the config's ranks checked at build."""
    cfg = MoEConfig(**BASE, dispatcher="allgather", runner="reference", dtype=torch.float32,
                    num_redundant_experts=c.world)
    ep = MoE(cfg)
    slots = cfg.num_experts + c.world
    good = Placement.contiguous(cfg.num_experts, slots, c.world)
    outside = Placement(good.experts, good.ranks[:-1] + (c.world,))
    exc = c.expect("MF510", lambda: ep.rebalance(outside))
    assert f"rank {c.world}" in str(exc), str(exc)
    c.expect("MF510", lambda: ep.rebalance(Placement((0,) * slots, good.ranks)))  # experts 1.. have no replica
    uneven = Placement(good.experts, (0,) + good.ranks[:-1])  # rank 0 one slot more, the last one fewer
    exc = c.expect("MF510", lambda: ep.rebalance(uneven))
    assert "slot count" in str(exc), str(exc)
    assert ep.placement == good
    c.expect("MF510", lambda: MoE(cfg.replace(placement=outside)))
