"""Every environment variable moeflow reads, declared once, typed, with its default.

Read them through the functions below (evaluated at call time, so tests can monkeypatch os.environ).
Inside ``with env.one_reading():`` (a layer's eager call) each variable is read from os.environ once and its value
kept until the outermost block ends, since a call reads its switches many times over.
``moeflow env`` prints the table.
"""
from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass

_HELD = threading.local()  # .values: {name: raw value} inside one_reading(), .depth: its nesting


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    help: str
    kind: str = "switch"  # how it is read: "switch" (get_bool), "seconds" (get_positive), "count" (get_count), "text",
    # "choice" (get_choice: one of ``choices``, or empty)
    choices: tuple[str, ...] = ()

    def get(self) -> str:
        held = getattr(_HELD, "values", None)
        if held is None:
            return os.environ.get(self.name, self.default)
        value = held.get(self.name)
        if value is None:
            value = held[self.name] = os.environ.get(self.name, self.default)
        return value

    def get_bool(self) -> bool:
        """1 / true / yes / on -> True; 0 / false / no / off / empty -> False. Anything else: MF107 for moeflow's
        own variables; False for another program's (TRITON_INTERPRET: read as Triton reads it)."""
        raw = self.get().strip().lower()
        if raw in _TRUE:
            return True
        if raw in _FALSE or not self.name.startswith("MOEFLOW_"):
            return False
        raise _invalid(self, "expected 1 or 0 (also true / false, yes / no, on / off)")

    def get_positive(self) -> float:
        """The value as a finite number > 0 (MF107 otherwise: not a number, 0, negative, nan, inf)."""
        try:
            value = float(self.get())
        except ValueError:
            raise _invalid(self, "expected a number") from None
        if not math.isfinite(value) or value <= 0:
            raise _invalid(self, "expected a finite number > 0")
        return value

    def get_count(self) -> int:
        """The value as a whole number >= 0 (MF107 otherwise)."""
        raw = self.get().strip()
        if not (raw.isascii() and raw.isdigit()):
            raise _invalid(self, "expected a whole number >= 0")
        return int(raw)

    def get_choice(self) -> str:
        """The value as one of ``choices``, or "" (unset); MF107 otherwise."""
        raw = self.get().strip()
        if raw and raw not in self.choices:
            raise _invalid(self, f"expected one of {', '.join(self.choices)}, or empty")
        return raw

    def read(self):
        """The value as its kind reads it (MF107 where it cannot be: `moeflow env` checks every variable so)."""
        return {"switch": self.get_bool, "seconds": self.get_positive, "count": self.get_count,
                "text": self.get, "choice": self.get_choice}[self.kind]()


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _invalid(var: EnvVar, why: str):
    from .errors import error  # errors imports nothing of moeflow's; deferred all the same, env is imported first
    return error("MF107", name=var.name, value=var.get(), why=why)


class one_reading:
    """Context manager: within it (on this thread) each variable is read once, its first value kept until the
    outermost block exits. Reentrant. For one layer call, whose path reads the same switches many times; a
    variable changed inside the block is seen after it."""

    def __enter__(self):
        depth = getattr(_HELD, "depth", 0)
        if depth == 0:
            _HELD.values = {}
        _HELD.depth = depth + 1
        return self

    def __exit__(self, *exc):
        _HELD.depth -= 1
        if _HELD.depth == 0:
            _HELD.values = None
        return False


VALIDATE_INPUTS = EnvVar(
    "MOEFLOW_VALIDATE_INPUTS", "1",
    "Check forward inputs (shapes, dtypes, devices, expert-id range). The id-range check reads the "
    "ids on the host; set 0 to skip it in latency-critical eager loops. Always skipped under CUDA-graph capture.")
KERNEL_CONFIG_DIR = EnvVar(
    "MOEFLOW_KERNEL_CONFIG_DIR", "",
    "Directory searched before the shipped tuned kernel configs (JSON files written by `moeflow tune`).", "text")
DIST_TIMEOUT_S = EnvVar(
    "MOEFLOW_DIST_TIMEOUT_S", "300",
    "Seconds an expert-parallel collective may take before it is reported as a stopped rank (MF502).", "seconds")
LOCAL_RANK = EnvVar(
    "LOCAL_RANK", "0",
    "torchrun's own: this process's GPU index on its node (init_distributed picks cuda:LOCAL_RANK).", "count")
TRITON_TMA = EnvVar(
    "MOEFLOW_TRITON_TMA", "1",
    "Triton runner: load weight tiles through TMA tensor descriptors where the weight allows it "
    "(16-byte aligned rows). Set 0 to force plain pointer loads (debugging, comparisons).")
