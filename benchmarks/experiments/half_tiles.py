"""Experiment (GPU): half tiles in the bf16 warp-specialized GEMMs (kernels/warp_specialized.py, HALF): a row block of
at most 64 rows (an expert's part-filled last one) loads 64 rows and runs its wgmmas over them only. The kernel
alone, with MOEFLOW_TRITON_HALF_TILES on and off by turns (ROUNDS rounds, the order swapped every round), each from a CUDA graph, at the shipped
table's tiles of each case where they are warp-specialized; the outputs compared bit for bit.

    PYTHONPATH=$PWD ROUNDS=3 python benchmarks/experiments/half_tiles.py OUT_DIR [preset:T[:N] ...]

preset:T:N: T's tiles with every expert given exactly N rows (N <= 64: every block a half tile).

Writes half_tiles.json under OUT_DIR; prints a table last.
"""
import json
import os
import statistics
import sys

import torch

from moeflow.kernels.autotune import graph_time_ms, random_weights
from moeflow.kernels.common import ACT_CODES, RowLayout
from moeflow.layouts import offsets_from_counts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import gemm_case  # noqa: E402

CASES = [("qwen3-30b-a3b", 1024), ("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384), ("mixtral-8x7b", 1024),
         ("mixtral-8x7b", 16384), ("deepseek-v3", 4096)]
ROUNDS = int(os.environ.get("ROUNDS", "3"))


def half_blocks(layout, block_m: int) -> tuple[int, int]:
    """-> (row blocks of at most block_m / 2 rows, all row blocks) of a sorted layout."""
    off = layout.meta.to(torch.int64)
    counts = off[1:] - off[:-1]
    blocks = (counts + block_m - 1) // block_m
    last = counts - (blocks - 1).clamp(min=0) * block_m
    return int(((counts > 0) & (last <= block_m // 2)).sum()), int(blocks.sum())


def main():
    from moeflow.kernels import warp_specialized as ws
    out_dir = sys.argv[1]
    cases = [tuple(int(v) if j else v for j, v in enumerate(c.split(":"))) for c in sys.argv[2:]] or CASES
    dev = torch.device("cuda")
    results = []
    for preset, t, *uniform in cases:
        shape, batch, layout, kcfg = gemm_case(preset, "none", t, dev)
        if uniform:  # preset:T:N: T's tiles, every expert given exactly N rows instead of T's routing
            e = shape.num_experts
            layout = RowLayout(False, offsets_from_counts(torch.full((e,), uniform[0], dtype=torch.int32,
                                                                     device=dev)), e, 0, e * uniform[0])
        w = random_weights(shape, dev)
        r, h, i = layout.rows, shape.hidden, shape.inter
        x = torch.randn(r, h, device=dev, dtype=torch.bfloat16)
        a = torch.randn(r, i, device=dev, dtype=torch.bfloat16)
        rw = torch.rand(r, device=dev)
        stages = {"gate_up": (kcfg.gate_up, lambda cfg, out: ws.launch(x, w.w13, None, layout, cfg, out, gated=True,
                                                                       act=ACT_CODES["silu"]), i),
                  "down": (kcfg.down, lambda cfg, out: ws.launch(a, w.w2, rw, layout, cfg, out), h)}
        for stage, (cfg, run, n) in stages.items():
            row = dict(preset=preset, T=t, uniform_rows=uniform[0] if uniform else None, stage=stage, cfg=str(cfg))
            if not cfg.warp_specialize or cfg.block_m != 128:
                continue
            row["half_blocks"], row["blocks"] = half_blocks(layout, 128)
            outs = {}
            for half in ("1", "0"):
                os.environ["MOEFLOW_TRITON_HALF_TILES"] = half
                outs[half] = torch.full((r, n), float("nan"), device=dev, dtype=torch.bfloat16)
                run(cfg, outs[half])
            torch.cuda.synchronize()
            row["bit_equal"] = bool(torch.equal(outs["1"], outs["0"]))
            for rnd in range(ROUNDS):  # on, off, off, on, on, off, ...: neither always runs first
                for half in (("1", "0") if rnd % 2 == 0 else ("0", "1")):
                    os.environ["MOEFLOW_TRITON_HALF_TILES"] = half
                    o = outs[half]
                    row.setdefault("us_half" + half, []).append(round(graph_time_ms([lambda: run(cfg, o)], 40) * 1e3,
                                                                      1))
            os.environ["MOEFLOW_TRITON_HALF_TILES"] = "1"
            row["median_half1"] = statistics.median(row["us_half1"])
            row["median_half0"] = statistics.median(row["us_half0"])
            results.append(row)
            print(row, flush=True)
        del batch, w, x, a
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "half_tiles.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("| preset | T | stage | half / all blocks | off µs | on µs | off/on | bit-equal |")
    for row in results:
        print(f"| {row['preset']} | {row['T']}{'' if row['uniform_rows'] is None else ' (%d a expert)' % row['uniform_rows']} | {row['stage']} | {row['half_blocks']}/{row['blocks']} | "
              f"{row['median_half0']} | {row['median_half1']} | {row['median_half0'] / row['median_half1']:.3f} | "
              f"{row['bit_equal']} |")


if __name__ == "__main__":
    main()
