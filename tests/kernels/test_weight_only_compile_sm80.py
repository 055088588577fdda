"""Weight-only FP8's Triton GEMMs compile for Ampere (sm_80), checked without a GPU: Triton refuses the type
fp8e4nv there wherever a kernel names it, so the weight-only path (W_FP8_BITS: uint8 weights decoded by
common.fp8e4m3_decode) must never reach it, constexpr-dead branches included. Both weight operand forms (pointer,
tensor descriptor over the bytes, which Triton lowers to pointers below sm_90), the three schemes, swapped tiles, split
K, masked rows, the persistent down and the split-K sums; float32 layers dot in IEEE float32 (no tf32 MMA in the PTX).
The FP8 x FP8 path is refused for sm_80 (the check can fail). Compiled in a subprocess: the interpreter tests switch
TRITON_INTERPRET on for this process."""
import pytest

from test_kernels_compile_sm90 import compile_without_interpreter

pytestmark = pytest.mark.targets  # a few dozen compilations through ptxas: the compile tier (.ci/run's 2nd step)

COMPILE_SM80 = r'''
import json, sys, torch
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moeflow.kernels.common import QUANT_CODES
from moeflow.kernels.gemm.down import _down_kernel, _down_persistent_kernel, _split_sum_kernel
from moeflow.kernels.gemm.gate_up import _gate_up_kernel, _gate_up_split_sum_kernel
from moeflow.tune.registers import _typed, divisible, ptxas_path
if ptxas_path() is None:
    print(json.dumps(None)); sys.exit(0)
ELEM = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
ALIGNED = {"I", "H", "stride_x", "stride_a", "stride_out", "stride_wn"}  # the JIT specializes these as multiples of 16

def compile80(fn, sig, const, warps=4, stages=3):
    """-> the PTX of fn compiled (through ptxas) for sm_80."""
    types, values = _typed(fn, sig, const)
    aligned = [n for n, t in types.items() if t.startswith("*") or (n in ALIGNED and t != "constexpr")]
    compiled = triton.compile(ASTSource(fn=fn, signature=types, constexprs=values, attrs=divisible(fn, aligned)),
                              target=GPUTarget("cuda", 80, 32), options={"num_warps": warps, "num_stages": stages})
    return compiled.asm["ptx"]

def runtime_types(fn, const, ptrs, descs):
    return {n: descs.get(n, "*" + ptrs[n] if n in ptrs else "i32") for n in fn.arg_names if n not in const}

def gate_up(scheme, dtype, bm, bn, bk, tma, split=1, swap=False, masked=False):
    d = ELEM[dtype]
    ptrs = dict(x_ptr=d, xs_ptr=d, src_ptr="i64", w="u8", ws_ptr="fp32", out_ptr="fp32" if split > 1 else d,
                outs_ptr=d, amax_ptr=d, meta_ptr="i32" if masked else "i64")
    const = dict(QUANT=QUANT_CODES[scheme], ACT=0, INTER_DTYPE=TL[dtype], MASKED=masked, E_POW2=256, BLOCK_M=bm,
                 BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, EVEN_K=False, DOT_IEEE=dtype == torch.float32, PROMOTE=False,
                 ROUND_IN_FP32=False, W_TMA=tma, INDEXED=not masked, SPLIT_K=split, X_TMA=False, SWAP=swap,
                 W_FP8_BITS=True)
    descs = {"w": f"tensordesc<u8[{bn}, {bk}]>"} if tma else {}
    return _gate_up_kernel, runtime_types(_gate_up_kernel, const, ptrs, descs), const

def down(scheme, dtype, bm, bn, bk, tma, split=1, swap=False, masked=False, persistent=False):
    d = ELEM[dtype]
    fn = _down_persistent_kernel if persistent else _down_kernel
    ptrs = dict(a_src=d, as_ptr=d, w="u8", ws_ptr="fp32", rw_ptr="fp32", out_ptr="fp32" if split > 1 else d,
                meta_ptr="i32" if masked else "i64")
    const = dict(QUANT=QUANT_CODES[scheme], E_POW2=256, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, EVEN_K=False,
                 SWAP=swap, W_FP8_BITS=True)
    if not persistent:
        const.update(MASKED=masked, DOT_IEEE=dtype == torch.float32, PROMOTE=False, W_TMA=tma, A_TMA=tma,
                     SPLIT_K=split)
    descs = {"w": f"tensordesc<u8[{bn}, {bk}]>", "a_src": f"tensordesc<{d}[{bm}, {bk}]>"} if tma or persistent else {}
    return fn, runtime_types(fn, const, ptrs, descs), const

cases = []
for scheme in ("fp8-tensor", "fp8-channel", "fp8-block"):
    cases += [
        (f"gate_up {scheme} bf16 descriptor", gate_up(scheme, torch.bfloat16, 64, 128, 64, True)),
        (f"gate_up {scheme} fp32 pointers masked", gate_up(scheme, torch.float32, 32, 64, 32, False, masked=True)),
        (f"gate_up {scheme} fp16 split K swapped", gate_up(scheme, torch.float16, 16, 64, 64, True, split=2,
                                                          swap=True)),
        (f"down {scheme} bf16 pointers split K masked", down(scheme, torch.bfloat16, 16, 64, 64, False, split=2,
                                                             masked=True)),
        (f"down {scheme} fp16 descriptors swapped", down(scheme, torch.float16, 16, 128, 128, True, swap=True)),
        (f"down {scheme} fp32 descriptors", down(scheme, torch.float32, 32, 64, 64, True)),
    ]
cases += [
    ("gate_up fp8-block bf16 a scale a column", gate_up("fp8-block", torch.bfloat16, 16, 256, 128, False)),
    ("down fp8-block bf16 a scale a column", down("fp8-block", torch.bfloat16, 16, 256, 128, True)),
    ("down persistent fp8-block bf16", down("fp8-block", torch.bfloat16, 64, 128, 128, True, persistent=True)),
    ("down persistent fp8-channel fp16", down("fp8-channel", torch.float16, 64, 128, 64, True, persistent=True)),
]
out = {}
for name, (fn, sig, const) in cases:
    ptx = compile80(fn, sig, const)
    out[name] = {"mma": "mma.sync" in ptx, "tf32": "tf32" in ptx}
ints = lambda fn, ptrs: {n: ptrs.get(n, "i32") for n in fn.arg_names}
compile80(_gate_up_split_sum_kernel, ints(_gate_up_split_sum_kernel, dict(
    part_ptr="*fp32", out_ptr="*bf16", outs_ptr="*bf16", amax_ptr="*bf16", meta_ptr="*i64")),
    dict(QUANT=0, ACT=0, INTER_DTYPE=tl.bfloat16, MASKED=False, SPLIT_K=2, BLOCK_I=1024, ROUND_IN_FP32=False))
compile80(_split_sum_kernel, ints(_split_sum_kernel, dict(part_ptr="*fp32", out_ptr="*bf16")),
          dict(SPLIT_K=2, BLOCK_H=1024))
out["split sums"] = {"mma": False, "tf32": False}
fn, sig, const = gate_up("fp8-block", torch.bfloat16, 16, 128, 128, False)  # the FP8 x FP8 path: refused
const["W_FP8_BITS"] = False
sig.update(x_ptr="*fp8e4nv", w="*fp8e4nv", out_ptr="*fp8e4nv")
try:
    compile80(fn, sig, const)
    out["fp8 x fp8 refused"] = ""
except Exception as e:
    out["fp8 x fp8 refused"] = str(e)
print(json.dumps(out))
'''


def test_weight_only_gemms_compile_for_sm80():
    out = compile_without_interpreter(COMPILE_SM80)
    assert "fp8e4nv not supported" in out.pop("fp8 x fp8 refused")
    for name, got in out.items():
        assert not got["tf32"], f"{name}: tf32 MMA in a weight-only kernel"
        if name.startswith(("gate_up", "down")) and "fp32" not in name:
            assert got["mma"], f"{name}: bf16 / fp16 dots not on the tensor cores"
