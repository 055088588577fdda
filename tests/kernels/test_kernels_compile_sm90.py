"""The Triton kernels on Hopper, checked without a GPU (moeflow/tune/registers.py: Triton's own
compiler for sm_90a and the ptxas inside the triton wheel).

* Every kernel compiles for sm_90a, for the layouts, schemes and load paths it has. The CPU
  interpreter runs code the GPU compiler refuses (a plain module global inside a kernel, for
  one), so interpreter tests alone do not show a kernel will build on the GPU.
* The large-tile GEMMs the tuned H200 configs rely on fit in registers without spills. An index
  expression that defeats Triton's constancy analysis (the fp8-block weight-scale index once cost
  ~80 registers: 253 instead of 174) fails here, not only in a benchmark.

Compiled in a subprocess: the interpreter tests switch TRITON_INTERPRET on for this process.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
              pytest.mark.targets]  # ptxas for sm_90a, minutes on a fresh cache: the compile tier (.ci/run's 2nd step)


def compile_without_interpreter(script: str, *args: str):
    """Run ``script`` (which prints JSON last, or null where the wheel ships no ptxas, or no Gluon for a
    Gluon kernel) in a fresh interpreter-free process -> its parsed JSON; skips the test on null."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if out is None:
        pytest.skip("this triton build ships no ptxas (or no Gluon)")
    return out


