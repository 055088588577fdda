"""moeflow.benchmark's accuracy helpers, and `moeflow bench` judging a layer that leaves an element unwritten."""
import math
import types

import pytest
import torch

from moeflow.benchmark import poisoned_allocations, relative_error
from moeflow.graphs import GraphCache


def test_relative_error_in_float64():
    want = torch.tensor([3.0, 4.0], dtype=torch.bfloat16)
    assert relative_error(want.clone(), want) == 0.0
    assert relative_error(torch.tensor([3.0, 4.5]), want) == pytest.approx(0.1, abs=1e-12)  # 0.5 / 5
    assert relative_error(torch.tensor([1.0, 0.0]), torch.zeros(2)) == pytest.approx(1e30)  # no division by zero
    assert math.isnan(relative_error(torch.tensor([float("nan"), 4.0]), want))


def test_poisoned_allocations_fill_fresh_buffers_and_restore_the_mode():
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory)
    with poisoned_allocations():
        assert torch.isnan(torch.empty(5, 3)).all() and torch.isnan(torch.empty_like(torch.ones(4))).all()
        assert torch.isnan(torch.ones(2).new_empty(7)).all()
        assert (torch.empty(6, dtype=torch.int32) == 2 ** 31 - 1).all()
        assert torch.isnan(torch.empty(4, dtype=torch.float8_e4m3fn).float()).all()
        # the layers' eager graphs stand aside: a call allocates anew rather than replaying a graph's old buffers
        assert not GraphCache(True, device_type="cpu").usable((torch.ones(1, 4),))
    assert GraphCache(True, device_type="cpu").usable((torch.ones(1, 4),))
    assert (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory) == before
    with pytest.raises(ValueError), poisoned_allocations():  # restored on the way out of an error too
        raise ValueError
    assert torch.are_deterministic_algorithms_enabled() == before[0]


def test_bench_marks_a_row_with_an_unwritten_element(make_layer):
    """A runner whose output buffer has a row it never writes: `moeflow bench` must call it wrong (NaN), whatever
    the allocator's block held before; on CUDA that may be another runner's right output of the same shape."""
    from moeflow.cli import bench
    layer = make_layer(num_experts=6, hidden_size=40, intermediate_size=24, top_k=2)
    x, logits = torch.randn(9, layer.config.hidden_size, dtype=torch.bfloat16), torch.randn(9, layer.config.num_experts)
    with torch.no_grad():
        want = layer(x, logits)

    class Runner(torch.nn.Module):
        config = layer.config
        plan = types.SimpleNamespace(runner="triton")  # stands for a faulty runner (the CPU runs only the reference)
        router, e_score_correction_bias = layer.router, layer.e_score_correction_bias  # bench counts the routed experts

        def __init__(self, rows: slice):
            super().__init__()
            self.rows = rows

        def forward(self, x, logits):
            out = torch.empty_like(want)
            out[self.rows] = layer(x, logits)[self.rows]
            return out

    row = bench._measure(Runner(slice(1, None)), x, logits, want)  # row 0 never written
    assert row["status"] == "wrong" and math.isnan(row["rel_err"]) and row["us"] > 0
    row = bench._measure(Runner(slice(None)), x, logits, want)
    assert row["status"] == "ok" and row["rel_err"] == 0.0
