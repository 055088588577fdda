"""alltoall-fixed's transfers as one all_to_all_single vs P2P to the peer only (the self block
handled on the compute stream meanwhile), 2 GPUs, eager and CUDA graph.
    torchrun --nproc-per-node 2 benchmarks/experiments/ep_p2p.py"""
import os, sys, json
import torch, torch.distributed as dist
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moeflow.distributed import init_distributed
from moeflow.dispatch.gather_sum import gather_sum
from _ep_timing import capture as cap, t_us

dev = init_distributed()
rank, W = dist.get_rank(), dist.get_world_size()
peer = 1 - rank
C, K, H, RB = 4096, 8, 7168, 14400
send = torch.randint(0, 255, (W * C, RB), dtype=torch.uint8, device=dev)
recv = torch.empty_like(send)
out = torch.randn(W * C * 4, H, device=dev, dtype=torch.bfloat16)  # expert outputs (copies)
pos = torch.randint(0, W * C * 4, (W, C, K), device=dev)
pos[:, :, 4:] = -1  # ~4 copies per row here
back = torch.empty(W * C, H, device=dev, dtype=torch.bfloat16)
home = torch.stack([torch.arange(C, device=dev) + r * C for r in range(W)], 1)

def d_a2a():
    dist.all_to_all_single(recv, send)

def p2p(sbuf, rbuf):
    ops = [dist.P2POp(dist.isend, sbuf, peer), dist.P2POp(dist.irecv, rbuf, peer)]
    return dist.batch_isend_irecv(ops)

def d_p2p():
    works = p2p(send[peer * C:(peer + 1) * C], recv[peer * C:(peer + 1) * C])
    recv[rank * C:(rank + 1) * C].copy_(send[rank * C:(rank + 1) * C])
    for w in works:
        w.wait()

def c_a2a():
    partial = gather_sum(out, pos.view(-1, K))
    dist.all_to_all_single(back, partial)
    gather_sum(back, home)

def c_p2p():
    part_peer = gather_sum(out, pos[peer])
    works = p2p(part_peer, back[peer * C:(peer + 1) * C])
    back[rank * C:(rank + 1) * C].copy_(gather_sum(out, pos[rank]))
    for w in works:
        w.wait()
    gather_sum(back, home)

res = {}
for name, fn in dict(dispatch_a2a=d_a2a, dispatch_p2p=d_p2p, combine_a2a=c_a2a, combine_p2p=c_p2p).items():
    res[f"eager_{name}"] = t_us(fn)
    try:
        res[f"graph_{name}"] = t_us(cap(fn).replay)
    except Exception as exc:
        res[f"graph_{name}"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        break
if rank == 0:
    print("P2P", json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in res.items()}))
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "p2p.json"), "w"))
dist.barrier(); dist.destroy_process_group()
