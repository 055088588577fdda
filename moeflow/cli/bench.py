"""`moeflow bench` — the main job: build a layer for a preset, check every valid runner against
the reference runner on the same weights and inputs, print latency, TFLOP/s, GB/s and error per runner and T
(on CUDA also % of roofline), with a progress bar; --json / --csv write the rows, --png plots time against T per
runner (on CUDA with the roofline floor). On a CPU-only machine the defaults finish in seconds.

Roofline (moeflow.benchmark): the experts each row's routing touched ("experts_hit") against this GPU's ceilings,
measured at the start of the run; "floor_us" and "pct_roofline" are in each row. Error: relative to the reference
runner's output, the call's buffers poisoned; over WRONG_REL_ERR the row is "wrong". Timing: on CUDA replays of one
CUDA graph with the L2 flushed, eager where the runner synchronizes with the host (the row's "timing"); on the CPU
synchronized host timing.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys

import torch

from ..benchmark import (Ceilings, graph_us, layer_bytes, layer_flops, measure_ceilings, plot_panels,
                         poisoned_allocations, relative_error, roofline_seconds, time_fn)
from ..dispatch import DISPATCHERS
from ..errors import MoeflowError, error
from ..experts import RUNNERS
from ..layer import MoE
from ..quant import SCHEMES
from .common import add_layer_args, config_from_args, int_list, make_parent, writable_path


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark every valid runner against the reference (the main job)")
    add_layer_args(p, runner=False)  # --runners (or --runner) names the runners benchmarked
    p.set_defaults(quant="all")
    p.add_argument("--tokens", type=int_list(0), default=None,
                   help="comma-separated token counts (default 1,16,128 on CPU; 1,16,128,1024,4096,16384 on CUDA)")
    p.add_argument("--runners", "--runner", dest="runners", default="all",
                   help="comma-separated runner names, each benchmarked against the reference runner "
                        "(default: every registered runner)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", type=writable_path, help="write the rows as JSON here")
    p.add_argument("--csv", dest="csv_path", type=writable_path, help="write the rows as CSV here")
    p.add_argument("--png", dest="png_path", type=plot_path,
                   help="plot µs against T per runner here (needs matplotlib: moeflow[plot]; its formats: .png, .svg, "
                        ".pdf, ...)")
    p.set_defaults(func=run)


def plot_path(text: str) -> str:
    """argparse type: a writable_path whose extension matplotlib can write (unchecked without matplotlib: MF606)."""
    text = writable_path(text)
    ext = os.path.splitext(text)[1].removeprefix(".").lower()
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return text
    formats = FigureCanvasBase.get_supported_filetypes()
    if ext and ext not in formats:  # no extension: matplotlib writes PNG (and appends .png)
        raise argparse.ArgumentTypeError(f"cannot plot to {text!r}: matplotlib writes no {ext!r} files; "
                                         f"formats: {', '.join(sorted(formats))}")
    return text


def _names(text: str, valid: list[str], check) -> list[str]:
    """The comma-separated names of --quant or --runners ("all": every valid one), each passed to ``check`` (which
    raises the coded error of an unknown name) before anything runs."""
    names = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    if "all" in names:
        return valid
    for name in names or [text]:
        check(name)
    return names


def _scheme(name: str) -> None:
    if name not in SCHEMES.names():
        raise error("MF102", field="--quant", value=name, valid=[*SCHEMES.names(), "all"])


def _runner(name: str) -> None:
    if name != "auto":
        RUNNERS.get(name)  # MF201


def run(args) -> int:
    schemes = _names(args.quant, SCHEMES.names(), _scheme)
    asked = _names(args.runners, RUNNERS.names(), _runner)
    runners = [r for r in asked if r != "reference"]  # the reference runner is benchmarked first in any case
    if args.dispatcher != "auto":
        DISPATCHERS.get(args.dispatcher)  # MF201
    base = config_from_args(args, quant="none", runner="reference")
    if args.png_path:
        _plotting()  # MF606 before the benchmark runs, not after
    tokens = args.tokens or ([1, 16, 128, 1024, 4096, 16384] if base.device.type == "cuda" else [1, 16, 128])
    _check_memory(base)
    ceilings = measure_ceilings(base.device) if base.device.type == "cuda" else None
    jobs = [(s, r) for s in schemes for r in ["reference", *runners]]
    rows, done, measured = [], 0, set()  # measured: the names (as asked) of the runners benchmarked
    for scheme in schemes:
        torch.manual_seed(args.seed)
        ref = layer = None  # the last scheme's layers freed first: two layers at a time, as _check_memory counts
        try:
            ref = MoE(base.replace(quant=scheme))
        except MoeflowError as exc:  # the scheme itself is refused at this shape
            rows += [_refused(base, scheme, r, exc) for r in ["reference", *runners]]
            done += 1 + len(runners)
            continue
        inputs = [(torch.randn(t, base.hidden_size, device=base.device).to(base.dtype),
                   torch.randn(t, base.num_experts, device=base.device)) for t in tokens]
        with torch.no_grad():
            expected = [ref(x, logits) for x, logits in inputs]
        for name in ["reference", *runners]:
            done += 1
            _progress(done, len(jobs), f"{scheme} {name}")
            layer = None  # the last runner's layer freed before the next is built
            try:
                layer = ref if name == "reference" else MoE(ref.config.replace(runner=name), init_weights=False)
            except MoeflowError as exc:
                rows.append(_refused(ref.config, scheme, name, exc))
                continue
            if layer is not ref:
                layer.load_state_dict(ref.state_dict())
            for (x, logits), want in zip(inputs, expected):
                rows.append(_measure(layer, x, logits, want, ceilings))
            measured.add(name)
    print(file=sys.stderr)
    _print_table(base, rows, ceilings)
    _write(rows, args)
    if args.png_path:
        _plot(base, rows, args.png_path)
    if not measured & set(asked):  # every row asked for refused: in CI that must not pass for a benchmark
        codes = sorted({r["status"] for r in rows if r["runner"] in asked and r["status"] not in ("ok", "wrong")})
        print(f"moeflow bench: nothing benchmarked of {', '.join(asked)}: every row refused "
              f"({', '.join(codes)}; `moeflow explain CODE`)", file=sys.stderr)
        return 2
    wrong = [r for r in rows if r["status"] == "wrong"]
    if wrong:
        print(f"moeflow bench: {len(wrong)} row(s) off the reference runner by more than {WRONG_REL_ERR:g} "
              f"({', '.join(sorted({r['runner'] + ' ' + r['quant'] for r in wrong}))}): a fault to report with "
              f"`moeflow env`'s output", file=sys.stderr)
        return 1
    return 0


def _check_memory(cfg) -> None:
    """MF605 when two copies of the experts (reference + layer under test) would not fit."""
    need = 2 * cfg.num_experts * 3 * cfg.hidden_size * cfg.intermediate_size * cfg.dtype.itemsize
    if cfg.device.type == "cuda":
        free = torch.cuda.mem_get_info(cfg.device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > 0.8 * free:
        raise error("MF605", what=f"E={cfg.num_experts} H={cfg.hidden_size} I={cfg.intermediate_size} "
                    f"{str(cfg.dtype).removeprefix('torch.')}", need=f"{need / 1e9:.1f}", device=cfg.device, free=f"{free / 1e9:.1f}")


def _measure(layer: MoE, x, logits, want, ceilings: Ceilings | None = None) -> dict:
    """One row: the layer's error against ``want`` and its time on x [T, H] routed by logits [T, E]; with
    ``ceilings`` (CUDA) also its floor and % of roofline."""
    cfg, t = layer.config, x.shape[0]
    with torch.no_grad():
        with poisoned_allocations():  # an element the layer never writes is NaN, not another runner's stale output
            err = relative_error(layer(x, logits), want)
        seconds, timing = _time(layer, x, logits)
        # the experts this routing touched, counted (not their expectation under random routing)
        hit = int(layer.router(logits, layer.e_score_correction_bias)[0].unique().numel())
    oracle = layer.plan.runner == "reference"  # the comparand itself: no error to report
    row = dict(quant=cfg.quant, runner=layer.plan.runner, dtype=str(cfg.dtype).removeprefix("torch."), T=t,
               us=seconds * 1e6, tflops=layer_flops(cfg, t) / seconds / 1e12,
               gbs=layer_bytes(cfg, t, hit) / seconds / 1e9, experts_hit=hit,
               rel_err=None if oracle else err, status="ok" if oracle else accuracy_status(err), timing=timing)
    floor = roofline_seconds(cfg, t, ceilings, hit) if ceilings is not None else float("nan")
    if floor == floor:  # nan: no ceilings (CPU), or an fp8 row on a GPU without fp8 matmuls
        row.update(floor_us=floor * 1e6, pct_roofline=100 * floor / seconds)
    return row


# a row whose error against the reference runner passes this is marked "wrong" and the command exits 1: 3x the
# loosest limit the tests hold any scheme's layer to against the float64 oracle (3e-2, FP8 in bf16), while a kernel
# fault (a tile unwritten, a wrong expert, a K step missing) is off by 0.2 or more
WRONG_REL_ERR = 0.1


def accuracy_status(rel_err: float) -> str:
    """"ok", or "wrong" for an error over WRONG_REL_ERR (NaN and inf included)."""
    return "ok" if rel_err <= WRONG_REL_ERR else "wrong"


def _time(layer: MoE, x, logits) -> tuple[float, str]:
    """-> (seconds a call of the layer takes, "graph": on CUDA, replays of one captured graph with the L2 flushed
    (graph_us), or "eager": synchronized host timing, where the call cannot be captured or off CUDA)."""
    def call():
        with torch.no_grad():
            return layer(x, logits)
    if x.device.type == "cuda":
        try:
            return graph_us(call) * 1e-6, "graph"
        except (RuntimeError, ImportError):  # not capturable (a host synchronization), or no triton for do_bench
            torch.cuda.synchronize()
    return time_fn(call, x.device), "eager"


def _refused(cfg, scheme: str, runner: str, exc: MoeflowError) -> dict:
    return dict(quant=scheme, runner=runner, dtype=str(cfg.dtype).removeprefix("torch."), T=None,
                us=None, tflops=None, rel_err=None, status=exc.code)


def _progress(done: int, total: int, what: str) -> None:
    width = 24
    fill = width * done // max(total, 1)
    print(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} {what:<32}", end="", file=sys.stderr, flush=True)


def _print_table(cfg, rows: list[dict], ceilings: Ceilings | None = None) -> None:
    print(f"moeflow bench: E={cfg.num_experts} H={cfg.hidden_size} I={cfg.intermediate_size} K={cfg.top_k} "
          f"dtype={str(cfg.dtype).removeprefix('torch.')} device={cfg.device} (error: ‖out−ref‖/‖ref‖ vs the reference runner)")
    if ceilings is not None:
        print(f"ceilings measured on this GPU: copy {ceilings.bandwidth / 1e12:.3g} TB/s, bf16 "
              f"{ceilings.bf16_flops / 1e12:.3g} TFLOP/s, fp8 {ceilings.fp8_flops / 1e12:.3g} TFLOP/s "
              f"(%roof: the floor max(FLOPs / peak, bytes / copy) over the time)")
    roof = any("pct_roofline" in r for r in rows)
    print(f"{'quant':<12} {'runner':<11} {'T':>6} {'µs':>10} {'TFLOP/s':>8} {'GB/s':>8} {'rel err':>9}"
          + ("  %roof" if roof else ""))
    for r in rows:
        if r["status"] not in ("ok", "wrong"):
            print(f"{r['quant']:<12} {r['runner']:<11} {'-':>6} refused with {r['status']} (moeflow explain {r['status']})")
            continue
        err = "(oracle)" if r["rel_err"] is None else f"{r['rel_err']:.2e}"
        line = (f"{r['quant']:<12} {r['runner']:<11} {r['T']:>6} {r['us']:>10.1f} {r['tflops']:>8.3g} "
                f"{r['gbs']:>8.4g} {err:>9}")
        line += f"  {r['pct_roofline']:5.1f}" if "pct_roofline" in r else ""
        print(line + (f"  WRONG: error over {WRONG_REL_ERR:g}" if r["status"] == "wrong" else ""))


def _write(rows: list[dict], args) -> None:
    if args.json_path:
        with open(make_parent(args.json_path), "w") as f:
            json.dump(rows, f, indent=1)
    if args.csv_path:
        keys = sorted({k for r in rows for k in r})
        with open(make_parent(args.csv_path), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)


def _plotting():
    """matplotlib's pyplot on a file backend, or MF606."""
    try:
        import matplotlib
    except ImportError as exc:
        raise error("MF606", why=str(exc)) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _plot(cfg, rows: list[dict], path: str) -> None:
    """One panel per scheme: µs against T per runner; on CUDA also the roofline floor (the rows' floor_us: the
    ceilings measured in this run, the experts each T's routing touched)."""
    panels = []
    for scheme in sorted({r["quant"] for r in rows if r["status"] == "ok"}):
        sel = [r for r in rows if r["quant"] == scheme and r["status"] == "ok"]
        lines = {name: [(r["T"], r["us"]) for r in sel if r["runner"] == name] for name in {r["runner"] for r in sel}}
        floors = {r["T"]: r["floor_us"] for r in sel if "floor_us" in r}  # every runner's row of a T: the same routing
        floor = sorted(floors.items())
        panels.append((f"{scheme}  E={cfg.num_experts} H={cfg.hidden_size} I={cfg.intermediate_size}", lines, floor))
    plot_panels(_plotting(), panels, make_parent(path))
