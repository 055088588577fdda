"""Experiment (GPU): one GEMM of the layer alone at variants of a table entry, graph-timed as the tuner times it
(batches_for(T) routings; any setup launch such as the row-block table's included), each output compared bit for bit
with a reference output; then OUT/override/: copies of the shipped tables whose entries of that GEMM at the timed T
take the fastest bit-equal variant where it beat the shipped entry by 2% or more (a MOEFLOW_KERNEL_CONFIG_DIR for a
layer A/B; GAIN=1.0 takes any faster one).

SWEEP=ws (default; fp8-block): the warp-specialized kernels (kernels/warp_specialized.py): GEMM=gate_up its 64 x 128
fp8-block gate_up (a tile a consumer) and its 128 x 128 one (COOP: the two consumers 64 rows each of a tile;
WS_GATE_UP=pingpong or coop times only one of the two), GEMM=down its 64 x 128 and wide 64 x 256 downs and the wide
128 x 256 COOP one (WS_DOWN=pingpong or coop likewise): the tuner's lists (autotune.WS_FP8_*) and a few tiles it
does not offer; reference:
the Triton kernel at 64 x 128 (the Gluon kernels give the same bits). With SCHEME=none its bf16 tiles (by turns at
128 or 64 rows, COOP at 128); reference: the shipped entry, a variant taken where it is bit-equal or within 1e-2
of it (rel_err: the largest difference over the largest output). SWEEP=order (SCHEME=none or fp8-block): the
shipped entry with another tile order (GROUP_M 4, 8, 16, 32, or GROUP_MS=...; not GROUPS, which bash keeps for
itself) or one stage more or fewer (STAGE_STEPS=-1,1; empty for none), where fit() keeps it;
reference: the shipped entry's output. Either sweep: ONLY=name,... times only the variants so named (as printed,
e.g. ws_128x128g8s3).

    PYTHONPATH=$PWD [GEMM=down] [SWEEP=order] [SCHEME=none] \
        python benchmarks/experiments/gemm_sweep.py OUT_DIR [preset:T,...]
"""
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

from moeflow.kernels.autotune import (WS_BF16_DOWN, WS_BF16_GATE_UP, WS_FP8_DOWN, WS_FP8_DOWN_COOP, WS_FP8_GATE_UP,
                                      WS_FP8_GATE_UP_COOP, _layer_parts, graph_time_ms, random_batch)
from moeflow.kernels.configs import SHIPPED_DIR, GemmConfig, fit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import gemm_rows, gemm_runner, preset_weights, same_bits  # noqa: E402

