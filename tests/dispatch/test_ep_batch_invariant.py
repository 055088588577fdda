"""Batch invariance with expert parallelism on the CPU: 2 gloo processes, every expert-parallel dispatcher that
declares it (alltoall, alltoall-fixed, alltoall-p2p, lowlatency) with the reference runner and batch_invariant=True.
Rank 0's probe tokens must get the same bits alone, inside its batches of 7 and 128 (at other positions), while
rank 1 sends nothing, 7 or 200 tokens (float32, H=256: sizes at which the default mode's rows do differ here); and
allgather is refused (MF212: its reduce-scatter sums in an order the collective picks). The file is also the worker: ``python test_ep_batch_invariant.py RANK WORLD INIT OUT``.
"""
import datetime
import json
import os
import sys

import pytest
import torch
import torch.distributed as dist

import gloo_group

WORLD = 2
DISPATCHERS = ("alltoall", "alltoall-fixed", "alltoall-p2p", "lowlatency")
DEADLINE_S = 120
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ep_batch_invariant")]  # seconds to spawn the group


def test_ep_rows_do_not_depend_on_the_batch(tmp_path):
    for r, got in enumerate(gloo_group.run_group(__file__, [], WORLD, str(tmp_path), DEADLINE_S)):
        for name in (*DISPATCHERS, "allgather-refused"):
            assert got.get(name) == "ok", f"rank {r} {name}: {got.get(name)}\n{got['_log']}"


def check(dispatcher: str, rank: int) -> None:
    """Rank 0 runs its probes in several batches while rank 1 sends other batches; rank 0's rows must match."""
    from moeflow import MoE, MoEConfig
    from oracle import bits
    cfg = MoEConfig(num_experts=8, hidden_size=256, intermediate_size=192, top_k=3, dtype=torch.float32,
                    device="cpu", dispatcher=dispatcher, runner="reference", quant="fp8-channel",
                    num_shared_experts=1, shared_intermediate_size=32, batch_invariant=True, max_tokens_per_rank=256)
    layer = MoE(cfg)  # the same seed on both ranks: the same weights
    g = torch.Generator().manual_seed(11)
    pool_x = torch.randn(300, 256, generator=g)
    pool_logits = torch.randn(300, 8, generator=g)
    probes = [5, 77, 140]
    # (rank 0's batch: pool rows, rank 1's batch size) per call; rank 0's probes at different positions each time
    calls = [([5], 0), ([77], 200), ([140], 7), ([9, 5, 3, 77, 140, 11, 12], 200),
             (list(range(200, 100, -1)) + [140, 5] + list(range(40, 66)) + [77], 7)]
    seen = {}
    for mine, other in calls:
        rows = mine if rank == 0 else list(range(other))
        out = layer(pool_x[rows], pool_logits[rows])
        if rank == 0:
            for p in probes:
                if p in mine:
                    b = bits(out[mine.index(p)])
                    assert p not in seen or torch.equal(seen[p], b), f"probe {p} differs in a batch of {len(mine)}"
                    seen.setdefault(p, b)
    assert rank != 0 or len(seen) == len(probes)


def main():
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: oracle
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    from moeflow import MoE, MoEConfig
    from moeflow.errors import MoeflowError
    results = {}
    for name in DISPATCHERS:
        torch.manual_seed(1)
        try:
            check(name, rank)
            results[name] = "ok"
        except Exception as exc:  # report and go on: the other rank expects this one's collectives
            results[name] = f"FAIL: {type(exc).__name__}: {exc}"
    try:
        MoE(MoEConfig(num_experts=8, hidden_size=64, intermediate_size=96, top_k=2, device="cpu",
                      dispatcher="allgather", batch_invariant=True))
        results["allgather-refused"] = "FAIL: built"
    except MoeflowError as exc:
        results["allgather-refused"] = "ok" if exc.code == "MF212" else f"FAIL: {exc.code}"
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    os._exit(0)


if __name__ == "__main__":
    main()
