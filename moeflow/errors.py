"""The error catalogue: every user-facing error moeflow raises has a stable code. Each :class:`ErrorSpec` carries
a one-line message template (it names the offending value and the valid alternatives) and a longer explanation
(what it means, when it happens, how to fix it, an example) that ``moeflow explain CODE`` prints.

``raise error("MF201", name="foo", valid=[...])``: the exception is an instance of :class:`MoeflowError` *and* of
the builtin a Python user expects (``ValueError``, ``TypeError``, ``RuntimeError``, ``TimeoutError``), so
``except ValueError`` keeps working. Code ranges: MF1xx configuration, MF2xx unsupported combination (refused by
the planner when the layer is built), MF3xx bad forward input, MF4xx weight loading, MF5xx expert parallelism,
MF6xx tooling (kernel configs, command line), MF7xx model integration.
"""
from __future__ import annotations

from dataclasses import dataclass


class MoeflowError(Exception):
    """Base class of every coded moeflow error. ``err.code`` is the stable code."""

    code: str = ""

    def __init__(self, code: str, message: str):
        super().__init__(f"[{code}] {message} (run `moeflow explain {code}` for details)")
        self.code = code
        self.detail = message

    def __reduce__(self):  # pickle / copy (a process pool hands a worker's error back): rebuilt from (code, detail)
        return type(self), (self.code, self.detail), self.__dict__


class ConfigError(MoeflowError, ValueError):
    """A value in the layer configuration is invalid on its own or in combination."""


class UnsupportedError(MoeflowError, ValueError):
    """The planner refuses a (scheme, runner, dispatcher) cell in this environment."""


class InputError(MoeflowError, ValueError):
    """A forward input has a wrong shape or value."""


class InputTypeError(MoeflowError, TypeError):
    """A forward input has a wrong dtype or device."""


class WeightError(MoeflowError, ValueError):
    """A weight given to ``load_weights`` is missing, unexpected or misshaped."""


class DistributedError(MoeflowError, RuntimeError):
    """Ranks of an expert-parallel group disagree, or a collective failed."""


class DistributedTimeout(MoeflowError, TimeoutError):
    """A rank of an expert-parallel group stopped answering."""


class ToolError(MoeflowError, RuntimeError):
    """A tooling step (kernel configs, command line, benchmark) cannot proceed."""


@dataclass(frozen=True)
class ErrorSpec:
    code: str
    cls: type[MoeflowError]
    title: str
    message: str  # str.format template; names the offending value and valid alternatives
    explanation: str  # what it means, when it happens, how to fix it, an example

    @property
    def builtin(self) -> type[Exception]:
        """The builtin exception class this code is also an instance of (ValueError, ...)."""
        return next(c for c in self.cls.__mro__ if c.__module__ == "builtins")


_SPECS: list[ErrorSpec] = []


def _spec(code: str, cls: type[MoeflowError], title: str, message: str, explanation: str) -> None:
    _SPECS.append(ErrorSpec(code, cls, title, message, explanation.strip()))


# ---------------------------------------------------------------- MF1xx: configuration
_spec("MF101", ConfigError, "invalid layer size",
      "{field}={value!r} is invalid: {why}",
      """
What: a size of the layer (num_experts, hidden_size, intermediate_size, top_k, shared expert
sizes) is not a positive integer, or top_k is larger than num_experts.
When: building MoE(...) or MoEConfig(...).
Fix: pass positive integers with 1 <= top_k <= num_experts.
Example: MoE(num_experts=8, hidden_size=4096, intermediate_size=14336, top_k=2)
""")
_spec("MF102", ConfigError, "unknown option value",
      "{field}={value!r} is not one of {valid}",
      """
What: a string option (scoring, activation, quant, dtype name) has a value moeflow does not know, or
a switch (renormalize, use_correction_bias, shared_expert_gate) is not True or False (a string such as
"no" would otherwise read as True).
When: building the configuration.
Fix: use one of the listed values; `moeflow matrix` lists the schemes, runners and dispatchers.
Example: MoE(..., scoring="softmax", activation="silu", quant="fp8-block")
""")
_spec("MF103", ConfigError, "invalid grouped top-k",
      "grouped top-k with num_expert_groups={groups}, topk_groups={topk_groups} is invalid: {why}",
      """
What: DeepSeek-V3-style grouped routing needs num_experts divisible by num_expert_groups,
1 <= topk_groups <= num_expert_groups, and enough experts in the chosen groups to pick top_k
(topk_groups * num_experts / num_expert_groups >= top_k). Groups of one expert cannot rank by
the sum of their two best scores.
When: building the configuration.
Fix: copy n_group / topk_group from the model's config.json; use num_expert_groups=1 for plain top-k.
Example: MoE(num_experts=256, top_k=8, num_expert_groups=8, topk_groups=4, scoring="sigmoid")
""")
_spec("MF104", ConfigError, "unsupported layer dtype",
      "dtype={value!r} is not supported; valid: {valid}",
      """
What: the layer's activation dtype (the dtype of hidden_states and of the output) must be a
floating type moeflow computes in: bfloat16, float16 or float32. FP8 is a quantization scheme,
not a layer dtype.
When: building the configuration, or converting a built layer (moe.to(device or dtype), .cuda(), .half(), ...).
Fix: pass dtype=torch.bfloat16 (the usual choice on GPUs) and quant="fp8-..." for FP8 weights.
Example: MoE(..., dtype=torch.bfloat16, quant="fp8-block")
""")
_spec("MF105", ConfigError, "invalid routing option",
      "{field}={value!r} is invalid: {why}",
      """
What: a routing option is inconsistent: routed_scaling_factor must be a finite positive number;
the correction bias (DeepSeek-V3's e_score_correction_bias) only makes sense with sigmoid scoring.
When: building the configuration.
Fix: follow the model's config.json (DeepSeek-V3: scoring="sigmoid", use_correction_bias=True).
Example: MoE(..., scoring="sigmoid", use_correction_bias=True, routed_scaling_factor=2.5)
""")
_spec("MF106", ConfigError, "invalid device",
      "device={value!r} is invalid: {why}",
      """
What: the layer's device cannot be used: the string does not parse; it is the meta device, which holds no data (a
meta tensor has a shape only); it is of a type no moeflow router, dispatcher and runner all declare (mps, xla, ...;
the backends declare cpu and cuda); or it names an accelerator this machine does not have
(torch.cuda.is_available() is False, or cuda:N with N >= torch.cuda.device_count()). A layer built without device=
takes torch's default device: inside `with torch.device("meta")` (a model built empty, to be loaded later) that is
"meta".
When: building the configuration, or converting a built layer (moe.to(device or dtype), .to_empty(device=...),
.cuda(), .half(), ...).
Fix: pass device="cpu", or "cuda" / "cuda:N" (N below torch.cuda.device_count()) on a machine with a GPU; inside a
meta-device block, pass device= explicitly.
Example: with torch.device("meta"): moe = MoE(..., device="cuda:0")
""")

