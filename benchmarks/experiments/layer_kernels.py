"""Per-kernel device time of the layer (eager; kernel durations do not depend on host overhead)
    CUDA_VISIBLE_DEVICES=0 python benchmarks/experiments/layer_kernels.py [preset:scheme:T,...]   (OUT=dir for the JSON)"""
import json, os, sys
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from bench_layer import Case, graph_us
from moeflow.experts import RUNNERS
from torch.profiler import ProfilerActivity, profile

CASES = [("qwen3-30b-a3b", "none", 1), ("qwen3-30b-a3b", "fp8-block", 1), ("deepseek-v3", "fp8-block", 1),
         ("qwen3-30b-a3b", "fp8-block", 1024), ("qwen3-30b-a3b", "none", 4096), ("qwen3-30b-a3b", "fp8-block", 4096),
         ("mixtral-8x7b", "fp8-block", 1024), ("deepseek-v3", "fp8-block", 4096), ("deepseek-v3", "fp8-block", 16384)]
if len(sys.argv) > 1:
    CASES = [(p, s, int(t)) for p, s, t in (c.split(":") for c in sys.argv[1].split(","))]
out = {}
cases = {}
for preset, scheme, t in CASES:
    key = (preset, scheme)
    if key not in cases:
        cases[key] = Case(preset, scheme)
    case = cases[key]
    runner = RUNNERS.get("triton")(case.cfg, case.scheme)
    x, logits = case.inputs(t, 1)[0]
    fn = lambda: case.layer(runner, x, logits)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g_us = graph_us(fn)
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    ev = p.key_averages()
    dev = lambda e: getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
    rows = sorted([(e.key, dev(e) / 5, e.count // 5) for e in ev if dev(e) > 0], key=lambda r: -r[1])
    name = f"{preset} {scheme} T={t}"
    out[name] = dict(graph_us=g_us, kernels=[(k[:70], round(us, 1), n) for k, us, n in rows[:14]],
                     total_kernel_us=round(sum(r[1] for r in rows), 1))
    print(f"\n== {name}: graph {g_us:.1f} us, sum of kernels {out[name]['total_kernel_us']} us")
    for k, us, n in out[name]["kernels"]:
        print(f"   {us:9.1f} us  x{n}  {k}")
    del runner
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "prof_layer.json"), "w"), indent=1)
