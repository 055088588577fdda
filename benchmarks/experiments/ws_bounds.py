"""Experiment (GPU): what bounds the warp-specialized GEMMs (kernels/warp_specialized.py)? One GEMM alone at a tile,
graph-timed as gemm_sweep.py times it (batches_for(T) routings, the row-block table's launch included), in three forms:
  full   the kernel as shipped;
  loads  the loader's TMA copies as shipped; the consumers wait for each step's tiles and release the slot without any
         wgmma (turns and epilogues as shipped): the time the operand traffic takes alone;
  math   the loader copies nothing: it arrives on each slot's ready barrier once the slot is free, so the consumers'
         wgmmas, scaling and epilogues run on whatever the slots hold: the time the K loops take without the traffic.
loads and math write wrong outputs on purpose (bounds, not kernels). Each form runs in its own process (the Gluon
functions are swapped in the module before the first compile). Per row it prints the three times and the operand
bytes the tiles read (every tile's K steps of activation and weight boxes, padding rows included) over the loads and
full times: the rate the SMs draw operands from L2 at.

    PYTHONPATH=$PWD [GEMM=gate_up|down] [SCHEME=fp8-block|none] [CFG=bm,bn,bk,group,stages] [GROUP_MS=1,2,8] \
        [FORMS=full,loads] python benchmarks/experiments/ws_bounds.py OUT.json preset:T,...
CFG: a warp-specialized tile for every row (else each row's table entry, which must be warp-specialized).
GROUP_MS: run each row's tile at each of these tile orders (GROUP_M) in turn (not GROUPS, which bash keeps).
FORMS: the forms to run (default all three).
"""
import json
import os
import subprocess
import sys

GEMM = os.environ.get("GEMM", "gate_up")
SCHEME = os.environ.get("SCHEME", "fp8-block")


from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from moeflow.kernels import warp_specialized as ws


