"""Timeline of one launch of the one-launch layer (kernels/fused_layer.py): per work item, when its program took
the ticket, when a down item's wait ended, when it finished and on which SM (%globaltimer, %smid). One H200.

    PYTHONPATH=$PWD OUT=DIR python benchmarks/experiments/fused_trace.py [preset:scheme:T[:field=value,...] ...]

The kernel is traced from a patched copy of fused_layer.py written next to it at run time (the shipped kernel has
no trace stores); the patched copy's output is checked equal to the runner's one launch with the same tiles. Launches are made after a
flush of L2, 5 times; the last is reported. Writes fused_trace.json (every item) under OUT; prints per-phase
summaries last.
"""
import importlib
import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
CASES = ["qwen3-30b-a3b:none:1", "qwen3-30b-a3b:fp8-block:1", "deepseek-v3:fp8-block:1"]

GTIME = '''
@triton.jit
def _gtime(x):
    """(%globaltimer ns, %smid) of the calling program; x: any int32 scalar (inline asm needs an operand)."""
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1)
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)
    return t, sm

'''
PATCHES = [  # (old, new), each old text must occur exactly once
    ("@triton.jit\ndef _row_operand", GTIME + "@triton.jit\ndef _row_operand"),
    ("    acc = tl.zeros((BLOCK_N2, 16), dtype=tl.float32)  # transposed, as gate_up's",
     "    tw, _sm = _gtime(t)\n    acc = tl.zeros((BLOCK_N2, 16), dtype=tl.float32)  # transposed, as gate_up's"),
    ("                tl.store(sync_ptr + 2 + cc, tl.zeros((128,), dtype=tl.int32), mask=cc < T * TOP_K)",
     "                tl.store(sync_ptr + 2 + cc, tl.zeros((128,), dtype=tl.int32), mask=cc < T * TOP_K)\n    return tw"),
    ("out_ptr, sync_ptr,\n        T, H, I,", "out_ptr, sync_ptr, trace_ptr,\n        T, H, I,"),
    ("    item = tl.atomic_add(sync_ptr, 1, sem=\"relaxed\")\n",
     "    item = tl.atomic_add(sync_ptr, 1, sem=\"relaxed\")\n    t0, sm = _gtime(item)\n    tw = t0\n"),
    ("        _down_item(item - items1,", "        tw = _down_item(item - items1,"),
    ("    pdl_launch(PDL)\n\n\ndef counters_size",
     "    t1, _sm = _gtime(item)\n    tl.store(trace_ptr + item * 4, t0)\n    tl.store(trace_ptr + item * 4 + 1, tw)\n"
     "    tl.store(trace_ptr + item * 4 + 2, t1)\n    tl.store(trace_ptr + item * 4 + 3, sm.to(tl.int64))\n"
     "    pdl_launch(PDL)\n\n\ndef counters_size"),
    ("                poison: bool = False) -> Tensor:", "                poison: bool = False, trace=None) -> Tensor:"),
    ("x, topk_ids, topk_weights, w13_arg, s13, w2_arg, s2, inter, part1, part2, out, sync,",
     "x, topk_ids, topk_weights, w13_arg, s13, w2_arg, s2, inter, part1, part2, out, sync, trace,"),
]


def traced_module(extra=(), name="trace"):
    """fused_layer.py with the trace PATCHES and ``extra`` (old, new) pairs applied, written beside it as
    _fused_<name>_tmp.py (Triton reads a kernel's source from its file) and imported."""
    import moeflow.kernels.fused_layer as shipped
    src = open(shipped.__file__).read()
    for old, new in [*PATCHES, *extra]:
        if src.count(old) != 1:
            raise SystemExit(f"patch target found {src.count(old)} times: {old[:60]!r}")
        src = src.replace(old, new)
    path = os.path.join(os.path.dirname(shipped.__file__), f"_fused_{name}_tmp.py")
    with open(path, "w") as f:
        f.write(src)
    return importlib.import_module(f"moeflow.kernels._fused_{name}_tmp")


