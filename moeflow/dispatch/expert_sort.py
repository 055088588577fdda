"""Token copies grouped by expert: the sort behind the sorted layout, shared by dispatchers.

    topk_ids [T, K] int (ids in 0 .. E-1), topk_weights [T, K] float
    -> offsets [E + 1] int64      copies of expert e are sorted rows offsets[e] .. offsets[e+1]-1
       counts [E] int32           copies of expert e (offsets' differences, made by the sort itself)
       row_of_copy [T, K] int64   the sorted row of copy k of token t
       source [T*K] int64         the token of each sorted row
       sorted_weights [T*K] f32   the routing weight of each sorted row
Stable: within an expert, copies keep their (t, k) order. No host synchronization.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..capabilities import triton_glue
from ._ep_reference import sort_copies_by_expert_torch
from ._ep_rows import _ep_kernels


# Which sort a CUDA batch of T*K copies takes, the fastest of each range: int32 ids and float32 weights (the
# layer's) up to ep_sort._WHOLE_COPIES in one program of kernels/rows/ep_sort (whole_sort); other dtypes, up to
# ONE_LAUNCH_COPIES, the one-launch comparison sort (kernels/rows/align.sort_copies; past this size the segment
# sort is faster); then kernels/rows/ep_sort's segment sort while ep_sort.sort_pays; torch's radix sort beyond.
ONE_LAUNCH_COPIES = 128
# schemes sort_and_quantize quantizes tokens for: kernels/rows/align.SORT_QUANT_CODES' keys, named here without
# importing triton (tests/kernels/test_triton_kernels.py checks they agree)
SORT_QUANTIZES = ("fp8-tensor", "fp8-channel", "fp8-block")
# fp8-tensor's one scale is the amax of the whole batch, which each of the sort's quantizing programs takes
# again: up to this many elements of hidden [T, H] (T = 1 at any preset, T <= 16 at H = 2048); larger batches
# are quantized by the runner (a row-amax launch, a max, a quantization launch)
TENSOR_QUANT_IN_SORT_MAX = 32768


def sort_by_expert(topk_ids: Tensor, topk_weights: Tensor, num_experts: int, bounds: Tensor | None = None):
    """On CUDA: the smallest batches in one Triton launch (kernels/rows/ep_sort's whole sort, or for ids and weights
    not int32 / float32 kernels/rows/align.sort_copies), larger ones in two or three (kernels/rows/ep_sort's segment
    sort), instead of a sort, a searchsorted and four index kernels; torch otherwise (the same values;
    thresholds above). bounds: 0 .. E in topk_ids' dtype and device, when the caller keeps one (torch path)."""
    out = _triton_sort(topk_ids, topk_weights, num_experts)
    return out if out is not None else sort_by_expert_torch(topk_ids, topk_weights, num_experts, bounds)


def sort_and_quantize(topk_ids: Tensor, topk_weights: Tensor, num_experts: int, hidden: Tensor, scheme: str,
                      bounds: Tensor | None = None):
    """sort_by_expert, and the tokens hidden [T, H] quantized by ``scheme`` (one of SORT_QUANTIZES; fp8-tensor
    only up to TENSOR_QUANT_IN_SORT_MAX elements) by the sort's own first launch where the sort is a Triton one
    (CUDA: the one-launch sort, or the segment sort's histogram launch; hidden's columns contiguous), so the
    runner's quantization launches leave the layer's serial chain
    -> (offsets, counts, row_of_copy, source, sorted_weights, hq [T, H] fp8, hs [T, G] float32);
    elsewhere (torch's sort) sort_by_expert's five and (None, None): the runner quantizes.
    hq and hs are bit for bit kernels/rows/quant.quantize_activation(hidden, scheme)."""
    out = _triton_sort(topk_ids, topk_weights, num_experts,
                       hidden if _sort_quantizes(hidden, topk_ids, scheme) else None, scheme)
    if out is None:
        out = sort_by_expert_torch(topk_ids, topk_weights, num_experts, bounds)
    return out if len(out) == 7 else (*out, None, None)


def _sort_quantizes(hidden: Tensor, topk_ids: Tensor, scheme: str) -> bool:
    """Whether a Triton sort's first launch may quantize hidden [T, H] by ``scheme`` (one of SORT_QUANTIZES): its
    columns contiguous, a row a token, fp8-tensor only up to TENSOR_QUANT_IN_SORT_MAX elements."""
    return (hidden.stride(-1) == 1 and hidden.shape[0] == topk_ids.shape[0]
            and (scheme != "fp8-tensor" or hidden.numel() <= TENSOR_QUANT_IN_SORT_MAX))


