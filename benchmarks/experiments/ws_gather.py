"""Experiment (GPU): the bf16 warp-specialized gate_up (kernels/warp_specialized.py) reading its rows by index,
gathered by the loader partition with cp.async (weights still by TMA), against the shipped path, which first
copies the R rows in order (gate_up._rows_in_order: one scatter launch) and reads the copy by TMA. Kernel times
from a CUDA graph, ROUNDS rounds by turns; the gathered output is compared bit for bit with the shipped kernel's on
the copy.

    PYTHONPATH=$PWD ROUNDS=3 python benchmarks/experiments/ws_gather.py OUT_DIR VERSION_FILE [preset:T ...]

VERSION_FILE: a version of warp_specialized.py whose launch() takes source_rows= (rows by index: a is then the T
token rows), regs=(consumer, loader) registers and gather_warps= (the loader partition's warps). Each case uses the
shipped table's gate_up config, which must be warp-specialized. Writes ws_gather.json under OUT_DIR.
"""
import importlib.util
import json
import os
import statistics
import sys

import torch

from moeflow.kernels.autotune import graph_time_ms, random_weights
from moeflow.kernels.common import ACT_CODES
from moeflow.kernels.gate_up import _rows_in_order

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import gemm_case  # noqa: E402

CASES = [("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384), ("mixtral-8x7b", 1024), ("mixtral-8x7b", 2048)]
ROUNDS = int(os.environ.get("ROUNDS", "3"))
# (consumer, loader) registers, loader warps
VARIANTS = [((232, 24), 4), ((216, 56), 4), ((216, 56), 2)]


def load(path: str):
    spec = importlib.util.spec_from_file_location("moeflow.kernels._ws_gather_version", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main():
    from moeflow.kernels import warp_specialized as shipped
    out_dir, path = sys.argv[1], sys.argv[2]
    cases = [(p, int(t)) for p, t in (c.split(":") for c in sys.argv[3:])] or CASES
    mod = load(path)
    dev = torch.device("cuda")
    act = ACT_CODES["silu"]
    results = []
    for preset, t in cases:
        shape, batch, layout, kcfg = gemm_case(preset, "none", t, dev, indexed=True)
        cfg = kcfg.gate_up
        w = random_weights(shape, dev).w13
        x, src, copy_rows = batch.hidden, batch.source_rows, batch.copy_rows
        r, i = src.numel(), shape.inter
        row = dict(preset=preset, T=t, cfg=str(cfg), R=r)
        if not cfg.warp_specialize:
            row["error"] = "the table's gate_up here is not warp-specialized"
            results.append(row)
            print(preset, t, row["error"], flush=True)
            continue
        want = torch.empty(r, i, dtype=x.dtype, device=dev)
        got = torch.empty_like(want)
        xc = _rows_in_order(x, None, src, copy_rows)[0]
        runs = {"copy+tma": lambda: shipped.launch(_rows_in_order(x, None, src, copy_rows)[0], w, None, layout, cfg,
                                                   want, gated=True, act=act),
                "tma (copy made)": lambda: shipped.launch(xc, w, None, layout, cfg, want, gated=True, act=act)}
        for regs, warps in VARIANTS:
            runs[f"gather {regs[0]}/{regs[1]} w{warps}"] = (lambda regs=regs, warps=warps: mod.launch(
                x, w, None, layout, cfg, got, gated=True, act=act, source_rows=src, regs=regs, gather_warps=warps))
        runs["tma (copy made)"]()
        torch.cuda.synchronize()
        valid = layout.valid_rows()
        for name, fn in runs.items():
            if name.startswith("gather"):
                got.fill_(float("nan"))
                try:
                    fn()
                    torch.cuda.synchronize()
                    row[name + " bit_equal"] = bool(torch.equal(got[valid], want[valid]))
                    row[name + " max_err"] = float((got[valid].float() - want[valid].float()).abs().max())
                except Exception as exc:  # recorded, not fatal
                    row[name + " error"] = repr(exc)[:300]
        for _ in range(ROUNDS):
            for name, fn in runs.items():
                if name + " error" in row:
                    continue
                row.setdefault(name, []).append(round(graph_time_ms([fn], 40) * 1e3, 1))
        row["median_us"] = {n: statistics.median(row[n]) for n in runs if n in row}
        results.append(row)
        print(f"{preset:14} T={t:6} {cfg}", flush=True)
        print("   ", {k: v for k, v in row.items() if "bit_equal" in k or "error" in k or "max_err" in k},
              row["median_us"], flush=True)
        del batch, w, x, xc, want, got
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "ws_gather.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
