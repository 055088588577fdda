"""Experiment (GPU): does prefetching the first experts' gate_up weights into L2 while the layer routes and sorts
shorten the small-batch layer rows (T = 16, 128)?

Why: at T <= 128 the gate_up GEMM streams the weights of every expert hit at about HBM speed, and the routing and
sort launches before it (7-9 µs) leave HBM idle. The GEMM's first programs take the lowest experts' row blocks; at
T = 128 every expert is hit on these presets (Qwen3: 1024 copies over 128 experts), so the first megabytes of
gate_up_proj in memory order are bytes the GEMM reads first. A bulk L2 prefetch (cp.async.bulk.prefetch.L2, sm_90)
of those bytes, issued at the start of the layer, would let HBM work during the routing. Nothing reads the
prefetched bytes but the GEMM, so the outputs are the layer's bits (checked).

Variants per row, interleaved over ROUNDS rounds, each the whole layer as one CUDA graph timed with do_bench (L2
flushed) and the clean flush (benchmark.clean_graph_us): off; MB megabytes prefetched in the layer's stream before
routing ("inline"); the same on a second captured stream that joins at the layer's end ("side").

    PYTHONPATH=$PWD MBS=16,32 ROUNDS=2 python benchmarks/experiments/l2_prefetch.py OUT.json \
        qwen3-30b-a3b:none:128,mixtral-8x7b:none:128,...
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl


CHUNK = 16384  # bytes a thread prefetches
BLOCK = 128  # threads (chunks) a program


@triton.jit
def _l2_prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program p: chunks p * BLOCK .. of ``nbytes`` from ``base`` (16-byte aligned), one cp.async.bulk.prefetch.L2 a
    thread (a hint: no memory is written, nothing waits for it)."""
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)
    ptrs = base + offs
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_l2(t: torch.Tensor, nbytes: int, stream=None) -> None:
    """The first ``nbytes`` (rounded down to 16) of t's storage into L2 (sm_90)."""
    nbytes = min(nbytes, t.numel() * t.element_size()) // 16 * 16
    if nbytes <= 0:
        return
    u8 = t.view(-1).view(torch.uint8) if t.dim() else t.view(torch.uint8)
    _l2_prefetch_kernel[(triton.cdiv(nbytes, CHUNK * BLOCK),)](u8, nbytes, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4)


def main():
    from decode_timeline import layer_cases

    from moeflow.benchmark import clean_graph_us, graph_us
    out_path = sys.argv[1]
    rows = [(p, s, int(t)) for p, s, t in (r.split(":") for r in sys.argv[2].split(","))]
    mbs = [int(m) for m in os.environ.get("MBS", "16,32").split(",")]
    rounds = int(os.environ.get("ROUNDS", "2"))
    modes = ["off"] + [f"{how}{mb}" for mb in mbs for how in ("inline", "side")]
    res = []
    side = torch.cuda.Stream()
    for (preset, scheme, t), (_, case, runner, x, logits) in zip(rows, layer_cases(rows)):
        row = f"{preset}:{scheme}:{t}"
        w13 = case.weights.w13

        def layer(mode):
            if mode == "off":
                return case.layer(runner, x, logits)
            mb = int(mode.lstrip("inlsde")) << 20
            if mode.startswith("inline"):
                prefetch_l2(w13, mb)
                return case.layer(runner, x, logits)
            stream = torch.cuda.current_stream()
            side.wait_stream(stream)
            with torch.cuda.stream(side):
                prefetch_l2(w13, mb)
            y = case.layer(runner, x, logits)
            stream.wait_stream(side)
            return y

        want = layer("off").clone()
        for mode in modes[1:]:
            got = layer(mode)
            torch.cuda.synchronize()
            assert torch.equal(got, want), (row, mode)
        for r in range(rounds):
            for mode in modes:
                rec = dict(row=row, mode=mode, round=r, us=round(graph_us(lambda: layer(mode)), 2),
                           clean_us=round(clean_graph_us(lambda: layer(mode)), 2))
                res.append(rec)
                print(json.dumps(rec), file=sys.stderr, flush=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{'row':34} " + " ".join(f"{m:>17}" for m in modes))
    for row in dict.fromkeys(r["row"] for r in res):
        cells = []
        for m in modes:
            rs = [x for x in res if x["row"] == row and x["mode"] == m]
            cells.append(f"{min(x['us'] for x in rs):7.1f}/{min(x['clean_us'] for x in rs):7.1f}")
        print(f"{row:34} " + " ".join(f"{c:>17}" for c in cells))
    print("(µs: do_bench / clean flush, the lower of the rounds; outputs equal to off's in every mode)")


if __name__ == "__main__":
    main()
