"""Experiment (GPU): would a two-CTA cluster sharing each weight tile through a TMA multicast draw operands faster
than each CTA loading its own? The loads alone of the warp-specialized GEMMs bound the bf16 ones and, with the
math, the fp8-block ones (benchmarks/results/ws_bounds_2026-12-03_h200_c589c8c.md: 10-15.6 TB/s of operands from
the L2; a fourth stage made them slower, which points at the L2 and its links). A multicast reads a weight tile
from the L2 once for two SMs. triton 3.6's Gluon has no multicast copy ("NYI: Support multicast" in libtriton;
cluster_probe.py), so this probe issues its copies in inline PTX, to learn whether the gain is worth building.

The probe: the loads of a persistent warp-specialized GEMM and nothing else. A loader warpgroup streams each tile's K
steps, an activation box [BM, BK] and a weight box [BN, BK], into a ring of STAGES slots; the consumer warpgroup
waits for each step's slot and releases it (no math: ws_bounds.py's "loads" form). CTA pairs (p, p + 1) take row
tiles 2i and 2i + 1 of the same weight column tile. Three forms, one kernel:
  - own:       each CTA copies both boxes itself, launched without clusters (the shipped kernels' traffic);
  - own-pair:  the same copies, launched as two-CTA clusters (what the cluster launch alone costs or gives);
  - multicast: two-CTA clusters; each CTA copies its activation box, and one half of the shared weight box
               ([BN / 2, BK], rows rank * BN / 2 on) into both CTAs' slots with .multicast::cluster; a slot is
               refilled once both CTAs' consumers have released it (each consumer arrives on its own and its
               peer's empty barrier: count 2).
Operands: A [M, K], B [N, K] (32 MB together: they stay in the L2, as the GEMMs' operands mostly do).

How the PTX finds its operands, since Gluon gives no addresses: the kernel's one shared allocation (an int8
buffer: the ring, then the barriers) sits at the start of `global_smem` (a 16-byte marker written through Gluon
and read back through PTX checks this in every CTA: `flag` stays 0); the tensor maps are the kernel's own
__grid_constant__ parameters, named <kernel>_param_<i> in Triton's PTX (the launch passes a Gluon
TensorDescriptor as 5 parameters: map, 2 sizes, 2 strides). The cluster launch is Triton's own (num_ctas in the
kernel's packed launch metadata; the kernel is compiled for one CTA and makes no CTA-layout assumption).

Checks before timing: the marker; then, per form, every CTA's final ring (each slot holds one of the last STAGES
steps) copied out and compared with the own form's, byte for byte, and each slot's two boxes with the operand
tiles that step read (as sorted bytes: the 128-byte swizzle permutes them within a box).

    PYTHONPATH=$PWD python benchmarks/experiments/multicast_probe.py OUT_DIR    # GPU; a table last
    python benchmarks/experiments/multicast_probe.py --compile                 # no GPU: sm_90a PTX and ptxas
On the GPU, run it under `timeout`: a barrier bug would hang a kernel rather than fail it.
Writes OUT_DIR/multicast_probe.json. Each form is timed as a CUDA graph (moeflow.benchmark.graph_us, the L2
flushed before each replay: the operands come from HBM once, then from the L2).
Reading it: if multicast draws operands clearly faster than own-pair (SM-delivered TB/s), a multicast loader for
the warp-specialized GEMMs is worth building (pairs of row blocks of one expert share each weight tile); if not,
the L2 is not what bounds their loads, and the docs should say so.
"""
import json
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from moeflow.kernels.cluster_ptx import (cluster_sync, fence_mbarrier_init, lanes, launch_as_pairs, multicast_asm,
                                         multicast_copy, remote_arrive, smem_base)
from moeflow.kernels.down_wgmma import smem_layout

KERNEL = "_mc_loads_kernel"
MARK = gl.constexpr(0x5A)  # the marker byte
# (name, element bytes, BM, BN, BK, STAGES): the warp-specialized tiles whose loads ws_bounds.py measured
CASES = (("fp8 64x256x128 s4 (ping-pong gate_up: gate and up)", 1, 64, 256, 128, 4),
         ("fp8 128x256x128 s3 (COOP gate_up)", 1, 128, 256, 128, 3),
         ("fp8 64x256x128 s5 (wide down)", 1, 64, 256, 128, 5),
         ("bf16 128x256x64 s4 (COOP down)", 2, 128, 256, 64, 4),
         ("bf16 128x128x64 s5 (down)", 2, 128, 128, 64, 5))
