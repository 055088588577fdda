"""Benchmark helpers: timing, FLOP and byte counts, the roofline of one MoE layer.

    FLOPs = 2 · T · K · 3 · H · I                    (gate_up GEMM [H→2I] + down GEMM [I→H])
    bytes ≥ hit · 3 · H · I · bytes_per_weight + T · H · 2 · bytes_per_act
    hit   = the distinct experts the routing touched, or their expectation E · (1 − (1 − K/E)^T) under random routing
    floor = max(FLOPs / matrix peak, bytes / memory bandwidth), the ceilings measured in the same run (measure_ceilings)

Timing: time_fn (host-timed, synchronized calls: any device), graph_us and clean_graph_us (CUDA: replays of one
captured graph). Accuracy: relative_error, poisoned_allocations (an element a call never writes shows as NaN).
"""
from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from dataclasses import dataclass

import torch

from .config import MoEConfig
from .graphs import standing_aside


@dataclass(frozen=True)
class Ceilings:
    """Peak rates used for '% of roofline' (FLOP/s, bytes/s). Defaults: an H200's dense bf16 and e4m3 matmul rates
    and device-copy bandwidth; quote ratios against ceilings measured in the same run (measure_ceilings)."""

    bf16_flops: float = 700e12
    fp8_flops: float = 1265e12
    bandwidth: float = 4.27e12


