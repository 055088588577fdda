"""`moeflow tune`'s search of the one-launch layer's tiles, the parts that run without a GPU: the candidate tile
sets, which T are searched, the pick (fused only where faster), and what --merge / --no-fused write; and the
Gluon fp8-block gate_up tiles among the separate GEMMs' candidates."""
import argparse
import json

import pytest
import torch

from moeflow.tune import autotune
from moeflow.tune import fused as tune_fused
from moeflow.kernels import configs as kc
from moeflow.kernels.gemm import tiles

QWEN3 = dict(num_experts=128, hidden=2048, inter=768, top_k=8)


@pytest.mark.parametrize("scheme", ["none", "fp8-channel", "fp8-block"])
def test_fused_candidates_are_valid_tiles(scheme):
    """Non-empty, already fitted (fit_fused leaves each unchanged), no duplicates; fp8-block: BLOCK_K 128 and
    BLOCK_N dividing 128 (one weight-scale block and one activation group a step)."""
    got = tune_fused.fused_candidates(autotune.Shape(scheme=scheme, **QWEN3), 1)
    assert got and len(set(got)) == len(got)
    assert all(isinstance(c, kc.FusedConfig) and tiles.fit_fused(c, scheme) == c for c in got)
    if scheme == "fp8-block":
        assert all(c.block_k1 == c.block_k2 == 128 and 128 % c.block_n1 == 0 and 128 % c.block_n2 == 0 for c in got)
    assert tune_fused.fused_candidates(autotune.Shape(scheme=scheme, **QWEN3), 16) == got  # the same set at every T


@pytest.mark.parametrize("shape,tokens,why", [
    (autotune.Shape(scheme="fp8-tensor", **QWEN3), 1, "a scheme the kernel does not run"),
    (autotune.Shape(scheme="none", dtype=torch.float32, **QWEN3), 1, "float32: tiles sized for 2-byte weights"),
    (autotune.Shape(scheme="none", **QWEN3), 0, "an empty batch"),
    (autotune.Shape(scheme="none", **QWEN3), 65, "more tokens than the runner's counters hold"),
])
def test_no_fused_candidates_where_the_runner_never_runs_it(shape, tokens, why):
    assert tune_fused.fused_candidates(shape, tokens) == [], why


def test_fused_searched_only_for_small_single_process_batches():
    shape = autotune.Shape(scheme="fp8-block", **QWEN3)
    limit = tune_fused.FUSED_TUNE_MAX_TOKENS
    assert tune_fused.fused_searched(shape, 1, True) and tune_fused.fused_searched(shape, limit, True)
    assert not tune_fused.fused_searched(shape, limit + 1, True)  # candidates exist there, but it is not searched
    assert tune_fused.fused_candidates(shape, limit + 1)
    assert not tune_fused.fused_searched(shape, 1, False)  # expert parallelism: separate launches always
    assert not tune_fused.fused_searched(autotune.Shape(scheme="fp8-tensor", **QWEN3), 1, True)


def test_pick_fused_only_where_faster_and_right():
    a, b, c = (kc.FusedConfig(block_n1=n) for n in (16, 64, 128))
    ok = tune_fused.FUSED_MAX_REL_ERR / 10
    assert tune_fused.pick_fused(10.0, []) is None
    assert tune_fused.pick_fused(10.0, [(a, 12.0, ok), (b, 11.0, ok)]) is None  # slower
    assert tune_fused.pick_fused(10.0, [(a, 10.0, ok), (b, 12.0, ok)]) is None  # a tie keeps the separate launches
    assert tune_fused.pick_fused(10.0, [(a, 9.5, ok), (b, 8.0, ok), (c, 10.5, ok)]) == b  # the fastest, not the first
    assert tune_fused.pick_fused(10.0, [(a, 8.0, ok), (b, 8.0, ok)]) == a  # equal fused times: the earlier candidate
    # a wrong output is never picked, however fast: over the limit, or NaN
    assert tune_fused.pick_fused(10.0, [(a, 5.0, 0.5), (b, 9.0, ok)]) == b
    assert tune_fused.pick_fused(10.0, [(a, 5.0, float("nan")), (b, 11.0, ok)]) is None
    assert tune_fused.pick_fused(10.0, [(a, 5.0, tune_fused.FUSED_MAX_REL_ERR)]) == a  # the limit itself passes


def _run_cli(monkeypatch, out, extra, tuned):
    """`moeflow tune` on a fake GPU with the search replaced: it writes ``tuned`` ({T: MoEKernelConfig}) ->
    the fused flag tune was called with."""
    from moeflow.cli import tune as tune_cli
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "GPU X")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    monkeypatch.setattr(autotune, "tune", lambda shape, tokens, on_result, fused, **kw:
                        (seen.append(fused), on_result(dict(tuned), {str(t): {"gate_up": 1.0} for t in tuned})))
    parser = argparse.ArgumentParser()
    tune_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["tune", "--experts", "8", "--inter", "256", "--hidden", "256", "--topk", "2",
                              "--quant", "fp8-block", "--tokens", ",".join(map(str, tuned)), "--device", "cpu",
                              "--out", str(out), "--merge"] + extra)
    assert args.func(args) == 0
    return seen[-1]


