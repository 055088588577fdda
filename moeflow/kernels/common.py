"""Triton helpers shared by the MoE kernels: which rows a program's block covers (the block
alignment of token copies to experts), the gated activation, FP8 rounding, tile ordering.

Layouts (moeflow/layouts.py), as the kernels see them, with R the number of flat rows:
  sorted: rows [R = N, ...]; meta = offsets [E + 1] int64 (rows of expert e: offsets[e]:offsets[e+1]).
  masked: rows [R = E * C, ...]; meta = counts [E] int32 (rows e*C .. e*C + counts[e] are valid).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from .. import env as moeflow_env
from ..targets import kernel_target

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value (quant/base.py)
MIN_AMAX = 1e-12  # amax floor of quant/base.amax_to_scale

# QUANT constexpr codes, one per scheme name
QUANT_CODES = {"none": 0, "fp8-tensor": 1, "fp8-channel": 2, "fp8-block": 3}
ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) on the host. Not triton.cdiv: a constexpr function, whose Python call cost adds up over the
    dozens of calls a layer launch makes."""
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    """The smallest power of two >= n on the host, as triton.next_power_of_2 (0 for 0), without its call cost."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def num_row_blocks(rows: int, num_experts: int, capacity: int, block_m: int, masked: bool) -> int:
    """Host-side upper bound of the row blocks a grid must cover (no device data read).

    sorted: each expert's rows are cut into cdiv(count, BLOCK_M) blocks; their sum is at most
    cdiv(N, BLOCK_M) plus one partial block per non-empty expert. masked: cdiv(C, BLOCK_M) per expert.
    """
    if masked:
        return num_experts * cdiv(capacity, block_m)
    return cdiv(rows, block_m) + min(num_experts, rows)


@triton.jit
def block_rows(pid_m, meta_ptr, num_experts, capacity,
               BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, MASKED: tl.constexpr):
    """Block ``pid_m`` -> (expert, row_start, row_end, slab_end), rows as int64.

    Rows row_start .. row_end-1 are valid copies of ``expert`` (empty when row_start >= row_end);
    the block may store up to slab_end (masked: the end of the expert's slab, whose empty slots
    the output must zero; sorted: row_end, since the next rows belong to the next expert).
    sorted: the block alignment is computed here, in every program, from the offsets: expert e
    owns blocks cum[e] - nb[e] .. cum[e] - 1 with nb = cdiv(counts, BLOCK_M), cum = cumsum(nb).
    """
    if MASKED:
        per_expert = tl.cdiv(capacity, BLOCK_M)
        expert = pid_m // per_expert
        slab = expert.to(tl.int64) * capacity
        count = tl.minimum(tl.load(meta_ptr + expert).to(tl.int64), capacity)
        row_start = slab + (pid_m % per_expert) * BLOCK_M
        row_end = slab + count
        slab_end = slab + capacity
    else:
        idx, lo, hi, nb, cum = expert_blocks(meta_ptr, num_experts, BLOCK_M, E_POW2)
        expert, row_start, row_end = sorted_block(pid_m, num_experts, idx, lo, hi, nb, cum, BLOCK_M)
        slab_end = row_end
    return expert, row_start, row_end, slab_end


@triton.jit
def expert_blocks(meta_ptr, num_experts, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """Sorted layout: the block alignment of every expert from the offsets [E + 1] ->
    (idx [E_POW2], lo, hi: first and end row, nb: row blocks, cum: inclusive prefix sum of nb);
    experts past num_experts own nothing. cum[E_POW2 - 1] is the number of real row blocks."""
    idx = tl.arange(0, E_POW2)
    lo = tl.load(meta_ptr + idx, mask=idx < num_experts, other=0)
    hi = tl.load(meta_ptr + idx + 1, mask=idx < num_experts, other=0)
    nb = (hi - lo + BLOCK_M - 1) // BLOCK_M
    return idx, lo, hi, nb, tl.cumsum(nb, 0)


@triton.jit
def sorted_block(pid_m, num_experts, idx, lo, hi, nb, cum, BLOCK_M: tl.constexpr):
    """Row block pid_m of the alignment expert_blocks gave -> (expert, row_start, row_end); past
    the last real block: expert num_experts and an empty range."""
    expert = tl.sum((cum <= pid_m).to(tl.int32), 0)
    mine = idx == expert  # all False past the last block: every sum below is then 0
    first_block = tl.sum(tl.where(mine, cum - nb, 0), 0)
    row_start = tl.sum(tl.where(mine, lo, 0), 0) + (pid_m - first_block) * BLOCK_M
    row_end = tl.sum(tl.where(mine, hi, 0), 0)
    row_start = tl.where(expert < num_experts, row_start, row_end)
    return expert, row_start, row_end


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """First statement of every layer kernel. PDL (programmatic dependent launch, launch_pdl=True):
    wait until the kernel before in the stream has finished and its writes are visible. Before any
    memory access, including the early exits, so a kernel never ends before the one it follows:
    the order is kept for every kernel after, PDL-launched or not. No-op when PDL is False."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_launch(PDL: tl.constexpr):
    """Let the next kernel launch once every program of this one has come here (or ended); its
    programs then take free SM slots and wait in pdl_wait. Short kernels call it at once; the GEMMs
    after their K loop (the kernel after a GEMM is short: the next GEMM is launched plainly, see
    pdl()). No-op when PDL is False."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """pdl_wait then pdl_launch: the opening of the short kernels."""
    pdl_wait(PDL)
    pdl_launch(PDL)


@triton.jit
def tile_ids(num_blocks_m, n_size, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """1-D program id -> (pid_m, pid_n), GROUP_M row blocks side by side so their weight tiles
    are read while still in L2."""
    return grouped_tile(tl.program_id(0), num_blocks_m, tl.cdiv(n_size, BLOCK_N), GROUP_M)


@triton.jit
def grouped_tile(pid, num_blocks_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile number pid -> (pid_m, pid_n) in the grouped order of tile_ids."""
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


