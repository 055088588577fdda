"""The expert-parallel building blocks in one process: packed rows, batch builders, gather_sum."""
import pytest
import torch

from moeflow.dispatch._ep_rows import RowCodec, masked_batch, sorted_batch
from moeflow.dispatch.gather_sum import gather_sum
from moeflow.quant import create_scheme


@pytest.mark.parametrize("hidden,dtype,payload", [
    (7168, torch.bfloat16, None),  # int64 words
    (7168, torch.bfloat16, "fp8-block"),  # G = 56 scales per row
    (96, torch.bfloat16, "fp8-channel"),  # G = 1: scale columns must not spill into the padding
    (128, torch.float32, "fp8-tensor"),
    (30, torch.float16, None),  # 60 token bytes: int32 words
    (33, torch.float16, "fp8-channel"),  # 33 token bytes: uint8 words
], ids=str)
def test_pack_round_trip(hidden, dtype, payload):
    scheme = payload and create_scheme(payload)
    codec = RowCodec(hidden, 8, dtype, scheme)
    assert codec.row_bytes % 16 == 0
    x = torch.randn(5, hidden).to(dtype)
    tokens, scale = codec.encode(x)
    ids, w = torch.randint(0, 8, (5, 8), dtype=torch.int32), torch.rand(5, 8)
    q, s = (x, None) if scheme is None else scheme.quantize_activation(x)
    # rows in token order, then padding
    rows = codec.unpack(codec.pack(6, tokens, scale, ids, w))
    assert torch.equal(codec.as_payload(rows.hidden[:5].contiguous()).view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(rows.ids[:5], ids) and torch.equal(rows.weights[:5], w)
    assert (rows.ids[5:] == -1).all() and (rows.weights[5:] == 0).all()  # padding rows
    assert (s is None) == (rows.scale is None) and (s is None or torch.equal(rows.scale[:5], s))
    # rows named per token (dest_pos): row i holds token index[i]; tokens 1 and 3 go nowhere
    index = torch.tensor([4, 0, 2])
    dest_pos = torch.full((5, 1), -1)
    dest_pos[index, 0] = torch.arange(3)
    rows = codec.unpack(codec.pack(3, tokens, scale, ids, w, dest_pos=dest_pos))
    got = codec.as_payload(rows.hidden.contiguous())
    assert torch.equal(got.view(torch.uint8), q[index].contiguous().view(torch.uint8))
    assert torch.equal(rows.ids, ids[index]) and torch.equal(rows.weights, w[index])
    assert s is None or torch.equal(rows.scale, s[index])


def random_copies(r, k, e_local):
    """[R * K] local expert per copy (sentinel e_local), distinct experts within a row."""
    choice = torch.rand(r, e_local + k).argsort(dim=1)[:, :k]  # values >= e_local become the sentinel
    return torch.where(choice < e_local, choice, e_local).flatten()


def local_ids(experts, e_local, k):
    """[R * K] local experts (sentinel e_local) -> [R, K] int32 ids, -1 where not here."""
    return torch.where(experts < e_local, experts, -1).to(torch.int32).view(-1, k)


def received_rows(codec, x, k):
    """x [T, H] packed and unpacked as a rank receives it: K copies per token, ids 0, random weights."""
    t = x.shape[0]
    return codec.unpack(codec.pack(t, codec.encode(x)[0], None, torch.zeros(t, k, dtype=torch.int32), torch.rand(t, k)))


def test_sorted_batch_invariants():
    codec = RowCodec(64, 4, torch.float32, None)
    x = torch.randn(20, 64)
    rows = received_rows(codec, x, 4)
    experts = random_copies(20, 4, 5)
    n = int((experts < 5).sum())
    batch, copy_pos = sorted_batch(codec, rows, n, 5, ids=local_ids(experts, 5, 4))
    assert batch.hidden.shape == (n, 64) and int(batch.offsets[-1]) == n
    assert torch.equal(batch.counts.long(), torch.bincount(experts, minlength=6)[:5])
    flat = copy_pos.flatten()
    assert torch.equal(flat >= 0, experts < 5)  # every copy has a batch row, non-copies none
    assert torch.equal(flat[flat >= 0].sort().values, torch.arange(n))  # a permutation
    for c in torch.nonzero(flat >= 0).flatten().tolist():
        assert torch.equal(batch.hidden[flat[c]], x[c // 4]) and batch.weights[flat[c]] == rows.weights.flatten()[c]


@pytest.mark.parametrize("payload", [None, "fp8-block"])
def test_sorted_batch_by_index_equals_the_gathered_one(payload):
    """indexed=True names the received rows (strided views of the buffer, source_rows) instead of
    copying them: gathered, it is the copied batch byte for byte."""
    codec = RowCodec(256, 4, torch.bfloat16, payload and create_scheme(payload))
    x = torch.randn(20, 256).to(torch.bfloat16)
    tokens, scale = codec.encode(x)
    rows = codec.unpack(codec.pack(20, tokens, scale, torch.zeros(20, 4, dtype=torch.int32), torch.rand(20, 4)))
    experts = random_copies(20, 4, 5)
    n = int((experts < 5).sum())
    copied, pos = sorted_batch(codec, rows, n, 5, ids=local_ids(experts, 5, 4))
    rows.ids.copy_(local_ids(experts, 5, 4))  # as alltoall receives them: local ids in the rows
    named, pos2 = sorted_batch(codec, rows, n, 5, indexed=True)
    assert named.source_rows is not None and named.num_rows == n and named.hidden.shape == (20, 256)
    assert named.hidden.data_ptr() == rows.hidden.data_ptr()  # a view of the receive buffer, no copy
    got = named.gathered()
    assert torch.equal(got.hidden.view(torch.uint8), copied.hidden.view(torch.uint8)) and torch.equal(pos, pos2)
    assert torch.equal(got.weights, copied.weights) and torch.equal(got.offsets, copied.offsets)
    assert payload is None or torch.equal(got.hidden_scale, copied.hidden_scale)


@pytest.mark.parametrize("indexed", [False, True])
def test_sorted_batch_padded_to_a_bound(indexed):
    """padded=True (alltoall-fixed): n is a bound; the first offsets[-1] rows are the exact batch's,
    the rest padding (weight 0, source row 0), and the batch says so."""
    codec = RowCodec(64, 4, torch.float32, None)
    x = torch.randn(20, 64)
    rows = received_rows(codec, x, 4)
    experts = random_copies(20, 4, 5)
    n = int((experts < 5).sum())
    ids = local_ids(experts, 5, 4)
    exact, pos = sorted_batch(codec, rows, n, 5, ids=ids, indexed=indexed)
    bound = 20 * 4
    padded, pos2 = sorted_batch(codec, rows, bound, 5, ids=ids, indexed=indexed, padded=True)
    assert padded.padded and not exact.padded and padded.num_rows == bound and torch.equal(pos, pos2)
    assert torch.equal(padded.offsets, exact.offsets) and int(padded.offsets[-1]) == n
    got, want = padded.gathered(), exact.gathered()
    assert got.padded and torch.equal(got.hidden[:n], want.hidden) and torch.equal(got.weights[:n], want.weights)
    assert not got.weights[n:].any() and torch.equal(got.hidden[n:], x[:1].expand(bound - n, -1))


def test_masked_batch_invariants():
    codec = RowCodec(64, 4, torch.float32, None)
    x = torch.randn(24, 64)
    rows = received_rows(codec, x, 4)
    experts = random_copies(24, 4, 6)
    batch, slot = masked_batch(codec, rows, experts, 6, capacity=24)
    assert batch.hidden.shape == (6, 24, 64)
    assert torch.equal(batch.counts.long(), torch.bincount(experts, minlength=7)[:6])
    flat = slot.flatten()
    assert torch.equal(flat >= 0, experts < 6)
    used = flat[flat >= 0]
    assert used.unique().numel() == used.numel()  # no two copies share a slot
    assert torch.equal(used // 24, experts[experts < 6]) and ((used % 24) < batch.counts.long()[used // 24]).all()
    valid = torch.arange(24)[None, :] < batch.counts[:, None]
    assert (batch.weights[~valid] == 0).all()
    for c in torch.nonzero(flat >= 0).flatten().tolist():
        assert torch.equal(batch.hidden.view(-1, 64)[flat[c]], x[c // 4])


def test_gather_sum_matches_a_loop():
    src = torch.randn(30, 48).to(torch.bfloat16)
    index = torch.randint(-1, 30, (17, 5))
    want = torch.zeros(17, 48)
    for r in range(17):
        for j in range(5):
            if index[r, j] >= 0:
                want[r] += src[index[r, j]].float()
    assert torch.equal(gather_sum(src, index), want.to(torch.bfloat16))
    assert gather_sum(src[:0], torch.full((3, 2), -1)).abs().sum() == 0  # nothing to gather


@pytest.mark.parametrize("world,cap,pieces", [(2, 8, 4), (3, 6, 2), (4, 5, 1), (2, 12, 3)])
def test_fixed_blocks_and_combine_pieces(world, cap, pieces):
    """alltoall-fixed's bookkeeping: rank_rows with block=C puts the tokens sent to rank r at rows
    r*C .. in token order, with the counts of the plain grouping; chunk_major maps every (rank, position) of the blocks
    one to one onto the piece-major buffer, as its definition says; combine_pieces divides C."""
    from moeflow.dispatch._ep_reference import rank_rows_torch
    from moeflow.dispatch.alltoall_fixed import chunk_major, combine_pieces
    t, e, k = cap, 2 * world, 2
    ids = torch.rand(t, e).argsort(dim=1)[:, :k].to(torch.int32)
    ids[0] = torch.tensor([0, 1])  # token 0 goes to rank 0 only (experts 0, 1 live there)
    expert_rank = torch.arange(e) // 2
    counts, _ = rank_rows_torch(ids, expert_rank, world)
    block_counts, slot = rank_rows_torch(ids, expert_rank, world, block=cap)
    assert torch.equal(block_counts, counts)
    for r in range(world):
        sent = [tt for tt in range(t) if (expert_rank[ids[tt].long()] == r).any()]
        assert slot[:, r].tolist() == [r * cap + sent.index(tt) if tt in sent else -1 for tt in range(t)]
    length = cap // pieces
    got = chunk_major(slot, cap, length)
    for tt in range(t):
        for r in range(world):
            p = int(slot[tt, r]) - r * cap
            want = -1 if p < 0 else (p // length) * world * length + r * length + p % length
            assert int(got[tt, r]) == want
    every = chunk_major(torch.arange(world * cap).view(world, cap).t(), cap, length)
    assert sorted(every.flatten().tolist()) == list(range(world * cap))  # one to one
    assert combine_pieces(cap, 4) == next(c for c in (4, 3, 2, 1) if cap % c == 0)
