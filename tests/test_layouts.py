"""The layout contract: the local dispatcher's permutation and its inverse, offsets, empty experts,
and the sorted <-> masked conversions (indices checked exactly; unwritten elements caught by
NaN poison)."""
import pytest
import torch

from moeflow import MoE, MoEConfig
from moeflow.capabilities import RunnerCaps
from moeflow.dispatch import create_dispatcher
from moeflow.layouts import (MASKED, SORTED, ExpertBatch, masked_output_to_sorted, masked_to_sorted,
                             offsets_from_counts, run_in_layout, sorted_output_to_masked, sorted_to_masked)
from moeflow.quant import create_scheme

H = 24


def local_dispatcher(num_experts, top_k, dtype=torch.float32):
    cfg = MoEConfig(num_experts=num_experts, hidden_size=H, intermediate_size=16, top_k=top_k, dtype=dtype)
    return create_dispatcher("local", cfg, create_scheme("none"))


def random_routing(t, e, k, unused=()):
    """ids [T, K] int32, distinct per row, never touching the experts in ``unused``; weights [T, K]."""
    r = torch.rand(t, e)
    r[:, list(unused)] = -1.0
    ids = r.topk(k, dim=1).indices.to(torch.int32)
    return ids, torch.rand(t, k) + 0.1


def tagged_hidden(t, dtype=torch.float32):
    """Random rows whose column 0 holds the token index, so a dispatched row names its token."""
    x = torch.randn(t, H)
    x[:, 0] = torch.arange(t, dtype=torch.float32)
    return x.to(dtype)


