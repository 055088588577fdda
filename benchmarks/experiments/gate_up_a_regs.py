"""Experiment (GPU): the Gluon fp8-block gate_up (kernels/gate_up_wgmma.py) with its x tile read into
registers once a K step (A_REGS: the 64-column wgmmas then read only their weight tiles from shared
memory) against the shipped form (each wgmma reads the x tile from shared memory), kernel alone, on each
preset's shape; every output compared bit for bit with the Triton kernel's.

    PYTHONPATH=$PWD python benchmarks/experiments/gate_up_a_regs.py [OUT_DIR] [preset:T ...]
"""
import json
import os
import sys
from dataclasses import replace

import torch

from moeflow.kernels import gate_up_wgmma
from moeflow.kernels.autotune import graph_time_ms
from moeflow.kernels.common import ACT_CODES
from moeflow.kernels.gate_up import gate_up

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import fp8_block_case  # noqa: E402

CASES = [("qwen3-30b-a3b", 1024), ("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384), ("mixtral-8x7b", 1024),
         ("mixtral-8x7b", 16384), ("deepseek-v3", 4096), ("deepseek-v3", 16384)]
VARIANTS = ((0, 3, 8), (0, 4, 8), (1, 3, 1), (1, 3, 2), (1, 4, 2), (2, 3, 8), (2, 4, 8), (2, 3, 4), (2, 4, 4))
# (x tile: 0 read by each wgmma from shared memory (shipped), 1 in registers for all four quarters, 2 quarters
# 1-3 from registers loaded once quarter 0 runs; stages; most steps a loop body); 128 rows, 8 warps


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", ".")
    cases = [(a.split(":")[0], int(a.split(":")[1])) for a in sys.argv[2:]] or CASES
    dev = torch.device("cuda")
    rows = []
    for preset, t in cases:
        _, batch, layout, kcfg, w, xq, xs = fp8_block_case(preset, t, dev)
        shipped = kcfg.gate_up
        triton_cfg = replace(shipped, block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3, split_k=1,
                             scale_overlap=0, warp_specialize=0)  # the Triton kernel at the variants' tile
        args = (xq, xs, w.w13, w.w13_scale, layout, "fp8-block", "silu", torch.bfloat16)
        ref, ref_s = gate_up(*args, triton_cfg)
        base = graph_time_ms([lambda: gate_up(*args, shipped)], 40) * 1e3
        res = dict(preset=preset, T=t, shipped_cfg=shipped.to_dict(), shipped_us=round(base, 1), variants={})
        line = f"{preset:14} T={t:<6} shipped {base:8.1f} us"
        for a_regs, stages, most in VARIANTS:
            cfg = replace(shipped, block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=stages, split_k=1,
                          scale_overlap=1)
            key = f"a{a_regs}s{stages}u{most}"
            inter = torch.full_like(ref, float("nan"))
            sc = torch.full_like(ref_s, float("nan"))
            run = lambda: gate_up_wgmma.launch(xq, xs, w.w13, w.w13_scale, layout, ACT_CODES["silu"], torch.bfloat16,
                                               cfg, inter, sc, most, a_regs)
            try:
                run()
                torch.cuda.synchronize()
                valid = layout.valid_rows()
                bits = bool((inter.view(torch.uint8)[valid] == ref.view(torch.uint8)[valid]).all()
                            and torch.equal(sc[valid], ref_s[valid]))
                us = graph_time_ms([run], 40) * 1e3
            except Exception as exc:  # a variant that does not compile or run: recorded, not fatal
                res["variants"][key] = dict(error=repr(exc)[:300])
                line += f" | {key} error"
                continue
            res["variants"][key] = dict(us=round(us, 1), bit_equal=bits)
            line += f" | {key} {us:7.1f} ({base / us:.2f}x{'' if bits else ' DIFF'})"
        print(line, flush=True)
        rows.append(res)
    json.dump(dict(device=torch.cuda.get_device_name(), rows=rows),
              open(os.path.join(out_dir, "gate_up_a_regs.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
