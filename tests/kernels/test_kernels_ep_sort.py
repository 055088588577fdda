"""kernels/ep_sort.sort_copies_by_expert under TRITON_INTERPRET=1, bit for bit against the torch ops of
dispatch/_ep_rows.sorted_batch (sort_copies_by_expert_torch; its invariants are checked in
tests/dispatch/test_ep_rows.py). Inputs are strided views of a packed buffer (ids columns, then weights
columns, then more: row stride > K, as RowCodec.unpack gives); outputs start poisoned (0x7f bytes), so
an element the kernels forget to write shows. Each case runs in both forms: one program sorting every copy
(whole_sort, up to ep_sort._WHOLE_COPIES) and the segment launches (forced by a threshold of 0)."""
import pytest
import torch

from oracle import same
from triton_interp import SKIP_REASON

pytestmark = [pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON)), pytest.mark.slow]

if SKIP_REASON is None:
    from moeflow.kernels.rows.ep_sort import sort_copies_by_expert

from moeflow.dispatch._ep_reference import sort_copies_by_expert_torch as sorted_batch_torch  # the torch reference


def received(r, k, e_local, case):
    """-> (ids, weights) [R, K] strided views of one packed int32 buffer [R, 2K + 3]: ids columns,
    weights columns (float32 bits), 3 more; the first copy here weighs -0.0, the last a NaN.
    case: "random" (distinct experts within a row, some copies not here, expert 1 gets none when
    E_local > 2), "one expert" (every copy to expert E_local - 1), "none here" (n = 0)."""
    buf = torch.full((r, 2 * k + 3), 0x7F7F7F7F, dtype=torch.int32)
    ids, weights = buf[:, :k], buf[:, k:2 * k].view(torch.float32)
    if case == "one expert":
        ids[:] = e_local - 1
    elif case == "none here":
        ids[:] = -1
    else:
        choice = torch.rand(r, e_local + k).argsort(dim=1)[:, :k]  # distinct within a row
        local = torch.where(choice < e_local, choice, -1)
        ids[:] = torch.where((local == 1) & (e_local > 2), -1, local)
    weights[:] = torch.where(ids >= 0, torch.rand(r, k), 0.0)
    here = torch.nonzero(ids >= 0)
    if len(here):  # bit patterns a float move could change: -0.0, a NaN with a payload
        weights[tuple(here[0])] = -0.0
        buf[here[-1][0], k + here[-1][1]] = 0x7FC01234
    assert ids.stride(0) == 2 * k + 3 and weights.stride(0) == 2 * k + 3
    return ids, weights


@pytest.fixture(params=["whole", "segments"])
def form(request, monkeypatch):
    """The sort's form under test: "whole" (one program, the default up to _WHOLE_COPIES) or "segments"."""
    from moeflow.kernels.rows import ep_sort
    monkeypatch.setattr(ep_sort, "_WHOLE_COPIES", 1 << 20 if request.param == "whole" else 0)
    return request.param


@pytest.fixture
def segments(monkeypatch):
    """The segment launches at every size (no whole sort)."""
    from moeflow.kernels.rows import ep_sort
    monkeypatch.setattr(ep_sort, "_WHOLE_COPIES", 0)


CASES = [  # (R, K, E_local, case)
    (0, 8, 5, "random"),
    (1, 3, 5, "random"),
    (7, 8, 6, "random"),
    (7, 1, 5, "random"),
    (7, 3, 1, "random"),
    (7, 3, 6, "one expert"),
    (7, 8, 5, "none here"),
    (300, 4, 6, "random"),  # 1200 copies: 5 segments of 256, prefix sums carry over
    (300, 4, 5, "one expert"),
]


@pytest.mark.parametrize("r,k,e_local,case", CASES, ids=str)
def test_sort_copies_matches_sorted_batch(r, k, e_local, case, form, poison_empty):
    ids, weights = received(r, k, e_local, case)
    n = int((ids >= 0).sum())
    want = sorted_batch_torch(ids, weights, e_local, n)
    got = sort_copies_by_expert(ids, weights, e_local, n)
    for name, g, w in zip(("source", "sorted_weights", "counts", "offsets", "copy_pos"), got, want):
        assert same(g, w), name
    if case == "random" and e_local > 2:
        assert got[2][1] == 0  # an expert with no copies


