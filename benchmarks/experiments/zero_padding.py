"""Experiment (GPU): do the GEMMs run faster under the H200's power cap when the rows a tile computes past its
expert's last token are zeros, instead of the next expert's rows?

Why: the H200 runs every compute-bound row at its 700 W cap, the SM clock at 67-83% of the 1980 MHz it holds
otherwise (power_clocks_2026-12-02_h200_b11282f.md), and a tensor core multiplying zeros switches fewer bits, so
spends less energy a multiply-add (a public note timed a large matmul 1.15x faster on zeros than on normal random
values, on an A100, and traced it to the power limit: H. He, "Strangely, Matrix Multiplications on GPUs Run Faster
When Given 'Predictable' Data!", thonking.ai, 2024). The sorted layout packs each expert's rows back to back: an
expert's last row block reads the next expert's rows as its padding and drops their outputs. At T >= 1024 the
tables' tiles compute 1.05-1.48x the real rows (graph_vs_eager.py --padding: DeepSeek-V3 T=4096 1.40-1.48x, Mixtral
T=1024 1.16-1.20x, Qwen3 T=4096 1.12-1.16x), all of it on data. A layout whose experts start on tile boundaries, with
zero rows in the gaps, would feed the tensor cores zeros there at the same tile count and the same bytes.

Per row (preset:scheme:T:gemm), the shipped tile, one routing, three inputs of the same row blocks:
  packed   the rows as the layer hands them (_gemm_case.gemm_rows): padding rows are the next expert's
  aligned  each expert's rows moved to start on a BLOCK_M boundary, the gaps zero rows with routing weight 0
           (aligned_rows); the real rows' outputs are checked bit-equal with packed's before timing
  zeros    packed with every activation row zero: the most the effect can be
Each is timed two ways, by turns over ROUNDS rounds: short (autotune.graph_time_ms over REP_MS, as the tuner and
ws_bounds.py time) and sustained (power_clocks.sustained: a graph replayed back to back for RUN_S s after SETTLE_S s
idle, µs a call over the last second, with that second's SM clock and power from nvidia-smi).
Reading: aligned faster than packed, by about the padding share times zeros' gain, would make an aligned sorted layout
worth building. Building it: experts starting on the larger GEMM tile's boundary, each with its real count (blocks by
count, not by the next offset); the row copy writing the gaps' zero rows (DeepSeek-V3 bf16 T=4096: about 220 MB more,
some 55 us against a 7.7 ms layer); the gate_up storing its zero outputs there too, so the down's padding is zeros.

    PYTHONPATH=$PWD OUT=DIR [ROUNDS=2] [REP_MS=100] [SETTLE_S=1] [RUN_S=2] \
        python benchmarks/experiments/zero_padding.py [preset:scheme:T:gemm ...]
Writes OUT/zero_padding.json and OUT/smi.csv; prints a table last.
"""
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import as_bytes, gemm_rows, gemm_runner, preset_weights, same_bits  # noqa: E402
from power_clocks import smi_window, start_smi, sustained  # noqa: E402

from moeflow.kernels.common import RowLayout  # noqa: E402

ROWS = ["deepseek-v3:none:4096:gate_up", "deepseek-v3:none:4096:down", "deepseek-v3:fp8-block:4096:gate_up",
        "deepseek-v3:fp8-block:4096:down", "mixtral-8x7b:none:1024:gate_up", "mixtral-8x7b:fp8-block:1024:gate_up",
        "qwen3-30b-a3b:none:4096:gate_up", "qwen3-30b-a3b:fp8-block:4096:gate_up"]
FORMS = ("packed", "aligned", "zeros")
ROUNDS, REP_MS = int(os.environ.get("ROUNDS", 2)), float(os.environ.get("REP_MS", 100))
SETTLE_S, RUN_S = float(os.environ.get("SETTLE_S", 1)), float(os.environ.get("RUN_S", 2))  # power_clocks': 3 and 3


