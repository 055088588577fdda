"""Every kernel config `moeflow tune` may time, and so record, computes the right values on this GPU: each gate_up
and down candidate of autotune.candidates at the three families of rows per expert (weight streaming m <= 16, the
middle, large tiles), every scheme, an aligned shape (the warp-specialized and Gluon kernels' sizes) and an odd one
(K tails, partial tiles), gate_up with rows by index and in order. Each runs with its outputs poisoned and is checked
as tune() checks its pick (kernels/verify.py: every element written, the sampled experts' rows within MAX_REL_ERR of
the float64 reference). Also tune() itself refusing a wrong fastest candidate.
Run: pytest -m gpu tests/gpu/test_gpu_tune_candidates.py (about 900 cases, compiled in 12 worker processes).
"""
import pytest
import torch

from moeflow.kernels import verify
from moeflow.kernels.autotune import Shape

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCHEMES = ("none", "fp8-tensor", "fp8-channel", "fp8-block")
# (E, H, I, top_k), token counts giving m = T * top_k / E in each candidate family
ALIGNED = ((16, 512, 256, 4), (32, 256, 2048))  # m = 8, 64, 512
ODD = ((5, 200, 72, 3), (8, 100, 400))  # m = 4.8, 60, 240


@pytest.mark.parametrize("sizes", [ALIGNED, ODD], ids=["aligned", "odd"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_tuner_candidate_computes_right(scheme, sizes):
    from candidate_checks import check_all, jobs_for
    (e, h, i, k), token_counts = sizes
    dtypes = (torch.bfloat16, torch.float16) if scheme == "none" and sizes is ODD else (torch.bfloat16,)
    jobs = [job for dt in dtypes for t in token_counts for job in jobs_for(Shape(e, h, i, k, scheme, dt), t)]
    results = check_all(jobs)
    bad = [(f"{s.dtype} T={t} {gemm} {'by index' if idx else 'in order'} {cfg}", r)
           for (s, t, gemm, cfg, idx), r in results if isinstance(r, str) or not r <= verify.MAX_REL_ERR]
    assert not bad, f"{len(bad)} of {len(results)} candidates wrong:\n" + "\n".join(f"  {c}: {r}" for c, r in bad)


def test_tune_refuses_a_wrong_fastest_candidate(monkeypatch):
    """tune() with the check reporting every gate_up and down candidate but the slowest as wrong: the table takes
    the slowest of each, and the file's notes list the others as refused, fastest first."""
    from moeflow.kernels import autotune
    real = autotune.gemm_checks
    slowest = {}

    def checks(shape, weights):
        gu, dn = real(shape, weights)
        return (lambda c, *a: gu(c, *a) if c == slowest.get("gate_up") else float("nan"),
                lambda c, *a: dn(c, *a) if c == slowest.get("down") else float("inf"))

    real_fastest = autotune._fastest_correct

    def fastest(gemm, tokens, cfgs, ms, check):
        slowest[gemm] = cfgs[max(range(len(cfgs)), key=ms.__getitem__)]
        return real_fastest(gemm, tokens, cfgs, ms, check)

    monkeypatch.setattr(autotune, "gemm_checks", checks)
    monkeypatch.setattr(autotune, "_fastest_correct", fastest)
    shape = Shape(8, 256, 128, 2, "fp8-block")
    table, measured = autotune.tune(shape, [300], rep_ms=2, log=lambda s: None)
    gu, dn = autotune.candidates(shape, 300)
    assert table[300].gate_up == slowest["gate_up"] and table[300].down == slowest["down"]
    refused = measured["300"]["refused"]
    assert [r["gemm"] for r in refused] == ["gate_up"] * (len(gu) - 1) + ["down"] * (len(dn) - 1)
    assert all(r["rel_err"] is None for r in refused)
