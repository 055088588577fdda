"""GEMM-only timing of the shipped fp8-block configs, graph-timed like the tuner, for the three
presets at T = 1 ... 16384, with whatever kernels `moeflow` imports. Run it twice, once with a copy
of the package whose kernels/gate_up.py and down.py are the versions to compare, and compare the
JSON files (benchmarks/results/scale_prefetch_*.md).

    PYTHONPATH=$PWD python benchmarks/experiments/scale_prefetch.py new.json new
    PYTHONPATH=/tmp/old python benchmarks/experiments/scale_prefetch.py old.json old
"""
import json
import sys

import torch

from moeflow.kernels import configs as kc
from moeflow.kernels.autotune import Shape, random_weights, random_batch, batches_for, graph_time_ms
from moeflow.kernels.common import RowLayout
from moeflow.kernels.gate_up import gate_up
from moeflow.kernels.down import down
from moeflow.kernels.quant import quantize_rows, quantize_groups
PRESETS = {"qwen3": (128, 2048, 768, 8), "mixtral": (8, 4096, 14336, 2), "dsv3": (256, 7168, 2048, 8)}
dev = torch.device("cuda")
rows = []
for p, (e, h, i, k) in PRESETS.items():
    shape = Shape(e, h, i, k, "fp8-block")
    w = random_weights(shape, dev)
    table = kc.find_table(torch.cuda.get_device_name(), e, i, h, "fp8-block")
    for t in (1, 16, 128, 1024, 4096, 16384):
        cfg = kc.nearest(table, t)
        ins = []
        for b in range(batches_for(t)):
            bt = random_batch(shape, t, dev, seed=t * 1000 + b)
            lay = RowLayout.of(bt)
            xq, xs = quantize_rows(bt.hidden, "fp8-block", lay)
            ins.append((bt, lay, xq, xs))
        def gu(inp):
            bt, lay, xq, xs = inp
            inter, extra = gate_up(xq, xs, w.w13, w.w13_scale, lay, "fp8-block", "silu", torch.bfloat16, cfg.gate_up)
            return quantize_groups(inter) if extra is None else (inter, extra)
        t_gu = graph_time_ms([lambda i=i: gu(i) for i in ins], 30)
        dn_in = [(gu(i), i) for i in ins]
        t_dn = graph_time_ms([lambda d=d: down(d[0][0], d[0][1], w.w2, w.w2_scale, d[1][0].weights, d[1][1], "fp8-block",
                                                torch.bfloat16, cfg.down) for d in dn_in], 30)
        rows.append(dict(preset=p, T=t, gate_up_us=round(t_gu * 1e3, 2), down_us=round(t_dn * 1e3, 2),
                         gate_up_cfg=str(cfg.gate_up), down_cfg=str(cfg.down)))
        print(sys.argv[2], p, t, rows[-1]["gate_up_us"], rows[-1]["down_us"], flush=True)
    del w
    torch.cuda.empty_cache()
json.dump({"label": sys.argv[2], "rows": rows}, open(sys.argv[1], "w"), indent=1)
