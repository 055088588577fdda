"""Why transformers' "moeflow" experts call runs slower than the same layer in a replaced block
(hf_bench: prefill 1x512 52k against 67k tokens/s, decode batch 1 145 against 175, ce1d9b4): the host
synchronizations of one forward per implementation, with where each came from, and the host time of one
forward.

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD python benchmarks/experiments/hf_syncs.py

Prints, per implementation and token count, the synchronizing calls torch reports
(torch.cuda.set_sync_debug_mode("warn")) with the moeflow / transformers frames that made them, the experts
modules' _is_expert_parallel flags, and the median host time of a forward (not synchronized) against its
synchronized time.
"""
from __future__ import annotations

import statistics
import sys
import time
import traceback
import warnings

import torch
import transformers

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_hf import model_config, use_implementation  # noqa: E402


def syncs_of(fn) -> list[str]:
    found = []

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "moeflow" in f.filename or "transformers" in f.filename]
        where = " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in frames[-4:][::-1])
        found.append(f"{str(message)[:80]} @ {where}")

    old = warnings.showwarning
    warnings.showwarning = show
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old
    return found


def host_us(fn, calls=10) -> tuple[float, float]:
    fn()
    torch.cuda.synchronize()
    host, synced = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        synced.append(time.perf_counter() - t0)
    return statistics.median(host) * 1e6, statistics.median(synced) * 1e6


@torch.no_grad()
def main() -> int:
    print("transformers", transformers.__version__)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(model_config(4, False), dtype=torch.bfloat16).eval()
    flags = {type(m).__name__: getattr(m, "_is_expert_parallel", "absent") for m in model.modules()
             if hasattr(m, "gate_up_proj")}
    print("experts modules' _is_expert_parallel:", flags)
    for name in ("grouped_mm", "moeflow", "moeflow-block"):
        use_implementation(model, name)
        for t in (1, 512):
            ids = torch.randint(0, 32000, (1, t), device="cuda")
            fwd = lambda: model(ids, use_cache=False)
            fwd()
            torch.cuda.synchronize()
            found = syncs_of(fwd)
            host, synced = host_us(fwd)
            print(f"{name:14s} T={t:<4d} host {host:8.1f} us  synced {synced:8.1f} us  syncs {len(found)}")
            for s in sorted(set(found)):
                print(f"    {found.count(s)}x {s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
