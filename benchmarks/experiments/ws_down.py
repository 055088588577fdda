"""The warp-specialized persistent Gluon down GEMM (kernels/warp_specialized.py; its prototype and the crash bisect are
in git history at 478a346) against the shipped bf16 down (tuned table), alone, graph-timed as the tuner times
it (the row-block table's launch included); outputs compared. One H200.

    PYTHONPATH=$PWD OUT=DIR python benchmarks/experiments/ws_down.py
"""
import json, os
from types import SimpleNamespace

import torch

from moeflow.kernels.autotune import Shape, _layer_parts, batches_for, graph_time_ms, random_batch, random_weights  # noqa: E402
from moeflow.kernels.common import RowLayout  # noqa: E402
from moeflow.kernels.configs import GemmConfig  # noqa: E402
from moeflow.kernels.down import down  # noqa: E402
from moeflow.presets import PRESETS  # noqa: E402

dev = torch.device("cuda")
ROWS = [("qwen3-30b-a3b", (1024, 4096, 16384)), ("deepseek-v3", (4096, 16384)), ("mixtral-8x7b", (4096, 16384))]
VARIANTS = [GemmConfig(128, 128, 64, 8, 4, s, warp_specialize=1) for s in (4, 5, 6)]
res = []
for preset, ts in ROWS:
    p = PRESETS[preset]
    shape = Shape(p["num_experts"], p["hidden_size"], p["intermediate_size"], p["top_k"], "none")
    w = random_weights(shape, dev)
    for t in ts:
        d_in = []
        for b in range(batches_for(t)):
            batch = random_batch(shape, t, dev, seed=t * 1000 + b)
            lay = RowLayout.of(batch)
            a = torch.randn(lay.rows, shape.inter, device=dev).to(torch.bfloat16)
            d_in.append((a, batch.weights, lay))
        kcfg = _layer_parts(shape)[1].kernel_config(batch, SimpleNamespace(w13=w.w13, w2=w.w2))
        ref = down(d_in[0][0], None, w.w2, None, d_in[0][1], d_in[0][2], "none", torch.bfloat16, kcfg.down)
        us = graph_time_ms([lambda d=d: down(d[0], None, w.w2, None, d[1], d[2], "none", torch.bfloat16, kcfg.down)
                            for d in d_in], 20) * 1e3
        fl = 2 * t * shape.top_k * shape.inter * shape.hidden
        row = dict(preset=preset, T=t, shipped=str(kcfg.down), shipped_us=round(us, 1), shipped_tflops=round(fl / us / 1e6))
        print(row, flush=True)
        res.append(row)
        for v in VARIANTS:
            try:
                out = down(d_in[0][0], None, w.w2, None, d_in[0][1], d_in[0][2], "none", torch.bfloat16, v, poison=True)
                valid = d_in[0][2].valid_rows()
                err = ((out.float() - ref.float())[valid].abs().max() / ref.float()[valid].abs().max()).item()
                us = graph_time_ms([lambda d=d, v=v: down(d[0], None, w.w2, None, d[1], d[2], "none", torch.bfloat16, v)
                                    for d in d_in], 20) * 1e3
            except Exception as exc:
                us, err = repr(exc)[:200], float("nan")
            row = dict(preset=preset, T=t, variant=str(v), us=us if isinstance(us, str) else round(us, 1),
                       tflops=None if isinstance(us, str) else round(fl / us / 1e6), rel_err=err)
            print(row, flush=True)
            res.append(row)
    del w
    torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "ws_down.json"), "w"), indent=1)