def measure_ceilings(device: torch.device) -> Ceilings:
    """The ceilings of this CUDA device (do_bench medians, about 2 s): the bandwidth is 2 GiB over a
    1 GiB device-to-device copy's time (read + write); each matrix peak is 2 · 8192³ FLOPs over an 8192² matmul's
    time, bf16 (``x @ x``) and e4m3 (``torch._scaled_mm``). fp8_flops is nan on a GPU without fp8 matmuls."""
    from triton.testing import do_bench

    def us(fn) -> float:
        return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
    a = torch.empty(2 ** 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    copy_us = us(lambda: b.copy_(a))
    x = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    flops = 2 * 8192 ** 3
    bf16 = flops / (us(lambda: x @ x) * 1e-6)
    try:
        f8, one = x.to(torch.float8_e4m3fn), torch.ones((), device=device)
        fp8 = flops / (us(lambda: torch._scaled_mm(f8, f8.t(), one, one, out_dtype=torch.bfloat16)) * 1e-6)
    except RuntimeError:  # no fp8 matmul on this GPU (compute capability < 8.9)
        fp8 = float("nan")
    return Ceilings(bf16_flops=bf16, fp8_flops=fp8, bandwidth=2 * 2 ** 30 / (copy_us * 1e-6))


def layer_flops(cfg: MoEConfig, tokens: int) -> float:
    return 2.0 * tokens * cfg.top_k * 3 * cfg.hidden_size * cfg.intermediate_size


def experts_hit(cfg: MoEConfig, tokens: int) -> float:
    e, k = cfg.num_experts, cfg.top_k
    return e * (1.0 - (1.0 - k / e) ** tokens)


def layer_bytes(cfg: MoEConfig, tokens: int, hit: float | None = None) -> float:
    """Fewest bytes moved; ``hit``: distinct experts the routing touched (default: the expectation)."""
    w_bytes = 1 if cfg.quant.startswith("fp8") else cfg.dtype.itemsize
    hit = experts_hit(cfg, tokens) if hit is None else hit
    weights = hit * 3 * cfg.hidden_size * cfg.intermediate_size * w_bytes
    return weights + tokens * cfg.hidden_size * 2 * cfg.dtype.itemsize


def roofline_seconds(cfg: MoEConfig, tokens: int, ceilings: Ceilings = Ceilings(), hit: float | None = None) -> float:
    return floor_seconds(layer_flops(cfg, tokens), layer_bytes(cfg, tokens, hit), cfg.quant.startswith("fp8"), ceilings)


def floor_seconds(flops: float, nbytes: float, fp8: bool, ceilings: Ceilings) -> float:
    """The roofline floor in seconds: max(FLOPs / the matrix peak (fp8 or bf16), bytes / the bandwidth)."""
    return max(flops / (ceilings.fp8_flops if fp8 else ceilings.bf16_flops), nbytes / ceilings.bandwidth)


def time_fn(fn, device: torch.device, min_seconds: float = 0.2, max_reps: int = 200, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` over repetitions (device-synchronized)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    samples, start = [], time.perf_counter()
    while len(samples) < max_reps and (len(samples) < 3 or time.perf_counter() - start < min_seconds):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖ (Frobenius, float64; NaN where got holds NaN): how far an output is off its comparand."""
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


@contextlib.contextmanager
def poisoned_allocations():
    """Within it, every buffer a call allocates is poisoned and the layers' eager graphs stand aside: torch.empty
    and its kin return floats as NaN and integers as their largest value (torch's deterministic fill), so an
    element the call never writes shows in its output, instead of the value the caching allocator's block held
    before (the same shape's output of another runner, say, which would pass a comparison). The eager graphs
    (moeflow.graphs) stand aside so that the call allocates its buffers anew, launch by launch.
    Costs a fill per allocation: for correctness calls, not timed ones. Deterministic mode is on meanwhile with
    warn_only (an op without a deterministic form runs as before; its warning is silenced) and is restored after."""
    fill = torch.utils.deterministic.fill_uninitialized_memory
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with standing_aside(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*(deterministic|CUBLAS_WORKSPACE_CONFIG).*")
            yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = fill


def graph_us(fn, rep_ms: float = 50) -> float:
    """fn (no arguments, CUDA work) captured as a CUDA graph -> median µs of its replays, L2 flushed (zeroed) before
    each (triton.testing.do_bench). Raises RuntimeError where fn cannot be captured (it synchronizes with the host)."""
    from triton.testing import do_bench

    from .graphs import capture_graph
    return do_bench(capture_graph(fn, warmups=2).replay, warmup=10, rep=rep_ms, return_mode="median") * 1e3


_CLEAN: list = []  # the 1 GiB buffer clean_graph_us reads, made once


def clean_graph_us(fn, reps: int = 100) -> float:
    """fn captured as a CUDA graph -> median µs of ``reps`` replays, each after reading 1 GiB (the L2 then holds
    clean lines: unlike do_bench's zeroing, which leaves dirty lines, nothing is left for the timed replay to write
    back, a few µs of a small layer's time)."""
    from .graphs import capture_graph
    if not _CLEAN:
        _CLEAN.append(torch.ones(1 << 27, dtype=torch.int64, device="cuda"))
    return timed_after_us(capture_graph(fn, warmups=2).replay, _CLEAN[0].amax, reps)


def timed_after_us(fn, before, reps: int = 100) -> float:
    """Median µs of CUDA work fn() over ``reps`` calls (after 3 untimed), each after before() (not timed)."""
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for _ in range(3):
        before()
        fn()
    for a, b in ev:
        before()
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in ev)[reps // 2] * 1e3


def plot_panels(plt, panels: list[tuple[str, dict, list]], path: str) -> None:
    """Write a PNG of one log-log panel per (title, {runner: [(T, µs)]}, floor [(T, µs)], empty for none):
    time against T per runner (one colour per runner across the panels), the roofline floor dashed.
    plt: matplotlib.pyplot on a file backend."""
    n = max(len(panels), 1)
    fig, axes = plt.subplots(1, n, figsize=(4 * n, 3.5), squeeze=False)
    names = sorted({name for _, lines, _ in panels for name in lines})
    colour = {name: f"C{i % 10}" for i, name in enumerate(names)}  # one colour per runner in every panel
    for ax, (title, lines, floor) in zip(axes[0], panels):
        for name, pts in sorted(lines.items()):
            ax.loglog(*zip(*sorted(pts)), marker="o", label=name, color=colour[name])
        if floor:
            ax.loglog(*zip(*sorted(floor)), "k--", label="roofline")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel("µs")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# the layer benchmark's targets (% of roofline): geometric mean over the rows, floor of every row, DeepSeek-V3
# fp8-block at T=16384 (TFLOP/s); rows with an anchor time must also be at least as fast as it
TARGET_GEOMEAN_PCT, TARGET_ROW_PCT, TARGET_DSV3_TFLOPS = 85.0, 60.0, 700.0


def target_summary(rows: list[dict], time_key: str = "layer_graph_us") -> dict:
    """The four target lines (TARGET_*, the anchors) over measured rows (bench_layer.py's: preset, scheme, T, floor_us,
    tflops, anchor_us, and the time columns), timed by ``time_key`` (layer_graph_us: do_bench; layer_clean_us:
    the clean flush). Rows without that time are left out. tflops is rescaled from the row's headline time
    (layer_graph_us, else layer_us) to ``time_key``'s.
    -> {"rows", "geomean_pct", "below": [(preset, scheme, T, pct)] under TARGET_ROW_PCT, "anchors",
        "anchors_met", "missed": [(preset, scheme, T, µs, anchor µs)], "dsv3_fp8_block_tflops" (None if absent)}"""
    import math

    timed = [r for r in rows if r.get(time_key)]
    pct = [100.0 * r["floor_us"] / r[time_key] for r in timed]
    key = lambda r: (r["preset"], r["scheme"], r["T"])
    anchored = [r for r in timed if r.get("anchor_us")]
    missed = [(*key(r), round(r[time_key], 1), r["anchor_us"]) for r in anchored if r[time_key] > r["anchor_us"]]
    dsv3 = [r for r in timed if key(r) == ("deepseek-v3", "fp8-block", 16384)]
    tflops = None
    if dsv3:
        r = dsv3[0]
        tflops = r["tflops"] * (r.get("layer_graph_us") or r["layer_us"]) / r[time_key]
    return {"rows": len(timed),
            "geomean_pct": math.exp(sum(map(math.log, pct)) / len(pct)) if pct else None,
            "below": [(*key(r), round(p, 1)) for r, p in zip(timed, pct) if p < TARGET_ROW_PCT],
            "anchors": len(anchored), "anchors_met": len(anchored) - len(missed), "missed": missed,
            "dsv3_fp8_block_tflops": tflops}


def rebased_rows(rows: list[dict], ceilings: dict) -> list[dict]:
    """bench_layer.py's rows with floor_us and roof_pct recomputed at other ``ceilings`` ({"bf16_flops", "fp8_flops",
    "bandwidth"}, as bench.json stores them), so that runs whose re-measured ceilings differ compare on one basis.
    Each row's FLOPs and bytes come back from its tflops and gbs over its headline time (layer_graph_us, else
    layer_us); fp8 schemes take fp8_flops, "none" bf16_flops."""
    c = Ceilings(**ceilings)
    out = []
    for r in rows:
        best_us = r.get("layer_graph_us") or r["layer_us"]
        floor_us = 1e6 * floor_seconds(r["tflops"] * best_us * 1e6, r["gbs"] * best_us * 1e3, r["scheme"] != "none", c)
        out.append({**r, "floor_us": floor_us, "roof_pct": 100.0 * floor_us / best_us})
    return out


def format_target_summary(s: dict, label: str) -> str:
    """target_summary's dict as four lines against the targets (TARGET_*, the anchors)."""
    g = f"{s['geomean_pct']:.1f}%" if s["geomean_pct"] is not None else "-"
    tf = f"{s['dsv3_fp8_block_tflops']:.0f} TFLOP/s" if s["dsv3_fp8_block_tflops"] is not None else "- (row not run)"
    return "\n".join([
        f"targets, {label}: geometric mean {g} of roofline over {s['rows']} rows (target >= {TARGET_GEOMEAN_PCT:g}%)",
        f"  rows below {TARGET_ROW_PCT:g}%: {len(s['below'])} {s['below']}",
        f"  rows at least as fast as the best anchor: {s['anchors_met']} of {s['anchors']}; missed {s['missed']}",
        f"  fp8-block DeepSeek-V3 T=16384: {tf} (target >= {TARGET_DSV3_TFLOPS:g})"])
