"""Two-CTA cluster operations that triton 3.6's Gluon has no operation for, in inline PTX (sm_90).

Used by benchmarks/experiments/multicast_probe.py (the copies alone). The warp-specialized GEMMs' MULTICAST form
(branch `multicast`, measured, not merged, and not in this repository: only main lands here) used them too: the two
CTAs of a cluster took two row blocks of one expert and each copied one of a step's two weight boxes into both CTAs'
shared memory with one TMA multicast, so the L2 served each weight box once for two SMs.

What the PTX needs that Gluon does not hand out, and where it comes from:
  - shared-memory addresses: ``smem_base()`` (the start of ``global_smem``, the dynamic shared memory Triton's PTX
    declares) plus the byte offset the allocator gave each buffer (the probe keeps one allocation at offset 0 and
    checks it with a marker; the branch's GEMMs read their buffers' offsets off a first compilation's LLVM IR);
  - the weight tensor map: the kernel's own __grid_constant__ parameter, named ``<kernel>_param_<i>`` in Triton's
    PTX (a Gluon TensorDescriptor of rank 2 is passed as 5 parameters: the map, 2 sizes, 2 strides);
  - the cluster launch: Triton's launcher makes one from ``num_ctas`` in a compiled kernel's packed launch metadata
    (``launch_as_pairs``); the kernel itself is compiled for one CTA and assumes no CTA layout.
Every asm below runs in every thread of a partition and acts in one, the first of the partition: each takes the
thread's lane as an operand (``lanes()``, which Triton computes once). An asm that read ``%tid.x`` itself, in a
loader partition's K loop, made ptxas spill the *consumer* partitions' registers: 280-344 bytes in the fp8-block
gate_up's consumers, none with the lane as an operand (sm_90a, 2026-12-05; nothing else in the asm changed).
Each returns a dummy 0, since inline_asm_elementwise must return something.
Measured (H200, 2026-12-05, benchmarks/results/multicast_2026-12-05_h200.md): the probe's multicast form checked
byte for byte, yet its SMs received operands at 0.75-0.99x the rate of each CTA loading its own, with 25-40% fewer
bytes from the L2; the GEMMs' form (branch `multicast`) ran the layer 1.01x slower, and was not merged. Kept for the
probe, and for kernels that may yet need a cluster operation. Per-step arrivals and waits take the default (CTA
scope) semantics: with .release.cluster ptxas put MEMBAR.ALL.GPU before each arrival, which halved the probe's rate.
"""
from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover - older triton: the Gluon kernels are not usable
    gluon = None

_ONE = "{ .reg .pred pl; .reg .b32 far; .reg .b64 tm; .reg .b16 msk; setp.eq.u32 pl, $1, 0; "
_END = " mov.u32 $0, 0; }"
_TMA_MC = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"


def multicast_asm(kernel: str, param: int) -> str:
    """The PTX of multicast_copy for the tensor map that is parameter ``param`` of ``kernel``: $1 the thread's lane
    in its partition, $2 the mbarrier, $3 the destination (the same offset in both CTAs), $4 the inner (K)
    coordinate, $5 the row, $6 a predicate."""
    return (_ONE + "setp.ne.and.u32 pl, $6, 0, pl; "
            f"mov.b64 tm, {kernel}_param_{param}; cvta.param.u64 tm, tm; mov.b16 msk, 3; "
            f"@pl {_TMA_MC} [$3], [tm, {{$4, $5}}], [$2], msk;" + _END)


if gluon is not None:
    _BASE = gl.constexpr("mov.u32 $0, global_smem;")
    _FENCE_INIT = gl.constexpr("fence.mbarrier_init.release.cluster; mov.u32 $0, 0;")
    _SYNC = gl.constexpr("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; "
                         "mov.u32 $0, 0;")
    # the arrivals take the default semantics (release, CTA scope), as CUTLASS's cluster barriers do: with
    # .release.cluster ptxas put MEMBAR.ALL.GPU before each one, and the probe's copies ran at half the rate
    _REMOTE_ARRIVE = gl.constexpr(_ONE + "setp.ne.and.u32 pl, $4, 0, pl; mapa.shared::cluster.u32 far, $2, $3; "
                                  "@pl mbarrier.arrive.shared::cluster.b64 _, [far];" + _END)

    @gluon.jit
    def smem_base():
        """The shared address of global_smem (int32), from which the allocator's byte offsets count."""
        return gl.inline_asm_elementwise(_BASE, "=r,r", [gl.program_id(0) * 0], dtype=gl.int32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def fence_mbarrier_init(x):
        """Make this CTA's mbarrier initializations visible to the other CTA of the cluster (before a cluster_sync
        after which it arrives on them or copies into their shared memory). x: any int32 (unused)."""
        gl.inline_asm_elementwise(_FENCE_INIT, "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def cluster_sync(x):
        """Every thread of both CTAs waits here for every other (barrier.cluster). Call it in every partition of a
        warp-specialized kernel, the same number of times: its worker warps never run the code around
        gl.warp_specialize, and a warp that never arrives would hang the cluster. x: any int32 (unused)."""
        gl.inline_asm_elementwise(_SYNC, "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def lanes():
        """-> [32 * warps] int32: each thread of the partition its own lane (0 .. 32 * warps - 1), the operand by
        which the asm below acts in the first thread only."""
        W: gl.constexpr = gl.num_warps()
        return gl.arange(0, 32 * W, layout=gl.BlockedLayout([1], [32], [W], [0]))

    @gluon.jit
    def remote_arrive(bar, peer, pred):
        """One arrival on the mbarrier at shared address ``bar`` in CTA ``peer`` of the cluster (the same offset as
        this CTA's), where pred (int32 or bool) holds."""
        gl.inline_asm_elementwise(_REMOTE_ARRIVE, "=r,r,r,r,r", [lanes(), bar, peer,
                                                                  gl.to_tensor(pred).to(gl.int32)],
                                  dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def multicast_copy(ASM: gl.constexpr, bar, dst, k, row, pred):
        """The [rows, K] box at (row, k) of the tensor map ASM names (multicast_asm) into shared address dst of
        both CTAs, completing on the mbarrier at ``bar`` in each, where pred holds."""
        gl.inline_asm_elementwise(ASM, "=r,r,r,r,r,r,r", [lanes(), bar, dst, k, row,
                                                          gl.to_tensor(pred).to(gl.int32)],
                                  dtype=gl.int32, is_pure=False, pack=1)


def launch_as_pairs(compiled) -> None:
    """Make the compiled kernel's launches two-CTA clusters: Triton's launcher then multiplies the grid's x by 2
    and sets the cluster dimension (its num_ctas path). Do it before the first launch: a kernel that waits on the
    other CTA of its cluster would wait forever without one."""
    nw, _, shared = compiled.packed_metadata
    compiled.packed_metadata = (nw, 2, shared)
