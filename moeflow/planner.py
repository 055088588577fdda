"""The planner: configuration + environment -> Plan, or a coded error, at construction time.

Checks, in order: the scheme's shape rules; the dispatcher (device, world size, packages); the
runner (device, scheme, dtype, compute capability, alignment, packages). "auto" picks, among the
valid candidates, the one of highest declared ``priority`` (a fixed, documented order:
triton > grouped_mm > reference for runners), unless that one declares a measured rule (RunnerCaps.slower) saying
it is slower here than another valid runner, which it then takes (grouped_mm's bf16 / fp16 on a CPU without
their matrix instructions: the reference runner). The layout the dispatcher produces is handed to the
runner natively when the runner lists it, else converted (layouts.run_in_layout). The router
is always chosen ("auto"): the valid one of highest priority (triton > torch).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from . import env as moeflow_env
from .capabilities import Environment
from .targets import arch_name, nearest, rules_for, target_of
from .config import MoEConfig
from .dispatch import DISPATCHERS
from .errors import MoeflowError, error
from .experts import RUNNERS
from .quant import SCHEMES, create_scheme, payload_scheme, row_local
from .routing import ROUTERS


@dataclass(frozen=True)
class Plan:
    scheme: str
    runner: str
    dispatcher: str
    layout: str  # what the dispatcher produces
    runner_layout: str  # what the runner consumes (equal to layout when native)
    environment: str
    reasons: tuple[str, ...]
    indexed_rows: bool = False  # the dispatcher hands rows by index and the runner gathers them itself
    router: str = "torch"
    # the runner may run dispatch, experts and combine together (RunnerCaps.fused_layer, DispatcherCaps.fusable);
    # for which batch sizes it does is the runner's tuned data (ExpertRunner.fused_config)
    fused_layer: bool = False
    # router, dispatcher and runner all declare graph_safe and the layout is native: a call can be captured in a CUDA
    # graph and replayed (moeflow.graphs replays eager calls of small batches from one)
    graph_safe: bool = False
    # graph-safe, and the dispatcher drops copies routed to no expert (DispatcherCaps.drops_copies): eager calls of
    # mid-sized batches may be padded to a bucket and replayed (MOEFLOW_EAGER_BUCKETS)
    bucketed: bool = False
    # an FP8 scheme on a GPU without FP8 tensor cores (moeflow.targets: sm_80, sm_86): FP8 weights, activations in the
    # layer dtype (quant/weight_only.py)
    weight_only: bool = False
    # why this GPU is not validated, where the chosen backends' kernels are compiled for it but were never run on one
    # (moeflow.targets' grade "compiled"; `moeflow selftest` checks it); "" on a validated GPU, a CPU or torch code
    unvalidated: str = ""
    # MoEConfig.batch_invariant: every stage computes a token from that token alone, in an order fixed for all batch
    # sizes (the backends' caps.batch_invariant); the one-launch layer is off (its tiles are chosen by T)
    batch_invariant: bool = False

    @property
    def converted(self) -> bool:
        return self.layout != self.runner_layout

    def __str__(self) -> str:
        conv = f" -> converted to {self.runner_layout}" if self.converted else " (native)"
        lines = [f"environment: {self.environment}",
                 f"router:      {self.router}",
                 f"quant:       {self.scheme}",
                 f"dispatcher:  {self.dispatcher} (layout {self.layout})",
                 f"runner:      {self.runner}{conv}",
                 "why:"]
        lines += [f"  - {r}" for r in self.reasons]
        return "\n".join(lines)


def check_scheme(cfg: MoEConfig, env: Environment, alternatives: bool = True) -> MoeflowError | None:
    """None when the scheme's shape rules hold for ``cfg``, else MF206 (naming the schemes whose rules hold unless
    ``alternatives`` is False); in an expert-parallel group, MF506 where the tokens are to travel as FP8
    (dispatch_payload "fp8") but the scheme's activation scale spans the batch (fp8-tensor), as every expert-parallel
    dispatcher refuses it when built (dispatch/_ep_base.py)."""
    cls = SCHEMES.get(cfg.quant)
    for rule in cls.caps.shape_rules:
        value = getattr(cfg, rule.field)
        if value % rule.multiple:
            return error("MF206", what=f"{rule.field}={value}", rule=f"a multiple of {rule.multiple}",
                         kind="quant scheme", name=cfg.quant, valid=_valid_schemes(cfg, env) if alternatives else [])
    if cfg.batch_invariant and not _weight_only(cfg, env) and not row_local(create_scheme(cfg.quant)):
        valid = [n for n in SCHEMES.names() if row_local(create_scheme(n))] if alternatives else []
        return error("MF212", kind="quant scheme", name=cfg.quant, valid=valid,
                     why="its activation scale spans the batch, so a token's FP8 values depend on the other tokens")
    if env.world_size > 1 and cfg.dispatch_payload == "fp8" and not row_local(payload_scheme(create_scheme(cfg.quant))):
        return error("MF506", scheme=cfg.quant, why="its activation scale spans the whole batch",
                     valid=["auto", "dtype"])
    return None


def _invariance_error(kind: str, name: str, caps, registry, check, cfg: MoEConfig, env: Environment,
                     alternatives: bool) -> MoeflowError | None:
    """MF212 where the layer is to be batch-invariant and backend ``name`` does not declare it (caps.batch_invariant)."""
    if not cfg.batch_invariant or caps.batch_invariant:
        return None
    return error("MF212", kind=kind, name=name, why="it does not declare a fixed per-token order for every batch size",
                 valid=_valid_names(registry, check, cfg, env, alternatives))


def check_dispatcher(name: str, cfg: MoEConfig, env: Environment, alternatives: bool = True) -> MoeflowError | None:
    """None when dispatcher ``name`` can serve ``cfg`` in ``env``, else its coded error
    (naming the valid alternatives unless ``alternatives`` is False)."""
    caps = DISPATCHERS.get(name).caps
    if env.device_type not in caps.devices:
        return error("MF203", kind="dispatcher", name=name, device=env.device_type, valid=sorted(caps.devices))
    if caps.distributed and env.world_size < 2:
        return error("MF208", name=name, why="needs an expert-parallel group of 2 or more ranks",
                     valid=_valid_names(DISPATCHERS, check_dispatcher, cfg, env, alternatives))
    if not caps.distributed and env.world_size > 1:
        return error("MF208", name=name, why=f"serves one process, but the group has {env.world_size} ranks",
                     valid=_valid_names(DISPATCHERS, check_dispatcher, cfg, env, alternatives))
    return (_invariance_error("dispatcher", name, caps, DISPATCHERS, check_dispatcher, cfg, env, alternatives)
            or _package_error("dispatcher", name, caps.requires, env))


def check_runner(name: str, cfg: MoEConfig, env: Environment, alternatives: bool = True) -> MoeflowError | None:
    """None when runner ``name`` can run ``cfg`` in ``env``, else its coded error."""
    caps = RUNNERS.get(name).caps
    rows = [s for s in caps.support if s.device == env.device_type]
    if not rows:
        return error("MF203", kind="runner", name=name, device=env.device_type,
                     valid=sorted({s.device for s in caps.support}))
    rows = [s for s in rows if cfg.quant in s.schemes]
    if not rows:
        return error("MF202", runner=name, scheme=cfg.quant, device=env.device_type,
                     valid=_valid_names(RUNNERS, check_runner, cfg, env, alternatives))
    dtyped = [s for s in rows if cfg.dtype in s.dtypes]
    if not dtyped:  # the dtypes with which this runner passes every check here (MF204 / MF206 / MF210 included)
        listed = sorted({d for s in rows for d in s.dtypes}, key=str)
        valid = [str(d).removeprefix("torch.") for d in listed if _passes(check_runner, name, cfg, env, dtype=d)]
        return error("MF207", runner=name, dtype=str(cfg.dtype).removeprefix("torch."), device=env.device_type,
                     valid=valid, runners=_valid_names(RUNNERS, check_runner, cfg, env, alternatives))
    if env.rocm and all(s.archs is not None for s in dtyped):  # NVIDIA kernels only (MF211 says why)
        return error("MF211", kind="runner", name=name, arch=env.rocm,
                     valid=_valid_names(RUNNERS, check_runner, cfg, env, alternatives))
    if env.device_type == "cuda":
        have = env.capability or (0, 0)
        capable = [s for s in dtyped if have >= s.min_cc]
        if not capable:
            need = min(s.min_cc for s in dtyped)
            return error("MF204", kind="runner", name=name, need=f"{need[0]}.{need[1]}", scheme=cfg.quant,
                         have=f"{have[0]}.{have[1]}", valid=_valid_names(RUNNERS, check_runner, cfg, env, alternatives))
        arch = arch_name(have)
        built = [s for s in capable if s.archs is None or arch in s.archs]
        if not built and not moeflow_env.ALLOW_UNVALIDATED_GPU.get_bool():
            return error("MF210", kind="runner", name=name, archs=_arch_list(a for s in capable for a in s.archs or ()),
                         have=arch,
                         valid=_valid_names(RUNNERS, check_runner, cfg, env, alternatives))
        dtyped = built or capable
    row = dtyped[0]
    for fld in ("hidden_size", "intermediate_size"):
        value = getattr(cfg, fld)
        if value % row.align:
            return error("MF206", what=f"{fld}={value}", rule=f"a multiple of {row.align}", kind="runner", name=name,
                         valid=_valid_names(RUNNERS, check_runner, cfg, env, alternatives))
    return (_invariance_error("runner", name, caps, RUNNERS, check_runner, cfg, env, alternatives)
            or _package_error("runner", name, caps.requires, env))


def check_router(name: str, cfg: MoEConfig, env: Environment, alternatives: bool = True) -> MoeflowError | None:
    """None when router ``name`` can route ``cfg`` in ``env``, else its coded error."""
    caps = ROUTERS.get(name).caps
    if env.device_type not in caps.devices:
        return error("MF203", kind="router", name=name, device=env.device_type, valid=sorted(caps.devices))
    if env.rocm and caps.archs is not None:
        return error("MF211", kind="router", name=name, arch=env.rocm,
                     valid=_valid_names(ROUTERS, check_router, cfg, env, alternatives))
    if env.device_type == "cuda" and caps.archs is not None and not moeflow_env.ALLOW_UNVALIDATED_GPU.get_bool():
        arch = arch_name(env.capability or (0, 0))
        if arch not in caps.archs:  # as a runner on a GPU its kernels are not built for (check_runner)
            return error("MF210", kind="router", name=name, archs=_arch_list(caps.archs), have=arch,
                         valid=_valid_names(ROUTERS, check_router, cfg, env, alternatives))
    e = cfg.num_experts
    if caps.max_experts is not None and e > caps.max_experts:
        return error("MF206", what=f"num_experts={e}", rule=f"at most {caps.max_experts}", kind="router", name=name,
                     valid=_valid_names(ROUTERS, check_router, cfg, env, alternatives))
    if caps.grouped_pow2 and cfg.grouped and e & (e - 1):
        return error("MF206", what=f"num_experts={e} with grouped selection", rule="a power of two",
                     kind="router", name=name, valid=_valid_names(ROUTERS, check_router, cfg, env, alternatives))
    return (_invariance_error("router", name, caps, ROUTERS, check_router, cfg, env, alternatives)
            or _package_error("router", name, caps.requires, env))


def _package_error(kind: str, name: str, packages, env: Environment) -> MoeflowError | None:
    for pkg in packages:
        why = env.package_error(pkg)
        if why:
            return error("MF205", kind=kind, name=name, package=pkg, why=why)
    return None


def _valid_names(registry, check, cfg, env, wanted: bool) -> list[str]:
    if not wanted:
        return []
    return [n for n in registry.names() if check(n, cfg, env, alternatives=False) is None]


def _arch_list(archs) -> str:
    """Architecture names (moeflow.targets), once each, oldest first: 'sm_80, sm_86, ...'."""
    return ", ".join(sorted(set(archs), key=lambda arch: int(arch.removeprefix("sm_"))))


def _passes(check, name: str, cfg: MoEConfig, env: Environment, **change) -> bool:
    """Whether backend ``name`` passes ``check`` with ``cfg`` changed by ``change`` (a change the configuration
    itself refuses does not)."""
    try:
        changed = cfg.replace(**change)
    except MoeflowError:
        return False
    return check(name, changed, env, alternatives=False) is None


def _valid_schemes(cfg: MoEConfig, env: Environment) -> list[str]:
    """The schemes whose shape rules (and payload rule) this configuration meets."""
    def check(name, changed, env, alternatives):  # check_scheme by name, as _passes calls the backends' checks
        return check_scheme(changed, env, alternatives)
    return [name for name in SCHEMES.names() if _passes(check, name, cfg, env, quant=name)]


def _choose(kind: str, registry, check, requested: str, cfg: MoEConfig, env: Environment) -> tuple[str, str]:
    """-> (name, reason). Raises the candidate's error, or MF209 when "auto" finds nothing."""
    if requested != "auto":
        registry.get(requested)  # MF201 for an unknown name
        err = check(requested, cfg, env)
        if err:
            raise err
        return requested, f"{kind} {requested!r} requested and valid here"
    ranked = sorted(registry.items(), key=lambda item: -item[1].caps.priority)
    refused, first = [], None
    for name, cls in ranked:
        err = check(name, cfg, env)
        if err is None:
            skipped = f"; skipped {', '.join(refused)}" if refused else ""
            slower = _measured_slower(cls.caps, check, cfg, env)
            if slower:
                return slower.than, (f"{kind} 'auto' -> {slower.than!r}: {name}'s {str(cfg.dtype)[6:]} on this CPU "
                                     f"(no {slower.lacking}) measured {slower.factor} slower than {slower.than!r} "
                                     f"({slower.at}; RunnerCaps.slower){skipped}")
            return name, f"{kind} 'auto' -> {name!r}: highest priority ({cls.caps.priority}) valid {kind}{skipped}"
        refused.append(f"{name} ({err.code})")
        first = first or f"{err.code}: {err.detail}"
    raise error("MF209", kind=kind, tried=", ".join(refused), first=first)


