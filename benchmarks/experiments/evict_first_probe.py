"""Experiment (GPU): does an L2 evict-first hint on streamed weight reads spare the layer the write-back of the
dirty lines that do_bench's flush leaves in the L2 (3-9 µs a row up to T=128: flush_mode.py,
benchmarks/results/t1_bounds_2026-12-01_h200.md, section 3)?

A probe kernel reads a buffer of the size a small batch's weights take (Qwen3-30B-A3B at T=1: 38 MB fp8, 75 MB
bf16; Mixtral at T=1: about 340 MB fp8; Qwen3 bf16 at T=128: 1.2 GB) once, 64 KB a program in one load of 16-byte
vectors, with each of three L2 policies: none, evict_first (the line is the first to go when its set needs room),
evict_last. Each read is captured as a CUDA graph and timed as bench_layer.py times the layer: replays after
do_bench's flush (256 MB of zeros: "dirty", moeflow.benchmark.graph_us) and after a 1 GiB read ("clean": nothing to
write back, clean_graph_us), medians. If evict_first brings the dirty time close to the clean one, the Triton
kernels' small-batch weight loads are worth giving the hint. They cannot today: triton 3.6 turns a pipelined
load into cp.async and drops its eviction policy (Gluon's cp.async too), and its TMA loads take none (checked on
sm_90a PTX, 2026-12-04).

    PYTHONPATH=$PWD python benchmarks/experiments/evict_first_probe.py OUT_DIR
Writes OUT_DIR/evict_first_probe.json; prints a table last. ``probe_ptx(policy)`` compiles the probe for sm_90a
without a GPU, to see the hint on its loads.
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl

BLOCK = 32768  # bf16 elements a program: 64 KB, 256 a thread at 4 warps, in 16-byte vectors
SIZES_MB = (38, 75, 340, 1200)
POLICIES = ("", "evict_first", "evict_last")


@triton.jit
def _stream_kernel(w_ptr, out_ptr, BLOCK: tl.constexpr, EV: tl.constexpr):
    """Program p sums w [p * BLOCK, (p + 1) * BLOCK) (bf16) into out[p] (float32), its loads under policy EV."""
    p = tl.program_id(0)
    v = tl.load(w_ptr + p.to(tl.int64) * BLOCK + tl.arange(0, BLOCK), eviction_policy=EV)
    tl.store(out_ptr + p, tl.sum(v.to(tl.float32), axis=0))


def probe_ptx(policy: str) -> str:
    """The probe kernel for sm_90a (no GPU) -> its PTX: the hint must be on the loads (ld.global...L2::cache_hint)."""
    from moeflow.kernels.registers import _compile_ptx, divisible
    return _compile_ptx(_stream_kernel, {"w_ptr": "*bf16", "out_ptr": "*fp32"}, {"BLOCK": BLOCK, "EV": policy},
                        divisible(_stream_kernel, ["w_ptr", "out_ptr"]), 4, 1)


def main():
    from moeflow.benchmark import clean_graph_us, graph_us
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for mb in SIZES_MB:
        n = (mb << 20) // 2 // BLOCK * BLOCK
        w = torch.randn(n, device="cuda").to(torch.bfloat16)
        out = torch.empty(n // BLOCK, dtype=torch.float32, device="cuda")
        for policy in POLICIES:
            run = lambda: _stream_kernel[(n // BLOCK,)](w, out, BLOCK=BLOCK, EV=policy, num_warps=4, num_stages=1)
            run()
            torch.cuda.synchronize()
            want = w.view(-1, BLOCK).float().sum(1)
            ok = bool(torch.allclose(out, want, rtol=1e-3, atol=1e-1))
            dirty, clean = graph_us(run), clean_graph_us(run)
            r = dict(mb=mb, policy=policy or "none", dirty_us=round(dirty, 2), clean_us=round(clean, 2),
                     dirty_tbs=round(n * 2 / dirty / 1e6, 2), clean_tbs=round(n * 2 / clean / 1e6, 2), sums_ok=ok)
            rows.append(r)
            print(json.dumps(r), flush=True)
        del w, out
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "evict_first_probe.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print(f"{'MB':>5} {'policy':12} {'dirty us':>9} {'clean us':>9} {'dirty-clean':>11}")
    for r in rows:
        print(f"{r['mb']:5} {r['policy']:12} {r['dirty_us']:9.1f} {r['clean_us']:9.1f} "
              f"{r['dirty_us'] - r['clean_us']:11.1f}")


if __name__ == "__main__":
    main()
