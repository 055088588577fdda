"""Why a compiled model without CUDA graphs (torch.compile's default mode) ran moeflow layers slower than eager
(benchmarks/results/compile_2026-12-03_h200.md: 1.2-1.6x at T = 1-64): does the op wrapper synchronize the host?

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD python benchmarks/experiments/compile_sync.py OUT_DIR

For 4 Qwen3-30B-A3B bf16 layers at T=64, eager (MOEFLOW_EAGER_GRAPHS=0) and compiled (default mode): the host time
of one unsynchronized call (median of 20) against the loop time a call, and every synchronizing CUDA call of one
compiled call, as torch.cuda.set_sync_debug_mode("warn") reports it (with the Python stack). Writes
OUT_DIR/compile_sync.json.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_overhead import Stack, loop_us  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from moeflow import MoE  # noqa: E402
from moeflow.presets import preset_config  # noqa: E402


def host_us(fn, calls=20) -> float:
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def syncs_of(fn) -> list[str]:
    found = []

    def record(message, category, filename, lineno, file=None, line=None):
        found.append(f"{message}\n" + "".join(traceback.format_stack(limit=14)[:-1]))

    old = warnings.showwarning
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
    return found


def main() -> int:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.environ["MOEFLOW_EAGER_GRAPHS"] = "0"
    torch.manual_seed(0)
    cfg = preset_config("qwen3-30b-a3b", dtype=torch.bfloat16, device="cuda", quant="none", runner="triton")
    model = Stack([MoE(cfg) for _ in range(4)]).requires_grad_(False).eval()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "commit": os.environ.get("MOEFLOW_COMMIT", "unknown")}
    with torch.inference_mode():
        for t in (1, 64):
            x = torch.randn(t, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
            compiled(x)
            for name, fn in (("eager", lambda: model(x)), ("compiled", lambda: compiled(x))):
                res[f"T{t}_{name}_host_us"] = host_us(fn)
                res[f"T{t}_{name}_loop_us"] = loop_us(fn)
                res[f"T{t}_{name}_syncs"] = syncs_of(fn)
                print(t, name, round(res[f"T{t}_{name}_host_us"]), round(res[f"T{t}_{name}_loop_us"]),
                      len(res[f"T{t}_{name}_syncs"]), flush=True)
    with open(os.path.join(out_dir, "compile_sync.json"), "w") as f:
        json.dump(res, f, indent=1)
    for key in (k for k in res if k.endswith("_syncs") and res[k]):
        print(key, res[key][0][:1500])
    return 0


if __name__ == "__main__":
    sys.exit(main())
