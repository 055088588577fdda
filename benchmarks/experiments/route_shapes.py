"""The routing kernel's launch shape (tokens per program, warps) against its time, per preset and T.

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD python benchmarks/experiments/route_shapes.py [OUT.json]
µs per call: a CUDA graph of 16 calls on 16 different logits tensors, replayed (do_bench median) / 16.
The ids and weights of every shape are checked equal to the torch router's first.
"""
import json
import sys

import torch
from triton.testing import do_bench

from moeflow.kernels.route import launch_shape, route
from moeflow.presets import preset_config
from moeflow.routing import create_router

PRESETS = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3")
TOKENS = (1, 4, 16, 128, 1024, 16384)
SHAPES = ((1, 1), (2, 1), (4, 1), (8, 1), (16, 1), (32, 1), (1, 2), (4, 2), (8, 2), (16, 2), (16, 4), (32, 4), (8, 4))
CALLS = 16


def per_call_us(cfg, logits, bias, block_t, warps):
    args = (cfg.top_k, cfg.scoring, cfg.renormalize, cfg.num_expert_groups, cfg.topk_groups, cfg.routed_scaling_factor)
    fn = lambda: [route(lg, bias, *args, block_t=block_t, num_warps=warps) for lg in logits]  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return do_bench(g.replay, warmup=10, rep=30, return_mode="median") * 1e3 / CALLS


def main():
    out = []
    for preset in PRESETS:
        cfg = preset_config(preset, device="cuda")
        bias = (torch.rand(cfg.num_experts, device="cuda") - 0.5) * 0.1 if cfg.use_correction_bias else None
        torch_router = create_router(cfg, "torch")
        e_pow2 = 1 << (cfg.num_experts - 1).bit_length()
        for t in TOKENS:
            logits = [torch.randn(t, cfg.num_experts, device="cuda") * 4 for _ in range(CALLS)]
            want = torch_router(logits[0], bias)
            row = dict(preset=preset, T=t, auto=launch_shape(e_pow2), us={})
            for bt, w in SHAPES:
                if bt * e_pow2 > 16384 or (bt > 1 and bt > 2 * t):
                    continue
                ids, wts = route(logits[0], bias, cfg.top_k, cfg.scoring, cfg.renormalize, cfg.num_expert_groups,
                                 cfg.topk_groups, cfg.routed_scaling_factor, block_t=bt, num_warps=w)
                ok = torch.equal(ids, want[0]) and torch.allclose(wts, want[1], rtol=1e-5, atol=1e-6)
                row["us"][f"{bt}x{w}"] = round(per_call_us(cfg, logits, bias, bt, w), 2) if ok else "WRONG"
            out.append(row)
            best = min((v, k) for k, v in row["us"].items() if v != "WRONG")
            print(f"{preset:14s} T={t:6d} auto={row['auto']} best {best[1]} {best[0]:.2f} us | "
                  + " ".join(f"{k}:{v}" for k, v in row["us"].items()), flush=True)
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
