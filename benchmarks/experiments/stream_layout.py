"""Is a T=1 program's slow weight stream the DRAM access pattern? Timed inside the kernel. One H200.

The one-launch layer's gate_up items read each K step as a [BLOCK_N, BLOCK_K] box of a [rows, K] weight matrix:
BLOCK_N row pieces of BLOCK_K elements, K elements apart (4 KB for Qwen3 bf16). They stream at 20-26 GB/s a
program, about 1.2 µs a step with two steps in flight (benchmarks/results/fused_down_prefetch_*.md), which is a
long time for two loads. stream_tiles.py timed whole launches (a fixed ~9 µs of launch and write-back in each), so
it could not tell a step's cost. Here each program reads %globaltimer before its first load and after its last
dot, and the same bytes are read in two layouts:

    strided      the matrix [P * BLOCK_N, steps * BLOCK_K]; program p, step s: the box at (p * BLOCK_N, s * BLOCK_K)
    tile-major   the matrix [P * steps * BLOCK_N, BLOCK_K]; program p, step s: rows (p * steps + s) * BLOCK_N ..,
                 one contiguous piece of BLOCK_N * BLOCK_K elements (a layout the weights could be packed in)

Each step's tile is multiplied into a [BLOCK_N, 16] accumulator as the layer does. L2 before each launch: "clean"
(1 GiB read) or "dirty" (256 MB zeroed, do_bench's flush). Reported: the launch's span (last end - first start),
the median program's time, and bytes / span; median of 5 launches.

    PYTHONPATH=$PWD OUT=DIR python benchmarks/experiments/stream_layout.py

Writes stream_layout.json under OUT; prints a table last.
"""
import json
import os
import statistics

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _gtime(x):
    """%globaltimer (ns) of the calling program; x: any int32 scalar (inline asm needs an operand)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _stream_timed(w, out_ptr, times_ptr, steps, TILE_MAJOR: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    t0 = _gtime(pid)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    b = tl.full((BLOCK_K, 16), 1.0, tl.float32).to(w.dtype)
    for s in range(steps):
        if TILE_MAJOR:
            tile = w.load([(pid * steps + s) * BLOCK_N, 0])
        else:
            tile = w.load([pid * BLOCK_N, s * BLOCK_K])
        acc = tl.dot(tile, b, acc)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + rows, tl.sum(acc, axis=1))
    t1 = _gtime(pid)
    tl.store(times_ptr + 2 * pid, t0)
    tl.store(times_ptr + 2 * pid + 1, t1)


def main():
    def alloc(size, align, stream):
        return torch.empty(size, dtype=torch.int8, device="cuda")
    triton.set_allocator(alloc)
    clean_buf = torch.ones(1 << 27, dtype=torch.int64, device="cuda")
    dirty_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    flushes = {"clean": clean_buf.amax, "dirty": dirty_buf.zero_}
    steps = 16
    rows, text = [], []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for bn, bk in ((64, 128), (128, 128)):
            for p in (96, 132, 264):
                shapes = {"strided": (p * bn, steps * bk), "tile-major": (p * steps * bn, bk)}
                for layout, shape in shapes.items():
                    w = torch.randn(shape, device="cuda").to(dtype)
                    out = torch.empty(p * bn, device="cuda", dtype=torch.float32)
                    times = torch.zeros(2 * p, dtype=torch.int64, device="cuda")
                    desc = TensorDescriptor.from_tensor(w, [bn, bk])
                    nbytes = w.numel() * w.element_size()
                    for stages in (2, 3, 4):
                        for fname, flush in flushes.items():
                            spans, progs = [], []
                            for rep in range(6):
                                flush()
                                _stream_timed[(p,)](desc, out, times, steps, TILE_MAJOR=layout == "tile-major",
                                                    BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=stages)
                                torch.cuda.synchronize()
                                if rep == 0:
                                    continue  # compile and first-touch
                                tt = times.view(p, 2).double()
                                spans.append((tt[:, 1].max() - tt[:, 0].min()).item() / 1e3)
                                progs.append((tt[:, 1] - tt[:, 0]).median().item() / 1e3)
                            span, prog = statistics.median(spans), statistics.median(progs)
                            r = dict(dtype=str(dtype).removeprefix("torch."), block_n=bn, block_k=bk, programs=p,
                                     steps=steps, layout=layout, stages=stages, flush=fname, MB=nbytes / 2 ** 20,
                                     span_us=span, program_us=prog, GBs=nbytes / span / 1e3)
                            rows.append(r)
                            text.append(f"{r['dtype']:13} {bn:3}x{bk} P={p:3} {layout:10} st={stages} {fname:5} "
                                        f"{r['MB']:5.1f} MB span {span:6.2f} us prog {prog:6.2f} us "
                                        f"{r['GBs']:6.0f} GB/s")
                            print(text[-1], flush=True)
                    del w
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "stream_layout.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
