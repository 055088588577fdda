"""The fp8-tensor / fp8-channel quantization of gate_up's output (kernels/quant.quantize_with_amax), timed alone.

In the layer's timeline (fp8_tensor_gap.py) it takes 11-12 µs after gate_up ends at Qwen3 T=16 and T=128 (inter
[128 or 1024, 768] bf16: 0.2-1.6 MB), 19 µs at T=1024, where Mixtral's [32, 14336] takes 3.3 µs. This times the
shipped launch and other tile shapes of the same kernel on those shapes, each captured alone in a CUDA graph
(moeflow.kernels.autotune.graph_time_ms, L2 not flushed), output bytes checked equal to the shipped launch's.

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD python benchmarks/experiments/inter_quant.py [OUT.json]

Result (2026-12-02, H200): every shape came out at 11-24 µs, Mixtral's too, so for a single launch this small
the timer measures its own replay cost; ncu found the cause instead (fp8_tensor_gap_2026-12-02_h200_4c734d2.md,
section 4). Kept for the tile list and the bit check.
"""
import json
import sys

import torch
import triton

from moeflow.kernels.autotune import graph_time_ms
from moeflow.kernels.common import pdl
from moeflow.kernels.quant import _quant_kernel, quantize_with_amax
from moeflow.quant import FP8_DTYPE

SHAPES = [("qwen3 T=16", 128, 768), ("qwen3 T=128", 1024, 768), ("qwen3 T=1024", 8192, 768),
          ("mixtral T=16", 32, 14336), ("mixtral T=128", 256, 14336), ("deepseek-v3 T=128", 1024, 2048)]
TILES = [(16, 512, 4), (16, 256, 4), (8, 256, 4), (4, 1024, 4), (2, 1024, 4), (1, 1024, 4), (32, 128, 4)]


def launch(x, amax, br, bk, w):
    r, k = x.shape
    q = torch.empty((r, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((r, 1), dtype=torch.float32, device=x.device)
    _quant_kernel[(triton.cdiv(r, br), triton.cdiv(k, bk))](
        x, q, s, amax, r, k, x.stride(0), q.stride(0), s.stride(0), 1, BLOCK_R=br, BLOCK_K=bk, GROUPED=False,
        ROUND_IN_FP32=False, num_warps=w, **pdl(x.device))
    return q, s


def main():
    out = {}
    for name, r, k in SHAPES:
        x = torch.randn(r, k, device="cuda", dtype=torch.bfloat16)
        amax = x.float().abs().amax(1)
        ref = quantize_with_amax(x, amax)[0]
        row = {"shipped": round(graph_time_ms([lambda: quantize_with_amax(x, amax)], 20) * 1e3, 2)}
        for br, bk, w in TILES:
            got = launch(x, amax, br, bk, w)[0]
            assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), (name, br, bk)
            row[f"{br}x{bk} w{w}"] = round(graph_time_ms([lambda br=br, bk=bk, w=w: launch(x, amax, br, bk, w)], 20)
                                           * 1e3, 2)
        out[name] = row
        print(name, row, flush=True)
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)
    keys = list(next(iter(out.values())))
    print("\n| shape | " + " | ".join(keys) + " |")
    for name, row in out.items():
        print(f"| {name} | " + " | ".join(f"{row[k]:.1f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