def _triton_sort(topk_ids: Tensor, topk_weights: Tensor, num_experts: int, hidden: Tensor | None = None,
                 scheme: str = "none"):
    """The Triton sort the thresholds above pick for this batch (with hidden: quantizing it too, the
    tuple then 7 long), or None where torch's sort runs (not CUDA, triton missing, a batch past
    sort_pays, or ids / weights not int32 / float32 beyond the one-launch size)."""
    if not triton_glue(topk_ids):  # not CUDA, or a GPU the kernels were not checked on
        return None
    try:
        from ..kernels.rows.align import sort_copies
        from ..kernels.rows.ep_sort import sort_pays, whole_sort
    except ImportError:  # triton missing
        return None
    n = topk_ids.numel()
    typed = topk_ids.dtype == torch.int32 and topk_weights.dtype == torch.float32  # what ep_sort takes
    if typed and whole_sort(n):
        return sort_by_segments(topk_ids, topk_weights, num_experts, hidden, scheme)  # one program: ep_sort.whole_sort
    if n <= ONE_LAUNCH_COPIES:
        return sort_copies(topk_ids, topk_weights, num_experts, hidden, scheme)
    if typed and sort_pays(n, num_experts):
        return sort_by_segments(topk_ids, topk_weights, num_experts, hidden, scheme)
    return None


def sort_by_segments(topk_ids: Tensor, topk_weights: Tensor, num_experts: int, hidden: Tensor | None = None,
                     scheme: str = "none"):
    """sort_by_expert through kernels/rows/ep_sort.sort_copies_by_expert (topk_ids int32, topk_weights
    float32; needs triton); with hidden, also (hq, hs) as sort_and_quantize."""
    from ..kernels.rows.ep_sort import sort_copies_by_expert
    source, sorted_w, counts, offsets, copy_pos, *quantized = sort_copies_by_expert(
        topk_ids, topk_weights, num_experts, topk_ids.numel(), x=hidden, scheme=scheme)
    return (offsets, counts, copy_pos.view(topk_ids.shape), source, sorted_w, *quantized)


def sort_dropping(topk_ids: Tensor, topk_weights: Tensor, num_experts: int, hidden: Tensor | None = None,
                  scheme: str = "none", valid: Tensor | None = None):
    """Token copies grouped by expert where a copy may go to no expert (id -1), and with valid [1] int64 every copy of
    the rows from valid[0] on (the padding tokens of moeflow.graph_buckets' bucketed calls, whatever their ids).
    topk_ids [T, K] int32 (ids in -1 .. E-1), topk_weights [T, K] float32
    -> (offsets [E + 1] int64, counts [E] int32, copy_pos [T, K] int64: the sorted row of each copy, -1 for a dropped
    one, source [T*K] int64, sorted_weights [T*K] float32, hq, hs): rows offsets[E] .. T*K-1 are padding (source 0,
    weight 0: ExpertBatch.padded). On CUDA kernels/rows/ep_sort's sort, the expert-parallel dispatchers' (with hidden
    [T, H] and a scheme of SORT_QUANTIZES, as sort_and_quantize: hq [T, H] fp8 and hs [T, G] float32 from the
    same launch); torch's otherwise, or past ep_sort.sort_pays (hq = hs = None: the runner quantizes)."""
    t, k = topk_ids.shape
    n = t * k
    typed = topk_ids.dtype == torch.int32 and topk_weights.dtype == torch.float32  # what ep_sort takes
    kernels = _ep_kernels(topk_ids, "ep_sort") if typed else None
    if kernels is not None and kernels.sort_pays(n, num_experts):
        quantize = hidden is not None and scheme in SORT_QUANTIZES and _sort_quantizes(hidden, topk_ids, scheme)
        source, sorted_w, counts, offsets, copy_pos, *quantized = kernels.sort_copies_by_expert(
            topk_ids, topk_weights, num_experts, n, padded=True, x=hidden if quantize else None, scheme=scheme,
            valid=valid)
    else:
        if valid is not None:  # the padding rows' copies to no expert, as the Triton sort reads them
            topk_ids = topk_ids.masked_fill((torch.arange(t, device=topk_ids.device) >= valid)[:, None], -1)
        source, sorted_w, counts, offsets, copy_pos = sort_copies_by_expert_torch(topk_ids, topk_weights,
                                                                                  num_experts, n)
        quantized = []
    hq, hs = quantized if quantized else (None, None)
    return offsets, counts, copy_pos.view(t, k), source, sorted_w, hq, hs


def sort_by_expert_torch(topk_ids: Tensor, topk_weights: Tensor, num_experts: int, bounds: Tensor | None = None):
    """A stable torch.sort; offsets by searchsorted on the sorted ids (bincount would read the
    largest id on the host, which a CUDA graph cannot capture)."""
    t, k = topk_ids.shape
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)
    if bounds is None:
        bounds = torch.arange(num_experts + 1, dtype=sorted_ids.dtype, device=sorted_ids.device)
    offsets = torch.searchsorted(sorted_ids, bounds)
    row = torch.empty_like(order)
    row[order] = torch.arange(order.numel(), device=order.device)
    return offsets, offsets.diff().to(torch.int32), row.view(t, k), order // k, topk_weights.reshape(-1).float()[order]