# ---------------------------------------------------------------- MF2xx: planner refusals
_spec("MF107", ConfigError, "invalid environment variable",
      "{name}={value!r} is invalid: {why}",
      """
What: an environment variable moeflow reads (`moeflow env` lists them) holds a value it cannot use.
When: the first call that reads it (MOEFLOW_EAGER_GRAPHS: every eager forward on CUDA; a switch such as
MOEFLOW_TRITON_PDL that is neither 1 nor 0: the first call that consults it; MOEFLOW_DIST_TIMEOUT_S that is not a
finite number > 0: init_distributed, or building an expert-parallel layer).
Fix: set it to a value of the kind `moeflow env` describes, or unset it for the default.
Example: MOEFLOW_EAGER_GRAPHS=16 (the largest batch replayed from a CUDA graph), MOEFLOW_EAGER_GRAPHS=0 (off)
""")
_spec("MF201", UnsupportedError, "unknown backend name",
      "{kind} {name!r} is not registered; registered {kind}s: {valid}",
      """
What: runner=, dispatcher= or quant= names a backend that is not in the registry.
When: building the layer (the planner looks the name up).
Fix: use "auto" or one of the listed names. Backends whose optional package is missing are still
listed, and refused with MF205 instead.
Example: MoE(..., runner="auto", dispatcher="auto")
""")
_spec("MF202", UnsupportedError, "runner does not support the quantization scheme",
      "runner {runner!r} does not run quant={scheme!r} on {device}; runners that do: {valid}",
      """
What: the chosen expert runner has no kernels for this quantization scheme on this device kind
(for example torch._scaled_grouped_mm has no fp8 block-scale mode and no CPU kernel).
When: building the layer, or converting it (moe.to(device or dtype), .cuda(), .half(), ...).
Fix: choose one of the listed runners, or runner="auto", or another scheme.
Example: MoE(..., quant="fp8-block", runner="reference")
""")
_spec("MF203", UnsupportedError, "backend does not run on this device kind",
      "{kind} {name!r} does not run on device type {device!r}; it runs on {valid}",
      """
What: the backend declares the device types it runs on and the layer's device is not one of them
(for example the Triton runner needs CUDA; the reference runner runs anywhere).
When: building the layer, or converting it (moe.to(device or dtype), .cuda(), .half(), ...). (A device type no
backend runs on at all, such as "meta", is MF106 before any backend is asked.)
Fix: move the layer to a supported device or choose another backend ("auto" picks a valid one).
Example: MoE(..., device="cpu", runner="grouped_mm")
""")
_spec("MF204", UnsupportedError, "compute capability too low",
      "{kind} {name!r} needs compute capability >= {need} for quant={scheme!r}; this GPU has {have}; "
      "valid {kind}s here: {valid}",
      """
What: the kernels need newer GPU hardware: moeflow's Triton kernels need bf16 tensor cores (compute capability 8.0,
Ampere; moeflow.targets), torch._grouped_mm / torch._scaled_grouped_mm need 9.0, and `moeflow tune`'s FP8 search
times FP8 dots, which need 8.9 (on sm_80 / sm_86 FP8 layers run weight-only with the default tiles, untuned).
When: building the layer on an older GPU, or moving a built layer to one (moe.to(...)); tuning an FP8 scheme there.
Fix: use a runner listed as valid (the reference runner runs on any GPU), or a newer GPU.
Example: MoE(..., runner="reference")
""")
_spec("MF205", UnsupportedError, "optional package missing",
      "{kind} {name!r} needs the package {package!r}, which is not importable: {why}",
      """
What: the backend depends on an optional Python package that is not installed (or fails to import).
When: building the layer, or converting it (moe.to(device or dtype), .cuda(), .half(), ...).
Fix: install the package (for the Triton runner: pip install triton) or choose another backend.
Example: pip install "triton>=3.4"
""")
_spec("MF206", UnsupportedError, "shape constraint not met",
      "{what} does not satisfy {rule} required by {kind} {name!r}; valid {kind}s here: {valid}",
      """
What: a scheme or backend needs sizes aligned to its tiles: fp8-block needs hidden_size and
intermediate_size divisible by 128 (its 128x128 weight blocks and 1x128 activation groups);
torch grouped GEMMs need row strides that are multiples of 16 bytes. The triton router holds all
experts of a token in registers (at most 1024; grouped selection needs a power-of-two count): the
plan then routes with the torch router and lists this code among the skipped candidates.
When: building the layer, or converting it (moe.to(device or dtype), .cuda(), .half(), ...).
Fix: a scheme's rule binds every runner: choose a scheme listed as valid (fp8-channel and fp8-tensor have no
size rule), or pad the model's sizes; a runner's alignment: choose a runner listed as valid (the reference runner
has none). A router refusal needs no fix: the torch router routes any expert count.
Example: MoE(hidden_size=7168, intermediate_size=2048, quant="fp8-block", ...)
""")
_spec("MF207", UnsupportedError, "runner does not support the layer dtype",
      "runner {runner!r} does not support dtype {dtype} on {device}; dtypes it runs here: {valid}; "
      "valid runners for {dtype}: {runners}",
      """
What: the runner's kernels exist only for some activation dtypes on this device kind. The dtypes listed are those
with which the runner passes every other check here too (compute capability, alignment); none where it passes none.
When: building the layer, or converting it (moe.to(device or dtype), .cuda(), .half(), ...).
Fix: use one of the listed dtypes, or a runner listed for this dtype.
Example: MoE(..., dtype=torch.bfloat16)
""")
_spec("MF208", UnsupportedError, "dispatcher does not fit the process group",
      "dispatcher {name!r} {why}; valid dispatchers here: {valid}",
      """
What: the dispatcher needs a different world: "local" serves a single process (expert-parallel
world size 1); the expert-parallel dispatchers need torch.distributed to be initialized and a
process group of size > 1.
When: building the layer, or converting it (moe.to(device or dtype), .cuda(), .half(), ...).
Fix: use dispatcher="auto", or start the program with torchrun and pass process_group=.
Example: torchrun --nproc-per-node 2 app.py   # then MoE(..., dispatcher="alltoall")
""")
_spec("MF209", UnsupportedError, "no valid plan",
      "no {kind} can run this configuration here; tried: {tried}; the first refused it with {first}",
      """
What: "auto" found no backend whose declared capabilities cover the configuration on this machine;
the message lists each candidate with the code that refused it, and quotes the first candidate's refusal.
When: building the layer with runner="auto" or dispatcher="auto", or converting it (moe.to(...)).
Fix: read the codes listed for each candidate (moeflow explain CODE) and change the configuration.
Example: moeflow check --preset small --quant fp8-block --device cpu
""")