FORMS = ("own", "own-pair", "multicast")
M, N, K_BYTES = 4096, 4096, 4096  # A [M, K], B [N, K]: K = K_BYTES / element bytes


def _param(i: int) -> str:
    """PTX expression: the generic address of the kernel's parameter i (a tensor map)."""
    return f"mov.b64 tm, {KERNEL}_param_{i}; cvta.param.u64 tm, tm;"


# The probe's own PTX besides kernels/cluster_ptx.py's (which the MULTICAST gate_up shares): every asm below runs in
# every thread of its partition and acts in one (the first thread of the loader warpgroup, or of the consumer
# warpgroup: $1 is the thread's lane, cluster_ptx.lanes, as in cluster_ptx's asm); each returns a dummy 0
# (inline_asm_elementwise needs an output).
_ONE_LANE = "{ .reg .pred pl; .reg .b64 tm; .reg .b16 msk; setp.eq.u32 pl, $1, 0; "
_END = " mov.u32 $0, 0; }"
ASM_LOAD32 = gl.constexpr("ld.shared.u32 $0, [$1];")
ASM_INIT = gl.constexpr(_ONE_LANE + "@pl mbarrier.init.shared::cta.b64 [$2], $3;" + _END)
_WAIT = ("{ .reg .pred done; mc_wait:\n mbarrier.try_wait.parity%s.shared::cta.b64 done, [$2], $3;\n"
         " @!done bra.uni mc_wait;\n mov.u32 $0, 0; }")
ASM_WAIT = gl.constexpr(_WAIT % "")  # $2 barrier, $3 parity
# a barrier the peer CTA arrives on too: the default semantics (acquire, CTA scope), as CUTLASS's; with
# .acquire.cluster ptxas invalidated the L1 (CCTL.IVALL) after each wait
ASM_WAIT_CLUSTER = gl.constexpr(_WAIT % "")
# $2 full barrier, $3 A slot, $4 B slot (multicast: this CTA's half of it), $5 bytes the slot receives,
# $6 K coordinate, $7 A row, $8 B row
_TMA = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
ASM_ISSUE_OWN = gl.constexpr(_ONE_LANE + "@pl mbarrier.arrive.expect_tx.shared::cta.b64 _, [$2], $5; " + _param(0)
                              + f" @pl {_TMA} [$3], [tm, {{$6, $7}}], [$2]; " + _param(5)
                              + f" @pl {_TMA} [$4], [tm, {{$6, $8}}], [$2];" + _END)
ASM_ISSUE_A = gl.constexpr(_ONE_LANE + "@pl mbarrier.arrive.expect_tx.shared::cta.b64 _, [$2], $5; " + _param(0)
                            + f" @pl {_TMA} [$3], [tm, {{$6, $7}}], [$2];" + _END)
# loads_probe's "own-split": the A box's second half, into the same slot and barrier (the expect above counted it)
ASM_COPY_A = gl.constexpr(_ONE_LANE + _param(0) + f" @pl {_TMA} [$3], [tm, {{$6, $7}}], [$2];" + _END)
# loads_probe's gather forms: the B box alone after the expect (the A rows come in row copies below)
ASM_ISSUE_B = gl.constexpr(_ONE_LANE + "@pl mbarrier.arrive.expect_tx.shared::cta.b64 _, [$2], $5; " + _param(5)
                            + f" @pl {_TMA} [$4], [tm, {{$6, $8}}], [$2];" + _END)
# one A row ([1, BK] box) in every thread whose $1 is not 0: $2 barrier, $3 destination, $4 K coordinate, $5 row
ASM_COPY_ROW = gl.constexpr("{ .reg .pred pl; .reg .b64 tm; setp.ne.u32 pl, $1, 0; " + _param(0)
                             + f" @pl {_TMA} [$3], [tm, {{$4, $5}}], [$2];" + _END)
