"""MoEConfig: the frozen, validated description of one MoE layer.

Shape legend used across moeflow: T tokens on this rank, H hidden_size, I intermediate_size of one
routed expert, E num_experts, K top_k, E_local experts on this rank, W expert-parallel ranks.
"""
from __future__ import annotations

import math
import numbers
import operator
from dataclasses import asdict, dataclass, field, replace

import torch

from .balance.placement import Placement
from .errors import error
from .registry import device_types

SCORINGS = ("softmax", "sigmoid")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
QUANT_SCHEMES = ("none", "fp8-tensor", "fp8-channel", "fp8-block")
# expert-parallel token payload (dispatch/_ep_base.py): "auto" = FP8 when the scheme quantizes each
# row on its own (fp8-channel, fp8-block), "fp8" = always (MF506 where impossible), "dtype" = never.
# The local dispatcher reads "dtype" only: it keeps its batches in the layer dtype instead of
# quantizing the tokens in its Triton sorts (dispatch/local.py); FP8 for quant="none" (lossy) it never does.
PAYLOADS = ("auto", "fp8", "dtype")


def parse_dtype(value) -> torch.dtype:
    """Accept a torch.dtype or its name ("bfloat16", "bf16", "fp16", ...)."""
    if isinstance(value, torch.dtype):
        if value in DTYPES.values():
            return value
        raise error("MF104", value=value, valid=list(DTYPES))
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    name = aliases.get(str(value), str(value)).removeprefix("torch.")
    if name not in DTYPES:
        raise error("MF104", value=value, valid=list(DTYPES))
    return DTYPES[name]


SWITCHES = ("renormalize", "use_correction_bias", "shared_expert_gate", "batch_invariant", "record_expert_load")


def _placement(value, num_experts) -> tuple[int, ...] | Placement:
    """An expert -> rank placement as a tuple of num_experts non-negative ints (which ranks exist is the
    dispatcher's check: dispatch/_ep_base.expert_placement); else MF504. A Placement (replicas) is kept as it is
    (MoEConfig._check_slots)."""
    if isinstance(value, Placement):
        return value
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise error("MF504", why=f"is {value!r}: it must be a sequence of ranks, one per expert")
    ranks = []
    for r in value:
        try:
            ranks.append(operator.index(r))  # ints (numpy's too); 0.5 or "1" are not ranks
        except TypeError:
            raise error("MF504", why=f"has the entry {r!r}: ranks are integers") from None
    if len(ranks) != num_experts:
        raise error("MF504", why=f"has {len(ranks)} entries; it needs one per expert (num_experts={num_experts})")
    if min(ranks, default=0) < 0:
        raise error("MF504", why=f"names rank {min(ranks)}; ranks are >= 0")
    return tuple(ranks)


def device_named(value) -> torch.device:
    """The device ``value`` names, as torch parses it (MF106 where it cannot); whether this machine has it is
    parse_device's question."""
    try:
        return torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise error("MF106", value=value, why=str(exc)) from None