_spec("MF210", UnsupportedError, "GPU the backend's kernels are not built for",
      "{kind} {name!r} has kernels built for {archs}; this GPU is {have}; valid {kind}s here: {valid}",
      """
What: a runner or router declares the GPU architectures its kernels are built for (Support.archs,
RouterCaps.archs; moeflow.targets lists them with what each was checked by: "validated", run on such a GPU, or
"compiled", every kernel and tile compiled for it and checked against its shared memory and registers in CI). The
Triton runner and router: sm_80, sm_86, sm_89, sm_90, sm_100, sm_120; grouped_mm (torch's grouped GEMMs): sm_90. A
GPU of another architecture (an older one, or one newer than this release: sm_103, sm_110, sm_121, ...) has
kernels nobody compiled or checked for it, so the planner does not pick that backend there.
When: building the layer on such a GPU with that runner named, or seeing it listed under MF209 with "auto"
(which then picks another runner, such as "reference"); a router: seen in `moeflow check`'s skipped candidates
(the torch router then routes).
Fix: use a backend listed as valid; or, to try it anyway (its results are not checked there), set
MOEFLOW_ALLOW_UNVALIDATED_GPU=1 and run `moeflow selftest`, which compares every cell with the reference runner.
Example: MoE(..., runner="reference")   # or: MOEFLOW_ALLOW_UNVALIDATED_GPU=1 moeflow selftest
""")

_spec("MF211", UnsupportedError, "AMD GPU: no kernels built for it",
      "{kind} {name!r} has no kernels for AMD GPUs (this one is {arch}, ROCm); valid {kind}s here: {valid}",
      """
What: moeflow's Triton kernels (the triton runner and router, the dispatchers' Triton sorts and row kernels) are
built for NVIDIA GPUs only (moeflow.targets). Triton's HIP backend compiles most of them for gfx942 (MI300), but
their rules are NVIDIA's: programmatic dependent launch (griddepcontrol) and the PTX clock of the peer-to-peer barrier
do not compile there, tiles plan for NVIDIA's shared memory (up to 200 KB against MI300's 64 KB), FP8 is e4m3fnuz
(bias 8, largest 240) where checkpoints are e4m3fn, and an MI250 reports compute capability 9.0, an H100's. So on a
ROCm device the Triton backends are refused, whatever its capability, and the torch code runs (the reference runner,
the torch router and the torch sorts and sums).
When: building the layer on an AMD GPU with runner="triton" named, or seeing it listed under MF209 / in `moeflow
check`'s skipped candidates with "auto" (which then picks the reference runner).
Fix: use runner="reference" (slow, exact) on AMD GPUs, or an NVIDIA GPU for the fast paths.
Example: MoE(..., runner="reference", device="cuda")   # a ROCm device is "cuda" to torch
""")

