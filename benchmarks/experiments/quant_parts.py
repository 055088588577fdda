"""The local dispatcher's sort with the tokens' FP8 quantization (dispatch/expert_sort.sort_and_quantize) at the
presets' sizes, with quantizing parts of one token (align._QUANT_PARTS past any batch: the form before
align.quant_rows) against several (align.quant_rows), by turns; outputs checked bit-equal first.

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD python benchmarks/experiments/quant_parts.py [OUT.json]
µs per call: a CUDA graph of the sort on 4 batches, replayed (do_bench median) / 4; ROUNDS (default 3) rounds.
"""
import json
import os
import statistics
import sys

import torch
from triton.testing import do_bench

from moeflow.dispatch.expert_sort import sort_and_quantize
from moeflow.graphs import capture_graph
from moeflow.kernels import align

CASES = (("qwen3-30b-a3b", 128, 8, 2048, (1024, 4096, 16384)), ("mixtral-8x7b", 8, 2, 4096, (1024, 4096, 16384)),
         ("deepseek-v3", 256, 8, 7168, (4096, 16384)))
CALLS = 4


def graph_us(batches):
    fn = lambda: [sort_and_quantize(ids, w, e, x, "fp8-block") for ids, w, e, x in batches]  # noqa: E731
    return do_bench(capture_graph(fn).replay, warmup=10, rep=50, return_mode="median") * 1e3 / CALLS


def main():
    rounds = int(os.environ.get("ROUNDS", "3"))
    out = []
    base = align._QUANT_PARTS
    for preset, e, k, h, tokens in CASES:
        for t in tokens:
            batches = [(torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k].to(torch.int32),
                        torch.rand(t, k, device="cuda"), e,
                        torch.randn(t, h, device="cuda", dtype=torch.bfloat16)) for _ in range(CALLS)]
            align._QUANT_PARTS = 1 << 40
            one = sort_and_quantize(*batches[0][:3], batches[0][3], "fp8-block")
            align._QUANT_PARTS = base
            several = sort_and_quantize(*batches[0][:3], batches[0][3], "fp8-block")
            same = all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                   b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                       for a, b in zip(one, several))
            row = dict(preset=preset, T=t, rows_a_part=align.quant_rows(t, -(-h // 1024), 1024), same=same,
                       one=[], several=[])
            for _ in range(rounds):
                align._QUANT_PARTS = 1 << 40
                row["one"].append(round(graph_us(batches), 2))
                align._QUANT_PARTS = base
                row["several"].append(round(graph_us(batches), 2))
            out.append(row)
            med = statistics.median
            print(f"{preset:14s} T={t:6d} rows/part={row['rows_a_part']} same={same} one token a part "
                  f"{med(row['one']):8.2f} us, several {med(row['several']):8.2f} us "
                  f"({med(row['one']) / med(row['several']):.2f}x)", flush=True)
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
