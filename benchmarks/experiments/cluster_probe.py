"""Does Triton's cluster option (num_ctas > 1) give a Hopper GEMM a TMA multicast? Checked without a GPU: a small
fp8 GEMM with TMA-descriptor operands compiled for sm_90a at num_ctas 1 and 2, its PTX searched.
    python benchmarks/experiments/cluster_probe.py
On triton 3.6 (2026-12-04): num_ctas=2 makes a two-CTA cluster (.reqnctapercluster 2) that splits the tile's N
between the two CTAs, with the A tile's shared layout broadcast to both (CGALayout [[0, 0]]), but each CTA still
issues its own cp.async.bulk.tensor for it: no .multicast::cluster in the PTX. So the option would not halve the
operand traffic from L2 that bounds the fp8 GEMMs (docs/performance.md)."""
import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _gemm(a_desc, b_desc, c_ptr, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """c [M, N] bf16 = a [M, K] fp8 @ b [N, K]^T fp8, one BM x BN tile a program."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        acc = tl.dot(a_desc.load([pid_m * BM, k]), b_desc.load([pid_n * BN, k]).T, acc)
    rm, rn = pid_m * BM + tl.arange(0, BM), pid_n * BN + tl.arange(0, BN)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16))


def ptx(num_ctas: int) -> str:
    sig = {"a_desc": "tensordesc<fp8e4nv[128, 128]>", "b_desc": "tensordesc<fp8e4nv[128, 128]>", "c_ptr": "*bf16",
           "N": "i32", "K": "i32", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"}
    src = ASTSource(fn=_gemm, signature=sig, constexprs={"BM": 128, "BN": 128, "BK": 128})
    options = {"num_warps": 8, "num_stages": 3, "num_ctas": num_ctas}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def main():
    print(f"triton {triton.__version__}")
    for n in (1, 2):
        text = ptx(n)
        size = re.findall(r"\.reqnctapercluster (\d+)", text) or ["1"]
        copies, wgmma = len(re.findall(r"cp\.async\.bulk\.tensor", text)), len(re.findall(r"wgmma\.mma_async", text))
        print(f"num_ctas={n}: cluster size {size[0]}, TMA copies {copies}, multicast {text.count('multicast')}, "
              f"wgmma {wgmma}")

if __name__ == "__main__":
    main()