_spec("MF212", UnsupportedError, "cannot be batch-invariant",
      "{kind} {name!r} cannot compute batch-invariantly ({why}); valid {kind}s here: {valid}",
      """
What: with MoEConfig(batch_invariant=True) a token's output must be the same bits whatever batch it came in, and at
any position in it. Every stage must then compute a token from that token alone, in an order fixed for all batch
sizes. A quantization scheme whose activation scale spans the batch cannot (fp8-tensor: one scale for the whole batch,
so a token's FP8 values depend on the other tokens); a backend that does not declare it cannot either (grouped_mm:
torch's grouped GEMM picks its kernel by the batch shape; allgather: its reduce-scatter sums in an order the
collective picks); nor can redundant experts across ranks (a copy's replica, and with it the order in which the
ranks' partial sums add up, follows the token's position in the batch).
When: building the layer with batch_invariant=True and such a scheme or backend named; "auto" skips such backends.
Fix: use a scheme that quantizes each token on its own (fp8-channel or fp8-block for FP8 checkpoints, or "none"), or
a backend the message lists as valid, or num_redundant_experts=0 (a rebalance without replicas keeps it); or drop
batch_invariant.
Example: MoE(..., quant="fp8-block", batch_invariant=True)
""")

# ---------------------------------------------------------------- MF3xx: forward inputs
_spec("MF301", InputError, "input has the wrong shape",
      "{name} has shape {shape}; expected {expected}",
      """
What: forward() takes hidden_states [T, H] and router_logits [T, E]; forward_topk() takes
hidden_states [T, H], topk_ids [T, K] and topk_weights [T, K], with this layer's H, E and K. An
ExpertsPath call (moeflow.integrations.path) also takes the weights: w13 [E, 2I, H], w2 [E, H, I].
When: calling the layer or an ExpertsPath.
Fix: flatten batch and sequence dimensions first: x.view(-1, hidden_size).
Example: y = moe(x.view(-1, H), logits.view(-1, E)).view(B, S, H)
""")
_spec("MF302", InputTypeError, "input has the wrong dtype",
      "{name} has dtype {dtype}; expected {expected}",
      """
What: hidden_states must have the layer's dtype; router_logits may be any floating dtype
(routing runs in float32); topk_ids must be an integer tensor; topk_weights floating. An ExpertsPath's
weights are in the layer dtype, or float8_e4m3fn with float32 scales for an FP8 scheme (none without one).
When: calling the layer or an ExpertsPath.
Fix: cast the input (x.to(moe.config.dtype)) or build the layer with the dtype you feed it.
Example: y = moe(x.to(torch.bfloat16), logits)
""")
_spec("MF303", InputTypeError, "input is on the wrong device",
      "{name} is on {device}; the layer is on {expected}",
      """
What: every input must be on the layer's device.
When: calling the layer.
Fix: move the input or the layer (MoE(..., device=...)).
Example: y = moe(x.to(moe.config.device), logits.to(moe.config.device))
""")
_spec("MF304", InputError, "expert id out of range",
      "topk_ids holds expert ids in [{lo}, {hi}]; valid ids are 0..{max_id}",
      """
What: forward_topk() received an expert id that is negative or >= num_experts. moeflow checks
this before any kernel runs (an out-of-range id would read another expert's weights or crash).
The check is skipped while a CUDA graph is being captured.
When: calling forward_topk().
Fix: ids come from a router over this layer's num_experts; check the caller's routing.
Example: ids = torch.topk(logits, k).indices.to(torch.int32)
""")
_spec("MF305", InputError, "duplicate expert in a token's top-k",
      "token {token} selects expert {expert} more than once",
      """
What: each token must select K distinct experts; a repeated id double-counts that expert.
When: calling forward_topk() with hand-made routing.
Fix: produce ids with torch.topk (distinct by construction).
Example: ids = torch.topk(scores, k, dim=-1).indices
""")

_spec("MF306", InputError, "compiled graph names no live moeflow layer",
      "the op moeflow.layer was called for {owner!r} with an anchor of no live layer of this process",
      """
What: under torch.compile, a moeflow layer is one op of the compiled graph (moeflow.ops). The op names its
layer's class and function, and finds the layer by its anchor, a one-element buffer (_moeflow_anchor) the graph
takes as an input. No live layer of this process had that anchor.
When: running a graph exported or compiled ahead of time in another process (torch.export, AOT compilation),
or a graph whose layer was deleted; or, inside CUDA graph capture, an anchor copied on its way to the op (a
module's buffers are not copied; the op can find a copy's layer only outside capture).
Fix: compile the model in the process that runs it (torch.compile(model)); keep the model alive while its
compiled function is used.
Example: model = torch.compile(model); y = model(x)
""")

_spec("MF307", InputError, "gradient asked of a moeflow layer",
      "a gradient was asked through the op moeflow.{op}: moeflow layers compute inference only",
      """
What: moeflow runs MoE layers for inference: its kernels have no backward. A call with grad mode on and an input
or weight that requires grad computes as usual, and its output carries a backward that raises this error, so that
no gradient stops silently at the layer. Compiled, the same: a layer is one op of the compiled graph (moeflow.ops),
the weights that require grad among its inputs, and running its backward raises this error.
When: calling backward through a layer's output, eagerly or in a model compiled with grad mode on (e.g. training
the layers around moeflow's).
Fix: run the model under torch.no_grad() or torch.inference_mode() (transformers' generate already does), or set
requires_grad_(False) on the model's parameters; to train other layers around moeflow's, use another experts
implementation for training.
Example: with torch.inference_mode(): y = torch.compile(model)(x)
""")