# (T, E, K, unused experts): what each exercises
SHAPES = {
    "basic": (16, 8, 2, ()),
    "empty-experts": (10, 9, 2, (0, 4, 8)),  # first, middle and last expert get no copies
    "one-token": (1, 5, 3, ()),
    "k-equals-e": (7, 4, 4, ()),  # every expert gets every token
    "one-expert-only": (12, 6, 1, (0, 1, 2, 4, 5)),  # all copies to expert 3
    "no-tokens": (0, 6, 2, ()),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_dispatch_groups_copies_by_expert(shape):
    t, e, k, unused = SHAPES[shape]
    ids, w = random_routing(t, e, k, unused)
    x = tagged_hidden(t)
    batch, _ = local_dispatcher(e, k).dispatch(x, ids, w)
    assert batch.layout == SORTED and batch.hidden.shape == (t * k, H)
    expected_counts = torch.bincount(ids.flatten().long(), minlength=e)
    assert batch.counts.dtype == torch.int32 and torch.equal(batch.counts.long(), expected_counts)
    assert batch.offsets.dtype == torch.int64
    assert batch.offsets.tolist() == [0] + expected_counts.cumsum(0).tolist()
    assert int(batch.offsets[-1]) == t * k  # offsets sum to T*K
    for u in unused:
        assert batch.counts[u] == 0 and batch.offsets[u] == batch.offsets[u + 1]
    for expert in range(e):
        lo, hi = int(batch.offsets[expert]), int(batch.offsets[expert + 1])
        tokens = batch.hidden[lo:hi, 0].long()
        want = (ids == expert).any(dim=1).nonzero().flatten()
        assert sorted(tokens.tolist()) == want.tolist()  # exactly the tokens that chose this expert
        assert torch.equal(batch.hidden[lo:hi], x[tokens])  # whole rows, bit-exact
        slot_k = (ids[tokens] == expert).int().argmax(dim=1)
        assert torch.equal(batch.weights[lo:hi], w[tokens, slot_k])


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_combine_inverts_dispatch(shape, dtype, poison):
    """combine(dispatch(x)) with an identity "runner" (row times its weight) is sum_k w[t,k] x[t]."""
    t, e, k, unused = SHAPES[shape]
    ids, w = random_routing(t, e, k, unused)
    x = torch.randn(t, H).to(dtype)
    d = local_dispatcher(e, k, dtype)
    batch, handle = d.dispatch(x, ids, w)
    out = d.combine((batch.hidden.float() * batch.weights[:, None]).to(dtype), handle)
    ref = x.double() * w.double().sum(1, keepdim=True)
    assert out.shape == (t, H) and out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_combine_returns_each_copy_to_its_token(poison):
    """Each copy carries a distinct value; combine must add exactly a token's own K copies."""
    t, e, k = 9, 5, 3
    ids, w = random_routing(t, e, k)
    d = local_dispatcher(e, k)
    batch, handle = d.dispatch(tagged_hidden(t), ids, w)
    token_of_row = batch.hidden[:, 0]
    expert_of_row = torch.repeat_interleave(torch.arange(e), batch.counts.long())
    marks = (token_of_row * 100 + expert_of_row)[:, None].expand(-1, H).contiguous()
    out = d.combine(marks, handle)
    want = (torch.arange(t)[:, None] * 100 * k + ids.long().sum(1, keepdim=True)).float().expand(-1, H)
    assert torch.equal(out, want)


def test_offsets_from_counts():
    counts = torch.tensor([3, 0, 2, 0], dtype=torch.int32)
    assert offsets_from_counts(counts).tolist() == [0, 3, 3, 5, 5]
    assert offsets_from_counts(torch.zeros(0, dtype=torch.int32)).tolist() == [0]


def sorted_batch(t, e, k, unused=(), groups=None):
    ids, w = random_routing(t, e, k, unused)
    batch, _ = local_dispatcher(e, k).dispatch(torch.randn(t, H), ids, w)
    if groups:  # an FP8-style per-row scale payload travels with its rows
        batch.hidden_scale = torch.rand(t * k, groups) + 0.5
    return batch


def expected_slots(counts, capacity):
    return [ex * capacity + c for ex, n in enumerate(counts) for c in range(n)]


@pytest.mark.parametrize("capacity", (None, "max+3"))
@pytest.mark.parametrize("shape", SHAPES)
def test_sorted_masked_round_trip(shape, capacity):
    t, e, k, unused = SHAPES[shape]
    batch = sorted_batch(t, e, k, unused, groups=2)
    counts = batch.host_counts()
    cap = None if capacity is None else max(counts, default=0) + 3
    masked, slot = sorted_to_masked(batch, cap)
    c = masked.hidden.shape[1]
    assert masked.layout == MASKED and masked.offsets is None
    assert c == (cap if cap else max(max(counts, default=0), 1))
    assert masked.hidden.shape == (e, c, H) and masked.weights.shape == (e, c) and masked.hidden_scale.shape == (e, c, 2)
    assert slot.tolist() == expected_slots(counts, c)  # indices, exactly
    valid = torch.arange(c)[None, :] < torch.tensor(counts)[:, None]
    for expert, n in enumerate(counts):
        lo = int(batch.offsets[expert])
        assert torch.equal(masked.hidden[expert, :n], batch.hidden[lo:lo + n])
        assert torch.equal(masked.weights[expert, :n], batch.weights[lo:lo + n])
        assert torch.equal(masked.hidden_scale[expert, :n], batch.hidden_scale[lo:lo + n])
    assert (masked.hidden[~valid] == 0).all() and (masked.weights[~valid] == 0).all()  # empty slots are zero
    # poison the empty slots: the way back must not read them
    masked.hidden[~valid] = float("nan")
    masked.weights[~valid] = float("nan")
    masked.hidden_scale[~valid] = float("nan")
    back, slot_back = masked_to_sorted(masked)
    assert back.layout == SORTED and slot_back.tolist() == slot.tolist()
    assert torch.equal(back.hidden, batch.hidden) and torch.equal(back.weights, batch.weights)
    assert torch.equal(back.hidden_scale, batch.hidden_scale)
    assert torch.equal(back.offsets, batch.offsets) and torch.equal(back.counts, batch.counts)


@pytest.mark.parametrize("shape", ["basic", "empty-experts", "no-tokens"])
def test_padded_sorted_batch_to_masked(shape):
    """A sorted batch sized by a bound (alltoall-fixed: rows past offsets[-1] are padding) converts
    like the unpadded one: the padding goes to no slot, and comes back as some row (unspecified)."""
    t, e, k, unused = SHAPES[shape]
    batch = sorted_batch(t, e, k, unused, groups=2)
    pad = 5
    padded = ExpertBatch(SORTED, torch.cat([batch.hidden, torch.full((pad, H), float("nan"))]),
                         torch.cat([batch.weights, torch.zeros(pad)]), batch.counts, batch.offsets,
                         torch.cat([batch.hidden_scale, torch.full((pad, 2), float("nan"))]), padded=True)
    cap = max(batch.host_counts(), default=0) + 1
    want, want_slot = sorted_to_masked(batch, cap)
    got, slot = sorted_to_masked(padded, cap)
    assert slot.tolist() == want_slot.tolist() + [e * cap] * pad  # indices exactly; padding: no slot
    assert torch.equal(got.hidden, want.hidden) and torch.equal(got.weights, want.weights)
    assert torch.equal(got.hidden_scale, want.hidden_scale) and torch.equal(got.counts, want.counts)
    out = torch.randn(e, cap, H)
    back = masked_output_to_sorted(out, slot)
    assert back.shape == (t * k + pad, H) and torch.equal(back[:t * k], masked_output_to_sorted(out, want_slot))


def test_sorted_to_masked_refuses_too_small_capacity():
    batch = sorted_batch(12, 6, 1, unused=(0, 1, 2, 4, 5))  # 12 copies to expert 3
    with pytest.raises(RuntimeError):
        sorted_to_masked(batch, capacity=11)


def test_masked_to_sorted_from_a_poisoned_slab():
    """A masked batch as a low-latency dispatcher would fill it: slots beyond counts are garbage."""
    e, c = 5, 4
    counts = torch.tensor([2, 0, 4, 1, 0], dtype=torch.int32)
    hidden = torch.full((e, c, H), float("nan"))
    weights = torch.full((e, c), float("nan"))
    valid = torch.arange(c)[None, :] < counts[:, None]
    hidden[valid] = torch.randn(int(counts.sum()), H)
    weights[valid] = torch.rand(int(counts.sum()))
    batch, slot = masked_to_sorted(ExpertBatch(MASKED, hidden, weights, counts))
    assert slot.tolist() == expected_slots(counts.tolist(), c)
    assert batch.offsets.tolist() == [0, 2, 2, 6, 7, 7]
    assert torch.equal(batch.hidden, hidden[valid]) and torch.equal(batch.weights, weights[valid])


def test_output_conversions_pick_and_zero_fill():
    batch = sorted_batch(10, 9, 2, unused=(0, 4, 8))
    masked, slot = sorted_to_masked(batch)
    e, c = masked.hidden.shape[:2]
    out_masked = torch.full((e, c, H), float("nan"))
    out_masked.view(-1, H)[slot] = batch.hidden * 3
    assert torch.equal(masked_output_to_sorted(out_masked, slot), batch.hidden * 3)  # never reads a NaN slot
    back = sorted_output_to_masked(batch.hidden * 3, slot, e, c)
    valid = torch.arange(c)[None, :] < masked.counts.long()[:, None]
    assert torch.equal(back[valid], batch.hidden * 3) and (back[~valid] == 0).all()


class FakeRunner:
    """A runner that consumes only ``layouts`` and returns 2 * w * x; NaN in masked empty slots
    (the conversion must never read those)."""

    def __init__(self, *layouts):
        self.caps = RunnerCaps(layouts=layouts, support=())
        self.seen = []

    def run(self, batch, weights):
        self.seen.append(batch.layout)
        out = 2 * batch.hidden * batch.weights[..., None]
        if batch.layout == MASKED:
            valid = torch.arange(out.shape[1])[None, :] < batch.counts.long()[:, None]
            out[~valid] = float("nan")
        return out


@pytest.mark.parametrize("runner_layouts", ((SORTED,), (MASKED,), (SORTED, MASKED)), ids=str)
@pytest.mark.parametrize("batch_layout", (SORTED, MASKED))
def test_run_in_layout(batch_layout, runner_layouts):
    batch = sorted_batch(10, 9, 2, unused=(0, 4, 8))
    want = 2 * batch.hidden * batch.weights[:, None]
    masked, slot = sorted_to_masked(batch)
    runner = FakeRunner(*runner_layouts)
    if batch_layout == SORTED:
        out = run_in_layout(runner, batch, None)
        assert torch.equal(out, want)
    else:
        out = run_in_layout(runner, masked, None)
        assert out.shape == masked.hidden.shape
        valid = torch.arange(out.shape[1])[None, :] < masked.counts.long()[:, None]
        assert torch.equal(out[valid], want)
        if runner.seen == [SORTED]:  # converted back: empty slots are zero
            assert (out[~valid] == 0).all()
    native = batch_layout in runner_layouts
    assert runner.seen == [batch_layout if native else runner_layouts[0]]


@pytest.mark.parametrize("quant", ("none", "fp8-tensor", "fp8-channel", "fp8-block"))
def test_reference_runner_same_in_both_layouts(quant, poison):
    """The reference runner consumes both layouts natively: identical numbers, zero empty slots."""
    layer = MoE(num_experts=6, hidden_size=128, intermediate_size=128, top_k=2, quant=quant, runner="reference",
                dtype=torch.float32)
    ids, w = random_routing(20, 6, 2, unused=(1,))
    batch, _ = layer.dispatcher.dispatch(torch.randn(20, 128), ids, w)
    masked, slot = sorted_to_masked(batch, capacity=max(batch.host_counts()) + 2)
    out_sorted = layer.runner.run(batch, layer.expert_weights())
    out_masked = layer.runner.run(masked, layer.expert_weights())
    valid = torch.arange(out_masked.shape[1])[None, :] < masked.counts.long()[:, None]
    assert not out_sorted.isnan().any()
    assert torch.equal(masked_output_to_sorted(out_masked, slot), out_sorted)
    assert (out_masked[~valid] == 0).all()


def test_grouped_mm_through_the_masked_conversion(poison):
    """grouped_mm consumes only sorted; given a masked batch it runs through the conversion."""
    layer = MoE(num_experts=6, hidden_size=64, intermediate_size=32, top_k=2, runner="grouped_mm",
                dtype=torch.float32)
    ids, w = random_routing(20, 6, 2, unused=(1, 5))
    batch, _ = layer.dispatcher.dispatch(torch.randn(20, 64), ids, w)
    masked, slot = sorted_to_masked(batch)
    native = run_in_layout(layer.runner, batch, layer.expert_weights())
    converted = run_in_layout(layer.runner, masked, layer.expert_weights())
    torch.testing.assert_close(masked_output_to_sorted(converted, slot), native, rtol=1e-6, atol=1e-6)
    valid = torch.arange(converted.shape[1])[None, :] < masked.counts.long()[:, None]
    assert (converted[~valid] == 0).all()


def test_runners_without_indexed_rows_read_an_indexed_batch_correctly():
    """A batch given by index, handed straight to a runner that does not declare indexed_rows,
    is gathered by the runner (never read as if its rows were in order)."""
    import torch
    from moeflow import MoEConfig
    from moeflow.dispatch import create_dispatcher
    from moeflow.experts.base import ExpertWeights
    from moeflow.experts.reference import ReferenceRunner
    from moeflow.quant import create_scheme
    cfg = MoEConfig(num_experts=4, hidden_size=16, intermediate_size=8, top_k=2, dtype=torch.float32)
    d = create_dispatcher("local", cfg, create_scheme("none"), indexed_rows=True)
    x = torch.randn(5, 16)
    ids = torch.rand(5, 4).argsort(dim=1)[:, :2].to(torch.int32)
    batch, _ = d.dispatch(x, ids, torch.rand(5, 2))
    weights = ExpertWeights(torch.randn(4, 16, 16), torch.randn(4, 16, 8), None, None)
    runner = ReferenceRunner(cfg, create_scheme("none"))
    assert torch.equal(runner.run(batch, weights), runner.run(batch.gathered(), weights))


@pytest.mark.parametrize("shape", SHAPES)
def test_indexed_dispatch_is_the_gathered_dispatch(shape):
    """Rows by index (Plan.indexed_rows): the same offsets, weights and, once gathered, the same
    rows as the ordinary sorted batch; source_rows name each row's token."""
    t, e, k, unused = SHAPES[shape]
    ids, w = random_routing(t, e, k, unused)
    x = tagged_hidden(t)
    plain, h_plain = local_dispatcher(e, k).dispatch(x, ids, w)
    d = create_dispatcher("local", MoEConfig(num_experts=e, hidden_size=H, intermediate_size=16, top_k=k),
                          create_scheme("none"), indexed_rows=True)
    indexed, h_indexed = d.dispatch(x, ids, w)
    assert indexed.hidden is x and indexed.source_rows.dtype == torch.int64 and indexed.num_rows == t * k
    assert torch.equal(indexed.source_rows, x[indexed.source_rows, 0].long())  # column 0 tags the token
    assert plain.copy_rows is None and indexed.copy_rows.shape == (t, k)  # the inverse of source_rows
    assert torch.equal(indexed.source_rows[indexed.copy_rows],
                       torch.arange(t, device=x.device)[:, None].expand(t, k))
    assert torch.equal(indexed.copy_rows.flatten().sort().values, torch.arange(t * k, device=x.device))
    g = indexed.gathered()
    assert g.source_rows is None and g.copy_rows is None and torch.equal(g.hidden, plain.hidden)
    for name in ("weights", "counts", "offsets"):
        assert torch.equal(getattr(indexed, name), getattr(plain, name)), name
    assert torch.equal(h_indexed.row_of_copy, h_plain.row_of_copy)


@pytest.mark.parametrize("runner_layouts", ((SORTED,), (MASKED,)), ids=str)
def test_run_in_layout_gathers_an_indexed_batch_for_other_runners(runner_layouts):
    """A runner that does not declare indexed_rows (natively sorted, or masked through the
    conversion) sees ordinary rows, with FP8-style scales following them."""
    ids, w = random_routing(10, 9, 2, (0, 4, 8))
    d = create_dispatcher("local", MoEConfig(num_experts=9, hidden_size=H, intermediate_size=16, top_k=2),
                          create_scheme("none"), indexed_rows=True)
    batch, _ = d.dispatch(torch.randn(10, H), ids, w)
    batch.hidden_scale = torch.rand(10, 3) + 0.5  # one per source token
    want = 2 * batch.hidden[batch.source_rows] * batch.weights[:, None]
    runner = FakeRunner(*runner_layouts)
    assert torch.equal(run_in_layout(runner, batch, None), want)
    assert torch.equal(batch.gathered().hidden_scale, batch.hidden_scale[batch.source_rows])
    if runner_layouts == (MASKED,):
        masked, _ = sorted_to_masked(batch)
        assert masked.hidden_scale.shape == (9, masked.hidden.shape[1], 3)
