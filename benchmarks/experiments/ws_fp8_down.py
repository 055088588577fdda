"""The warp-specialized persistent Gluon down GEMM in fp8-block (kernels/warp_specialized.py, SCALED: products by
turns in each consumer's K loop) against the shipped fp8-block down (tuned table), alone, graph-timed as the tuner
times it (the row-block table's launch included); outputs compared bit for bit with the shipped kernel's. One H200.

    PYTHONPATH=$PWD OUT=DIR python benchmarks/experiments/ws_fp8_down.py [preset:T,...]
"""
import json, os, sys
from types import SimpleNamespace

import torch

from moeflow.kernels.autotune import _layer_parts, batches_for, graph_time_ms, random_batch
from moeflow.kernels.common import RowLayout
from moeflow.kernels.configs import GemmConfig
from moeflow.kernels.down import down
from moeflow.quant import create_scheme

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_case import preset_weights  # noqa: E402

dev = torch.device("cuda")
ROWS = [("qwen3-30b-a3b", 1024), ("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384), ("deepseek-v3", 4096),
        ("deepseek-v3", 16384), ("mixtral-8x7b", 1024), ("mixtral-8x7b", 16384)]
if len(sys.argv) > 1:
    ROWS = [(p, int(t)) for p, t in (r.split(":") for r in sys.argv[1].split(","))]
VARIANTS = ([GemmConfig(64, 128, 128, 8, 4, s, warp_specialize=1) for s in (4, 6, 8)]
            + [GemmConfig(128, 64, 128, 8, 4, s, warp_specialize=1) for s in (6, 8)])
SCH = create_scheme("fp8-block")
res, weights = [], {}
for preset, t in ROWS:
    shape, w = preset_weights(preset, "fp8-block", weights, dev)
    d_in = []
    for b in range(batches_for(t)):
        batch = random_batch(shape, t, dev, seed=t * 1000 + b)
        lay = RowLayout.of(batch)
        a, a_s = SCH.quantize_activation(torch.randn(lay.rows, shape.inter, device=dev).bfloat16())
        d_in.append((a, a_s, batch.weights, lay))
    kcfg = _layer_parts(shape)[1].kernel_config(batch, SimpleNamespace(w13=w.w13, w2=w.w2))
    run = lambda d, cfg, poison=False: down(d[0], d[1], w.w2, w.w2_scale, d[2], d[3], "fp8-block", torch.bfloat16, cfg,
                                            poison=poison)
    ref = run(d_in[0], kcfg.down)
    us = graph_time_ms([lambda d=d: run(d, kcfg.down) for d in d_in], 20) * 1e3
    fl = 2 * t * shape.top_k * shape.inter * shape.hidden
    row = dict(preset=preset, T=t, shipped=str(kcfg.down), shipped_us=round(us, 1), shipped_tflops=round(fl / us / 1e6))
    print(row, flush=True)
    res.append(row)
    for v in VARIANTS:
        try:
            out = run(d_in[0], v, poison=True)
            valid = d_in[0][3].valid_rows()
            same = bool(torch.equal(out[valid], ref[valid]))
            err = ((out.float() - ref.float())[valid].abs().max() / ref.float()[valid].abs().max()).item()
            us = graph_time_ms([lambda d=d, v=v: run(d, v) for d in d_in], 20) * 1e3
        except Exception as exc:
            us, err, same = repr(exc)[:200], float("nan"), False
        row = dict(preset=preset, T=t, variant=f"{v.block_m}x{v.block_n}s{v.num_stages}",
                   us=us if isinstance(us, str) else round(us, 1),
                   tflops=None if isinstance(us, str) else round(fl / us / 1e6), bit_equal=same, rel_err=err)
        print(row, flush=True)
        res.append(row)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "ws_fp8_down.json"), "w"), indent=1)