@pytest.mark.parametrize("extra,e,carried_at", [
    ([], 8, {64}),  # T=1 searched now: its answer (None) stands; T=64 above the search limit: its tiles kept
    (["--no-fused"], 8, {1, 64}),  # nothing searched: both keep their tiles
    (["--local-experts", "4"], 4, {1, 64}),  # expert parallelism: nothing searched
])
def test_merge_keeps_old_fused_tiles_only_where_not_searched(monkeypatch, tmp_path, extra, e, carried_at):
    gemm = kc.GemmConfig(16, 64, 128)
    old_f, other_f = kc.FusedConfig(block_n1=128, split1=2), kc.FusedConfig(block_n2=128, split2=16)
    old = kc.MoEKernelConfig(gemm, gemm, fused=old_f)
    new = kc.MoEKernelConfig(kc.GemmConfig(32, 64, 128), kc.GemmConfig(32, 64, 128))
    path = tmp_path / kc.file_name("GPU X", e, 256, 256, "fp8-block")
    kc.write_table(path, {}, {1: old, 2: old, 64: old}, {"2": {"gate_up": 5.0}})
    fused = _run_cli(monkeypatch, tmp_path, extra, {1: new, 64: new})
    assert fused == ("--no-fused" not in extra)
    table, measured = kc.read_table(path)
    assert table[2] == old  # not re-tuned: kept whole
    for t in (1, 64):
        assert table[t].gate_up == new.gate_up and table[t].fused == (old_f if t in carried_at else None), t
    assert set(measured) == {"1", "2", "64"}
    if not extra:  # a tile set the search found for a searched T is written as found, not replaced by the old one
        again = tmp_path / "again"  # another file: the table cache is keyed by path and modification time
        again.mkdir()
        kc.write_table(again / path.name, {}, {1: old}, {})
        _run_cli(monkeypatch, again, extra, {1: kc.MoEKernelConfig(gemm, gemm, fused=other_f)})
        assert kc.read_table(again / path.name)[0][1].fused == other_f


def test_merge_keeps_the_files_notes(monkeypatch, tmp_path):
    """A merge writes back the old file's free-form notes (fused_source, edits) with the new header."""
    gemm = kc.GemmConfig(16, 64, 128)
    path = tmp_path / kc.file_name("GPU X", 8, 256, 256, "fp8-block")
    kc.write_table(path, {"triton_version": "old", "fused_source": "a record", "edits": ["T=2 set by hand"]},
                   {2: kc.MoEKernelConfig(gemm, gemm)}, {"2": {"gate_up": 5.0}})
    _run_cli(monkeypatch, tmp_path, ["--no-fused"], {1: kc.MoEKernelConfig(gemm, gemm)})
    data = json.loads(path.read_text())
    assert data["fused_source"] == "a record" and data["edits"] == ["T=2 set by hand"]
    assert data["triton_version"] != "old" and data["device"] == "GPU X" and set(data["configs"]) == {"1", "2"}


@pytest.mark.parametrize("preset, tokens, gluon_gate_up", [
    ("deepseek-v3", 2048, True), ("mixtral-8x7b", 256, True), ("qwen3-30b-a3b", 1024, True),  # middle: 64-row tiles
    ("deepseek-v3", 16384, True),  # large: 128-row tiles
    ("qwen3-30b-a3b", 16, False)])  # weight streaming: none
def test_fp8_block_candidates_keep_the_gluon_gate_up_where_offered(preset, tokens, gluon_gate_up):
    """The Gluon gate_up tiles each family offers (scale_overlap, and the warp-specialized ones) survive fit() (a tile
    it cannot run would come back with the flag 0 and silently time the Triton kernel twice), and every candidate is
    a fitted tile."""
    from moeflow.kernels.gemm.tiles import fit
    from moeflow.presets import PRESETS
    p = PRESETS[preset]
    shape = autotune.Shape(p["num_experts"], p["hidden_size"], p["intermediate_size"], p["top_k"], "fp8-block")
    gu, dn = autotune.candidates(shape, tokens)
    for c in gu:
        assert fit(c, fused_pair=True, scheme="fp8-block", elem_bytes=1, n_size=shape.inter) == c
    gluon = [c for c in gu if c.scale_overlap]
    assert bool(gluon) == gluon_gate_up
    m = tokens * shape.top_k / shape.num_experts
    assert all(c.block_m == (64 if m <= 96 else 128) for c in gluon)
    ws = [c for c in gu if c.warp_specialize]  # the warp-specialized gate_up: 64 x 128 wherever the Gluon one is,
    assert bool(ws) == gluon_gate_up and all(c.block_n == 128 and c.num_warps == 4 for c in ws)
    tiles = {c.block_m for c in ws}  # and the consumers' shared 128-row tiles (COOP) in the large family
    assert tiles == (set() if not gluon_gate_up else {64, 128} if m > 96 else {64})
    wide = [c for c in dn if c.warp_specialize and c.block_n == 256]  # the wide ws down, kept by fit()
    assert bool(wide) == gluon_gate_up
    assert {c.block_m for c in wide} == (set() if not gluon_gate_up else {64, 128} if m > 96 else {64})  # COOP: large
    for c in dn:
        assert fit(c, fused_pair=False, scheme="fp8-block", elem_bytes=1, n_size=shape.hidden) == c
    assert len(set(gu)) == len(gu) and len(set(dn)) == len(dn)


