"""the four target lines of docs/performance.md as benchmark.target_summary computes them from bench_layer.py's rows."""
import json
import math
import pathlib
import runpy
import sys

import pytest
import torch

from moeflow.benchmark import format_target_summary, rebased_rows, target_summary

COMPARE_RUNS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "compare_runs.py"


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


def test_rebased_rows_recompute_the_floor_at_other_ceilings():
    """benchmark.rebased_rows: FLOPs and bytes back from tflops and gbs over the headline time; the floor is the
    larger of the two at the given ceilings, the scheme's peak (fp8 or bf16); the input rows are left as they were."""
    rows = [dict(preset="p", scheme="none", runner="triton", T=1, layer_us=99.0, layer_graph_us=10.0,
                 tflops=2.0, gbs=3000.0, floor_us=1.0, roof_pct=10.0),  # 20 MFLOP, 30 MB
            dict(preset="p", scheme="fp8-block", runner="triton", T=4096, layer_us=100.0, layer_graph_us=None,
                 tflops=500.0, gbs=100.0, floor_us=1.0, roof_pct=1.0)]  # 50 GFLOP, 10 MB (layer_us: no graph)
    ceil = dict(bf16_flops=1e12, fp8_flops=1e15, bandwidth=2e12)
    a, b = rebased_rows(rows, ceil)
    assert math.isclose(a["floor_us"], 20.0) and math.isclose(a["roof_pct"], 200.0)  # 20 MFLOP at 1 TFLOP/s
    assert math.isclose(b["floor_us"], 50.0) and math.isclose(b["roof_pct"], 50.0)  # 50 GFLOP at 1 PFLOP/s
    a, _ = rebased_rows(rows, dict(ceil, bf16_flops=1e15))
    assert math.isclose(a["floor_us"], 15.0)  # now the bytes bound: 30 MB at 2 TB/s
    assert rows[0]["floor_us"] == 1.0 and rows[1]["roof_pct"] == 1.0


def test_compare_runs_prints_both_runs_and_the_rebased_lines(tmp_path, capsys):
    """benchmarks/compare_runs.py on two bench.json files: a row's ratio, the spread, and three target blocks."""
    row = dict(preset="p", scheme="none", runner="triton", T=1, layer_us=50.0, layer_graph_us=10.0,
               layer_clean_us=9.0, tflops=2.0, gbs=3000.0, floor_us=5.0, roof_pct=50.0, anchor_us=None)
    paths = []
    for name, us, ceil in (("old", 10.0, 4e12), ("new", 12.0, 2e12)):
        r = dict(row, layer_graph_us=us, tflops=2.0 * 10.0 / us, gbs=3000.0 * 10.0 / us)
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(dict(ceilings=dict(bf16_flops=1e12, fp8_flops=2e12, bandwidth=ceil),
                                             rows=[r])))
    argv, sys.argv = sys.argv, ["compare_runs.py", *map(str, paths)]
    try:
        with pytest.raises(SystemExit) as done:
            runpy.run_path(str(COMPARE_RUNS), run_name="__main__")
    finally:
        sys.argv = argv
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "1.200" in out and "geometric mean 1.200" in out
    assert out.count("targets, ") == 3 and "new run at the old run's ceilings" in out


# the anchor table: (preset, T) -> (bf16 µs, its % of roofline, fp8 µs, its %), the percentages as published
# printed them (whole numbers) at its ceilings (700 / 1265 TFLOP/s, 4.27 TB/s) with random routing's expected hit
PERF_ANCHORS = {
    ("qwen3-30b-a3b", 1): (35, 50, 27, 33), ("qwen3-30b-a3b", 128): (300, 94, 169, 84),
    ("qwen3-30b-a3b", 4096): (777, 57, 621, 39), ("qwen3-30b-a3b", 16384): (2347, 75, 2160, 45),
    ("deepseek-v3", 1): (203, 81, 108, 76), ("deepseek-v3", 128): (5268, 99, 2765, 94),
    ("deepseek-v3", 4096): (10239, 52, 5741, 46), ("deepseek-v3", 16384): (22764, 72, 15453, 59),
    ("mixtral-8x7b", 1): (188, 88, 144, 57), ("mixtral-8x7b", 128): (677, 98, 376, 88),
    ("mixtral-8x7b", 4096): (5088, 81, 3325, 69), ("mixtral-8x7b", 16384): (18283, 90, 12092, 75),
}


@pytest.mark.parametrize("preset,t", sorted(PERF_ANCHORS))
def test_roofline_reproduces_perf_md_anchor_percentages(preset, t):
    """moeflow.benchmark's FLOPs, bytes, expected hit and floor at the anchors' ceilings (Ceilings()) give each of their
    24 anchor percentages to within rounding: the formulas the benchmarks report against are the anchors'."""
    from moeflow.benchmark import roofline_seconds
    from moeflow.presets import preset_config
    bf16_us, bf16_pct, fp8_us, fp8_pct = PERF_ANCHORS[(preset, t)]
    for quant, us, pct in (("none", bf16_us, bf16_pct), ("fp8-block", fp8_us, fp8_pct)):
        cfg = preset_config(preset, quant=quant, dtype=torch.bfloat16)
        assert 100 * roofline_seconds(cfg, t) / (us * 1e-6) == pytest.approx(pct, abs=0.6), (preset, t, quant)


def test_roofline_formulas_by_hand():
    """The roofline formulas on Qwen3-30B-A3B (H 2048, I 768, E 128, K 8), numbers worked by hand."""
    from moeflow.benchmark import Ceilings, experts_hit, layer_bytes, layer_flops, roofline_seconds
    from moeflow.presets import preset_config
    bf16 = preset_config("qwen3-30b-a3b", dtype=torch.bfloat16)
    fp8 = preset_config("qwen3-30b-a3b", quant="fp8-block", dtype=torch.bfloat16)
    assert layer_flops(bf16, 1) == 2 * 8 * (2048 * 1536 + 768 * 2048) == 75_497_472
    assert experts_hit(bf16, 16) == pytest.approx(128 * (1 - (120 / 128) ** 16)) and round(experts_hit(bf16, 16), 1) == 82.4
    # 8 experts hit x 3HI weights (2 bytes in bf16, 1 in FP8) + T x H in and out in bf16
    assert layer_bytes(bf16, 1, hit=8) == 8 * 3 * 2048 * 768 * 2 + 2048 * 2 * 2
    assert layer_bytes(fp8, 1, hit=8) == 8 * 3 * 2048 * 768 + 2048 * 2 * 2
    ceil = Ceilings(bf16_flops=1e15, fp8_flops=2e15, bandwidth=1e12)
    assert roofline_seconds(bf16, 1, ceil, hit=8) == pytest.approx(layer_bytes(bf16, 1, 8) / 1e12)  # memory-bound
    big = layer_flops(fp8, 16384)  # compute-bound: the FP8 peak, not the bf16 one
    assert roofline_seconds(fp8, 16384, Ceilings(1e15, 2e15, 1e13), hit=128) == pytest.approx(big / 2e15)
