"""Registers and spills of the GEMM kernels for Hopper, found without a GPU.

Triton compiles a kernel to PTX for sm_90a on any machine; the ptxas that ships in the triton wheel
then reports what a thread needs (`ptxas -v`). Register pressure decides which tiles are fast (a
per-column scale index in the K loop costs the fp8-block gate_up some 80 registers and its 128x128
tiles: common.scale_block), so tests/kernels/test_kernels_compile_sm90.py keeps the large-tile configs spill-free, and
`python -m moeflow.tune.registers` prints the table.

    register_usage(kernel, scheme, dtype, GemmConfig, tma=True) -> (registers per thread, spill-store bytes)
kernel: "gate_up" | "down" | "down_persistent"; scheme: a quant scheme name; dtype: the layer dtype (torch).
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import torch
import triton
import triton.language as tl

from ..kernels.common import QUANT_CODES, next_pow2
from ..kernels.configs import GemmConfig

SM90_SHARED_BYTES = 227 * 1024  # the most shared memory one program may take on an H100 / H200 (opt-in)
_ELEM = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def ptxas_path() -> str | None:
    """The ptxas inside the triton wheel, or None where this build has none."""
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return path if os.path.isfile(path) else None


def _signature(kernel: str, scheme: str, dtype: torch.dtype, cfg: GemmConfig, tma: bool, extra: dict | None = None):
    q = QUANT_CODES[scheme]
    act = "fp8e4nv" if q else _ELEM[dtype]  # GEMM operand type
    out = "fp8e4nv" if (kernel == "gate_up" and q == 3) else _ELEM[dtype]
    desc = f"tensordesc<{act}[{cfg.block_n}, {cfg.block_k}]>"
    aligned = {"I", "H", "stride_x", "stride_a", "stride_out", "stride_wn"}  # specialized as multiples of 16
    if kernel == "gate_up":
        from ..kernels.gemm.gate_up import _gate_up_kernel as fn
        ptrs = dict(x_ptr=act, xs_ptr="fp32", src_ptr="i64", w=act, ws_ptr="fp32", out_ptr=out, outs_ptr="fp32",
                    amax_ptr="fp32", meta_ptr="i64")
        const = dict(QUANT=q, ACT=0, INTER_DTYPE=_TL[dtype], MASKED=False, E_POW2=256, EVEN_K=True,
                     INDEXED=not cfg.x_tma, X_TMA=bool(cfg.x_tma), DOT_IEEE=False, PROMOTE=False, ROUND_IN_FP32=False,
                     W_TMA=tma)
    else:  # "down", or "down_persistent" (TMA operands only): the same operands
        from ..kernels.gemm.down import _down_kernel, _down_persistent_kernel
        ptrs = dict(a_src=act, as_ptr="fp32", w=act, ws_ptr="fp32", rw_ptr="fp32", out_ptr=_ELEM[dtype], meta_ptr="i64")
        const = dict(QUANT=q, E_POW2=256, EVEN_K=True)
        if kernel == "down":
            fn = _down_kernel
            const.update(MASKED=False, DOT_IEEE=False, PROMOTE=False, W_TMA=tma, A_TMA=tma)
        else:
            fn = _down_persistent_kernel
    const.update(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                 SWAP=bool(cfg.swap_ab))
    const.update(extra or {})
    sig = {}  # the runtime parameters' types (compile_for_hopper marks the constexprs)
    for name in fn.arg_names:
        if name in const:
            continue
        if tma and name == "w":
            sig[name] = desc
        elif name == "x_ptr" and const.get("X_TMA"):
            sig[name] = f"tensordesc<{act}[{cfg.block_m}, {cfg.block_k}]>"
        elif tma and name == "a_src":
            sig[name] = f"tensordesc<{act}[{cfg.block_m}, {cfg.block_k}]>"
        else:
            sig[name] = "*" + ptrs[name] if name in ptrs else "i32"
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
             for n, t in sig.items() if t.startswith("*") or n in aligned}
    return fn, sig, const, attrs


def register_usage(kernel: str, scheme: str, dtype: torch.dtype, cfg: GemmConfig, tma: bool = True,
                   extra: dict | None = None):
    """-> (registers per thread, spill-store bytes) of the kernel compiled for sm_90a (module docstring)."""
    regs, spill, _ = ptxas_report(gemm_ptx(kernel, scheme, dtype, cfg, tma, extra))
    return regs, spill


def gemm_ptx(kernel: str, scheme: str, dtype: torch.dtype, cfg: GemmConfig, tma: bool = True,
             extra: dict | None = None) -> str:
    """register_usage's kernel compiled for sm_90a -> its PTX (tests count instructions in it)."""
    fn, sig, const, attrs = _signature(kernel, scheme, dtype, cfg, tma, extra)
    return _compile_ptx(fn, sig, const, attrs, cfg.num_warps, cfg.num_stages)


