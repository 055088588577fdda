"""Mid-size layers (T=128) with the first experts' gate_up weights asked of the L2 before routing, against the
layer as shipped.

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD python benchmarks/experiments/t128_prefetch.py [OUT.json]

Why: at T=128 the GEMMs stream weights at the HBM rate (Qwen3 bf16 gate_up 4.34 TB/s), but they start only after
routing and the sort (7-9 µs, three launches; triton_2026-12-01_h200_3acc8ad.md, section 3), and HBM is idle until
then. Unlike decode (decode_prefetch_2026-11-30_h200.md: the decode gate_up streams at 2.4 TB/s even from L2), these
GEMMs are bound by HBM, so bytes found in L2 should shorten them. Nearly every expert has tokens at T=128, and the
gate_up's first programs take the lowest row blocks, i.e. the lowest experts; so the plan is static (no routing
needed): bytes of experts 0, 1, ... of gate_up_proj (gate rows 0..R and up rows I..I+R of each, whole experts while
they fit), then their scales, up to a budget. The requests (cp.async.bulk.prefetch.L2, CHUNK bytes each) are made by
a small kernel launched before the router, either on a side stream (a parallel graph branch: not in the chain) or in
the chain (PDL launch). Outputs are checked bit-equal to the shipped layer's. Whole layer as one CUDA graph,
do_bench (L2 flushed, median) and the clean-flush figure; variants alternate over two rounds.
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from bench_layer import Case  # noqa: E402
from moeflow.benchmark import clean_graph_us, graph_us  # noqa: E402
from moeflow.experts import create_runner  # noqa: E402
from moeflow.kernels.common import pdl, pdl_start  # noqa: E402
from moeflow.layer import routed_experts  # noqa: E402

CHUNK = 16384
BLOCK = 64
MB = 1 << 20
CASES = [("qwen3-30b-a3b", "none", 128), ("qwen3-30b-a3b", "fp8-block", 128), ("mixtral-8x7b", "none", 128),
         ("mixtral-8x7b", "fp8-block", 128), ("deepseek-v3", "fp8-block", 128), ("qwen3-30b-a3b", "none", 1024)]
VARIANTS = [("side 12MB", 12 * MB, "side"), ("side 24MB", 24 * MB, "side"), ("side 36MB", 36 * MB, "side"),
            ("chain 24MB", 24 * MB, "chain")]


@triton.jit
def _bulk_prefetch_kernel(addr_ptr, size_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Request i (addr [n] int64 absolute, size [n] int32, multiples of 16): one L2 bulk prefetch; nothing waited."""
    pdl_start(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    addr = tl.load(addr_ptr + i, mask=ok, other=0)
    size = tl.load(size_ptr + i, mask=ok, other=0)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, size, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


def plan_ranges(w, budget: int):
    """(absolute address, bytes) ranges of experts 0, 1, ... of gate_up_proj w.w13 [E, 2I, H] (whole experts while
    they fit, then gate rows 0..R and up rows I..I+R of the next), their w13_scale blocks, within budget bytes."""
    w13 = w.w13
    e_num, two_i, h = w13.shape
    i_half = two_i // 2
    row_bytes = h * w13.element_size()
    ranges, left = [], budget
    for e in range(e_num):
        base = w13.data_ptr() + e * w13.stride(0) * w13.element_size()
        whole = two_i * row_bytes
        if whole <= left:
            ranges.append((base, whole))
            left -= whole
        else:
            r = left // (2 * row_bytes)
            if r:
                ranges.append((base, r * row_bytes))
                ranges.append((base + i_half * row_bytes, r * row_bytes))
            left = 0
        if w.w13_scale is not None:
            s = w.w13_scale
            ranges.append((s.data_ptr() + e * s.stride(0) * s.element_size(), s[0].numel() * s.element_size()))
        if left <= 0:
            break
    addr, size = [], []
    for a, n in ranges:
        n = n // 16 * 16
        for off in range(0, n, CHUNK):
            addr.append(a + off)
            size.append(min(CHUNK, n - off))
    dev = w13.device
    return (torch.tensor(addr, dtype=torch.int64, device=dev), torch.tensor(size, dtype=torch.int32, device=dev))


def launch(req, chain: bool):
    addr, size = req
    n = addr.numel()
    _bulk_prefetch_kernel[(triton.cdiv(n, BLOCK),)](addr, size, n, BLOCK=BLOCK, num_warps=2, **(pdl(addr.device) if chain else {}))


def layer_fn(case, runner, x, logits, req, where, side):
    plan = case.use(runner)

    def fn():
        main = torch.cuda.current_stream()
        if where == "side":
            side.wait_stream(main)
            with torch.cuda.stream(side):
                launch(req, False)
        elif where == "chain":
            launch(req, True)
        ids, w = case.router(logits, case.bias)
        out = routed_experts(plan, case.dispatcher, runner, x, ids, w, case.weights)[0]
        if where == "side":
            main.wait_stream(side)
        return out
    return fn


def main():
    out = {}
    side = torch.cuda.Stream()
    for preset, scheme, t in CASES:
        torch.cuda.empty_cache()
        case = Case(preset, scheme)
        runner = create_runner("triton", case.cfg.replace(runner="triton"), case.scheme)
        x, logits = case.inputs(t, 1)[0]
        variants = {"shipped": (None, "")}
        for label, b, where in VARIANTS:
            variants[label] = (plan_ranges(case.weights, b), where)
        ref = layer_fn(case, runner, x, logits, None, "", side)()
        for k, (req, where) in variants.items():
            got = layer_fn(case, runner, x, logits, req, where, side)()
            torch.cuda.synchronize()
            assert torch.equal(got, ref), (preset, scheme, t, k)
        times = {k: [] for k in variants}
        clean = {k: [] for k in variants}
        for _ in range(2):
            for k, (req, where) in variants.items():
                fn = layer_fn(case, runner, x, logits, req, where, side)
                times[k].append(round(graph_us(fn), 2))
                clean[k].append(round(clean_graph_us(fn), 2))
        name = f"{preset} {scheme} T={t}"
        out[name] = dict(do_bench=times, clean=clean)
        print(name, {k: (min(v), min(clean[k])) for k, v in times.items()}, flush=True)
        del case, runner
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)
    keys = list(next(iter(out.values()))["do_bench"])
    print("\ndo_bench µs (best of 2) / clean-flush µs")
    print("| row | " + " | ".join(keys) + " |")
    for name, r in out.items():
        print(f"| {name} | " + " | ".join(f"{min(r['do_bench'][k]):.1f} / {min(r['clean'][k]):.1f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
