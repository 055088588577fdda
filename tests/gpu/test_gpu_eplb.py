"""Load balancing on one GPU (moeflow.balance): the replica rule (to_slots) and the load counter (count_copies) on
CUDA against plain Python references, with no host synchronization (torch's sync debug mode set to error) and
captured in CUDA graphs; and a layer with redundant experts and a load counter (one process: the local dispatcher,
the triton runner) captured whole, replayed on fresh inputs (bit for bit the eager call, within tolerance of the
layer without replicas, the counter exact), then rebalanced between replays: the same graph, not captured again,
computes with the new placement. Written, not yet run on a GPU.
Run: pytest -m gpu tests/gpu/test_gpu_eplb.py
"""
import contextlib

import pytest
import torch

from moeflow import MoE, MoEConfig
from moeflow.balance import Placement, count_copies, plan_placement, to_slots
from moeflow.balance.slots import ExpertSlots
from oracle import captured, rel_err
from tolerances import rel_tol

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PLACEMENT = Placement((5, 0, 1, 2, 0, 3, 4, 0, 5), (0, 0, 0, 1, 1, 1, 2, 2, 2))  # 6 experts; 0: 3 replicas, 5: 2


def slots_reference(ids: torch.Tensor, placement: Placement, rank: int) -> torch.Tensor:
    """to_slots in plain Python on the host: copy (t, k) of expert e -> replica (t + k + rank) mod count of e."""
    replicas = {e: [s for s, x in enumerate(placement.experts) if x == e] for e in set(placement.experts)}
    rows = [[-1 if e < 0 else replicas[e][(t + k + rank) % len(replicas[e])] for k, e in enumerate(row)]
            for t, row in enumerate(ids.tolist())]
    return torch.tensor(rows, dtype=torch.int32).view(ids.shape)


def routing(t: int, e: int = 6, k: int = 3, device="cuda") -> torch.Tensor:
    """[t, k] int32: k distinct experts of 0..e-1 per token."""
    return torch.rand(t, e).argsort(dim=1)[:, :k].to(torch.int32).to(device)


@contextlib.contextmanager
def no_host_sync():
    """torch raises on any operation that synchronizes the host with the device (set_sync_debug_mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("t", [0, 1, 37, 4096])
@pytest.mark.parametrize("rank", [0, 2])
def test_to_slots_on_cuda(t, rank):
    ids = routing(t)
    if t > 1:  # expert 0 first in every token (its 3 replicas share it), dropped copies stay -1
        ids = torch.cat([torch.zeros(t, 1, dtype=torch.int32), 1 + routing(t, 5, 2, "cpu")], dim=1).cuda()
        ids[::3, 1] = -1
    table = ExpertSlots(PLACEMENT, 6, "cuda", rank=rank)
    with no_host_sync():
        got = to_slots(ids, table.start, table.count, table.slots, rank)
    assert got.is_cuda and got.dtype == torch.int32 and got.shape == ids.shape
    assert torch.equal(got.cpu(), slots_reference(ids.cpu(), PLACEMENT, rank))


@pytest.mark.parametrize("t", [0, 1, 37, 4096])
def test_count_copies_on_cuda(t):
    ids = routing(t, e=6)  # experts 0..5 of 7: expert 6 never chosen
    load = torch.zeros(7, dtype=torch.int64, device="cuda")
    valid = torch.tensor([max(t - 5, 0)], device="cuda")
    with no_host_sync():
        count_copies(ids, load, valid)  # the rows from valid[0] on are padding
        count_copies(ids, load)
    kept = ids.cpu().long()
    want = torch.bincount(kept[:max(t - 5, 0)].flatten(), minlength=7) + torch.bincount(kept.flatten(), minlength=7)
    assert torch.equal(load.cpu(), want) and int(load[6]) == 0


def test_mapping_and_counter_captured():
    """to_slots and count_copies in one CUDA graph: replays on fresh ids match the references, the counter adds up."""
    ids = routing(64)
    table = ExpertSlots(PLACEMENT, 6, "cuda", rank=1, record=True)
    graph, out = captured(lambda: table(ids))
    table.load.zero_()  # the warm-up call counted; the capture ran nothing
    total = torch.zeros(6, dtype=torch.int64)
    for _ in range(3):
        ids.copy_(routing(64))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), slots_reference(ids.cpu(), PLACEMENT, 1))
        total += torch.bincount(ids.cpu().long().flatten(), minlength=6)
    assert torch.equal(table.load.cpu(), total)


@pytest.mark.parametrize("t", [1, 16, 300])
@pytest.mark.parametrize("scheme", ["none", "fp8-block"])
def test_layer_with_replicas_captured_and_rebalanced(make_layer, scheme, t):
    """A one-process layer with 4 redundant slots and a load counter, captured whole: replays equal the eager call
    bit for bit and the layer without replicas within tolerance; the counter is exact. Rebalanced between replays
    (weights and tables rewritten in place), the same graph computes with the new placement."""
    cfg = MoEConfig(num_experts=16, hidden_size=256, intermediate_size=256, top_k=4, quant=scheme,
                    dtype=torch.bfloat16, device="cuda", runner="triton")
    plain = make_layer(cfg)
    layer = MoE(cfg.replace(num_redundant_experts=4, record_expert_load=True), init_weights=False)
    layer.load_state_dict(plain.state_dict())
    x = torch.randn(t, 256, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(t, 16, device="cuda")
    graph, out = captured(lambda: layer(x, logits))  # a warm-up (compile) call, then the capture
    tol = rel_tol(scheme, torch.bfloat16)
    before = layer.placement
    for step in range(4):
        if step == 2:  # rebalance to the counted load: the hot experts get the replicas
            layer.rebalance(plan_placement(layer.expert_load(), 1, 4))
            assert layer.placement != before
        layer.expert_load(reset=True)
        x.copy_(torch.randn_like(x))
        logits.copy_(torch.randn_like(logits) + 3.0 * (torch.arange(16, device="cuda") < 2))
        out.fill_(float("nan"))  # poison: the replay must rewrite every element
        graph.replay()
        torch.cuda.synchronize()
        ids, _ = layer.router(logits, None)
        assert torch.equal(layer.expert_load().cpu(), torch.bincount(ids.long().flatten().cpu(), minlength=16))
        assert torch.equal(out, layer(x, logits)), f"replay differs from eager (step {step})"
        assert rel_err(out, plain(x, logits)) <= tol, f"{scheme} T={t} step {step}"
