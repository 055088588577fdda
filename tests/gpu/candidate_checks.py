"""Run `moeflow tune`'s correctness check (autotune.gemm_checks) on every candidate the tuner may time, in worker
processes (each compiles its share of the kernels; Triton's on-disk cache is shared). Used by
test_gpu_tune_candidates.py; a helper module, not a test file.

A job: (shape, tokens, gemm "gate_up" | "down", GemmConfig, rows by index). A worker builds each (shape, tokens,
rows by index)'s weights and batch once (seeded by the shape and T: fresh data for each case, the same in every
worker), runs the candidate with its outputs poisoned and returns its relative error against the float64
reference, or the exception it raised.
"""
from __future__ import annotations

import multiprocessing as mp
import zlib
from concurrent.futures import ProcessPoolExecutor

DEVICE = "cuda"  # a CPU smoke run of _worker under TRITON_INTERPRET=1 may set "cpu"


def jobs_for(shape, tokens: int) -> list[tuple]:
    """Every candidate of both GEMMs at T = tokens: gate_up with rows by index and in order, the down once."""
    from moeflow.tune.autotune import candidates
    gu, dn = candidates(shape, tokens)
    return ([(shape, tokens, "gate_up", c, indexed) for c in gu for indexed in (True, False)]
            + [(shape, tokens, "down", c, False) for c in dn])


def _seed(shape, tokens: int) -> int:
    return zlib.crc32(repr((shape, tokens)).encode()) % (2 ** 31)


def _case(shape, tokens: int, indexed: bool):
    """-> (check_gate_up, check_down, the gate_up input tuple, the down's inputs)."""
    from moeflow.tune import autotune
    from moeflow.kernels.rows.quant import down_input
    seed = _seed(shape, tokens)
    weights = autotune.random_weights(shape, DEVICE, seed=seed)
    routing = autotune.random_routing(shape, tokens, DEVICE, seed=seed + 1)
    inp = autotune.gemm_inputs(shape, [routing], indexed)[0]
    run_gu, _ = autotune.gemm_runners(shape, weights)
    first = autotune.candidates(shape, tokens)[0][0]  # any gate_up makes finite down inputs; its own check is a job
    a, a_s = down_input(*run_gu(first, inp), shape.scheme)
    return (*autotune.gemm_checks(shape, weights), inp, (a, a_s, inp[0].weights, inp[1]))


def _worker(jobs: list[tuple[int, tuple]]) -> list[tuple[int, float | str]]:
    import torch
    cases, out = {}, []
    for j, (shape, tokens, gemm, cfg, indexed) in jobs:
        key = (shape, tokens, indexed)
        try:
            if key not in cases:
                cases[key] = _case(shape, tokens, indexed)
            check_gu, check_dn, inp, down_in = cases[key]
            err = check_gu(cfg, inp) if gemm == "gate_up" else check_dn(cfg, *down_in)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            out.append((j, err))
        except Exception as exc:  # a compile error or a launch fault is a failed case, reported with the rest
            out.append((j, f"{type(exc).__name__}: {str(exc)[:300]}"))
    return out


def check_all(jobs: list[tuple], workers: int = 12) -> list[tuple[tuple, float | str]]:
    """-> [(job, relative error or the exception text)] in the order of ``jobs``."""
    numbered = list(enumerate(jobs))
    chunks = [numbered[i::workers] for i in range(workers) if numbered[i::workers]]
    with ProcessPoolExecutor(len(chunks), mp_context=mp.get_context("spawn")) as pool:
        results = dict(r for part in pool.map(_worker, chunks) for r in part)
    return [(job, results[j]) for j, job in numbered]