def _measured_slower(caps, check, cfg: MoEConfig, env: Environment):
    """The first of the backend's measured rules (RunnerCaps.slower, capabilities.Slower) that applies to ``cfg`` in
    ``env`` and names a backend that is valid there, else None: "auto" then takes that backend instead."""
    for rule in getattr(caps, "slower", ()):
        if rule.applies(cfg.dtype, env) and check(rule.than, cfg, env, alternatives=False) is None:
            return rule
    return None


def plan(cfg: MoEConfig, env: Environment) -> Plan:
    err = check_scheme(cfg, env)
    if err:
        raise err
    if cfg.batch_invariant and cfg.num_redundant_experts and env.world_size > 1:  # balance/slots.py's replica rule
        raise error("MF212", kind="placement", name=f"num_redundant_experts={cfg.num_redundant_experts}",
                    why="a copy's replica follows its token's position in the batch, and so does the order in which "
                        "the ranks' partial sums add up", valid=["num_redundant_experts=0"])
    dispatcher, why_d = _choose("dispatcher", DISPATCHERS, check_dispatcher, cfg.dispatcher, cfg, env)
    runner, why_r = _choose("runner", RUNNERS, check_runner, cfg.runner, cfg, env)
    router, why_t = _choose("router", ROUTERS, check_router, "auto", cfg, env)
    layout = DISPATCHERS.get(dispatcher).caps.layout
    runner_layouts = RUNNERS.get(runner).caps.layouts
    runner_layout = layout if layout in runner_layouts else runner_layouts[0]
    indexed = (layout == runner_layout and DISPATCHERS.get(dispatcher).caps.indexed_rows
               and RUNNERS.get(runner).caps.indexed_rows)
    reasons = (f"quant {cfg.quant!r}: shape rules met", why_d, why_r,
               f"layout {layout!r} " + ("consumed natively" if layout == runner_layout
                                        else f"converted to {runner_layout!r} for the runner"))
    if indexed:
        reasons += ("rows by index: the runner reads each token's row in place (no permuted copy of hidden)",)
    target = _kernel_rules(env)
    weight_only = _weight_only(cfg, env)
    if weight_only:
        reasons += (f"weight-only FP8: {target.arch} has no FP8 tensor cores, so the {cfg.quant} weights are read as "
                    f"stored and dequantized inside the GEMMs, the activations stay {str(cfg.dtype)[6:]}",)
    # (the one-launch layer dots FP8 activations: none under weight-only FP8; nor for float32 FP8 layers, as its FP8
    # dots on Hopper land 2e-4 to 4e-3 from its float32 reference, the separate launches 2e-7: above the float32 FP8
    # tolerance)
    # (nor under batch invariance: the one launch runs for small batches only, in its own order)
    fused = (DISPATCHERS.get(dispatcher).caps.fusable and cfg.quant in RUNNERS.get(runner).caps.fused_layer
             and not weight_only and not cfg.batch_invariant
             and not (cfg.dtype == torch.float32 and SCHEMES.get(cfg.quant).quantized))
    if cfg.batch_invariant:
        reasons += (f"batch-invariant: router {router!r}, dispatcher {dispatcher!r} and runner {runner!r} compute each "
                    "token from that token alone, in one order for every batch size (docs/batch-invariance.md)",)
    if fused:
        reasons += (f"small batches: dispatch, experts and combine in one {runner!r} launch where its tuned "
                    f"configs say so (dispatcher {dispatcher!r} only sorts and sums)",)
    reasons += (why_t,)
    graph_safe = (layout == runner_layout and env.device_type == "cuda" and DISPATCHERS.get(dispatcher).caps.graph_safe
                  and RUNNERS.get(runner).caps.graph_safe and ROUTERS.get(router).caps.graph_safe)
    if graph_safe:
        reasons += ("CUDA-graph safe: eager calls of small batches replay a captured graph (MOEFLOW_EAGER_GRAPHS)",)
    bucketed = graph_safe and DISPATCHERS.get(dispatcher).caps.drops_copies
    if bucketed:
        reasons += ("eager calls of mid-sized batches pad to a bucket and replay its graph (MOEFLOW_EAGER_BUCKETS)",)
    unvalidated = _unvalidated(env, RUNNERS.get(runner).caps, ROUTERS.get(router).caps)
    if unvalidated:
        reasons += (unvalidated,)
    return Plan(cfg.quant, runner, dispatcher, layout, runner_layout, env.describe(), reasons, indexed, router,
                fused, graph_safe, bucketed, weight_only, unvalidated, cfg.batch_invariant)


