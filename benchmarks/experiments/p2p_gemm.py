"""Is the runner slower on alltoall-p2p's batch? Time layer.runner on the batch of alltoall-fixed,
of alltoall-p2p, and of alltoall-p2p with its received rows copied into an ordinary tensor (same layout).

    PYTHONPATH=$PWD torchrun --standalone --nproc-per-node 2 benchmarks/experiments/p2p_gemm.py
"""
import dataclasses, json, os, sys
import torch, torch.distributed as dist
sys.path.insert(0, "benchmarks")
from moeflow import MoE
from moeflow.distributed import init_distributed
from moeflow.layouts import run_in_layout
from bench_ep import routing

def gtime(fn, n=5):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n): fn()
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3 / n)
    return sorted(ts)[2]

dev = init_distributed(); rank = dist.get_rank()
res = {}
T = 4096
for quant in ("fp8-block", "none"):
    torch.manual_seed(0)
    x = torch.randn(T, 7168, device=dev).to(torch.bfloat16)
    ids, w = routing(T, 256, 8, dev)
    for disp in ("alltoall-fixed", "alltoall-p2p"):
        layer = MoE(num_experts=256, hidden_size=7168, intermediate_size=2048, top_k=8, quant=quant, runner="triton",
                    dispatcher=disp, dtype=torch.bfloat16, device=dev, max_tokens_per_rank=T)
        d = layer.dispatcher
        batch, handle = d.dispatch(x, ids, w)
        wts = layer.expert_weights()
        res[f"{quant}/{disp}"] = gtime(lambda: run_in_layout(layer.runner, batch, wts))
        if disp == "alltoall-p2p":
            rows = d.codec.unpack(d.peers.local["rows"].clone())  # same layout, ordinary memory
            copy = dataclasses.replace(batch, hidden=d.codec.as_payload(rows.hidden), hidden_scale=rows.scale)
            res[f"{quant}/{disp}/rows-copied"] = gtime(lambda: run_in_layout(layer.runner, copy, wts))
            res[f"{quant}/rows-stride"] = [batch.hidden.stride(), None if batch.hidden_scale is None else batch.hidden_scale.stride(),
                                           copy.hidden.stride(), int(batch.offsets[-1])]
        del layer, d, batch, handle
        torch.cuda.empty_cache()
    dist.barrier()
allr = [None, None]; dist.all_gather_object(allr, res)
if rank == 0:
    print(json.dumps(allr, indent=0))
    json.dump(allr, open(os.path.join(os.environ.get("OUT", "/tmp"), "p2p_gemm.json"), "w"), indent=1)
dist.barrier(); dist.destroy_process_group()