TRITON_PDL = EnvVar(
    "MOEFLOW_TRITON_PDL", "1",
    "Triton runner on compute capability >= 9.0: programmatic dependent launch. The layer's short kernels "
    "(routing, sort, quantization, top-k sum) are launched while the kernel before finishes and wait on "
    "griddepcontrol.wait before touching memory, which hides launch gaps at small batches; the GEMMs are "
    "launched plainly. Set 0 for plain launches everywhere.")
TRITON_FUSED = EnvVar(
    "MOEFLOW_TRITON_FUSED", "1",
    "Triton runner, single-process layers: run a small batch's dispatch, experts and combine in one launch where "
    "the tuned table (or the T=1 default, none and fp8-block) gives tiles for it (kernels/gemm/fused_layer.py). Set 0 "
    "for the separate launches (sort, gate_up, down, top-k sum) at every batch size (comparisons, debugging).")
TRITON_PAIR_TILES = EnvVar(
    "MOEFLOW_TRITON_PAIR_TILES", "1",
    "Triton runner, the Gluon fp8-block gate_up at 128-row tiles: a row block of at most 64 rows (an expert's "
    "part-filled last one) runs as one program over two column tiles instead of two programs over half-empty "
    "tiles (kernels/gemm/gate_up_wgmma.py). Set 0 to run every block as a 128-row tile (comparisons, debugging).")
EAGER_GRAPHS = EnvVar(
    "MOEFLOW_EAGER_GRAPHS", "16",
    "Largest batch (tokens) whose eager layer call is replayed from a CUDA graph captured for its shape "
    "(moeflow.graphs: one replay instead of the call's launches one by one, which cost the host more than the GPU at "
    "decode sizes). CUDA layers whose plan is graph-safe, outside any capture and torch.compile. 0 turns it off.",
    "count")
EAGER_BUCKETS = EnvVar(
    "MOEFLOW_EAGER_BUCKETS", "2048",
    "Largest batch (tokens) whose eager call past MOEFLOW_EAGER_GRAPHS is padded to a bucket (the next power of "
    "two, at most this) and replayed from a graph captured for the bucket: its padding tokens route to no expert "
    "(moeflow.graph_buckets). For eager prefill, whose launches cost the host more than the GPU up to a few thousand "
    "tokens. Same layers as MOEFLOW_EAGER_GRAPHS (0 there turns these off too), single-process. 0 turns it off.",
    "count")
ALLOW_UNVALIDATED_GPU = EnvVar(
    "MOEFLOW_ALLOW_UNVALIDATED_GPU", "0",
    "Set 1 to let the planner build runners and routers on a GPU whose architecture their kernels are not built for "
    "(their declared archs, moeflow.targets: the Triton backends sm_80 to sm_120, grouped_mm sm_90), and the "
    "dispatchers' Triton kernels run there, following the nearest target's rules. Untested there: MF210 otherwise, "
    "or their torch code.")
KERNEL_ARCH = EnvVar(
    "MOEFLOW_KERNEL_ARCH", "",
    "Make the Triton runner's kernel choice follow another GPU architecture's rules (sm_80, sm_86, sm_89, sm_90, "
    "sm_100, sm_120: moeflow.targets): its features (FP8 dots or weight-only FP8, TMA, PDL, the Hopper Gluon "
    "kernels), its shared-memory budget and its default tiles. On an H100 / H200, sm_80 runs the portable kernels "
    "and weight-only FP8 (with Triton's DISABLE_MMA_V3=1, as mma.sync: the Ampere instruction). Tests, benchmarks.",
    "choice", ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"))  # moeflow.targets' (tests/test_env.py checks)
BATCH_INVARIANT = EnvVar(
    "MOEFLOW_BATCH_INVARIANT", "0",
    "transformers integration: plan the layers it builds batch-invariant (MoEConfig.batch_invariant: a token's output "
    "the same bits whatever batch it came in; docs/batch-invariance.md), for experts_implementation=\"moeflow\" and "
    "block replacement alike; replace_moe_blocks(batch_invariant=...) overrides it.")
TRITON_INTERPRET = EnvVar(
    "TRITON_INTERPRET", "0",
    "Triton's own switch: run Triton kernels in its CPU interpreter (tests only; slow; no bf16).")

ALL = (VALIDATE_INPUTS, ALLOW_UNVALIDATED_GPU, KERNEL_CONFIG_DIR, DIST_TIMEOUT_S, LOCAL_RANK, TRITON_TMA,
       TRITON_PDL, TRITON_FUSED, TRITON_PAIR_TILES, EAGER_GRAPHS, EAGER_BUCKETS, KERNEL_ARCH, BATCH_INVARIANT,
       TRITON_INTERPRET)
# the switches a layer's forward path reads on every call: a graph captured under one setting replays that setting's
# launches, so moeflow.graphs keys its graphs by their values
PATH_SWITCHES = (TRITON_TMA, TRITON_PDL, TRITON_FUSED, TRITON_PAIR_TILES, KERNEL_ARCH)
