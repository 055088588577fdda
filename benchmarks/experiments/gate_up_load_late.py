"""Experiment (GPU): the Gluon fp8-block gate_up (kernels/gate_up_wgmma.py) refilling a freed slot after the
step's second wgmma is issued (LOAD_LATE: two run meanwhile) instead of before it (one runs meanwhile), kernel alone,
each preset's shape at its shipped config, alternating A B four times (the GPU's clock drifts under its power cap).
The refill costs five CTA barriers (the compiler's, around the mbarrier expect and the three TMA copies;
ncu_gate_up_2026-12-01_h200_1d0a473.md). Outputs compared bit for bit.

    PYTHONPATH=$PWD python benchmarks/experiments/gate_up_load_late.py [OUT_DIR] [preset:T ...]
"""
import json
import os
import sys

import torch

from moeflow.kernels import gate_up_wgmma
from moeflow.kernels.autotune import graph_time_ms
from moeflow.kernels.common import ACT_CODES

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import fp8_block_case  # noqa: E402

CASES = [("qwen3-30b-a3b", 2048), ("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384), ("mixtral-8x7b", 1024),
         ("mixtral-8x7b", 16384), ("deepseek-v3", 4096), ("deepseek-v3", 16384)]
ROUNDS = 4


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", ".")
    cases = [(a.split(":")[0], int(a.split(":")[1])) for a in sys.argv[2:]] or CASES
    dev = torch.device("cuda")
    rows = []
    for preset, t in cases:
        _, batch, layout, kcfg, w, xq, xs = fp8_block_case(preset, t, dev)
        cfg = kcfg.gate_up
        assert gate_up_wgmma.usable(xq, xs, w.w13, w.w13_scale, layout, "fp8-block", cfg), cfg
        r, i = xq.shape[0], w.w13.shape[1] // 2
        outs = {p: (torch.full((r, i), float("nan"), device=dev).to(torch.float8_e4m3fn),
                    torch.full((r, i // 128), float("nan"), device=dev)) for p in (False, True)}
        runs = {p: (lambda p=p: gate_up_wgmma.launch(xq, xs, w.w13, w.w13_scale, layout, ACT_CODES["silu"],
                                                      torch.bfloat16, cfg, *outs[p], load_late=p)) for p in (False, True)}
        for p in (False, True):
            runs[p]()
        torch.cuda.synchronize()
        valid = layout.valid_rows()
        bits = bool(torch.equal(outs[False][0].view(torch.uint8)[valid], outs[True][0].view(torch.uint8)[valid])
                    and torch.equal(outs[False][1][valid], outs[True][1][valid]))
        times = {False: [], True: []}
        for _ in range(ROUNDS):
            for p in (False, True):
                times[p].append(graph_time_ms([runs[p]], 40) * 1e3)
        a, b = sum(times[False]) / ROUNDS, sum(times[True]) / ROUNDS
        rows.append(dict(preset=preset, T=t, cfg=cfg.to_dict(), load_early_us=times[False], load_late_us=times[True],
                         speedup=round(a / b, 4), bit_equal=bits))
        print(f"{preset:14} T={t:<6} early " + " ".join(f"{v:8.1f}" for v in times[False]) + " | late "
              + " ".join(f"{v:8.1f}" for v in times[True]) + f" | {a / b:.3f}x {'bit-equal' if bits else 'DIFF'}",
              flush=True)
    json.dump(dict(device=torch.cuda.get_device_name(), rows=rows),
              open(os.path.join(out_dir, "gate_up_load_late.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
