"""Experiment (GPU): the warp-specialized fp8-block gate_up (kernels/warp_specialized.py, GATED and SCALED: 64 x 128
tiles, each consumer warpgroup its own tile, the two by turns) against the shipped fp8-block gate_up (tuned table),
alone, graph-timed as the tuner times it (batches_for(T) routings; the row-block table's launch included). Outputs
compared bit for bit with the Triton kernel's at 64 x 128 (the shipped Gluon kernels give the same bits).
GEMM=down: the same for the down, its wide 64 x 256 tiles (and the 64 x 128 ws tile the tables use) against the
shipped down entry.
Then writes OUT/override/: copies of the shipped fp8-block tables whose entries of that GEMM at the timed T take the
fastest ws variant where it beat the shipped entry by 2% or more (a MOEFLOW_KERNEL_CONFIG_DIR for a layer A/B).

    PYTHONPATH=$PWD [GEMM=down] python benchmarks/experiments/ws_fp8_gate_up.py OUT_DIR [preset:T,...]
"""
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from moeflow.kernels.autotune import _layer_parts, batches_for, graph_time_ms, random_batch
from moeflow.kernels.common import RowLayout
from moeflow.kernels.configs import SHIPPED_DIR, GemmConfig
from moeflow.kernels.down import down
from moeflow.kernels.gate_up import gate_up
from moeflow.quant import create_scheme

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import preset_weights  # noqa: E402

ROWS = [(p, t) for p in ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3") for t in (1024, 2048, 4096, 8192, 16384)]
GEMM = os.environ.get("GEMM", "gate_up")
VARIANTS = {"gate_up": [GemmConfig(64, 128, 128, g, 4, s, warp_specialize=1)
                        for g, s in ((8, 3), (8, 4), (8, 5), (16, 4))],
            "down": [GemmConfig(64, bn, 128, g, 4, s, warp_specialize=1)
                     for bn, g, s in ((128, 8, 6), (256, 8, 3), (256, 8, 4), (256, 8, 5), (256, 16, 4))]}[GEMM]
SCH = create_scheme("fp8-block")
GAIN = 1.02


def main():
    out_dir = Path(sys.argv[1])
    rows = ROWS
    if len(sys.argv) > 2:
        rows = [(p, int(t)) for p, t in (r.split(":") for r in sys.argv[2].split(","))]
    dev = torch.device("cuda")
    res, weights, picks = [], {}, {}
    for preset, t in rows:
        shape, w = preset_weights(preset, "fp8-block", weights, dev)
        ins = []
        for b in range(batches_for(t)):
            batch = random_batch(shape, t, dev, seed=t * 1000 + b)
            lay = RowLayout.of(batch)
            if GEMM == "down":  # a random intermediate [R, I], quantized
                x, xs = SCH.quantize_activation(torch.randn(lay.rows, shape.inter, device=dev).bfloat16())
            else:
                x, xs = SCH.quantize_activation(batch.hidden)  # [R, H]: the batch's rows in order
            ins.append((x, xs, lay, batch.weights))
        kcfg = _layer_parts(shape)[1].kernel_config(batch, SimpleNamespace(w13=w.w13, w2=w.w2))
        if GEMM == "down":
            run = lambda d, cfg, poison=False: (down(d[0], d[1], w.w2, w.w2_scale, d[3], d[2], "fp8-block",
                                                     torch.bfloat16, cfg, poison=poison), None)
        else:
            run = lambda d, cfg, poison=False: gate_up(d[0], d[1], w.w13, w.w13_scale, d[2], "fp8-block", "silu",
                                                       torch.bfloat16, cfg, poison=poison)
        want, want_s = run(ins[0], GemmConfig(64, 128, 128, 8, 4, 3))
        valid = ins[0][2].valid_rows()
        fl = 2 * t * shape.top_k * shape.hidden * shape.inter * (2 if GEMM == "gate_up" else 1)
        shipped = kcfg.down if GEMM == "down" else kcfg.gate_up

        def timed(cfg):
            try:
                got, got_s = run(ins[0], cfg, poison=True)
                same = None
                if GEMM == "down":
                    same = bool(torch.equal(got[valid], want[valid]))
                elif got.dtype == torch.float8_e4m3fn:
                    same = bool(torch.equal(got.view(torch.uint8)[valid], want.view(torch.uint8)[valid])
                                and torch.equal(got_s[valid], want_s[valid]))
                us = graph_time_ms([lambda d=d: run(d, cfg) for d in ins], 20) * 1e3
                return dict(us=round(us, 1), tflops=round(fl / us / 1e6), bit_equal=same)
            except Exception as exc:  # recorded, not fatal
                return dict(error=repr(exc)[:300])

        row = dict(preset=preset, T=t, gemm=GEMM, shipped_cfg=str(shipped), shipped=timed(shipped))
        for v in VARIANTS:
            row[_name(v)] = timed(v)
        res.append(row)
        best = min((k for k in row if k.startswith("ws_") and "us" in row[k] and row[k]["bit_equal"]),
                   key=lambda k: row[k]["us"], default=None)
        ship = row["shipped"].get("us")
        if best and ship and row[best]["us"] * GAIN <= ship:
            picks.setdefault(shape, {})[t] = next(v for v in VARIANTS if _name(v) == best)
        print(f"{preset:14} T={t:6} shipped {ship} " + " ".join(
            f"{k} {row[k].get('us')}{'' if row[k].get('bit_equal') else '!'}" for k in row if k.startswith("ws_"))
            + f"  pick {best if shape in picks and t in picks[shape] else '-'}", flush=True)
        ins = None  # free the batches before the next row
        torch.cuda.empty_cache()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "ws_fp8_gate_up.json").write_text(json.dumps(res, indent=1))
    over = out_dir / "override"
    over.mkdir(exist_ok=True)
    for shape, by_t in picks.items():
        name = f"E={shape.num_experts},N={shape.inter},K={shape.hidden},device=NVIDIA_H200,scheme=fp8-block.json"
        table = json.loads((SHIPPED_DIR / name).read_text())
        for t, cfg in by_t.items():
            table["configs"][str(t)][GEMM] = cfg.to_dict()
        (over / name).write_text(json.dumps(table, indent=1))
        print("override", name, sorted(by_t), flush=True)


def _name(v: GemmConfig) -> str:
    return f"ws_{v.block_m}x{v.block_n}g{v.group_m}s{v.num_stages}"


if __name__ == "__main__":
    main()