# ---------------------------------------------------------------- MF4xx: weights
_spec("MF401", WeightError, "missing weight",
      "load_weights is missing {names}; expected names: {valid}",
      """
What: a weight the layer needs was not given (with strict=True).
When: calling load_weights(), or load_state_dict() with the layer's expert weights.
Fix: pass Hugging Face names and layouts: gate_up_proj [E, 2I, H] (gate rows first),
down_proj [E, H, I], and the layer's optional tensors; or pass strict=False to keep the current values.
Example: moe.load_weights({"gate_up_proj": w13, "down_proj": w2})
""")
_spec("MF402", WeightError, "weight has the wrong shape",
      "{name} has shape {shape}; expected {expected}",
      """
What: a weight does not have the layout moeflow expects (Hugging Face's fused layout).
When: calling load_weights(), or load_state_dict() with the layer's expert weights.
Fix: gate_up_proj is [E, 2I, H] with the gate rows first; down_proj is [E, H, I]; FP8 block
scales are [E, ceil(N/128), ceil(K/128)] for a weight [E, N, K]. Stack per-expert weights first:
torch.stack([torch.cat([w1, w3]) for w1, w3 in ...]).
Example: gate_up = torch.cat([gate_proj, up_proj], dim=1)  # [E, 2I, H]
""")
_spec("MF403", WeightError, "unexpected weight",
      "load_weights got names it cannot take: {names}; valid names: {valid}",
      """
What: a name given to load_weights() is not a weight of this layer (a typo, or a tensor of a
part the layer was not built with, such as shared experts or their *.weight_scale_inv), or one weight is given
twice, under both spellings of the shared experts (shared_expert. and shared_experts.).
When: calling load_weights() with strict=True (a weight given twice: with any strict, and load_state_dict).
Fix: rename or drop the tensor, build the layer with the matching option, or pass strict=False.
Example: MoE(..., num_shared_experts=1, shared_intermediate_size=2048)
""")
_spec("MF404", WeightError, "bad weight dtype or scale",
      "{name}: {why}",
      """
What: a weight's dtype cannot be loaded: an FP8 weight needs its *_scale_inv beside it, a scale
must be floating, a high-precision weight must be a floating tensor and comes without a scale, a
scaled FP8 weight must be float8_e4m3fn, a *_scale_inv comes with its weight (not alone, onto a stale one); or a
tensor is on the meta device (no values) or is not a tensor.
When: calling load_weights(), or load_state_dict() with the layer's expert weights.
Fix: pass float8_e4m3fn weights together with their *_scale_inv tensors, or high-precision weights;
dequantize other FP8 formats first; load a lazily built checkpoint's tensors themselves.
Example: moe.load_weights({"gate_up_proj": q, "gate_up_proj_scale_inv": s, ...})
""")

# ---------------------------------------------------------------- MF5xx: expert parallelism
_spec("MF501", DistributedError, "ranks disagree on the configuration",
      "rank {rank} and rank {other} disagree on {field}: {mine!r} vs {theirs!r}",
      """
What: every rank of an expert-parallel group must build the same layer (sizes, routing, scheme,
runner family, placement). moeflow compares the configurations at construction.
When: building the layer under torch.distributed.
Fix: build the layer from one shared configuration on every rank.
Example: cfg = MoEConfig(...); MoE(cfg, process_group=pg)  # same cfg on each rank
""")
_spec("MF502", DistributedTimeout, "rank stopped answering",
      "{what} did not complete within {seconds}s on rank {rank}",
      """
What: a collective of the expert-parallel group did not complete in time: another rank crashed,
hangs, or was never started.
When: building the layer, or in dispatch/combine.
Fix: look at the other ranks' logs; raise MOEFLOW_DIST_TIMEOUT_S if the job is just slow.
Example: MOEFLOW_DIST_TIMEOUT_S=600 torchrun --nproc-per-node 8 app.py
""")
_spec("MF503", DistributedError, "fixed dispatch capacity exceeded",
      "{count} tokens on rank {rank} exceed the capacity of {capacity} tokens per rank of dispatcher {name!r}",
      """
What: the fixed-size dispatchers (lowlatency, alltoall-fixed) use buffers sized for
max_tokens_per_rank tokens on each rank; a rank was given more. No token is dropped silently: the
overflowing rank still takes part in both collectives with its first max_tokens_per_rank tokens
(so its peers finish correctly) and then raises this error.
When: at the end of the forward (combine) on the rank that was given too many tokens.
Fix: raise max_tokens_per_rank (the capacity), or use the alltoall dispatcher, whose buffers follow
the batch (one host synchronization per dispatch).
Example: MoE(..., dispatcher="lowlatency", max_tokens_per_rank=256)
""")
_spec("MF504", DistributedError, "invalid expert placement",
      "expert placement {why}",
      """
What: an explicit expert->rank placement must give each expert one integer rank (a sequence of
num_experts of them), with ranks in [0, world_size) and every rank holding at least one expert. A
layer that runs in one process (torch.distributed not initialized, or a group of one rank) takes no
placement naming another rank: start the program with torchrun, or drop the placement.
When: building the configuration (its form) or the layer (its ranks).
Fix: pass placement as a list of length num_experts whose entry e is the rank owning expert e. Fewer experts
than ranks: no placement works; build the layer on a process group of at most num_experts ranks.
Example: MoE(..., placement=[0, 0, 1, 1, 1, 0, 1, 0])
""")