COMPILE_ALL = r'''
import json, sys, torch
import triton.language as tl
from moeflow.kernels.configs import GemmConfig
from moeflow.tune.registers import compile_for_hopper, ptxas_path, register_usage
if ptxas_path() is None:
    print(json.dumps(None)); sys.exit(0)
from moeflow.kernels.rows.align import _align_kernel, _sort_copies_kernel
from moeflow.kernels.rows.quant import _quant_kernel, _row_amax_kernel
from moeflow.kernels.rows.reduce import _moe_sum_kernel
out = {}
small, big = GemmConfig(16, 64, 128, 1, 4, 3), GemmConfig(64, 128, 128, 8, 8, 3)
gemms = [  # (kernel, scheme, dtype, config, tma, extra constexprs)
    ("gate_up", "none", torch.float16, small, False, dict(MASKED=True, INDEXED=False, EVEN_K=False)),
    ("gate_up", "fp8-tensor", torch.bfloat16, small, True, {}),
    ("gate_up", "fp8-channel", torch.float32, small, False, dict(PROMOTE=True, INDEXED=False)),
    ("gate_up", "fp8-block", torch.bfloat16, big, True, dict(MASKED=True)),
    ("gate_up", "fp8-block", torch.bfloat16, small, True, dict(SPLIT_K=2)),  # split K: float32 partial sums
    ("gate_up", "none", torch.float32, small, True, dict(DOT_IEEE=True, ACT=2)),
    ("down", "none", torch.bfloat16, small, False, dict(MASKED=True, EVEN_K=False)),
    ("down", "fp8-channel", torch.float32, small, True, dict(PROMOTE=True)),
    ("down", "fp8-tensor", torch.float16, small, True, {}),
    ("down", "fp8-block", torch.bfloat16, big, True, dict(MASKED=True)),
    ("down", "fp8-block", torch.float32, small, True, dict(SPLIT_K=4)),  # split K: float32 partial tiles
    ("gate_up", "none", torch.bfloat16, GemmConfig(128, 128, 64, 8, 8, 4, x_tma=1), True, {}),  # rows through TMA
    ("down_persistent", "none", torch.bfloat16, GemmConfig(128, 128, 64, 8, 8, 4), True, {}),
    ("down_persistent", "fp8-block", torch.bfloat16, GemmConfig(64, 128, 128, 8, 4, 4), True, {}),
]
for kernel, scheme, dtype, cfg, tma, extra in gemms:
    out[f"{kernel} {scheme} {dtype} tma={tma} {extra}"] = register_usage(kernel, scheme, dtype, cfg, tma, extra)
ints = lambda fn, ptrs: {n: ptrs.get(n, "i32") for n in fn.arg_names}
out["row_amax masked"] = compile_for_hopper(_row_amax_kernel, ints(_row_amax_kernel, dict(
    x_ptr="*bf16", amax_ptr="*fp32", meta_ptr="*i32")), dict(BLOCK_R=16, BLOCK_K=512, MASKED=True))
out["row_amax one step"] = compile_for_hopper(_row_amax_kernel, ints(_row_amax_kernel, dict(
    x_ptr="*bf16", amax_ptr="*fp32", meta_ptr="*i32")), dict(BLOCK_R=1, BLOCK_K=8192, MASKED=False))
for grouped, fold in ((True, 0), (False, 0), (False, 1024)):
    out[f"quant grouped={grouped} amax_rows={fold}"] = compile_for_hopper(_quant_kernel, ints(_quant_kernel, dict(
        x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", amax_ptr="*fp32")),
        dict(BLOCK_R=16, BLOCK_K=128 if grouped else 512, GROUPED=grouped, ROUND_IN_FP32=False, AMAX_ROWS=fold))
from moeflow.kernels.gemm.gate_up import _gate_up_split_sum_kernel
for q in (0, 2, 3):
    out[f"gate_up_split_sum quant={q}"] = compile_for_hopper(_gate_up_split_sum_kernel, ints(_gate_up_split_sum_kernel, dict(
        part_ptr="*fp32", out_ptr="*fp8e4nv" if q == 3 else "*bf16", outs_ptr="*fp32", amax_ptr="*fp32", meta_ptr="*i64")),
        dict(QUANT=q, ACT=0, INTER_DTYPE=tl.bfloat16, MASKED=False, SPLIT_K=4, BLOCK_I=128 if q == 3 else 1024,
             ROUND_IN_FP32=False))
from moeflow.kernels.gemm.down import _split_sum_kernel
out["split_sum"] = compile_for_hopper(_split_sum_kernel, ints(_split_sum_kernel, dict(
    part_ptr="*fp32", out_ptr="*bf16")), dict(SPLIT_K=4, BLOCK_H=1024))
for table in (False, True):
    out[f"moe_sum table={table}"] = compile_for_hopper(_moe_sum_kernel, ints(_moe_sum_kernel, dict(
        y_ptr="*bf16", row_ptr="*i64", out_ptr="*bf16", table_ptr="*i64")), dict(TOP_K=8, BLOCK_H=1024, TABLE=table))
from moeflow.kernels.rows.peer import _barrier_kernel
out["peer barrier"] = compile_for_hopper(_barrier_kernel, ints(_barrier_kernel, dict(
    pads_ptr="*i64", epoch_ptr="*i64", status_ptr="*i64", limit="i64")), dict(CLOCK=True), num_warps=1)
for masked in (False, True):
    out[f"align masked={masked}"] = compile_for_hopper(_align_kernel, ints(_align_kernel, dict(
        meta_ptr="*i32" if masked else "*i64", table_ptr="*i64")), dict(BLOCK_M=64, E_POW2=256, MASKED=masked))
out["sort_copies"] = compile_for_hopper(_sort_copies_kernel, ints(_sort_copies_kernel, dict(
    ids_ptr="*i32", w_ptr="*fp32", offsets_ptr="*i64", counts_ptr="*i32", row_ptr="*i64", source_ptr="*i64", sorted_w_ptr="*fp32")),
    dict(TOP_K=8, BLOCK_I=64, BLOCK_J=64, BLOCK_E=64))
for qx in (1, 2, 3):  # the same launch quantizing the tokens (fp8-tensor, fp8-channel, fp8-block)
    out[f"sort_copies quant_x={qx}"] = compile_for_hopper(_sort_copies_kernel, ints(_sort_copies_kernel, dict(
        ids_ptr="*i32", w_ptr="*fp32", offsets_ptr="*i64", counts_ptr="*i32", row_ptr="*i64", source_ptr="*i64",
        sorted_w_ptr="*fp32", x_ptr="*bf16", xq_ptr="*fp8e4nv", xs_ptr="*fp32")),
        dict(TOP_K=8, BLOCK_I=64, BLOCK_J=64, BLOCK_E=64, QUANT_X=qx, BLOCK_H=1024))
# one token: Triton specializes an integer argument of 1 to a constant (a plain int inside the kernel)
out["sort_copies quant_x=1 num_tokens=1"] = compile_for_hopper(_sort_copies_kernel, ints(_sort_copies_kernel, dict(
    ids_ptr="*i32", w_ptr="*fp32", offsets_ptr="*i64", counts_ptr="*i32", row_ptr="*i64", source_ptr="*i64",
    sorted_w_ptr="*fp32", x_ptr="*bf16", xq_ptr="*fp8e4nv", xs_ptr="*fp32")),
    dict(TOP_K=8, BLOCK_I=64, BLOCK_J=64, BLOCK_E=64, QUANT_X=1, BLOCK_H=1024, num_tokens=1))
from moeflow.kernels.routing.route import _route_kernel
from moeflow.kernels.routing.route import launch_shape
# Qwen3, DeepSeek-V3, Mixtral, wide, and sigmoid without a bias (its choice the logits)
for grouped, e_pow2, k, sigmoid in ((1, 128, 8, 0), (8, 256, 8, 1), (1, 8, 2, 0), (1, 1024, 8, 0), (1, 64, 4, 1)):
    block_t, warps = launch_shape(e_pow2)
    out[f"route groups={grouped} E={e_pow2}{' sigmoid' * sigmoid}"] = compile_for_hopper(_route_kernel, ints(
        _route_kernel, dict(logits_ptr="*bf16", bias_ptr="*fp32", ids_ptr="*i32", w_ptr="*fp32", scale="fp32")),
        dict(K=k, K_POW2=k, E_POW2=e_pow2, SIGMOID=bool(sigmoid), RENORM=True, HAS_BIAS=grouped > 1, GROUPS=grouped,
             TOPK_GROUPS=min(grouped, 4), BLOCK_T=block_t), num_warps=warps)
from moeflow.kernels.routing.route_stream import _route_stream_kernel, stream_shape
for grouped, e_pow2, scoring in ((1, 128, "softmax"), (8, 256, "sigmoid"), (1, 128, "softmax-sum")):
    lanes, warps = stream_shape(16384, e_pow2, grouped)  # Qwen3, DeepSeek-V3, a softmax needing its row's sum
    out[f"route_stream groups={grouped} E={e_pow2} {scoring}"] = compile_for_hopper(
        _route_stream_kernel, ints(_route_stream_kernel, dict(logits_ptr="*bf16", bias_ptr="*fp32", ids_ptr="*i32",
                                                              w_ptr="*fp32", scale="fp32")),
        dict(K=8, E_POW2=e_pow2, SIGMOID=grouped > 1, RENORM=scoring != "softmax-sum", HAS_BIAS=grouped > 1,
             GROUPS=grouped, TOPK_GROUPS=min(grouped, 4), LANES=lanes, BLOCK_T=32 * warps // lanes), num_warps=warps)
from moeflow.kernels.rows.ep_rows import _copy_slots_kernel, _pack_rows_kernel, _scatter_rows_kernel
for groups in (56, 0):  # fp8-block payload (scales), layer-dtype payload; the second through a table (p2p)
    out[f"pack_rows groups={groups}"] = compile_for_hopper(_pack_rows_kernel, ints(_pack_rows_kernel, dict(
        tokens_ptr="*i64", tscale_ptr="*fp32", ids_ptr="*i32", w_ptr="*fp32", dest_ptr="*i64", rank_ptr="*i64",
        local_ptr="*i64", out_ids_ptr="*i32", out_w_ptr="*fp32", out_scale_ptr="*fp32", out_hidden_ptr="*i64",
        table_ptr="*i64")),
        dict(TOP_K=8, GROUPS=groups, REMAP=groups > 0, BLOCK_K=8, BLOCK_G=64 if groups else 1, BLOCK_W=1024, BLOCK_P=64,
             TABLE=groups == 0))
    out[f"scatter_rows groups={groups}"] = compile_for_hopper(_scatter_rows_kernel, ints(_scatter_rows_kernel, dict(
        slot_ptr="*i64", w_ptr="*fp32", scale_ptr="*fp32", hidden_ptr="*i64", w_slab_ptr="*fp32",
        scale_slab_ptr="*fp32", hidden_slab_ptr="*i64")),
        dict(TOP_K=8, GROUPS=groups, BLOCK_K=8, BLOCK_G=64 if groups else 1, BLOCK_W=1024))
from moeflow.kernels.rows.ep_rows import _rank_count_kernel, _rank_rows_kernel
out["rank_count"] = compile_for_hopper(_rank_count_kernel, ints(_rank_count_kernel, dict(
    ids_ptr="*i32", rank_ptr="*i64", table_ptr="*i64")), dict(TOP_K=8, BLOCK_T=512, W_POW2=2))
out["rank_rows"] = compile_for_hopper(_rank_rows_kernel, ints(_rank_rows_kernel, dict(
    ids_ptr="*i32", rank_ptr="*i64", table_ptr="*i64", counts_ptr="*i64", home_ptr="*i64")),
    dict(TOP_K=8, BLOCK_T=512, W_POW2=2, B_POW2=32))
from moeflow.kernels.rows.ep_sort import _segment_hist_kernel, _segment_place_kernel, _segment_scan_kernel
out["segment_hist"] = compile_for_hopper(_segment_hist_kernel, ints(_segment_hist_kernel, dict(
    ids_ptr="*i32", hist_ptr="*i32")), dict(TOP_K=8, SEG=8192, BINS=512), num_warps=16)
for qx in (1, 3):
    out[f"segment_hist quant_x={qx}"] = compile_for_hopper(_segment_hist_kernel, ints(_segment_hist_kernel, dict(
        ids_ptr="*i32", hist_ptr="*i32", x_ptr="*bf16", xq_ptr="*fp8e4nv", xs_ptr="*fp32")),
        dict(TOP_K=8, SEG=1024, BINS=256, QUANT_X=qx, BLOCK_H=1024), num_warps=4)
out["segment_hist quant_x=3 qrows=8"] = compile_for_hopper(_segment_hist_kernel, ints(_segment_hist_kernel, dict(
    ids_ptr="*i32", hist_ptr="*i32", x_ptr="*bf16", xq_ptr="*fp8e4nv", xs_ptr="*fp32")),
    dict(TOP_K=8, SEG=256, BINS=256, QUANT_X=3, BLOCK_H=1024, QROWS=8), num_warps=4)  # 8 tokens a part
place_ptrs = dict(ids_ptr="*i32", w_ptr="*fp32", hist_ptr="*i32", counts_ptr="*i32", offsets_ptr="*i64",
                  source_ptr="*i64", sorted_w_ptr="*fp32", pos_ptr="*i64", before_ptr="*i32", totals_ptr="*i32")
out["segment_place"] = compile_for_hopper(_segment_place_kernel, ints(_segment_place_kernel, place_ptrs),
                                          dict(TOP_K=8, SEG=8192, BINS=512, S_POW2=16), num_warps=16)
out["segment_place scanned"] = compile_for_hopper(_segment_place_kernel, ints(_segment_place_kernel, place_ptrs),
                                                  dict(TOP_K=8, SEG=256, BINS=512, S_POW2=512, SCANNED=True),
                                                  num_warps=4)
# the local dispatcher's dropping form for bucketed calls: the rows from valid[0] on routed to no expert
out["segment_hist valid quant_x=3"] = compile_for_hopper(_segment_hist_kernel, ints(_segment_hist_kernel, dict(
    ids_ptr="*i32", hist_ptr="*i32", valid_ptr="*i64", x_ptr="*bf16", xq_ptr="*fp8e4nv", xs_ptr="*fp32")),
    dict(TOP_K=8, SEG=1024, BINS=256, QUANT_X=3, BLOCK_H=1024, VALID=True), num_warps=4)
out["segment_place valid"] = compile_for_hopper(_segment_place_kernel, ints(_segment_place_kernel, dict(
    place_ptrs, valid_ptr="*i64")), dict(TOP_K=8, SEG=1024, BINS=256, S_POW2=32, VALID=True), num_warps=4)
out["segment_scan"] = compile_for_hopper(_segment_scan_kernel, ints(_segment_scan_kernel, dict(
    hist_ptr="*i32", before_ptr="*i32", totals_ptr="*i32")), dict(BINS=512, KB=16, S_POW2=512), num_warps=16)
from moeflow.kernels.rows.ep_sort import _whole_sort_kernel
out["whole_sort quant_x=3"] = compile_for_hopper(_whole_sort_kernel, ints(_whole_sort_kernel, dict(
    ids_ptr="*i32", w_ptr="*fp32", counts_ptr="*i32", offsets_ptr="*i64", source_ptr="*i64", sorted_w_ptr="*fp32",
    pos_ptr="*i64", x_ptr="*bf16", xq_ptr="*fp8e4nv", xs_ptr="*fp32")),
    dict(TOP_K=8, SEG=256, BINS=512, QUANT_X=3, BLOCK_H=1024), num_warps=4)
out["whole_sort valid"] = compile_for_hopper(_whole_sort_kernel, ints(_whole_sort_kernel, dict(
    ids_ptr="*i32", w_ptr="*fp32", counts_ptr="*i32", offsets_ptr="*i64", source_ptr="*i64", sorted_w_ptr="*fp32",
    pos_ptr="*i64", valid_ptr="*i64")), dict(TOP_K=8, SEG=256, BINS=256, VALID=True), num_warps=4)
from moeflow.kernels.rows.ep_rows import _blank_rows_kernel
for table in (False, True):
    out[f"blank_rows table={table}"] = compile_for_hopper(_blank_rows_kernel, ints(_blank_rows_kernel, dict(
        buf_ptr="*i32", blank_ptr="*i32", counts_ptr="*i64", table_ptr="*i64")), dict(BLOCK_R=16, BLOCK_W=256, TABLE=table))
out["copy_slots"] = compile_for_hopper(_copy_slots_kernel, ints(_copy_slots_kernel, dict(
    experts_ptr="*i64", slot_ptr="*i64", counts_ptr="*i32", w_slab_ptr="*fp32")), dict(BLOCK=1024))
from moeflow.kernels.rows.quant import _gather_kernel, _scatter_kernel
out["gather_rows"] = compile_for_hopper(_gather_kernel, ints(_gather_kernel, dict(
    x_ptr="*u8", xs_ptr="*fp32", src_ptr="*i64", out_ptr="*u8", outs_ptr="*fp32")), dict(BLOCK_K=8192, BLOCK_G=64))
out["scatter_rows"] = compile_for_hopper(_scatter_kernel, ints(_scatter_kernel, dict(
    x_ptr="*u8", xs_ptr="*fp32", dst_ptr="*i64", out_ptr="*u8", outs_ptr="*fp32")), dict(COPIES=8, BLOCK_K=8192,
                                                                                        BLOCK_G=64))
print(json.dumps(out))
'''


