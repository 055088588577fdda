"""`moeflow selftest`: check this machine. Every cell the planner accepts here (scheme × runner × single-process
dispatcher × dtype) is built at a small shape and compared with the reference runner (moeflow.selftest has the cells,
shapes and batches); refused cells are listed with their codes. Exit 1 when a cell fails, 2 when none was checked.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from .. import selftest
from ..config import parse_device, parse_dtype
from ..errors import MoeflowError, error
from ..experts import RUNNERS
from ..quant import SCHEMES
from .common import default_device, int_list, make_parent, writable_path

EPILOG = ("The header says whether the planner counts this GPU as validated (moeflow's kernels run and checked on its "
          "architecture) or not. Cells the planner refuses are listed with their code, not failures (`moeflow "
          "explain CODE` says why); where it refuses the fast runners with MF210, MOEFLOW_ALLOW_UNVALIDATED_GPU=1 "
          "moeflow selftest builds and checks them. Report a failure with the --json file and `moeflow env`'s "
          "output.")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "selftest", help="check this machine: every cell the planner accepts, against the reference runner",
        description=f"Build every (quant scheme, runner, dispatcher, dtype) cell the planner accepts on this device "
                    f"at a small shape (E={selftest.SHAPE['num_experts']}, H={selftest.SHAPE['hidden_size']}, "
                    f"I={selftest.SHAPE['intermediate_size']}, top_k={selftest.SHAPE['top_k']}), load random weights "
                    f"(FP8 schemes: an FP8 checkpoint), run a few batches and compare each output with the reference "
                    f"runner's for the same weights and inputs, against the test suite's tolerance for the scheme and "
                    f"dtype. Prints a table and a summary line; exits 1 when any cell fails (2 when no cell was checked).",
        epilog=EPILOG)
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--schemes", "--quant", dest="schemes", default="all",
                   help=f"comma-separated quant schemes (default all: {', '.join(SCHEMES.names())})")
    p.add_argument("--runners", "--runner", dest="runners", default="all",
                   help=f"comma-separated runners (default all: {', '.join(RUNNERS.names())}); the reference runner, "
                        f"the comparand, runs for the others when left out (its rows are then not shown)")
    p.add_argument("--dtypes", "--dtype", dest="dtypes", type=_dtypes, default=list(selftest.DTYPES),
                   help="comma-separated layer dtypes (default bfloat16,float16,float32; bf16, fp16, fp32 also read)")
    p.add_argument("--tokens", type=int_list(1), default=list(selftest.TOKENS),
                   help=f"comma-separated token counts routed at random (default "
                        f"{','.join(map(str, selftest.TOKENS))}); a batch of {selftest.IDLE_BATCH} tokens that leaves "
                        f"expert {selftest.IDLE_EXPERT} idle runs in any case (shown as {selftest.IDLE_BATCH}*)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs (default 0)")
    p.add_argument("--json", dest="json_path", type=writable_path,
                   help="write the results here as JSON: device, compute capability, moeflow version and commit, "
                        "date, one row a cell")
    p.set_defaults(func=run)


def _dtypes(text: str) -> list:
    """argparse type: comma-separated dtype names -> [torch.dtype]."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError("no dtype given")
    try:
        return list(dict.fromkeys(parse_dtype(n) for n in names))
    except MoeflowError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _names(text: str, valid: list[str], what: str) -> list[str]:
    """The comma-separated names of --schemes or --runners ("all": every registered one), each checked (MF102 for an
    unknown scheme, MF201 for an unknown runner)."""
    names = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    if not names or "all" in names:
        return valid
    for name in names:
        if what == "scheme" and name not in valid:
            raise error("MF102", field="--schemes", value=name, valid=[*valid, "all"])
        if what == "runner":
            RUNNERS.get(name)  # MF201
    return names


