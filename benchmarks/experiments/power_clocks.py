"""How fast does a row run once the H200 has been busy for a while, and at what SM clock and power? One H200.

The 36-row benchmark runs each row for well under a second (do_bench), after a pause for setup, and the same config
timed at the start and at the end of one experiment has differed by up to 9% (split_down_2026-12-02_h200_695417e.md).
nvidia-smi during a 36-row run showed the SW power cap (700 W) active in a third of its samples, with SM clocks of
900-1980 MHz while busy. This measures it per row: for each case, after SETTLE_S seconds idle, one CUDA graph of the
layer (or the ceiling's kernel) replayed back to back for RUN_S seconds, each replay timed by events, while
nvidia-smi samples clock, power and clock-event reasons every 100 ms.

    PYTHONPATH=$PWD OUT=DIR python benchmarks/experiments/power_clocks.py [preset:scheme:T ...]

Per case: µs a call over the first 0.25 s and over the last second, and the SM clock, power and share of samples
with the SW power cap (reason bit 0x4) over that last second. Writes power_clocks.json and smi.csv under OUT;
prints a table last.
"""
import csv
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_layer import Case  # noqa: E402
from moeflow.experts import create_runner  # noqa: E402
from moeflow.kernels.autotune import capture_graph  # noqa: E402

CASES = ["ceiling:bf16-mm:0", "ceiling:fp8-mm:0", "ceiling:copy:0", "qwen3-30b-a3b:none:1", "mixtral-8x7b:none:128",
         "qwen3-30b-a3b:none:4096", "qwen3-30b-a3b:fp8-block:4096", "qwen3-30b-a3b:fp8-block:16384",
         "mixtral-8x7b:none:1024", "deepseek-v3:fp8-block:16384"]
SETTLE_S, RUN_S = float(os.environ.get("SETTLE_S", 3)), float(os.environ.get("RUN_S", 3))
_cases = {}


def ceiling_fn(kind: str):
    if kind == "copy":
        a = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        return lambda: b.copy_(a)
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    if kind == "bf16-mm":
        return lambda: x @ x
    f8, one = x.to(torch.float8_e4m3fn), torch.ones((), device="cuda")
    return lambda: torch._scaled_mm(f8, f8.t(), one, one, out_dtype=torch.bfloat16)


def layer_fn(preset: str, scheme: str, t: int):
    key = (preset, scheme)
    if key not in _cases:
        _cases.clear()  # one preset's weights at a time
        torch.cuda.empty_cache()
        _cases[key] = Case(preset, scheme)
    case = _cases[key]
    runner = create_runner("triton", case.cfg.replace(runner="triton"), case.scheme)
    x, logits = case.inputs(t, 1)[0]
    return lambda: case.layer(runner, x, logits)


def graph_of(fn, target_us=2000.0):
    """A CUDA graph of n calls of fn, n chosen so a replay takes about target_us -> (graph, n)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    n = max(1, min(200, int(target_us / max(a.elapsed_time(b) * 1e3, 1.0))))
    g = capture_graph(lambda: [fn() for _ in range(n)])
    torch.cuda.synchronize()
    return g, n


def sustained(fn, settle_s: float = SETTLE_S, run_s: float = RUN_S) -> dict:
    """fn as graph_of's graph, after settle_s s idle, replayed back to back for run_s s, each replay timed by events
    -> µs a call over the first 0.25 s and the last second, and the run's and its last second's times (ISO)."""
    g, n = graph_of(fn)
    time.sleep(settle_s)
    start = datetime.datetime.now()
    t0, samples = time.perf_counter(), []  # (seconds since start, µs a call)
    while time.perf_counter() - t0 < run_s:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        samples.append((time.perf_counter() - t0, a.elapsed_time(b) * 1e3 / n))
    end = datetime.datetime.now()
    med = lambda v: statistics.median(v) if v else float("nan")
    first = med([us for s, us in samples if s < 0.25])
    last = med([us for s, us in samples if s > run_s - 1])
    del g
    return dict(calls_per_replay=n, replays=len(samples), first_us=first, last_us=last, start=start.isoformat(),
                end=end.isoformat(), last_second_from=(end - datetime.timedelta(seconds=1)).isoformat())


def run_case(spec: str) -> dict:
    preset, scheme, t = spec.split(":")
    return sustained(ceiling_fn(scheme) if preset == "ceiling" else layer_fn(preset, scheme, int(t)))


def start_smi(path: str) -> subprocess.Popen:
    """nvidia-smi sampling the timestamp, SM clock, power and clock-event reasons every 100 ms into path (CSV, what
    smi_window reads); terminate() the process to stop it."""
    return subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active",
                             "--format=csv,noheader", "-lms", "100"], stdout=open(path, "w"))


def smi_window(path: str, lo: str, hi: str) -> dict:
    rows = []
    with open(path) as f:
        for r in csv.reader(f):
            try:
                ts = datetime.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f").isoformat()
                rows.append((ts, int(r[1].split()[0]), float(r[2].split()[0]), int(r[3].strip(), 16)))
            except (ValueError, IndexError):
                continue
    w = [r for r in rows if lo <= r[0] <= hi]
    med = lambda v: statistics.median(v) if v else None
    return dict(samples=len(w), sm_mhz=med([r[1] for r in w]), sm_mhz_min=min([r[1] for r in w], default=None),
                power_w=med([r[2] for r in w]), power_cap_share=sum(r[3] & 4 > 0 for r in w) / len(w) if w else None)


def main():
    out_dir = os.environ.get("OUT", ".")
    smi_path = os.path.join(out_dir, "smi.csv")
    smi = start_smi(smi_path)
    res = {}
    try:
        for spec in sys.argv[1:] or CASES:
            res[spec] = run_case(spec)
            print(spec, res[spec], flush=True)
    finally:
        time.sleep(0.3)
        smi.terminate()
        smi.wait()
    for spec, r in res.items():
        r.update(smi_window(smi_path, r["last_second_from"], r["end"]))
    with open(os.path.join(out_dir, "power_clocks.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n{'case':32s} {'first µs':>9s} {'last µs':>9s} {'ratio':>6s} {'SM MHz':>7s} {'min':>5s} {'W':>6s} {'cap':>5s}")
    for spec, r in res.items():
        print(f"{spec:32s} {r['first_us']:9.1f} {r['last_us']:9.1f} {r['last_us'] / r['first_us']:6.3f} "
              f"{r['sm_mhz'] or 0:7d} {r['sm_mhz_min'] or 0:5d} {r['power_w'] or 0:6.0f} {r['power_cap_share'] or 0:5.2f}")


if __name__ == "__main__":
    main()