ROWS = [(p, t) for p in ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3") for t in (1024, 2048, 4096, 8192, 16384)]
GEMM = os.environ.get("GEMM", "gate_up")
SWEEP = os.environ.get("SWEEP", "ws")
SCHEME = os.environ.get("SCHEME", "fp8-block")
# fp8-block: the warp-specialized tiles the tuner offers (64 rows a consumer by turns, or COOP: 128 rows, 64 each;
# BLOCK_K 128), and a few it does not; WS_GATE_UP / WS_DOWN = pingpong or coop keeps one of the two forms
_WS_FP8 = {"gate_up": (WS_FP8_GATE_UP + WS_FP8_GATE_UP_COOP
                       + [GemmConfig(bm, 128, 128, 8, 4, s, warp_specialize=1) for bm, s in ((64, 3), (128, 4))]
                       + [GemmConfig(128, 128, 128, 16, 4, 4, warp_specialize=1)]),
           "down": (WS_FP8_DOWN + WS_FP8_DOWN_COOP
                    + [GemmConfig(bm, 256, 128, g, 4, s, warp_specialize=1)
                       for bm, g, s in ((64, 8, 3), (128, 8, 4), (128, 16, 4))])}[GEMM]
_FORM = os.environ.get("WS_GATE_UP" if GEMM == "gate_up" else "WS_DOWN", "all")
WS_VARIANTS = [c for c in _WS_FP8 if _FORM in ("all", "coop" if c.block_m == 128 else "pingpong")]
# SCHEME=none: the bf16 tiles the tuner offers (a tile a consumer by turns at 128 or 64 rows, or COOP: 128 rows,
# 64 each; BLOCK_K 64), and a few it does not
WS_BF16_VARIANTS = {"gate_up": WS_BF16_GATE_UP + [GemmConfig(64, 128, 64, 8, 4, 4, warp_specialize=1)],
                    "down": WS_BF16_DOWN + [GemmConfig(bm, 256, 64, 8, 4, s, warp_specialize=1)
                                            for bm, s in ((128, 3), (64, 3), (64, 4))]}[GEMM]
GAIN = float(os.environ.get("GAIN", "1.02"))
ONLY = [n for n in os.environ.get("ONLY", "").split(",") if n]  # e.g. ONLY=ws_128x128g8s3: those variants alone
# SWEEP=order's GROUP_M values, and its stage steps (STAGE_STEPS= for none)
GROUP_MS = [int(g) for g in os.environ.get("GROUP_MS", "4,8,16,32").split(",") if g]
STAGE_STEPS = [int(d) for d in os.environ.get("STAGE_STEPS", "-1,1").split(",") if d]


def variants(shipped: GemmConfig, shape) -> list[GemmConfig]:
    """The configs SWEEP times against the shipped entry (module docstring)."""
    if SWEEP == "ws":
        return WS_BF16_VARIANTS if SCHEME == "none" else WS_VARIANTS
    out = [replace(shipped, group_m=g) for g in GROUP_MS]
    out += [replace(shipped, num_stages=shipped.num_stages + d) for d in STAGE_STEPS]
    nbytes = 1 if SCHEME != "none" else 2
    fitted = [fit(c, fused_pair=GEMM == "gate_up", scheme=SCHEME, elem_bytes=nbytes,
                  n_size=shape.inter if GEMM == "gate_up" else shape.hidden) for c in out]
    return [c for i, c in enumerate(fitted) if c != shipped and c not in fitted[:i] and c == out[i]]


def main():
    out_dir = Path(sys.argv[1])
    rows = ROWS
    if len(sys.argv) > 2:
        rows = [(p, int(t)) for p, t in (r.split(":") for r in sys.argv[2].split(","))]
    dev = torch.device("cuda")
    res, weights, picks = [], {}, {}
    for preset, t in rows:
        shape, w = preset_weights(preset, SCHEME, weights, dev)
        ins = gemm_rows(shape, t, GEMM, dev)
        kcfg = _layer_parts(shape)[1].kernel_config(random_batch(shape, t, dev, seed=t * 1000),
                                                    SimpleNamespace(w13=w.w13, w2=w.w2))
        run = gemm_runner(GEMM, w, SCHEME)
        shipped = kcfg.down if GEMM == "down" else kcfg.gate_up
        want = run(ins[0], GemmConfig(64, 128, 128, 8, 4, 3) if SWEEP == "ws" and SCHEME != "none" else shipped)
        valid = ins[0][2].valid_rows()
        fl = 2 * t * shape.top_k * shape.hidden * shape.inter * (2 if GEMM == "gate_up" else 1)
        tried = [v for v in variants(shipped, shape) if not ONLY or _name(v) in ONLY]

        def timed(cfg):
            try:
                got = run(ins[0], cfg, poison=True)
                same = same_bits(got, want, valid)
                g, x = got[0][valid].float(), want[0][valid].float()  # the output (fp8: its bytes' values)
                err = float((g - x).abs().max() / x.abs().max().clamp(min=1e-30)) if x.numel() else 0.0
                us = graph_time_ms([lambda d=d: run(d, cfg) for d in ins], 20) * 1e3
                return dict(us=round(us, 1), tflops=round(fl / us / 1e6), bit_equal=same, rel_err=err)
            except Exception as exc:  # recorded, not fatal
                return dict(error=repr(exc)[:300])

        row = dict(preset=preset, T=t, gemm=GEMM, shipped_cfg=str(shipped), shipped=timed(shipped))
        names = {_name(v): v for v in tried}
        for name, v in names.items():
            row[name] = timed(v)
        res.append(row)
        # bf16 kernels may sum a tile's products in another order: close to the shipped entry's output is enough
        ok = lambda r: r["bit_equal"] or (SCHEME == "none" and r["rel_err"] < 1e-2)
        best = min((k for k in names if "us" in row[k] and ok(row[k])), key=lambda k: row[k]["us"], default=None)
        ship = row["shipped"].get("us")
        if best and ship and row[best]["us"] * GAIN <= ship:
            picks.setdefault(shape, {})[t] = names[best]
        print(f"{preset:14} {SCHEME:9} {GEMM:7} T={t:6} shipped {ship} " + " ".join(
            f"{k} {row[k].get('us')}{'' if row[k].get('bit_equal') else '!'}" for k in names)
            + f"  pick {best if shape in picks and t in picks[shape] else '-'}", flush=True)
        ins = None  # free the batches before the next row
        torch.cuda.empty_cache()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"sweep_{SWEEP}_{SCHEME}_{GEMM}.json").write_text(json.dumps(res, indent=1))
    over = out_dir / "override"
    over.mkdir(exist_ok=True)
    for shape, by_t in picks.items():
        name = f"E={shape.num_experts},N={shape.inter},K={shape.hidden},device=NVIDIA_H200,scheme={SCHEME}.json"
        src = over / name if (over / name).is_file() else SHIPPED_DIR / name  # another GEMM's sweep wrote it first
        table = json.loads(src.read_text())
        for t, cfg in by_t.items():
            table["configs"][str(t)][GEMM] = cfg.to_dict()
        (over / name).write_text(json.dumps(table, indent=1))
        print("override", name, sorted(by_t), flush=True)


def _name(v: GemmConfig) -> str:
    return f"{'ws_' if v.warp_specialize else ''}{v.block_m}x{v.block_n}g{v.group_m}s{v.num_stages}"


if __name__ == "__main__":
    main()
