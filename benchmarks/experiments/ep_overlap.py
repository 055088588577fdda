"""Does a bandwidth-bound kernel on the compute stream overlap an NCCL all_to_all_single (c10d,
async_op=True) on 2 GPUs? Eager and in a CUDA graph. torchrun --nproc-per-node 2 benchmarks/experiments/ep_overlap.py"""
import os, sys, statistics, json
import torch, torch.distributed as dist
sys.path.insert(0, os.getcwd())
from moeflow.distributed import init_distributed
from moeflow.dispatch.gather_sum import gather_sum

dev = init_distributed()
rank = dist.get_rank()
R, K, H = 8192, 8, 7168
src = torch.randn(R * 4, H, device=dev, dtype=torch.bfloat16)
idx = torch.randint(0, R * 4, (R, K), device=dev)
half = idx[: R // 2].contiguous()
send = torch.randn(R, H, device=dev, dtype=torch.bfloat16)
recv = torch.empty_like(send)

def t_us(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize(); dist.barrier()
    out = []
    for _ in range(5):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        torch.cuda.synchronize(); dist.barrier()
        a.record()
        for _ in range(n):
            fn()
        b.record(); b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / n)
    return statistics.median(out)

def cap(fn):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        fn()
    torch.cuda.synchronize()
    return g

def a2a():
    dist.all_to_all_single(recv, send)

def sum_full():
    gather_sum(src, idx)

def both():  # a2a in flight while an independent sum runs
    w = dist.all_to_all_single(recv, send, async_op=True)
    gather_sum(src, idx)
    w.wait()

def both_after():  # sum first, then a2a: serial reference
    gather_sum(src, idx)
    dist.all_to_all_single(recv, send)

res = {}
for name, fn in dict(a2a=a2a, sum=sum_full, overlapped=both, serial=both_after).items():
    res[f"eager_{name}"] = t_us(fn)
    res[f"graph_{name}"] = t_us(cap(fn).replay)
# side stream for the sum instead of the current one
side = torch.cuda.Stream()
def both_side():
    side.wait_stream(torch.cuda.current_stream())
    w = dist.all_to_all_single(recv, send, async_op=True)
    with torch.cuda.stream(side):
        gather_sum(src, idx)
    w.wait()
    torch.cuda.current_stream().wait_stream(side)
res["eager_overlapped_side"] = t_us(both_side)
res["graph_overlapped_side"] = t_us(cap(both_side).replay)
if rank == 0:
    print("OVERLAP", json.dumps({k: round(v, 1) for k, v in res.items()}))
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "overlap.json"), "w"))
dist.barrier(); dist.destroy_process_group()