def fused_layer_usage(scheme: str, dtype: torch.dtype, cfg, tma: bool = True, top_k: int = 8):
    """gemm/fused_layer.py's kernel compiled for sm_90a with FusedConfig ``cfg`` -> (registers per thread, spill-store
    bytes, whether its dots run as wgmma)."""
    from ..kernels.gemm.fused_layer import _fused_layer_kernel as fn
    q = QUANT_CODES[scheme]
    act = "fp8e4nv" if q else _ELEM[dtype]
    sig = {n: "i32" for n in fn.arg_names}
    sig.update({n: "*" + _ELEM[dtype] for n in ("x_ptr", "inter_ptr", "out_ptr")})
    sig.update(ids_ptr="*i32", sync_ptr="*i32", rw_ptr="*fp32", w13s_ptr="*fp32", w2s_ptr="*fp32", part1_ptr="*fp32",
               part2_ptr="*fp32")
    for name, rows, k in (("w13", cfg.block_n1, cfg.block_k1), ("w2", cfg.block_n2, cfg.block_k2)):
        sig[name] = f"tensordesc<{act}[{rows}, {k}]>" if tma else "*" + act
    const = dict(TOP_K=top_k, K_POW2=max(2, next_pow2(top_k)), QUANT=q, ACT=0, INTER_DTYPE=_TL[dtype],
                 BLOCK_N1=cfg.block_n1, BLOCK_K1=cfg.block_k1, SPLIT1=cfg.split1, BLOCK_N2=cfg.block_n2,
                 BLOCK_K2=cfg.block_k2, SPLIT2=cfg.split2, W13_TMA=tma, W2_TMA=tma,
                 DOT_IEEE=dtype == torch.float32 and q == 0, ROUND_IN_FP32=False, PDL=True)
    aligned = {"H", "I", "stride_x", "stride_out", "stride_w13e", "stride_w13n", "stride_w2e", "stride_w2n",
               "w13_rows", "w2_rows"}  # specialized as multiples of 16
    sig = {n: t for n, t in sig.items() if n not in const}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t.startswith("*") or n in aligned}
    ptx = _compile_ptx(fn, sig, const, attrs, cfg.num_warps, cfg.num_stages)
    regs, spill, _ = ptxas_report(ptx)
    return regs, spill, "wgmma.mma_async" in ptx


def compile_for_hopper(fn, signature: dict, constexprs: dict, attrs: dict | None = None, num_warps: int = 4,
                       num_stages: int = 3):
    """Compile a @triton.jit kernel for sm_90a here (no GPU) -> (registers per thread, spill-store bytes).

    signature: every non-constexpr parameter's Triton type ("*bf16", "i32", "fp32",
    "tensordesc<fp8e4nv[128, 128]>"); constexprs: the constexpr values (defaults fill the rest).
    Raises triton's CompilationError for code only the CPU interpreter accepts.
    """
    regs, spill, _ = ptxas_report(_compile_ptx(fn, signature, constexprs, attrs, num_warps, num_stages))
    return regs, spill