B_HALF_MULTICAST = gl.constexpr(multicast_asm(KERNEL, 10))  # bh_desc's boxes into both CTAs
# $2 the slot's empty barrier
ASM_RELEASE = gl.constexpr(_ONE_LANE + "@pl mbarrier.arrive.shared::cta.b64 _, [$2];" + _END)


@gluon.jit
def _asm(text: gl.constexpr, a, b=0, c=0, d=0, e=0, f=0, g=0):
    """One inline PTX statement with side effects over the thread's lane ($1, cluster_ptx.lanes) and scalars a..g
    ($2..$8) -> its dummy int32 result, one a thread."""
    return gl.inline_asm_elementwise(text, "=r,r,r,r,r,r,r,r,r", [lanes(), a, b, c, d, e, f, g], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _tile(q, m_pairs, n_tiles, rank, COLPAIRS: gl.constexpr, GROUP: gl.constexpr):
    """Tile pair q's tile for CTA rank -> (row tile, column tile) (tile_of's order, which the checks use)."""
    if COLPAIRS:
        return q // (n_tiles // 2), 2 * (q % (n_tiles // 2)) + rank
    if GROUP:
        w = q % (GROUP // 2 * n_tiles)
        return (q // (GROUP // 2 * n_tiles)) * GROUP + 2 * (w % (GROUP // 2)) + rank, w // (GROUP // 2)
    return 2 * (q % m_pairs) + rank, q // m_pairs


def tile_of(q: int, rank: int, m_pairs: int, n_tiles: int, colpairs: bool = False, group: int = 0):
    """_tile in Python. The pair shares the column tile and consecutive pairs take the next row tiles (all of them;
    GROUP: GROUP row tiles, then the next column tile); COLPAIRS (loads_probe's "own-cols"): the pair shares the row
    tile, and consecutive pairs take the next column tiles."""
    if colpairs:
        return q // (n_tiles // 2), 2 * (q % (n_tiles // 2)) + rank
    if group:
        w = q % (group // 2 * n_tiles)
        return (q // (group // 2 * n_tiles)) * group + 2 * (w % (group // 2)) + rank, w // (group // 2)
    return 2 * (q % m_pairs) + rank, q // m_pairs


@gluon.jit
def _loader(p, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
            MULTICAST: gl.constexpr, CLUSTER: gl.constexpr, SPLIT_A: gl.constexpr, COLPAIRS: gl.constexpr,
            GROUP: gl.constexpr, GATHER: gl.constexpr):
    """The loader warpgroup: every K step of the CTA's tiles into slot g % STAGES, once the slot is released. One
    thread issues; a whole warpgroup, so that no warp of the CTA sits out the cluster barriers (with a one-warp
    loader Triton pads the CTA with three idle warps, which would never arrive). GATHER (a_desc's boxes one row):
    the A box's BM rows come as BM row copies from rows idx[mt * BM + r] of A, issued by threads 0 .. BM - 1 one
    row each (GATHER 1), by thread 0 all (GATHER 2), or by the first BM / 4 lanes of each of the 4 warps (3)."""
    base, m_pairs, n_tiles, k_steps, idx_ptr = p
    LOADER: gl.constexpr = 32 * gl.num_warps()
    lane = gl.arange(0, LOADER, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    A_BYTES: gl.constexpr = BM * BK
    B_BYTES: gl.constexpr = BN * BK
    if CLUSTER:  # both CTAs' barriers initialized before any copy reaches them
        cluster_sync(base)
    pid = gl.program_id(0)
    rank = pid % 2
    full = base + STAGES * (A_BYTES + B_BYTES)
    empty = full + 8 * STAGES
    g = 0
    for q in range(pid // 2, m_pairs * n_tiles, gl.num_programs(0) // 2):
        mt, nt = _tile(q, m_pairs, n_tiles, rank, COLPAIRS, GROUP)
        # GATHER 1: thread t copies row t; GATHER 3: the warps share the rows, BM / 4 lanes each (row w * BM / 4 + lane)
        mine = lane < BM if GATHER != 3 else lane % 32 < BM // 4
        row_of = lane if GATHER != 3 else lane // 32 * (BM // 4) + lane % 32
        rows = gl.load(idx_ptr + mt * BM + gl.minimum(row_of, BM - 1))
        for kk in range(k_steps):
            s = g % STAGES
            if g >= STAGES:
                _asm(ASM_WAIT_CLUSTER, empty + 8 * s, ((g // STAGES) - 1) & 1)
            a_slot = base + s * A_BYTES
            b_slot = base + STAGES * A_BYTES + s * B_BYTES
            if MULTICAST:  # this CTA's activation box, and its half of the weight box into both CTAs
                _asm(ASM_ISSUE_A, full + 8 * s, a_slot, 0, A_BYTES + B_BYTES, kk * BK, mt * BM)
                multicast_copy(B_HALF_MULTICAST, full + 8 * s, b_slot + rank * (B_BYTES // 2), kk * BK,
                               nt * BN + rank * (BN // 2), True)
            elif GATHER:
                _asm(ASM_ISSUE_B, full + 8 * s, a_slot, b_slot, A_BYTES + B_BYTES, kk * BK, mt * BM, nt * BN)
                if GATHER != 2:
                    gl.inline_asm_elementwise(ASM_COPY_ROW, "=r,r,r,r,r,r", [mine.to(gl.int32), full + 8 * s,
                                              a_slot + row_of * BK, lane * 0 + kk * BK, rows], dtype=gl.int32,
                                              is_pure=False, pack=1)
                else:
                    for r in gl.static_range(BM):
                        _asm(ASM_COPY_A, full + 8 * s, a_slot + r * BK, 0, 0, kk * BK, gl.load(idx_ptr + mt * BM + r))
            else:  # SPLIT_A: a_desc's boxes are [BM / 2, BK], the second copied below
                _asm(ASM_ISSUE_OWN, full + 8 * s, a_slot, b_slot, A_BYTES + B_BYTES, kk * BK, mt * BM, nt * BN)
                if SPLIT_A:
                    _asm(ASM_COPY_A, full + 8 * s, a_slot + A_BYTES // 2, 0, 0, kk * BK, mt * BM + BM // 2)
            g += 1
    if CLUSTER:  # no CTA leaves while its peer may still arrive on its barriers
        cluster_sync(base)


@gluon.jit
def _consumer(p, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
              MULTICAST: gl.constexpr, CLUSTER: gl.constexpr):
    """The consumer warpgroup: waits for each step's slot and releases it (multicast: in both CTAs)."""
    base, m_pairs, n_tiles, k_steps, _ = p
    if CLUSTER:
        cluster_sync(base)
    full = base + STAGES * (BM * BK + BN * BK)
    empty = full + 8 * STAGES
    pid = gl.program_id(0)
    g = 0
    for q in range(pid // 2, m_pairs * n_tiles, gl.num_programs(0) // 2):
        for kk in range(k_steps):
            s = g % STAGES
            _asm(ASM_WAIT, full + 8 * s, (g // STAGES) & 1)
            _asm(ASM_RELEASE, empty + 8 * s)
            if MULTICAST:  # the peer CTA's barrier at the same offset counts this CTA's consumer too
                remote_arrive(empty + 8 * s, 1 - pid % 2, True)
            g += 1
    if CLUSTER:
        cluster_sync(base)


@gluon.jit(do_not_specialize=["m_pairs", "n_tiles", "k_steps", "never"])
def _mc_loads_kernel(a_desc, b_desc, bh_desc, flag_ptr, img_ptr, idx_ptr, m_pairs, n_tiles, k_steps, never,
                     BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                     MULTICAST: gl.constexpr, CLUSTER: gl.constexpr, IMAGE: gl.constexpr, SPLIT_A: gl.constexpr,
                     COLPAIRS: gl.constexpr, GROUP: gl.constexpr, GATHER: gl.constexpr):
    """Loads alone (module docstring), in bytes: a_desc A [M, K] boxes [BM, BK]; b_desc B [N, K] boxes [BN, BK];
    bh_desc B boxes [BN / 2, BK] (multicast). flag_ptr [P] int32, zeroed: set to 1 where a CTA's marker check
    failed. img_ptr [P, STAGES * (BM + BN) * BK] int8: with IMAGE, each CTA's final ring. idx_ptr [M] int32: the
    rows of A the GATHER forms copy for row r of A's row tile mt (idx[mt * BM + r]). never: a runtime 0 (the
    buffer's last use then stays in the kernel, so the allocator gives nothing else its bytes). The cluster
    barriers run inside both partitions: a warp-specialized kernel's worker warps skip the code around them."""
    RING: gl.constexpr = STAGES * (BM + BN) * BK
    lay: gl.constexpr = gl.BlockedLayout([16], [32], [4], [0])  # thread t: bytes 16 t .. 16 t + 15
    # 2048-byte chunks (a 1-D shared buffer must be a power of two long): the ring, then one for the barriers
    buf = gl.allocate_shared_memory(gl.int8, [RING // 2048 + 1, 2048], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    buf.index(0).store(gl.full([2048], MARK, gl.int8, lay))
    zero = gl.program_id(0) * 0
    base = smem_base()
    tid = gl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [zero], dtype=gl.int32, is_pure=True, pack=1)
    word = gl.inline_asm_elementwise(ASM_LOAD32, "=r,r", [base + 16 * tid], dtype=gl.int32, is_pure=False, pack=1)
    gl.store(flag_ptr + gl.program_id(0), 1, mask=word != MARK * 0x01010101)  # the bytes this thread wrote
    full = base + RING
    for s in gl.static_range(STAGES):
        _asm(ASM_INIT, full + 8 * s, 1)
        _asm(ASM_INIT, full + 8 * (STAGES + s), 2 if MULTICAST else 1)
    fence_mbarrier_init(zero)
    fence_async_shared()
    p = (base, m_pairs, n_tiles, k_steps, idx_ptr)
    gl.warp_specialize([(_consumer, (p, BM, BN, BK, STAGES, MULTICAST, CLUSTER)),
                        (_loader, (p, BM, BN, BK, STAGES, MULTICAST, CLUSTER, SPLIT_A, COLPAIRS, GROUP, GATHER))],
                       [4], [40])
    offs = gl.arange(0, 2048, lay)
    out = img_ptr + gl.program_id(0).to(gl.int64) * RING
    if IMAGE:
        for c in gl.static_range(RING // 2048):
            gl.store(out + c * 2048 + offs, buf.index(c).load(lay))
    else:
        gl.store(out + offs, buf.index(0).load(lay), mask=offs < never)


def _descs(a, b, bm, bn, bk, split_a=False, row_a=False):
    """TMA descriptors over the byte views (fp8 typed: the swizzle then matches a GEMM's of the same row bytes).
    split_a (_constexprs' SPLIT_A): the A box is BM / 2 rows, copied twice a step; row_a (GATHER): one row, with
    the full box's swizzle (the default for one row is none)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    av, bv = a.view(torch.float8_e4m3fn), b.view(torch.float8_e4m3fn)
    ar = 1 if row_a else bm // 2 if split_a else bm
    a_layout = smem_layout((bm, bk), "float8e4nv") if row_a else smem_layout((ar, bk), "float8e4nv")
    return (TensorDescriptor.from_tensor(av, [ar, bk], a_layout),
            TensorDescriptor.from_tensor(bv, [bn, bk], smem_layout((bn, bk), "float8e4nv")),
            TensorDescriptor.from_tensor(bv, [bn // 2, bk], smem_layout((bn // 2, bk), "float8e4nv")))


def _constexprs(bm, bn, bk, stages, form, image):
    """form: FORMS, or loads_probe's own-split (A in two boxes of BM / 2 rows), own-cols (COLPAIRS), own-g<G>
    (GROUP G: tile_of) and the row copies (GATHER): rows (A's own rows, one copy each, one thread a row), gather
    (rows of A in a random order, idx), gather-1 (the same, thread 0 issuing every row) and gather-4w (the same,
    every warp of the loader a quarter of the rows)."""
    return dict(BM=bm, BN=bn, BK=bk, STAGES=stages, MULTICAST=form == "multicast",
                GATHER={"rows": 1, "gather": 1, "gather-1": 2, "gather-4w": 3}.get(form, 0),
                CLUSTER=form in ("own-pair", "multicast"), IMAGE=image, SPLIT_A=form == "own-split",
                COLPAIRS=form == "own-cols", GROUP=int(form[5:]) if form.startswith("own-g") else 0, num_warps=4)


def compile_ptx(case, form: str, image: bool = False):
    """One form of one case for sm_90a (no GPU) -> the compiled kernel (asm["ptx"], metadata.shared)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    _, elem, bm, bn, bk_elems, stages = case
    bk = bk_elems * elem
    a = torch.empty(M, K_BYTES, dtype=torch.uint8)
    b = torch.empty(N, K_BYTES, dtype=torch.uint8)
    const = _constexprs(bm, bn, bk, stages, form, image)
    descs = _descs(a, b, bm, bn, bk, const["SPLIT_A"], const["GATHER"] > 0)
    sig = {name: mangle_type(d) for name, d in zip(("a_desc", "b_desc", "bh_desc"), descs)}
    sig |= dict(flag_ptr="*i32", img_ptr="*i8", idx_ptr="*i32", m_pairs="i32", n_tiles="i32", k_steps="i32",
                never="i32")
    const.pop("num_warps")
    sig |= {k: "constexpr" for k in const}
    return triton.compile(GluonASTSource(fn=_mc_loads_kernel, signature=sig, constexprs=const),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def compile_summary(case, form: str, image: bool = False) -> dict:
    """compile_ptx's kernel -> what ptxas and its PTX show: registers and spill bytes, shared memory, warps, the
    multicast copies, remote arrivals and cluster barriers in its PTX (--compile prints it; the CPU test checks it)."""
    from moeflow.kernels.registers import ptxas_report
    c = compile_ptx(case, form, image)
    ptx = c.asm["ptx"]
    regs, spill, _ = ptxas_report(ptx)
    return dict(case=case[0], form=form, image=image, regs=regs, spill=spill, shared=c.metadata.shared,
                warps=c.metadata.num_warps, multicast=ptx.count("multicast::cluster ["),
                remote=ptx.count("mapa.shared::cluster"), cluster_barriers=ptx.count("barrier.cluster.arrive"))


def _launcher(case, form: str, image: bool, programs: int, sizes=(M, N, K_BYTES)):
    """-> (run(): one launch, flag [P] int32, img [P, RING] uint8, tile bytes the SMs receive, bytes read from L2).
    sizes: (M, N, K bytes) of the operands A [M, K] and B [N, K]."""
    _, elem, bm, bn, bk_elems, stages = case
    bk = bk_elems * elem
    m, n, k_bytes = sizes
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randint(0, 256, (m, k_bytes), dtype=torch.uint8, device="cuda", generator=g)
    b = torch.randint(0, 256, (n, k_bytes), dtype=torch.uint8, device="cuda", generator=g)
    const = _constexprs(bm, bn, bk, stages, form, image)
    descs = _descs(a, b, bm, bn, bk, const["SPLIT_A"], const["GATHER"] > 0)
    idx = (torch.randperm(m, generator=g, device="cuda") if form.startswith("gather")
           else torch.arange(m, device="cuda")).to(torch.int32)
    ring = stages * (bm + bn) * bk
    flag = torch.zeros(programs, dtype=torch.int32, device="cuda")
    img = torch.zeros((programs, ring), dtype=torch.uint8, device="cuda")
    m_pairs, n_tiles, k_steps = m // bm // 2, n // bn, k_bytes // bk
    args = (*descs, flag, img, idx, m_pairs, n_tiles, k_steps, 0)
    kernel = _mc_loads_kernel.warmup(*args, grid=(1,), **const)
    cluster = const["CLUSTER"]
    if cluster:  # a two-CTA cluster launch: the launcher multiplies the grid by num_ctas
        launch_as_pairs(kernel)
    grid = (programs // 2,) if cluster else (programs,)
    tiles = 2 * m_pairs * n_tiles
    delivered = tiles * k_steps * (bm + bn) * bk
    from_l2 = delivered - (tiles * k_steps * bn * bk // 2 if form == "multicast" else 0)

    def run():
        _mc_loads_kernel[grid](*args, **const)
    return run, flag, img, delivered, from_l2, (a, b, bm, bn, bk, stages, m_pairs, n_tiles, k_steps,
                                                form == "own-cols", const["GROUP"], idx)


def _expected_slots(ops, pid: int, programs: int):
    """The operand boxes each slot of CTA pid holds at the end: [(A box, B box) as uint8 tensors] per slot."""
    a, b, bm, bn, bk, stages, m_pairs, n_tiles, k_steps, colpairs, group, idx = ops
    steps = []
    for q in range(pid // 2, m_pairs * n_tiles, programs // 2):
        mt, nt = tile_of(q, pid % 2, m_pairs, n_tiles, colpairs, group)
        steps += [(mt, nt, kk) for kk in range(k_steps)]
    slots = [None] * stages
    for g in range(max(0, len(steps) - stages), len(steps)):
        mt, nt, kk = steps[g]
        ks = slice(kk * bk, (kk + 1) * bk)
        slots[g % stages] = (a[idx[mt * bm:(mt + 1) * bm].long(), ks], b[nt * bn:(nt + 1) * bn, ks])
    return slots


def check(case, programs: int, forms=FORMS, sizes=(M, N, K_BYTES)) -> dict:
    """Every form's final rings: the marker, byte equality with the own form's (forms[0] must be "own"), the boxes
    each slot should hold."""
    images, res = {}, {}
    for form in forms:
        run, flag, img, _, _, ops = _launcher(case, form, True, programs, sizes)
        run()
        torch.cuda.synchronize()
        a, b, bm, bn, bk, stages = ops[:6]
        bad = 0
        for pid in range(0, programs, max(1, programs // 8)):  # eight CTAs' rings against the operands
            ring = img[pid]
            for s, box in enumerate(_expected_slots(ops, pid, programs)):
                if box is None:
                    continue
                got_a = ring[s * bm * bk:(s + 1) * bm * bk]
                got_b = ring[stages * bm * bk + s * bn * bk:stages * bm * bk + (s + 1) * bn * bk]
                bad += not torch.equal(got_a.sort().values, box[0].reshape(-1).sort().values)
                bad += not torch.equal(got_b.sort().values, box[1].reshape(-1).sort().values)
        images[form] = img.clone()
        res[form] = dict(marker_ok=bool((flag == 0).all()), boxes_wrong=bad,
                         same_as_own=bool(torch.equal(img, images["own"])))
    return res


def main():
    if sys.argv[1:] == ["--compile"]:
        for case in CASES:
            for form in FORMS:
                c = compile_summary(case, form)
                print(f"{case[0]:52} {form:9} shared {c['shared']:6} regs {c['regs']:3} spill {c['spill']} "
                      f"multicast copies {c['multicast']} cluster barriers {c['cluster_barriers']}")
        return
    from moeflow.benchmark import graph_us
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for case in CASES:
        for programs in (sms - sms % 2, sms - sms % 2 - 4):
            checks = check(case, programs)
            for form in FORMS:
                run, _, _, delivered, from_l2, _ = _launcher(case, form, False, programs)
                ok = checks[form]
                us = graph_us(run) if ok["marker_ok"] and not ok["boxes_wrong"] and ok["same_as_own"] else float("nan")
                r = dict(case=case[0], programs=programs, form=form, us=round(us, 2),
                         delivered_tbs=round(delivered / us / 1e6, 2), l2_tbs=round(from_l2 / us / 1e6, 2), **ok)
                rows.append(r)
                print(json.dumps(r), flush=True)
    with open(os.path.join(out_dir, "multicast_probe.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), triton=triton.__version__, rows=rows), f, indent=1)
    print(f"{'case':52} {'P':>4} {'form':9} {'us':>8} {'SM TB/s':>8} {'L2 TB/s':>8} checks")
    for r in rows:
        good = r["marker_ok"] and not r["boxes_wrong"] and r["same_as_own"]
        print(f"{r['case']:52} {r['programs']:4} {r['form']:9} {r['us']:8.1f} {r['delivered_tbs']:8.2f} "
              f"{r['l2_tbs']:8.2f} {'ok' if good else r}")


if __name__ == "__main__":
    main()
