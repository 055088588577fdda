"""The routing kernels' launch shapes against their time, per preset and T: kernels/route.py's (tokens per
program, warps), "BxW", and kernels/route_stream.py's (threads a token, warps), "sLxW", where it applies.

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD python benchmarks/experiments/route_shapes.py [OUT.json]
    (TOKENS=1,4096, PRESETS=qwen3-30b-a3b, SHAPES=1x1,2x1 and STREAM=4x1,8x2 narrow the sweep)
µs per call: a CUDA graph of 16 calls on 16 different logits tensors, replayed (do_bench median) / 16.
The ids and weights of every shape are checked equal to the torch router's first, in all but 1 in 1000 rows (rows
with an exact float32 tie may pick either; before common.exact_sigmoid, DeepSeek-V3's rows within an ulp of one
did too, torch's and Triton's float32 sigmoids then differing by an ulp); "WRONG" otherwise.
"""
import json
import os
import sys

import torch
from triton.testing import do_bench

from moeflow.graphs import capture_graph
from moeflow.kernels.route import launch_shape, route
from moeflow.kernels.route_stream import stream_pays, streams
from moeflow.presets import preset_config
from moeflow.routing import create_router

PRESETS = tuple(os.environ.get("PRESETS", "qwen3-30b-a3b,mixtral-8x7b,deepseek-v3").split(","))
TOKENS = tuple(int(t) for t in os.environ.get("TOKENS", "1,4,16,128,1024,16384").split(","))
SHAPES = ((1, 1), (2, 1), (4, 1), (8, 1), (16, 1), (32, 1), (1, 2), (4, 2), (8, 2), (16, 2), (16, 4), (32, 4), (8, 4))
STREAM = ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4))
if "SHAPES" in os.environ:  # e.g. SHAPES=1x1,2x1 STREAM=4x1,8x2 (empty: none)
    SHAPES = tuple(tuple(int(v) for v in s.split("x")) for s in os.environ["SHAPES"].split(",") if s)
if "STREAM" in os.environ:
    STREAM = tuple(tuple(int(v) for v in s.split("x")) for s in os.environ["STREAM"].split(",") if s)
CALLS = 16


def per_call_us(cfg, logits, bias, **shape):
    args = (cfg.top_k, cfg.scoring, cfg.renormalize, cfg.num_expert_groups, cfg.topk_groups, cfg.routed_scaling_factor)
    fn = lambda: [route(lg, bias, *args, **shape) for lg in logits]  # noqa: E731
    return do_bench(capture_graph(fn).replay, warmup=10, rep=30, return_mode="median") * 1e3 / CALLS


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
            shapes = [(f"{bt}x{w}", dict(block_t=bt, num_warps=w, lanes=0)) for bt, w in SHAPES
                      if bt * e_pow2 <= 16384 and not (bt > 1 and bt > 2 * t)]
            if streams(cfg.scoring, bias is not None, cfg.num_expert_groups):
                shapes += [(f"s{ln}x{w}", dict(lanes=ln, num_warps=w)) for ln, w in STREAM
                           if 4 * ln <= e_pow2 // cfg.num_expert_groups]
            row["auto_stream"] = stream_pays(t, e_pow2)
            for name, shape in shapes:
                ids, wts = route(logits[0], bias, cfg.top_k, cfg.scoring, cfg.renormalize, cfg.num_expert_groups,
                                 cfg.topk_groups, cfg.routed_scaling_factor, **shape)
                agree = (ids == want[0]).all(dim=1)  # rows within an ulp of a tie may pick either (near_ties)
                ok = int((~agree).sum()) * 1000 <= t and torch.allclose(wts[agree], want[1][agree], rtol=1e-5,
                                                                       atol=1e-6)
                row["us"][name] = round(per_call_us(cfg, logits, bias, **shape), 2) if ok else "WRONG"
            out.append(row)
            best = min(((v, k) for k, v in row["us"].items() if v != "WRONG"), default=(float("nan"), "none"))
            print(f"{preset:14s} T={t:6d} auto={row['auto']} best {best[1]} {best[0]:.2f} us | "
                  + " ".join(f"{k}:{v}" for k, v in row["us"].items()), flush=True)
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
