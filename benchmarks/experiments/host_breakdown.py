"""Where the host's time goes in an eager layer call past the eager graphs' sizes (T > MOEFLOW_EAGER_GRAPHS), as in
transformers' eager prefill: per call, how much is Triton's launch path, how much torch's allocations, and how much
the rest (moeflow's Python, torch ops).

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD python benchmarks/experiments/host_breakdown.py [OUT_DIR]

Per preset, scheme, T and entry point (MoE.forward with router logits, the ExpertsPath of transformers' "moeflow"
experts call), eager graphs off (MOEFLOW_EAGER_GRAPHS=0), µs per call:
    host       median wall time of one unsynchronized call (eager_overhead.host_us)
    eager      100 calls back to back, then one synchronize, / 100 (eager_overhead.eager_us)
    gpu        the call captured as one CUDA graph, replayed back to back (eager_overhead.gpu_us)
    launches   Triton launches a call (JITFunction.run calls) and their summed wall time a call
    empties    torch.empty / torch.zeros / torch.full / torch.arange calls a call (moeflow's own) and their wall time
    no_launch  host time of the call with JITFunction.run replaced by a no-op: everything but Triton's launch path
Also a cProfile (200 calls, top 40 by cumulative and by own time) per case at T=512: OUT_DIR/host_profile_*.txt.
"""
from __future__ import annotations

import os
import sys
import time

import torch
from triton.runtime.jit import JITFunction

sys.path.insert(0, os.path.dirname(__file__))
from eager_overhead import (eager_us, gpu_us, host_us, layer_case, layer_inputs, profile_text,  # noqa: E402
                            results_header, run_all)


TOKENS = (64, 512, 4096)
ALLOCS = ("empty", "zeros", "full", "arange", "empty_like", "zeros_like")


class Tally:
    """Counts and times the calls of patched functions (Triton's JITFunction.run, torch allocations)."""

    def __init__(self):
        self.n, self.s = {}, {}
        self._orig = {}

    def wrap(self, owner, name, key, noop=False):
        orig = getattr(owner, name)
        self._orig[(owner, name)] = orig

        def wrapped(*a, **k):
            t0 = time.perf_counter()
            r = None if noop else orig(*a, **k)
            self.s[key] = self.s.get(key, 0.0) + time.perf_counter() - t0
            self.n[key] = self.n.get(key, 0) + 1
            return r
        setattr(owner, name, wrapped)

    def restore(self):
        for (owner, name), orig in self._orig.items():
            setattr(owner, name, orig)
        self._orig.clear()

    def per_call(self, calls):
        return {k: (self.n[k] / calls, self.s[k] / calls * 1e6) for k in self.n}


def tallied(fn, calls=100, noop=False):
    """Per call: {key: (count, µs)} over ``calls`` unsynchronized calls, and the wall µs a call."""
    fn()
    torch.cuda.synchronize()
    t = Tally()
    t.wrap(JITFunction, "run", "triton_launch", noop=noop)
    for name in ALLOCS:
        t.wrap(torch, name, "torch_alloc")
    try:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        wall = (time.perf_counter() - t0) / calls * 1e6
    finally:
        t.restore()
    torch.cuda.synchronize()
    return t.per_call(calls), wall


def run_case(preset, scheme, out_dir):
    moe, path, weights = layer_case(preset, scheme)
    rows = []
    for t in TOKENS:
        x, logits, ids64, w = layer_inputs(moe, t)
        for name, fn in (("forward", lambda: moe(x, logits)), ("experts_path", lambda: path(x, ids64, w, weights))):
            os.environ["MOEFLOW_EAGER_GRAPHS"] = "0"
            row = dict(preset=preset, scheme=scheme, T=t, entry=name, host_us=host_us(fn), eager_us=eager_us(fn))
            tally, row["tallied_wall_us"] = tallied(fn)
            row["tally"] = tally
            _, row["no_launch_us"] = tallied(fn, noop=True)
            os.environ["MOEFLOW_VALIDATE_INPUTS"] = "0"
            row["gpu_us"] = gpu_us(fn)
            os.environ["MOEFLOW_VALIDATE_INPUTS"] = "1"
            rows.append(row)
            la = tally.get("triton_launch", (0, 0))
            al = tally.get("torch_alloc", (0, 0))
            print(f"{preset:14s} {scheme:9s} T={t:<5d} {name:13s} host {row['host_us']:7.1f} "
                  f"eager {row['eager_us']:7.1f} gpu {row['gpu_us']:7.1f} | launches {la[0]:4.1f} {la[1]:6.1f}us  "
                  f"allocs {al[0]:4.1f} {al[1]:5.1f}us"
                  f"  no-launch {row['no_launch_us']:6.1f}", flush=True)
            if t == 512:
                with open(os.path.join(out_dir, f"host_profile_{preset}_{scheme}_T{t}_{name}.txt"), "w") as f:
                    f.write(profile_text(fn, sorts=("cumulative", "tottime"), lines=40))
    return rows


def main() -> int:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    return run_all(results_header(), run_case, out_dir, "host_breakdown.json")


if __name__ == "__main__":
    sys.exit(main())
