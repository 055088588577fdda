"""Experiment (GPU): two or more versions of kernels/gate_up_wgmma.py, the kernel alone, timed by turns in one
process. Each version is a file, loaded as its own module inside moeflow.kernels (so its relative imports resolve);
each output is compared bit for bit with the Triton kernel's; every version runs the shipped 128-row Gluon config
(pair tiles as shipped) in a CUDA graph, ROUNDS rounds, the versions in turn within each round.

    PYTHONPATH=$PWD ROUNDS=3 python benchmarks/experiments/gate_up_versions.py OUT_DIR name=path [name=path ...] \
        [-- preset:T ...]

A version may change the config it runs: name=path@num_stages=4,group_m=4 (GemmConfig fields, integers); e.g.
`cp moeflow/kernels/gate_up_wgmma.py .ab/dyn.py && patch .ab/dyn.py <diff>`, then `dyn4=.ab/dyn.py@num_stages=4`
(benchmarks/results/dynamic_slots_2026-12-02_h200_9636796.md ran so).
"""
import importlib.util
import json
import os
import statistics
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import gluon_gate_up_case, time_gluon_gate_up  # noqa: E402

CASES = [("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384), ("mixtral-8x7b", 1024), ("mixtral-8x7b", 4096),
         ("deepseek-v3", 4096), ("deepseek-v3", 16384)]
ROUNDS = int(os.environ.get("ROUNDS", "3"))


def load(name: str, path: str):
    """The module in ``path``, as moeflow.kernels.<name>."""
    spec = importlib.util.spec_from_file_location(f"moeflow.kernels.{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main():
    args = sys.argv[1:]
    out_dir = args.pop(0)
    cut = args.index("--") if "--" in args else len(args)
    specs = [(n, *(p.split("@", 1) if "@" in p else (p, ""))) for n, p in (a.split("=", 1) for a in args[:cut])]
    versions = {n: load(n, p) for n, p, _ in specs}
    fields = {n: {k: int(v) for k, v in (f.split("=") for f in over.split(",") if f)} for n, _, over in specs}
    cases = [(p, int(t)) for p, t in (c.split(":") for c in args[cut + 1:])] or CASES
    dev = torch.device("cuda")
    results = []
    for preset, t in cases:
        case = gluon_gate_up_case(preset, t, dev)
        row = dict(preset=preset, T=t, cfg=str(case.cfg), changed=fields)
        for _ in range(ROUNDS):
            for name, mod in versions.items():
                row.setdefault(name, []).append(time_gluon_gate_up(case, mod, replace(case.cfg, **fields[name])))
        med = {n: statistics.median(x["us"] for x in row[n] if "us" in x) if any("us" in x for x in row[n]) else None
               for n in versions}
        row["median_us"] = med
        results.append(row)
        print(f"{preset:14} T={t:6} " + "  ".join(f"{n} {med[n]} {[x.get('us') for x in row[n]]}" for n in versions)
              + f"  bit-equal {all(x.get('bit_equal') for n in versions for x in row[n])}", flush=True)
        del case
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "gate_up_versions.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
