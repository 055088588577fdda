"""Does a bandwidth-bound kernel on the compute stream overlap an NCCL all_to_all_single (c10d,
async_op=True) on 2 GPUs? Eager and in a CUDA graph. torchrun --nproc-per-node 2 benchmarks/experiments/ep_overlap.py"""
import os, sys, json
import torch, torch.distributed as dist
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moeflow.distributed import init_distributed
from moeflow.dispatch.gather_sum import gather_sum
from _ep_timing import capture as cap, t_us

dev = init_distributed()
rank = dist.get_rank()
R, K, H = 8192, 8, 7168
src = torch.randn(R * 4, H, device=dev, dtype=torch.bfloat16)
idx = torch.randint(0, R * 4, (R, K), device=dev)
half = idx[: R // 2].contiguous()
send = torch.randn(R, H, device=dev, dtype=torch.bfloat16)
recv = torch.empty_like(send)

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
