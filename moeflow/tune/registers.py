"""Shared memory, registers and spills of the Triton kernels on each NVIDIA target, found without a GPU.

Triton compiles a kernel for any target on any machine (GPUTarget("cuda", arch)); the ptxas it assembles that target
with (the wheel's ptxas, or ptxas-blackwell from sm_100 on) then reports what a thread needs (`ptxas -v`). ARCHS:
sm_80, 86, 89, 90a, 100a, 120a. Register pressure decides which tiles are fast (a per-column scale index in the K loop
cost the fp8-block gate_up ~80 registers: common.scale_block), so tests/kernels/test_kernels_compile_sm90.py keeps
the large tiles spill-free; `python -m moeflow.tune.registers [--arch 120]` prints the table.
    compile_report(fn, signature, constexprs, attrs, num_warps, num_stages, arch) -> CompileReport
    gemm_report(kernel "gate_up" | "down" | "down_persistent", scheme, dtype, GemmConfig, arch, tma, extra, types)
compile_for_hopper, register_usage, gemm_ptx, fused_layer_usage and the gluon_* helpers: the same at sm_90a.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from ..kernels.common import QUANT_CODES, next_pow2
from ..kernels.configs import GemmConfig

ARCHS = (80, 86, 89, 90, 100, 120)  # the compute capabilities moeflow's kernels are built for (Triton's GPUTarget)
SM90_SHARED_BYTES = 227 * 1024  # the most shared memory one program may take on an H100 / H200 (opt-in)
_ELEM = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@dataclass(frozen=True)
class CompileReport:
    """One kernel compiled for one target: what a program and a thread of it take."""

    arch: int  # the compute capability as Triton's GPUTarget names it: 80, 86, 89, 90, 100, 120
    shared_bytes: int  # shared memory a program takes (triton's metadata.shared: allocations and layout scratch)
    registers: int  # registers per thread (ptxas -v)
    spill_bytes: int  # spill-store bytes per thread (ptxas -v)
    ptx: str = field(repr=False)
    notes: tuple[str, ...] = ()  # ptxas's lines with a message code (C7514: it serialized the wgmmas)


def arch_of(arch) -> int:
    """80, "sm_80", "sm_90a", (9, 0) -> the capability as Triton's GPUTarget takes it (80, 90)."""
    if isinstance(arch, tuple):
        return arch[0] * 10 + arch[1]
    if isinstance(arch, str):
        found = re.fullmatch(r"(?:sm_)?(\d+)a?", arch.strip())
        if not found:
            raise ValueError(f"not an NVIDIA target: {arch!r} (expected e.g. 90 or 'sm_90a')")
        return int(found.group(1))
    return int(arch)


def gpu_name(arch=90) -> str:
    """The --gpu-name triton hands ptxas for ``arch``: sm_80, sm_86, sm_89, sm_90a, sm_100a, sm_120a."""
    try:
        from triton.backends.nvidia.compiler import sm_arch_from_capability
    except ImportError:  # a triton build without the NVIDIA backend (ROCm wheels): its naming
        return f"sm_{arch_of(arch)}{'a' if arch_of(arch) >= 90 else ''}"
    return sm_arch_from_capability(arch_of(arch))


