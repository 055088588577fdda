"""Experiment (GPU): the Gluon fp8-block gate_up (kernels/gate_up_wgmma.py) as 64-row tiles of 4 warps at 2
stages, small enough (80 KB of shared memory, 255 registers x 128 threads) for two programs an SM, so that one
program's epilogue and pipeline fill overlap the other's K loop, against the shipped configs (128 rows, 8
warps, 3 stages: one program an SM), kernel alone, each preset's shape; every output compared bit for bit with
the Triton kernel's at the same tile. Loop bodies (UNROLL) are set here directly, also the even ones that
down_wgmma.unroll() refuses at 2 stages (ptxas spills 56-160 bytes there).

    PYTHONPATH=$PWD python benchmarks/experiments/gate_up_two_ctas.py [OUT_DIR] [preset:T ...]
"""
import json
import os
import sys
from dataclasses import replace

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from moeflow.kernels import gate_up_wgmma
from moeflow.kernels.autotune import graph_time_ms
from moeflow.kernels.common import ACT_CODES, expert_rows
from moeflow.kernels.gate_up import gate_up

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import fp8_block_case, time_variant  # noqa: E402

CASES = [("qwen3-30b-a3b", 1024), ("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384), ("mixtral-8x7b", 1024),
         ("mixtral-8x7b", 16384), ("deepseek-v3", 4096), ("deepseek-v3", 16384)]
VARIANTS = ((128, 8, 3, 0), (64, 4, 2, 1), (64, 4, 2, 2), (64, 4, 2, 4), (64, 4, 3, 1), (64, 4, 2, 0))
# (rows, warps, stages, steps a loop body; 0: down_wgmma.unroll()'s pick)


def launch(x, xs, w13, w13s, layout, cfg, inter, scale, unroll_steps):
    """gate_up_wgmma.launch with the loop body given."""
    from moeflow.kernels.down_wgmma import unroll
    r, h = x.shape
    e, two_i, _ = w13.shape
    bm = cfg.block_m
    x_desc = TensorDescriptor(x, [r, h], [x.stride(0), 1], [bm, 128],
                              gl.NVMMASharedLayout.get_default_for([bm, 128], gl.float8e4nv))
    per_expert = 2 if expert_rows(w13) else 0
    w_desc = gate_up_wgmma._weight_planes(w13, e * per_expert or 2, two_i // 2, h, 128)
    blocks_m = layout.num_row_blocks(bm)
    return gate_up_wgmma._gate_up_wgmma_kernel[(blocks_m * (two_i // 256),)](
        x_desc, w_desc, x_desc, w_desc, xs, w13s, inter, scale, layout.meta, layout.num_experts, blocks_m, two_i // 2, h,
        per_expert,
        xs.stride(0), w13s.stride(0), w13s.stride(1), inter.stride(0), scale.stride(0),
        ACT=ACT_CODES["silu"], INTER_DTYPE=gl.bfloat16, E_POW2=layout.e_pow2, BLOCK_M=bm, GROUP_M=cfg.group_m,
        STAGES=cfg.num_stages, UNROLL=unroll_steps or unroll(h // 128, 8, cfg.num_stages), PAIRS=False,
        num_warps=cfg.num_warps)


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", ".")
    cases = [(a.split(":")[0], int(a.split(":")[1])) for a in sys.argv[2:]] or CASES
    dev = torch.device("cuda")
    rows = []
    for preset, t in cases:
        _, batch, layout, kcfg, w, xq, xs = fp8_block_case(preset, t, dev)
        shipped = kcfg.gate_up
        args = (xq, xs, w.w13, w.w13_scale, layout, "fp8-block", "silu", torch.bfloat16)
        base = graph_time_ms([lambda: gate_up(*args, shipped)], 40) * 1e3
        res = dict(preset=preset, T=t, shipped_cfg=shipped.to_dict(), shipped_us=round(base, 1), variants={})
        line = f"{preset:14} T={t:<6} shipped {base:8.1f} us"
        for bm, warps, stages, u in VARIANTS:
            cfg = replace(shipped, block_m=bm, block_n=128, block_k=128, num_warps=warps, num_stages=stages, split_k=1,
                          scale_overlap=1, warp_specialize=0)
            ref, ref_s = gate_up(*args, replace(cfg, scale_overlap=0))  # the Triton kernel, same tile
            key = f"{bm}w{warps}s{stages}u{u}"
            inter = torch.full_like(ref, float("nan"))
            sc = torch.full_like(ref_s, float("nan"))
            run = lambda: launch(xq, xs, w.w13, w.w13_scale, layout, cfg, inter, sc, u)
            rec, k = time_variant(run, layout, (inter, sc), (ref, ref_s))
            if k is not None:
                rec.update(regs=k.n_regs, shared=k.metadata.shared)
            res["variants"][key] = rec
            line += (f" | {key} {k.n_regs}r/{k.metadata.shared // 1024}KB {rec['us']:7.1f} "
                     f"({base / rec['us']:.2f}x{'' if rec['bit_equal'] else ' DIFF'})" if "us" in rec
                     else f" | {key} error")
        print(line, flush=True)
        rows.append(res)
    json.dump(dict(device=torch.cuda.get_device_name(), rows=rows),
              open(os.path.join(out_dir, "gate_up_two_ctas.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