def test_every_kernel_compiles_for_sm90():
    usage = compile_without_interpreter(COMPILE_ALL)
    assert len(usage) == 63
    for name, (regs, spill) in usage.items():
        assert 0 < regs <= 255, name
        if name.startswith("route"):  # a warp (or threads) per token's row: its scores stay in registers
            assert spill == 0, (name, regs, spill)
    assert usage["segment_hist quant_x=3 qrows=8"][1] == 0
    assert usage["segment_place"][1] == 0, "the in-register sort of 8192 copies spills at 16 warps"
    assert usage["segment_place scanned"][1] == 0 and usage["segment_scan"][1] == 0
    assert usage["whole_sort quant_x=3"][1] == 0


CASES = [  # (kernel, scheme, (block_m, block_n, block_k, group_m, warps, stages), most registers, most spill bytes)
    ("gate_up", "fp8-block", (64, 128, 128, 8, 8, 4), 200, 0),
    # the tile the H200 tables pick at large T: 20 bytes since each K step loads the next step's scales, which
    # measured faster than the spill-free form (docs/performance.md)
    ("gate_up", "fp8-block", (128, 128, 128, 8, 8, 3), 255, 24),
    ("gate_up", "none", (128, 128, 64, 8, 8, 3), 255, 0),
    # token rows through TMA (GemmConfig.x_tma): no row addresses to hold, 172 registers instead of 255
    ("gate_up", "none", (128, 128, 64, 8, 8, 4, 0, 1, 0, 1), 180, 0),
    ("down", "fp8-block", (128, 128, 128, 8, 8, 3), 240, 0),
    ("down", "fp8-block", (64, 128, 128, 8, 4, 4), 208, 0),
    ("down_persistent", "fp8-block", (64, 128, 128, 8, 4, 4), 255, 0),  # 2 programs per SM: 255 fit
    ("down_persistent", "none", (128, 128, 64, 8, 8, 4), 255, 0),
    ("down", "none", (128, 256, 64, 8, 8, 3), 255, 0),
]