def parse_device(value) -> torch.device:
    """The layer's device: MF106 where torch cannot parse ``value``, for the meta device (also torch's default
    device inside ``with torch.device("meta")``, where a layer built without device= lands), for a device type no
    router, dispatcher and runner all declare, and for a GPU this machine does not have."""
    dev = device_named(value)
    if dev.type == "cpu":
        return torch.device("cpu")  # "cpu:0": torch's CPU tensors carry no index, so the layer's device must not
    if dev.type == "meta":
        raise error("MF106", value=str(dev), why=(
            "the meta device is not supported: a moeflow layer needs a device that holds data (a meta tensor has a "
            "shape only). Pass device= explicitly (device=\"cuda\" or device=\"cpu\"), also inside "
            "`with torch.device(\"meta\")`, whose default device a layer built without device= takes"))
    if dev.type != "cuda":
        valid = device_types()
        if dev.type not in valid:
            raise error("MF106", value=str(dev), why=(
                f"moeflow does not run on device type {dev.type!r}: its routers, dispatchers and runners run on "
                f"{valid}; pass device= one of them"))
        return dev
    if not torch.cuda.is_available():
        raise error("MF106", value=value, why="CUDA is not available on this machine")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise error("MF106", value=value, why=f"this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return dev


# the integer fields (numpy integers are read as Python ints)
INT_FIELDS = ("num_experts", "hidden_size", "intermediate_size", "top_k", "max_tokens_per_rank", "num_expert_groups",
              "topk_groups", "num_shared_experts", "shared_intermediate_size", "num_redundant_experts")


@dataclass(frozen=True)
class MoEConfig:
    """Everything that defines a layer. Frozen: build a new one with ``dataclasses.replace``.

    Routing: ``scoring`` "softmax" (Mixtral, Qwen) or "sigmoid" (DeepSeek-V3); ``renormalize``
    divides the K selected weights by their sum; grouped top-k keeps the ``topk_groups`` best of
    ``num_expert_groups`` groups (a group's score is the sum of its two best biased scores when a
    correction bias is used, else its best score) before the top-K; ``use_correction_bias`` adds
    ``e_score_correction_bias [E]`` for *selection only*; ``routed_scaling_factor`` multiplies the
    final weights. Shared experts: one gated MLP of intermediate size
    ``num_shared_experts * shared_intermediate_size`` applied to every token and added; with
    ``shared_expert_gate`` its output is scaled by sigmoid(x @ w_gate) (Qwen2-MoE).
    """

    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    scoring: str = "softmax"
    renormalize: bool = True
    num_expert_groups: int = 1
    topk_groups: int = 1
    use_correction_bias: bool = False
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    activation: str = "silu"
    quant: str = "none"
    runner: str = "auto"
    dispatcher: str = "auto"
    dtype: torch.dtype = torch.bfloat16
    device: torch.device = field(default_factory=torch.get_default_device)  # omitted: torch's, as nn.Linear's
    placement: tuple[int, ...] | Placement | None = None  # expert e on rank placement[e]; None = contiguous blocks
    # expert-parallel load balancing (moeflow.balance, docs/load-balancing.md): physical expert slots beyond the
    # E logical experts, holding replicas (placement: a Placement of E + num_redundant_experts slots, or None);
    # and the per-expert token counter of layer.expert_load()
    num_redundant_experts: int = 0
    record_expert_load: bool = False
    max_tokens_per_rank: int = 256  # tokens per rank of fixed-size dispatch buffers (lowlatency, alltoall-fixed)
    dispatch_payload: str = "auto"  # expert parallelism: how tokens travel (PAYLOADS)
    # a token's output the same bits whatever batch it came in (alone, among 4,096, at any position), call after call:
    # the planner keeps only backends that declare it and they compute each token in a fixed order (docs/batch-invariance.md)
    batch_invariant: bool = False

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "dtype", parse_dtype(self.dtype))
        set_(self, "device", parse_device(self.device))
        for name in INT_FIELDS:  # numpy's integers too, as Python ints (a bool or a str stays, refused below)
            v = getattr(self, name)
            if not isinstance(v, bool) and hasattr(type(v), "__index__"):
                set_(self, name, operator.index(v))
        f = self.routed_scaling_factor
        if isinstance(f, numbers.Real) and not isinstance(f, bool):
            set_(self, "routed_scaling_factor", float(f))
        for name in SWITCHES:
            v = getattr(self, name)
            if isinstance(v, (str, bytes)) or v not in (True, False):  # a bool (or numpy's, or 0 / 1), not "no"
                raise error("MF102", field=name, value=v, valid=[True, False])
            set_(self, name, bool(v))
        if self.placement is not None:
            set_(self, "placement", _placement(self.placement, self.num_experts))
        for name in ("num_experts", "hidden_size", "intermediate_size", "top_k", "max_tokens_per_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise error("MF101", field=name, value=v, why="must be a positive integer")
        if self.top_k > self.num_experts:
            raise error("MF101", field="top_k", value=self.top_k,
                        why=f"cannot select more experts than num_experts={self.num_experts}")
        for name in ("num_shared_experts", "shared_intermediate_size", "num_redundant_experts"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise error("MF101", field=name, value=v, why="must be a non-negative integer")
        if (self.num_shared_experts > 0) != (self.shared_intermediate_size > 0):
            raise error("MF101", field="shared_intermediate_size", value=self.shared_intermediate_size,
                        why="num_shared_experts and shared_intermediate_size must be both zero or both positive")
        if self.shared_expert_gate and self.num_shared_experts == 0:
            raise error("MF101", field="shared_expert_gate", value=True, why="needs num_shared_experts > 0")
        for name, valid in (("scoring", SCORINGS), ("activation", ACTIVATIONS), ("quant", QUANT_SCHEMES),
                            ("dispatch_payload", PAYLOADS)):
            if getattr(self, name) not in valid:
                raise error("MF102", field=name, value=getattr(self, name), valid=list(valid))
        self._check_groups()
        self._check_slots()
        f = self.routed_scaling_factor
        if not isinstance(f, float) or not math.isfinite(f) or f <= 0:
            raise error("MF105", field="routed_scaling_factor", value=f, why="must be a finite number > 0")
        if self.use_correction_bias and self.scoring != "sigmoid":
            raise error("MF105", field="use_correction_bias", value=True,
                        why="the correction bias is defined for sigmoid scoring (DeepSeek-V3)")

    def _check_slots(self):
        """A Placement must fit E + num_redundant_experts slots (its ranks: the dispatcher's check); an expert -> rank
        list has no room for replicas (MF510)."""
        slots = self.num_experts + self.num_redundant_experts
        if isinstance(self.placement, Placement):
            self.placement.check(self.num_experts, slots)
        elif self.placement is not None and self.num_redundant_experts:
            raise error("MF510", why=f"is an expert -> rank list, with no room for num_redundant_experts="
                                     f"{self.num_redundant_experts} replicas: pass a moeflow.balance.Placement of "
                                     f"{slots} slots, or placement=None")

    def _check_groups(self):
        g, tg, e = self.num_expert_groups, self.topk_groups, self.num_experts
        bad = None
        if not isinstance(g, int) or isinstance(g, bool) or g <= 0 or e % g:
            bad = f"num_experts={e} must be divisible by num_expert_groups"
        elif not isinstance(tg, int) or isinstance(tg, bool):
            bad = "topk_groups must be an integer"
        elif not 1 <= tg <= g:
            bad = "need 1 <= topk_groups <= num_expert_groups"
        elif g > 1 and tg * (e // g) < self.top_k:
            bad = f"the {tg} kept groups hold {tg * (e // g)} experts, fewer than top_k={self.top_k}"
        elif g > 1 and self.use_correction_bias and e // g < 2:
            bad = "groups need at least 2 experts to rank by the sum of their best two"
        if bad:
            raise error("MF103", groups=g, topk_groups=tg, why=bad)

    # ---------------------------------------------------------------- derived values
    @property
    def grouped(self) -> bool:
        return self.num_expert_groups > 1

    @property
    def shared_size(self) -> int:
        """Intermediate size of the (merged) shared-expert MLP; 0 without shared experts."""
        return self.num_shared_experts * self.shared_intermediate_size

    def replace(self, **changes) -> "MoEConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain-value form (dtype and device as strings), for printing and cross-rank comparison."""
        d = asdict(self)
        d["dtype"] = str(self.dtype).removeprefix("torch.")
        d["device"] = self.device.type
        return d
