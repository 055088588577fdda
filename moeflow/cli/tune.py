"""`moeflow tune` — search Triton kernel configs for a layer shape on this GPU and write the JSON
file the "triton" runner looks up (moeflow/kernels/configs.py names and reads it).

    moeflow tune --preset deepseek-v3 --quant fp8-block --out ./configs
    moeflow tune --preset deepseek-v3 --quant fp8-block --tokens 4096,16384 --merge --out ./configs
    MOEFLOW_KERNEL_CONFIG_DIR=./configs python app.py      # the runner finds the file there

Per token count: the gate_up and down GEMM configs, each checked against a float64 reference before it is recorded
(run), and for a single-process layer of none, fp8-channel or fp8-block at T <= 16 the one-launch layer's tiles
(kernels/gemm/fused_layer.py), where that launch is faster than the separate ones (--no-fused: not searched).
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

from ..errors import error
from .common import add_layer_args, config_from_args, int_list

DEFAULT_TOKENS = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192,16384"


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="search Triton kernel configs for a shape on this GPU; write JSON")
    add_layer_args(p, default_preset="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int_list(1), default=DEFAULT_TOKENS,
                   help=f"comma-separated token counts (default {DEFAULT_TOKENS})")
    p.add_argument("--local-experts", type=int, default=None,
                   help="experts per rank under expert parallelism (default: all num_experts)")
    p.add_argument("--out", default=None, help="directory to write into (default: $MOEFLOW_KERNEL_CONFIG_DIR, else .)")
    p.add_argument("--rep-ms", type=float, default=15.0, help="timing budget per candidate, ms (replays of its CUDA graph)")
    p.add_argument("--merge", action="store_true",
                   help="keep the entries an existing file in --out has for the token counts not tuned now, and "
                        "a re-tuned entry's one-launch tiles where this run does not search them")
    p.add_argument("--no-fused", action="store_true",
                   help="do not search the one-launch small-batch layer's tiles (kernels/gemm/fused_layer.py; "
                        "by default searched for a single-process layer of scheme none (a bf16 / fp16 layer), "
                        "fp8-channel or fp8-block, T <= 16: moeflow/tune/fused.fused_candidates)")
    p.set_defaults(func=run)


def run(args) -> int:
    """Tune args' shape at each of --tokens and write the table (after every T, so a stopped search keeps what it
    found). Before a GEMM config is recorded, the fastest is rerun with its outputs poisoned and held to a float64
    reference, expert by expert (moeflow/tune/verify.py); a wrong one is logged, listed under the file's measured_us
    as "refused", and the next fastest takes its place (MF607 if none is right). MF604 without CUDA or triton."""
    from .. import env as moeflow_env
    from ..capabilities import Environment
    if not torch.cuda.is_available():
        raise error("MF604", why="CUDA is not available on this machine")
    why = Environment("cuda").package_error("triton")
    if why:
        raise error("MF604", why=f"triton does not import ({why})")
    import triton

    from ..kernels import configs as kc
    from ..tune.autotune import Shape, tune
    from ..tune.fused import fused_searched

    cfg = config_from_args(args, device="cuda")
    e = args.local_experts or cfg.num_experts
    shape = Shape(e, cfg.hidden_size, cfg.intermediate_size, cfg.top_k, cfg.quant, cfg.dtype)
    tokens = args.tokens
    device = torch.cuda.get_device_name()
    out_dir = Path(args.out or moeflow_env.KERNEL_CONFIG_DIR.get() or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"tuning {shape} on {device} for T={tokens}", file=sys.stderr)
    path = out_dir / kc.file_name(device, e, cfg.intermediate_size, cfg.hidden_size, cfg.quant)
    indexed = e == cfg.num_experts  # a single-process layer hands gate_up its rows by index; EP batches are sorted
    meta = dict(device=device, capability=list(torch.cuda.get_device_capability()), E=e, N=cfg.intermediate_size,
                K=cfg.hidden_size, scheme=cfg.quant, dtype=str(cfg.dtype).removeprefix("torch."), top_k=cfg.top_k,
                triton_version=triton.__version__, torch_version=torch.__version__,
                gate_up_rows="by index" if indexed else "in order")
    kept, kept_us = {}, {}
    if args.merge and path.is_file():
        kept, kept_us = kc.read_table(path)
        meta = {**kc.table_notes(path), **meta}  # the old file's notes (fused_source, edits) stay
    searched = set() if args.no_fused else {t for t in tokens if fused_searched(shape, t, indexed)}

    def save(table, measured):  # after every T, so a stopped search keeps what it found
        # an entry re-tuned with --merge keeps its one-launch tiles where this run did not search them (--no-fused,
        # or a T, scheme or layer tune does not search); where it did, the search's answer stands, None included
        carried = {t: replace(c, fused=kept[t].fused) if t in kept and t not in searched else c
                   for t, c in table.items()}
        kc.write_table(path, meta, {**kept, **carried}, {**kept_us, **measured})

    tune(shape, tokens, rep_ms=args.rep_ms, log=lambda s: print(s, file=sys.stderr), on_result=save,
         indexed_rows=indexed, fused=not args.no_fused)
    print(path)
    return 0
