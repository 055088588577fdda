"""The packed-row kernels (moeflow/kernels/rows/ep_rows.py) under TRITON_INTERPRET=1, bit for bit against
the torch code of the dispatchers: RowCodec.pack (lowlatency), alltoall's per-destination routing,
masked_batch_torch. Destination buffers and outputs start poisoned (0x7f bytes), so an element a kernel
forgets to write shows."""
import pytest
import torch

from oracle import same
from triton_interp import SKIP_REASON

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))

if SKIP_REASON is None:
    from moeflow.kernels.rows.ep_rows import blank_rows, masked_scatter, pack_rows, rank_rows

from moeflow.dispatch._ep_reference import blank_rows_torch, masked_batch_torch, pack_rows_torch, rank_rows_torch
from moeflow.dispatch._ep_rows import RowCodec
from moeflow.quant import create_scheme

PAYLOADS = [  # (hidden, layer dtype, payload) -> word type, scale groups G
    (256, torch.bfloat16, None),  # int64 words, no scale
    (384, torch.bfloat16, "fp8-block"),  # G = 3
    (96, torch.bfloat16, "fp8-channel"),  # G = 1
    (30, torch.float16, None),  # 60 token bytes: int32 words
    (7, torch.float16, None),  # 14 token bytes: int16 words
    (33, torch.float16, "fp8-channel"),  # 33 token bytes: uint8 words
    (1101, torch.float16, "fp8-channel"),  # 1101 uint8 words: two chunks of the word loops, the second partial
]
PACKERS = ["pack_rows", "pack_rows_torch"]  # the kernel and its torch reference: both must match the dispatchers


def packer_fn(name):
    return pack_rows if name == "pack_rows" else pack_rows_torch


def codec_for(hidden, dtype, payload, k=3):
    return RowCodec(hidden, k, dtype, payload and create_scheme(payload))


def poisoned(codec, m):
    return torch.full((m, codec.row_bytes), 0x7F, dtype=torch.uint8)


def routing(t, k, num_experts):
    """ids [T, K] int32 (distinct per token), weights [T, K] float32 with a -0.0 in it."""
    ids = torch.rand(t, num_experts).argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand(t, k)
    if t:
        w[0, 0] = -0.0
    return ids, w


@pytest.mark.parametrize("hidden,dtype,payload", PAYLOADS, ids=str)
@pytest.mark.parametrize("t", [0, 1, 5])
@pytest.mark.parametrize("packer", PACKERS)
def test_pack_rows_as_lowlatency(packer, t, hidden, dtype, payload):
    """lowlatency's send buffer: token i in row i, rows T.. padding (hidden and scale left alone)."""
    codec, cap = codec_for(hidden, dtype, payload), 7
    tokens, scale = codec.encode(torch.randn(t, hidden).to(dtype))
    ids, w = routing(t, 3, 16)
    want = codec.unpack(codec.pack(cap, tokens, scale, ids, w))
    buf = poisoned(codec, cap)
    got = codec.unpack(buf)
    packer_fn(packer)(got, tokens, scale, ids, w, torch.arange(t)[:, None], pad_from=t)
    assert same(got.ids, want.ids) and same(got.weights, want.weights)
    assert same(got.hidden[:t], want.hidden[:t])
    assert (scale is None) == (got.scale is None) and (scale is None or same(got.scale[:t], want.scale[:t]))
    assert (buf[t:, 8 * codec.top_k:] == 0x7F).all()  # padding rows: only ids and weights written


def alltoall_send(codec, tokens, scale, topk_ids, topk_weights, expert_rank, expert_local, world):
    """alltoall's rows, built here from their definition -> (expected Rows fields, home [T, W]):
    one row per (destination, token), grouped by destination, tokens ascending; the ids of the
    destination's experts as local ids, -1 and weight 0 for the others."""
    t = topk_ids.shape[0]
    ids = topk_ids.long()
    rank_of = expert_rank[ids]
    need = torch.zeros(t, world, dtype=torch.bool).scatter_(1, rank_of, True)
    j = torch.nonzero(need.t().flatten()).squeeze(1)
    dest, token = j // max(t, 1), j % max(t, 1)
    home = torch.full((t, world), -1, dtype=torch.int64)
    home[token, dest] = torch.arange(token.numel())
    valid = rank_of[token] == dest[:, None]
    local = torch.where(valid, expert_local[ids[token]], -1).to(torch.int32)
    weights = torch.where(valid, topk_weights[token].float(), 0.0)
    return dict(ids=local, weights=weights, hidden=tokens[token], scale=None if scale is None else scale[token]), home