# ---------------------------------------------------------------- MF6xx: tooling
_spec("MF601", ToolError, "unknown preset",
      "preset {name!r} is not known; presets: {valid}",
      """
What: the command line names a model shape that moeflow has no preset for.
When: moeflow bench / check / tune.
Fix: use one of the listed presets, or give the sizes explicitly (--hidden, --inter, --experts, --topk).
Example: moeflow bench --preset qwen3-30b-a3b
""")
_spec("MF602", ToolError, "unknown error code",
      "{code!r} is not an error code; codes: {valid}",
      """
What: `moeflow explain` was given a code that is not in the catalogue.
When: moeflow explain CODE.
Fix: run `moeflow explain` with no argument for the list of codes.
Example: moeflow explain MF202
""")

# ---------------------------------------------------------------- MF21x: Triton runner (MF210: with MF2xx above)
# ---------------------------------------------------------------- MF505+: expert-parallel additions
_spec("MF505", DistributedError, "collective failed",
      "{what} failed on rank {rank}: {why}",
      """
What: a collective of the expert-parallel group raised instead of completing: a peer process
exited (its connection closed), or the group's backend cannot move tensors of this device
(an NCCL group with a CPU layer, a gloo group with a CUDA layer).
When: building the layer (configuration check), or in dispatch/combine.
Fix: look at the other ranks' logs for the first error; use NCCL for CUDA layers and gloo for CPU.
Example: torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
""")
_spec("MF506", UnsupportedError, "FP8 payload not possible for this scheme",
      "payload='fp8' is not possible with quant={scheme!r}: {why}; valid payloads: {valid}",
      """
What: an expert-parallel dispatcher compresses tokens to FP8 on their home rank, one token at a
time. A scheme whose activation scale spans the whole batch a GEMM sees (fp8-tensor: one amax for
all rows) cannot be reproduced that way: the rows from different ranks would carry different
scales where the scheme promises one.
When: building the layer (the planner refuses it for the expert-parallel dispatchers) or the dispatcher with
payload="fp8" (dispatcher.with_payload("fp8")).
Fix: use payload="auto" (FP8 for fp8-channel and fp8-block, the layer dtype otherwise) or "dtype".
Example: moe.dispatcher = moe.dispatcher.with_payload("auto")
""")
_spec("MF507", UnsupportedError, "peer memory not available",
      "dispatcher {name!r} cannot map its peers' memory on rank {rank}: {why}; valid dispatchers: {valid}",
      """
What: the peer-to-peer dispatcher (alltoall-p2p) stores tokens straight into the other ranks' GPU
memory, which needs every rank of the group on one node with GPUs that can map each other's memory
(torch symmetric memory: NVLink or PCIe peer access). The group's ranks could not map each other's
buffers: ranks on several nodes, GPUs without peer access, or a torch build without symmetric memory.
When: building the layer (the dispatcher allocates and maps its buffers once).
Fix: use alltoall-fixed (the same blocks through NCCL, also CUDA-graph capturable) or alltoall.
Example: MoE(..., dispatcher="alltoall-fixed", max_tokens_per_rank=4096)
""")
_spec("MF508", DistributedError, "expert-parallel layer cannot be copied or pickled",
      "{how} a layer whose dispatcher {name!r} runs on a process group of {world} ranks is not possible: {why}",
      """
What: an expert-parallel layer belongs to its process group: torch's process groups cannot be copied or pickled,
its dispatcher exchanges with the other ranks' layers in step, and some own buffers the other ranks write into
(alltoall-p2p). A copy would be a layer no other rank exchanges with.
When: copy.deepcopy, pickle or torch.save of the layer (or of a model holding it) where the group has more than
one rank. A layer in a group of one rank is copied (the copy shares the group) but not pickled (MF508 too).
Fix: save and load the weights instead: torch.save(layer.state_dict()); for a second layer, build one with the
same configuration on every rank (construction is collective) and load_state_dict(layer.state_dict()).
Example: twin = MoE(layer.config); twin.load_state_dict(layer.state_dict())
""")
_spec("MF509", DistributedError, "batch overwritten by a later one",
      "dispatcher {name!r} holds one batch at a time: this batch's {what} were overwritten by a later {by} (of this "
      "layer or another sharing its buffers); valid dispatchers for overlapped batches: {valid}",
      """
What: alltoall-p2p's peers store a batch's token rows, and later its partial sums, straight into buffers that
each rank maps once (shared by the layers of one group and size), and the experts read those rows in place. Each
dispatch_start and combine_start refills them, so a batch started before an earlier one finished overwrote that
earlier batch's rows or sums; the earlier batch is refused where it is next used (dispatch_wait, combine_start,
combine_wait) rather than computed from the wrong rows.
When: two micro-batches overlapped through the dispatcher's halves (dispatch_start of B before A's combine_wait).
A layer's own forward never does this.
Fix: finish each batch (combine_wait) before the next dispatch_start, or overlap micro-batches with alltoall-fixed
(the same fixed blocks through NCCL, buffers per call) or alltoall.
Example: MoE(..., dispatcher="alltoall-fixed", max_tokens_per_rank=4096)
""")
# ---------------------------------------------------------------- MF510+: load balancing (moeflow.balance)
_spec("MF510", ConfigError, "invalid placement with replicas",
      "placement {why}",
      """
What: a moeflow.balance.Placement names, for each physical expert slot of the layer (num_experts +
num_redundant_experts of them), the logical expert the slot holds a replica of and the rank holding it. It must
have exactly that many slots, name experts in [0, num_experts) with every expert holding at least one slot, and
name only ranks of the layer's group, every rank holding at least one slot. layer.rebalance also keeps each rank's
slot count (weights and tables are rewritten in place). An expert -> rank list (placement=[...]) has one slot per
expert: with num_redundant_experts > 0 the placement must be a Placement.
When: building the configuration (slots, experts) or the layer (ranks), or layer.rebalance(placement).
Fix: make placements with moeflow.balance.plan_placement (from layer.expert_load) or Placement.contiguous, for the
layer's group size, with num_redundant_experts = placement slots - num_experts.
Example: layer.rebalance(plan_placement(layer.expert_load(all_ranks=True), world, layer.config.num_redundant_experts))
""")
_spec("MF511", DistributedError, "ranks disagree on the rebalance",
      "rank {rank} and rank {other} were given different placements to rebalance: {why}",
      """
What: layer.rebalance(placement) is collective: every rank of the layer's group calls it with the same placement,
since the expert weights move between ranks by it. The ranks compare their placements first, and every rank
raises this error, so none is left waiting and no weight has moved.
When: layer.rebalance, typically where each rank planned from its own load counts.
Fix: plan from counts every rank shares: layer.expert_load(all_ranks=True) all-reduces them over the group and
plan_placement is deterministic, so every rank computes the same placement (or plan on one rank and broadcast it).
Example: load = layer.expert_load(reset=True, all_ranks=True); layer.rebalance(plan_placement(load, world, r))
""")
_spec("MF512", ConfigError, "expert load not recorded",
      "layer.expert_load(): this layer does not count its expert load: {why}",
      """
What: the load counter (token copies per logical expert, accumulated on the device in every forward) exists only
where the layer was built to record it; it costs one small scatter-add a forward.
When: layer.expert_load() on a layer built with record_expert_load=False (the default).
Fix: build the layer with record_expert_load=True (every rank of an expert-parallel group alike).
Example: MoE(..., num_redundant_experts=16, record_expert_load=True)
""")
_spec("MF513", ConfigError, "placement cannot be planned",
      "plan_placement: {why}",
      """
What: moeflow.balance.plan_placement(load, num_ranks, num_redundant, group_size=, ranks_per_node=) gives every rank
the same number of slots, (num_experts + num_redundant) / num_ranks, and with groups keeps each group of
group_size consecutive experts on one node of ranks_per_node ranks, the same number of groups per node. The
arguments do not allow that, or load is not a one dimensional tensor of finite non-negative counts.
When: plan_placement(...).
Fix: pick num_redundant so that num_experts + num_redundant is a multiple of num_ranks; group_size must divide
num_experts and the groups must split evenly over the nodes (or leave both group arguments out).
Example: plan_placement(load, num_ranks=8, num_redundant=32, group_size=32, ranks_per_node=8)
""")