def ptxas_path(arch=90) -> str | None:
    """The ptxas triton assembles ``arch`` with (its get_ptxas: the wheel's ptxas, ptxas-blackwell from sm_100 on,
    or TRITON_PTXAS_PATH / TRITON_PTXAS_BLACKWELL_PATH), or None where there is none."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        path = get_ptxas(arch_of(arch)).path
    except (ImportError, RuntimeError):  # no NVIDIA backend, or "Cannot find ptxas" (none in the wheel nor set)
        return None
    return path if path and os.path.isfile(path) else None


def _signature(kernel: str, scheme: str, dtype: torch.dtype, cfg: GemmConfig, tma: bool, extra: dict | None = None,
               types: dict | None = None):
    """-> (the GEMM kernel, its runtime parameters' types, its constexprs, its compile attributes). types: parameter
    types that replace the ones derived here ({"w": "*u8"}: weights stored as bytes)."""
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
    sig = {}  # the runtime parameters' types (compile_report marks the constexprs)
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
    unknown = set(types or {}) - set(sig)
    if unknown:
        raise KeyError(f"{fn.__name__} has no runtime parameters {sorted(unknown)}")
    sig.update(types or {})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
             for n, t in sig.items() if t.startswith("*") or n in aligned}
    return fn, sig, const, attrs


def gemm_report(kernel: str, scheme: str, dtype: torch.dtype, cfg: GemmConfig, arch=90, tma: bool | None = None,
                extra: dict | None = None, types: dict | None = None) -> CompileReport:
    """A grouped GEMM kernel ("gate_up" | "down" | "down_persistent", its tile ``cfg``) compiled for ``arch``.
    tma: weights (and the down's rows) through tensor descriptors; None: where the target has TMA (sm_90 on).
    extra: constexprs over the defaults here (MASKED, SPLIT_K, ...). types: parameter types over the derived ones,
    as a weight-only FP8 form needs on sm_80 / sm_86, where Triton refuses fp8e4nv ({"w": "*u8"})."""
    arch = arch_of(arch)
    tma = arch >= 90 if tma is None else tma
    fn, sig, const, attrs = _signature(kernel, scheme, dtype, cfg, tma, extra, types)
    return compile_report(fn, sig, const, attrs, cfg.num_warps, cfg.num_stages, arch)


def register_usage(kernel: str, scheme: str, dtype: torch.dtype, cfg: GemmConfig, tma: bool = True,
                   extra: dict | None = None):
    """-> (registers per thread, spill-store bytes) of the kernel compiled for sm_90a (gemm_report)."""
    report = gemm_report(kernel, scheme, dtype, cfg, 90, tma, extra)
    return report.registers, report.spill_bytes


def gemm_ptx(kernel: str, scheme: str, dtype: torch.dtype, cfg: GemmConfig, tma: bool = True,
             extra: dict | None = None, arch=90) -> str:
    """register_usage's kernel compiled for sm_90a (or ``arch``) -> its PTX (tests count instructions in it)."""
    fn, sig, const, attrs = _signature(kernel, scheme, dtype, cfg, tma, extra)
    return _compile_ptx(fn, sig, const, attrs, cfg.num_warps, cfg.num_stages, arch)


def fused_layer_report(scheme: str, dtype: torch.dtype, cfg, tma: bool = True, top_k: int = 8,
                       arch=90) -> CompileReport:
    """gemm/fused_layer.py's kernel compiled for ``arch`` with FusedConfig ``cfg`` (PDL only from sm_90 on)."""
    from ..kernels.gemm.fused_layer import _fused_layer_kernel as fn
    arch = arch_of(arch)
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
                 DOT_IEEE=dtype == torch.float32 and q == 0, ROUND_IN_FP32=False, PDL=arch >= 90)
    aligned = {"H", "I", "stride_x", "stride_out", "stride_w13e", "stride_w13n", "stride_w2e", "stride_w2n",
               "w13_rows", "w2_rows"}  # specialized as multiples of 16
    sig = {n: t for n, t in sig.items() if n not in const}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t.startswith("*") or n in aligned}
    return compile_report(fn, sig, const, attrs, cfg.num_warps, cfg.num_stages, arch)


def fused_layer_usage(scheme: str, dtype: torch.dtype, cfg, tma: bool = True, top_k: int = 8):
    """gemm/fused_layer.py's kernel compiled for sm_90a with FusedConfig ``cfg`` -> (registers per thread, spill-store
    bytes, whether its dots run as wgmma)."""
    report = fused_layer_report(scheme, dtype, cfg, tma, top_k, 90)
    return report.registers, report.spill_bytes, "wgmma.mma_async" in report.ptx


def compile_report(fn, signature: dict, constexprs: dict, attrs: dict | None = None, num_warps: int = 4,
                   num_stages: int = 3, arch=90, maxnreg: int | None = None) -> CompileReport:
    """Compile a @triton.jit (or @gluon.jit) kernel for ``arch`` here, no GPU needed -> its CompileReport.

    signature: every non-constexpr parameter's Triton type ("*bf16", "i32", "fp32",
    "tensordesc<fp8e4nv[128, 128]>"); constexprs: the constexpr values (defaults fill the rest); attrs: compile
    attributes (divisible). Raises triton's CompilationError for code only the CPU interpreter accepts, or that the
    target lacks (fp8e4nv before sm_89, TMA and PDL before sm_90, Gluon's wgmma off sm_90).
    """
    arch = arch_of(arch)
    compiled = compile_kernel(fn, signature, constexprs, attrs, num_warps, num_stages, arch, maxnreg)
    ptx = compiled.asm["ptx"]
    regs, spill, notes = ptxas_report(ptx, arch)
    return CompileReport(arch, compiled.metadata.shared, regs, spill, ptx, tuple(notes))


def compile_kernel(fn, signature: dict, constexprs: dict, attrs: dict | None = None, num_warps: int = 4,
                   num_stages: int = 3, arch=90, maxnreg: int | None = None):
    """triton.compile of compile_report's arguments -> the compiled kernel (its asm: "ptx", "cubin"; its
    metadata.shared). A Gluon kernel takes no num_stages (its pipelining is its own), and a num_warps constexpr
    parameter of one is given ``num_warps``."""
    from triton.backends.compiler import GPUTarget
    arch = arch_of(arch)
    if ptxas_path(arch) is None:
        raise FileNotFoundError(f"this triton build ships no ptxas for {gpu_name(arch)}")
    gluon = fn.is_gluon() if hasattr(fn, "is_gluon") else False
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as Source
        if "num_warps" in fn.arg_names:
            constexprs = dict(constexprs, num_warps=num_warps)
        options = {"num_warps": num_warps}
    else:
        from triton.compiler import ASTSource as Source
        options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg:
        options["maxnreg"] = maxnreg
    sig, const = _typed(fn, signature, constexprs)
    return triton.compile(Source(fn=fn, signature=sig, constexprs=const, attrs=attrs or {}),
                          target=GPUTarget("cuda", arch, 32), options=options)


