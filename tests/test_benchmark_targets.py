"""PERF.md's four target lines as benchmark.target_summary computes them from bench_layer.py's rows."""
import math

from moeflow.benchmark import format_target_summary, target_summary


def _row(preset, scheme, t, floor, graph, clean=None, anchor=None, tflops=1.0):
    return dict(preset=preset, scheme=scheme, runner="triton", T=t, floor_us=floor, layer_us=2 * graph,
                layer_graph_us=graph, layer_clean_us=clean, tflops=tflops, anchor_us=anchor)


ROWS = [_row("qwen3-30b-a3b", "none", 1, 10.0, 40.0, 20.0, anchor=35),  # 25%, anchor missed (clean: 50%, met)
        _row("mixtral-8x7b", "none", 128, 90.0, 100.0, 95.0, anchor=100),  # 90%, anchor met (equal)
        _row("deepseek-v3", "fp8-block", 16384, 640.0, 1000.0, 800.0, anchor=900, tflops=750.0),  # 64%, missed
        _row("deepseek-v3", "none", 4096, 70.0, 100.0)]  # 70%, no anchor, no clean time


def test_do_bench_lines():
    s = target_summary(ROWS)
    assert s["rows"] == 4
    assert math.isclose(s["geomean_pct"], (25 * 90 * 64 * 70) ** 0.25)
    assert s["below"] == [("qwen3-30b-a3b", "none", 1, 25.0)]
    assert (s["anchors"], s["anchors_met"]) == (3, 1)
    assert s["missed"] == [("qwen3-30b-a3b", "none", 1, 40.0, 35), ("deepseek-v3", "fp8-block", 16384, 1000.0, 900)]
    assert s["dsv3_fp8_block_tflops"] == 750.0


def test_clean_flush_lines_rescale_and_skip_untimed_rows():
    s = target_summary(ROWS, "layer_clean_us")
    assert s["rows"] == 3  # the row without a clean time is left out
    assert math.isclose(s["geomean_pct"], (50 * 100 * 90 / 95 * 80) ** (1 / 3))
    assert s["below"] == [("qwen3-30b-a3b", "none", 1, 50.0)]
    assert (s["anchors"], s["anchors_met"]) == (3, 3)
    assert math.isclose(s["dsv3_fp8_block_tflops"], 750.0 * 1000 / 800)  # same FLOPs, the clean time


def test_no_rows_and_the_printed_lines():
    empty = target_summary([])
    assert empty["geomean_pct"] is None and empty["dsv3_fp8_block_tflops"] is None
    text = format_target_summary(target_summary(ROWS), "do_bench")
    assert "geometric mean 56.3% of roofline over 4 rows" in text
    assert "rows below 60%: 1" in text and "1 of 3" in text and "750 TFLOP/s" in text
    assert "- (row not run)" in format_target_summary(empty, "x")
