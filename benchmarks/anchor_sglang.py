"""SGLang's Triton fused-MoE GEMMs on bench_layer.py's rows: an external anchor, GEMM launches only.

    bash benchmarks/fetch_sglang_anchor.sh          # once: their kernel, config lookup and configs -> .anchors/sglang
    python benchmarks/anchor_sglang.py --out $OUT [--presets ...] [--schemes none,fp8-block] [--tokens ...]
    python benchmarks/anchor_sglang.py --self-check # CPU: align, config lookup, inputs, their kernel in Triton's
                                                    # interpreter; --compile-sm90 adds compiling every row for sm_90

What runs is SGLang's own code, unmodified and never committed here: .anchors/sglang/fused_moe_triton_kernels.py (the
@triton.jit fused_moe_kernel and its launcher invoke_fused_moe_kernel) and fused_moe_triton_config.py (their tuned-
config lookup, try_get_optimal_moe_config, reading .anchors/sglang/configs through SGLANG_MOE_CONFIG_DIR, or a
copy made from configs_bundle.json where those files did not all arrive). Their
modules import SGLang internals; this harness puts minimal stand-ins into sys.modules before loading them (platform
probes answered from torch: is_cuda, is_sm90_supported, is_arch_support_pdl = sm >= 90; batch-invariant mode off;
deterministic inference off; no config override; MoE padding 0; their activation-quantization kernels replaced by
a stub that raises, since every activation reaches their launcher already quantized). No sglang, sgl_kernel or
vllm is needed.

Per preset (qwen3-30b-a3b, deepseek-v3, mixtral-8x7b), scheme (none = bf16, fp8-block = float8_e4m3fn weights with
128x128 float32 block scales, activations 1x128 groups) and T:
    config      SGLang's choice, as their fused_experts_impl makes it: try_get_optimal_moe_config(w13 [E, 2I, H],
                w2 [E, H, I], top_k, "fp8_w8a8" or None, M=T, block_shape, return_down_config=True): the JSON
                E=<E>,N=<I>,device_name=<torch.cuda.get_device_name()>[,dtype=..,block_shape=..][_down].json of
                this triton version's folder, else the newest other version's, else their default; the nearest M
                key. Their "USE_TMA": true (in the H100 tables for Qwen3 at M=4096) turns on their TMA paths as they
                do: the gate_up output in sorted order (c_sorted), TMA descriptors for the down GEMM's operands.
    config_source / down_config_source   the file their lookup read (from their log records) or "default"
    gemm_us     the two fused_moe_kernel launches only, through their launcher, eager: triton.testing.do_bench
                (warmup 10 ms, rep --rep-ms, median, L2 zeroed before each repetition), in µs
    gemm_graph_us  the same two launches captured once as a CUDA graph and replayed (moeflow.benchmark.graph_us,
                bench_layer's method for its headline figure): no host launch cost
    up_us, down_us  each launch alone, eager
    rel_err     both GEMMs' outputs against a float32 torch reference on exactly their inputs (dequantized), the
                larger of the two, on up to 64 sampled token copies: at T=16 (else the smallest T) and on every row
                where TMA is on; a misuse of their kernel shows as an error far above bf16 rounding (~3e-3)
Not timed (done before, in torch): the routing (random logits -> softmax top-k, renormalized; seeded), the
moe_align_block_size sort (a torch version of sgl_kernel's op, below: same sorted_token_ids / expert_ids /
num_tokens_post_padded layout, pad id T*top_k, +1 bucket convention), the activation silu(gate) * up of the gate_up
output, the 1x128 FP8 quantization of the hidden states and of the intermediate (SGLang's per-token-group quant:
scale = amax / 448, eps 1e-10; their launcher's pre-quantized path, as SGLANG_OPT_MOE_QUANT_ONCE uses it), and the
top-k sum after the down GEMM. So the figure is their GEMM time alone, against moeflow's experts-only stages.
Weights: uniform +-1/sqrt(fan_in), made a few experts at a time (as moeflow.tune.autotune.random_weights) so that
DeepSeek-V3's 22.5 GB (bf16) of experts need no whole-tensor temporaries; one (preset, scheme) is resident at a time.
Before timing, every row's two kernels are compiled in --precompile-workers processes (their launcher called with
meta tensors in Triton's warmup mode), filling Triton's on-disk cache that the timing process then reads.
Writes anchor.csv (row by row) and anchor.json under --out; prints the table, then one summary line.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import csv
import importlib.util
import inspect
import json
import logging
import math
import os
import re
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128  # fp8-block: weight blocks 128 x 128, activation groups 1 x 128 (SGLang's block_shape [128, 128])
SCHEMES = ("none", "fp8-block")
FIELDS = ["preset", "scheme", "T", "gemm_us", "gemm_graph_us", "up_us", "down_us", "config", "config_source",
          "down_config_source", "experts_hit", "rel_err", "doc_anchor_us", "note"]
CHECK_T = 16
ERR_LIMIT = 2e-2  # a rel_err above this is flagged: bf16 output rounding alone is ~3e-3
MODULE_PREFIX = "_sglang_anchor"

# ----------------------------------------------------------------------------------------------------------------
# SGLang's modules, loaded behind stand-ins for the internals they import

# test knobs: None = answer from the hardware (the self-check forces a device name, sm_90 and PDL)
OVERRIDES = {"device_name": None, "sm90": None, "pdl": None}


def _is_cuda() -> bool:
    return torch.cuda.is_available() and torch.version.cuda is not None


def _is_hip() -> bool:
    return torch.version.hip is not None


def _sm_major() -> int:
    return torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 0


def _is_sm90_supported() -> bool:  # sglang.srt.utils: SM 9.x and CUDA >= 12.3
    if OVERRIDES["sm90"] is not None:
        return OVERRIDES["sm90"]
    return (_is_cuda() and _sm_major() == 9
            and tuple(int(v) for v in torch.version.cuda.split(".")[:2]) >= (12, 3))


def _is_arch_support_pdl() -> bool:  # sglang.kernels.jit.utils: not HIP, SM >= 9
    if OVERRIDES["pdl"] is not None:
        return OVERRIDES["pdl"]
    return _is_cuda() and _sm_major() >= 9


def _device_name(device_id: int = 0) -> str:
    if OVERRIDES["device_name"] is not None:
        return OVERRIDES["device_name"]
    return torch.cuda.get_device_name(device_id) if torch.cuda.is_available() else "cpu"


def _quant_stub(*args, **kwargs):
    raise RuntimeError("anchor_sglang: SGLang's launcher was about to quantize an activation itself; the harness "
                       "hands it float8 activations quantized outside the timed region")


class _EnvVar:
    def __init__(self, name):
        self.name = name

    def get(self):
        return os.environ.get(self.name, "0").lower() in ("1", "true", "yes")


class _Envs:  # sglang.srt.environ.envs: every flag read as a boolean environment variable, default off
    def __getattr__(self, name):
        return _EnvVar(name)


def install_shims() -> None:
    """Minimal stand-ins, in sys.modules, for the SGLang internals their two modules import (this release's layout
    and the older ones')."""
    ns = types.SimpleNamespace
    exec_ctx = ns(deterministic=ns(enable_deterministic_inference=False),
                  moe=ns(enable_fused_moe_sum_all_reduce=False))
    quant_fp8 = dict(per_token_group_quant_fp8=_quant_stub, scaled_fp8_quant=_quant_stub,
                     sglang_per_token_group_quant_fp8=_quant_stub)
    quant_int8 = dict(per_token_group_quant_int8=_quant_stub, per_token_quant_int8=_quant_stub,
                      sglang_per_token_group_quant_int8=_quant_stub)
    leaves = {
        "sglang.kernels.jit.utils": dict(is_arch_support_pdl=_is_arch_support_pdl),
        "sglang.kernels.ops.quantization.fp8_kernel": quant_fp8,
        "sglang.kernels.ops.quantization.int8_kernel": quant_int8,
        "sglang.srt.layers.quantization.fp8_kernel": quant_fp8,
        "sglang.srt.layers.quantization.int8_kernel": quant_int8,
        "sglang.srt.batch_invariant_ops": dict(is_batch_invariant_mode_enabled=lambda: False),
        "sglang.srt.environ": dict(envs=_Envs()),
        "sglang.srt.layers.moe.utils": dict(get_moe_padding_size=lambda is_aiter_moe=False: 0),
        "sglang.srt.utils": dict(cpu_has_amx_support=lambda: False, is_cpu=lambda: False, is_cuda=_is_cuda,
                                 is_hip=_is_hip, is_sm90_supported=_is_sm90_supported,
                                 get_device_name=_device_name,
                                 get_bool_env_var=lambda name, default="false": _EnvVar(name).get()),
        "sglang.srt.runtime_context": dict(get_exec=lambda: exec_ctx),
        "sglang.srt.layers.moe.moe_runner.triton_utils": dict(get_config=lambda: None),
        "sglang.srt.layers.moe.fused_moe_triton": dict(get_config=lambda: None),
    }
    for name, attrs in leaves.items():
        parts = name.split(".")
        for i in range(1, len(parts)):
            pkg = ".".join(parts[:i])
            if pkg not in sys.modules or not getattr(sys.modules[pkg], "__anchor_shim__", False):
                sys.modules[pkg] = m = types.ModuleType(pkg)
                m.__path__, m.__anchor_shim__ = [], True
        m = sys.modules.get(name)
        if m is None or not getattr(m, "__anchor_shim__", False):
            sys.modules[name] = m = types.ModuleType(name)
            m.__path__, m.__anchor_shim__ = [], True
        m.__dict__.update(attrs)


def _load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    keep, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no __pycache__ in the extracted folder
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = keep
    return module


class SGLang:
    """Their kernel module (.kern) and config module (.conf) from anchor_dir, with the calls this harness makes."""

    def __init__(self, anchor_dir: Path):
        anchor_dir = Path(anchor_dir).resolve()
        for f in ("fused_moe_triton_kernels.py", "fused_moe_triton_config.py"):
            if not (anchor_dir / f).is_file():
                raise SystemExit(f"{anchor_dir / f} missing: run benchmarks/fetch_sglang_anchor.sh first")
        install_shims()
        self.dir = anchor_dir
        self.config_root, self.config_note = _config_root(anchor_dir)
        os.environ["SGLANG_MOE_CONFIG_DIR"] = str(self.config_root)  # their lookup reads <dir>/configs/triton_*/
        self.kern = _load_module(f"{MODULE_PREFIX}.fused_moe_triton_kernels", anchor_dir / "fused_moe_triton_kernels.py")
        self.conf = _load_module(f"{MODULE_PREFIX}.fused_moe_triton_config", anchor_dir / "fused_moe_triton_config.py")
        if not hasattr(self.conf.logger, "warning_once"):  # SGLang patches this onto logging.Logger
            self.conf.logger.warning_once = self.conf.logger.warning
        self.conf.logger.setLevel(logging.ERROR)  # config_sources reads what their lookup logs
        self.invoke_params = inspect.signature(self.kern.invoke_fused_moe_kernel).parameters
        self.config_params = inspect.signature(self.conf.try_get_optimal_moe_config).parameters
        manifest = anchor_dir / "MANIFEST.txt"
        self.source = manifest.read_text().splitlines()[0] if manifest.is_file() else "unknown"

    def invoke_kwargs(self, **kw) -> dict:
        """kw restricted to invoke_fused_moe_kernel's parameters; a wanted (truthy) one it lacks is an error."""
        missing = [k for k, v in kw.items() if k not in self.invoke_params and v not in (None, False)]
        if missing:
            raise RuntimeError(f"this SGLang's invoke_fused_moe_kernel takes no {missing} ({self.source})")
        return {k: v for k, v in kw.items() if k in self.invoke_params}

    def pdl(self) -> bool:
        f = getattr(self.kern, "is_arch_support_pdl", None)
        return bool(f()) if f else False

    def swap_ab(self, cfg: dict) -> bool:
        f = getattr(self.kern, "should_enable_swap_ab", None)
        return bool(f(cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"])) if f else False

    def tma_supported(self) -> bool:
        f = getattr(self.kern, "support_tensor_descriptor", None)
        return bool(f()) if f else False

    def resolve(self, shape: Shape, tokens: int):
        """-> (up config, down config or None, up TMA, down TMA): SGLang's _prepare_fused_moe_run's choice."""
        kw = dict(block_shape=[GROUP, GROUP] if shape.fp8 else None, per_channel_quant=False, return_down_config=True)
        kw = {k: v for k, v in kw.items() if k in self.config_params}
        got = self.conf.try_get_optimal_moe_config((shape.E, 2 * shape.I, shape.H), (shape.E, shape.H, shape.I),
                                                    shape.K, "fp8_w8a8" if shape.fp8 else None, tokens, **kw)
        up, (down, _) = got if kw.get("return_down_config") else (got, (None, None))
        up = dict(up)
        up_tma = bool(up.pop("USE_TMA", False)) and self.tma_supported()
        down_tma = False
        if down is not None:
            down = dict(down)
            down_tma = bool(down.pop("USE_TMA", False)) and self.tma_supported()
        return up, down, up_tma, down_tma

    def config_sources(self, shape: Shape) -> tuple[str, str]:
        """(gate_up, down): the config file their lookup reads for this shape on this device, or "default"; the
        down table's "=up" where their lookup reuses the gate_up one, "-" where this release has no down tables.
        Taken from their own log records (their lookup is lru-cached: cleared first)."""
        conf = self.conf
        args = (shape.E, shape.I, "fp8_w8a8" if shape.fp8 else None, GROUP if shape.fp8 else 0,
                GROUP if shape.fp8 else 0)
        has_down = "down_moe" in inspect.signature(conf.get_moe_configs.__wrapped__).parameters
        conf.get_moe_configs.cache_clear()
        out = []
        for down in (False, True) if has_down else (False,):
            with _log_records(conf.logger) as recs:
                conf.get_moe_configs(*args, **({"down_moe": down} if has_down else {}))
            out.append(_source_of(recs, self.config_root / "configs"))
        return out[0], out[1] if has_down else "-"


def _config_root(anchor_dir: Path) -> tuple[Path, str]:
    """The folder whose configs/ their lookup reads: anchor_dir where its configs/ holds every file of
    configs_bundle.json as written there, else a temporary copy made from the bundle (file names holding '=', ','
    or ' ' may not survive a transfer)."""
    bundle_file = anchor_dir / "configs_bundle.json"
    if not bundle_file.is_file():
        return anchor_dir, "configs/ as found (no bundle)"
    bundle = json.loads(bundle_file.read_text())

    def intact(rel, text):
        f = anchor_dir / "configs" / rel
        return f.is_file() and f.read_text() == text
    if all(intact(rel, text) for rel, text in bundle.items()):
        return anchor_dir, f"configs/ ({len(bundle)} files)"
    import tempfile
    root = Path(tempfile.mkdtemp(prefix="sglang-anchor-"))
    for rel, text in bundle.items():
        (root / "configs" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "configs" / rel).write_text(text)
    return root, f"configs/ incomplete: {len(bundle)} files recreated from configs_bundle.json in {root}"


@contextlib.contextmanager
def _log_records(logger):
    recs = []

    class Keep(logging.Handler):
        def emit(self, record):
            recs.append(record.getMessage())

    h, level, prop = Keep(), logger.level, logger.propagate
    logger.addHandler(h)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield recs
    finally:
        logger.removeHandler(h)
        logger.setLevel(level)
        logger.propagate = prop


def _source_of(messages: list[str], configs: Path) -> str:
    for msg in messages:
        if "reusing the tuned up-projection config" in msg:
            return "=up"
        found = re.findall(r"config from (.+?\.json)", msg)
        if found:
            path = Path(found[-1])
            try:
                return str(path.resolve().relative_to(configs.resolve()))
            except ValueError:
                return str(path)
        if "Using default MoE kernel config" in msg:
            return "default"
    return "?"


# ----------------------------------------------------------------------------------------------------------------
# inputs (our own code)

@dataclass(frozen=True)
class Shape:
    E: int
    H: int
    I: int  # the expert intermediate size
    K: int
    fp8: bool

    @staticmethod
    def of(preset: str, scheme: str) -> Shape:
        from moeflow.presets import PRESETS
        p = PRESETS[preset]
        return Shape(p["num_experts"], p["hidden_size"], p["intermediate_size"], p["top_k"], scheme == "fp8-block")


def quant_block_weight(w: torch.Tensor):
    """[c, n, k] float -> (float8 [c, n, k], float32 scales [c, n/128, k/128]): 128 x 128 blocks, amax / 448."""
    c, n, k = w.shape
    b = w.float().reshape(c, n // GROUP, GROUP, k // GROUP, GROUP)
    s = b.abs().amax(dim=(2, 4)).clamp_min(1e-12) / FP8_MAX
    q = (b / s[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(c, n, k)
    return q, s


def quant_groups(x: torch.Tensor, chunk_rows: int = 1 << 15):
    """[M, K] -> (float8 [M, K], float32 [M, K/128]): SGLang's per-token-group quantization (groups of 128 along K,
    scale = max(amax, 1e-10) / 448), a slice of rows at a time."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, k // GROUP), dtype=torch.float32, device=x.device)
    for lo in range(0, m, chunk_rows):
        g = x[lo:lo + chunk_rows].float().reshape(-1, k // GROUP, GROUP)
        sc = g.abs().amax(-1).clamp_min(1e-10) / FP8_MAX
        q[lo:lo + chunk_rows] = (g / sc[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(-1, k)
        s[lo:lo + chunk_rows] = sc
    return q, s


def dequant_rows(q: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    if s is None:
        return q.float()
    return (q.float().reshape(q.shape[0], -1, GROUP) * s[..., None]).reshape(q.shape)


def dequant_weight(q: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    """One expert's [n, k] weight in float32."""
    if s is None:
        return q.float()
    return q.float() * s.repeat_interleave(GROUP, 0).repeat_interleave(GROUP, 1)


def make_weights(shape: Shape, device, dtype=torch.bfloat16, seed: int = 1, chunk_bytes: int = 256 << 20):
    """(w13 [E, 2I, H], w13 scale, w2 [E, H, I], w2 scale): uniform +-1/sqrt(fan_in), drawn a few experts at a time
    (float32 draws of at most chunk_bytes); bf16 (dtype), or float8 with [E, n/128, k/128] float32 block scales."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for n, k in ((2 * shape.I, shape.H), (shape.H, shape.I)):
        w = torch.empty((shape.E, n, k), dtype=FP8 if shape.fp8 else dtype, device=device)
        s = torch.empty((shape.E, n // GROUP, k // GROUP), dtype=torch.float32, device=device) if shape.fp8 else None
        step = max(1, min(shape.E, chunk_bytes // (n * k * 4)))
        for lo in range(0, shape.E, step):
            hi = min(shape.E, lo + step)
            draw = torch.empty((hi - lo, n, k), dtype=torch.float32, device=device)
            draw.uniform_(-1, 1, generator=gen).mul_(1 / math.sqrt(k))
            if shape.fp8:
                w[lo:hi], s[lo:hi] = quant_block_weight(draw)
            else:
                w[lo:hi] = draw
            del draw
        out += [w, s]
    return tuple(out)


def routing(shape: Shape, tokens: int, device, dtype=torch.bfloat16, seed: int = 0):
    """-> hidden [T, H] dtype, topk_ids [T, K] int32, topk_weights [T, K] float32 (softmax top-k of random logits,
    renormalized), deterministic in seed."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(tokens, shape.E, generator=gen, device=device)
    w, ids = torch.softmax(logits, dim=-1).topk(shape.K, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    x = torch.randn(tokens, shape.H, generator=gen, device=device).to(dtype)
    return x, ids.to(torch.int32).contiguous(), w.float().contiguous()


def align_sizes(numel: int, block: int, num_experts: int) -> tuple[int, int]:
    """(len(sorted_token_ids), len(expert_ids)) as SGLang's moe_align_block_size allocates them."""
    if numel < num_experts + 1:
        padded = numel * block
    else:
        padded = numel + (num_experts + 1) * (block - 1)
    padded = (padded + 3) // 4 * 4  # their align kernel pads sorted ids with int4 stores
    return padded, -(-padded // block)


def moe_align_block_size(topk_ids: torch.Tensor, block: int, num_experts: int):
    """A torch version of SGLang's moe_align_block_size (sgl_kernel's op, num_experts + 1 buckets: -1 ids first,
    none here): -> sorted_token_ids int32 [padded] (the flat copy indices t * top_k + k grouped by expert, experts in
    order, each group padded to a multiple of block with the pad id topk_ids.numel()), expert_ids int32 [blocks]
    (each block's expert; -1 past the used blocks, which the kernel never reads), num_tokens_post_padded int32 [1].
    Within an expert the copies keep their flat order (the CUDA op's atomics give some order)."""
    device = topk_ids.device
    flat = topk_ids.flatten().long()
    numel = flat.numel()
    padded_len, blocks = align_sizes(numel, block, num_experts)
    sorted_ids = torch.full((padded_len,), numel, dtype=torch.int32, device=device)
    expert_ids = torch.full((blocks,), -1, dtype=torch.int32, device=device)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block - 1) // block * block
    start_padded = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    dest = start_padded[experts] + torch.arange(numel, device=device) - start[experts]
    sorted_ids[dest] = order.to(torch.int32)
    used = padded // block
    total = int(used.sum())
    expert_ids[:total] = torch.repeat_interleave(torch.arange(num_experts, device=device, dtype=torch.int32), used)
    return sorted_ids, expert_ids, (padded.sum() if numel else padded.new_zeros(())).reshape(1).to(torch.int32)


def moe_align_reference(topk_ids: torch.Tensor, block: int, num_experts: int):
    """The same, as plain loops (the self-check's reference)."""
    flat = topk_ids.flatten().tolist()
    numel = len(flat)
    ids, experts = [], []
    for e in range(num_experts):
        mine = [i for i, x in enumerate(flat) if x == e]
        if not mine:
            continue
        mine += [numel] * (-len(mine) % block)
        ids += mine
        experts += [e] * (len(mine) // block)
    padded_len, blocks = align_sizes(numel, block, num_experts)
    return ids + [numel] * (padded_len - len(ids)), experts + [-1] * (blocks - len(experts)), len(ids)


@dataclass
class Row:
    """One (shape, T): SGLang's configs and every tensor the two launches read or write."""
    T: int
    up_cfg: dict
    down_cfg: dict | None
    up_tma: bool
    down_tma: bool
    ids: torch.Tensor
    w: torch.Tensor
    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    ntp: torch.Tensor
    a1: torch.Tensor
    a1_s: torch.Tensor | None
    c1: torch.Tensor
    a2: torch.Tensor | None = None
    a2_s: torch.Tensor | None = None
    c3: torch.Tensor | None = None

    def describe(self, sg: SGLang, fp8: bool) -> str:
        def f(c, tma):
            s = (f"M{c['BLOCK_SIZE_M']} N{c['BLOCK_SIZE_N']} K{c['BLOCK_SIZE_K']} G{c['GROUP_SIZE_M']} "
                 f"w{c.get('num_warps', 4)} s{c.get('num_stages', 3)}")
            return s + (" tma" if tma else "") + (" swapAB" if fp8 and sg.swap_ab(c) else "")
        return f"up {f(self.up_cfg, self.up_tma)}; down {f(self.down_cfg or self.up_cfg, self.down_tma)}"


def total_rows(shape: Shape, tokens: int, up_cfg: dict, down_tma: bool) -> int:
    """Rows of the gate_up output: T * top_k, plus SGLang's sorted-layout padding when the down GEMM uses TMA."""
    numel = tokens * shape.K
    return numel + (min(numel, shape.E + 1) * (up_cfg["BLOCK_SIZE_M"] - 1) if down_tma else 0)


def empty_weights(shape: Shape, device="meta", dtype=torch.bfloat16):
    """Weights as make_weights makes them, uninitialized (meta: shapes, strides and dtypes only)."""
    m = dict(device=device)
    if not shape.fp8:
        return (torch.empty((shape.E, 2 * shape.I, shape.H), dtype=dtype, **m), None,
                torch.empty((shape.E, shape.H, shape.I), dtype=dtype, **m), None)
    return (torch.empty((shape.E, 2 * shape.I, shape.H), dtype=FP8, **m),
            torch.empty((shape.E, 2 * shape.I // GROUP, shape.H // GROUP), dtype=torch.float32, **m),
            torch.empty((shape.E, shape.H, shape.I), dtype=FP8, **m),
            torch.empty((shape.E, shape.H // GROUP, shape.I // GROUP), dtype=torch.float32, **m))


def empty_row(sg: SGLang, shape: Shape, tokens: int, device="meta", dtype=torch.bfloat16) -> Row:
    """A row as build_row makes it, uninitialized (meta: what the precompile's warmup launches need)."""
    up, down, up_tma, down_tma = sg.resolve(shape, tokens)
    m = dict(device=device)
    numel = tokens * shape.K
    plen, blocks = align_sizes(numel, up["BLOCK_SIZE_M"], shape.E)
    rows = total_rows(shape, tokens, up, down_tma)
    act = FP8 if shape.fp8 else dtype
    scales = (lambda r, k: torch.empty((r, k // GROUP), dtype=torch.float32, **m)) if shape.fp8 else (lambda r, k: None)
    return Row(tokens, up, down, up_tma, down_tma, ids=torch.empty((tokens, shape.K), dtype=torch.int32, **m),
               w=torch.empty((tokens, shape.K), dtype=torch.float32, **m),
               sorted_ids=torch.empty(plen, dtype=torch.int32, **m), expert_ids=torch.empty(blocks, dtype=torch.int32, **m),
               ntp=torch.empty(1, dtype=torch.int32, **m), a1=torch.empty((tokens, shape.H), dtype=act, **m),
               a1_s=scales(tokens, shape.H), c1=torch.empty((rows, 2 * shape.I), dtype=dtype, **m),
               a2=torch.empty((rows, shape.I), dtype=act, **m), a2_s=scales(rows, shape.I),
               c3=torch.empty((tokens, shape.K, shape.H), dtype=dtype, **m))


def launch_kwargs(sg: SGLang, shape: Shape, weights, row: Row, gemm: str) -> dict:
    """invoke_fused_moe_kernel's arguments for one GEMM, as SGLang's _fused_moe_kernel_sequence passes them
    (no bias, no zero points, not EP: filter_expert False; compute type from the output dtype)."""
    import triton.language as tl
    w13, w13_s, w2, w2_s = weights
    ctype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[row.c1.dtype]
    kw = dict(bias=None, B_zp=None, topk_weights=row.w, topk_ids=row.ids, sorted_token_ids=row.sorted_ids,
              expert_ids=row.expert_ids, num_tokens_post_padded=row.ntp, compute_type=ctype, use_fp8_w8a8=shape.fp8,
              use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False, per_channel_quant=False,
              block_shape=[GROUP, GROUP] if shape.fp8 else None, filter_expert=False)
    if gemm == "up":
        kw.update(A=row.a1, B=w13, C=row.c1, A_scale=row.a1_s, B_scale=w13_s, mul_routed_weight=False,
                  top_k=shape.K, config=row.up_cfg, c_sorted=row.down_tma, b_use_tma=row.up_tma)
    else:
        kw.update(A=row.a2, B=w2, C=row.c3, A_scale=row.a2_s, B_scale=w2_s, mul_routed_weight=True, top_k=1,
                  config=row.down_cfg or row.up_cfg, a_use_tma=row.down_tma, b_use_tma=row.down_tma,
                  router_topk=shape.K)
    return sg.invoke_kwargs(**kw)


def build_row(sg: SGLang, shape: Shape, weights, tokens: int, device, dtype=torch.bfloat16, seed: int = 0) -> Row:
    """Routing, the align sort, the quantized input and the buffers; runs the gate_up GEMM once (not timed) to make
    the down GEMM's input: silu(gate) * up of its output, 1x128-quantized for fp8-block."""
    up, down, up_tma, down_tma = sg.resolve(shape, tokens)
    x, ids, w = routing(shape, tokens, device, dtype, seed)
    sorted_ids, expert_ids, ntp = moe_align_block_size(ids, up["BLOCK_SIZE_M"], shape.E)
    a1, a1_s = quant_groups(x) if shape.fp8 else (x, None)
    rows = total_rows(shape, tokens, up, down_tma)
    row = Row(tokens, up, down, up_tma, down_tma, ids, w, sorted_ids, expert_ids, ntp, a1, a1_s,
              c1=torch.zeros((rows, 2 * shape.I), dtype=dtype, device=device),
              c3=torch.zeros((tokens, shape.K, shape.H), dtype=dtype, device=device))
    sg.kern.invoke_fused_moe_kernel(**launch_kwargs(sg, shape, weights, row, "up"))
    h = torch.empty((rows, shape.I), dtype=dtype, device=device)
    step = 1 << 15
    for lo in range(0, rows, step):  # SGLang's silu_and_mul: gate first, float32 math
        g = row.c1[lo:lo + step].float()
        h[lo:lo + step] = torch.nn.functional.silu(g[:, :shape.I]) * g[:, shape.I:]
    row.a2, row.a2_s = quant_groups(h) if shape.fp8 else (h, None)
    return row


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


def check_row(shape: Shape, weights, row: Row, samples: int = 64, seed: int = 0) -> tuple[float, float]:
    """(gate_up, down) relative errors of the last launches' outputs against float32 references on their exact
    inputs (dequantized), on up to ``samples`` of the T * top_k token copies."""
    w13, w13_s, w2, w2_s = weights
    numel = row.T * shape.K
    dev = row.c1.device
    if numel <= samples:
        r = torch.arange(numel, device=dev)
    else:
        r = torch.randperm(numel, generator=torch.Generator().manual_seed(seed))[:samples].to(dev)
    t, e = r // shape.K, row.ids.flatten().long()[r]
    pos = r
    if row.down_tma:  # gate_up output and down input in sorted order: copy -> its place in sorted_token_ids
        inv = torch.full((numel + 1,), -1, dtype=torch.long, device=dev)
        inv[row.sorted_ids.long()] = torch.arange(row.sorted_ids.numel(), device=dev)
        pos = inv[r]
    a1 = dequant_rows(row.a1[t], None if row.a1_s is None else row.a1_s[t])
    a2 = dequant_rows(row.a2[pos], None if row.a2_s is None else row.a2_s[pos])
    up_ref = torch.empty((len(r), 2 * shape.I), dtype=torch.float32, device=dev)
    down_ref = torch.empty((len(r), shape.H), dtype=torch.float32, device=dev)
    for ex in e.unique().tolist():
        sel = (e == ex).nonzero().flatten()
        up_ref[sel] = a1[sel] @ dequant_weight(w13[ex], None if w13_s is None else w13_s[ex]).T
        down_ref[sel] = a2[sel] @ dequant_weight(w2[ex], None if w2_s is None else w2_s[ex]).T
    down_ref *= row.w.flatten()[r][:, None]
    return (relative_error(row.c1[pos].float(), up_ref),
            relative_error(row.c3.reshape(numel, shape.H)[r].float(), down_ref))


# ----------------------------------------------------------------------------------------------------------------
# compiling ahead: their launcher in Triton's warmup mode

class _WarmupKernel:
    """Stands in for their fused_moe_kernel while their launcher runs: kernel[grid](...) compiles, launches nothing."""

    def __init__(self, jit):
        self.jit = jit

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.jit.run(*args, grid=grid, warmup=True, **kwargs)


@contextlib.contextmanager
def warmup_mode(sg: SGLang):
    real = sg.kern.fused_moe_kernel
    sg.kern.fused_moe_kernel = _WarmupKernel(real)
    try:
        yield
    finally:
        sg.kern.fused_moe_kernel = real


def warm_rows(sg: SGLang, jobs, device="meta") -> list[tuple]:
    """Compile both launches of every (preset, scheme, T) in jobs (meta tensors) -> [(job, None or the error)]."""
    done = []
    with warmup_mode(sg):
        for preset, scheme, tokens in jobs:
            shape = Shape.of(preset, scheme)
            try:
                weights = empty_weights(shape, device)
                row = empty_row(sg, shape, tokens, device)
                for gemm in ("up", "down"):
                    sg.kern.invoke_fused_moe_kernel(**launch_kwargs(sg, shape, weights, row, gemm))
                done.append(((preset, scheme, tokens), None))
            except Exception as exc:  # noqa: BLE001 (reported; the timing run meets it again)
                done.append(((preset, scheme, tokens), f"{type(exc).__name__}: {exc}"[:300]))
    return done


def _precompile_worker(anchor_dir: str, jobs) -> list[tuple]:
    fake = os.environ.get("ANCHOR_SGLANG_SM90_DEVICE")  # the self-check's: compile for sm_90 without a GPU
    if fake:
        from triton.runtime import driver
        driver.set_active(_Sm90Driver())
        OVERRIDES.update(device_name=fake, sm90=True, pdl=True)
    return warm_rows(SGLang(Path(anchor_dir)), jobs)


def precompile(anchor_dir: Path, jobs, workers: int) -> list[tuple]:
    """warm_rows over jobs in spawned worker processes (Triton's on-disk cache then holds every kernel)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    workers = max(1, min(workers, len(jobs)))
    # the largest rows compile the most distinct kernels: deal them out first
    jobs = sorted(jobs, key=lambda j: -j[2])
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        parts = list(pool.map(_precompile_worker, [str(anchor_dir)] * workers, [jobs[i::workers] for i in range(workers)]))
    return [d for p in parts for d in p]


# ----------------------------------------------------------------------------------------------------------------
# timing

def bench_us(fn, rep_ms: float) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=rep_ms, return_mode="median") * 1e3


def doc_anchors() -> dict:
    """bench_layer.py's ANCHORS ((preset, T) -> (bf16 µs, fp8 µs), docs/performance.md), read without importing."""
    try:
        tree = ast.parse((ROOT / "benchmarks" / "bench_layer.py").read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "ANCHORS" for t in node.targets):
                return ast.literal_eval(node.value)
    except (OSError, SyntaxError, ValueError):
        pass
    return {}


def fmt_row(r: dict) -> str:
    def num(v, w=9):
        return f"{v:{w}.1f}" if isinstance(v, float) else f"{'-':>{w}}"
    err = f"{r['rel_err']:.1e}" if isinstance(r.get("rel_err"), float) else "      -"
    doc = f"{r['doc_anchor_us']:>6}" if r.get("doc_anchor_us") else "     -"
    head = f"{r['preset']:>14} {r['scheme']:>9} T={r['T']:>5}"
    if r.get("gemm_us") is None:
        return f"{head}  {r.get('note', '')}"
    down_src = r.get("down_config_source")
    return (f"{head} gemm {num(r.get('gemm_us'))}us graph {num(r.get('gemm_graph_us'))} up "
            f"{num(r.get('up_us'), 8)} down {num(r.get('down_us'), 8)} doc {doc} err {err}  {r.get('config')}  "
            f"[{r.get('config_source')}"
            f"{'' if down_src in ('=up', '-', None, r.get('config_source')) else ' | down ' + down_src}]"
            f"{'  ' + r['note'] if r.get('note') else ''}")


def run(args) -> int:
    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        raise SystemExit("anchor_sglang: no GPU (for CPU checks: --self-check)")
    sg = SGLang(Path(args.anchor_dir))
    presets, schemes = args.presets.split(","), args.schemes.split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    bad = [s for s in schemes if s not in SCHEMES]
    if bad:
        raise SystemExit(f"--schemes: {bad} not among {SCHEMES}")
    from moeflow.presets import PRESETS
    bad = [p for p in presets if p not in PRESETS]
    if bad:
        raise SystemExit(f"--presets: {bad} not among {list(PRESETS)}")
    device = torch.cuda.get_device_name()
    print(f"anchor_sglang: {device}, torch {torch.__version__}, triton {__import__('triton').__version__}, "
          f"SGLang {sg.source}, PDL {sg.pdl()}, TMA {sg.tma_supported()}, {sg.config_note}", file=sys.stderr)
    jobs = [(p, s, t) for p in presets for s in schemes for t in tokens]
    compile_errors = {}
    if args.precompile_workers > 0:
        t0 = time.time()
        try:
            for job, err in precompile(sg.dir, jobs, args.precompile_workers):
                if err:
                    compile_errors[job] = err
                    print(f"precompile {job}: {err}", file=sys.stderr)
            print(f"precompiled {len(jobs)} rows in {time.time() - t0:.0f}s ({args.precompile_workers} workers)",
                  file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 (the kernels then compile at their first launch)
            print(f"precompile failed after {time.time() - t0:.0f}s, compiling at first launch instead: "
                  f"{type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
    check_t = CHECK_T if CHECK_T in tokens else min(tokens)
    anchors = doc_anchors()
    rows = []
    fh = open(out / "anchor.csv", "w", newline="")
    writer = csv.DictWriter(fh, FIELDS)
    writer.writeheader()

    def emit(row):
        rows.append(row)
        writer.writerow({k: round(v, 2) if k.endswith("_us") and isinstance(v, float) else v
                         for k, v in ((k, row.get(k)) for k in FIELDS)})
        fh.flush()
        print(fmt_row(row), file=sys.stderr)

    from moeflow.benchmark import graph_us
    for preset in presets:
        for scheme in schemes:
            shape = Shape.of(preset, scheme)
            base = dict(preset=preset, scheme=scheme)
            if time.time() - start > args.deadline_s:
                for t in tokens:
                    emit(dict(base, T=t, note="skipped: deadline"))
                continue
            weights = None
            try:
                src_up, src_down = sg.config_sources(shape)
            except Exception as exc:  # noqa: BLE001 (the rows still run; only the source column is lost)
                src_up = src_down = f"? ({type(exc).__name__}: {str(exc)[:80]})"
            try:
                weights = make_weights(shape, "cuda")
            except torch.cuda.OutOfMemoryError:
                weights = None
                torch.cuda.empty_cache()
                free, total = torch.cuda.mem_get_info()
                for t in tokens:
                    emit(dict(base, T=t, note=f"skipped: weights do not fit ({free / 2**30:.0f} of "
                                              f"{total / 2**30:.0f} GiB free)"))
                continue
            for t in tokens:
                r = dict(base, T=t, config_source=src_up, down_config_source=src_down)
                doc = anchors.get((preset, t))
                r["doc_anchor_us"] = doc and doc[1 if shape.fp8 else 0]
                if time.time() - start > args.deadline_s:
                    emit(dict(r, note="skipped: deadline"))
                    continue
                row = up_kw = down_kw = both = None
                try:
                    row = build_row(sg, shape, weights, t, "cuda", seed=t)
                    up_kw = launch_kwargs(sg, shape, weights, row, "up")
                    down_kw = launch_kwargs(sg, shape, weights, row, "down")
                    invoke = sg.kern.invoke_fused_moe_kernel

                    def both(invoke=invoke, up_kw=up_kw, down_kw=down_kw):
                        invoke(**up_kw)
                        invoke(**down_kw)
                    both()
                    torch.cuda.synchronize()
                    r["config"] = row.describe(sg, shape.fp8)
                    r["experts_hit"] = int(row.ids.unique().numel())
                    notes = []
                    if t == check_t or row.up_tma or row.down_tma:
                        e_up, e_down = check_row(shape, weights, row)
                        r["rel_err"] = max(e_up, e_down)
                        if not r["rel_err"] <= ERR_LIMIT:
                            notes.append(f"CHECK FAILED: rel_err gate_up {e_up:.1e} down {e_down:.1e}")
                    r["gemm_us"] = bench_us(both, args.rep_ms)
                    r["up_us"] = bench_us(lambda kw=up_kw, f=invoke: f(**kw), args.rep_ms)
                    r["down_us"] = bench_us(lambda kw=down_kw, f=invoke: f(**kw), args.rep_ms)
                    try:
                        r["gemm_graph_us"] = graph_us(both, rep_ms=args.rep_ms)
                    except Exception as exc:  # noqa: BLE001 (a capture that fails leaves the eager figures)
                        torch.cuda.synchronize()
                        notes.append(f"no graph: {type(exc).__name__}: {str(exc)[:120]}")
                    if (preset, scheme, t) in compile_errors:
                        notes.append("precompile failed, compiled at first launch")
                    r["note"] = "; ".join(notes)
                except torch.cuda.OutOfMemoryError:
                    r.update(gemm_us=None, note="skipped: out of memory")
                except Exception as exc:  # noqa: BLE001 (one row's failure is reported, the others still run)
                    r.update(gemm_us=None, note=f"failed: {type(exc).__name__}: {str(exc)[:300]}")
                finally:
                    row = up_kw = down_kw = both = None  # free this row's buffers before the next
                    torch.cuda.empty_cache()
                emit(r)
            del weights
            torch.cuda.empty_cache()
    fh.close()
    timed = [r for r in rows if r.get("gemm_us") is not None]
    errs = [r["rel_err"] for r in timed if isinstance(r.get("rel_err"), float)]
    meta = dict(device=device, torch=torch.__version__, triton=__import__("triton").__version__, sglang=sg.source,
                configs=sg.config_note, pdl=sg.pdl(), tma=sg.tma_supported(), rep_ms=args.rep_ms, check_T=check_t,
                method="two fused_moe_kernel launches through SGLang's invoke_fused_moe_kernel; do_bench median, "
                       "L2 zeroed before each repetition; gemm_graph_us: the same as one CUDA graph replay",
                seconds=round(time.time() - start, 1))
    (out / "anchor.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print("\n".join(fmt_row(r) for r in rows))
    notes = [r.get("note") or "" for r in rows]
    bad = sum(n.startswith("failed") or "CHECK FAILED" in n for n in notes)
    skipped = sum(n.startswith("skipped") for n in notes)
    worst = f"max rel_err {max(errs):.1e}" if errs else "no check ran"
    print(f"anchor_sglang: {len(timed)}/{len(rows)} rows timed on {device} in {time.time() - start:.0f}s, {worst}, "
          f"{bad} failed, {skipped} skipped -> {out}")
    return 0 if timed and not bad else 1


# ----------------------------------------------------------------------------------------------------------------
# CPU self-check

def _check_align() -> None:
    cases = [(torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]]), 4, 5)]
    g = torch.Generator().manual_seed(0)
    for tokens, k, e, block in [(1, 8, 128, 16), (3, 2, 8, 16), (16, 8, 256, 64), (50, 8, 128, 16), (200, 2, 8, 128),
                                (33, 4, 16, 32), (7, 1, 4, 1)]:
        cases.append((torch.rand(tokens, e, generator=g).topk(k, dim=1).indices, block, e))
    for ids, block, e in cases:
        s, x, n = moe_align_block_size(ids.to(torch.int32), block, e)
        rs, rx, rn = moe_align_reference(ids, block, e)
        assert s.dtype == x.dtype == n.dtype == torch.int32, (s.dtype, x.dtype, n.dtype)
        assert s.tolist() == rs and x.tolist() == rx and n.tolist() == [rn], (ids.shape, block, e)
    print(f"align: {len(cases)} cases match the loop reference (sizes as SGLang allocates them)")


def _check_lookup(sg: SGLang) -> None:
    import triton
    print(f"config lookup (triton {triton.__version__}), as on the GPU machine:")
    for device in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        OVERRIDES.update(device_name=device, sm90=True, pdl=True)
        for preset in ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"):
            for scheme in SCHEMES:
                shape = Shape.of(preset, scheme)
                src = sg.config_sources(shape)
                for t in (1, 16, 128, 1024, 4096, 16384):
                    up, down, up_tma, down_tma = sg.resolve(shape, t)
                    row = Row(t, up, down, up_tma, down_tma, *([None] * 8))
                    if shape.fp8:
                        for c in (up, down or up):
                            assert GROUP % c["BLOCK_SIZE_K"] == 0 and c["BLOCK_SIZE_K"] <= GROUP, c
                    if t in (1, 4096, 16384):
                        print(f"  {device[7:11]} {preset:>13} {scheme:>9} T={t:>5} {row.describe(sg, shape.fp8)}  "
                              f"[{src[0]} | {src[1]}]")
    OVERRIDES.update(device_name=None, sm90=None, pdl=None)
    sg.conf.get_moe_configs.cache_clear()


def _check_inputs() -> None:
    shape = Shape(E=4, H=256, I=128, K=2, fp8=True)
    w13, w13_s, w2, w2_s = make_weights(shape, "cpu", chunk_bytes=1 << 18)
    assert w13.shape == (4, 256, 256) and w13_s.shape == (4, 2, 2) and w2.shape == (4, 256, 128)
    assert w2_s.shape == (4, 2, 1) and w13.dtype == FP8 and w13_s.dtype == torch.float32
    ref = make_weights(Shape(4, 256, 128, 2, False), "cpu", dtype=torch.float32, chunk_bytes=1 << 30)
    err = relative_error(torch.stack([dequant_weight(w13[e], w13_s[e]) for e in range(4)]), ref[0])
    assert err < 0.05, err  # same draws, chunked differently: fp8 rounding only
    x, ids, w = routing(shape, 5, "cpu", torch.float32)
    assert x.shape == (5, 256) and ids.shape == (5, 2) and ids.dtype == torch.int32
    assert torch.allclose(w.sum(-1), torch.ones(5)) and all(len(set(r)) == 2 for r in ids.tolist())
    q, s = quant_groups(x, chunk_rows=2)
    assert q.dtype == FP8 and s.shape == (5, 2) and relative_error(dequant_rows(q, s), x) < 0.05
    print(f"inputs: weights (fp8 blocks vs float32 draws: rel {err:.1e}), routing, 1x128 quantization")


def _check_interpreter(anchor_dir: Path) -> None:
    """Their launcher and kernel in Triton's interpreter (a child process: TRITON_INTERPRET=1 must precede triton's
    import) at tiny shapes: float32 and float16, the plain and the TMA (sorted) layouts, fp8-block."""
    import subprocess
    env = dict(os.environ, TRITON_INTERPRET="1")
    # -O: their kernel's `assert use_fp8_w8a8 and group_n > 0 ...` under a TMA A operand is a device_assert, which
    # Triton compiles away without TRITON_DEBUG (and SGLang's bf16 TMA configs rely on); the interpreter would raise
    cmd = [sys.executable, "-O", __file__, "--interpret-check", "--anchor-dir", str(anchor_dir)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
    sys.stdout.write(res.stdout)
    if res.returncode:
        sys.stdout.write(res.stderr[-4000:])
        raise SystemExit(f"interpreter check failed ({res.returncode})")


def _interpreter_numpy2() -> None:
    """Triton's interpreter takes a runtime int argument's __index__ as int(1-element array), which NumPy >= 2.4
    refuses (their kernel's `range(0, K, BLOCK_SIZE_K)`): index its one element instead."""
    from triton.runtime import interpreter
    orig = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    interpreter._patch_lang_tensor = patched


def interpret_check(anchor_dir: Path) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _interpreter_numpy2()
    sg = SGLang(anchor_dir)
    failures = []
    for dtype, fp8, tma, tokens in [(torch.float32, False, False, 5), (torch.float16, False, False, 9),
                                    (torch.float32, False, True, 7), (torch.float32, True, False, 6),
                                    (torch.float32, True, True, 6)]:
        shape = Shape(E=4, H=256, I=128, K=2, fp8=fp8)
        weights = make_weights(shape, "cpu", dtype=dtype)
        cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64 if fp8 else 32, BLOCK_SIZE_K=128 if fp8 else 64, GROUP_SIZE_M=1)
        down_cfg = dict(cfg, BLOCK_SIZE_N=128 if fp8 else 64)
        orig = sg.resolve
        sg.resolve = lambda s, t, c=cfg, d=down_cfg, tma=tma: (dict(c), dict(d), tma, tma)
        label = f"{str(dtype)[6:]:>7} {'fp8-block' if fp8 else 'plain':>9} {'tma+sorted' if tma else 'rows':>10} T={tokens}"
        try:
            row = build_row(sg, shape, weights, tokens, "cpu", dtype=dtype, seed=tokens)
            for gemm in ("up", "down"):
                sg.kern.invoke_fused_moe_kernel(**launch_kwargs(sg, shape, weights, row, gemm))
            e_up, e_down = check_row(shape, weights, row)
            limit = 1e-2 if dtype == torch.float16 or fp8 else 1e-5
            ok = e_up <= limit and e_down <= limit
            print(f"interpreter {label}: rel_err gate_up {e_up:.1e} down {e_down:.1e} {'ok' if ok else 'FAILED'}")
            if not ok:
                failures.append(label)
        except Exception as exc:  # noqa: BLE001
            print(f"interpreter {label}: {type(exc).__name__}: {str(exc)[:300]}")
            failures.append(label)
        finally:
            sg.resolve = orig
    if failures:
        raise SystemExit(f"interpreter check failed: {failures}")


class _Sm90Driver:
    """Triton's active driver for compiling on a machine without a GPU: targets sm_90 (compile only)."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def _check_compile_sm90(sg: SGLang, tokens: list[int]) -> None:
    """Compile both launches of every row for sm_90 (H100 and H200 configs, PDL and swap_ab on, as there) through
    the precompile's path (meta tensors, warmup mode), with Triton's own ptxas; check that real tensors (CPU ones,
    Qwen3's rows) find those same kernels (the timing run then loads them from the disk cache) and that each
    kernel's shared memory fits sm_90's 227 KiB."""
    t0 = time.time()
    os.environ["ANCHOR_SGLANG_SM90_DEVICE"] = "NVIDIA H100 80GB HBM3"
    try:
        jobs = [(p, s, t) for p in ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b") for s in SCHEMES for t in tokens]
        errors = [(job, err) for job, err in precompile(sg.dir, jobs, 2) if err]
    finally:
        del os.environ["ANCHOR_SGLANG_SM90_DEVICE"]
    if errors:
        raise SystemExit(f"precompile (worker processes, sm_90) failed: {errors[:3]}")
    print(f"precompile: {len(jobs)} H100 rows compiled for sm_90 in 2 worker processes in {time.time() - t0:.0f}s")
    from triton.runtime import driver
    driver.set_active(_Sm90Driver())
    kernels = sg.kern.fused_moe_kernel.device_caches[0][0]  # Triton's in-memory cache: key -> compiled kernel
    t0 = time.time()
    try:
        for device in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
            OVERRIDES.update(device_name=device, sm90=True, pdl=True)
            sg.conf.get_moe_configs.cache_clear()  # their lru cache is not keyed by the device name
            jobs = [(p, s, t) for p in ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b") for s in SCHEMES
                    for t in tokens]
            for job, err in warm_rows(sg, jobs):
                if err:
                    raise SystemExit(f"sm_90 compile failed for {device} {job}: {err}")
            n = len(kernels)
            for job, err in warm_rows(sg, [j for j in jobs if j[0] == "qwen3-30b-a3b"], device="cpu"):
                if err:
                    raise SystemExit(f"sm_90 compile failed for {device} {job} (real tensors): {err}")
            if len(kernels) != n:
                raise SystemExit(f"real tensors compiled {len(kernels) - n} kernels the meta ones did not: the "
                                 "precompile would miss them")
    finally:
        driver.set_active(None)  # the real driver again, created when next asked for
        OVERRIDES.update(device_name=None, sm90=None, pdl=None)
        sg.conf.get_moe_configs.cache_clear()
    shared = sorted(k.metadata.shared for k in kernels.values())
    assert shared[-1] <= 232448, f"a kernel needs {shared[-1]} B of shared memory, over sm_90's 227 KiB"
    print(f"compile sm_90: {len(kernels)} distinct kernels for 2 devices x {len(jobs)} rows in "
          f"{time.time() - t0:.0f}s (real tensors hit the same ones); shared memory up to {shared[-1] // 1024} KiB "
          f"(sm_90 allows 227); PDL {all(k.metadata.launch_pdl for k in kernels.values())}")


def self_check(args) -> int:
    _check_align()
    sg = SGLang(Path(args.anchor_dir))
    print(f"SGLang: {sg.source}")
    _check_lookup(sg)
    _check_inputs()
    _check_interpreter(Path(args.anchor_dir))
    if args.compile_sm90:
        _check_compile_sm90(sg, [int(t) for t in args.tokens.split(",")])
    print("self-check: ok")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default="qwen3-30b-a3b,deepseek-v3,mixtral-8x7b")
    p.add_argument("--schemes", default="none,fp8-block")
    p.add_argument("--tokens", default="1,16,128,1024,4096,16384")
    p.add_argument("--out", default=".")
    p.add_argument("--anchor-dir", default=str(ROOT / ".anchors" / "sglang"))
    p.add_argument("--deadline-s", type=float, default=1e9, help="start no new row after this many seconds")
    p.add_argument("--rep-ms", type=float, default=50, help="do_bench's rep (ms)")
    p.add_argument("--precompile-workers", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)),
                   help="processes compiling every row's kernels before timing (0: compile at first launch)")
    p.add_argument("--self-check", action="store_true", help="CPU checks (no GPU needed)")
    p.add_argument("--compile-sm90", action="store_true", help="with --self-check: compile every row for sm_90")
    p.add_argument("--interpret-check", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.interpret_check:
        interpret_check(Path(args.anchor_dir))
        return 0
    if args.self_check:
        return self_check(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