def placement(world, num_experts=7):
    """-> (expert_rank, expert_local) [E] int64: a scattered, uneven placement over ``world`` ranks."""
    rank = torch.tensor([(3 * e + e // 2) % world for e in range(num_experts)])
    local = torch.zeros(num_experts, dtype=torch.int64)
    for r in range(world):
        mine = rank == r
        local[mine] = torch.arange(int(mine.sum()))
    return rank, local


@pytest.mark.parametrize("hidden,dtype,payload", PAYLOADS, ids=str)
@pytest.mark.parametrize("t,world", [(0, 2), (1, 2), (6, 1), (6, 2), (6, 3)])
@pytest.mark.parametrize("packer", PACKERS)
def test_pack_rows_as_alltoall(packer, t, world, hidden, dtype, payload):
    """alltoall's send buffer: a row per (destination, token), local ids of that rank's experts."""
    codec = codec_for(hidden, dtype, payload)
    tokens, scale = codec.encode(torch.randn(t, hidden).to(dtype))
    ids, w = routing(t, 3, 7)
    rank, local = placement(world)
    want, home = alltoall_send(codec, tokens, scale, ids, w, rank, local, world)
    buf = poisoned(codec, want["ids"].shape[0])
    packer_fn(packer)(codec.unpack(buf), tokens, scale, ids, w, home, rank, local)
    got = codec.unpack(buf)
    assert same(got.ids, want["ids"]) and same(got.weights, want["weights"]) and same(got.hidden, want["hidden"])
    assert scale is None or same(got.scale, want["scale"])
    # and the dispatcher's own call (RowCodec.pack with dest_pos) on this machine
    mine = codec.unpack(codec.pack(want["ids"].shape[0], tokens, scale, ids, w, dest_pos=home, expert_rank=rank,
                                   expert_local=local))
    assert same(mine.ids, want["ids"]) and same(mine.hidden, want["hidden"])


@pytest.mark.parametrize("block", [0, 301])
@pytest.mark.parametrize("t,world,k", [(0, 2, 3), (1, 2, 3), (6, 1, 2), (6, 3, 3), (300, 3, 4), (40, 5, 1)])
def test_rank_rows_matches_torch_and_the_definition(t, world, k, block, poison_empty):
    """counts and home of alltoall's send buffer: kernel == torch == a loop over the definition.
    T=300 with W=3 spans two token blocks of the kernel (the row numbering carries over).
    block > 0: alltoall-fixed's blocks, rank r's rows from r * block."""
    ids, _ = routing(t, k, 7)
    rank, _ = placement(world)
    counts, home = rank_rows(ids, rank, world, block)
    want_counts, want_home = rank_rows_torch(ids, rank, world, block)
    assert same(counts, want_counts) and same(home, want_home.contiguous())
    loop_home, row = torch.full((t, world), -1), 0
    for r in range(world):
        row = r * block if block else row
        for i in range(t):
            if (rank[ids[i].long()] == r).any():
                loop_home[i, r], row = row, row + 1
    assert same(home, loop_home)
    assert counts[:, 0].tolist() == [(home[:, r] >= 0).sum().item() for r in range(world)]
    assert counts[:, 1].tolist() == [(rank[ids.long()] == r).sum().item() for r in range(world)]


@pytest.mark.parametrize("remap", [False, True])
def test_pack_rows_scattered_rows(remap):
    """Rows in any order, tokens sent nowhere, rows no pair names kept, padding after: kernel == torch."""
    codec = codec_for(384, torch.bfloat16, "fp8-block", k=5)
    t, d, m = 6, (3 if remap else 1), 24
    tokens, scale = codec.encode(torch.randn(t, 384).to(torch.bfloat16))
    ids, w = routing(t, 5, 7)
    rank, local = placement(d)
    dest_pos = torch.randperm(20)[:t * d].view(t, d)
    dest_pos[torch.rand(t, d) < 0.3] = -1
    bufs = [poisoned(codec, m), poisoned(codec, m)]
    for fn, buf in zip((pack_rows, pack_rows_torch), bufs):
        fn(codec.unpack(buf), tokens, scale, ids, w, dest_pos, *((rank, local) if remap else (None, None)), pad_from=20)
    assert torch.equal(bufs[0], bufs[1])
    named = torch.zeros(m, dtype=torch.bool)
    named[dest_pos[dest_pos >= 0]] = True
    assert (bufs[0][:20][~named[:20]] == 0x7F).all()


def received(codec, dtype, r, k):
    """A receive buffer of R packed rows (random tokens, scales, routing) -> its Rows."""
    tokens, scale = codec.encode(torch.randn(r, codec.hidden_size).to(dtype))
    ids, w = routing(r, k, 9)
    return codec.unpack(codec.pack(r, tokens, scale, ids, w))


def copies(r, k, e_local, case):
    """experts [R*K] int64: local expert of each copy, e_local where not here."""
    if case == "one expert":
        return torch.full((r * k,), 2, dtype=torch.int64)
    choice = torch.rand(r, e_local + k).argsort(dim=1)[:, :k]  # distinct within a row
    experts = torch.where(choice < e_local, choice, e_local).flatten()
    return torch.where(experts == 1, e_local, experts)  # expert 1 gets no copy


@pytest.mark.parametrize("hidden,dtype,payload", PAYLOADS, ids=str)
@pytest.mark.parametrize("r,k,e_local,case", [(1, 3, 5, "random"), (9, 3, 5, "random"), (6, 4, 3, "one expert"),
                                              (20, 2, 7, "random")])
def test_masked_scatter_matches_masked_batch(r, k, e_local, case, hidden, dtype, payload, poison_empty):
    codec = codec_for(hidden, dtype, payload, k=k)
    rows = received(codec, dtype, r, k)
    experts = copies(r, k, e_local, case)
    capacity = r * k if case == "one expert" else r + 1
    batch, slot = masked_batch_torch(codec, rows, experts, e_local, capacity)
    hidden_w, weights, scale, counts, copy_slot = masked_scatter(rows, experts, e_local, capacity)
    assert same(copy_slot, slot.flatten())
    assert same(counts, batch.counts.to(torch.int32))  # int32 as ExpertBatch says (masked_batch's cumsum gives int64)
    assert same(weights, batch.weights)  # valid slots bit for bit, +0.0 in every empty one
    valid = torch.arange(capacity)[None, :] < counts[:, None]
    want = batch.hidden.contiguous().view(torch.uint8).view(codec.word)
    assert hidden_w.shape == want.shape and same(hidden_w[valid], want[valid])
    assert (scale is None) == (batch.hidden_scale is None)
    assert scale is None or (scale.shape == batch.hidden_scale.shape and same(scale[valid], batch.hidden_scale[valid]))


def test_masked_scatter_many_copies(poison_empty):
    """More copies than one block of the slot kernel (1024): positions carry over between blocks."""
    codec = codec_for(7, torch.float16, None)
    rows = received(codec, torch.float16, 350, 3)
    experts = copies(350, 3, 4, "random")
    batch, slot = masked_batch_torch(codec, rows, experts, 4, 350)
    hidden, weights, _, counts, copy_slot = masked_scatter(rows, experts, 4, 350)
    assert same(copy_slot, slot.flatten()) and same(counts, batch.counts.to(torch.int32))
    assert same(weights, batch.weights)
    valid = torch.arange(350)[None, :] < counts[:, None]
    assert same(hidden[valid], batch.hidden.contiguous().view(torch.int16)[valid])


def test_masked_scatter_no_rows(poison_empty):
    """R = 0 (masked_batch cannot: its running count has no last column): empty slabs, counts 0."""
    codec = codec_for(96, torch.bfloat16, "fp8-channel")
    rows = codec.unpack(poisoned(codec, 0))
    hidden, weights, scale, counts, copy_slot = masked_scatter(rows, torch.zeros(0, dtype=torch.int64), 4, 5)
    assert hidden.shape == (4, 5, 12) and scale.shape == (4, 5, 1) and copy_slot.shape == (0,)
    assert same(counts, torch.zeros(4, dtype=torch.int32)) and same(weights, torch.zeros(4, 5))


@pytest.mark.parametrize("hidden,dtype,payload", PAYLOADS[:3] + PAYLOADS[-1:], ids=str)
@pytest.mark.parametrize("used", [[0, 0], [3, 40], [40, 40], [17, 0, 33]], ids=str)
def test_blank_rows_matches_torch(used, hidden, dtype, payload):
    """alltoall-fixed's send buffer: rows past each block's count become the blank row (ids -1, the
    rest 0); the used rows keep their bytes. Kernel == torch == the definition."""
    codec, cap = codec_for(hidden, dtype, payload), 40
    world = len(used)
    counts = torch.tensor(used, dtype=torch.int64)
    blank = codec.blank_row("cpu")
    start = torch.randint(0, 256, (world * cap, codec.row_bytes), dtype=torch.uint8)
    got, ref = start.clone(), start.clone()
    blank_rows(got, counts, cap, blank)
    blank_rows_torch(ref, counts, cap, blank)
    assert same(got, ref)
    for d, n in enumerate(used):
        block, orig = got[d * cap:(d + 1) * cap], start[d * cap:(d + 1) * cap]
        assert same(block[:n], orig[:n])
        assert (block[n:] == blank).all()
    rows = codec.unpack(got[:1].clone().copy_(blank[None]))
    assert (rows.ids == -1).all() and (rows.weights == 0).all() and not rows.hidden.any()


# ---------------------------------------------------------------- through address tables (alltoall-p2p)
@pytest.mark.parametrize("hidden,dtype,payload", PAYLOADS[:3] + PAYLOADS[-1:], ids=str)
@pytest.mark.parametrize("t,world,me", [(0, 2, 0), (1, 2, 1), (6, 3, 2), (9, 3, 0)])
def test_pack_and_blank_through_a_table(t, world, me, hidden, dtype, payload):
    """alltoall-p2p: rank ``me`` stores its block straight into every rank's receive buffer (W buffers in
    one process stand in for the peers). Block ``me`` of buffer d must equal block d of alltoall-fixed's
    send buffer (pack + blank_rows); every other block of buffer d stays poisoned."""
    codec, cap = codec_for(hidden, dtype, payload), 9
    tokens, scale = codec.encode(torch.randn(t, hidden).to(dtype))
    ids, w = routing(t, 3, 7)
    rank, local = placement(world)
    counts, slot = rank_rows(ids, rank, world, block=cap)
    send = poisoned(codec, world * cap)
    pack_rows(codec.unpack(send), tokens, scale, ids, w, slot, rank, local)
    blank_rows(send, counts[:, 0], cap, codec.blank_row("cpu"))
    bufs = [poisoned(codec, world * cap) for _ in range(world)]
    table = torch.tensor([b.data_ptr() + me * cap * codec.row_bytes for b in bufs], dtype=torch.int64)
    pos = slot - torch.arange(world) * cap  # negative: not sent
    pack_rows(codec.unpack(bufs[0]), tokens, scale, ids, w, pos, rank, local, table=table)
    blank_rows(bufs[0], counts[:, 0], cap, codec.blank_row("cpu"), table=table)
    for d, buf in enumerate(bufs):
        got, want = codec.unpack(buf[me * cap:(me + 1) * cap]), codec.unpack(send[d * cap:(d + 1) * cap])
        assert same(got.ids, want.ids) and same(got.weights, want.weights) and same(got.hidden, want.hidden)
        assert scale is None or same(got.scale, want.scale)
        others = torch.cat([buf[:me * cap], buf[(me + 1) * cap:]])
        assert (others == 0x7F).all()


def test_table_arguments_are_checked():
    codec = codec_for(256, torch.bfloat16, None)
    tokens, _ = codec.encode(torch.randn(2, 256).to(torch.bfloat16))
    ids, w = routing(2, 3, 7)
    rank, local = placement(2)
    buf = poisoned(codec, 4)
    with pytest.raises(ValueError):
        pack_rows(codec.unpack(buf), tokens, None, ids, w, torch.zeros(2, 2, dtype=torch.int64), rank, local,
                  table=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError):
        blank_rows(buf, torch.zeros(2, dtype=torch.int64), 2, codec.blank_row("cpu"), table=torch.zeros(2, dtype=torch.int32))
