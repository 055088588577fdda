"""Capabilities as data: what each backend declares, and the environment it is checked against.

A backend never decides whether it can run; it *declares* rows of :class:`Support` (and a few
other facts) and the planner (``moeflow.planner``) checks a configuration against them. The same
declarations print as the capability matrix (``moeflow matrix``).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from . import env as moeflow_env
from .targets import BY_ARCH, TARGETS, rules_for

ALL_FLOAT = frozenset({torch.bfloat16, torch.float16, torch.float32})


@dataclass(frozen=True)
class Support:
    """One row of what a runner can do: on ``device`` it runs ``schemes`` for layer ``dtypes``
    on GPUs of compute capability >= ``min_cc`` whose architecture is one of ``archs`` (moeflow.targets names:
    the GPUs its kernels are built for; None: any; both ignored off CUDA), when hidden_size and intermediate_size are
    multiples of ``align`` elements."""

    device: str  # "cpu" | "cuda"
    schemes: frozenset[str]
    dtypes: frozenset[torch.dtype] = ALL_FLOAT
    min_cc: tuple[int, int] = (0, 0)
    align: int = 1
    archs: frozenset[str] | None = None


@dataclass(frozen=True)
class Slower:
    """A measured rule "auto" ranks runners by (RunnerCaps.slower): on ``device``, for layer ``dtypes``, this runner
    was measured ``factor`` slower than runner ``than`` (``at``: where) on a CPU with none of the ISA features
    ``fast_with`` (names of ``torch.cpu.get_capabilities()``); there "auto" picks ``than`` when it is valid. Applied
    only where the environment knows its CPU features (Environment.cpu_features: a detected machine, not a
    hypothetical one such as the matrix's)."""

    device: str  # "cpu"
    dtypes: frozenset[torch.dtype]
    fast_with: frozenset[str]  # any of these ISA features and the rule does not apply
    than: str  # the runner it is slower than
    lacking: str  # the missing features, as the plan's reason names them
    factor: str  # the measurement, as the plan's reason quotes it: "2.2-6.8x"
    at: str  # where it was measured: "from 128 tokens on, AVX2 CPU"

    def applies(self, dtype: torch.dtype, env: Environment) -> bool:
        return (env.device_type == self.device and dtype in self.dtypes and env.cpu_features is not None
                and not self.fast_with & env.cpu_features)


@dataclass(frozen=True)
class ShapeRule:
    """``field`` of the configuration must be a multiple of ``multiple``."""

    field: str
    multiple: int


@dataclass(frozen=True)
class RunnerCaps:
    layouts: tuple[str, ...]  # layouts consumed natively, preferred first
    support: tuple[Support, ...]
    requires: tuple[str, ...] = ()  # importable packages needed
    priority: int = 0  # "auto" picks the valid runner of highest priority
    note: str = ""
    indexed_rows: bool = False  # reads sorted rows through ExpertBatch.source_rows itself (no gathered copy)
    # schemes for which it can run a single-process layer's dispatch, experts and combine together (one launch
    # for small batches: ExpertRunner.fused_config / run_fused), where the dispatcher declares ``fusable``
    fused_layer: frozenset[str] = frozenset()
    # its run never synchronizes with the host and keeps no data-dependent shapes: a call can be captured in a CUDA
    # graph and replayed on new inputs of the same shapes (what moeflow.graphs needs of every stage)
    graph_safe: bool = False
    # measured rules by which "auto" prefers another valid runner (Slower): data, checked by the planner
    slower: tuple[Slower, ...] = ()
    # with MoEConfig.batch_invariant it computes each row from that row alone, in an order fixed for every batch size
    # (one tile and kernel for all T, no split K, no atomics in sums): docs/batch-invariance.md
    batch_invariant: bool = False

    @property
    def devices(self) -> frozenset[str]:
        """The device types of its Support rows (as DispatcherCaps.devices and RouterCaps.devices declare theirs)."""
        return frozenset(s.device for s in self.support)


@dataclass(frozen=True)
class DispatcherCaps:
    layout: str  # layout the dispatcher hands to runners
    devices: frozenset[str]
    distributed: bool  # True: needs an expert-parallel group of size > 1; False: size 1 only
    requires: tuple[str, ...] = ()
    priority: int = 0
    note: str = ""
    indexed_rows: bool = False  # can hand sorted rows by index (ExpertBatch.source_rows) when asked
    # its dispatch and combine are local bookkeeping only (one process, no transfer): a runner declaring the
    # scheme in ``RunnerCaps.fused_layer`` may do them inside its own launch
    fusable: bool = False
    # dispatch and combine can be captured in a CUDA graph and replayed by this process alone (RunnerCaps.graph_safe;
    # an expert-parallel exchange needs every rank to replay in step, so none declares it)
    graph_safe: bool = False
    # ``dropping(valid)`` gives it for calls whose topk_ids may hold -1, a copy routed to no expert, or whose rows from
    # valid[0] on are padding (moeflow.graph_buckets' bucketed calls): its batches are then padded
    # (ExpertBatch.padded), and such a copy adds zero
    drops_copies: bool = False
    # a token's copies are combined in a fixed order whatever the batch (no atomics in the sums): MoEConfig.batch_invariant
    batch_invariant: bool = False


@dataclass(frozen=True)
class RouterCaps:
    devices: frozenset[str]
    requires: tuple[str, ...] = ()
    priority: int = 0  # the plan picks the valid router of highest priority
    max_experts: int | None = None  # the most experts it routes over (None: any)
    grouped_pow2: bool = False  # grouped selection needs a power-of-two expert count
    note: str = ""
    graph_safe: bool = False  # as RunnerCaps.graph_safe
    # the GPU architectures its kernels are built for (moeflow.targets names; None: any); on others only with
    # MOEFLOW_ALLOW_UNVALIDATED_GPU=1 (MF210), as a runner's Support rows' archs
    archs: frozenset[str] | None = None
    # with MoEConfig.batch_invariant it routes each token from its own logits alone, ties broken by expert index, with
    # one launch shape for every batch size
    batch_invariant: bool = False


@dataclass(frozen=True)
class SchemeCaps:
    shape_rules: tuple[ShapeRule, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class Environment:
    """What the planner checks against: device type, CUDA compute capability, EP world size and
    which optional packages import. ``Environment.detect`` reads the real machine; the matrix
    command also builds hypothetical ones (e.g. cuda 9.0 on a CPU-only machine)."""

    device_type: str
    capability: tuple[int, int] | None = None
    world_size: int = 1
    unavailable: frozenset[str] = field(default_factory=frozenset)  # packages forced missing (tests)
    # on a detected CPU, its ISA features (cpu_features()); None: unknown (a hypothetical environment)
    cpu_features: frozenset[str] | None = None
    # the GPU's own capability where MOEFLOW_KERNEL_ARCH made ``capability`` another architecture's, else None
    actual: tuple[int, int] | None = None
    # an AMD GPU under ROCm (torch calls it "cuda"): its architecture, "gfx942"; None for NVIDIA GPUs and CPUs
    rocm: str | None = None

    @classmethod
    def detect(cls, device: torch.device, world_size: int = 1) -> "Environment":
        """The machine of ``device``; on CUDA with MOEFLOW_KERNEL_ARCH set, planned as that architecture (its
        capability; ``actual`` keeps the GPU's own), as the kernels then choose (moeflow.targets.kernel_target)."""
        cc = actual = tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None
        forced = moeflow_env.KERNEL_ARCH.get_choice() if device.type == "cuda" else ""
        if forced:
            cc = BY_ARCH[forced].capability
        rocm = None
        if device.type == "cuda" and torch.version.hip:
            rocm = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
        return cls(device.type, cc, world_size, cpu_features=cpu_features() if device.type == "cpu" else None,
                   actual=actual if forced else None, rocm=rocm)

    def describe(self) -> str:
        cc = f" sm_{self.capability[0]}{self.capability[1]}" if self.capability else ""
        if self.actual is not None:
            cc += f" (MOEFLOW_KERNEL_ARCH, on an sm_{self.actual[0]}{self.actual[1]} GPU)"
        if self.rocm:
            cc = f" {self.rocm} (ROCm)"
        if self.cpu_features is not None:
            shown = [f for f in _SHOWN_CPU_FEATURES if f in self.cpu_features]
            cc = f" ({', '.join(shown) or 'no AVX2'})"
        return f"{self.device_type}{cc}, world size {self.world_size}"

    def package_error(self, package: str) -> str | None:
        """None when ``package`` imports here, else the reason it does not."""
        if package in self.unavailable:
            return "marked unavailable"
        return _import_error(package)


# the CPU features that decide how fast matrix products of each dtype run (Environment.describe names those present)
_SHOWN_CPU_FEATURES = ("avx2", "avx512_f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "neon", "bf16", "sve",
                       "sve_bf16", "fp16_arith")


def cpu_features() -> frozenset[str]:
    """This CPU's ISA features, as torch names them (``torch.cpu.get_capabilities()``: "avx2", "avx512_bf16",
    "amx_bf16", ...; on ARM "bf16", "sve_bf16", ...): the query Environment.detect makes (tests replace it)."""
    return _detected_cpu_features()


@lru_cache(maxsize=None)
def _detected_cpu_features() -> frozenset[str]:
    query = getattr(torch.cpu, "get_capabilities", None)
    if query is not None:
        return frozenset(k for k, v in query().items() if v is True)
    found = {"avx2": "_is_avx2_supported", "avx512_f": "_is_avx512_supported",  # an older torch
             "avx512_bf16": "_is_avx512_bf16_supported", "amx_bf16": "_is_amx_tile_supported",
             "amx_fp16": "_is_amx_fp16_supported"}
    return frozenset(k for k, fn in found.items() if getattr(torch.cpu, fn, lambda: False)())


@lru_cache(maxsize=None)
def _import_error(package: str) -> str | None:
    try:
        importlib.import_module(package)
    except Exception as exc:  # ImportError, or a broken install raising anything
        return f"{type(exc).__name__}: {exc}"
    return None


# every GPU architecture moeflow's Triton kernels are built for (moeflow.targets): the runners' and routers' archs
TRITON_ARCHS = frozenset(t.arch for t in TARGETS)


def triton_glue(t: torch.Tensor, fp8: bool = False) -> bool:
    """Whether the Triton kernels around the runner run for ``t``: the local dispatcher's sort (with the tokens'
    quantization) and the top-k sum, the expert-parallel dispatchers' row packing and quantization. On CUDA, on a GPU
    the kernels are built for (moeflow.targets; any with MOEFLOW_ALLOW_UNVALIDATED_GPU=1); ``fp8``: a kernel that
    writes FP8, which needs a target with FP8 support (sm_89 on). Elsewhere their torch code runs (the same results:
    each kernel's torch reference); never on an AMD GPU (MF211)."""
    if not t.is_cuda or torch.version.hip:  # no kernel is built for AMD GPUs (MF211)
        return False
    have = _capability(t.device.index if t.device.index is not None else torch.cuda.current_device())
    forced = moeflow_env.KERNEL_ARCH.get_choice()
    target = BY_ARCH[forced] if forced else rules_for(have)  # whose rules the kernels follow (targets.kernel_target)
    return target is not None and (target.fp8_dots or not fp8)


@lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))