# Compiled kernels take the sigmoid from the GPU's approximate exp2 and reciprocal, flushing subnormals
# (libdevice's fast_expf and fast_dividef: about 4 instructions an element against tl.sigmoid's 14, whose exp and
# division keep subnormals). Triton decides at decoration time whether a kernel runs in its CPU interpreter, which
# has no libdevice; so is this.
_FAST_SIGMOID = tl.constexpr(not moeflow_env.TRITON_INTERPRET.get_bool())
_SUBNORMAL_RCP = tl.constexpr(2.0 ** 126)  # 1 / y is subnormal from here


@triton.jit
def sigmoid(x):
    """1 / (1 + exp(-x)) in float32: within a few float32 ulps of torch's; where exp(-x) is subnormal or overflows
    (|x| > 87) it gives exactly 1 or 0, where torch's is within 2**-126 of them."""
    if _FAST_SIGMOID:
        return libdevice.fast_dividef(1.0, 1.0 + libdevice.fast_expf(-x))
    else:
        return tl.sigmoid(x)


@triton.jit
def newton_rcp(y):
    """1 / y from the GPU's approximate reciprocal (fast_dividef) and one Newton step in FMAs, no branch: the IEEE
    result for y in [1, 2**126); 0 from 2**126 (where 1 / y is subnormal), NaN at infinity. Compiled kernels only."""
    q = libdevice.fast_dividef(1.0, y)
    return tl.fma(q, tl.fma(-y, q, 1.0), q)


@triton.jit
def exact_sigmoid(x):
    """torch.sigmoid's float32 bits on CUDA wherever they are normal: 1 / (1 + exp(-x)) with CUDA's expf
    (libdevice.exp), as torch's kernel computes it, and the reciprocal from newton_rcp, which equals the IEEE
    division for y = 1 + exp(-x) < 2**126. From there (x below about -87.3, where torch's result is subnormal)
    this gives 0.
    The routers rank sigmoid(x) + bias on it, so they pick torch's experts wherever the float32 choices do not tie
    exactly (tl.sigmoid differs from torch by up to 15 ulps). Newton step, not div_rn: the same bits, at
    tl.sigmoid's cost.
    The interpreter (no libdevice): tl.sigmoid."""
    if _FAST_SIGMOID:  # compiled
        y = 1.0 + libdevice.exp(-x)
        return tl.where(y < _SUBNORMAL_RCP, newton_rcp(y), 0.0)
    else:
        return tl.sigmoid(x)


@triton.jit
def gated_act(gate, up, ACT: tl.constexpr):
    """act(gate) * up in float32; ACT 0 silu, 1 gelu (erf), 2 gelu_tanh (as torch's)."""
    if ACT == 0:
        a = gate * sigmoid(gate)
    elif ACT == 1:
        a = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    else:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        a = 0.5 * gate * (2.0 * sigmoid(2.0 * inner))  # 1 + tanh(y) == 2 * sigmoid(2y)
    return a * up


