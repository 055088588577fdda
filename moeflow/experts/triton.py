"""runner="triton": fused Triton MoE kernels on CUDA, sorted and masked layouts natively (TritonRunner).

    batch (sorted [N, H] + offsets, or masked [E, C, H] + counts), layer dtype or FP8 payload
      -> [quantize x]      kernels/rows/quant.py   (FP8 schemes, unless the dispatcher sent FP8)
      -> gate_up + act     kernels/gemm/gate_up.py (block alignment in-kernel; FP8-block output quant fused)
      -> [quantize inter]  kernels/rows/quant.py   (fp8-tensor / fp8-channel, from the amax gate_up wrote)
      -> down + route w    kernels/gemm/down.py    -> [N, H] / [E, C, H] layer dtype
No host synchronization and no data-dependent shape: a call can be captured in a CUDA graph (the decode path);
small single-process batches may run as one launch (run_fused). Kernel configs: tuned JSON files
(kernels/configs.py). triton is imported lazily: where it is absent the planner refuses the runner (MF205).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import env as moeflow_env
from ..capabilities import ALL_FLOAT, TRITON_ARCHS, RunnerCaps, Support
from ..layouts import MASKED, SORTED, ExpertBatch
from ..targets import INTERPRETER, kernel_target
from .base import ExpertRunner, ExpertWeights, empty_output

_FP8 = frozenset({"fp8-tensor", "fp8-channel", "fp8-block"})
# gemm/fused_layer.FUSED_SCHEMES, named here without importing triton (tests/kernels/test_fused_layer.py checks it)
_FUSED = frozenset({"none", "fp8-channel", "fp8-block"})
FUSED_MAX_TOKENS = 64  # the one-launch layer's largest batch (it sizes the layer's counters)
# MoEConfig.batch_invariant: every batch runs the tuned (or default) entry of this many tokens, without split K and
# Gluon kernels (invariant_tiles): one tile and one kernel for every T
INVARIANT_TOKENS = 1024


class TritonRunner(ExpertRunner):
    name = "triton"
    caps = RunnerCaps(
        layouts=(SORTED, MASKED),
        support=(
            # The architectures of moeflow.targets: Hopper's own kernels (TMA, Gluon) where they run, the portable
            # Triton kernels with tiles fitted to each target's shared memory elsewhere; FP8 schemes weight-only on
            # sm_80 / sm_86 (no FP8 tensor cores: Plan.weight_only). Each is "validated" or "compiled" there.
            Support("cuda", frozenset({"none"}), ALL_FLOAT, min_cc=(8, 0), archs=TRITON_ARCHS),
            Support("cuda", _FP8, ALL_FLOAT, min_cc=(8, 0), archs=TRITON_ARCHS),
        ),
        requires=("triton",),
        priority=30,
        note="fused Triton GEMMs (activation, routing weight and FP8 quantization fused)",
        indexed_rows=True,  # gate_up loads each sorted row from its token's row (ExpertBatch.source_rows)
        fused_layer=_FUSED,
        graph_safe=True,  # no host synchronization, no data-dependent shape (tests/gpu/test_gpu_triton.py captures it)
        batch_invariant=True,  # one entry's tiles for every T, no split K, no Gluon kernel (kernel_config)
    )

    def __init__(self, config, scheme):
        super().__init__(config, scheme)
        self._table = None  # tuned configs of this shape: {tokens: MoEKernelConfig}, or {} for defaults
        self._fitted = {}  # (layout, tokens) -> fitted MoEKernelConfig: no per-call lookup cost
        self._sync = {}  # device index -> the fused layer's int32 counters, zero between launches
        if config.device.type == "cuda" and scheme.name in _FUSED:
            # made now, not at the first call: a first call under torch.compile's CUDA graphs would take them from
            # the graphs' memory pool, which refuses allocations that outlive a recording (moeflow.ops)
            self._counters(config.device)

    def run(self, batch: ExpertBatch, weights: ExpertWeights) -> Tensor:
        return self.run_with(batch, weights, self.kernel_config(batch, weights))

    def run_with(self, batch: ExpertBatch, weights: ExpertWeights, kcfg, poison: bool = False) -> Tensor:
        """run() with explicit kernel configs ``kcfg`` (a MoEKernelConfig; tests and tuning call it).

        Returns [N, H] (sorted) or [E, C, H] (masked, zeros in empty slots), ``config.dtype``.
        poison: fill every intermediate and output buffer with NaN first, so unwritten elements show.
        Weights are used through their strides (the last dimension contiguous, as the layer's
        parameters are; an expert dimension of stride 0 is fine).
        """
        from ..kernels.common import RowLayout, unit_stride_rows
        from ..kernels.gemm.down import down
        from ..kernels.gemm.gate_up import gate_up
        from ..kernels.rows.quant import down_input, quantize_activation, quantize_rows
        config, scheme = self.config, self.scheme
        h = config.hidden_size
        layout = RowLayout.of(batch)
        if layout.rows == 0:
            return empty_output(batch, h, config.dtype)
        src = batch.source_rows  # rows by index: quantize the S source rows once, gather in gate_up
        x = batch.hidden.reshape(-1 if src is not None else layout.rows, h)
        weight_only = scheme.weight_only  # FP8 weights, layer-dtype activations
        if batch.hidden_scale is not None:
            xq, xs = self.input_activations(x, batch.hidden_scale.reshape(x.shape[0], -1))
        elif scheme.activations_quantized:
            xq, xs = quantize_activation(x, scheme.name) if src is not None else quantize_rows(x, scheme.name, layout)
        else:
            xq, xs = x, None
        xq, xs = unit_stride_rows(xq), None if xs is None else unit_stride_rows(xs)
        inter, extra = gate_up(xq, xs, weights.w13, weights.w13_scale,
                               layout, scheme.name, config.activation, config.dtype, kcfg.gate_up, poison,
                               source_rows=None if src is None else src.contiguous(),
                               copy_rows=None if batch.copy_rows is None else batch.copy_rows.contiguous(),
                               weight_only=weight_only)
        a, a_scale = (inter, None) if weight_only else down_input(inter, extra, scheme.name)
        out = down(a, a_scale, weights.w2, weights.w2_scale, batch.weights.reshape(-1).float().contiguous(),
                   layout, scheme.name, config.dtype, kcfg.down, poison, weight_only=weight_only)
        return out.view(*batch.hidden.shape[:-1], h) if batch.layout == MASKED else out

    def kernel_config(self, batch: ExpertBatch, weights: ExpertWeights):
        """Tuned (or default) configs for this batch, fitted to the scheme and dtype.

        Lookup key: tokens per rank, estimated from the batch's shape alone (no sync): N / top_k
        for sorted batches, the capacity C for masked ones (tokens a rank may send).
        """
        cfg = self.config
        e, i, h = weights.w13.shape[0], weights.w2.shape[2], weights.w2.shape[1]
        tokens = batch.hidden.shape[1] if batch.layout == MASKED else max(batch.num_rows // cfg.top_k, 1)
        key = (batch.layout, tokens, e, moeflow_env.KERNEL_ARCH.get())
        if key not in self._fitted:
            self._fitted[key] = self._fit(self._entry_for(tokens, e, i, h, batch.hidden.device), i, h)
        return self._fitted[key]

    def _fit(self, entry, i: int, h: int):
        """A tuned (or default) entry's two GEMM tiles made valid for this scheme and dtype (tiles.fit) ->
        MoEKernelConfig without its fused tiles; i, h: the intermediate and hidden sizes. Batch-invariant layers:
        without split K and Gluon kernels too (invariant_tiles)."""
        from ..kernels import configs as kc
        from ..kernels.gemm import tiles
        # operand bytes in shared memory: FP8 dots 1; the layer dtype's otherwise (weight-only FP8: its activations)
        nbytes = 1 if self.scheme.activations_quantized else self.config.dtype.itemsize
        budget = kernel_target(self.config.device).tile_budget
        fitted = kc.MoEKernelConfig(
            tiles.fit(entry.gate_up, fused_pair=True, scheme=self.scheme.name, elem_bytes=nbytes, n_size=i,
                      budget=budget),
            tiles.fit(entry.down, fused_pair=False, scheme=self.scheme.name, elem_bytes=nbytes, n_size=h,
                      budget=budget))
        return invariant_tiles(fitted) if self.config.batch_invariant else fitted

    def _fused_tiles(self, tokens: int, entry):
        """The entry's one-launch tiles for ``tokens`` (fitted), or None: no fused entry, an empty batch, more than
        FUSED_MAX_TOKENS tokens, or MOEFLOW_TRITON_FUSED=0."""
        from ..kernels.gemm import tiles
        if entry.fused is None or not 0 < tokens <= FUSED_MAX_TOKENS or not moeflow_env.TRITON_FUSED.get_bool():
            return None
        return tiles.fit_fused(entry.fused, self.scheme.name, budget=kernel_target(self.config.device).tile_budget)

    def fused_config(self, tokens: int, weights: ExpertWeights):
        """The tuned entry's FusedConfig for ``tokens`` (fitted), or None: no fused entry, an empty batch, more
        than FUSED_MAX_TOKENS tokens, or MOEFLOW_TRITON_FUSED=0."""
        if not 0 < tokens <= FUSED_MAX_TOKENS or not moeflow_env.TRITON_FUSED.get_bool():
            return None  # before the lookup: a large batch never reads the table's entry for it
        key = ("fused", tokens, weights.w13.shape[0], moeflow_env.KERNEL_ARCH.get())
        if key not in self._fitted:
            self._fitted[key] = self._fused_tiles(tokens, self._entry(tokens, weights, weights.w13.device))
        return self._fitted[key]

    def run_fused(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, weights: ExpertWeights,
                  fused_config) -> Tensor:
        """The whole layer after routing in one launch (kernels/gemm/fused_layer.py) -> [T, H] layer dtype: for
        small single-process batches where the tuned table says so (MoEKernelConfig.fused), route's ids and weights
        go straight into one launch for the local dispatcher's sort, both GEMMs and its top-k sum."""
        from ..kernels.common import unit_stride_rows
        from ..kernels.gemm.fused_layer import fused_layer
        cfg = self.config
        return fused_layer(unit_stride_rows(hidden), topk_ids.to(torch.int32).contiguous(),
                           topk_weights.float().contiguous(), weights.w13, weights.w13_scale, weights.w2,
                           weights.w2_scale, self.scheme.name, cfg.activation, cfg.dtype, fused_config,
                           self._counters(hidden.device))

    def _counters(self, device: torch.device) -> Tensor:
        """This layer's fused-launch counters on ``device`` (made, zeroed, when the runner is built on a CUDA device,
        else at the first call there), as many as any batch and tile set may need; each launch leaves them zero for
        the next. Launches of one layer must therefore not overlap: calls (or graph replays) of the same layer on
        two streams at once are not supported. Made once, not per call: a per-call zeroing would be one more node
        in a captured graph."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._sync:
            from ..kernels.configs import FusedConfig
            from ..kernels.gemm.fused_layer import counters_size
            cfg = self.config
            most = FusedConfig(block_n1=16, block_n2=16, split1=2, split2=2)  # the narrowest tiles, split
            n = counters_size(FUSED_MAX_TOKENS, cfg.top_k, cfg.hidden_size, cfg.intermediate_size, most)
            self._sync[index] = torch.zeros(n, dtype=torch.int32, device=torch.device("cuda", index))
        return self._sync[index]

    def _entry(self, tokens: int, weights: ExpertWeights, device: torch.device):
        """The tuned table's entry nearest ``tokens`` (the table read once), or the documented defaults."""
        e, i, h = weights.w13.shape[0], weights.w2.shape[2], weights.w2.shape[1]
        return self._entry_for(tokens, e, i, h, device)

    def _entry_for(self, tokens: int, e: int, i: int, h: int, device: torch.device):
        """_entry for E experts of intermediate size i and hidden size h (no weights needed: `moeflow check`); a
        batch-invariant layer's is the entry of INVARIANT_TOKENS whatever ``tokens``."""
        if self.config.batch_invariant:
            tokens = INVARIANT_TOKENS
        from ..kernels import configs as kc
        from ..kernels.gemm import tiles
        target = kernel_target(device)
        cc = None if target is INTERPRETER else target.capability  # a CPU under MOEFLOW_KERNEL_ARCH: that target's
        if self._table is None:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            if moeflow_env.KERNEL_ARCH.get_choice():  # another architecture's rules: not this GPU's own tuned tables
                name = f"{target.arch} (MOEFLOW_KERNEL_ARCH)"
            self._table = kc.find_table(name, e, i, h, self.scheme.name, capability=cc) or {}
        if self._table:
            return kc.nearest(self._table, tokens)
        return tiles.default_config(tokens, self.config.top_k, e, self.scheme.name, hidden=h, inter=i, capability=cc)

    def describe_kernels(self, tokens: int, local_experts: int, masked: bool, fused: bool) -> str:
        """What a call of ``tokens`` tokens runs, in words (`moeflow check`): the one-launch layer (``fused``: the plan
        allows it) or each GEMM's kernel (kernels/gemm/choice.py) and tile, for operands laid out as the layer's."""
        from ..kernels.gemm import choice
        cfg = self.config
        i, h = cfg.intermediate_size, cfg.hidden_size
        entry = self._entry_for(tokens, local_experts, i, h, cfg.device)
        f = self._fused_tiles(tokens, entry) if fused else None
        if f is not None:
            return f"one launch (fused layer) {f.block_n1}/{f.block_n2}-wide tiles, split {f.split1}/{f.split2}"
        fitted = self._fit(entry, i, h)
        gate_up, down = fitted.gate_up, fitted.down
        rows = tokens if masked else tokens * cfg.top_k
        c_gate_up, c_down = choice.describe(gate_up, down, scheme=self.scheme.name, dtype=cfg.dtype, hidden=h, inter=i,
                                            rows=rows, masked=masked, device=cfg.device,
                                            weight_only=self.scheme.weight_only)
        return f"gate_up {choice.tile_text(gate_up, c_gate_up)}; down {choice.tile_text(down, c_down)}"


def invariant_tiles(cfg):
    """A fitted MoEKernelConfig made batch-invariant: no split K (a row's K sum in one program, not partials summed in
    T-dependent groups) and no Gluon kernel (their use depends on the call's operands); the tiles themselves stay, one
    set for every T (kernel_config)."""
    from dataclasses import replace
    plain = dict(split_k=1, scale_overlap=0, warp_specialize=0)
    return replace(cfg, gate_up=replace(cfg.gate_up, **plain), down=replace(cfg.down, **plain), fused=None)