def test_sort_copies_rejects_bad_views():
    ids, weights = received(4, 3, 5, "random")
    with pytest.raises(ValueError):
        sort_copies_by_expert(ids.long(), weights, 5, 4)
    with pytest.raises(ValueError):
        sort_copies_by_expert(ids.t(), weights.t(), 5, 4)


@pytest.mark.parametrize("t,k,e", [(1, 2, 8), (40, 8, 16), (100, 8, 128), (700, 2, 8)])
def test_local_sort_by_segments_equals_torch(t, k, e, form, poison_empty):
    """The local dispatcher's mid-sized CUDA path (dispatch/expert_sort.sort_by_segments) equals its
    torch sort exactly: offsets, counts, row of each copy, source row and weight of each sorted row."""
    from moeflow.dispatch.expert_sort import sort_by_expert_torch, sort_by_segments
    ids = torch.rand(t, e).argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand(t, k)
    for got, want in zip(sort_by_segments(ids, w, e), sort_by_expert_torch(ids, w, e), strict=True):
        assert same(got, want)


@pytest.mark.parametrize("t,k,e,h,scheme", [(40, 8, 16, 384, "fp8-block"), (100, 8, 128, 1024, "fp8-block"),
                                             (70, 2, 8, 200, "fp8-block"), (33, 4, 8, 1100, "fp8-channel"),
                                             (24, 8, 16, 640, "fp8-tensor")])
def test_local_sort_by_segments_quantizes_the_tokens(t, k, e, h, scheme, form, poison_empty):
    """The segment sort with the tokens: its histogram launch also quantizes them (extra programs),
    bit for bit kernels/quant.quantize_activation; the sort's five outputs unchanged."""
    from moeflow.dispatch.expert_sort import sort_by_segments
    from moeflow.kernels.rows.quant import quantize_activation
    ids = torch.rand(t, e).argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand(t, k)
    x = (torch.randn(t, h) * torch.rand(t, 1) * 10).half()
    x[0, :128] = 0  # an all-zero group / part of a row
    got = sort_by_segments(ids, w, e, x, scheme)
    for g, want in zip(got[:5], sort_by_segments(ids, w, e), strict=True):
        assert same(g, want)
    q, sc = quantize_activation(x, scheme)
    assert torch.equal(got[5].view(torch.uint8), q.view(torch.uint8)) and torch.equal(got[6], sc)


@pytest.mark.parametrize("t,k,e,h,scheme", [(40, 8, 16, 384, "fp8-block"), (33, 4, 8, 200, "fp8-channel"),
                                             (24, 8, 16, 640, "fp8-tensor"), (70, 2, 8, 128, "none")])