def run(args) -> int:
    device = parse_device(args.device or default_device())  # MF106: not a device, or not on this machine
    schemes = _names(args.schemes, SCHEMES.names(), "scheme")
    runners = _names(args.runners, RUNNERS.names(), "runner")
    start = time.perf_counter()
    rows = selftest.run(device, schemes, runners, args.dtypes, args.tokens, args.seed, progress=_progress)
    seconds = time.perf_counter() - start
    info = selftest.machine(device, rows)
    print(render(info, rows, args.tokens))
    print(summary(rows, info, seconds))
    if any(r.code == "MF210" for r in rows):
        print("moeflow selftest: cells refused with MF210 (`moeflow explain MF210`): "
              "MOEFLOW_ALLOW_UNVALIDATED_GPU=1 moeflow selftest builds and checks them on this GPU", file=sys.stderr)
    if args.json_path:
        doc = dict(info, seconds=round(seconds, 3), shape=selftest.SHAPE,
                   batches=[dict(tokens=b.tokens, idle_expert=b.idle_expert) for b in selftest.batches(args.tokens)],
                   passed=not any(r.failed for r in rows), cells=[r.as_json() for r in rows])
        with open(make_parent(args.json_path), "w") as f:
            json.dump(doc, f, indent=1)
    failed = [r for r in rows if r.failed]
    if failed:
        print(f"moeflow selftest: {len(failed)} cell(s) failed; report them with the --json file and `moeflow env`'s "
              f"output", file=sys.stderr)
        return 1
    if not any(r.status == "pass" for r in rows):  # every cell asked for refused (or the comparand): no check made
        print("moeflow selftest: nothing checked: every cell asked for was refused or is the comparand",
              file=sys.stderr)
        return 2
    return 0


def _progress(done: int, total: int, what: str) -> None:
    width = 24
    fill = width * done // max(total, 1)
    end = "\n" if done == total else ""
    print(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} {what:<40}", end=end, file=sys.stderr, flush=True)


def render(info: dict, rows: list, tokens) -> str:
    """The header (device, the planner's word on it), the legend and the table, one row a cell."""
    cc = f", compute capability {info['capability']}" if info["capability"] else ""
    versions = (f"moeflow {info['moeflow']}" + (f" ({info['commit']})" if info["commit"] else "")
                + f", torch {info['torch']}" + (f", triton {info['triton']}" if info["triton"] else ""))
    shape = selftest.SHAPE
    cells = (f"cells: E={shape['num_experts']} H={shape['hidden_size']} I={shape['intermediate_size']} "
             f"top_k={shape['top_k']}; tokens {', '.join(map(str, tokens))} routed at random, "
             f"{selftest.IDLE_BATCH}* with expert {selftest.IDLE_EXPERT} idle")
    legend = ("rel err: ‖out − ref‖ / ‖ref‖ in float64 against the reference runner, the worst batch; "
              "tol: the tests' tolerance (moeflow/tolerances.py)")
    lines = [f"moeflow selftest: {info['device']}, {info['name']}{cc} (planned as {info['environment']})",
             f"planner: {info['validation']}",
             f"runners: {info['planner']}",
             f"{versions}; {info['date']}", cells, legend]
    header = ("quant", "runner", "dispatcher", "dtype", "tokens", "rel err", "tol", "status")
    table = [header]
    for r in rows:
        err = "—" if r.rel_err is None else f"{r.rel_err:.2e}"
        tol = "—" if r.tol is None else f"{r.tol:.0e}"
        status = f"refused ({r.code})" if r.status == "refused" else r.status
        table.append((r.scheme, r.runner, r.dispatcher, r.dtype, ",".join(r.tokens) or "—", err, tol, status))
    widths = [max(len(row[c]) for row in table) for c in range(len(header))]
    right = {5, 6}  # numbers
    for n, row in enumerate(table):
        padded = [v.rjust(w) if c in right else v.ljust(w) for c, (v, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(padded).rstrip())
        r = rows[n - 1] if n else None
        if r is not None and r.failed and r.detail:
            lines.append(f"    {r.detail}")
    return "\n".join(lines)


def summary(rows: list, info: dict, seconds: float) -> str:
    """One line: PASS or FAIL, and the count of each status."""
    count = {s: sum(r.status == s for r in rows) for s in ("pass", "FAIL", "comparand", "refused")}
    verdict = "FAIL" if count["FAIL"] else "PASS" if count["pass"] else "NOTHING CHECKED"
    parts = [f"{count['pass']} passed", f"{count['FAIL']} failed"]
    if count["comparand"]:
        parts.append(f"{count['comparand']} reference (the comparand)")
    parts.append(f"{count['refused']} refused")
    return f"moeflow selftest: {verdict}: {', '.join(parts)} on {info['name']} in {seconds:.1f} s"