LARGE_TILES = """
import json, sys, torch
from moeflow.kernels.configs import GemmConfig
from moeflow.tune.registers import ptxas_path, register_usage
if ptxas_path() is None:
    print(json.dumps(None)); sys.exit(0)
cases = json.loads(sys.argv[1])
print(json.dumps([register_usage(k, s, torch.bfloat16, GemmConfig(*c)) for k, s, c, _, _ in cases]))
"""


def test_large_tiles_fit_in_registers():
    usage = compile_without_interpreter(LARGE_TILES, json.dumps(CASES))
    for (kernel, scheme, cfg, most, most_spill), (regs, spill) in zip(CASES, usage):
        tile = "x".join(map(str, cfg[:3]))
        assert spill <= most_spill, f"{kernel} {scheme} {tile}: {spill} bytes of register spills"
        assert regs <= most, f"{kernel} {scheme} {tile}: {regs} registers > {most}"


FUSED = """
import json, sys, torch
from moeflow.kernels.configs import FusedConfig
from moeflow.tune.registers import fused_layer_usage, ptxas_path
if ptxas_path() is None:
    print(json.dumps(None)); sys.exit(0)
dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
print(json.dumps([fused_layer_usage(s, dt[d], FusedConfig(*c), tma, k) for s, d, c, tma, k, _ in json.loads(sys.argv[1])]))
"""
FUSED_CASES = [  # (scheme, dtype, FusedConfig fields, TMA, top-k, wgmma expected)
    ("fp8-block", "bf16", (128, 128, 128, 128, 4, 3, 2, 8), True, 8, True),  # the H200 tables' fp8 tiles
    ("fp8-block", "bf16", (128, 128, 64, 128, 4, 3, 2, 8), True, 8, True),  # gate_up and down tiles unequal
    ("fp8-block", "fp16", (64, 128, 128, 128, 4, 4, 1, 8), False, 2, True),
    ("none", "bf16", (64, 128, 128, 128, 4, 3, 2, 8), True, 8, True),  # the tables' bf16 tiles
    ("none", "bf16", (32, 64, 64, 64, 4, 4, 1, 1), False, 3, None),  # 32-row gate_up tiles: mma.sync there
    ("fp8-block", "bf16", (32, 128, 32, 128, 4, 4, 1, 1), True, 8, False),  # no 64-row tile: no wgmma
    ("none", "fp32", (16, 32, 16, 32, 4, 2, 2, 2), False, 3, False),  # IEEE float32 dots
]


def test_fused_layer_compiles_for_sm90():
    """The one-launch layer builds for sm_90a at its table tiles, unequal gate_up and down tiles, pointer and TMA
    weights and every dtype, without spills; its 64-row tiles run as wgmma (the weight tile is the dot's M)."""
    usage = compile_without_interpreter(FUSED, json.dumps(FUSED_CASES))
    for (scheme, dtype, cfg, tma, k, wgmma), (regs, spill, has_wgmma) in zip(FUSED_CASES, usage):
        what = f"{scheme} {dtype} {cfg} tma={tma}"
        assert 0 < regs <= 255 and spill == 0, (what, regs, spill)
        if wgmma is not None:
            assert has_wgmma == wgmma, what


GLUON_COMPILE = """
import importlib, importlib.util, json, sys, torch
from moeflow.tune.registers import compile_gluon_for_hopper, gluon_ptx, ptxas_path
if ptxas_path() is None or importlib.util.find_spec("triton.experimental.gluon") is None:
    print(json.dumps(None)); sys.exit(0)
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type
from moeflow.kernels.gemm.down_wgmma import unroll
kernel = getattr(importlib.import_module(sys.argv[1]), sys.argv[2])
fp8 = torch.empty(2, 256, 256, dtype=torch.float8_e4m3fn)
out = []
# {"descs": {name: box rows, or a box shape}, "ptrs": {name: type}, "const", "warps", "unroll"?,
#  "count"?: PTX instructions to count, "ptx"?: true for the PTX itself,
#  "aligned"?: parameters compiled as multiples of 16, as the JIT specializes them at the shipped shapes}
def desc(box):
    box = [box, 128] if isinstance(box, int) else box
    rank = len(box)
    return mangle_type(TensorDescriptor(fp8, list(fp8.shape[-rank:]), list(fp8.stride()[-rank:]), box,
                                        gl.NVMMASharedLayout.get_default_for(box, gl.float8e4nv)))
for job in json.loads(sys.argv[3]):
    sig = {name: desc(box) for name, box in job["descs"].items()}
    sig.update(job["ptrs"])
    sig.update({n: "i32" for n in kernel.arg_names if n not in sig})
    const = dict(job["const"], **({"UNROLL": unroll(*job["unroll"])} if "unroll" in job else {}))
    if "INTER_DTYPE" in const:
        const["INTER_DTYPE"] = getattr(gl, const["INTER_DTYPE"])
    if "count" in job or job.get("ptx"):  # how often each instruction appears in the PTX, or the PTX
        ptx = gluon_ptx(kernel, sig, const, job["warps"], aligned=job.get("aligned", ()))
        out.append(ptx if job.get("ptx") else {op: ptx.count(op + " ") for op in job["count"]})
    else:
        out.append(compile_gluon_for_hopper(kernel, sig, const, job["warps"], aligned=job.get("aligned", ())))
print(json.dumps(out))
"""