def aligned_rows(a, a_scale, layout: RowLayout, route_w, block_m: int):
    """A sorted layout's rows moved so each expert starts on a block_m boundary, the gaps zero rows.

    a: [R, K] rows (layer dtype or float8), a_scale: [R, K/128] float32 or None, layout: sorted (offsets [E + 1]),
    route_w: [R] float32 -> (a2 [R2, K], a_scale2 (gap rows 1.0) or None, RowLayout with the aligned offsets,
    route_w2 [R2] (gap rows 0), dest [N] int64: where each of the N = offsets[-1] real rows went). Expert e's row
    blocks cover the same rows of its tokens as in ``layout`` (so the same tiles, outputs bit-equal on real rows),
    and R2 = the rows of the row blocks."""
    off = layout.meta.to(torch.int64)
    counts = off[1:] - off[:-1]
    off2 = torch.zeros_like(off)
    off2[1:] = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0)
    n, r2 = int(off[-1]), int(off2[-1])
    rows = torch.arange(n, device=off.device)
    expert = torch.searchsorted(off[1:], rows, right=True)
    dest = off2[expert] + rows - off[expert]
    a2 = torch.zeros((r2, a.shape[1]), dtype=a.dtype, device=a.device)
    as_bytes(a2)[dest] = as_bytes(a[:n])
    s2 = None
    if a_scale is not None:
        s2 = torch.ones((r2, a_scale.shape[1]), dtype=a_scale.dtype, device=a.device)
        s2[dest] = a_scale[:n]
    w2 = torch.zeros(r2, dtype=route_w.dtype, device=route_w.device)
    w2[dest] = route_w[:n]
    return a2, s2, RowLayout(False, off2, layout.num_experts, 0, r2), w2, dest


def forms(ins, block_m: int) -> dict:
    """gemm_rows' first input (a, a_scale, layout, route_w) -> {form: the GEMM's input} and the real rows' places."""
    a, a_s, lay, rw = ins
    a2, s2, lay2, rw2, dest = aligned_rows(a, a_s, lay, rw, block_m)
    return {"packed": ins, "aligned": (a2, s2, lay2, rw2), "zeros": (torch.zeros_like(a), a_s, lay, rw)}, dest


def run_row(spec: str, weights: dict, dev) -> dict:
    from types import SimpleNamespace

    from moeflow.kernels.autotune import _layer_parts, graph_time_ms, random_batch
    from moeflow.kernels.warp_specialized import block_table_torch
    preset, scheme, t, gemm = spec.split(":")
    t = int(t)
    shape, w = preset_weights(preset, scheme, weights, dev)
    ins = gemm_rows(shape, t, gemm, dev)[0]
    kcfg = _layer_parts(shape)[1].kernel_config(random_batch(shape, t, dev, seed=t * 1000),
                                                SimpleNamespace(w13=w.w13, w2=w.w2))
    cfg = kcfg.down if gemm == "down" else kcfg.gate_up
    run = gemm_runner(gemm, w, scheme)
    inputs, dest = forms(ins, cfg.block_m)
    n = int(ins[2].meta[-1])
    packed, aligned = run(inputs["packed"], cfg), run(inputs["aligned"], cfg)
    torch.cuda.synchronize()
    at = lambda outs, idx: tuple(None if o is None else as_bytes(o)[idx] for o in outs)
    blocks = [int(block_table_torch(inputs[f][2], cfg.block_m)[1]) for f in ("packed", "aligned")]
    rec = dict(cfg=str(cfg), bit_equal=same_bits(at(aligned, dest), at(packed, slice(0, n)), slice(None)),
               rows=n, aligned_rows=int(inputs["aligned"][2].rows), row_blocks=blocks)
    for r in range(ROUNDS):
        for f in (FORMS if r % 2 == 0 else FORMS[::-1]):
            call = lambda d=inputs[f]: run(d, cfg)
            short = graph_time_ms([call], REP_MS) * 1e3
            rec.setdefault(f, []).append(dict(short_us=round(short, 1), **sustained(call, SETTLE_S, RUN_S)))
    return rec


def main():
    out_dir = os.environ.get("OUT", ".")
    os.makedirs(out_dir, exist_ok=True)
    smi_path = os.path.join(out_dir, "smi.csv")
    smi = start_smi(smi_path)
    res, weights, dev = {}, {}, torch.device("cuda")
    try:
        for spec in sys.argv[1:] or ROWS:
            res[spec] = run_row(spec, weights, dev)
            print(spec, {f: [round(x["last_us"], 1) for x in res[spec][f]] for f in FORMS}, flush=True)
    finally:
        smi.terminate()
        smi.wait()
    med = lambda v: statistics.median(v) if v else 0
    for rec in res.values():
        for x in (x for f in FORMS for x in rec[f]):
            x.update(smi_window(smi_path, x["last_second_from"], x["end"]))
    with open(os.path.join(out_dir, "zero_padding.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n{'row':36s} {'rows':>13s} {'bits':>5s} " + " ".join(f"{f + ' short/sust (MHz)':>27s}" for f in FORMS))
    for spec, rec in res.items():
        cells = [f"{med([x['short_us'] for x in rec[f]]):9.1f} {med([x['last_us'] for x in rec[f]]):9.1f} "
                 f"({med([x['sm_mhz'] or 0 for x in rec[f]]):4d})" for f in FORMS]
        print(f"{spec:36s} {rec['rows']:6d}/{rec['aligned_rows']:6d} {str(rec['bit_equal']):>5s} " + " ".join(
            f"{c:>27s}" for c in cells))


if __name__ == "__main__":
    main()
