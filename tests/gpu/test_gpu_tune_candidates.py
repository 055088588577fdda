"""Every kernel config `moeflow tune` may time, and so record, computes the right values on this GPU: each gate_up
and down candidate of autotune.candidates at the three families of rows per expert (weight streaming m <= 16, the
middle, large tiles), every scheme, an aligned shape (the warp-specialized and Gluon kernels' sizes) and an odd one
(K tails, partial tiles), gate_up with rows by index and in order. Each runs with its outputs poisoned and is checked
as tune() checks its pick (tune/verify.py: every element written, every expert's rows within MAX_REL_ERR of
the float64 reference). Also tune() itself refusing a wrong fastest candidate.
Run: pytest -m gpu tests/gpu/test_gpu_tune_candidates.py (about 900 cases, compiled in 12 worker processes).
"""
import pytest
import torch

from moeflow.tune import verify
from moeflow.tune.autotune import Shape
from moeflow.kernels.configs import FusedConfig, GemmConfig

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
    from moeflow.tune import autotune
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


# the corners a hand-edited file may reach (configs.checked admits them, fit() adapts them): the largest and
# smallest tiles, 1 and 8 warps (16, which checked refuses, failed in ptxas: 128 registers a thread), 8 stages, wide
# groups, long splits, persistent downs, every Gluon flag on tiles that are not its own
EXTREMES = [GemmConfig(256, 256, 256, 64, 4, 8), GemmConfig(256, 256, 256, 1, 8, 8), GemmConfig(1, 1, 1, 1, 1, 1),
            GemmConfig(16, 16, 16, 1, 1, 8, split_k=64), GemmConfig(128, 64, 32, 8, 2, 2, programs_per_sm=8),
            GemmConfig(32, 256, 128, 3, 8, 5, scale_overlap=2, x_tma=1, warp_specialize=1, swap_ab=1),
            GemmConfig(64, 32, 64, 1, 4, 4, swap_ab=1, split_k=4), GemmConfig(128, 128, 128, 2, 8, 8, x_tma=1)]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_hand_edited_extremes_compute_right(scheme):
    """Extreme configs a person may write into a file, fitted as the runner fits a table's entries, run every GEMM
    right at the aligned and odd shapes (rows by index and in order), small and large T."""
    from candidate_checks import check_all
    from moeflow.kernels.gemm.tiles import fit
    jobs = []
    for (e, h, i, k), token_counts in (ALIGNED, ODD):
        shape = Shape(e, h, i, k, scheme)
        nbytes = 1 if scheme != "none" else 2
        for t in (token_counts[0], token_counts[2]):
            for c in EXTREMES:
                gu = fit(c, fused_pair=True, scheme=scheme, elem_bytes=nbytes, n_size=i)
                dn = fit(c, fused_pair=False, scheme=scheme, elem_bytes=nbytes, n_size=h)
                jobs += [(shape, t, "gate_up", gu, True), (shape, t, "gate_up", gu, False), (shape, t, "down", dn, False)]
    results = check_all(jobs)
    bad = [(f"{s.num_experts}x{s.hidden}x{s.inter} T={t} {gemm} {cfg}", r) for (s, t, gemm, cfg, _), r in results
           if isinstance(r, str) or not r <= verify.MAX_REL_ERR]
    assert not bad, f"{len(bad)} of {len(results)} wrong:\n" + "\n".join(f"  {c}: {r}" for c, r in bad)


FUSED_EXTREMES = [FusedConfig(256, 256, 256, 256, 8, 8, 64, 64), FusedConfig(1, 1, 1, 1, 1, 1),
                  FusedConfig(16, 256, 256, 16, 2, 8, 1, 64), FusedConfig(128, 32, 32, 128, 8, 2, 8, 1)]


@pytest.mark.parametrize("scheme", ["none", "fp8-channel", "fp8-block"])
@pytest.mark.parametrize("cfg", FUSED_EXTREMES, ids=str)
def test_hand_edited_one_launch_extremes_compute_right(scheme, cfg):
    """The one-launch layer's tiles at the corners a file may hold (fit_fused adapts them: shared memory, the
    scheme's BLOCK_K): poisoned, repeated (the same bits), against its torch reference and the float64 oracle."""
    from fused_cases import check_fused
    check_fused(scheme, torch.bfloat16, 3, 16, 512, 256, 4, cfg, repeats=2, device="cuda")
