"""The one-launch layer's Gluon form (kernels/fused_layer_wgmma.py, FusedConfig.wgmma) against the shipped Triton
kernel at the tuned tiles, over a small grid of its own tiles. One H200.

    PYTHONPATH=$PWD OUT=DIR python benchmarks/experiments/fused_wgmma.py [preset:scheme:T ...]

Per case: the table's FusedConfig (Triton), then wgmma=1 at the table's tiles and at stages x tile variants. Each
output is compared with the Triton kernel's at the same tiles (bit-equal or not, max |diff|) and with the float64
float32 reference fused_layer_torch (max |diff| / max |ref|). Timed as the whole layer (route -> one launch) from a CUDA
graph: do_bench (L2 zeroed before each replay) twice by turns, and after a clean 1 GiB read once. Writes
fused_wgmma.json under OUT; prints a table last (best wgmma config per case first).
"""
import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CASES = ["qwen3-30b-a3b:fp8-block:1", "qwen3-30b-a3b:none:1", "deepseek-v3:fp8-block:1", "mixtral-8x7b:fp8-block:1",
         "deepseek-v3:none:1", "mixtral-8x7b:none:1", "qwen3-30b-a3b:fp8-block:4", "qwen3-30b-a3b:none:4"]
SMEM = 227 * 1024


def variants(table, scheme: str, small: bool) -> dict:
    """name -> FusedConfig: the Triton table entry, then Gluon ones (shared memory within the SM's)."""
    out = {"triton table": table}
    elem = 1 if scheme == "fp8-block" else 2
    bk = 128 // elem
    tiles = [(table.block_n1, table.split1, table.block_n2, table.split2)]
    if small:
        tiles += [(64, table.split1, table.block_n2, table.split2), (64, 2 * table.split1, table.block_n2, table.split2),
                  (table.block_n1, table.split1, 128, table.split2), (64, table.split1, 128, table.split2 // 2 or 1)]
    else:
        tiles += [(64, table.split1, table.block_n2, table.split2)]
    for bn1, s1, bn2, s2 in dict.fromkeys(tiles):
        for stages in (3, 4, 6, 8):
            if stages * 2 * bn1 * bk * elem + 16 * bk * elem + 2048 > SMEM:
                continue
            cfg = replace(table, wgmma=1, block_n1=bn1, split1=s1, block_n2=bn2, split2=max(s2, 1), num_stages=stages)
            out[f"wgmma bn1={bn1} s1={s1} bn2={bn2} s2={max(s2, 1)} st={stages}"] = cfg
    return out


def main():
    from bench_layer import Case
    from moeflow.benchmark import clean_graph_us, graph_us
    from moeflow.experts import create_runner
    from moeflow.kernels import fused_layer as fl
    rows, text = [], []
    for spec in sys.argv[1:] or CASES:
        preset, scheme, t = spec.split(":")
        case = Case(preset, scheme)
        runner = create_runner("triton", case.cfg.replace(runner="triton"), case.scheme)
        x, logits = case.inputs(int(t), 1)[0]
        ids, w = case.router(logits, case.bias)
        table = runner.fused_config(int(t), case.weights)
        cw = case.weights
        ref = fl.fused_layer_torch(x, ids.int(), w.float(), cw.w13, cw.w13_scale, cw.w2, cw.w2_scale, scheme,
                                   case.cfg.activation, torch.bfloat16).double()
        scale = ref.abs().max().item()
        layers, info = {}, {}
        for name, cfg in variants(table, scheme, case.weights.w13.shape[0] == 128).items():
            sync = torch.zeros(fl.counters_size(int(t), ids.shape[1], cw.w2.shape[1], cw.w2.shape[2], cfg) + 64,
                               dtype=torch.int32, device="cuda")
            try:
                got = fl.fused_layer(x, ids.int(), w.float(), cw.w13, cw.w13_scale, cw.w2, cw.w2_scale, scheme,
                                     case.cfg.activation, torch.bfloat16, cfg, sync, poison=True)
                triton_same = fl.fused_layer(x, ids.int(), w.float(), cw.w13, cw.w13_scale, cw.w2, cw.w2_scale,
                                             scheme, case.cfg.activation, torch.bfloat16,
                                             replace(cfg, wgmma=0, num_stages=3),
                                             sync, poison=True)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a config the compiler refuses: recorded, not fatal
                text.append(f"  {spec} {name}: {type(exc).__name__}: {str(exc)[:200]}")
                rows.append(dict(case=spec, variant=name, error=f"{type(exc).__name__}: {exc}"[:2000]))
                continue
            info[name] = dict(equal_to_triton=torch.equal(got, triton_same),
                              max_diff_triton=(got.float() - triton_same.float()).abs().max().item(),
                              rel_err_ref=(got.double() - ref).abs().max().item() / scale,
                              nan=bool(torch.isnan(got).any()))

            def layer(cfg=cfg, sync=sync):
                i, wt = case.router(logits, case.bias)
                return fl.fused_layer(x, i.int(), wt.float(), cw.w13, cw.w13_scale, cw.w2, cw.w2_scale, scheme,
                                      case.cfg.activation, torch.bfloat16, cfg, sync)
            layers[name] = layer
        us = {name: [] for name in layers}
        for _ in range(2):
            for name, layer in layers.items():
                us[name].append(graph_us(layer))
        res = []
        for name, layer in layers.items():
            r = dict(case=spec, variant=name, us=min(us[name]), rounds=us[name], clean_us=clean_graph_us(layer),
                     **info[name])
            rows.append(r)
            res.append(r)
        base = res[0]["us"]
        text.append(f"== {spec}  table {table}")
        for r in [res[0]] + sorted(res[1:], key=lambda r: r["us"]):
            text.append(f"  {r['variant']:42} {r['us']:7.1f} us (clean {r['clean_us']:6.1f})  x{base / r['us']:.3f}"
                        f"  eq_triton {r['equal_to_triton']!s:5} d {r['max_diff_triton']:.2e} ref {r['rel_err_ref']:.1e}"
                        f"{'  NaN' if r['nan'] else ''}")
        del runner, case, layers
        torch.cuda.empty_cache()
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "fused_wgmma.json"), "w"), indent=1)
    print("\n".join(text))


if __name__ == "__main__":
    main()