def assert_wgmmas_overlapped(kernel: str, jobs: list[dict], most_spill: list[int]) -> None:
    """Compile the Gluon kernel (module.name) for sm_90a at each job: ptxas prints neither C7514 (it
    serialized the wgmmas) nor C7517 (it injected waits), and each job spills at most its bound."""
    usage = compile_without_interpreter(GLUON_COMPILE, *kernel.rsplit(".", 1), json.dumps(jobs))
    for job, most, (regs, spill, notes) in zip(jobs, most_spill, usage):
        assert not [n for n in notes if "C7514" in n or "C7517" in n], (job, notes)
        assert spill <= most and regs <= 255, (job, regs, spill)


# the Gluon down kernels' parameters that are multiples of 16 at every shipped shape (the JIT specializes them so)
DOWN_ALIGNED = ["as_ptr", "ws_ptr", "rw_ptr", "out_ptr", "meta_ptr", "H", "I", "stride_wse", "stride_out"]


def test_wgmma_down_keeps_its_wgmmas_overlapped():
    """kernels/gemm/down_wgmma.py compiled for sm_90a: ptxas neither serializes its wgmmas (C7514: a running
    product's registers read or moved, which the two-products-by-turns loop exists to avoid) nor
    injects waits (C7517), and the tiles the tuner offers fit in registers. UNROLL 1 is the serial form.
    The tile the H200 tables pick (128x128, 8 warps, 4 stages, 8 steps a body) spills 32-44 bytes and is
    still the fastest measured: 1.25x the Triton kernel on Mixtral T=16384, against 1.19x for 4 steps a
    body, which does not spill."""
    tiles = [(128, 128, 8, 4, 8, False), (128, 128, 8, 4, 8, True), (128, 128, 8, 3, 8, False), (64, 128, 4, 4, 6, True),
             (64, 64, 4, 3, 2, False), (128, 128, 8, 4, 1, False)]
    ptrs = dict(as_ptr="*fp32", ws_ptr="*fp32", rw_ptr="*fp32", out_ptr="*bf16", meta_ptr="*i64")
    jobs = [dict(descs=dict(a_desc=bm, w_desc=bn), ptrs=ptrs, warps=warps, aligned=DOWN_ALIGNED,
                 const=dict(E_POW2=8, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, STAGES=stages, UNROLL=unroll,
                            COALESCED_STORE=coalesced))
            for bm, bn, warps, stages, unroll, coalesced in tiles]
    assert_wgmmas_overlapped("moeflow.kernels.gemm.down_wgmma._down_wgmma_kernel", jobs, [48, 48, 0, 0, 0, 0])


# the Gluon gate_up's parameters that are multiples of 16 at every shipped shape (the JIT specializes them so)
GATE_UP_ALIGNED = ["xs_ptr", "ws_ptr", "out_ptr", "outs_ptr", "meta_ptr", "I", "H", "stride_wse", "stride_wsn",
                   "stride_out"]


def gate_up_descs(bm: int, pairs: bool) -> dict:
    """The Gluon gate_up's descriptors' boxes: x rows, and the gate and up weight tiles as two planes of a 3-D box (the
    pair tile's: 64 x rows, 256 weight rows a plane)."""
    return dict(x_desc=bm, w_desc=[2, 128, 128], xt_desc=64 if pairs else bm, wt_desc=[2, 256 if pairs else 128, 128])


def test_wgmma_gate_up_keeps_its_wgmmas_overlapped():
    """kernels/gemm/gate_up_wgmma.py compiled for sm_90a at the tiles the tuner offers and the loop bodies unroll()
    picks for Qwen3's, Mixtral's and DeepSeek-V3's K loops (16, 32, 56 steps) and a 9-step one: no serialized
    wgmmas (C7514), no injected waits (C7517), no spills (a body of a multiple of STAGES steps spilled 128-600
    bytes: unroll() avoids those)."""
    tiles = [(128, 8, 3, 16, False), (128, 8, 3, 56, False), (128, 8, 4, 32, False), (128, 8, 4, 56, False),
             (128, 8, 3, 9, False), (64, 4, 4, 32, False), (128, 8, 3, 16, True), (128, 8, 3, 56, True),
             (128, 8, 2, 9, True)]
    ptrs = dict(xs_ptr="*fp32", ws_ptr="*fp32", out_ptr="*fp8e4nv", outs_ptr="*fp32", meta_ptr="*i64")
    jobs = [dict(descs=gate_up_descs(bm, pairs), ptrs=ptrs, warps=warps, unroll=[steps, 8, stages], aligned=GATE_UP_ALIGNED,
                 const=dict(ACT=0, INTER_DTYPE="bfloat16", E_POW2=8, BLOCK_M=bm, GROUP_M=8, STAGES=stages, PAIRS=pairs))
            for bm, warps, stages, steps, pairs in tiles]
    # pair tiles at 3 stages spilled 48-116 bytes until a step's gate and up tiles came in one copy, on barriers of
    # their own (test_wgmma_refills_take_one_cta_barrier): 254 registers, none spilled since
    assert_wgmmas_overlapped("moeflow.kernels.gemm.gate_up_wgmma._gate_up_wgmma_kernel", jobs, [0] * len(jobs))


def refill_barriers(ptx: str) -> tuple[int, int]:
    """-> (refills, the most CTA barriers (bar.sync) inside one). A refill is a slot's mbarrier expects, then its TMA
    copies; barriers before its first or after its last operation do not count."""
    refills, most, inside, pending, last = 0, 0, 0, 0, None
    for line in ptx.splitlines():
        op = line.split("//")[0].strip()  # .loc lines name the source file (down_wgmma.py) in a comment
        kind = ("e" if "expect_tx" in op else "c" if "cp.async.bulk.tensor" in op
                else "b" if op.startswith("bar.sync") else "x" if op.startswith("wgmma.") or "try_wait" in op else None)
        if kind in ("e", "c"):
            if last is None or (kind == "e" and last == "c"):  # a new refill
                most, inside, refills = max(most, inside), 0, refills + 1
            else:
                inside += pending
            pending, last = 0, kind
        elif kind == "b":
            pending += 1
        elif kind == "x":
            last = None
    return refills, max(most, inside)


