"""Expert-parallel benchmark: dispatch and combine bandwidth against raw NCCL of the same bytes, the
whole layer with EP, and low-latency dispatch/combine replayed from CUDA graphs.

    torchrun --nproc-per-node 2 benchmarks/bench_ep.py --out ep.json            # 2×H200 (issue targets)
    torchrun --nproc-per-node 2 benchmarks/bench_ep.py --small --out ep.json    # CPU/gloo smoke run

Method. Every timing is the median of 5 repetitions of ``iters`` back-to-back calls, each repetition
opened by a barrier and timed with CUDA events (perf_counter on CPU). Both ranks run the same calls
in the same order; no collective runs inside triton.testing.do_bench (its repeat count differs per
rank). "bytes" are the bytes this rank sends to *other* ranks (rows kept on the rank itself are a
local copy): dispatch = packed rows (token + routing + FP8 scales), combine = partial sums sent back.
The raw baseline is dist.all_to_all_single over buffers of exactly those bytes and split sizes,
timed the same way in the same run; ratio = raw time / moeflow time (1.0 = as fast as raw NCCL).
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from moeflow import MoE, MoEConfig  # noqa: E402
from moeflow.dispatch import DISPATCHERS, create_dispatcher  # noqa: E402
from moeflow.distributed import all_gather_start, init_distributed  # noqa: E402
from moeflow.quant import create_scheme  # noqa: E402


def timed(fn, iters, dev, reps=5):
    """Median over ``reps`` of the mean time (µs) of ``iters`` calls of fn."""
    for _ in range(2):
        fn()
    out = []
    for _ in range(reps):
        sync(dev)
        dist.barrier()
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) * 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - t0) * 1e6 / iters)
    return statistics.median(out)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def routing(t, e, k, dev):
    ids = torch.rand(t, e, device=dev).topk(k).indices.to(torch.int32)  # uniform random routing
    return ids, torch.rand(t, k, device=dev)


def profile(name, fn, dev, rank, res, trace=""):
    """Device time per kernel of 5 eager calls (torch.profiler), kept under res["profile/<name>"],
    and host time per op (self CPU time: where a host-bound call spends it) under res["host/<name>"]."""
    if dev.type != "cuda":
        return
    from torch.profiler import ProfilerActivity, profile as prof

    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    if trace and rank == 0:
        p.export_chrome_trace(f"{trace}/trace_{name}.json")
    dev_us = lambda e: getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
    events = p.key_averages()
    rows = sorted(events, key=lambda e: -dev_us(e))[:15]
    res[f"profile/{name}"] = {e.key[:90]: round(dev_us(e) / 5, 1) for e in rows if dev_us(e) > 0}
    host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:20]
    res[f"host/{name}"] = {"_total_self_cpu_us": round(sum(e.self_cpu_time_total for e in events) / 5, 1),
                           **{f"{e.key[:60]} x{e.count // 5}": round(e.self_cpu_time_total / 5, 1) for e in host}}


def raw_a2a(send_rows, recv_rows, row_bytes, dev):
    """A closure running all_to_all_single over uint8 buffers of these split sizes."""
    inp = torch.randint(0, 255, (sum(send_rows), row_bytes), dtype=torch.uint8, device=dev)
    out = torch.empty(sum(recv_rows), row_bytes, dtype=torch.uint8, device=dev)
    return lambda: dist.all_to_all_single(out, inp, recv_rows, send_rows)


def bench_alltoall(a, dev, rank, res):
    h, dt = a.hidden, torch.bfloat16
    for quant in ("none", "fp8-block"):  # bf16 payload; FP8 payload (the scheme's own 1x128 scales)
        cfg = MoEConfig(num_experts=a.experts, hidden_size=h, intermediate_size=a.inter, top_k=a.topk, quant=quant,
                        dtype=dt, device=dev)
        x = torch.randn(a.tokens, h, device=dev).to(dt)
        ids, w = routing(a.tokens, a.experts, a.topk, dev)
        r_d, r_c = bench_exact(a, cfg, quant, x, ids, w, dev, rank, res)
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # the exact dispatcher's buffers are gone with bench_exact's frame
        for name in ("alltoall-fixed", "alltoall-p2p"):
            if name == "alltoall-p2p" and dev.type != "cuda":
                continue  # peer memory: CUDA only
            fixed = bench_fixed(a, cfg, quant, x, ids, w, dev, rank, res, name)
            res[f"{name}/{quant}"] = dict(fixed, raw_dispatch_us=r_d, raw_combine_us=r_c, **{
                f"ratio_{k}": (r_d + r_c) / (fixed[f"{k}_dispatch_us"] + fixed[f"{k}_combine_us"])
                for k in ("eager", "graph") if f"{k}_dispatch_us" in fixed})
            if dev.type == "cuda":
                torch.cuda.empty_cache()


def bench_exact(a, cfg, quant, x, ids, w, dev, rank, res):
    """alltoall: dispatch (rows by index, and gathered) and combine against raw NCCL of the same
    bytes and split sizes -> (raw dispatch µs, raw combine µs), the baseline of alltoall-fixed too."""
    h, dt = cfg.hidden_size, cfg.dtype
    # rows by index, as the layer's plan asks for the triton runner (Plan.indexed_rows); the
    # gathered batch (one row copied per copy, what other runners get) is timed beside it
    d = create_dispatcher("alltoall", cfg, create_scheme(quant), indexed_rows=True)
    gathered = create_dispatcher("alltoall", cfg, create_scheme(quant), indexed_rows=False)
    batch, handle = d.dispatch(x, ids, w)
    out = torch.randn(batch.num_rows, h, device=dev).to(dt)
    t_d = timed(lambda: d.dispatch(x, ids, w), a.iters, dev)
    t_dg = timed(lambda: gathered.dispatch(x, ids, w), a.iters, dev)
    t_c = timed(lambda: d.combine(out, handle), a.iters, dev)
    # the transfer alone: pack + counts exchange + the all-to-all, without building the ExpertBatch
    # (dispatch) or the home-rank sum (combine)
    t_dx = timed(lambda: d.dispatch_start(x, ids, w).work.wait(), a.iters, dev)
    t_cx = timed(lambda: d.combine_start(out, handle).work.wait(), a.iters, dev)
    others = [r for r in range(d.world) if r != rank]
    d_bytes = sum(handle.sent[r] for r in others) * d.codec.row_bytes
    c_bytes = sum(handle.received[r] for r in others) * h * dt.itemsize
    if a.profile:
        profile(f"alltoall-{quant}-dispatch", lambda: d.dispatch(x, ids, w), dev, rank, res, a.trace)
        profile(f"alltoall-{quant}-combine", lambda: d.combine(out, handle), dev, rank, res)
    r_d = timed(raw_a2a(handle.sent, handle.received, d.codec.row_bytes, dev), a.iters, dev)
    r_c = timed(raw_a2a(handle.received, handle.sent, h * dt.itemsize, dev), a.iters, dev)
    res[f"alltoall/{quant}"] = dict(
        tokens=a.tokens, payload=str(d.codec.dtype), row_bytes=d.codec.row_bytes, rows_sent=handle.sent,
        dispatch_us=t_d, dispatch_gathered_us=t_dg, combine_us=t_c, raw_dispatch_us=r_d, raw_combine_us=r_c, copies=batch.num_rows,
        dispatch_transfer_us=t_dx, combine_transfer_us=t_cx,
        dispatch_bytes=d_bytes, combine_bytes=c_bytes,
        dispatch_GBps=d_bytes / t_d / 1e3, combine_GBps=c_bytes / t_c / 1e3,
        raw_dispatch_GBps=d_bytes / r_d / 1e3, raw_combine_GBps=c_bytes / r_c / 1e3,
        ratio_dispatch=r_d / t_d, ratio_combine=r_c / t_c, ratio_total=(r_d + r_c) / (t_d + t_c))
    return r_d, r_c


def bench_fixed(a, cfg, quant, x, ids, w, dev, rank, res, name="alltoall-fixed"):
    """alltoall-fixed or alltoall-p2p (blocks of max_tokens_per_rank = the batch's T rows): eager, and
    replayed from CUDA graphs (dispatch and combine captured apart); raw NCCL of alltoall's exact bytes
    is the baseline (the fixed blocks move W·T rows: a few more when a token skips a rank)."""
    d = create_dispatcher(name, cfg.replace(max_tokens_per_rank=a.tokens), create_scheme(quant), indexed_rows=True)
    batch, handle = d.dispatch(x, ids, w)
    out = torch.randn(batch.num_rows, cfg.hidden_size, device=dev).to(cfg.dtype)
    last = {"handle": handle}  # the combine's batch: dispatched again after the dispatches timed before it

    def combine():
        return d.combine(out, last["handle"])

    def fresh(fn):  # alltoall-p2p refuses (MF509) to combine a batch whose rows later dispatches refilled
        if fn is combine:
            last["handle"] = d.dispatch(x, ids, w)[1]
        return fn

    fns = {"dispatch": lambda: d.dispatch(x, ids, w), "combine": combine}
    r = dict(tokens=a.tokens, rows_per_block=a.tokens, batch_rows=batch.num_rows, copies=int(batch.offsets[-1]),
             combine_pieces=handle.pieces)
    for half, fn in fns.items():
        r[f"eager_{half}_us"] = timed(fresh(fn), a.iters, dev)
    if a.profile:
        profile(f"{name}-{quant}-dispatch", fns["dispatch"], dev, rank, res)
        profile(f"{name}-{quant}-combine", fresh(fns["combine"]), dev, rank, res)
    if dev.type == "cuda":
        for half, fn in fns.items():
            r[f"graph_{half}_us"] = timed(capture(fresh(fn)).replay, a.iters, dev)
        if name != "alltoall-fixed":
            return r
        default = d.combine_chunks
        for pieces in (1, 2, 8):  # the combine in other numbers of pieces (the default is timed above)
            d.combine_chunks = pieces
            batch, handle = d.dispatch(x, ids, w)
            r[f"graph_combine_{pieces}_pieces_us"] = timed(capture(lambda: d.combine(out, handle)).replay, a.iters, dev)
        d.combine_chunks = default
    return r


def capture(fn):
    """fn captured in a CUDA graph (warmed up on a side stream first, as graphs want)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):  # NCCL's watchdog thread keeps polling
        fn()
    torch.cuda.synchronize()
    return g


