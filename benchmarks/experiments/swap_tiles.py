"""Experiment (GPU): transposed tiles (GemmConfig.swap_ab) for the small and middle batches' GEMMs.

Times, as `moeflow tune` does (autotune.tune: rows by index, the tuner's routings, CUDA graphs, median), every
gate_up and down candidate the tuner offers at T (swapped ones included) and the shipped table's entry, and prints
the best unswapped, the best swapped and the shipped tile per GEMM. Then writes copies of the shipped tables with
the T entries replaced by the best tiles of this run, the one-launch tiles kept, for a layer A/B through
MOEFLOW_KERNEL_CONFIG_DIR (bench_layer.py run with and without it).

    PYTHONPATH=$PWD python benchmarks/experiments/swap_tiles.py OUT [preset:scheme:T ...]

Writes OUT/swap_tiles.json and OUT/cfg/*.json; prints a table last.
"""
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

from moeflow.kernels.autotune import (Shape, candidates, covering_pairs, gemm_inputs, gemm_runners, graph_time_ms,
                                      precompile, random_weights, tuner_routings)
from moeflow.kernels.configs import (SHIPPED_DIR, GemmConfig, MoEKernelConfig, file_name, find_table, nearest,
                                     read_table, table_notes, write_table)
from moeflow.kernels.quant import down_input
from moeflow.presets import PRESETS
from moeflow.quant import create_scheme

CASES = [f"{p}:{s}:{t}" for p in ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3") for s in ("none", "fp8-block")
         for t in (16, 128)]


def shape_of(preset: str, scheme: str) -> Shape:
    p = PRESETS[preset]
    return Shape(p["num_experts"], p["hidden_size"], p["intermediate_size"], p["top_k"], scheme)


def tile(c) -> str:
    return "{block_m}x{block_n}x{block_k} w{num_warps} s{num_stages} sk{split_k} p{programs_per_sm} o{scale_overlap} " \
           "ws{warp_specialize} swap{swap_ab}".format(**c.to_dict())


def time_case(shape: Shape, t: int, shipped: MoEKernelConfig, dev) -> dict:
    """Every candidate of both GEMMs at T = t (and the shipped tiles), each timed as tune() times it."""
    w = random_weights(shape, dev)
    gu_c, dn_c = candidates(shape, t)
    gu_c = gu_c + [c for c in (shipped.gate_up,) if c not in gu_c]
    dn_c = dn_c + [c for c in (shipped.down,) if c not in dn_c]
    inputs = gemm_inputs(shape, tuner_routings(shape, t, dev), True)
    run_gu, run_dn = gemm_runners(shape, w)
    gu = [(c, graph_time_ms([lambda c=c, i=i: run_gu(c, i) for i in inputs], 15) * 1e3) for c in gu_c]
    ref_gu = [run_gu(shipped.gate_up, i) for i in inputs]

    sch = create_scheme(shape.scheme)

    def values(pair):  # gate_up's output as float32 (fp8-block: dequantized by its group scales)
        return sch.dequantize_activation(*pair) if shape.scheme == "fp8-block" else pair[0].float()

    def rel_err(got, want):
        return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()

    want = values(ref_gu[0])
    for c, _ in gu:  # every tile's output against the shipped tile's (fp32 sums in another order: close, not equal)
        err = rel_err(values(run_gu(c, inputs[0])), want)
        assert err < 0.02, (tile(c), err)
    down_in = [(*down_input(*r, shape.scheme), i[0].weights, i[1]) for r, i in zip(ref_gu, inputs)]
    dn = [(c, graph_time_ms([lambda c=c, d=d: run_dn(c, *d) for d in down_in], 15) * 1e3) for c in dn_c]
    want = run_dn(shipped.down, *down_in[0]).float()
    for c, _ in dn:
        err = rel_err(run_dn(c, *down_in[0]).float(), want)
        assert err < 0.01, (tile(c), err)
    out = {}
    for name, timed, ship in (("gate_up", gu, shipped.gate_up), ("down", dn, shipped.down)):
        plain = min((x for x in timed if not x[0].swap_ab), key=lambda x: x[1])
        swapped = min((x for x in timed if x[0].swap_ab), key=lambda x: x[1])
        out[name] = dict(shipped=(ship.to_dict(), dict(timed)[ship]), plain=(plain[0].to_dict(), plain[1]),
                         swapped=(swapped[0].to_dict(), swapped[1]), best=min(timed, key=lambda x: x[1])[0].to_dict(),
                         all=[(c.to_dict(), round(us, 2)) for c, us in timed])
    return out


def main():
    out_dir = sys.argv[1]
    cases = sys.argv[2:] or CASES
    os.makedirs(os.path.join(out_dir, "cfg"), exist_ok=True)
    dev = torch.device("cuda")
    device = torch.cuda.get_device_name()
    parsed = [(p, s, int(t)) for p, s, t in (c.split(":") for c in cases)]
    jobs = []
    for p, s, t in parsed:  # every candidate of either GEMM in at least one pair, compiled in worker processes
        shape = shape_of(p, s)
        jobs += [(shape, pair, True) for pair in covering_pairs(*candidates(shape, t))]
    precompile(jobs)
    rows, tables = [], {}
    for p, s, t in parsed:
        shape = shape_of(p, s)
        name = file_name(device, shape.num_experts, shape.inter, shape.hidden, s)
        table = find_table(device, shape.num_experts, shape.inter, shape.hidden, s)
        shipped = nearest(table, t)
        res = time_case(shape, t, shipped, dev)
        torch.cuda.empty_cache()  # the case's weights (DeepSeek-V3's bf16: 22.5 GB)
        rows.append(dict(preset=p, scheme=s, T=t, **res))
        tbl, measured = tables.setdefault(name, read_table(SHIPPED_DIR / name))
        old = tbl.get(t, shipped)
        tbl[t] = replace(old, gate_up=GemmConfig(**res["gate_up"]["best"]), down=GemmConfig(**res["down"]["best"]))
        for g in ("gate_up", "down"):
            r = res[g]
            print(f"{p:14} {s:9} T={t:<4} {g:7} shipped {r['shipped'][1]:8.1f}  plain {r['plain'][1]:8.1f}  "
                  f"swapped {r['swapped'][1]:8.1f} ({tile(GemmConfig(**r['swapped'][0]))})", flush=True)
    for name, (tbl, measured) in tables.items():
        write_table(Path(out_dir, "cfg", name), table_notes(SHIPPED_DIR / name), tbl, measured)
    json.dump(dict(device=device, rows=rows), open(os.path.join(out_dir, "swap_tiles.json"), "w"), indent=1)
    print("\ncase | GEMM | shipped us | best unswapped us | best swapped us | swapped / shipped")
    for r in rows:
        for g in ("gate_up", "down"):
            x = r[g]
            print(f"{r['preset']} {r['scheme']} T={r['T']} | {g} | {x['shipped'][1]:.1f} | {x['plain'][1]:.1f} | "
                  f"{x['swapped'][1]:.1f} | {x['swapped'][1] / x['shipped'][1]:.3f}")


if __name__ == "__main__":
    main()