def test_wgmma_refills_take_one_cta_barrier():
    """The Gluon fp8-block GEMMs' K loops refill a slot with expects and TMA copies that the compiler orders by CTA
    barriers (bar.sync: both warpgroups line up) wherever two of them write one shared allocation; an expect and a copy
    both write their mbarrier. One barrier a slot put 4 (down: expect, a copy, w copy) or 5 (gate_up: expect, x, gate,
    up) barriers around each refill, on each K step. With an mbarrier per copy in separate allocations, and the gate
    and up tiles in one 3-D copy, the expects run, then one barrier, then the copies. In the sm_90a PTX: at most one
    bar.sync inside any refill."""
    gate_up = dict(descs=gate_up_descs(128, True), warps=8, unroll=[16, 8, 3], ptx=True, aligned=GATE_UP_ALIGNED,
                   ptrs=dict(xs_ptr="*fp32", ws_ptr="*fp32", out_ptr="*fp8e4nv", outs_ptr="*fp32", meta_ptr="*i64"),
                   const=dict(ACT=0, INTER_DTYPE="bfloat16", E_POW2=8, BLOCK_M=128, GROUP_M=8, STAGES=3, PAIRS=True))
    down = dict(descs=dict(a_desc=128, w_desc=128), warps=8, ptx=True, aligned=DOWN_ALIGNED,
                ptrs=dict(as_ptr="*fp32", ws_ptr="*fp32", rw_ptr="*fp32", out_ptr="*bf16", meta_ptr="*i64"),
                const=dict(E_POW2=8, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, STAGES=4, UNROLL=8,
                           COALESCED_STORE=False))
    for kernel, job in (("moeflow.kernels.gemm.gate_up_wgmma._gate_up_wgmma_kernel", gate_up),
                        ("moeflow.kernels.gemm.down_wgmma._down_wgmma_kernel", down),
                        ("moeflow.kernels.gemm.down_wgmma_persistent._down_wgmma_persistent_kernel", down)):
        ptx = compile_without_interpreter(GLUON_COMPILE, *kernel.rsplit(".", 1), json.dumps([job]))[0]
        refills, most = refill_barriers(ptx)
        assert refills >= 8 and most <= 1, (kernel, refills, most)


WEIGHT_PLANES = """
import importlib.util, json, sys, torch
if importlib.util.find_spec("triton.experimental.gluon") is None:
    print(json.dumps(None)); sys.exit(0)
from moeflow.kernels.gemm import gate_up_wgmma
from moeflow.kernels.common import expert_rows
e, i, h = 3, 384, 256
w13 = torch.randint(0, 256, (e, 2 * i, h), dtype=torch.uint8).view(torch.float8_e4m3fn)
out = []
for w in (w13, w13[:1].expand(e, -1, -1)):  # experts back to back, and an expert stride of 0
    per_expert = 2 if expert_rows(w) else 0
    for rows in (128, 256):
        d = gate_up_wgmma._weight_planes(w, e * per_expert or 2, i, h, rows)
        planes = torch.as_strided(w.view(torch.uint8), d.shape, d.strides, w.storage_offset())
        out.append(d.block_shape == [2, rows, 128] and all(
            torch.equal(planes[x * per_expert], w[x, :i].view(torch.uint8))
            and torch.equal(planes[x * per_expert + 1], w[x, i:].view(torch.uint8)) for x in range(e)))
print(json.dumps(out))
"""


def test_gate_up_weight_planes_address_each_experts_gate_and_up_rows():
    """kernels/gate_up_wgmma._weight_planes reads w13 [E, 2I, H] as planes [2E, I, H]: the kernel copies expert e's
    gate rows from plane e * planes_per_expert and its up rows from the next plane (2 planes an expert, or one pair
    of planes for an expert stride of 0). The descriptor's shape and strides, applied to w13's storage, give exactly
    those rows in both layouts and both boxes (no GPU: the descriptor is plain data)."""
    assert compile_without_interpreter(WEIGHT_PLANES) == [True] * 4


def test_wgmma_down_persistent_keeps_its_wgmmas_overlapped():
    """kernels/gemm/down_wgmma_persistent.py compiled for sm_90a at the tiles the tuner offers it (64x128 with 4 warps,
    128x128 with 8) and Qwen3's and DeepSeek-V3's K loops (6 and 16 steps: bodies of 6 and 8): its loop over
    tiles keeps the wgmmas overlapped (no C7514 / C7517) and nothing spills at those tiles."""
    tiles = [(64, 4, 4, 6, True), (64, 4, 3, 6, False), (64, 4, 4, 8, True), (128, 8, 3, 6, True), (128, 8, 3, 8, False)]
    ptrs = dict(as_ptr="*fp32", ws_ptr="*fp32", rw_ptr="*fp32", out_ptr="*bf16", meta_ptr="*i64")
    jobs = [dict(descs=dict(a_desc=bm, w_desc=128), ptrs=ptrs, warps=warps, aligned=DOWN_ALIGNED,
                 const=dict(E_POW2=128, BLOCK_M=bm, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, STAGES=stages, UNROLL=unroll,
                            COALESCED_STORE=coalesced))
            for bm, warps, stages, unroll, coalesced in tiles]
    assert_wgmmas_overlapped("moeflow.kernels.gemm.down_wgmma_persistent._down_wgmma_persistent_kernel", jobs,
                             [0] * len(tiles))


