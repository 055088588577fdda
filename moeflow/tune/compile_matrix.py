"""The compile matrix: every Triton kernel and tile the planner can pick on a target, compiled for it without a GPU.

``python -m moeflow.tune.compile_matrix --arch sm_80 [--json PATH]`` (outside Triton's interpreter) makes Triton's
active driver a stand-in for a GPU of that architecture and turns every launch into a compile (JITFunction.run with
warmup): the real launchers then run on CPU tensors under MOEFLOW_KERNEL_ARCH, so each kernel is compiled with the
constexprs and tiles the kernel choice gives there (model shapes x schemes x layouts x batch sizes), plus the routers,
sorts, quantization, top-k sum and expert-parallel row kernels. Each compiled kernel's shared memory must fit the target (Target.shared_bytes) and
its registers one SM's 64K (ptxas for that target); spills are reported. tests/kernels/test_compile_matrix.py runs it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from dataclasses import asdict, dataclass

import torch

# (preset, H, I, E, K): the three model shapes of the benchmarks and a small odd one (I not a multiple of 128 * 2)
SHAPES = (("qwen3-30b-a3b", 2048, 768, 128, 8), ("deepseek-v3", 7168, 2048, 256, 8),
          ("mixtral-8x7b", 4096, 14336, 8, 2), ("small", 384, 640, 8, 2))
# batch sizes reaching every row of the tile rules (rows an expert m <= 16, <= 128, more: tiles.default_config; the
# Hopper rules' rows: sm90_tiles.RULES) on these shapes
TOKENS = (1, 128, 1024, 16384)
SCHEMES = ("none", "fp8-tensor", "fp8-channel", "fp8-block")
REGISTERS_PER_SM = 65536


@dataclass
class Compiled:
    kernel: str
    num_warps: int
    num_stages: int
    shared_bytes: int
    registers: int
    spill_bytes: int
    fits: bool


def _stand_in_driver(sm: int):
    """A Triton driver for a GPU of compute capability ``sm`` (80, ...) that compiles only: launches become compiles
    (JITFunction.run with warmup=True, which returns the compiled kernel); the compiled kernels are listed."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class StandIn:
        def get_current_target(self):
            return GPUTarget("cuda", sm, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(StandIn())
    compiled = {}
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        if id(kernel) not in compiled and os.environ.get("MOEFLOW_COMPILE_MATRIX_VERBOSE"):
            print(f"compiled {self.fn.__name__} ({len(compiled) + 1})", file=sys.stderr, flush=True)
        compiled[id(kernel)] = (self.fn.__name__, kernel)
        return kernel

    JITFunction.run = compile_only
    return compiled


def _cases(target):
    """Launch (compile-only) every GEMM configuration the kernel choice gives on ``target``."""
    from ..config import MoEConfig
    from ..experts.triton import TritonRunner
    from ..experts.base import ExpertWeights
    from ..layouts import MASKED, SORTED
    from ..quant import create_scheme
    cpu = torch.device("cpu")
    # off Hopper the tile rules read no shape (tiles.default_config): one model shape and the odd one cover them
    shapes = SHAPES if target.gluon else (SHAPES[0], SHAPES[-1])
    for preset, h, i, e, k in shapes:
        for scheme in SCHEMES:
            if scheme == "fp8-block" and (h % 128 or i % 128):
                continue
            # float32 layers (4-byte operands: other stage counts) on the small shape, where their tiles differ
            dtypes = (torch.bfloat16, torch.float32) if preset == "small" and scheme in ("none", "fp8-block") \
                else (torch.bfloat16,)
            for dtype in dtypes:
                cfg = MoEConfig(num_experts=e, hidden_size=h, intermediate_size=i, top_k=k, quant=scheme, dtype=dtype)
                sch = create_scheme(scheme, weight_only=not target.fp8_dots)
                runner = TritonRunner(cfg, sch)
                w13, s13, w2, s2 = _weights(e, h, i, sch, dtype)
                weights = ExpertWeights(w13, w2, s13, s2)
                for t in TOKENS:
                    kcfg = runner._fit(runner._entry_for(t, e, i, h, cpu), i, h)
                    # the masked layout (a MASKED constexpr: the same tiles) at one batch size a shape
                    for layout in (SORTED, MASKED) if t == TOKENS[1] else (SORTED,):
                        if os.environ.get("MOEFLOW_COMPILE_MATRIX_VERBOSE"):
                            print(f"case {preset} {scheme} {dtype} T={t} {layout}: {kcfg}", file=sys.stderr, flush=True)
                        batch = _batch(layout, e, h, k, dtype, sch)
                        runner.run_with(batch, weights, kcfg)
                    fused = runner._fused_tiles(t, runner._entry_for(t, e, i, h, cpu))
                    if fused is not None and not sch.weight_only:  # the plan runs no one-launch layer weight-only
                        _fused(runner, weights, h, e, k, dtype, fused)


def _weights(e, h, i, sch, dtype):
    """Stride-0 expert weights (one expert's storage) of the scheme: w13 [E, 2I, H], w2 [E, H, I] and scales."""
    store = torch.float8_e4m3fn if sch.quantized else dtype
    w13 = torch.zeros(1, 2 * i, h, dtype=store).expand(e, -1, -1)
    w2 = torch.zeros(1, h, i, dtype=store).expand(e, -1, -1)
    s13 = s2 = None
    if sch.quantized:
        s13 = torch.ones(sch.weight_scale_shape(1, 2 * i, h)).expand(e, *sch.weight_scale_shape(1, 2 * i, h)[1:])
        s2 = torch.ones(sch.weight_scale_shape(1, h, i)).expand(e, *sch.weight_scale_shape(1, h, i)[1:])
    return w13, s13, w2, s2


def _batch(layout, e, h, k, dtype, sch):
    """A small batch of the layout: 4 copies an expert (sorted, rows by index) or a capacity of 4 (masked)."""
    from ..layouts import MASKED, ExpertBatch
    if layout == MASKED:
        hidden = torch.zeros(e, 4, h, dtype=dtype)
        counts = torch.full((e,), 2, dtype=torch.int32)
        return ExpertBatch(MASKED, hidden, torch.ones(e, 4), counts)
    rows = 4 * e
    offsets = torch.arange(0, rows + 1, 4, dtype=torch.int64)
    tokens = max(rows // k, 1)
    source = torch.arange(rows, dtype=torch.int64) % tokens
    return ExpertBatch("sorted", torch.zeros(tokens, h, dtype=dtype), torch.ones(rows),
                       torch.full((e,), 4, dtype=torch.int32), offsets=offsets, source_rows=source)


def _fused(runner, weights, h, e, k, dtype, fused):
    from ..kernels.gemm.fused_layer import counters_size, fused_layer
    cfg = runner.config
    x = torch.zeros(1, h, dtype=dtype)
    ids = torch.zeros(1, k, dtype=torch.int32)
    sync = torch.zeros(counters_size(1, k, h, cfg.intermediate_size, fused), dtype=torch.int32)
    fused_layer(x, ids, torch.ones(1, k), weights.w13, weights.w13_scale, weights.w2, weights.w2_scale,
                runner.scheme.name, cfg.activation, dtype, fused, sync)


def _glue(target):
    """The kernels around the runner: routers (one launch, streamed), sorts, quantization, the top-k sum."""
    from ..kernels.routing.route import route
    from ..kernels.rows.align import sort_copies
    from ..kernels.rows.ep_sort import sort_copies_by_expert
    from ..kernels.rows.reduce import moe_sum
    for t, e, groups in ((4, 8, 1), (4, 256, 8), (4096, 128, 1), (4096, 256, 8)):
        logits = torch.zeros(t, e)
        for scoring, bias in (("softmax", None), ("sigmoid", torch.zeros(e))):
            route(logits, bias, 8 if e > 8 else 2, scoring, True, num_groups=groups,
                  topk_groups=min(groups, 4))
    schemes = SCHEMES if target.fp8_dots else ("none",)  # the sorts quantize only where FP8 is (triton_glue)
    for scheme in schemes:
        x = None if scheme == "none" else torch.zeros(4, 256, dtype=torch.bfloat16)
        sort_copies(torch.zeros(4, 2, dtype=torch.int32), torch.ones(4, 2), 8, x, scheme)
        x = None if scheme == "none" else torch.zeros(600, 256, dtype=torch.bfloat16)
        sort_copies_by_expert(torch.zeros(600, 8, dtype=torch.int32), torch.ones(600, 8), 128, 4800, x=x,
                              scheme=scheme)
    moe_sum(torch.zeros(8, 256, dtype=torch.bfloat16), torch.arange(8).view(4, 2), 2)
    _expert_parallel(target)


def _expert_parallel(target):
    """The expert-parallel dispatchers' row kernels (kernels/rows/ep_rows.py): ranking, packing (layer dtype, and an
    FP8 payload where FP8 is), the blank tails of fixed blocks, the masked scatter."""
    from ..dispatch._ep_rows import RowCodec
    from ..kernels.rows import ep_rows
    from ..quant import create_scheme
    t, k, h, e, world = 6, 2, 256, 8, 2
    ids = torch.zeros(t, k, dtype=torch.int32)
    expert_rank = torch.arange(e, dtype=torch.int64) % world
    expert_local = torch.arange(e, dtype=torch.int64) // world
    for block in (0, 8):
        ep_rows.rank_rows(ids, expert_rank, world, block)
    payloads = (None, create_scheme("fp8-channel"), create_scheme("fp8-block")) if target.fp8_dots else (None,)
    for payload in payloads:
        codec = RowCodec(h, k, torch.bfloat16, payload)
        buf = torch.zeros(world * 8, codec.row_bytes, dtype=torch.uint8)
        x = torch.zeros(t, h, dtype=torch.bfloat16)
        tokens, scale = codec.encode(x)
        dest = torch.zeros(t, world, dtype=torch.int64)
        ep_rows.pack_rows(codec.unpack(buf), tokens, scale, ids, torch.ones(t, k), dest, expert_rank, expert_local)
        ep_rows.blank_rows(buf, torch.zeros(world, dtype=torch.int64), 8, codec.blank_row("cpu"))
        ep_rows.masked_scatter(codec.unpack(buf), torch.zeros(world * 8 * k, dtype=torch.int64), e // world, 16)


def run(arch: str) -> list[Compiled]:
    """Compile the matrix for ``arch`` (moeflow.targets name) -> one Compiled a distinct kernel compilation."""
    os.environ["MOEFLOW_KERNEL_ARCH"] = arch
    from ..targets import BY_ARCH
    from .registers import ptxas_report
    target = BY_ARCH[arch]
    compiled = _stand_in_driver(target.sm)
    warnings.filterwarnings("ignore", message="moeflow: no tuned")  # the defaults are what is compiled
    _cases(target)
    _glue(target)
    out = []
    for name, kernel in compiled.values():
        md = kernel.metadata
        regs, spill, _ = ptxas_report(kernel.asm["ptx"], target.sm)
        fits = md.shared <= target.shared_bytes and regs * 32 * md.num_warps <= REGISTERS_PER_SM
        out.append(Compiled(name, md.num_warps, md.num_stages, md.shared, regs, spill, fits))
    return out


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run the compile matrix outside Triton's interpreter (TRITON_INTERPRET=0)")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", required=True, help="sm_80 | sm_86 | sm_89 | sm_90 | sm_100 | sm_120")
    p.add_argument("--json", help="write the compiled kernels here")
    args = p.parse_args(argv)
    rows = run(args.arch)
    for r in sorted(rows, key=lambda r: (r.kernel, -r.shared_bytes)):
        print(f"{r.kernel:28} warps {r.num_warps:2} stages {r.num_stages} shared {r.shared_bytes:7} "
              f"regs {r.registers:3} spill {r.spill_bytes:5} {'ok' if r.fits else 'DOES NOT FIT'}")
    bad = [r for r in rows if not r.fits]
    print(f"{args.arch}: {len(rows)} kernels compiled, {len(bad)} do not fit")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
