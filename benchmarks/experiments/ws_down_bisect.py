"""Bisect a crash of the warp-specialized down (_ws_down.py): each case in its own process (a fault ends the
CUDA context). Qwen3's down shape, bf16, T tokens. One H200.

    PYTHONPATH=$PWD python benchmarks/experiments/ws_down_bisect.py
"""
import json, os, subprocess, sys

CASE = r'''
import json, sys, torch
sys.path.insert(0, "benchmarks/experiments")
from _ws_down import ws_down
from moeflow.kernels.autotune import Shape, random_batch, random_weights
from moeflow.kernels.common import RowLayout
from moeflow.kernels.down import down_torch
kw = json.loads(sys.argv[1]); t = kw.pop("T"); e = kw.pop("E", 128)
dev = torch.device("cuda")
shape = Shape(e, 2048, 768, 8, "none")
w = random_weights(shape, dev)
batch = random_batch(shape, t, dev)
lay = RowLayout.of(batch)
a = torch.randn(lay.rows, 768, device=dev).to(torch.bfloat16)
out = torch.full((lay.rows, 2048), float("nan"), device=dev, dtype=torch.bfloat16)
ws_down(a, w.w2, batch.weights, lay, out, **kw)
torch.cuda.synchronize()
ref = down_torch(a, None, w.w2, None, batch.weights, lay, "none", torch.bfloat16)
v = lay.valid_rows()
print(json.dumps(dict(err=((out.float() - ref.float())[v].abs().max() / ref.float()[v].abs().max()).item(),
                      nan=int(out[v].isnan().sum()))))
'''
cases = [dict(T=1024, mode=0, stages=4), dict(T=16384, mode=0, stages=6)]
for c in cases:
    try:
        r = subprocess.run([sys.executable, "-c", CASE, json.dumps(c)], capture_output=True, text=True, timeout=90)
        out = r.stdout.strip().splitlines()[-1] if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1][:200]
    except subprocess.TimeoutExpired:
        out = "timeout (hang)"
    print(c, "->", out, flush=True)