def _weight_only(cfg: MoEConfig, env: Environment) -> bool:
    """Plan.weight_only: an FP8 scheme on a GPU whose kernel rules have no FP8 dots (moeflow.targets)."""
    target = _kernel_rules(env)
    return target is not None and not target.fp8_dots and SCHEMES.get(cfg.quant).quantized


def _kernel_rules(env: Environment):
    """The moeflow.targets Target whose rules this GPU's kernels follow: its own, or where it is none but
    MOEFLOW_ALLOW_UNVALIDATED_GPU=1 lets kernels run there, the nearest (targets.nearest); None off CUDA (and on AMD
    GPUs: the torch code quantizes as the scheme says) or else."""
    if env.device_type != "cuda" or env.rocm:
        return None
    return rules_for(env.capability or (0, 0))


def _unvalidated(env: Environment, runner_caps, router_caps) -> str:
    """Plan.unvalidated: why the runner's or router's kernels are unchecked on this GPU, or ""."""
    if env.device_type != "cuda" or env.rocm:
        return ""
    built = [s.archs for s in runner_caps.support if s.device == "cuda" and s.archs is not None]
    if router_caps.archs is not None:
        built.append(router_caps.archs)
    if not built:  # torch code only (the reference runner, the torch router)
        return ""
    have = env.capability or (0, 0)
    target = target_of(have)
    if target is None:
        return (f"{arch_name(have)}: no kernels are built for it; running {nearest(have).arch}'s untested "
                "(MOEFLOW_ALLOW_UNVALIDATED_GPU=1): run `moeflow selftest` to check this GPU")
    if target.validated:
        return ""
    return (f"{target.arch} ({target.family}): moeflow's kernels are compiled for it and checked against its limits, "
            "but not run on one: run `moeflow selftest` to check this GPU")


_warned_unvalidated: set = set()


def warn_unvalidated(plan: Plan) -> None:
    """A warning, once per process and text, that the plan's GPU is not validated (Plan.unvalidated)."""
    if plan.unvalidated and plan.unvalidated not in _warned_unvalidated:
        _warned_unvalidated.add(plan.unvalidated)
        warnings.warn(f"moeflow: {plan.unvalidated}", stacklevel=3)


def cell_status(cfg: MoEConfig, env: Environment) -> str:
    """'ok' or the error code that refuses this (scheme, runner, dispatcher) cell."""
    try:
        plan(cfg, env)
    except MoeflowError as exc:
        return exc.code
    return "ok"


def matrix(template: MoEConfig, env: Environment) -> list[tuple[str, str, str, str]]:
    """[(scheme, runner, dispatcher, 'ok' | code)] over every registered triple."""
    rows = []
    for scheme in SCHEMES.names():
        for runner in RUNNERS.names():
            for dispatcher in DISPATCHERS.names():
                cfg = template.replace(quant=scheme, runner=runner, dispatcher=dispatcher)
                rows.append((scheme, runner, dispatcher, cell_status(cfg, env)))
    return rows