@pytest.mark.parametrize("by_valid", [False, True])
def test_dropping_sort_equals_torch_and_quantizes(monkeypatch, t, k, e, h, scheme, form, poison_empty, by_valid):
    """The local dispatcher's dropping form (dispatch/expert_sort.sort_dropping: ids of -1 go to no expert, the batch
    padded to T * K rows) on the Triton sort equals its torch path exactly, and quantizes the tokens bit for bit
    kernels/quant.quantize_activation. The last rows' copies are all dropped (a bucket's padding tokens): their ids
    -1, or by_valid their ids real and the rows past ``valid`` (the sort then reads them as -1); more at random."""
    from moeflow.dispatch import _ep_rows, expert_sort
    from moeflow.kernels.rows.quant import quantize_activation
    ids = torch.rand(t, e).argsort(dim=1)[:, :k].to(torch.int32)
    ids[torch.rand(t, k) < 0.3] = -1
    dropped = ids.clone()
    dropped[t - t // 3:] = -1
    valid = torch.tensor([t - t // 3]) if by_valid else None
    if not by_valid:
        ids = dropped
    w = torch.rand(t, k)
    x = (torch.randn(t, h) * torch.rand(t, 1) * 10).half()
    monkeypatch.setattr(_ep_rows, "triton_glue", lambda t: True)  # the CUDA path (_ep_kernels), here interpreted
    got = expert_sort.sort_dropping(ids, w, e, x, scheme, valid)
    monkeypatch.setattr(_ep_rows, "triton_glue", lambda t: False)
    want = expert_sort.sort_dropping(ids, w, e, x, scheme, valid)
    for name, g, ref in zip(("offsets", "counts", "copy_pos", "source", "weights"), got[:5], want[:5], strict=True):
        assert same(g, ref), name
    for name, g, ref in zip(("offsets", "counts", "copy_pos", "source", "weights"), got[:5],
                            expert_sort.sort_dropping(dropped, w, e)[:5], strict=True):
        assert same(g, ref), f"{name}: rows past valid are not the rows of ids -1"
    assert int(got[0][-1]) == int((dropped >= 0).sum()) and torch.equal(got[2] < 0, dropped < 0)
    assert want[5] is None and want[6] is None  # torch's sort: the runner quantizes
    if scheme == "none":
        assert got[5] is None and got[6] is None
    else:
        q, sc = quantize_activation(x, scheme)
        assert torch.equal(got[5].view(torch.uint8), q.view(torch.uint8)) and torch.equal(got[6], sc)


@pytest.mark.parametrize("h,scheme", [(1500, "fp8-block"), (384, "fp8-block"), (640, "fp8-tensor")])
def test_sorts_quantize_several_tokens_a_part(monkeypatch, h, scheme, poison_empty):
    """Quantizing parts of several tokens each (align.quant_rows, here forced by a low _QUANT_PARTS; 37 tokens leave
    a part-filled last one): the segment sort's and the one-launch sort's tokens bit for bit
    kernels/quant.quantize_activation's."""
    from moeflow.dispatch.expert_sort import sort_by_segments
    from moeflow.kernels.rows import align
    from moeflow.kernels.rows.quant import quantize_activation
    monkeypatch.setattr(align, "_QUANT_PARTS", 4)
    t, k, e = 37, 4, 16
    assert align.quant_rows(t, 2, 1024) == 8 and align.quant_rows(t, 1, 512) == 8  # 5 parts of 8 tokens
    ids = torch.rand(t, e).argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand(t, k)
    x = (torch.randn(t, h) * torch.rand(t, 1) * 10).half()
    x[0, :128] = 0  # an all-zero group / part of a row
    q, sc = quantize_activation(x, scheme)
    for got in (sort_by_segments(ids, w, e, x, scheme), align.sort_copies(ids, w, e, x, scheme)):
        assert torch.equal(got[5].view(torch.uint8), q.view(torch.uint8)) and torch.equal(got[6], sc)


def test_quant_rows_keeps_parts_few_and_enough():
    """align.quant_rows: one token a part for small batches; up to 8192 elements a part past _QUANT_PARTS parts
    (Qwen3's H = 2048 in two parts of 1024 columns: T = 16384 takes 8 tokens a part, 4096 parts)."""
    from moeflow.kernels.rows.align import quant_rows
    assert quant_rows(1, 2, 1024) == 1 and quant_rows(512, 2, 1024) == 1 and quant_rows(1024, 2, 1024) == 2
    assert quant_rows(16384, 2, 1024) == 8 and quant_rows(4096, 7, 1024) == 8 and quant_rows(4096, 1, 256) == 4


def test_sort_by_segment_many_segments(monkeypatch, segments, poison_empty):
    """A small histogram table forces many short segments (1200 copies, 8 bins: segments of 256):
    the prefix sums across segments carry the order."""
    from moeflow.kernels.rows import ep_sort
    monkeypatch.setattr(ep_sort, "_SEGMENT_TABLE", 64)
    for case in ("random", "one expert"):
        ids, weights = received(300, 4, 6, case)
        n = int((ids >= 0).sum())
        got = ep_sort.sort_copies_by_expert(ids, weights, 6, n)
        want = sorted_batch_torch(ids, weights, 6, n)
        for name, g, w in zip(("source", "sorted_weights", "counts", "offsets", "copy_pos"), got, want):
            assert same(g, w), f"{case}: {name}"


@pytest.mark.parametrize("r,k,e_local,case", [(300, 4, 6, "random"), (300, 4, 6, "one expert"),
                                               (7, 8, 5, "none here"), (1, 3, 5, "random"), (0, 8, 5, "random"),
                                               (97, 8, 33, "random")], ids=str)
def test_sort_copies_scanned(r, k, e_local, case, monkeypatch, segments, poison_empty):
    """The three-launch form (a scan launch between histogram and placement, segment_size): forced here (no
    one-table form) with segments of 64 copies and scan programs of at most 256 cells (1200 copies: 19 segments, a part-filled last
    one; 776 copies over 64 bins: 13 segments, scanned in four blocks of 16 keys), bit for bit the torch
    reference."""
    from moeflow.kernels.rows import ep_sort
    monkeypatch.setattr(ep_sort, "_TABLE_SEG", 0)
    monkeypatch.setattr(ep_sort, "_SCAN_SEG", 64)
    monkeypatch.setattr(ep_sort, "_SCAN_CELLS", 256)
    ids, weights = received(r, k, e_local, case)
    n = int((ids >= 0).sum())
    assert ep_sort.segment_size(r * k, 64)[1]
    want = sorted_batch_torch(ids, weights, e_local, n)
    got = ep_sort.sort_copies_by_expert(ids, weights, e_local, n)
    for name, g, w in zip(("source", "sorted_weights", "counts", "offsets", "copy_pos"), got, want):
        assert same(g, w), f"{case}: {name}"


def test_segment_size():
    """Two launches while the whole table fits every place program at segments of 512 copies or fewer, else three
    with 256-copy segments (more where one key's column of segments would pass _SCAN_CELLS)."""
    from moeflow.kernels.rows.ep_sort import segment_size, sort_pays
    assert segment_size(0, 16) == (256, False)
    assert segment_size(8192, 256) == (256, False)  # Qwen3 T=1024: 32 segments x 256 bins
    assert segment_size(16384, 256) == (512, False)  # Qwen3 T=2048
    assert segment_size(131072, 16) == (256, False)  # Mixtral T=65536: 512 x 16
    assert segment_size(32768, 256) == (256, True)  # Qwen3 T=4096: 128 segments, scanned
    assert segment_size(131072, 512) == (256, True)  # DeepSeek-V3 T=16384: 512 segments
    assert segment_size(1 << 22, 512) == (512, True)  # 8192 segments at most
    assert sort_pays(131072, 256) and sort_pays(1 << 19, 256) and not sort_pays((1 << 19) + 1, 8)


def test_whole_sort_threshold():
    """One program sorts up to _WHOLE_COPIES copies (the local dispatcher's T=16 at top-8, Mixtral's T=128 at top-2:
    256), the segment launches beyond (Qwen3's T=128: 1024 copies)."""
    from moeflow.kernels.rows.ep_sort import _WHOLE_COPIES, whole_sort
    assert whole_sort(0) and whole_sort(256) and whole_sort(_WHOLE_COPIES) and not whole_sort(_WHOLE_COPIES + 1)
    assert not whole_sort(1024)


@pytest.mark.parametrize("r,k,e_local,case", [(7, 3, 6, "random"), (7, 8, 5, "none here"), (400, 4, 6, "one expert")],
                         ids=str)
def test_sort_copies_padded_to_a_bound(r, k, e_local, case, form, poison_empty):
    """n an upper bound of the copies here (alltoall-fixed: R * min(K, E_local)): the kernel equals
    the torch reference, and positions past the copies hold source 0, weight 0; the reference's
    first positions equal the exact sort's."""
    ids, weights = received(r, k, e_local, case)
    n = int((ids >= 0).sum())
    bound = r * min(k, e_local)
    want = sorted_batch_torch(ids, weights, e_local, bound)
    got = sort_copies_by_expert(ids, weights, e_local, bound, padded=True)
    for name, g, w in zip(("source", "sorted_weights", "counts", "offsets", "copy_pos"), got, want):
        assert same(g, w), name
    exact = sorted_batch_torch(ids, weights, e_local, n)
    assert same(want[0][:n], exact[0]) and same(want[1][:n], exact[1]) and same(want[4], exact[4])
    assert int(want[3][-1]) == n
    assert not want[0][n:].any() and not want[1][n:].any()