WS_DOWN_COMPILE = """
import importlib.util, json, sys, torch
from moeflow.tune.registers import gluon_compiled, ptxas_path, ptxas_report
if ptxas_path() is None or importlib.util.find_spec("triton.experimental.gluon") is None:
    print(json.dumps(None)); sys.exit(0)
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type
from moeflow.kernels.gemm import warp_specialized as ws
from moeflow.kernels.gemm.tiles import _WS_FP8_STAGES, _WS_UNSCALED_STAGES
out = []
# (dtype, gated, BLOCK_M, BLOCK_N, BLOCK_K, stages, UNROLL or 0: not SCALED)
jobs = [(torch.bfloat16, gated, 128, 64 if gated else 128, 64, stages, 0)
        for gated in (False, True) for stages in (2, 6)]
jobs += [(torch.float16, gated, 128, 64 if gated else 128, 64, 5, 0) for gated in (False, True)]
# COOP (the two consumers 64 rows each of a tile of 256 accumulator columns) at 2 stages; the COOP and 64-row tiles at
# their most stages come from ws_fits' table below
jobs += [(torch.bfloat16, gated, 128, 128 if gated else 256, 64, 2, 0) for gated in (False, True)]
# fp8-block down: Qwen3's 6 steps, DeepSeek-V3's 16 (bodies of 8), one step, 7 steps; 64 x 128 and 128 x 64
jobs += [(torch.float8_e4m3fn, False, bm, bn, 128, stages, u) for bm, bn, stages, u in
         ((64, 128, 4, 6), (64, 128, 8, 8), (64, 128, 3, 1), (128, 64, 6, 7), (128, 64, 4, 8))]
# fp8-block gate_up, 64 x 128: bodies of 8 (Qwen3's 16 steps, Mixtral's 32, DeepSeek-V3's 56), 7, 1; 2-5 stages
jobs += [(torch.float8_e4m3fn, True, 64, 128, 128, stages, u) for stages, u in ((4, 8), (5, 8), (3, 7), (2, 1))]
# the same 128 x 128, the two consumers 64 rows each (COOP): 2-4 stages
jobs += [(torch.float8_e4m3fn, True, 128, 128, 128, stages, u) for stages, u in ((4, 8), (3, 7), (2, 1))]
# the wide fp8-block down, 64 x 256 in quarters: Qwen3's 6 steps, DeepSeek-V3's 16 and Mixtral's 112 (bodies of 8), 1
jobs += [(torch.float8_e4m3fn, False, 64, 256, 128, stages, u) for stages, u in ((5, 6), (4, 8), (3, 1))]
# the same 128 x 256, the two consumers 64 rows each (COOP): 2-4 stages (5 would take 262 KB)
jobs += [(torch.float8_e4m3fn, False, 128, 256, 128, stages, u) for stages, u in ((4, 8), (3, 6), (2, 1))]
# ws_fits' tiles at their most stages must fit the SM's shared memory, one stage past must overflow it
limits = [(torch.bfloat16, gated, bm, bn, 64, most, 0) for (gated, bm, bn), most in _WS_UNSCALED_STAGES.items()]
limits += [(torch.float8_e4m3fn, gated, bm, bn, 128, most, 8) for (gated, bm, bn), most in _WS_FP8_STAGES.items()]
jobs += [j for j in limits if j not in jobs]
past = [(dtype, gated, bm, bn, bk, most + 1, u) for dtype, gated, bm, bn, bk, most, u in limits]
gl_of = {torch.bfloat16: (gl.bfloat16, "bf16"), torch.float16: (gl.float16, "fp16"),
         torch.float8_e4m3fn: (gl.float8e4nv, "")}
for dtype, gated, bm, bn, bk, stages, u in jobs + past:
    t = torch.empty(256, 256, dtype=dtype)
    gdt, name = gl_of[dtype]
    desc = lambda rows: mangle_type(TensorDescriptor(t, [256, 256], [256, 1], [rows, bk],
                                                     gl.NVMMASharedLayout.get_default_for([rows, bk], gdt)))
    fn = ws._ws_gemm_kernel
    out_ty = "*" + (name or ("fp8e4nv" if gated else "bf16"))  # fp8-block: the down's out bf16, the gate_up's fp8
    w_box = 128 if bn == 256 and u else bn  # the wide fp8-block down loads its 256 weight rows as two 128-row boxes
    sig = dict(a_desc=desc(bm), w_desc=desc(w_box), rw_ptr="*fp32", out_ptr=out_ty, blk_ptr="*i32",
               nblk_ptr="*i32", as_ptr="*fp32", ws_ptr="*fp32", outs_ptr="*fp32")
    sig.update({n: "i32" for n in fn.arg_names if n not in sig})
    const = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, STAGES=stages, CONSUMER_REGS=ws.CONSUMER_REGS,
                 LOADER_REGS=ws.LOADER_REGS, GATED=gated, ACT=2 if gated else 0, SCALED=u > 0, UNROLL=max(u, 1))
    # compiled as the JIT specializes the shipped launches: these are multiples of 16 at every shipped shape
    aligned = ["rw_ptr", "out_ptr", "blk_ptr", "nblk_ptr", "as_ptr", "ws_ptr", "outs_ptr", "N", "K", "stride_out",
               "stride_wse"]
    compiled = gluon_compiled(fn, sig, const, 4, maxnreg=ws.MAXNREG, aligned=aligned)
    if (dtype, gated, bm, bn, bk, stages, u) in past:
        out.append(("past", [gated, bm, bn, stages], compiled.metadata.shared))
    else:
        out.append(("fits", [gated, bm, bn, stages], compiled.metadata.shared, *ptxas_report(compiled.asm["ptx"])))
print(json.dumps(out))
"""


def test_warp_specialized_gemms_compile_without_spills():
    """kernels/gemm/warp_specialized.py compiled for sm_90a (down and gate_up, bf16 and fp16, 2-6 stages, also COOP and
    64-row tiles; the fp8-block
    down's loop bodies of 1-8 steps, 2-8 stages, all three tiles; the fp8-block gate_up's bodies of 1-8 steps, 2-5
    stages, and its 128-row tiles shared by the two consumers at 2-4, as the wide down's) under its launch's register
    cap:
    no spills (the loader warp's 24 registers hold only scalars: the row blocks come from a table), and ptxas
    neither serializes the wgmmas (C7514) nor injects waits (C7517). Every tile's program fits the SM's shared memory
    (227 KB, the compiler's scratch included), and configs.ws_fits' tiles one stage past their most do not:
    the stage limits there are shared memory's."""
    from moeflow.tune.registers import SM90_SHARED_BYTES
    out = compile_without_interpreter(WS_DOWN_COMPILE)
    for kind, tile, shared, *report in out:
        if kind == "past":  # tiles._WS_UNSCALED_STAGES and _WS_FP8_STAGES: one stage more would not launch
            assert shared > SM90_SHARED_BYTES, (tile, shared)
            continue
        regs, spill, notes = report
        assert shared <= SM90_SHARED_BYTES, (tile, shared)
        assert spill == 0 and regs <= 168, (tile, regs, spill)
        assert not [n for n in notes if "C7514" in n or "C7517" in n], notes
    assert sum(kind == "past" for kind, *_ in out) == 12


