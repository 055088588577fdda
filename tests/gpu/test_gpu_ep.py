"""Expert parallelism on GPUs: NCCL, one process per GPU (run through the device tool, 2×H200).

    python -m pytest -m gpu tests/gpu/test_gpu_ep.py    # spawns the workers below with torchrun
    torchrun --nproc-per-node 2 tests/gpu/test_gpu_ep.py OUT.json   # the workers themselves

Checks, per rank: every dispatcher × every runner the planner accepts on this GPU × scheme (bf16)
equals the one-process layer with the same weights (tests/tolerances.py), rows handed as the plan
says (by index for the triton runner); the FP8 payload on a bf16 layer; the start/wait halves;
low-latency dispatch → experts → combine captured in one CUDA graph and replayed on fresh inputs
(with a capturable stand-in expert: the masked layout's own math); the whole layer captured for
runners that consume the masked layout natively (not "reference", which reads counts on the host);
the whole layer with alltoall-fixed and alltoall-p2p (no host synchronization) captured and
replayed; alltoall-p2p's barrier giving up on a silent peer.
"""
import json
import os
import subprocess
import sys
import traceback
import zlib

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_ep_nccl_two_gpus(tmp_path):
    out = tmp_path / "results.json"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", __file__, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads(out.read_text())
    bad = {k: v for k, v in results.items() if not (v == "ok" or v.startswith("skip"))}
    assert not bad, json.dumps(bad, indent=1)[:6000]


# ---------------------------------------------------------------- the workers (torchrun)
def stand_in_expert(batch, dispatcher, dtype):
    """Masked batch -> each valid slot's token × its routing weight, capturable (no host sync)."""
    e, c, h = batch.hidden.shape
    if batch.hidden_scale is None:
        x = batch.hidden.float()
    else:
        x = dispatcher.codec.payload.dequantize_activation(
            batch.hidden.reshape(e * c, h), batch.hidden_scale.reshape(e * c, -1)).view(e, c, h)
    valid = torch.arange(c, device=x.device)[None, :] < batch.counts[:, None]
    return torch.where(valid[..., None], x * batch.weights[..., None], 0.0).to(dtype)


def check_graph(ctx, payload, whole_layer_runner=None, dispatcher="lowlatency", quant="fp8-block"):
    from moeflow import MoE, MoEConfig
    from oracle import rel_err

    cfg = MoEConfig(num_experts=16, hidden_size=512, intermediate_size=256, top_k=4, dispatcher=dispatcher,
                    max_tokens_per_rank=64, dtype=torch.bfloat16, device=ctx.device,
                    runner=whole_layer_runner or "reference", quant=quant if whole_layer_runner else "none")
    layer = MoE(cfg)
    d = layer.dispatcher.with_payload(payload)
    t, h, e, k = 48, cfg.hidden_size, cfg.num_experts, cfg.top_k
    x = torch.randn(t, h, device=ctx.device).to(cfg.dtype)
    logits = torch.randn(t, e, device=ctx.device)
    ids = torch.rand(t, e, device=ctx.device).topk(k).indices.to(torch.int32)
    w = torch.rand(t, k, device=ctx.device)

    def step():
        if whole_layer_runner:
            return layer(x, logits)
        batch, handle = d.dispatch(x, ids, w)
        return d.combine(stand_in_expert(batch, d, cfg.dtype), handle)

    os.environ["MOEFLOW_VALIDATE_INPUTS"] = "0"
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as CUDA graphs want
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # NCCL's watchdog thread keeps polling
        y = step()
    for trial in range(3):
        x.copy_(torch.randn(t, h, device=ctx.device).to(cfg.dtype))
        logits.copy_(torch.randn(t, e, device=ctx.device))
        ids.copy_(torch.rand(t, e, device=ctx.device).topk(k).indices)
        w.copy_(torch.rand(t, k, device=ctx.device))
        graph.replay()
        torch.cuda.synchronize()
        if whole_layer_runner:
            want = layer(x, logits)
        else:
            xq = x.float() if d.codec.payload is None else d.codec.payload.fake_quantize_activation(x)
            want = xq * w.sum(1, keepdim=True)
        err = rel_err(y, want)
        assert err <= 1e-2, f"replay {trial}: relative error {err:.2e}"