@triton.jit
def acc_tile(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
    """A zero float32 accumulator of a [BLOCK_M, BLOCK_N] output tile, held as [BLOCK_N, BLOCK_M] where SWAP (swap_ab:
    tile_dot says why)."""
    if SWAP:
        return tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        return tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def tile_dot(a, b, SWAP: tl.constexpr):
    """a [BLOCK_M, BLOCK_K] @ b [BLOCK_K, BLOCK_N] in float32 as acc_tile holds it: [BLOCK_M, BLOCK_N], or where SWAP
    its transpose b.T @ a.T [BLOCK_N, BLOCK_M]. Swapped, the weight tile is the MMA's M operand: a Hopper wgmma needs
    M >= 64 rows a warpgroup but takes N from 8 up, so a block of 16-32 token rows runs as wgmma from shared memory
    (fp8 included) instead of as mma.sync on a 16-row A (which Triton feeds fp8 by converting it to fp16 first), or
    as a 64-row wgmma that is mostly padding (GemmConfig.swap_ab)."""
    if SWAP:
        return tl.dot(tl.trans(b), tl.trans(a))
    else:
        return tl.dot(a, b)


@triton.jit
def tile_dot_acc(a, b, acc, SWAP: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b accumulated inside the dot, as tile_dot (acc in acc_tile's form); IEEE: float32 operands dotted in
    IEEE float32 (float32 layers)."""
    if SWAP:
        if IEEE:
            return tl.dot(tl.trans(b), tl.trans(a), acc, input_precision="ieee")
        else:
            return tl.dot(tl.trans(b), tl.trans(a), acc)
    else:
        if IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)


@triton.jit
def per_row(v, SWAP: tl.constexpr):
    """v [BLOCK_M] (one value a token row) broadcastable over an accumulator in acc_tile's form."""
    if SWAP:
        return v[None, :]
    else:
        return v[:, None]


@triton.jit
def per_col(v, SWAP: tl.constexpr):
    """v [BLOCK_N] (one value an output column) broadcastable over an accumulator in acc_tile's form."""
    if SWAP:
        return v[:, None]
    else:
        return v[None, :]


@triton.jit
def row_major(acc, SWAP: tl.constexpr):
    """An accumulator in acc_tile's form -> [BLOCK_M, BLOCK_N] (one transpose after the K loop, not one a step)."""
    if SWAP:
        return tl.trans(acc)
    else:
        return acc


@triton.jit
def split_steps(k_size, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """This program's K steps kb_lo .. kb_hi-1: all cdiv(k_size, BLOCK_K) of them, or under split K
    (SPLIT_K > 1, grid axis 1 the split s) the s-th run of cdiv(n, SPLIT_K) (empty past the end)."""
    num_kb = tl.cdiv(k_size, BLOCK_K)
    if SPLIT_K > 1:
        per_split = tl.cdiv(num_kb, SPLIT_K)
        kb_lo = tl.program_id(1) * per_split
        kb_hi = tl.minimum(kb_lo + per_split, num_kb)
    else:
        kb_lo = 0
        kb_hi = num_kb
    return kb_lo, kb_hi


@triton.jit
def scale_block(cols, n):
    """128x128 weight-scale block row of each output column (n columns in all), clamped per block.
    Not cols % n: that would hide from Triton that 128 columns share one scale, costing the
    fp8-block K loops some 70 registers per thread (tests/kernels/test_kernels_compile_sm90.py guards it)."""
    return tl.minimum(cols // 128, (n - 1) // 128)


@triton.jit
def fp8_scale(amax):
    """float32 amax -> dequantization scale, amax times float32(1 / 448), as quant/base.amax_to_scale (which says
    why a multiply; Triton's `/` would be the approximate div.full)."""
    return tl.maximum(amax, 1e-12) * (1.0 / 448.0)


@triton.jit
def to_fp8(x, scale, ROUND_IN_FP32: tl.constexpr):
    """Saturating quantize x * (1 / scale) (float32) to float8e4nv, as quant/base.to_fp8.

    scale: broadcastable to x, one value a row or group (pass it unbroadcast: the reciprocal is then taken once a
    row, in IEEE rounding as torch's, and each element costs one multiply instead of an IEEE division's dozen
    instructions).

    ROUND_IN_FP32 (set under TRITON_INTERPRET only): the interpreter's own float32 -> fp8 cast
    drops the mantissa carry (31.4 becomes 16), so round to e4m3's 3 mantissa bits here first,
    to nearest even, and let the cast see exact values; below 2**-6, where e4m3 is subnormal, to its
    fixed step 2**-9 instead (-0.0013 became -0.0 where the step rounds it to -0.00195), after clamping to ±448.
    Compiled kernels use the hardware cast, which saturates by itself (no clamp: 2 instructions an element fewer).
    """
    y = x * tl.math.div_rn(1.0, scale)
    if ROUND_IN_FP32:
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        bits = y.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # drop 20 of 23 mantissa bits (RTNE)
        sub = (y + 24576.0) - 24576.0  # float32 steps of 2**-9 at 1.5 * 2**14: the add rounds to the step (RTNE)
        sub = tl.where(sub == 0.0, y * 0.0, sub)  # keeps the sign of a value that rounds to zero
        y = tl.where(tl.abs(y) < 0.015625, sub, bits.to(tl.float32, bitcast=True))
    return y.to(tl.float8e4nv)  # compiled: cvt.rn.satfinite, which saturates to ±448 itself and keeps NaN a NaN


@dataclass(frozen=True)
class RowLayout:
    """Host-side description of the flat rows a launch works on (see the module docstring).

    masked: True for the masked layout. meta: offsets [E + 1] int64 (sorted) or counts [E]
    int32 (masked), on the device. capacity: C (masked), 0 (sorted). rows: R.
    """

    masked: bool
    meta: Tensor
    num_experts: int
    capacity: int
    rows: int

    @classmethod
    def of(cls, batch) -> "RowLayout":
        """From an ExpertBatch; reads only shapes (no host synchronization)."""
        e = batch.num_local_experts
        if batch.layout == "masked":
            c = batch.hidden.shape[1]
            return cls(True, batch.counts.to(torch.int32).contiguous(), e, c, e * c)
        return cls(False, batch.offsets.to(torch.int64).contiguous(), e, 0, batch.num_rows)

    def num_row_blocks(self, block_m: int) -> int:
        return num_row_blocks(self.rows, self.num_experts, self.capacity, block_m, self.masked)

    @property
    def e_pow2(self) -> int:
        return max(2, next_pow2(self.num_experts))

    def valid_rows(self) -> Tensor:
        """[R] bool: which flat rows hold a token copy (torch; for references and tests)."""
        dev = self.meta.device
        if self.masked:
            slot = torch.arange(self.capacity, device=dev)[None, :]
            return (slot < self.meta.to(torch.int64)[:, None]).reshape(-1)
        return torch.arange(self.rows, device=dev) < self.meta[-1]  # rows past offsets[-1]: padding


def weight_operand(w: Tensor, block_n: int, block_k: int):
    """How a GEMM kernel reads weight tiles of w [E, N, K] (last dimension contiguous).

    -> (TensorDescriptor over the rows [E * N, K] with [block_n, block_k] boxes, N), for TMA loads
       (an expert stride of 0 gives a descriptor over one expert's [N, K] and 0: every expert
       reads the same rows); or (w, 0) where TMA cannot address w (rows not 16-byte aligned,
       experts not back to back, MOEFLOW_TRITON_TMA=0) and the kernel uses pointer loads.
    Rows a box reads past an expert's N belong to the next expert or are zero (past the end):
    the kernels never store the output columns they feed. Columns past K are zero.
    """
    e, n, k = w.shape
    per_expert = expert_rows(w)
    if per_expert is None:
        return w, 0
    desc = _rows_descriptor(w, e * n if per_expert else n, k, w.stride(1), [block_n, block_k])
    return (w, 0) if desc is None else (desc, per_expert)


def expert_rows(w: Tensor) -> int | None:
    """w [E, N, K] read as rows [E * N, K]: expert e's rows start at row e * (this): N, or 0 for an
    expert stride of 0 (every expert reads the same rows); None where the experts are not back to
    back, or there are none."""
    e, n, _ = w.shape
    if e == 0 or w.stride(0) not in (0, n * w.stride(1)):
        return None
    return n if w.stride(0) else 0


def rows_operand(a: Tensor, block_m: int, block_k: int):
    """How a GEMM kernel reads activation tiles of a [R, K] whose rows are in layout order (the
    down GEMM's input): a TensorDescriptor with [block_m, block_k] boxes where TMA can address it
    (16-byte aligned rows, MOEFLOW_TRITON_TMA not 0), else ``a`` itself (pointer loads)."""
    desc = _rows_descriptor(a, a.shape[0], a.shape[1], a.stride(0), [block_m, block_k])
    return a if desc is None else desc


def _rows_descriptor(t: Tensor, rows: int, k: int, row_stride: int, block: list[int]):
    """A TMA descriptor over ``rows`` rows of ``k`` contiguous elements from t's start, ``row_stride``
    elements apart; None where TMA cannot address them (MOEFLOW_TRITON_TMA=0, nothing to read,
    last dimension not contiguous, rows or base not 16-byte aligned)."""
    if rows == 0 or k == 0 or not tma_rows(t, row_stride):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor(t, [rows, k], [row_stride, 1], block)


def tma_rows(t: Tensor, row_stride: int) -> bool:
    """Whether TMA may read rows of t, ``row_stride`` elements apart: MOEFLOW_TRITON_TMA not 0, the last
    dimension contiguous, rows and base 16-byte aligned, a device whose kernel target has TMA (moeflow.targets)."""
    return (moeflow_env.TRITON_TMA.get_bool() and t.stride(-1) == 1 and (row_stride * t.element_size()) % 16 == 0
            and t.data_ptr() % 16 == 0 and kernel_target(t.device).tma)


def unit_stride_rows(t: Tensor) -> Tensor:
    """t [R, C] as the kernels take it: itself when its columns are contiguous (any row stride, e.g.
    rows viewed inside an expert-parallel receive buffer), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (persistent grids size by it); 1 elsewhere (the
    CPU interpreter)."""
    if device.type != "cuda":
        return 1
    return _cuda_properties(device).multi_processor_count


def pdl(device: torch.device, early_start: bool = True) -> dict:
    """Launch keywords of a kernel that opens with pdl_wait: {"PDL": on, "launch_pdl": on and
    early_start}, on for CUDA devices whose kernel target has PDL (moeflow.targets: sm_90 on) unless MOEFLOW_TRITON_PDL=0
    (never in the interpreter). early_start=False (the GEMMs) keeps the griddepcontrol code, so the
    kernel still lets the next one launch early, but launches the kernel itself plainly: started
    early, a weight-streaming GEMM's programs land on whichever SMs the kernel before frees first,
    unevenly, and run slower."""
    on = (device.type == "cuda" and not interpreting() and moeflow_env.TRITON_PDL.get_bool()
          and kernel_target(device).pdl)
    return {"PDL": on, "launch_pdl": on and early_start}


def _cuda_properties(device: torch.device):
    """torch.cuda's properties of a CUDA device (an index-less device: the current one), cached."""
    return _properties_of(device.index if device.index is not None else torch.cuda.current_device())


@lru_cache(maxsize=None)
def _properties_of(index: int):
    return torch.cuda.get_device_properties(index)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (see to_fp8)."""
    return moeflow_env.TRITON_INTERPRET.get_bool()


# ---------------------------------------------------------------- routing: top-k keys
NEG_INF = tl.constexpr(float("-inf"))  # the routers' masked choice (kernels/routing/route.py, route_stream.py)


@triton.jit
def order_key(x, idx, N: tl.constexpr):
    """float32 x and its column idx (0 .. N-1) -> int64 keys ordered as (x ascending, idx descending):
    the float's bits made monotone (negative values' magnitude bits flipped) in the high word, N-1-idx
    in the low word. One max over the keys then gives the largest x and, among exact ties, the lowest
    index. (-0.0 orders below +0.0, which routing's scores never produce as a tie: softmax and
    sigmoid are >= +0.)"""
    bits = x.to(tl.int32, bitcast=True)
    mono = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (mono.to(tl.int64) << 32) | (N - 1 - idx).to(tl.int64)


@triton.jit
def key_value(key):
    """The float32 value of an order_key."""
    mono = (key >> 32).to(tl.int32)
    return tl.where(mono < 0, mono ^ 0x7FFFFFFF, mono).to(tl.float32, bitcast=True)


# ---------------------------------------------------------------- weight-only FP8: e4m3fn bits decoded in the GEMMs
@triton.jit
def fp8e4m3_decode(bits, DTYPE: tl.constexpr):
    """float8_e4m3fn bit patterns (a uint8 tile) -> their exact values in DTYPE (tl.float16, tl.bfloat16, tl.float32),
    from integer ops and bitcasts only: sm_80 / sm_86 Triton refuses the type float8e4nv wherever a kernel names it.

    e4m3's sign, 4 exponent bits (bias 7) and 3 mantissa bits, placed as fp16's sign and the low 4 of its 5 exponent
    bits (bias 15) and the top 3 of its 10 mantissa bits, make an fp16 of value 2**-8 times the e4m3 value: normals
    and subnormals alike (e4m3's subnormals land on fp16's; fp16 arithmetic keeps subnormals, where float32's may be
    flushed). The multiply by 256 and the widening cast are exact. NaN patterns (0x7F, 0xFF) decode to ±480, not NaN:
    quantized weights hold none (quantization saturates at ±448)."""
    b = bits.to(tl.uint16)
    half = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True) * 256.0
    return half.to(DTYPE)


def fp8e4m3_decode_torch(bits: Tensor) -> Tensor:
    """Reference of fp8e4m3_decode: uint8 bit patterns -> float32 values, through torch's own float8_e4m3fn."""
    return bits.view(torch.float8_e4m3fn).float()