def _compile_ptx(fn, signature: dict, constexprs: dict, attrs: dict | None, num_warps: int, num_stages: int) -> str:
    """compile_for_hopper's compilation -> the PTX for sm_90a."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if ptxas_path() is None:
        raise FileNotFoundError("this triton build ships no ptxas")
    sig, const = _typed(fn, signature, constexprs)
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs or {}),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return compiled.asm["ptx"]


def divisible(fn, names) -> dict:
    """The compile attributes the JIT gives a launch whose parameters ``names`` (pointers to tensors, or integers)
    are multiples of 16 (16-byte aligned): tt.divisibility 16, for triton.compile's attrs. Without them a kernel
    compiled here assumes nothing of its strides (scalar loads and stores where the launch would vectorize)."""
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}


def compile_gluon_for_hopper(fn, signature: dict, constexprs: dict, num_warps: int, maxnreg: int | None = None,
                             aligned=()):
    """compile_for_hopper for a @gluon.jit kernel (gemm/down_wgmma.py) -> (registers per thread,
    spill-store bytes, ptxas's info lines: C7514 there means it serialized the wgmmas).
    signature: the Triton types of the runtime parameters (a Gluon TensorDescriptor's is
    triton.runtime.jit.mangle_type(descriptor)). maxnreg: the launch's register cap (a warp-specialized
    kernel's partitions then set their own, gemm/warp_specialized.py). aligned: parameters compiled as
    multiples of 16, as the JIT would specialize them (divisible)."""
    return ptxas_report(gluon_ptx(fn, signature, constexprs, num_warps, maxnreg, aligned))


def gluon_ptx(fn, signature: dict, constexprs: dict, num_warps: int, maxnreg: int | None = None, aligned=()) -> str:
    """compile_gluon_for_hopper's compilation -> the PTX for sm_90a."""
    return gluon_compiled(fn, signature, constexprs, num_warps, maxnreg, aligned).asm["ptx"]


def gluon_compiled(fn, signature: dict, constexprs: dict, num_warps: int, maxnreg: int | None = None, aligned=()):
    """triton.compile of a @gluon.jit kernel for sm_90a (compile_gluon_for_hopper's arguments) -> the compiled
    kernel: its asm, and its metadata.shared, the bytes of shared memory a program takes (its allocations and the
    compiler's scratch for layout changes; at most SM90_SHARED_BYTES on an H100 / H200)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    const_in = dict(constexprs, num_warps=num_warps) if "num_warps" in fn.arg_names else dict(constexprs)
    sig, const = _typed(fn, signature, const_in)
    options = {"num_warps": num_warps} | ({"maxnreg": maxnreg} if maxnreg else {})
    return triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=const, attrs=divisible(fn, aligned)),
                          target=GPUTarget("cuda", 90, 32), options=options)


def _typed(fn, signature: dict, constexprs: dict) -> tuple[dict, dict]:
    """(every parameter's type, "constexpr" for the constexprs; the constexpr values, defaults filled in)."""
    const = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    const.update(constexprs)
    return {name: ("constexpr" if name in const else signature[name]) for name in fn.arg_names}, const


def ptxas_report(ptx: str) -> tuple[int, int, list[str]]:
    """Assemble PTX for sm_90a with the wheel's ptxas -> (registers per thread, spill-store bytes, the
    lines ptxas printed with a message code, like C7514)."""
    ptxas = ptxas_path()
    if ptxas is None:
        raise FileNotFoundError("this triton build ships no ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores", res.stderr)
    notes = [line for line in res.stderr.splitlines() if re.search(r"\(C\d+\)", line)]
    return int(regs.group(1)), int(spill.group(1)) if spill else 0, notes


def main() -> None:
    rows = [("gate_up", "none", GemmConfig(128, 128, 64, 8, 8, 3)), ("gate_up", "fp8-block", GemmConfig(64, 128, 128, 8, 8, 4)),
            ("gate_up", "fp8-block", GemmConfig(128, 128, 128, 8, 8, 4)), ("down", "none", GemmConfig(128, 256, 64, 8, 8, 3)),
            ("down", "fp8-block", GemmConfig(128, 128, 128, 8, 8, 3))]
    print("kernel   scheme      tile            regs  spill bytes (TMA / pointers)")
    for kernel, scheme, cfg in rows:
        t = register_usage(kernel, scheme, torch.bfloat16, cfg, tma=True)
        p = register_usage(kernel, scheme, torch.bfloat16, cfg, tma=False)
        tile = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps}"
        print(f"{kernel:8} {scheme:11} {tile:15} {t[0]:4} {t[1]:5}   /  {p[0]:4} {p[1]:5}")


if __name__ == "__main__":
    main()
