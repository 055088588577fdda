"""Experiment: the fp8-block down GEMM written in Gluon (Triton's lower-level language, triton 3.6),
so that the per-K-step scaling overlaps the next step's wgmma.

Triton compiles `acc += tl.dot(a, b) * s[:, None]` to a wgmma followed by wgmma.wait_group 0: the
tensor cores idle while every step's product is scaled (benchmarks/results/scale_cost_*: the same
tile run as fp8-channel, one accumulator, is 1.0-1.26x faster). Here each step issues its wgmma
asynchronously into a fresh product, then waits with one group outstanding (wait_group 1) for
the previous step's product and scales that one while the tensor cores run the new one.

    python benchmarks/experiments/gluon_down.py --compile        (no GPU: PTX for sm_90a, waits, registers)
    PYTHONPATH=$PWD python benchmarks/experiments/gluon_down.py --out DIR   (GPU: against kernels/down.py)
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _expert_block(pid_m, meta_ptr, num_experts, BLOCK_M: gl.constexpr, E_POW2: gl.constexpr,
                  num_warps: gl.constexpr):
    """common.block_rows for the sorted layout: block pid_m -> (expert, row_start, row_end)."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    idx = gl.arange(0, E_POW2, layout=lay)
    lo = gl.load(meta_ptr + idx, mask=idx < num_experts, other=0)
    hi = gl.load(meta_ptr + idx + 1, mask=idx < num_experts, other=0)
    nb = (hi - lo + BLOCK_M - 1) // BLOCK_M
    cum = gl.associative_scan(nb, 0, _add)
    expert = gl.sum((cum <= pid_m).to(gl.int32), 0)
    mine = idx == expert
    first_block = gl.sum(gl.where(mine, cum - nb, 0), 0)
    row_end = gl.sum(gl.where(mine, hi, 0), 0)
    row_start = gl.sum(gl.where(mine, lo, 0), 0) + (pid_m - first_block) * BLOCK_M
    row_start = gl.where(expert < num_experts, row_start, row_end)
    return expert, row_start, row_end


@gluon.jit
def _issue(a_desc, w_desc, a_bufs, b_bufs, bars, step, a_row, w_row, STAGES: gl.constexpr, BLOCK_K: gl.constexpr,
           pred):
    slot = step % STAGES
    bar = bars.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [a_row, step * BLOCK_K], bar, a_bufs.index(slot), pred=pred)
    tma.async_copy_global_to_shared(w_desc, [w_row, step * BLOCK_K], bar, b_bufs.index(slot), pred=pred)


@gluon.jit
def _step(a_bufs, b_bufs, bars, t, d, STAGES: gl.constexpr):
    """Wait for step t's tiles, start its wgmma into d's registers (d's values unused) -> the running product."""
    slot = t % STAGES
    mbarrier.wait(bars.index(slot), (t // STAGES) & 1)
    return warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), d, use_acc=False, is_async=True)