def test_block_table_kernel_compiles():
    out = compile_without_interpreter(r"""
import json, sys
from moeflow.tune.registers import compile_for_hopper, ptxas_path
if ptxas_path() is None:
    print(json.dumps(None)); sys.exit(0)
from moeflow.kernels.gemm.warp_specialized import _block_table_kernel as k
sig = {n: "i32" for n in k.arg_names}
sig.update(meta_ptr="*i64", blk_ptr="*i32", nblk_ptr="*i32")
print(json.dumps(compile_for_hopper(k, sig, dict(BLOCK_M=128, E_POW2=256, PDL=True))))
""")
    assert out[1] == 0


EPILOGUE_OPS = r'''
import json, sys, torch
from moeflow.kernels.configs import GemmConfig
from moeflow.tune.registers import _compile_ptx, divisible, gemm_ptx, ptxas_path
if ptxas_path() is None:
    print(json.dumps(None)); sys.exit(0)
from moeflow.kernels.rows.quant import _quant_kernel
ops = json.loads(sys.argv[1])
out = []  # (what, most divisions a thread may take, counts)
for scheme, cfg in (("fp8-block", GemmConfig(128, 128, 128, 8, 8, 3)), ("none", GemmConfig(128, 128, 64, 8, 8, 3))):
    per_thread = cfg.block_m * cfg.block_n // (32 * cfg.num_warps)  # outputs a thread holds: 64
    ptx = gemm_ptx("gate_up", scheme, torch.bfloat16, cfg)
    out.append((f"gate_up {scheme}", per_thread // 16, {op: ptx.count(op + " ") for op in ops}))
ptrs = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "amax_ptr": "*fp32"}
# the JIT's specialization of a launch on torch tensors with row strides of multiples of 16: without it each element
# is its own 2-byte load, and the [16, 128] program's layout hands every thread all 16 rows' scales
attrs = divisible(_quant_kernel, ["x_ptr", "q_ptr", "s_ptr", "amax_ptr", "K", "stride_x", "stride_q", "stride_s"])
for rows, cols, grouped in ((4, 512, False), (16, 128, True)):
    const = dict(BLOCK_R=rows, BLOCK_K=cols, GROUPED=grouped, ROUND_IN_FP32=False, AMAX_ROWS=0)
    sig = {n: ptrs.get(n, "i32") for n in _quant_kernel.arg_names if n not in const and n != "PDL"}
    ptx = _compile_ptx(_quant_kernel, sig, const, attrs, 4, 3)
    # a thread's 16 outputs lie in one row (or group) in either tile: 2 allows a layout that splits them over two
    out.append((f"quant {rows}x{cols} grouped={grouped}", 2, {op: ptx.count(op + " ") for op in ops}))
print(json.dumps(out))
'''


def test_epilogues_divide_once_a_row_or_group():
    """The FP8 quantization takes one IEEE reciprocal a row or group and multiplies each element (common.to_fp8), and
    the sigmoid comes from the approximate exp2 and reciprocal (common.sigmoid). In the sm_90a PTX of the gate_up
    epilogues (Triton fp8-block and bf16, Gluon fp8-block) no div.full.f32 (tl.sigmoid's, or Triton's `/`), and
    div.rn.f32 at most a sixteenth of a thread's 64 outputs there (they take 2), and at most 2 of a thread's 16 in
    the quantization launches (they take 1), compiled as the JIT specializes them on aligned tensors. A division an
    element was a third of the Gluon gate_up's epilogue."""
    ops = ["div.rn.f32", "div.full.f32"]
    found = compile_without_interpreter(EPILOGUE_OPS, json.dumps(ops))
    gluon = dict(descs=gate_up_descs(128, True), warps=8, unroll=[16, 8, 3], count=ops,
                 aligned=GATE_UP_ALIGNED,
                 ptrs=dict(xs_ptr="*fp32", ws_ptr="*fp32", out_ptr="*fp8e4nv", outs_ptr="*fp32", meta_ptr="*i64"),
                 const=dict(ACT=0, INTER_DTYPE="bfloat16", E_POW2=8, BLOCK_M=128, GROUP_M=8, STAGES=3, PAIRS=True))
    counts = compile_without_interpreter(GLUON_COMPILE, "moeflow.kernels.gemm.gate_up_wgmma", "_gate_up_wgmma_kernel",
                                         json.dumps([gluon]))
    found.append(("gluon gate_up fp8-block", 2 * (128 * 128 // 256 // 16), counts[0]))  # full and pair tiles
    for what, most, n in found:
        assert n["div.full.f32"] == 0, (what, n)
        assert n["div.rn.f32"] <= most, (what, most, n)


SWAPPED_MMAS = r'''
import json, re, sys, torch
from moeflow.kernels.configs import GemmConfig
from moeflow.tune.registers import gemm_ptx, ptxas_path, ptxas_report
if ptxas_path() is None:
    print(json.dumps(None)); sys.exit(0)
out = {}
for kernel, scheme, bm, bn, bk in (("gate_up", "fp8-block", 16, 128, 128), ("gate_up", "none", 16, 64, 64),
                                   ("down", "fp8-block", 16, 128, 128), ("down", "none", 32, 128, 64)):
    for swap in (0, 1):
        ptx = gemm_ptx(kernel, scheme, torch.bfloat16, GemmConfig(bm, bn, bk, 1, 4, 3, swap_ab=swap))
        regs, spill, _ = ptxas_report(ptx)
        out[f"{kernel} {scheme} {bm}x{bn} swap={swap}"] = dict(
            wgmma=sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
            mma_sync=len(re.findall(r"\bmma\.sync\b", ptx)), fp8_to_f16=ptx.count("cvt.rn.f16x2.e4m3x2"),
            regs=regs, spill=spill)
print(json.dumps(out))
'''


def test_swapped_tiles_run_wgmma_from_shared_memory():
    """GemmConfig.swap_ab (common.tile_dot): a block of 16-32 token rows, as the dot's N, compiles for sm_90a to
    wgmma m64nBLOCK_M (fp8 straight from shared memory, no conversion to fp16), where the same tile unswapped is
    mma.sync on a 16-row A whose fp8 operands Triton first converts to fp16; neither spills."""
    found = compile_without_interpreter(SWAPPED_MMAS)
    for name, got in found.items():
        assert got["spill"] == 0, (name, got)
        bm = int(name.split()[2].split("x")[0])
        if name.endswith("swap=1"):
            assert got["wgmma"] and all(w.startswith("m64n%d" % bm) for w in got["wgmma"]), (name, got)
            assert got["mma_sync"] == 0 and got["fp8_to_f16"] == 0, (name, got)
        else:
            assert not got["wgmma"] and got["mma_sync"] > 0, (name, got)
            assert ("fp8" not in name) or got["fp8_to_f16"] > 0, (name, got)

