"""How fast P Triton programs stream weight tiles the way the one-launch layer's K loops do (TMA tiles
[BLOCK_N, BLOCK_K] of a [rows, K] matrix, pipelined over num_stages, each multiplied into a [BLOCK_N, 16]
accumulator on the tensor cores): bytes / time for a grid of P programs, one row block each. One H200.

    PYTHONPATH=$PWD OUT=DIR python benchmarks/experiments/stream_tiles.py [--ptr]
--ptr: TMA against pointer loads (cp.async) at the Qwen3 sizes only; --accs: one accumulator a step against 2 and 4.

do_bench with L2 flushed, median; the matrix is re-made per shape so rows of one program are contiguous
(rows * K * 2 bytes in all). Prints GB/s per (dtype, P, BLOCK_N, BLOCK_K, K, stages, warps); writes
stream_tiles.json under OUT.
"""
import json
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
LOADS, KS, TILES, PROGRAMS = ("tma",), (2048, 7168), ((64, 128), (128, 128), (64, 256)), (96, 132, 192, 264, 528)


@triton.jit
def _stream(w, out_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    b = tl.full((BLOCK_K, 16), 1.0, tl.float32).to(w.dtype)
    for k0 in range(0, K, BLOCK_K):
        tile = w.load([pid * BLOCK_N, k0])
        acc = tl.dot(tile, b, acc)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + rows, tl.sum(acc, axis=1))


@triton.jit
def _stream_ptr(w_ptr, out_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """_stream with pointer loads (cp.async pipelined by Triton) instead of TMA."""
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    b = tl.full((BLOCK_K, 16), 1.0, tl.float32).to(w_ptr.dtype.element_ty)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    for k0 in range(0, K, BLOCK_K):
        tile = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + k0 + tl.arange(0, BLOCK_K)[None, :])
        acc = tl.dot(tile, b, acc)
    tl.store(out_ptr + rows, tl.sum(acc, axis=1))


@triton.jit
def _stream_accs(w, out_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACCS: tl.constexpr):
    """_stream with each step's tile read as ACCS (2 or 4) boxes of BLOCK_K // ACCS columns, each multiplied into
    its own accumulator: ACCS independent wgmma chains a step instead of one."""
    pid = tl.program_id(0)
    SUB: tl.constexpr = BLOCK_K // ACCS
    a0 = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    a1 = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    a2 = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    a3 = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    b = tl.full((SUB, 16), 1.0, tl.float32).to(w.dtype)
    for k0 in range(0, K, BLOCK_K):
        a0 = tl.dot(w.load([pid * BLOCK_N, k0]), b, a0)
        a1 = tl.dot(w.load([pid * BLOCK_N, k0 + SUB]), b, a1)
        if ACCS == 4:
            a2 = tl.dot(w.load([pid * BLOCK_N, k0 + 2 * SUB]), b, a2)
            a3 = tl.dot(w.load([pid * BLOCK_N, k0 + 3 * SUB]), b, a3)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + rows, tl.sum(a0 + a1 + a2 + a3, axis=1))


def main():
    import sys
    from triton.testing import do_bench
    global LOADS, KS, TILES, PROGRAMS
    if "--ptr" in sys.argv:  # TMA against pointer loads at the one-launch layer's Qwen3 sizes
        LOADS, KS, TILES, PROGRAMS = ("tma", "ptr"), (2048,), ((64, 128), (128, 128)), (96, 192, 264)
    if "--accs" in sys.argv:  # one accumulator a step against 2 and 4 independent ones, Qwen3 sizes
        LOADS, KS, TILES, PROGRAMS = ("tma", "acc2", "acc4"), (2048,), ((64, 128), (128, 128), (64, 256)), (96, 264)

    def alloc(size, align, stream):
        return torch.empty(size, dtype=torch.int8, device="cuda")
    triton.set_allocator(alloc)
    rows_out = []
    for dtype in DTYPES:
        for k in KS:
            for bn, bk in TILES:
                for p in PROGRAMS:
                    rows = p * bn
                    w = torch.randn(rows, k, device="cuda").to(dtype)
                    out = torch.empty(rows, device="cuda", dtype=torch.float32)
                    desc = TensorDescriptor.from_tensor(w, [bn, bk])
                    for loads, stages in [(ld, st) for ld in LOADS for st in (2, 3, 4, 6)]:
                        if stages * bn * bk * w.element_size() > 200 * 1024:
                            continue
                        if loads.startswith("acc"):  # "acc2", "acc4": that many accumulators a step
                            accs = int(loads[3:])
                            sub = TensorDescriptor.from_tensor(w, [bn, bk // accs])
                            fn = lambda: _stream_accs[(p,)](sub, out, k, BLOCK_N=bn, BLOCK_K=bk, ACCS=accs,
                                                            num_warps=4, num_stages=stages)
                        else:
                            kern, arg = (_stream, desc) if loads == "tma" else (_stream_ptr, w)
                            fn = lambda: kern[(p,)](arg, out, k, BLOCK_N=bn, BLOCK_K=bk, num_warps=4,
                                                    num_stages=stages)
                        try:
                            us = do_bench(fn, warmup=5, rep=30, return_mode="median") * 1e3
                        except Exception as e:  # noqa: BLE001 - a tile set the compiler refuses
                            print(f"skip {dtype} {p} {bn}x{bk} s{stages}: {type(e).__name__}")
                            continue
                        gbs = w.numel() * w.element_size() / us / 1e3
                        r = dict(loads=loads, dtype=str(dtype).removeprefix("torch."), programs=p, block_n=bn,
                                 block_k=bk, K=k,
                                 stages=stages, MB=w.numel() * w.element_size() / 2 ** 20, us=us, GBs=gbs)
                        rows_out.append(r)
                        print(f"{loads:4} {r['dtype']:14} K={k:5} P={p:4} {bn:3}x{bk:3} st={stages} {r['MB']:6.1f} MB "
                              f"{us:7.1f} us {gbs:7.0f} GB/s", flush=True)
                    del w
    json.dump(rows_out, open(os.path.join(os.environ.get("OUT", "."), "stream_tiles.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