def bench_lowlatency(a, dev, rank, res):
    h, dt, t = a.hidden, torch.bfloat16, a.ll_tokens
    cfg = MoEConfig(num_experts=a.experts, hidden_size=h, intermediate_size=a.inter, top_k=a.topk, quant="fp8-block",
                    dtype=dt, device=dev, max_tokens_per_rank=t)
    d = DISPATCHERS.get("lowlatency")(cfg, create_scheme("fp8-block"))  # FP8 dispatch, bf16 combine
    x = torch.randn(t, h, device=dev).to(dt)
    ids, w = routing(t, a.experts, a.topk, dev)
    batch, handle = d.dispatch(x, ids, w)
    out = torch.randn(batch.hidden.shape, device=dev).to(dt)
    row, world = d.codec.row_bytes, d.world
    gather_in = torch.empty(t, row, dtype=torch.uint8, device=dev)
    gather_out = torch.empty(world * t, row, dtype=torch.uint8, device=dev)
    back_in = torch.empty(world * t, h, dtype=dt, device=dev)
    back_out = torch.empty_like(back_in)
    fns = {
        "dispatch": lambda: d.dispatch(x, ids, w),
        "combine": lambda: d.combine(out, handle),
        "raw_allgather": lambda: all_gather_start(gather_out, gather_in, None).wait(),
        "raw_alltoall": lambda: dist.all_to_all_single(back_out, back_in),
    }
    if a.profile:
        profile("lowlatency-dispatch", fns["dispatch"], dev, rank, res)
    r = dict(tokens=t, row_bytes=row, dispatch_bytes=(world - 1) * t * row, combine_bytes=(world - 1) * t * h * 2)
    for name, fn in fns.items():
        r[f"eager_{name}_us"] = timed(fn, a.iters, dev)
    res["lowlatency/fp8-dispatch"] = r
    if dev.type != "cuda":
        return
    g = {name: capture(fn) for name, fn in fns.items()}  # one graph per call: dispatch and combine apart
    for name, graph in g.items():
        r[f"graph_{name}_us"] = timed(graph.replay, a.iters, dev)


