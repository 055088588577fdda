"""`moeflow bench` — the main job: build a layer for a preset, check every valid runner against
the reference runner on the same weights and inputs, print latency and error per runner and T.

On a CPU-only machine the defaults (preset "small", all schemes) finish in seconds.
"""
from __future__ import annotations

import csv
import json
import os
import sys

import torch

from ..benchmark import layer_flops, roofline_seconds, time_fn
from ..errors import MoeflowError, error
from ..experts import RUNNERS
from ..layer import MoE
from ..quant import SCHEMES
from .common import add_layer_args, config_from_args


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark every valid runner against the reference (the main job)")
    add_layer_args(p)
    p.set_defaults(quant="all")
    p.add_argument("--tokens", default=None, help="comma-separated token counts (default 1,16,128 on CPU; "
                   "1,16,128,1024,4096,16384 on CUDA)")
    p.add_argument("--runners", default="all", help="comma-separated runner names (default: every registered runner)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", help="write the rows as JSON here")
    p.add_argument("--csv", dest="csv_path", help="write the rows as CSV here")
    p.set_defaults(func=run)


def run(args) -> int:
    schemes = SCHEMES.names() if args.quant == "all" else args.quant.split(",")
    runners = [r for r in RUNNERS.names() if r != "reference"] if args.runners == "all" else args.runners.split(",")
    base = config_from_args(args, quant="none", runner="reference")
    tokens = [int(t) for t in (args.tokens or ("1,16,128,1024,4096,16384" if base.device.type == "cuda" else "1,16,128")).split(",")]
    _check_memory(base)
    jobs = [(s, r) for s in schemes for r in ["reference", *runners]]
    rows, done = [], 0
    for scheme in schemes:
        torch.manual_seed(args.seed)
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
            try:
                layer = ref if name == "reference" else MoE(ref.config.replace(runner=name))
            except MoeflowError as exc:
                rows.append(_refused(ref.config, scheme, name, exc))
                continue
            if layer is not ref:
                layer.load_state_dict(ref.state_dict())
            for (x, logits), want in zip(inputs, expected):
                rows.append(_measure(layer, x, logits, want))
    print(file=sys.stderr)
    _print_table(base, rows)
    _write(rows, args)
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


def _measure(layer: MoE, x, logits, want) -> dict:
    cfg, t = layer.config, x.shape[0]
    with torch.no_grad():
        got = layer(x, logits)
        err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
        seconds = time_fn(lambda: layer(x, logits), cfg.device)
    oracle = layer.plan.runner == "reference"  # the comparand itself: no error to report
    row = dict(quant=cfg.quant, runner=layer.plan.runner, dtype=str(cfg.dtype).removeprefix("torch."), T=t,
               us=seconds * 1e6, tflops=layer_flops(cfg, t) / seconds / 1e12, rel_err=None if oracle else err,
               status="ok")
    if cfg.device.type == "cuda":
        row["pct_roofline"] = 100 * roofline_seconds(cfg, t) / seconds
    return row


def _refused(cfg, scheme: str, runner: str, exc: MoeflowError) -> dict:
    return dict(quant=scheme, runner=runner, dtype=str(cfg.dtype).removeprefix("torch."), T=None,
                us=None, tflops=None, rel_err=None, status=exc.code)


def _progress(done: int, total: int, what: str) -> None:
    width = 24
    fill = width * done // max(total, 1)
    print(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} {what:<32}", end="", file=sys.stderr, flush=True)


def _print_table(cfg, rows: list[dict]) -> None:
    print(f"moeflow bench: E={cfg.num_experts} H={cfg.hidden_size} I={cfg.intermediate_size} K={cfg.top_k} "
          f"dtype={str(cfg.dtype).removeprefix('torch.')} device={cfg.device} (error: ‖out−ref‖/‖ref‖ vs the reference runner)")
    roof = any("pct_roofline" in r for r in rows)
    print(f"{'quant':<12} {'runner':<11} {'T':>6} {'µs':>10} {'TFLOP/s':>8} {'rel err':>9}" + ("  %roof" if roof else ""))
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['quant']:<12} {r['runner']:<11} {'-':>6} refused with {r['status']} (moeflow explain {r['status']})")
            continue
        err = "(oracle)" if r["rel_err"] is None else f"{r['rel_err']:.2e}"
        line = f"{r['quant']:<12} {r['runner']:<11} {r['T']:>6} {r['us']:>10.1f} {r['tflops']:>8.3g} {err:>9}"
        print(line + (f"  {r['pct_roofline']:5.1f}" if "pct_roofline" in r else ""))


def _write(rows: list[dict], args) -> None:
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(rows, f, indent=1)
    if args.csv_path:
        keys = sorted({k for r in rows for k in r})
        with open(args.csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