def worker_checks(ctx):
    from moeflow import MoEConfig
    from moeflow.capabilities import Environment
    from moeflow.experts import RUNNERS
    from moeflow.planner import cell_status
    from test_ep_worker import DISPATCHERS, SCHEMES, check_halves
    from tolerances import rel_tol

    env = Environment.detect(ctx.device, world_size=2)
    shape = dict(num_experts=16, hidden_size=512, intermediate_size=256, top_k=4, max_tokens_per_rank=128,
                 dtype=torch.bfloat16, device=ctx.device)
    checks = []
    for d in DISPATCHERS:
        for r in RUNNERS.names():
            for s in SCHEMES:
                if cell_status(MoEConfig(**shape, dispatcher=d, runner=r, quant=s), env) == "ok":
                    checks.append((f"{d}-{r}-{s}", lambda c, d=d, r=r, s=s: c.compare(
                        [37, 90], dispatcher=d, runner=r, quant=s, **shape)))
        checks.append((f"{d}-fp8-payload", lambda c, d=d: c.compare(
            [64, 21], payload="fp8", tol=rel_tol("fp8-payload", torch.bfloat16), dispatcher=d, runner="reference",
            **shape)))
        checks.append((f"{d}-halves", lambda c, d=d: check_halves(c, d, device=ctx.device)))
    graphs = ("dtype", "fp8") if ctx.device.type == "cuda" else ()  # (a CPU dry run skips graphs)
    for payload in graphs:
        checks.append((f"lowlatency-cuda-graph-{payload}", lambda c, p=payload: check_graph(c, p)))
    masked = [r for r in RUNNERS.names() if r != "reference" and "masked" in RUNNERS.get(r).caps.layouts
              and graphs and cell_status(MoEConfig(**{**shape, "quant": "fp8-block"}, dispatcher="lowlatency", runner=r), env) == "ok"]
    for r in masked:
        checks.append((f"lowlatency-whole-layer-graph-{r}", lambda c, r=r: check_graph(c, "auto", r)))
    # alltoall-fixed: the prefill path with no host synchronization, the whole layer in one graph
    for d in ("alltoall-fixed", "alltoall-p2p"):
        for q in ("none", "fp8-block") if graphs else ():
            for r in RUNNERS.names():
                if r != "reference" and cell_status(MoEConfig(**{**shape, "quant": q}, dispatcher=d, runner=r),
                                                    env) == "ok":
                    checks.append((f"{d}-whole-layer-graph-{r}-{q}", lambda c, r=r, q=q, d=d: check_graph(
                        c, "auto", r, d, q)))
    if graphs:
        checks.append(("p2p-barrier-timeout", check_barrier_timeout))
    return checks, masked



def check_barrier_timeout(ctx):
    """kernels/peer.barrier with a peer that never signals: it stops after its limit and writes
    1 + the silent rank into pinned host memory (no hang); a round the peer did signal passes."""
    from moeflow.kernels.rows.peer import barrier

    dev = ctx.device
    pads = [torch.zeros(2, dtype=torch.int64, device=dev) for _ in range(2)]
    table = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64, device=dev)
    epoch = torch.zeros(1, dtype=torch.int64, device=dev)
    status = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    addr = torch.tensor([status.data_ptr()], dtype=torch.int64, device=dev)
    pads[0][1] = 1  # "rank 1" entered round 1
    barrier(table, epoch, addr, 0, 2, timeout_s=0.05)
    torch.cuda.synchronize()
    assert int(status[0]) == 0 and pads[0].tolist() == [1, 1] and pads[1].tolist() == [1, 0], (status, pads)
    barrier(table, epoch, addr, 0, 2, timeout_s=0.05)  # round 2: "rank 1" stays silent
    torch.cuda.synchronize()
    assert int(status[0]) == 2 and int(epoch[0]) == 2, (status, epoch)


def main():
    import torch.distributed as dist

    from moeflow.distributed import init_distributed
    from test_ep_worker import Ctx

    out = sys.argv[1]
    device = init_distributed()
    ctx = Ctx(dist.get_rank(), dist.get_world_size())
    ctx.device = device
    checks, masked = worker_checks(ctx)
    results = {} if masked else {"lowlatency-whole-layer-graph": "skip: no CUDA graphs here, or no capturable runner consumes the masked layout natively"}
    for name, fn in checks:
        torch.manual_seed(zlib.crc32(name.encode()))
        try:
            fn(ctx)
            results[name] = "ok"
        except Exception as exc:
            results[name] = f"FAIL: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
        if ctx.rank == 0:
            print(f"{name:48s} {results[name].splitlines()[0][:150]}", flush=True)
    gathered = [None] * ctx.world
    dist.all_gather_object(gathered, results)
    if ctx.rank == 0:
        merged = {k: next((g[k] for g in gathered if g.get(k) != "ok"), "ok") for k in results}
        with open(out, "w") as f:
            json.dump(merged, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