@gluon.jit
def _fma(d, s, acc):
    """acc + d * s[:, None] as an inline asm with side effects, so it stays where it is written: the
    compiler otherwise sinks it past the next wgmma, which then needs a copy of d's registers."""
    return gl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=r,r,r,r",
                                     [d, gl.broadcast(s[:, None], d)[0], acc], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _down_fp8_block_wgmma(a_desc, w_desc, as_ptr, ws_ptr, rw_ptr, out_ptr, meta_ptr,
                          num_experts, num_blocks_m, H, I, stride_as, stride_wse, stride_wsn, stride_out,
                          E_POW2: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                          UNROLL: gl.constexpr, num_warps: gl.constexpr):
    pid = gl.program_id(0)
    num_pid_n = gl.cdiv(H, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = gl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    expert, row_start, row_end = _expert_block(pid_m, meta_ptr, num_experts, BLOCK_M, E_POW2, num_warps)
    if row_start < row_end:
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BLOCK_N, 32])
        rows_l: gl.constexpr = gl.SliceLayout(1, mma)
        cols_l: gl.constexpr = gl.SliceLayout(0, mma)
        a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        a_row = row_start.to(gl.int32)
        w_row = (expert * H + pid_n * BLOCK_N).to(gl.int32)
        n = gl.cdiv(I, BLOCK_K)
        for s in gl.static_range(STAGES):
            _issue(a_desc, w_desc, a_bufs, b_bufs, bars, s, a_row, w_row, STAGES, BLOCK_K, s < n)
        rows = row_start + gl.arange(0, BLOCK_M, layout=rows_l)
        rows_ld = gl.minimum(rows, row_end - 1)
        as_rows = as_ptr + rows_ld * stride_as
        ws_e = ws_ptr + expert.to(gl.int64) * stride_wse + gl.minimum(pid_n * BLOCK_N // 128, (H - 1) // 128) * stride_wsn
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
        # UNROLL steps per loop body, two products by turns: while the tensor cores run step t + 1, step t's
        # product is scaled into acc. Each wgmma takes the finished product of its turn as its (ignored:
        # use_acc=False) accumulator, so it writes those registers, and _fma pins the scaling before it.
        # Each body ends with nothing in flight: a product still running across the loop's back edge makes
        # ptxas serialize every wgmma (C7514). The host picks UNROLL dividing n.
        d_a = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
        d_b = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
        for j in range(0, n // UNROLL):
            t = j * UNROLL
            p_a = _step(a_bufs, b_bufs, bars, t, d_a, STAGES)
            s_a = gl.load(as_rows + t) * gl.load(ws_e + t)
            for u in gl.static_range(1, UNROLL):
                p_b = _step(a_bufs, b_bufs, bars, t + u, d_b, STAGES)
                s_b = gl.load(as_rows + t + u) * gl.load(ws_e + t + u)
                d_a = warpgroup_mma_wait(num_outstanding=1, deps=(p_a,))
                acc = _fma(d_a, s_a, acc)
                _issue(a_desc, w_desc, a_bufs, b_bufs, bars, t + u - 1 + STAGES, a_row, w_row, STAGES, BLOCK_K,
                       t + u - 1 + STAGES < n)  # into the slot step t + u - 1 has finished with
                p_a, s_a, d_a, p_b, s_b, d_b = p_b, s_b, d_b, p_a, s_a, d_a
            d_a = warpgroup_mma_wait(num_outstanding=0, deps=(p_a,))
            acc = _fma(d_a, s_a, acc)
            _issue(a_desc, w_desc, a_bufs, b_bufs, bars, t + UNROLL - 1 + STAGES, a_row, w_row, STAGES, BLOCK_K,
                   t + UNROLL - 1 + STAGES < n)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols_l)
        y = acc * gl.load(rw_ptr + rows_ld)[:, None]
        ptrs = out_ptr + rows[:, None] * stride_out + cols[None, :]
        gl.store(ptrs, y.to(out_ptr.dtype.element_ty), mask=(rows < row_end)[:, None] & (cols < H)[None, :])


def _unroll(n: int) -> int:
    """Steps per loop body: the largest of 8 .. 1 that divides the n K steps."""
    return next(u for u in range(8, 0, -1) if n % u == 0)


def down_wgmma(a, a_scale, w2, w2_scale, route_w, layout, dtype, cfg):
    """kernels/down.down for fp8-block on a sorted batch: a [R, I] fp8 + a_scale [R, I/128], w2 [E, H, I] fp8 +
    w2_scale [E, H/128, I/128], route_w [R] float32 -> [R, H] dtype. cfg: GemmConfig (block_k 128, block_n <= 128)."""
    r, i = a.shape
    e, h, _ = w2.shape
    out = torch.empty((r, h), dtype=dtype, device=a.device)
    if r == 0:
        return out
    bm, bn, bk = cfg.block_m, min(cfg.block_n, 128), 128
    a_desc = TensorDescriptor(a, [r, i], [a.stride(0), 1], [bm, bk],
                              gl.NVMMASharedLayout.get_default_for([bm, bk], gl.float8e4nv))
    w_desc = TensorDescriptor(w2, [e * h, i], [w2.stride(1), 1], [bn, bk],
                              gl.NVMMASharedLayout.get_default_for([bn, bk], gl.float8e4nv))
    blocks_m = layout.num_row_blocks(bm)
    grid = (blocks_m * triton.cdiv(h, bn),)
    _down_fp8_block_wgmma[grid](a_desc, w_desc, a_scale, w2_scale, route_w, out, layout.meta, layout.num_experts,
                                blocks_m, h, i, a_scale.stride(0), w2_scale.stride(0), w2_scale.stride(1), out.stride(0),
                                E_POW2=layout.e_pow2, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m,
                                STAGES=cfg.num_stages, UNROLL=_unroll(triton.cdiv(i, bk)),
                                num_warps=cfg.num_warps)
    return out


def compile_here(bm=128, bn=128, warps=8, stages=3):
    """Compile for sm_90a without a GPU -> (wgmma.wait_group arguments, registers, spill bytes)."""
    import re
    import subprocess
    import tempfile
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    from moeflow.kernels.registers import ptxas_path
    fp8 = torch.empty(256, 256, dtype=torch.float8_e4m3fn)
    a_desc = TensorDescriptor(fp8, [256, 256], [256, 1], [bm, 128], gl.NVMMASharedLayout.get_default_for([bm, 128], gl.float8e4nv))
    w_desc = TensorDescriptor(fp8, [256, 256], [256, 1], [bn, 128], gl.NVMMASharedLayout.get_default_for([bn, 128], gl.float8e4nv))
    fn = _down_fp8_block_wgmma
    const = dict(E_POW2=128, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, STAGES=stages, UNROLL=8, num_warps=warps)
    types = dict(a_desc=mangle_type(a_desc), w_desc=mangle_type(w_desc), as_ptr="*fp32", ws_ptr="*fp32", rw_ptr="*fp32",
                 out_ptr="*bf16", meta_ptr="*i64")
    sig = {n: ("constexpr" if n in const else types.get(n, "i32")) for n in fn.arg_names}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=const, attrs={})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    ptx = k.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        p = os.path.join(tmp, "k.ptx")
        open(p, "w").write(ptx)
        res = subprocess.run([ptxas_path(), "-v", "--gpu-name", "sm_90a", p, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True)
    regs = int(re.search(r"Used (\d+) registers", res.stderr).group(1))
    spill = re.search(r"(\d+) bytes spill stores", res.stderr)
    return re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx), regs, int(spill.group(1)) if spill else 0


