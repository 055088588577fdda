"""The peer-to-peer pieces under TRITON_INTERPRET=1: kernels/peer.barrier (one process standing in for
the ranks: their pads are tensors here) and moe_sum_to, the combine's top-k sum stored through an
address table (outputs poisoned with NaN)."""
import pytest
import torch

from oracle import same
from triton_interp import SKIP_REASON

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))

if SKIP_REASON is None:
    from moeflow.kernels.rows.peer import barrier
    from moeflow.kernels.rows.reduce import moe_sum, moe_sum_to


def addresses(ts):
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)


def state(world):
    pads = [torch.zeros(world, dtype=torch.int64) for _ in range(world)]
    status = torch.zeros(1, dtype=torch.int32)
    return pads, addresses(pads), torch.zeros(1, dtype=torch.int64), status, addresses([status])


@pytest.mark.parametrize("world,rank", [(2, 0), (3, 2), (4, 1)])
def test_barrier_passes_when_every_rank_signalled(world, rank):
    pads, table, epoch, status, status_at = state(world)
    for rnd in (1, 2, 3):
        for s in range(world):
            if s != rank:
                pads[rank][s] = rnd + (s % 2)  # a peer may already have entered the next round
        barrier(table, epoch, status_at, rank, world, timeout_s=1.0)
        assert int(epoch[0]) == rnd and int(status[0]) == 0
        assert all(int(p[rank]) == rnd for p in pads), "rank signals round rnd into slot `rank` of every pad"


@pytest.mark.parametrize("world,silent", [(2, 1), (4, 2)])
def test_barrier_gives_up_on_a_silent_rank(world, silent):
    """No hang: after its limit the barrier returns and writes 1 + the first silent rank."""
    pads, table, epoch, status, status_at = state(world)
    for s in range(world):
        pads[0][s] = 0 if s == silent else 1
    barrier(table, epoch, status_at, 0, world, timeout_s=1e-4)  # 100 polls in the interpreter
    assert int(status[0]) == silent + 1 and int(epoch[0]) == 1


@pytest.mark.parametrize("world,rows,k", [(2, 5, 3), (3, 1, 2), (4, 3, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_moe_sum_to_matches_moe_sum(world, rows, k, dtype):
    """Row d * rows + p of moe_sum's output lands at row p of block `me` of buffer d; the rest stays NaN."""
    me, h = world - 1, 40
    y = torch.randn(11, h).to(dtype)
    copies = torch.randint(-1, 11, (world * rows * k,))  # -1: not computed here
    want = moe_sum(y, copies, k)
    bufs = [torch.full((world * rows, h), float("nan"), dtype=dtype) for _ in range(world)]
    moe_sum_to(y, copies, k, addresses(bufs) + me * rows * h * y.element_size(), rows)
    for d, buf in enumerate(bufs):
        assert same(buf[me * rows:(me + 1) * rows], want[d * rows:(d + 1) * rows])
        assert torch.cat([buf[:me * rows], buf[(me + 1) * rows:]]).isnan().all()


def test_moe_sum_to_checks_its_table():
    y = torch.randn(4, 8)
    with pytest.raises(ValueError):
        moe_sum_to(y, torch.zeros(6, dtype=torch.int64), 2, torch.zeros(2, dtype=torch.int64), 2)  # 3 rows != 2 * 2
