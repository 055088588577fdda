"""The layout contract: how a dispatcher hands token copies to an expert runner (ExpertBatch).

* ``sorted`` — the copies for this rank's experts, grouped by local expert, contiguous: ``hidden [N, H]`` with
  ``offsets [E_local + 1]`` (copies of local expert e are rows ``offsets[e]:offsets[e+1]``). What grouped GEMMs
  and high-throughput all-to-all want.
* ``masked`` — a fixed-capacity slab per local expert: ``hidden [E_local, C, H]`` with ``counts [E_local]``; slot
  (e, c) is valid iff c < counts[e]. What low-latency, CUDA-graph friendly dispatch wants (no data-dependent shapes).

Runner output has the layout of its input, the layer dtype, and every row already multiplied by its routing
weight; empty masked slots are zero. :func:`run_in_layout` converts for a runner that does not consume a layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

SORTED = "sorted"
MASKED = "masked"
LAYOUTS = (SORTED, MASKED)


@dataclass
class ExpertBatch:
    """Token copies for this rank's experts.

    layout: "sorted" | "masked".
    hidden: sorted [N, H] / masked [E_local, C, H]; the layer dtype, or float8_e4m3fn when the
        dispatcher sent a quantized payload (then ``hidden_scale`` is set, made by the layer's
        scheme's ``quantize_activation``).
    weights: routing weight of each copy, float32: sorted [N] / masked [E_local, C] (0 in empty slots).
    counts: [E_local] int32, copies per local expert (both layouts).
    offsets: sorted only: [E_local + 1] int64, exclusive prefix sum of counts. offsets[-1] == N
        unless ``padded``.
    hidden_scale: float32 activation scales, sorted [N, G] / masked [E_local, C, G], or None.
    source_rows: sorted only, or None: [N] int64. When set, the rows are given by index: row r is
        ``hidden[source_rows[r]]`` and ``hidden`` [S, H] (``hidden_scale`` [S, G]) holds the S source
        rows un-permuted. A dispatcher hands this only when the plan says the runner reads rows by
        index (``Plan.indexed_rows``); ``gathered()`` makes the ordinary batch.
    copy_rows: rows by index only, or None: [S, K] int64, the sorted row of each of the K copies of source
        row s (the inverse of ``source_rows``: source_rows[copy_rows[s, k]] == s; every sorted row is one
        copy, but for a padded batch's padding rows, which no entry names: its dropped copies are -1). A
        runner that copies the rows into layout order scatters by it, reading each source row once, instead
        of gathering by ``source_rows`` (which reads each source row K times).
    padded: sorted only. The batch is sized by a bound (alltoall-fixed: no host synchronization):
        rows offsets[-1] .. N-1 are padding (weight 0, a valid source row) that runners skip; their
        output rows are unspecified and nothing reads them. False: offsets[-1] == N.
    """

    layout: str
    hidden: Tensor
    weights: Tensor
    counts: Tensor
    offsets: Tensor | None = None
    hidden_scale: Tensor | None = None
    source_rows: Tensor | None = None
    padded: bool = False
    copy_rows: Tensor | None = None

    @property
    def num_local_experts(self) -> int:
        return self.counts.shape[0]

    @property
    def num_rows(self) -> int:
        """Flat rows the runner computes: N (sorted) or E_local * C (masked)."""
        if self.source_rows is not None:
            return self.source_rows.shape[0]
        return self.hidden.shape[0] if self.layout == SORTED else self.hidden.shape[0] * self.hidden.shape[1]

    def gathered(self) -> "ExpertBatch":
        """The same batch with its rows materialized in order (itself when not given by index)."""
        if self.source_rows is None:
            return self
        pick = self.source_rows
        return ExpertBatch(self.layout, self.hidden.index_select(0, pick), self.weights, self.counts, self.offsets,
                           None if self.hidden_scale is None else self.hidden_scale.index_select(0, pick),
                           padded=self.padded)

    @property
    def quantized(self) -> bool:
        return self.hidden_scale is not None

    def host_counts(self) -> list[int]:
        """counts as Python ints (synchronizes with the device)."""
        return [int(c) for c in self.counts.tolist()]


def offsets_from_counts(counts: Tensor) -> Tensor:
    """counts [E] int -> offsets [E + 1] int64 (exclusive prefix sum)."""
    return torch.cat([counts.new_zeros(1, dtype=torch.int64), counts.to(torch.int64).cumsum(0)])


def expert_of_sorted_row(offsets: Tensor, rows: int) -> Tensor:
    """offsets [E + 1] int64 of a sorted batch of ``rows`` rows -> [rows] int64: the expert whose
    span offsets[e] .. offsets[e+1]-1 holds each row; E for padding rows past offsets[-1]
    (ExpertBatch.padded). No host synchronization."""
    return torch.searchsorted(offsets[1:], torch.arange(rows, device=offsets.device), right=True)


def sorted_to_masked(batch: ExpertBatch, capacity: int | None = None) -> tuple[ExpertBatch, Tensor]:
    """-> (masked batch with ``capacity`` slots per expert, slot_of_row [N] int64 = e * C + c).

    capacity defaults to the largest count (a host synchronization). Rows beyond a given
    capacity would be lost, so a too-small capacity is a programming error and raises.
    """
    batch = batch.gathered()
    e_local = batch.num_local_experts
    n = batch.hidden.shape[0]
    counts = batch.counts.to(torch.int64)
    if capacity is None:
        capacity = max(int(counts.max()) if e_local else 0, 1)
    elif n and int(counts.max()) > capacity:
        raise RuntimeError(f"sorted_to_masked: an expert has {int(counts.max())} rows > capacity {capacity}")
    dev = batch.hidden.device
    row = torch.arange(n, device=dev)
    expert_of_row = expert_of_sorted_row(batch.offsets, n)  # E_local for padding rows: a dropped slot
    start = torch.cat([batch.offsets[:-1], batch.offsets[-1:]])
    trash = e_local * capacity
    slot = torch.where(expert_of_row < e_local, expert_of_row * capacity + row - start[expert_of_row], trash)

    def scatter(rows: Tensor) -> Tensor:  # empty slots are zero (fp8 zero is 0x00)
        out = torch.zeros((trash + 1, *rows.shape[1:]), dtype=rows.dtype, device=dev)
        out[slot] = rows
        return out[:trash].view(e_local, capacity, *rows.shape[1:])

    masked = ExpertBatch(
        layout=MASKED,
        hidden=scatter(batch.hidden),
        weights=scatter(batch.weights),
        counts=batch.counts,
        hidden_scale=None if batch.hidden_scale is None else scatter(batch.hidden_scale),
    )
    return masked, slot


def masked_to_sorted(batch: ExpertBatch) -> tuple[ExpertBatch, Tensor]:
    """-> (sorted batch, slot_of_row [N] int64 = e * C + c of each sorted row). Data-dependent N."""
    e_local, capacity = batch.hidden.shape[:2]
    dev = batch.hidden.device
    valid = torch.arange(capacity, device=dev)[None, :] < batch.counts.to(torch.int64)[:, None]
    slot = valid.flatten().nonzero().squeeze(1)  # row-major: grouped by expert, in slot order

    def gather(x: Tensor) -> Tensor:
        return x.flatten(0, 1)[slot]

    sorted_batch = ExpertBatch(
        layout=SORTED,
        hidden=gather(batch.hidden),
        weights=gather(batch.weights),
        counts=batch.counts,
        offsets=offsets_from_counts(batch.counts),
        hidden_scale=None if batch.hidden_scale is None else gather(batch.hidden_scale),
    )
    return sorted_batch, slot


def masked_output_to_sorted(out: Tensor, slot: Tensor) -> Tensor:
    """out [E_local, C, H] -> [N, H], rows picked by ``slot`` (from sorted_to_masked; padding rows,
    slot E_local * C, get some row: their output is unspecified)."""
    flat = out.flatten(0, 1)
    return flat[slot.clamp(max=flat.shape[0] - 1)]


def sorted_output_to_masked(out: Tensor, slot: Tensor, e_local: int, capacity: int) -> Tensor:
    """out [N, H] -> [E_local, C, H] with zeros in empty slots (``slot`` from masked_to_sorted)."""
    full = out.new_zeros(e_local * capacity, out.shape[1])
    full[slot] = out
    return full.view(e_local, capacity, out.shape[1])


def run_in_layout(runner, batch: ExpertBatch, weights) -> Tensor:
    """Run ``runner`` on ``batch``, converting the layout when the runner does not consume it.

    Returns the output in ``batch.layout``. The native path is an optimization; the converted
    path is always correct, so every (dispatcher, runner) pair composes (conversions return the index that
    maps results back). A batch given by index reaches only runners that read rows by index.
    """
    if batch.layout in runner.caps.layouts:
        if batch.source_rows is not None and not runner.caps.indexed_rows:
            batch = batch.gathered()
        return runner.run(batch, weights)
    if batch.layout == SORTED:
        masked, slot = sorted_to_masked(batch)
        return masked_output_to_sorted(runner.run(masked, weights), slot)
    sorted_batch, slot = masked_to_sorted(batch)
    e_local, capacity = batch.hidden.shape[:2]
    return sorted_output_to_masked(runner.run(sorted_batch, weights), slot, e_local, capacity)
