"""Expert parallelism on CPU: gloo groups of 2 and 4 processes (tests/dispatch/test_ep_worker.py).

One process group per world size runs every check in sequence (spawning costs more than the
checks); each check is reported here as its own test. What is checked, per rank: every dispatcher ×
CPU runner × scheme the planner accepts equals the one-process layer with the same weights (within
tests/tolerances.py); FP8 payload compression; uneven explicit placement; a rank with no tokens and
no tokens at all; every token routed to one rank's experts; the start/wait halves with shared
experts in between; the dispatchers' Triton kernel paths (CUDA-only in the library) forced onto
CPU through Triton's interpreter (alltoall-p2p's stores through address tables into the other
processes' shared memory included); alltoall-p2p's buffers reused over several forwards, MF507 when
they cannot be mapped (on every rank, or on one: every rank raises at once), MF509 for a batch a later one
overwrote, a forward that raised partway, a layer built under inference_mode, its buffers shared by layers of one size
(and mapped anew where one rank alone still holds them); with_payload keeping the dispatcher's settings; "auto" picking alltoall; MF501 (ranks disagree), MF504 (bad placement),
MF503 (low-latency capacity overflow: the other ranks finish correctly, the group stays usable), a call refused on one
rank (MF305, MF301: it takes part with no tokens, the other ranks finish correctly), MF508 (copying or pickling a
layer with a process group)
and MF502 (a rank that never builds the layer); a layer compiled by torch.compile (one op, the eager bits); redundant
experts on every dispatcher, the load counter summed over the group, a rebalance to a planned placement (weights vs
the checkpoint, outputs vs the one-process layer), the state_dict round trip, MF510 and MF511 (ep_balance_checks.py).
The suite is killed after 150 s, so it cannot hang CI.
"""
import os

import pytest

import gloo_group
from test_ep_worker import LAST, suite

HERE = os.path.dirname(os.path.abspath(__file__))
WORLDS = (2, 4)
DEADLINE_S = 150
_runs: dict[int, dict] = {}


def run_group(world: int, tmp_dir: str) -> list[dict]:
    """Spawn ``world`` workers in one gloo group; -> each rank's {check: result}."""
    return gloo_group.run_group(os.path.join(HERE, "test_ep_worker.py"), [f"w{world}"], world, tmp_dir, DEADLINE_S)


@pytest.fixture(scope="module")
def group_results(tmp_path_factory):
    def get(world):
        if world not in _runs:
            _runs[world] = run_group(world, str(tmp_path_factory.mktemp(f"ep{world}")))
        return _runs[world]
    return get


CASES = [pytest.param(w, name, id=f"w{w}-{name}", marks=[pytest.mark.slow])  # seconds to spawn a group
         for w in WORLDS for name, _ in suite(w) + [LAST[w]]]
# one xdist worker runs a module's group: the group of W processes is spawned once per worker that needs it
pytestmark = pytest.mark.xdist_group("ep_cpu")


@pytest.mark.parametrize("world,check", CASES)
def test_ep(world, check, group_results):
    results = group_results(world)
    for rank, res in enumerate(results):
        if check == "peer-exit-MF505" and rank == world - 1:
            continue  # the rank that exited
        got = res.get(check)
        assert got == "ok", f"rank {rank}: {got or 'no result'}\n--- log ---\n{res['_log']}"
