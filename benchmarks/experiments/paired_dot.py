"""Experiment (GPU): the fp8-block gate_up with gate and up in ONE dot per K step.

The shipped kernel (moeflow/kernels/gate_up.py) issues two dots per K step, gate and up, each
followed by a wait and the block-scale FMA (ptxas sm_90a SASS: QGMMA x4, WARPGROUP.DEPBAR, QGMMA x4,
DEPBAR per step). Here the weight tile comes through a 3-D TMA descriptor over gate_up_proj viewed
as [2E, I, H] (gate half 2e, up half 2e + 1) with a [2, BLOCK_N, BLOCK_K] box: one [BLOCK_K,
2 * BLOCK_N] operand, one dot, one wait, then the accumulator is split into gate and up.
BLOCK_N = 64 keeps the accumulator and the per-step partial sum in registers (a 2 * 64-wide dot per
warpgroup); the 1x128 group quantization then runs as its own kernel (kernels/quant.quantize_groups),
timed with it.
(Deferring each step's scaling to the next iteration, so that the next dot runs meanwhile, does not
survive compilation: ptxas sm_90a SASS still waits for every dot in its own iteration.)

    PYTHONPATH=$PWD python benchmarks/experiments/paired_dot.py --out $OUT/paired
Prints one line per (shape, variant, config) and writes the rows as JSON.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moeflow.kernels.autotune import Shape, random_batch, random_weights
from moeflow.kernels.common import RowLayout, block_rows, gated_act, tile_ids
from moeflow.kernels.configs import GemmConfig
from moeflow.kernels.gate_up import gate_up
from moeflow.kernels.quant import quantize_groups, quantize_rows


@triton.jit
def _gu_paired(x_ptr, xs_ptr, src_ptr, w3, ws_ptr, out_ptr, meta_ptr, num_experts, num_blocks_m, I, H,
               stride_x, stride_xs, stride_wse, stride_wsn, stride_out,
               E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP_M: tl.constexpr, INDEXED: tl.constexpr):
    pid_m, pid_n = tile_ids(num_blocks_m, I, BLOCK_N, GROUP_M)
    expert, row_start, row_end, _ = block_rows(pid_m, meta_ptr, num_experts, 1, BLOCK_M, E_POW2, False)
    if row_start >= row_end:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    rows_ld = tl.minimum(rows, row_end - 1)
    if INDEXED:
        x_rows = tl.load(src_ptr + rows_ld)
    else:
        x_rows = rows_ld
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + x_rows[:, None] * stride_x + rk[None, :]
    ws_e = ws_ptr + expert.to(tl.int64) * stride_wse
    g_b = (pid_n * BLOCK_N) // 128
    is_up = tl.arange(0, 2 * BLOCK_N) >= BLOCK_N
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(H, BLOCK_K)):
        a = tl.load(x_ptrs)
        b = w3.load([2 * expert, pid_n * BLOCK_N, kb * BLOCK_K])  # [2, BLOCK_N, BLOCK_K]
        b = tl.reshape(b, (2 * BLOCK_N, BLOCK_K)).T
        kg = (kb * BLOCK_K) // 128
        a_s = tl.load(xs_ptr + x_rows * stride_xs + kg)
        g_s = tl.load(ws_e + g_b * stride_wsn + kg)
        u_s = tl.load(ws_e + (g_b + I // 128) * stride_wsn + kg)
        w_s = tl.where(is_up, u_s, g_s)
        acc += tl.dot(a, b) * (a_s[:, None] * w_s[None, :])
        x_ptrs += BLOCK_K
    g, u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    h = gated_act(g, u, 0).to(out_ptr.dtype.element_ty)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], h, mask=row_ok[:, None] & (cols < I)[None, :])


def gate_up_paired(xq, xs, w13, w13_scale, layout: RowLayout, cfg: GemmConfig, source_rows=None):
    """-> (inter [R, I] fp8, scale [R, I/128]): the paired dot, then the separate group quantization."""
    e, two_i, h = w13.shape
    i = two_i // 2
    w3 = TensorDescriptor(w13, [2 * e, i, h], [i * h, h, 1], [2, cfg.block_n, cfg.block_k])
    inter = torch.empty(layout.rows, i, dtype=torch.bfloat16, device=xq.device)
    blocks_m = layout.num_row_blocks(cfg.block_m)
    grid = (blocks_m * triton.cdiv(i, cfg.block_n),)
    _gu_paired[grid](xq, xs, source_rows if source_rows is not None else layout.meta, w3, w13_scale, inter,
                     layout.meta, layout.num_experts, blocks_m, i, h, xq.stride(0), xs.stride(0),
                     w13_scale.stride(0), w13_scale.stride(1), inter.stride(0),
                     E_POW2=layout.e_pow2, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                     GROUP_M=cfg.group_m, INDEXED=source_rows is not None,
                     num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return quantize_groups(inter)


SHIPPED = [GemmConfig(64, 128, 128, 8, 8, 4), GemmConfig(128, 128, 128, 8, 8, 3), GemmConfig(64, 64, 128, 8, 4, 4),
           GemmConfig(64, 64, 128, 8, 4, 3), GemmConfig(128, 64, 128, 8, 8, 4)]
PAIRED = [GemmConfig(128, 64, 128, 8, 8, 4), GemmConfig(128, 64, 128, 8, 8, 3), GemmConfig(64, 64, 128, 8, 4, 4),
          GemmConfig(64, 64, 128, 8, 4, 3), GemmConfig(64, 64, 128, 8, 4, 2)]


def main() -> None:
    from triton.testing import do_bench
    from moeflow.kernels.configs import fit
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="paired")
    ap.add_argument("--cases", default="deepseek-v3:16384,deepseek-v3:4096,qwen3-30b-a3b:16384,qwen3-30b-a3b:4096,mixtral-8x7b:4096")
    args = ap.parse_args()
    from moeflow.presets import preset_config
    dev = torch.device("cuda")
    rows = []
    for case in args.cases.split(","):
        name, t = case.split(":")
        t = int(t)
        c = preset_config(name)
        shape = Shape(c.num_experts, c.hidden_size, c.intermediate_size, c.top_k, "fp8-block")
        w = random_weights(shape, dev)
        batch = random_batch(shape, t, dev, seed=t)
        layout = RowLayout.of(batch)
        # rows by index, as the layer's local dispatcher hands them: S = T token rows, R = T*K copies
        x = torch.randn(t, c.hidden_size, device=dev).to(torch.bfloat16)
        src = torch.randint(0, t, (layout.rows,), device=dev)
        xq, xs = quantize_rows(x, "fp8-block", None)
        flops = 2 * layout.rows * c.hidden_size * 2 * c.intermediate_size
        ref = None
        for variant, cfgs in (("shipped", SHIPPED), ("paired", PAIRED)):
            for cfg in cfgs:
                if variant == "shipped":
                    cfg = fit(cfg, fused_pair=True, scheme="fp8-block", elem_bytes=1, n_size=c.intermediate_size)

                    def run(cfg=cfg):
                        inter, extra = gate_up(xq, xs, w.w13, w.w13_scale, layout, "fp8-block", "silu",
                                               torch.bfloat16, cfg, source_rows=src)
                        return quantize_groups(inter) if extra is None else (inter, extra)
                else:
                    def run(cfg=cfg):
                        return gate_up_paired(xq, xs, w.w13, w.w13_scale, layout, cfg, source_rows=src)
                try:
                    q, s = run()
                    val = q.float() * s.repeat_interleave(128, dim=1)[:, :q.shape[1]]
                    if ref is None:
                        ref = val
                    err = ((val - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
                    us = do_bench(run, warmup=5, rep=40, return_mode="median") * 1e3
                    row = dict(case=case, variant=variant, config=str(cfg), us=round(us, 1),
                               tflops=round(flops / us / 1e6, 1), rel_err_vs_first=err)
                except Exception as exc:  # noqa: BLE001 - an experiment records the failure and goes on
                    row = dict(case=case, variant=variant, config=str(cfg), error=repr(exc)[:300])
                rows.append(row)
                print(row, flush=True)
        del w
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paired_dot.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{'case':22} {'variant':8} {'config':40} {'us':>9} {'TFLOP/s':>8}")
    for r in rows:
        print(f"{r['case']:22} {r['variant']:8} {r['config'][:40]:40} {r.get('us', 'fail'):>9} {r.get('tflops', ''):>8}")


if __name__ == "__main__":
    main()
