"""Experiment (GPU): a persistent down GEMM against the shipped one.

The shipped down kernel (moeflow/kernels/down.py) runs one program per output tile. Qwen3's down
GEMM has K = I = 768 (12 steps of 64) and DeepSeek-V3's K = 2048, so each tile spends a large
share of its time filling the pipeline and in its epilogue. Here a fixed number of programs loop
over the tiles (`tl.range(..., flatten=True)` lets Triton's pipeliner run across tile boundaries),
and the loop bound is the real number of row blocks, computed in the kernel from the offsets (the
shipped grid covers an upper bound of them; its extra programs return at once).
Sorted layout, rows materialized, both operands through TMA descriptors, bf16 and fp8-block.

    PYTHONPATH=$PWD python benchmarks/experiments/persistent_down.py --out $OUT/pdown
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
from moeflow.kernels.common import RowLayout
from moeflow.kernels.configs import GemmConfig
from moeflow.kernels.down import down
from moeflow.kernels.quant import quantize_groups


@triton.jit
def _down_persistent(a_desc, as_ptr, w_desc, ws_ptr, rw_ptr, out_ptr, meta_ptr, num_experts, H, I,
                     stride_as, stride_wse, stride_wsn, stride_out,
                     FP8_BLOCK: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGS: tl.constexpr, FLATTEN: tl.constexpr):
    idx = tl.arange(0, E_POW2)
    lo = tl.load(meta_ptr + idx, mask=idx < num_experts, other=0).to(tl.int32)
    hi = tl.load(meta_ptr + idx + 1, mask=idx < num_experts, other=0).to(tl.int32)
    nb = (hi - lo + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(nb, 0)
    blocks_m = tl.sum(nb, 0)
    num_pid_n = tl.cdiv(H, BLOCK_N)
    num_tiles = blocks_m * num_pid_n
    k_tiles = tl.cdiv(I, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGS, flatten=FLATTEN):
        per_group = GROUP_M * num_pid_n
        first_m = (tile // per_group) * GROUP_M
        group_size = tl.minimum(blocks_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % group_size
        pid_n = (tile % per_group) // group_size
        expert = tl.sum((cum <= pid_m).to(tl.int32), 0)
        mine = idx == expert
        first_block = tl.sum(tl.where(mine, cum - nb, 0), 0)
        row_start = tl.sum(tl.where(mine, lo, 0), 0) + (pid_m - first_block) * BLOCK_M
        row_end = tl.sum(tl.where(mine, hi, 0), 0)
        rows = row_start + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        rows_ld = tl.minimum(rows, row_end - 1).to(tl.int64)
        w_row = (expert * H + pid_n * BLOCK_N).to(tl.int32)
        ws_e = ws_ptr + expert.to(tl.int64) * stride_wse
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(k_tiles):
            a = a_desc.load([row_start, kb * BLOCK_K])
            b = w_desc.load([w_row, kb * BLOCK_K]).T
            if FP8_BLOCK:
                a_s = tl.load(as_ptr + rows_ld * stride_as + kb)
                s = a_s * tl.load(ws_e + tl.minimum((pid_n * BLOCK_N) // 128, (H - 1) // 128) * stride_wsn + kb)
                acc += tl.dot(a, b) * s[:, None]
            else:
                acc = tl.dot(a, b, acc)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        route_w = tl.load(rw_ptr + rows_ld)
        y = (acc * route_w[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], y, mask=row_ok[:, None] & (cols < H)[None, :])


def down_persistent(a, a_scale, w2, w2_scale, route_w, layout: RowLayout, cfg: GemmConfig, progs: int, flatten: bool):
    r, i = a.shape
    e, h, _ = w2.shape
    out = torch.empty((r, h), dtype=torch.bfloat16, device=a.device)
    a_desc = TensorDescriptor(a, [r, i], [a.stride(0), 1], [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor(w2, [e * h, i], [w2.stride(1), 1], [cfg.block_n, cfg.block_k])
    fp8 = a_scale is not None
    ws = w2_scale if fp8 else route_w
    a_s = a_scale if fp8 else route_w
    _down_persistent[(progs,)](a_desc, a_s, w_desc, ws, route_w, out, layout.meta, layout.num_experts, h, i,
                               a_s.stride(0) if fp8 else 0, ws.stride(0) if fp8 else 0, ws.stride(1) if fp8 else 0,
                               out.stride(0), FP8_BLOCK=fp8, E_POW2=layout.e_pow2, BLOCK_M=cfg.block_m,
                               BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, NUM_PROGS=progs,
                               FLATTEN=flatten, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def main() -> None:
    from triton.testing import do_bench

    from moeflow.experts.triton import TritonRunner
    from moeflow.config import MoEConfig
    from moeflow.presets import preset_config
    from moeflow.quant import create_scheme
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="pdown")
    ap.add_argument("--cases", default="qwen3-30b-a3b:none:4096,qwen3-30b-a3b:fp8-block:4096,qwen3-30b-a3b:none:16384,"
                                       "deepseek-v3:none:4096,deepseek-v3:fp8-block:16384,deepseek-v3:none:16384")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for case in args.cases.split(","):
        name, scheme, t = case.split(":")
        t = int(t)
        c = preset_config(name)
        shape = Shape(c.num_experts, c.hidden_size, c.intermediate_size, c.top_k, scheme)
        w = random_weights(shape, dev)
        batch = random_batch(shape, t, dev, seed=t)
        layout = RowLayout.of(batch)
        inter = (torch.randn(layout.rows, c.intermediate_size, device=dev) * 0.5).to(torch.bfloat16)
        a, a_s = quantize_groups(inter) if scheme == "fp8-block" else (inter, None)
        rw = batch.weights.float().contiguous()
        runner = TritonRunner(MoEConfig(num_experts=c.num_experts, hidden_size=c.hidden_size,
                                        intermediate_size=c.intermediate_size, top_k=c.top_k, quant=scheme,
                                        dtype=torch.bfloat16), create_scheme(scheme))
        shipped = runner.kernel_config(batch, w).down
        flops = 2 * layout.rows * c.hidden_size * c.intermediate_size
        ref = down(a, a_s, w.w2, w.w2_scale, rw, layout, scheme, torch.bfloat16, shipped)
        variants = [("shipped", shipped, None, None)]
        cfgs = ([GemmConfig(128, 128, 64, 8, 8, 3), GemmConfig(128, 128, 64, 8, 8, 4), GemmConfig(64, 128, 64, 8, 4, 4)]
                if scheme == "none" else [GemmConfig(64, 128, 128, 8, 4, 4), GemmConfig(128, 128, 128, 8, 8, 3)])
        for cfg in cfgs:
            for mult in (1, 2):
                for flatten in (True, False):
                    variants.append(("persistent", cfg, sms * mult, flatten))
        for kind, cfg, progs, flatten in variants:
            if kind == "shipped":
                run = lambda: down(a, a_s, w.w2, w.w2_scale, rw, layout, scheme, torch.bfloat16, shipped)
            else:
                run = lambda cfg=cfg, progs=progs, flatten=flatten: down_persistent(a, a_s, w.w2, w.w2_scale, rw, layout,
                                                                                     cfg, progs, flatten)
            try:
                got = run()
                err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                us = do_bench(run, warmup=5, rep=40, return_mode="median") * 1e3
                row = dict(case=case, kind=kind, config=str(cfg), progs=progs, flatten=flatten, us=round(us, 1),
                           tflops=round(flops / us / 1e6, 1), max_rel_diff=err)
            except Exception as exc:  # noqa: BLE001 - an experiment records the failure and goes on
                row = dict(case=case, kind=kind, config=str(cfg), progs=progs, flatten=flatten, error=repr(exc)[:300])
            rows.append(row)
            print(row, flush=True)
        del w
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "persistent_down.json").write_text(json.dumps(rows, indent=1) + "\n")
    for r in rows:
        cfg = r["config"].replace("GemmConfig(", "").replace("block_", "")[:60]
        print(f"{r['case']:32} {r['kind']:10} {cfg:60} {r['progs']!s:>5} {r['flatten']!s:>5} "
              f"{r.get('us', 'fail'):>9} {r.get('tflops', ''):>7} {r.get('max_rel_diff', r.get('error', ''))}")


if __name__ == "__main__":
    main()