# ---------------------------------------------------------------- MF603+: kernel configs / tuning
_spec("MF603", ToolError, "invalid kernel config file",
      "kernel config file {path} cannot be used: {why}",
      """
What: a tuned Triton kernel configuration file (JSON, written by `moeflow tune`) that matches this
layer's shape could not be read or parsed.
When: the first forward of a layer using the triton runner, when it looks its configs up.
Fix: re-run `moeflow tune` for the shape, or delete the file (the shipped configs or the
documented defaults are used then). Files in $MOEFLOW_KERNEL_CONFIG_DIR are searched first.
Example: moeflow tune --preset qwen3-30b-a3b --quant fp8-block --out $MOEFLOW_KERNEL_CONFIG_DIR
""")
_spec("MF604", ToolError, "tuning needs a CUDA GPU with Triton",
      "moeflow tune cannot run here: {why}",
      """
What: `moeflow tune` times the Triton kernels on the GPU it will serve; it needs CUDA and the
triton package.
When: moeflow tune on a machine without a GPU or without triton.
Fix: run it on the target GPU (pip install 'moeflow[triton]'); use the files it writes through
MOEFLOW_KERNEL_CONFIG_DIR or copy them into moeflow/kernels/configs/.
Example: CUDA_VISIBLE_DEVICES=0 moeflow tune --preset deepseek-v3 --quant fp8-block
""")
_spec("MF605", ToolError, "benchmark does not fit in memory",
      "{what} needs about {need} GB on {device}; {free} GB are free",
      """
What: `moeflow bench` keeps two copies of the experts (the reference layer and the layer under
test); the preset's experts at this dtype do not fit in the memory free on the device.
When: moeflow bench with a large preset (deepseek-v3 holds 22.5 GB of bf16 experts) on a small machine.
Fix: benchmark fewer experts with the same shapes (--experts), a smaller preset, or a GPU with more memory.
Example: moeflow bench --preset deepseek-v3 --experts 16 --device cpu
""")
_spec("MF606", ToolError, "plotting needs matplotlib",
      "moeflow bench --png cannot plot here: {why}",
      """
What: `moeflow bench --png` draws its plot with matplotlib, an optional package moeflow does not require.
When: moeflow bench --png on a machine without matplotlib (checked before the benchmark runs).
Fix: pip install 'moeflow[plot]' (or matplotlib), or leave --png out and plot the --csv / --json rows elsewhere.
Example: pip install 'moeflow[plot]' && moeflow bench --png bench.png
""")
_spec("MF607", ToolError, "no kernel config computed correct values",
      "moeflow tune: none of the {count} {gemm} candidates for T={tokens} computed values within the reference's "
      "tolerance on {device} (the fastest refused, with their relative errors: {examples})",
      """
What: `moeflow tune` checks the fastest candidate of each GEMM against the float64 reference (its outputs
poisoned first) before it records it, and falls back to the next fastest if the output is wrong. Here every
candidate computed wrong values: a fault of the kernels or of the Triton compiler on this GPU, not of the shape.
When: moeflow tune (each token count, after timing).
Fix: check that the Triton version is the tested one (`moeflow env`); run the GPU tests
(pytest -m gpu tests/gpu/test_gpu_tune_candidates.py) and report the failure with `moeflow env`'s output.
Until then the layer runs on the shipped tables or the documented defaults for this shape.
Example: pip install triton==3.6.0 && moeflow tune --preset qwen3-30b-a3b --quant fp8-block
""")
# ---------------------------------------------------------------- MF7xx: model integration (transformers)
_spec("MF701", UnsupportedError, "transformers is not installed",
      "{what} needs the optional package 'transformers': {why}",
      """
What: the Hugging Face integration (moeflow.integrations.hf, `moeflow generate`) uses the
transformers library, which moeflow does not require. `import moeflow` works without it.
When: calling moeflow.integrations.hf.register(), replace_moe_blocks(), load_fp8_model(), or
running `moeflow generate`.
Fix: install the extra.
Example: pip install "moeflow[transformers]"
""")
_spec("MF702", UnsupportedError, "MoE block not supported",
      "{path}: MoE block {cls!r} cannot be replaced by moeflow; supported blocks: {valid}",
      """
What: replace_moe_blocks() replaces the sparse MoE blocks (router + experts + shared experts) of
the model families whose routing it knows exactly (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
DeepSeek-V3). A block of another class has routing moeflow cannot promise to reproduce, so it is
refused when the model is converted, never at forward time.
When: replace_moe_blocks(model) meets a module holding a `gate` and `experts` of another class.
Fix: use the experts implementation instead (routing stays in transformers, the experts run in
moeflow): from_pretrained(..., experts_implementation="moeflow"); or pass skip_unknown=True to
keep unknown blocks as they are.
Example: model.set_experts_implementation("moeflow")
""")
_spec("MF703", UnsupportedError, "no MoE block found",
      "{model} has no sparse MoE block to replace; supported blocks: {valid}",
      """
What: replace_moe_blocks() found no block of a supported family in the model (a dense model,
or an MoE family moeflow does not know).
When: replace_moe_blocks(model) or load_fp8_model(path).
Fix: check the model is one of the supported families, or use experts_implementation="moeflow".
Example: replace_moe_blocks(AutoModelForCausalLM.from_pretrained(path))
""")
_spec("MF704", UnsupportedError, "experts module not supported",
      "{cls}: {feature} is not supported by the moeflow experts implementation; {fix}",
      """
What: transformers' experts modules declare how their weights are stored and computed (has_gate,
is_transposed, has_bias, is_concatenated, has_post_expert_norm, act_fn, a custom gate, FP8 block
size and scale format). moeflow runs gated, bias-free experts with silu / gelu / gelu_tanh
activations, weights gate_up_proj [E, 2I, H] / down_proj [E, H, I] (or their transposes), high-precision
or FP8 with 128x128 block scales in float32. Anything else is refused, naming the feature: for example
experts that are not gated (Nemotron-H: has_gate=False, up_proj and down_proj, no gate_up_proj), or a
module with another attribute layout (its tensors are listed).
When: prepare_experts(model) (at load time), else the first call of the moeflow implementation of an experts
module (its first forward), before any of its tensors is read. transformers checks only the name when
experts_implementation="moeflow" is set.
Fix: use another experts implementation for this model (e.g. "grouped_mm" or "eager").
Example: model.set_experts_implementation("grouped_mm")
""")
_spec("MF705", WeightError, "FP8 checkpoint not loadable",
      "{path}: {why}",
      """
What: load_fp8_model() reads a fine-grained FP8 checkpoint (float8_e4m3fn weights, each with a
`weight_scale_inv` of 128x128 block scales, quantization_config.quant_method "fp8") and loads
the experts into moeflow fp8-block layers without dequantizing. The checkpoint has something it
cannot read: no such directory, no safetensors, a missing scale, another block size.
When: load_fp8_model(path).
Fix: point at a directory with config.json and *.safetensors of a fine-grained FP8 checkpoint
with weight_block_size [128, 128].
Example: load_fp8_model("/models/tiny-fp8", dtype=torch.bfloat16)
""")
_spec("MF706", ToolError, "model cannot be loaded",
      "--model {path!r}: {why}",
      """
What: `moeflow generate --model PATH` loads a local Hugging Face checkpoint (a directory with
config.json and safetensors weights); nothing is downloaded.
When: moeflow generate.
Fix: pass a local checkpoint directory, or omit --model to build a small random-weight model.
Example: moeflow generate --model ./Qwen3-30B-A3B --prompt "Hello"
""")


CATALOGUE: dict[str, ErrorSpec] = {s.code: s for s in sorted(_SPECS, key=lambda spec: spec.code)}


def error(code: str, /, **fields) -> MoeflowError:
    """Build (not raise) the coded exception for ``code`` with its message filled from ``fields``.
    ``code`` is positional-only so that a message may itself have a ``{code}`` field (MF602)."""
    spec = CATALOGUE[code]
    return spec.cls(code, spec.message.format(**fields))


def explain(code: str) -> str:
    """The long explanation of ``code`` as the command line prints it."""
    spec = CATALOGUE.get(code.upper())
    if spec is None:
        raise error("MF602", code=code, valid=sorted(CATALOGUE))
    return f"{spec.code} ({spec.cls.__name__}: {spec.builtin.__name__}) - {spec.title}\n\n{spec.explanation}\n"
