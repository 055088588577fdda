"""Which float32 sigmoid in Triton gives torch.sigmoid's bits on CUDA? The routers rank sigmoid(x) + bias
(DeepSeek-V3), so an ulp between the two changes the experts a row picks where two choices are an ulp apart.

    PYTHONPATH=$PWD python benchmarks/experiments/sigmoid_bits.py [OUT.json]

Per variant, on randn * 4 (the routing tests' logits) and on every 37th float32 in [-100, 100] (bit patterns):
the count of elements whose bits differ from torch.sigmoid's, and the largest difference in ulps.
  tl.sigmoid            1 / (1 + tl.exp(-x)): approximate exp2 and the default division
  libdevice_exp_div_rn  libdevice.exp (CUDA's expf) and an IEEE division (div_rn), as torch's kernel writes it
  libdevice_exp         libdevice.exp and the default division
  fast                  kernels/common.sigmoid (fast_expf and fast_dividef)
  libdevice_exp_rcp_rn  libdevice.exp and an IEEE reciprocal (rcp_rn: the same correctly rounded 1 / y)
  libdevice_exp_newton  libdevice.exp and kernels/common.newton_rcp: fast_dividef's reciprocal, one Newton step
  exact_sigmoid         kernels/common.exact_sigmoid: the Newton form, 0 where 1 / (1 + exp(-x)) is subnormal
Then every float32 y in [1, 2**128) (1 + exp(-x) takes no other value): the count of y whose reciprocal by
rcp_rn and by the Newton step differ from div_rn(1, y).
"""
import json
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from moeflow.kernels.common import exact_sigmoid, newton_rcp
from moeflow.kernels.common import sigmoid as fast_sigmoid


@triton.jit
def _sig_kernel(x_ptr, out_ptr, n, VARIANT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok)
    if VARIANT == 0:
        y = tl.sigmoid(x)
    elif VARIANT == 1:
        y = tl.math.div_rn(1.0, 1.0 + libdevice.exp(-x))
    elif VARIANT == 2:
        y = 1.0 / (1.0 + libdevice.exp(-x))
    elif VARIANT == 3:
        y = fast_sigmoid(x)
    elif VARIANT == 4:
        y = libdevice.rcp_rn(1.0 + libdevice.exp(-x))
    elif VARIANT == 5:
        y = newton_rcp(1.0 + libdevice.exp(-x))
    else:
        y = exact_sigmoid(x)
    tl.store(out_ptr + offs, y, mask=ok)


@triton.jit
def _rcp_kernel(first_bits, n, bad_ptr, BLOCK: tl.constexpr):
    """bad[0] += y whose rcp_rn differs from div_rn(1, y), bad[1] += whose Newton step does; bad[2], bad[3]: the
    same among y < 2**126; y's bits first_bits + i."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    y = (first_bits + i).to(tl.int32).to(tl.float32, bitcast=True)
    want = tl.math.div_rn(1.0, y).to(tl.int32, bitcast=True)
    a = libdevice.rcp_rn(y).to(tl.int32, bitcast=True) != want
    b = newton_rcp(y).to(tl.int32, bitcast=True) != want
    low = ok & (y < 2.0 ** 126)
    tl.atomic_add(bad_ptr, tl.sum((a & ok).to(tl.int32), 0))
    tl.atomic_add(bad_ptr + 1, tl.sum((b & ok).to(tl.int32), 0))
    tl.atomic_add(bad_ptr + 2, tl.sum((a & low).to(tl.int32), 0))
    tl.atomic_add(bad_ptr + 3, tl.sum((b & low).to(tl.int32), 0))


VARIANTS = ("tl.sigmoid", "libdevice_exp_div_rn", "libdevice_exp", "fast", "libdevice_exp_rcp_rn",
            "libdevice_exp_newton", "exact_sigmoid")


def main():
    inputs = {"randn*4": torch.randn(1 << 24, device="cuda") * 4}
    bits = torch.arange(-(1 << 31), (1 << 31) - 1, 37, device="cuda", dtype=torch.int64).to(torch.int32)
    f = bits.view(torch.float32)
    inputs["float32 grid |x|<=100"] = f[torch.isfinite(f) & (f.abs() <= 100)].contiguous()
    out = []
    for name, x in inputs.items():
        want = torch.sigmoid(x)
        for v, vname in enumerate(VARIANTS):
            got = torch.empty_like(x)
            _sig_kernel[(triton.cdiv(x.numel(), 1024),)](x, got, x.numel(), VARIANT=v, BLOCK=1024)
            diff = (got.view(torch.int32).long() - want.view(torch.int32).long()).abs()
            row = dict(input=name, n=x.numel(), variant=vname, differ=int((diff > 0).sum()), max_ulps=int(diff.max()))
            out.append(row)
            print(f"{name:24s} {vname:22s} differ {row['differ']:>10d} of {row['n']:>10d}  max ulps {row['max_ulps']}")
    first, last = 0x3F800000, 0x7F7FFFFF  # 1.0 .. the largest float32
    bad = torch.zeros(4, dtype=torch.int32, device="cuda")
    _rcp_kernel[(triton.cdiv(last + 1 - first, 4096),)](first, last + 1 - first, bad, BLOCK=4096)
    row = dict(input="every y in [1, 2**128)", n=last + 1 - first, rcp_rn_differ=int(bad[0]), newton_differ=int(bad[1]),
               rcp_rn_differ_below_2_126=int(bad[2]), newton_differ_below_2_126=int(bad[3]))
    out.append(row)
    print(f"reciprocal of every y in [1, 2**128): rcp_rn differs {row['rcp_rn_differ']}, Newton {row['newton_differ']}"
          f" of {row['n']}; below 2**126: {row['rcp_rn_differ_below_2_126']} and {row['newton_differ_below_2_126']}")
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