def bench_layer(a, dev, rank, res):
    """The whole layer with EP: route -> dispatch -> experts -> combine, eager (alltoall syncs the host)."""
    for disp, runner, quant, t in (("alltoall", "grouped_mm", "none", a.tokens),
                                   ("alltoall", "grouped_mm", "fp8-channel", a.tokens),
                                   ("alltoall", "triton", "fp8-block", a.tokens),
                                   ("alltoall-fixed", "triton", "fp8-block", a.tokens),
                                   ("alltoall-p2p", "triton", "fp8-block", a.tokens),
                                   ("alltoall", "triton", "none", a.tokens),
                                   ("alltoall-fixed", "triton", "none", a.tokens),
                                   ("alltoall-p2p", "triton", "none", a.tokens),
                                   ("lowlatency", "grouped_mm", "fp8-channel", a.ll_tokens),
                                   ("lowlatency", "triton", "fp8-block", a.ll_tokens)):
        res[f"layer/{disp}/{runner}/{quant}/T{t}"] = layer_time(a, dev, disp, runner, quant, t)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    # DeepSeek-V3 has one shared expert (I = 2048): the layer runs it between the dispatch halves
    for disp in ("alltoall-fixed", "alltoall-p2p"):
        res[f"layer/{disp}/triton/fp8-block/T{a.tokens}/shared"] = layer_time(a, dev, disp, "triton", "fp8-block",
                                                                            a.tokens, shared=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def layer_time(a, dev, disp, runner, quant, t, shared=False):
    from moeflow.errors import MoeflowError

    extra = dict(num_shared_experts=1, shared_intermediate_size=a.inter) if shared else {}
    try:
        layer = MoE(num_experts=a.experts, hidden_size=a.hidden, intermediate_size=a.inter, top_k=a.topk,
                    quant=quant, runner=runner, dispatcher=disp, dtype=torch.bfloat16, device=dev,
                    max_tokens_per_rank=max(t, 1), **extra)
    except MoeflowError as exc:
        return dict(skipped=exc.code)
    x, logits = torch.randn(t, a.hidden, device=dev).to(torch.bfloat16), torch.randn(t, a.experts, device=dev)
    r = dict(tokens=t, layer_us=timed(lambda: layer(x, logits), max(a.iters // 4, 3), dev))
    if a.profile and disp.startswith("alltoall-"):  # device time per kernel of the layer (eager)
        prof = {}
        profile("layer", lambda: layer(x, logits), dev, dist.get_rank(), prof)
        r["profile"] = prof.get("profile/layer")
    p = layer.plan
    if dev.type == "cuda" and disp != "alltoall" and p.layout == p.runner_layout and p.runner != "reference":
        # the fixed-shape dispatchers with a runner of their layout: the layer as one CUDA graph
        os.environ["MOEFLOW_VALIDATE_INPUTS"] = "0"  # (input checks read values on the host)
        try:
            r["graph_layer_us"] = timed(capture(lambda: layer(x, logits)).replay, max(a.iters // 4, 3), dev)
        finally:
            os.environ.pop("MOEFLOW_VALIDATE_INPUTS")
    return r


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--ll-tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke run)")
    p.add_argument("--skip", default="", help="comma list of sections to skip: alltoall,lowlatency,layer")
    p.add_argument("--profile", action="store_true", help="also record device time per kernel of dispatch")
    p.add_argument("--trace", default="", help="with --profile: a folder for rank 0's chrome traces of dispatch")
    p.add_argument("--out", default="")
    a = p.parse_args()
    if a.small:
        a.tokens, a.ll_tokens, a.hidden, a.inter, a.experts, a.iters = 64, 16, 256, 128, 16, 3
    dev = init_distributed()
    rank = dist.get_rank()
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "world": dist.get_world_size(), "torch": torch.__version__,
           "nccl": nccl_version() if dev.type == "cuda" else None,
           "commit": os.environ.get("MOEFLOW_COMMIT", ""), "args": vars(a)}
    sections = {"alltoall": bench_alltoall, "lowlatency": bench_lowlatency, "layer": bench_layer}
    for name, fn in sections.items():
        if name not in a.skip.split(","):
            fn(a, dev, rank, res)
            dump(res, a.out, rank)
    if rank == 0:
        print_table(res)
    dist.barrier()
    dist.destroy_process_group()


def nccl_version():
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def dump(res, path, rank):
    if path and rank == 0:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)


def print_table(res):
    print(f"\n{res['device']} x{res['world']}, torch {res['torch']}, NCCL {res['nccl']}, commit {res['commit']}")
    for key, r in res.items():
        if key.startswith("alltoall/"):
            print(f"{key:22s} dispatch {r['dispatch_us']:8.1f} us {r['dispatch_GBps']:6.1f} GB/s (raw {r['raw_dispatch_us']:7.1f} us,"
                  f" x{r['ratio_dispatch']:.2f})  combine {r['combine_us']:8.1f} us {r['combine_GBps']:6.1f} GB/s"
                  f" (raw {r['raw_combine_us']:7.1f} us, x{r['ratio_combine']:.2f})  total x{r['ratio_total']:.2f}"
                  f"  [transfer only: dispatch {r['dispatch_transfer_us']:.1f} us, combine {r['combine_transfer_us']:.1f} us;"
                  f" gathered dispatch {r['dispatch_gathered_us']:.1f} us]")
        elif key.startswith(("alltoall-fixed/", "alltoall-p2p/")):
            print(f"{key:22s} " + "  ".join(f"{k[:-3]} {v:.1f}" for k, v in r.items() if k.endswith("_us"))
                  + f"  (us; combine pieces {r.get('combine_pieces')})  ratio " + "  ".join(f"{k[6:]} x{v:.2f}" for k, v in r.items() if k.startswith("ratio_")))
        elif key.startswith("lowlatency/"):
            print(f"{key:22s} " + "  ".join(f"{k[:-3]} {v:.1f}" for k, v in r.items() if k.endswith("_us")) + "  (us)")
        elif key.startswith("host/"):
            print(f"{key}: " + ", ".join(f"{k[:50]} {v:.0f}" for k, v in list(r.items())[:10]) + " (us per call)")
        elif key.startswith("profile/"):
            print(f"{key}: " + ", ".join(f"{k[:40]} {v:.0f}" for k, v in list(r.items())[:8]) + " (us per call)")
        elif key.startswith("layer/"):
            print(f"{key:42s} " + (f"{r['layer_us']:9.1f} us" if "layer_us" in r else f"skipped ({r['skipped']})")
                  + (f"  graph {r['graph_layer_us']:9.1f} us" if "graph_layer_us" in r else ""))
            if r.get("profile"):
                print("    " + ", ".join(f"{k[:28]} {v:.0f}" for k, v in list(r["profile"].items())[:9]) + " (us per call)")


if __name__ == "__main__":
    main()
