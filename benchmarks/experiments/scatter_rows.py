"""The row copy before the TMA gate_up kernels, gathered by source_rows (each token row read K times) against
scattered by the local dispatcher's inverse map (ExpertBatch.copy_rows: each token row read once); alone and
in the whole layer.

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD python benchmarks/experiments/scatter_rows.py [OUT.json]
Alone: do_bench median (L2 flushed), copies checked equal. Layer: bench_layer's graph_us, the two in turns over
two rounds (the gather by patching gate_up._rows_in_order to ignore copy_rows), outputs checked bit-equal.
"""
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from bench_layer import graph_us  # noqa: E402
from decode_timeline import layer_calls  # noqa: E402
from moeflow.kernels import gate_up as gate_up_mod  # noqa: E402
from moeflow.kernels.quant import gather_rows, scatter_rows  # noqa: E402

ALONE = [("qwen3 fp8 T=16384", 16384, 2048, 8, torch.float8_e4m3fn, 16),
         ("deepseek-v3 fp8 T=16384", 16384, 7168, 8, torch.float8_e4m3fn, 56),
         ("deepseek-v3 bf16 T=16384", 16384, 7168, 8, torch.bfloat16, 0), ("mixtral bf16 T=16384", 16384, 4096, 2, torch.bfloat16, 0)]
LAYER = [("qwen3-30b-a3b", "fp8-block", 4096), ("qwen3-30b-a3b", "fp8-block", 16384), ("mixtral-8x7b", "none", 16384),
         ("deepseek-v3", "fp8-block", 4096), ("deepseek-v3", "fp8-block", 16384), ("deepseek-v3", "none", 16384)]


def main():
    out = {"alone": {}, "layer": {}}
    for name, t, h, k, dtype, g in ALONE:
        x = torch.randn(t, h, device="cuda").to(dtype)
        xs = torch.rand(t, g, device="cuda") if g else None
        perm = torch.randperm(t * k, device="cuda")
        copy_rows = perm.view(t, k)
        src = torch.empty_like(perm)
        src[perm] = torch.arange(t * k, device="cuda") // k
        a, b = gather_rows(x, xs, src), scatter_rows(x, xs, copy_rows)
        assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and (g == 0 or torch.equal(a[1], b[1]))
        us = [do_bench(lambda: gather_rows(x, xs, src), return_mode="median") * 1e3,
              do_bench(lambda: scatter_rows(x, xs, copy_rows), return_mode="median") * 1e3]
        out["alone"][name] = dict(gather_us=round(us[0], 1), scatter_us=round(us[1], 1))
        print(name, out["alone"][name], flush=True)
        del x, xs, src, a, b
    scatter = gate_up_mod._rows_in_order

    def gather(x, xs, src, copy_rows):
        return scatter(x, xs, src, None)

    for name, fn in layer_calls(LAYER):
        res = {"gather": [], "scatter": []}
        gate_up_mod._rows_in_order = gather
        want = fn()
        gate_up_mod._rows_in_order = scatter
        assert torch.equal(fn(), want), name
        for _ in range(2):
            for label, f in (("gather", gather), ("scatter", scatter)):
                gate_up_mod._rows_in_order = f
                res[label].append(round(graph_us(fn), 1))
        gate_up_mod._rows_in_order = scatter
        out["layer"][name] = res
        print(name, res, flush=True)
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
