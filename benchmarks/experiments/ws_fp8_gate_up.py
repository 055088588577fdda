"""The warp-specialized persistent Gluon gate_up in fp8-block (kernels/warp_specialized.py, GATED and SCALED: a TMA
loader warp, the two consumer warpgroups cooperating on each 128 x 128 tile) against the shipped fp8-block gate_up
(tuned table), alone, rows in order, graph-timed; outputs (fp8 intermediate and group scales) compared bit for bit.
One H200.

    PYTHONPATH=$PWD OUT=DIR python benchmarks/experiments/ws_fp8_gate_up.py [preset:T,...]
"""
import json, os, sys
from dataclasses import replace

import torch

from moeflow.kernels.autotune import graph_time_ms
from moeflow.kernels.configs import GemmConfig
from moeflow.kernels.gate_up import gate_up

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import fp8_block_case  # noqa: E402

CASES = [("qwen3-30b-a3b", 1024), ("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384), ("deepseek-v3", 4096),
         ("deepseek-v3", 16384), ("mixtral-8x7b", 1024), ("mixtral-8x7b", 16384)]
if len(sys.argv) > 1:
    CASES = [(p, int(t)) for p, t in (c.split(":") for c in sys.argv[1].split(","))]
VARIANTS = [GemmConfig(128, 128, 128, 8, 4, s, warp_specialize=1) for s in (3, 4)]
dev = torch.device("cuda")
rows = []
for preset, t in CASES:
    _, batch, layout, kcfg, w, xq, xs = fp8_block_case(preset, t, dev)
    run = lambda cfg: gate_up(xq, xs, w.w13, w.w13_scale, layout, "fp8-block", "silu", torch.bfloat16, cfg)
    ref, ref_s = run(kcfg.gate_up)
    base = graph_time_ms([lambda: run(kcfg.gate_up)], 40) * 1e3
    res = dict(preset=preset, T=t, shipped=kcfg.gate_up.to_dict(), shipped_us=round(base, 1), ws={})
    line = f"{preset:14} T={t:<6} shipped {base:9.1f} us"
    valid = layout.valid_rows()
    for v in VARIANTS:
        key = f"s{v.num_stages}"
        try:
            got, got_s = run(v)
            bits = bool((got.view(torch.uint8)[valid] == ref.view(torch.uint8)[valid]).all()
                        and torch.equal(got_s[valid], ref_s[valid]))
            us = graph_time_ms([lambda v=v: run(v)], 40) * 1e3
        except Exception as exc:  # recorded, not fatal
            res["ws"][key] = dict(error=repr(exc)[:300])
            line += f" | {key} error"
            continue
        res["ws"][key] = dict(us=round(us, 1), bit_equal=bits)
        line += f" | {key} {us:8.1f} ({base / us:.2f}x{'' if bits else ' DIFF'})"
    print(line, flush=True)
    rows.append(res)
    del w
    torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name(), rows=rows),
          open(os.path.join(os.environ.get("OUT", "."), "ws_fp8_gate_up.json"), "w"), indent=1)