def traced_launch(mod, runner, case, x, ids, w, cfg, flush, repeats=5):
    """-> (output of the last of ``repeats`` launches of mod.fused_layer, each after an L2 flush, its trace
    [items, 4] int64 on the CPU, the number of gate_up items)."""
    wt = case.weights
    t, k = ids.shape
    tiles1 = t * k * -(-wt.w2.shape[2] // cfg.block_n1)
    n_items = tiles1 * cfg.split1 + t * -(-wt.w2.shape[1] // cfg.block_n2) * cfg.split2
    trace = torch.zeros(n_items, 4, dtype=torch.int64, device="cuda")
    sync = _counters(mod, case, t, k, cfg)
    for _ in range(repeats):
        flush.zero_()
        got = mod.fused_layer(x, ids.int(), w.float(), wt.w13, wt.w13_scale, wt.w2, wt.w2_scale, case.scheme.name,
                              case.cfg.activation, torch.bfloat16, cfg, sync, trace=trace)
    torch.cuda.synchronize()
    return got, trace.cpu(), tiles1 * cfg.split1


def _counters(mod, case, t: int, k: int, cfg):
    """mod.fused_layer's zeroed counters for T = t tokens, top-k k, at cfg."""
    wt = case.weights
    return torch.zeros(mod.counters_size(t, k, wt.w2.shape[1], wt.w2.shape[2], cfg), dtype=torch.int32, device="cuda")


def routed_layer(mod, case, x, logits, k: int, cfg, trace_rows: int):
    """-> a callable of no arguments, the layer a graph times: route ``logits`` [T, E], then mod.fused_layer at cfg,
    its trace written into a scratch [trace_rows, 4] int64 (traced_launch's trace shape)."""
    wt = case.weights
    sync = _counters(mod, case, x.shape[0], k, cfg)
    scratch = torch.zeros(trace_rows, 4, dtype=torch.int64, device="cuda")

    def layer():
        ids, w = case.router(logits, case.bias)
        return mod.fused_layer(x, ids.int(), w.float(), wt.w13, wt.w13_scale, wt.w2, wt.w2_scale, case.scheme.name,
                               case.cfg.activation, torch.bfloat16, cfg, sync, trace=scratch)
    return layer


def summary(tr, items1):
    """tr [items, 4] int64 (start, wait end, end, sm) -> text lines (µs from the first start)."""
    t = tr[:, :3].double()
    t0 = t[:, 0].min()
    t = (t - t0) / 1e3
    g, d = t[:items1], t[items1:]
    q = lambda v: " ".join(f"{v.quantile(p).item():6.1f}" for p in (0.0, 0.1, 0.5, 0.9, 1.0))
    lines = [f"   gate_up {items1:4d} items: start [min p10 p50 p90 max] {q(g[:, 0])} | end {q(g[:, 2])}",
             f"   down    {len(d):4d} items: start {q(d[:, 0])} | wait end {q(d[:, 1])} | end {q(d[:, 2])}",
             f"   down run (end - wait end) {q(d[:, 2] - d[:, 1])}; gate_up run {q(g[:, 2] - g[:, 0])}",
             f"   SMs used {tr[:, 3].unique().numel()}, kernel span {t[:, 2].max().item():.1f} us"]
    return lines


def routed_case(preset: str, scheme: str, tokens: int):
    """bench_layer's Case of one row, the triton runner, one batch of ``tokens`` inputs routed, and the runner's
    table FusedConfig for it -> (case, runner, x [T, H], logits [T, E], ids [T, K] int32, w [T, K] float32, table)."""
    from bench_layer import Case
    from moeflow.experts import create_runner
    case = Case(preset, scheme)
    runner = create_runner("triton", case.cfg.replace(runner="triton"), case.scheme)
    x, logits = case.inputs(tokens, 1)[0]
    ids, w = case.router(logits, case.bias)
    return case, runner, x, logits, ids, w, runner.fused_config(tokens, case.weights)


def main():
    mod = traced_module()
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    out, text = {}, []
    for spec in [a for a in sys.argv[1:]] or CASES:
        preset, scheme, t, *over = spec.split(":")
        case, runner, x, _, ids, w, cfg = routed_case(preset, scheme, int(t))
        if over:  # preset:scheme:T:field=value,...: the table's FusedConfig with those fields replaced
            cfg = replace(cfg, **{k: int(v) for k, v in (f.split("=") for f in over[0].split(","))})
        ref = runner.run_fused(x, ids, w, case.weights, cfg)
        got, tr, items1 = traced_launch(mod, runner, case, x, ids, w, cfg, flush)
        same = torch.equal(got, ref)
        out[spec] = dict(cfg=str(cfg), items1=items1, equal_to_shipped=same, trace=tr.tolist())
        text += [f"== {spec} {cfg} (output equal to shipped: {same})"] + summary(tr, items1)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "fused_trace.json"), "w"))
    print("\n".join(text))


if __name__ == "__main__":
    main()