@pytest.mark.parametrize("preset, tokens", [("qwen3-30b-a3b", 1024), ("deepseek-v3", 2048),  # middle family
                                            ("mixtral-8x7b", 1024), ("deepseek-v3", 16384)])  # large tiles
def test_bf16_candidates_keep_every_warp_specialized_tile(preset, tokens):
    """bf16: the tuner offers the warp-specialized tiles by turns (128 x 64 and 64 x 128 gate_up, 128 x 128 down) and
    COOP (128 x 128 gate_up, 128 x 256 down) in the middle and large families, and fit() keeps every one (a tile it
    cannot run would come back with the flag 0 and time the Triton kernel instead)."""
    from moeflow.kernels.gemm.tiles import fit
    from moeflow.presets import PRESETS
    p = PRESETS[preset]
    shape = autotune.Shape(p["num_experts"], p["hidden_size"], p["intermediate_size"], p["top_k"], "none")
    gu, dn = autotune.candidates(shape, tokens)
    for cfgs, gated, n in ((gu, True, shape.inter), (dn, False, shape.hidden)):
        assert all(fit(c, fused_pair=gated, scheme="none", elem_bytes=2, n_size=n) == c for c in cfgs)
    assert {(c.block_m, c.block_n) for c in gu if c.warp_specialize} == {(128, 64), (64, 128), (128, 128)}
    assert {(c.block_m, c.block_n) for c in dn if c.warp_specialize} == {(128, 128), (128, 256)}
    assert set(autotune.WS_BF16_GATE_UP) <= set(gu) and set(autotune.WS_BF16_DOWN) <= set(dn)


@pytest.mark.parametrize("scheme", ["none", "fp8-tensor", "fp8-channel", "fp8-block"])
def test_swapped_candidates_only_where_precise(scheme):
    """The tuner times swapped tiles (GemmConfig.swap_ab) for none and fp8-block at small and middle batches, never
    for fp8-tensor/-channel, whose K loops would accumulate in the fp8 wgmma's narrower accumulator
    (autotune._precise), and never at large batches."""
    for tokens, swaps in ((16, scheme in ("none", "fp8-block")), (256, scheme in ("none", "fp8-block")),
                          (16384, False)):
        shape = autotune.Shape(scheme=scheme, **QWEN3)
        for family in autotune.candidates(shape, tokens):
            assert any(c.swap_ab for c in family) == swaps, (tokens, scheme)
            assert all(c.block_m <= 32 for c in family if c.swap_ab)


def test_layer_times_checks_each_tile_set_poisoned(monkeypatch):
    """The tuner's check of a one-launch tile set runs it with its fresh buffers NaN-poisoned (a launch reusing the
    memory of the candidate before could leave an unwritten element holding a right value), the timed runs without;
    a NaN left is an error no limit passes."""
    calls = []

    class Runner:
        def run_fused(self, x, ids, w, weights, f):
            out = torch.empty_like(x)  # NaN only under poisoned allocations
            calls.append(bool(out.isnan().all()))
            out.copy_(x)
            if f.block_n1 == 64:  # this tile set leaves an element unwritten
                out[0, 0] = torch.empty(())
            return out

        def run_with(self, batch, weights, pair):
            return batch

    class Dispatcher:
        def dispatch(self, x, ids, w):
            return x, None

        def combine(self, out, handle):
            return out

    from moeflow.tune import timing
    monkeypatch.setattr(timing, "graph_time_ms", lambda fns, rep_ms: [f() for f in fns] and 1.0)
    x = torch.randn(3, 8)
    routing = (x, torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2))
    tiles = [kc.FusedConfig(block_n1=32), kc.FusedConfig(block_n1=64)]
    sep, timed = tune_fused.layer_times((Dispatcher(), Runner()), None, [routing], None, tiles, 1.0)
    assert calls.count(True) == len(tiles) and calls.count(False) == len(tiles)  # one check, one timed run each
    assert timed[0][2] == 0.0 and timed[1][2] != timed[1][2]  # NaN: never within FUSED_MAX_REL_ERR
    assert tune_fused.usable(timed) == [(tiles[0], 1.0)]