def compile_for_hopper(fn, signature: dict, constexprs: dict, attrs: dict | None = None, num_warps: int = 4,
                       num_stages: int = 3):
    """compile_report at sm_90a -> (registers per thread, spill-store bytes)."""
    report = compile_report(fn, signature, constexprs, attrs, num_warps, num_stages, 90)
    return report.registers, report.spill_bytes


def _compile_ptx(fn, signature: dict, constexprs: dict, attrs: dict | None, num_warps: int, num_stages: int,
                 arch=90) -> str:
    """compile_for_hopper's compilation -> the PTX for sm_90a (or ``arch``)."""
    return compile_kernel(fn, signature, constexprs, attrs, num_warps, num_stages, arch).asm["ptx"]


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


def gluon_compiled(fn, signature: dict, constexprs: dict, num_warps: int, maxnreg: int | None = None, aligned=(),
                   arch=90):
    """triton.compile of a @gluon.jit kernel for sm_90a, or ``arch`` (compile_gluon_for_hopper's arguments) -> the
    compiled kernel: its asm, and its metadata.shared, the bytes of shared memory a program takes (its allocations and
    the compiler's scratch for layout changes; at most SM90_SHARED_BYTES on an H100 / H200)."""
    return compile_kernel(fn, signature, constexprs, divisible(fn, aligned), num_warps, arch=arch, maxnreg=maxnreg)


def _typed(fn, signature: dict, constexprs: dict) -> tuple[dict, dict]:
    """(every parameter's type, "constexpr" for the constexprs; the constexpr values, defaults filled in)."""
    const = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    const.update(constexprs)
    return {name: ("constexpr" if name in const else signature[name]) for name in fn.arg_names}, const


def ptxas_report(ptx: str, arch=90) -> tuple[int, int, list[str]]:
    """Assemble PTX for sm_90a (or ``arch``) with the ptxas triton uses for it, `ptxas -v --gpu-name=<gpu_name>`
    -> (registers per thread, spill-store bytes, the lines ptxas printed with a message code, like C7514)."""
    ptxas = ptxas_path(arch)
    if ptxas is None:
        raise FileNotFoundError(f"this triton build ships no ptxas for {gpu_name(arch)}")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, "-v", f"--gpu-name={gpu_name(arch)}", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=False)
    if res.returncode:
        raise RuntimeError(f"ptxas for {gpu_name(arch)} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores", res.stderr)
    notes = [line for line in res.stderr.splitlines() if re.search(r"\(C\d+\)", line)]
    return int(regs.group(1)), int(spill.group(1)) if spill else 0, notes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moeflow.tune.registers",
                                     description="registers and spills of the GEMM tiles on one NVIDIA target")
    parser.add_argument("--arch", default="90", help="80, 86, 89, 90, 100 or 120 (or sm_90a ...): default 90")
    arch = arch_of(parser.parse_args(argv).arch)
    rows = [("gate_up", "none", GemmConfig(128, 128, 64, 8, 8, 3)),
            ("gate_up", "fp8-block", GemmConfig(64, 128, 128, 8, 8, 4)),
            ("gate_up", "fp8-block", GemmConfig(128, 128, 128, 8, 8, 4)),
            ("down", "none", GemmConfig(128, 256, 64, 8, 8, 3)),
            ("down", "fp8-block", GemmConfig(128, 128, 128, 8, 8, 3))]
    other = arch != 90  # elsewhere also the shared memory a program takes (with pointer operands), in KiB
    if other:
        print(f"{gpu_name(arch)} (ptxas: {ptxas_path(arch)})")
    print("kernel   scheme      tile            regs  spill bytes (TMA / pointers)" + "   shared KiB" * other)
    for kernel, scheme, cfg in rows:
        tile = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps}"
        if scheme != "none" and arch < 89:
            print(f"{kernel:8} {scheme:11} {tile:15} (FP8 operands need sm_89 on)")
            continue
        t = gemm_report(kernel, scheme, torch.bfloat16, cfg, arch, tma=True) if arch >= 90 else None
        p = gemm_report(kernel, scheme, torch.bfloat16, cfg, arch, tma=False)
        tma = f"{t.registers:4} {t.spill_bytes:5}" if t else f"{'-':>4} {'-':>5}"
        print(f"{kernel:8} {scheme:11} {tile:15} {tma}   /  {p.registers:4} {p.spill_bytes:5}"
              + f"   {p.shared_bytes / 1024:8.1f}" * other)


if __name__ == "__main__":
    main()