@gluon.jit
def _wait_release(ready, empty, turn_bar, g0, n, STAGES: gl.constexpr, TURNS: gl.constexpr):
    """loads: wait for each of the tile's steps and release its slot; hand over the turn (TURNS)."""
    for k in range(n):
        g = g0 + k
        mbarrier.wait(ready.index(g % STAGES), (g // STAGES) & 1)
        mbarrier.arrive(empty.index(g % STAGES), count=1)
    if TURNS:
        mbarrier.arrive(turn_bar, count=1)


@gluon.jit
def _k_loop(a_bufs, w_bufs, ready, empty, turn_bar, g0, n, acc, acc_u, STAGES: gl.constexpr, GATED: gl.constexpr,
            ROW0: gl.constexpr = 0, TURNS: gl.constexpr = True):
    _wait_release(ready, empty, turn_bar, g0, n, STAGES, TURNS)
    return acc, acc_u


@gluon.jit
def _k_loop_scaled(a_bufs, w_bufs, ready, empty, turn_bar, g0, n, acc, d_a, d_b, as_rows, ws_tile,
                   STAGES: gl.constexpr, UNROLL: gl.constexpr):
    _wait_release(ready, empty, turn_bar, g0, n, STAGES, True)
    return acc, d_a, d_b


@gluon.jit
def _k_loop_quarters(a_bufs, w_bufs, ready, empty, turn_bar, g0, n, acc0, acc1, acc2, acc3, d_a, d_b,
                     as_rows, gs, us, STAGES: gl.constexpr, UNROLL: gl.constexpr, QN: gl.constexpr,
                     ROW0: gl.constexpr = 0, TURNS: gl.constexpr = True):
    _wait_release(ready, empty, turn_bar, g0, n, STAGES, TURNS)
    return acc0, acc1, acc2, acc3, d_a, d_b


@gluon.jit
def _loader(p, c: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
            GROUP_M: gl.constexpr, STAGES: gl.constexpr, GATED: gl.constexpr, ACT: gl.constexpr,
            SCALED: gl.constexpr, UNROLL: gl.constexpr, INTER_DTYPE: gl.constexpr):
    """math: every step's slot handed to the consumers as soon as it is free, nothing copied into it."""
    (a_desc, w_desc, a_bufs, w_bufs, ready, empty, turn, rw_ptr, out_ptr, blk_ptr, nblk_ptr, num_blocks,
     num_programs, N, K, w_rows_per_expert, stride_out, as_ptr, ws_ptr, stride_as, stride_wse, stride_wsn,
     outs_ptr, stride_outs) = p
    blocks_m, num_pid_n, my_tiles = ws._tiles(nblk_ptr, num_programs, N, BLOCK_N)
    n = gl.cdiv(K, BLOCK_K)
    for g in range(my_tiles * n):
        slot = g % STAGES
        mbarrier.wait(empty.index(slot), ((g // STAGES) & 1) ^ 1)
        mbarrier.arrive(ready.index(slot), count=1)


def _patch(form: str) -> None:
    """Swap the kernel's Gluon functions for the bound's (module docstring)."""
    if form == "loads":
        ws._k_loop, ws._k_loop_scaled, ws._k_loop_quarters = _k_loop, _k_loop_scaled, _k_loop_quarters
    elif form == "math":
        ws._loader = _loader


def operand_bytes(layout, cfg, n_out: int, k: int, elem: int, gated: bool) -> int:
    """Bytes of the activation and weight boxes every tile's K steps load (module docstring); the row blocks are the
    kernel's own (ws.block_table_torch)."""
    from moeflow.kernels.common import cdiv
    tiles = int(ws.block_table_torch(layout, cfg.block_m)[1]) * cdiv(n_out, cfg.block_n)
    w_rows = cfg.block_n * (2 if gated else 1)
    return tiles * cdiv(k, cfg.block_k) * (cfg.block_m + w_rows) * cfg.block_k * elem


def child(form: str, rows: list[str]) -> list[dict]:
    import torch
    _patch(form)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from dataclasses import replace
    from types import SimpleNamespace

    from _gemm_case import gemm_rows, preset_weights

    from moeflow.kernels.autotune import _layer_parts, random_batch
    from moeflow.kernels.configs import GemmConfig
    dev = torch.device("cuda")
    out, weights = [], {}
    for row in rows:
        preset, t = row.split(":")
        t = int(t)
        shape, w = preset_weights(preset, SCHEME, weights, dev)
        ins = gemm_rows(shape, t, GEMM, dev)
        kcfg = _layer_parts(shape)[1].kernel_config(random_batch(shape, t, dev, seed=t * 1000),
                                                    SimpleNamespace(w13=w.w13, w2=w.w2))
        cfg = kcfg.down if GEMM == "down" else kcfg.gate_up
        if os.environ.get("CFG"):
            bm, bn, bk, g, s = (int(v) for v in os.environ["CFG"].split(","))
            cfg = GemmConfig(bm, bn, bk, g, 4, s, warp_specialize=1)
        groups = [int(g) for g in os.environ.get("GROUP_MS", "").split(",") if g] or [cfg.group_m]
        for cfg in [replace(cfg, group_m=g) for g in groups]:
            out.append(_time_form(form, preset, t, shape, w, ins, cfg))
        ins = None
        torch.cuda.empty_cache()
    return out


def label(cfg) -> str:
    """A tile's short name: BMxBNxBK, tile order, stages."""
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} g{cfg.group_m} s{cfg.num_stages}"


def _time_form(form, preset, t, shape, w, ins, cfg) -> dict:
    """One row at one tile in this process's form -> its record (us, TFLOP/s, operand GB and TB/s, or error)."""
    import torch
    from _gemm_case import gemm_runner

    from moeflow.kernels.autotune import graph_time_ms
    rec = dict(form=form, preset=preset, T=t, gemm=GEMM, scheme=SCHEME, cfg=str(cfg), tile=label(cfg))
    if not cfg.warp_specialize:
        return dict(rec, error="not warp-specialized")
    run = gemm_runner(GEMM, w, SCHEME)
    n_out, k = (shape.hidden, shape.inter) if GEMM == "down" else (shape.inter, shape.hidden)
    nbytes = operand_bytes(ins[0][2], cfg, n_out, k, 1 if SCHEME == "fp8-block" else 2, GEMM == "gate_up")
    flops = 2 * t * shape.top_k * shape.hidden * shape.inter * (2 if GEMM == "gate_up" else 1)
    try:
        run(ins[0], cfg)
        torch.cuda.synchronize()
        us = graph_time_ms([lambda d=d: run(d, cfg) for d in ins], 20) * 1e3
        rec = dict(rec, us=round(us, 1), tflops=round(flops / us / 1e6), operand_gb=round(nbytes / 1e9, 3),
                   operand_tbs=round(nbytes / us / 1e6, 2))
    except Exception as exc:  # recorded, not fatal
        rec = dict(rec, error=repr(exc)[:300])
    print(json.dumps(rec), file=sys.stderr, flush=True)
    return rec


def main():
    if os.environ.get("WS_BOUND_FORM"):
        print(json.dumps(child(os.environ["WS_BOUND_FORM"], sys.argv[1].split(","))))
        return
    out_path, rows = sys.argv[1], sys.argv[2]
    res = []
    for form in os.environ.get("FORMS", "full,loads,math").split(","):
        p = subprocess.run([sys.executable, __file__, rows], env={**os.environ, "WS_BOUND_FORM": form},
                           capture_output=True, text=True)
        if p.returncode:
            print(form, "failed:", p.stderr[-2000:], flush=True)
            continue
        res += json.loads(p.stdout.strip().splitlines()[-1])
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    by = {}
    for r in res:
        by.setdefault((r["preset"], r["T"], r["cfg"]), {})[r["form"]] = r
    print(f"{'row':28} {'tile':18} {'full µs':>9} {'loads µs':>9} {'math µs':>9} {'GB':>7} {'TB/s full':>9} "
          f"{'TB/s loads':>10}")
    for (preset, t, cfg), d in by.items():
        g = lambda f, k: d.get(f, {}).get(k, "-")
        tile = next(iter(d.values()))["tile"]
        print(f"{preset + ' ' + GEMM + ' T=' + str(t):28} {tile:18} {g('full', 'us'):>9} {g('loads', 'us'):>9} "
              f"{g('math', 'us'):>9} {g('full', 'operand_gb'):>7} {g('full', 'operand_tbs'):>9} "
              f"{g('loads', 'operand_tbs'):>10}")


if __name__ == "__main__":
    main()
