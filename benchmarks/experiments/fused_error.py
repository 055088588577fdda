"""Which is closer to the float64 oracle at PERF.md's shapes: the one-launch small-batch layer (kernels/fused_layer.py)
or the separate launches? fused_layer.py (the experiment) reports only their difference from each other. Here both
against tests/oracle.oracle_moe (float64 einsum over the dequantized weights of the experts the routing hit, the
activations fake-quantized by the scheme), --repeats routings per (preset, scheme, T), one H200.

    PYTHONPATH=$PWD python benchmarks/experiments/fused_error.py [--schemes fp8-channel,fp8-block] [--tokens 1,2,4]
        [--repeats N] [preset ...]
"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "..", "tests")]


def main():
    from bench_layer import Case
    from moeflow.experts import create_runner
    from moeflow.kernels.configs import FusedConfig, fit_fused
    from oracle import oracle_moe, rel_err
    p = argparse.ArgumentParser()
    p.add_argument("--schemes", default="fp8-channel,fp8-block")
    p.add_argument("--tokens", default="1,2,4")
    p.add_argument("--tiles", default="64,128,64,128,4,4,1,8", help="the FusedConfig forced in")
    p.add_argument("--repeats", type=int, default=1, help="routings (fresh inputs) per row")
    p.add_argument("presets", nargs="*", default=["qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"])
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed before each preset: the same routings")
    args = p.parse_args()
    tiles = FusedConfig(*(int(v) for v in args.tiles.split(",")))
    print(f"{'preset':14} {'scheme':11} {'T':>2} {'separate':>9} {'fused':>9} {'reference':>9} {'fused-sep':>9}  "
          "(relative error against the oracle; the reference runner's too; fused against separate)")
    for preset in args.presets:
        for scheme in args.schemes.split(","):
            case = Case(preset, scheme)
            torch.manual_seed(args.seed)
            runner = create_runner("triton", case.cfg.replace(runner="triton"), case.scheme)
            reference = create_runner("reference", case.cfg.replace(runner="reference"), case.scheme)
            e, wts = case.cfg.num_experts, case.weights
            for t, _ in ((int(v), r) for v in args.tokens.split(",") for r in range(args.repeats)):
                x, logits = case.inputs(t, 1)[0]
                ids, w = case.router(logits, case.bias)
                runner._fitted[("fused", t, e)] = None
                separate = case.layer(runner, x, logits)
                runner._fitted[("fused", t, e)] = fit_fused(tiles, scheme)
                fused = case.layer(runner, x, logits)
                by_reference = case.layer(reference, x, logits)
                hit, local = torch.unique(ids.long(), return_inverse=True)
                sch = case.scheme
                w13 = sch.dequantize_weight(wts.w13[hit], None if wts.w13_scale is None else wts.w13_scale[hit])
                w2 = sch.dequantize_weight(wts.w2[hit], None if wts.w2_scale is None else wts.w2_scale[hit])
                ref = oracle_moe(x, local, w, w13, w2, case.cfg.activation, sch, torch.bfloat16)
                del w13, w2
                print(f"{preset:14} {scheme:11} {t:>2} {rel_err(separate, ref):9.2e} {rel_err(fused, ref):9.2e} "
                      f"{rel_err(by_reference, ref):9.2e} {rel_err(fused, separate):9.2e}", flush=True)
            del case, runner, reference
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