def gpu_main(out_dir):
    from types import SimpleNamespace
    from moeflow.kernels.autotune import Shape, _runner, graph_time_ms, random_batch, random_weights
    from moeflow.kernels.common import RowLayout
    from moeflow.kernels.down import down, down_torch
    from moeflow.kernels.gate_up import gate_up
    from moeflow.kernels.quant import down_input, quantize_rows
    from moeflow.presets import PRESETS
    from dataclasses import replace
    dev = torch.device("cuda")
    rows = []
    cases = [("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384), ("mixtral-8x7b", 1024), ("mixtral-8x7b", 4096),
             ("mixtral-8x7b", 16384), ("deepseek-v3", 4096), ("deepseek-v3", 16384)]
    # correctness first, small and odd: empty experts, one expert with everything, I not a multiple of 128
    for (e, h, i, t, k) in ((8, 256, 384, 50, 2), (16, 384, 320, 200, 4), (4, 128, 256, 1, 1)):
        shape = Shape(e, h, i, k, "fp8-block")
        w = random_weights(shape, dev)
        batch = random_batch(shape, t, dev)
        if t == 200:  # all copies to expert 3
            batch.offsets = torch.zeros_like(batch.offsets)
            batch.offsets[4:] = batch.hidden.shape[0]
        layout = RowLayout.of(batch)
        a, a_s = quantize_rows(torch.randn(layout.rows, i, device=dev).bfloat16(), "fp8-block", layout)
        rw = torch.rand(layout.rows, device=dev)
        from moeflow.kernels.configs import GemmConfig
        for cfg in (GemmConfig(64, 128, 128, 4, 4, 4), GemmConfig(128, 128, 128, 8, 8, 3), GemmConfig(64, 64, 128, 4, 4, 3)):
            got = down_wgmma(a, a_s, w.w2, w.w2_scale, rw, layout, torch.bfloat16, cfg)
            want = down_torch(a, a_s, w.w2, w.w2_scale, rw, layout, "fp8-block", torch.bfloat16)
            valid = layout.valid_rows()
            err = (got[valid].float() - want[valid].float()).abs().max().item()
            scale = want[valid].float().abs().max().item()
            print(f"check E={e} H={h} I={i} T={t} cfg {cfg.block_m}x{cfg.block_n} w{cfg.num_warps}: max err {err:.3g} (max {scale:.3g})",
                  flush=True)
            rows.append(dict(check=[e, h, i, t, cfg.block_m, cfg.block_n], err=err, ref_max=scale))
    for preset, t in cases:
        p = PRESETS[preset]
        e, h, i, k = p["num_experts"], p["hidden_size"], p["intermediate_size"], p["top_k"]
        shape = Shape(e, h, i, k, "fp8-block")
        batch = random_batch(shape, t, dev)
        layout = RowLayout.of(batch)
        meta = SimpleNamespace(w13=torch.empty(e, 2 * i, h, device="meta"), w2=torch.empty(e, h, i, device="meta"))
        kcfg = _runner(shape).kernel_config(batch, meta)
        w = random_weights(shape, dev)
        xq, xs = quantize_rows(batch.hidden, "fp8-block", layout)
        a, a_s = down_input(*gate_up(xq, xs, w.w13, w.w13_scale, layout, "fp8-block", "silu", torch.bfloat16, kcfg.gate_up),
                            "fp8-block")
        rw = batch.weights.float()
        ref = down(a, a_s, w.w2, w.w2_scale, rw, layout, "fp8-block", torch.bfloat16, kcfg.down)
        shipped = graph_time_ms([lambda: down(a, a_s, w.w2, w.w2_scale, rw, layout, "fp8-block", torch.bfloat16,
                                              kcfg.down)], 40) * 1e3
        res = dict(preset=preset, T=t, shipped_cfg=kcfg.down.to_dict(), shipped_us=round(shipped, 1), gluon={})
        line = f"{preset:14} T={t:<6} shipped {shipped:9.1f} us ({kcfg.down.block_m}x{kcfg.down.block_n} w{kcfg.down.num_warps} s{kcfg.down.num_stages} pps{kcfg.down.programs_per_sm})"
        for bm, bn, warps, stages in ((64, 128, 4, 4), (128, 128, 8, 3), (128, 128, 8, 4), (64, 128, 4, 5), (128, 64, 4, 4)):
            cfg = replace(kcfg.down, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
            try:
                got = down_wgmma(a, a_s, w.w2, w.w2_scale, rw, layout, torch.bfloat16, cfg)
                diff = (got.float() - ref.float()).abs().max().item()
                us = graph_time_ms([lambda: down_wgmma(a, a_s, w.w2, w.w2_scale, rw, layout, torch.bfloat16, cfg)], 40) * 1e3
            except Exception as exc:  # a config that does not compile or fit
                res["gluon"][f"{bm}x{bn}w{warps}s{stages}"] = str(exc)[:200]
                line += f" | {bm}x{bn}w{warps}s{stages} ERR"
                continue
            res["gluon"][f"{bm}x{bn}w{warps}s{stages}"] = dict(us=round(us, 1), diff=diff)
            line += f" | {bm}x{bn}w{warps}s{stages} {us:8.1f} ({shipped / us:.2f}x, d {diff:.2g})"
        print(line, flush=True)
        rows.append(res)
    json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(os.path.join(out_dir, "gluon_down.json"), "w"),
              indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.compile:
        for cfg in ((128, 128, 8, 3), (64, 128, 4, 4), (128, 64, 4, 4)):
            print(cfg, compile_here(*cfg))
    else:
        gpu_main(args.out)
