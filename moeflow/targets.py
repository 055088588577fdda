"""The NVIDIA GPU architectures moeflow's Triton kernels are built for, as data: what each has and how it was checked.

Each Target says what the kernel choice may use there (FP8 tensor cores, TMA, programmatic dependent launch, Hopper's
Gluon kernels), the shared memory a program may take and the part of it tiles may plan for, and its grade:
"validated" (the GPU suite and `moeflow selftest` ran on it) or "compiled" (CI compiles every kernel and tile the
planner can pick for it and checks its shared memory and registers; never run). The planner refuses a GPU that is no
Target (MF210); MOEFLOW_KERNEL_ARCH makes the kernel choice act as another target's (tests, benchmarks).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from . import env as moeflow_env

VALIDATED = "validated"
COMPILED = "compiled"


@dataclass(frozen=True)
class Target:
    arch: str  # "sm_80"
    capability: tuple[int, int]
    family: str  # "Ampere"
    gpus: str  # examples, for the docs and messages
    shared_bytes: int  # the most shared memory one program may take (the opt-in maximum)
    tile_budget: int  # the shared memory a GEMM tile's stages may plan for (the rest: epilogue scratch)
    fp8_dots: bool  # FP8 tensor cores: FP8 schemes dot FP8 operands; else weight-only FP8 (weights decoded in-loop)
    tma: bool  # tensor-memory-accelerator loads (Triton tensor descriptors)
    pdl: bool  # programmatic dependent launch (griddepcontrol)
    gluon: bool  # Hopper's Gluon kernels (wgmma, warp-specialized)
    grade: str  # VALIDATED | COMPILED
    # an MMA accumulator reduced to one value in an epilogue (the fp8-tensor gate_up's amax); False on sm_100, where
    # Triton 3.6 fails to compile that for a tcgen05 accumulator (OptimizeTMemLayouts; found by the compile matrix):
    # there each row's amax goes to the one address by its own atomic
    tile_to_scalar: bool = True

    @property
    def validated(self) -> bool:
        return self.grade == VALIDATED

    @property
    def sm(self) -> int:
        """The target as Triton's GPUTarget names it: 80, 86, ..."""
        return self.capability[0] * 10 + self.capability[1]


_KB = 1024
TARGETS = (
    Target("sm_80", (8, 0), "Ampere", "A100, A30", 163 * _KB, 140 * _KB, False, False, False, False, COMPILED),
    Target("sm_86", (8, 6), "Ampere", "A10, A40, RTX 3090", 99 * _KB, 80 * _KB, False, False, False, False, COMPILED),
    Target("sm_89", (8, 9), "Ada", "L4, L40S, RTX 4090", 99 * _KB, 80 * _KB, True, False, False, False, COMPILED),
    Target("sm_90", (9, 0), "Hopper", "H100, H200, H20", 227 * _KB, 200 * _KB, True, True, True, True, VALIDATED),
    Target("sm_100", (10, 0), "Blackwell", "B200, GB200", 227 * _KB, 200 * _KB, True, True, True, False, COMPILED,
           tile_to_scalar=False),
    Target("sm_120", (12, 0), "Blackwell", "RTX 5090, RTX PRO 6000", 99 * _KB, 80 * _KB, True, True, True, False,
           COMPILED),
)
BY_ARCH = {t.arch: t for t in TARGETS}

# Triton's CPU interpreter (tests): tensor descriptors (TMA's code paths) and FP8 dots computed in software; no PDL, no
# Gluon; Hopper's tile budget
INTERPRETER = Target("interpreter", (0, 0), "CPU", "Triton's interpreter", 227 * _KB, 200 * _KB, True, True, False,
                     False, VALIDATED)


def target_of(capability: tuple[int, int] | None) -> Target | None:
    """The Target of a CUDA compute capability, or None where the kernels are not built for it."""
    return next((t for t in TARGETS if t.capability == tuple(capability or ())), None)


def arch_name(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def rules_for(capability: tuple[int, int]) -> Target | None:
    """The Target whose rules a GPU of ``capability`` follows: its own; for a GPU that is none, the nearest (nearest())
    only with MOEFLOW_ALLOW_UNVALIDATED_GPU=1, else None (no moeflow kernel runs there)."""
    return target_of(capability) or (nearest(capability) if moeflow_env.ALLOW_UNVALIDATED_GPU.get_bool() else None)


def kernel_target(device) -> Target:
    """The target whose rules the kernel choice follows for ``device`` (a torch.device): MOEFLOW_KERNEL_ARCH's when
    set (a GPU then runs another target's kernels and tiles: the portable or weight-only paths on a Hopper GPU), else
    the device's own (nearest: a GPU that is no Target); the interpreter's on a CPU."""
    forced = moeflow_env.KERNEL_ARCH.get_choice()
    if forced:
        return BY_ARCH[forced]
    if device.type != "cuda":
        return INTERPRETER
    return _device_target(device.index if device.index is not None else _current())


def _current() -> int:
    import torch
    return torch.cuda.current_device()


@lru_cache(maxsize=None)
def _device_target(index: int) -> Target:
    import torch
    return nearest(tuple(torch.cuda.get_device_capability(index)))


def nearest(capability: tuple[int, int]) -> Target:
    """The Target of ``capability``, or for a GPU that is none (built only with MOEFLOW_ALLOW_UNVALIDATED_GPU=1) the
    nearest older target (of its major version first), else sm_80: whose rules its kernels follow."""
    known = target_of(capability)
    if known is not None:
        return known
    older = [t for t in TARGETS if t.capability <= tuple(capability)]
    same = [t for t in older if t.capability[0] == capability[0]]
    return (same or older or [TARGETS[0]])[-1]
