"""Experiment (GPU): the Gluon fp8-block gate_up (kernels/gate_up_wgmma.py) with each K step's scales loaded
one step ahead (PREFETCH), against loading them in the step that uses them, kernel alone, each preset's shape
at its shipped config; the two alternate A B A B (the GPU's clock drifts under its power cap over a run).
ncu's source view of the shipped kernel (Qwen3 T=4096) put 5.5% of all warp stall samples on the multiply
of the loaded scales, waiting on the loads (long scoreboard). Outputs compared bit for bit.

    PYTHONPATH=$PWD python benchmarks/experiments/gate_up_scale_prefetch.py [OUT_DIR] [preset:T ...]
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
                                                      torch.bfloat16, cfg, *outs[p], prefetch=p)) for p in (False, True)}
        for p in (False, True):
            runs[p]()
        torch.cuda.synchronize()
        valid = layout.valid_rows()
        bits = bool(torch.equal(outs[False][0].view(torch.uint8)[valid], outs[True][0].view(torch.uint8)[valid])
                    and torch.equal(outs[False][1][valid], outs[True][1][valid]))
        times = {False: [], True: []}
        for _ in range(2):
            for p in (False, True):
                times[p].append(graph_time_ms([runs[p]], 40) * 1e3)
        a, b = sum(times[False]) / 2, sum(times[True]) / 2
        rows.append(dict(preset=preset, T=t, cfg=cfg.to_dict(), load_in_step_us=times[False], prefetch_us=times[True],
                         speedup=round(a / b, 4), bit_equal=bits))
        print(f"{preset:14} T={t:<6} in-step {times[False][0]:8.1f} {times[False][1]:8.1f} | prefetch "
              f"{times[True][0]:8.1f} {times[True][1]:8.1f} | {a / b:.3f}x {'bit-equal' if bits else 'DIFF'}", flush=True)
    json.dump(dict(device=torch.cuda.get_device_name(), rows=rows),
              open(os.path.join(out_dir, "gate_up_scale_prefetch.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
