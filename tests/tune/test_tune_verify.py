"""`moeflow tune` checks the configs it records (tune/verify.py, autotune.gemm_checks / _fastest_correct): the
kernels' own outputs pass under the CPU interpreter, outputs with faults planted in them are refused, and the
search falls back to the next fastest candidate, or raises MF607 when none is right."""
from dataclasses import replace

import pytest
import torch

from triton_interp import SKIP_REASON

from moeflow.errors import MoeflowError
from moeflow.tune import verify

interp = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))
SCHEMES = ["none", "fp8-tensor", "fp8-channel", "fp8-block"]


def _shape(scheme):
    from moeflow.tune import autotune
    return autotune.Shape(6, 256, 128, 2, scheme, torch.float16)


def _setup(scheme, tokens=7):
    """(shape, weights, (check_gate_up, check_down), the first gemm_inputs tuple, the down's inputs from it)."""
    from moeflow.tune import autotune
    from moeflow.kernels.rows.quant import down_input
    shape = _shape(scheme)
    weights = autotune.random_weights(shape, "cpu")
    checks = autotune.gemm_checks(shape, weights)
    inp = autotune.gemm_inputs(shape, autotune.tuner_routings(shape, tokens, "cpu")[:1], False)[0]
    gu, dn = autotune.candidates(shape, tokens)
    run_gu, _ = autotune.gemm_runners(shape, weights)
    a, a_s = down_input(*run_gu(gu[0], inp), scheme)
    return shape, weights, checks, inp, (a, a_s, inp[0].weights, inp[1]), gu, dn


@pytest.mark.slow
@interp
@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_kernels_pass_their_check(scheme):
    """The tuner's first candidates of each GEMM (interpreter, fp16 layer) pass with a wide margin: the limit sits
    well above a correct output's rounding. fp8-block: a narrow gate_up tile (layer-dtype output) and one with the
    groups quantized in its epilogue (fp8 output, compared with the reference quantized the same way)."""
    _, _, (check_gu, check_dn), inp, down_in, gu, dn = _setup(scheme)
    tried = gu[:1] + [c for c in gu if c.block_n % 128 == 0][:1 if scheme == "fp8-block" else 0]
    for c in tried:
        err = check_gu(c, inp)
        assert err < verify.MAX_REL_ERR / 10, (c, err)
    err = check_dn(dn[0], *down_in)
    assert err < verify.MAX_REL_ERR / 10, (dn[0], err)


def _faulty(monkeypatch, module, name, fault):
    """Replace kernels/<module>.<name> by the torch reference beside it with ``fault`` applied to its output."""
    import importlib
    mod = importlib.import_module(f"moeflow.kernels.gemm.{module}")
    ref = getattr(mod, f"{name}_torch")

    def run(*args, poison=False, source_rows=None, **kw):
        if name == "gate_up":
            x, xs, w, ws, layout, scheme, act, dtype, _cfg = args
            return fault(ref(x, xs, w, ws, layout, scheme, act, dtype, source_rows=source_rows), layout), None
        a, a_s, w, ws, rw, layout, scheme, dtype, _cfg = args
        return fault(ref(a, a_s, w, ws, rw, layout, scheme, dtype), layout)

    monkeypatch.setattr(mod, name, run)


def _rows_of(layout, e):
    offs = layout.meta.tolist()
    return slice(offs[e], offs[e + 1])


def _last_expert(layout):
    offs = layout.meta.tolist()
    return max(e for e in range(len(offs) - 1) if offs[e + 1] > offs[e])


FAULTS = {
    "none": lambda out, layout: out,  # the reference itself: passes
    "a NaN left": lambda out, layout: out.index_put_((torch.tensor([out.shape[0] - 1]), torch.tensor([3])),
                                                     torch.tensor(float("nan"), dtype=out.dtype)),
    "the last expert's rows unwritten (zeros)": lambda out, layout: out.index_fill_(
        0, torch.arange(out.shape[0])[_rows_of(layout, _last_expert(layout))], 0),
    "columns past the first tile unwritten": lambda out, layout: out.index_fill_(1, torch.arange(64, out.shape[1]), 0),
    "values twice as large": lambda out, layout: out.mul_(2),
    "one row's values in another row": lambda out, layout: out.index_copy_(0, torch.tensor([0]), out[-1:].clone()),
}


@interp
@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["none", "fp8-block"])
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("gemm", ["gate_up", "down"])
def test_wrong_outputs_are_refused(monkeypatch, scheme, fault, gemm):
    """A GEMM that writes the reference's values passes; one with a fault planted fails its check (error over the
    limit, or not finite)."""
    from moeflow.tune import autotune
    shape, weights, _, inp, down_in, gu, dn = _setup(scheme, tokens=9)
    _faulty(monkeypatch, gemm, gemm, FAULTS[fault])
    check_gu, check_dn = autotune.gemm_checks(shape, weights)  # made after the patch: they import the kernels
    err = check_gu(gu[0], inp) if gemm == "gate_up" else check_dn(dn[0], *down_in)
    if fault == "none":
        assert err < verify.MAX_REL_ERR / 10, err
    else:
        assert not err <= verify.MAX_REL_ERR, (fault, err)


@interp
def test_a_wrong_expert_is_refused():
    """Rows multiplied by a neighbouring expert's weights (a block table off by one) are far outside the limit."""
    from moeflow.kernels.common import RowLayout
    from moeflow.kernels.gemm.down import down_torch
    shape, weights, _, inp, (a, a_s, rw, layout), _, _ = _setup("none", tokens=9)
    shifted = RowLayout(False, torch.cat([layout.meta[:1], layout.meta[:-1]]), layout.num_experts, 0, layout.rows)
    out = down_torch(a, a_s, weights.w2, weights.w2_scale, rw, shifted, "none", shape.dtype)
    err = verify.gemm_error("down", "none", "silu", layout.meta, (a, a_s, rw), (weights.w2, weights.w2_scale), (out,))
    assert err > 10 * verify.MAX_REL_ERR, err


def test_fastest_correct_falls_back_and_reports():
    """The fastest passing candidate wins; faster ones that failed are listed (error rounded, None for NaN or
    inf); none passing raises MF607 naming the GEMM, T and the refused."""
    from moeflow.tune.autotune import _fastest_correct
    from moeflow.kernels.configs import GemmConfig
    cfgs = [GemmConfig(16, bn, 128, 1, 4, 3) for bn in (32, 64, 128, 256)]
    ms = [0.4, 0.1, 0.3, 0.2]  # fastest first: 64, 256, 128, 32
    errs = {64: float("nan"), 256: 0.5, 128: 1e-3, 32: 1e-3}
    best, t, refused = _fastest_correct("down", 16, cfgs, ms, lambda c: errs[c.block_n])
    assert best == cfgs[2] and t == 0.3
    assert [(r["gemm"], r["config"]["block_n"], r["rel_err"]) for r in refused] == [("down", 64, None),
                                                                                    ("down", 256, 0.5)]
    best, _, refused = _fastest_correct("down", 16, cfgs, ms, lambda c: 0.0)
    assert best == cfgs[1] and refused == []
    with pytest.raises(MoeflowError) as exc:
        _fastest_correct("gate_up", 4096, cfgs, ms, lambda c: float("inf"))
    assert exc.value.code == "MF607" and "T=4096" in str(exc.value) and "4 gate_up candidates" in str(exc.value)


def test_refused_notes_name_a_loadable_config():
    """The "refused" notes tune() stores hold a GemmConfig's fields, which load back into the same config."""
    from moeflow.tune.autotune import _fastest_correct
    from moeflow.kernels.configs import GemmConfig
    bad = replace(GemmConfig(64, 128, 128, 8, 4, 4), warp_specialize=1)
    good = GemmConfig(128, 128, 128, 8, 8, 3)
    _, _, refused = _fastest_correct("gate_up", 1024, [bad, good], [1.0, 2.0],
                                     lambda c: 1.0 if c == bad else 0.0)
    assert [GemmConfig(**r["config"]) for r in refused] == [bad]


@interp
def test_fp8_group_outputs_are_checked_against_the_same_quantization():
    """gate_up's fp8-block groups: the reference's own groups pass at ~0 error (the reference is quantized the same
    way), a scale off by 2 in one row's group, or a group's bytes from another row, does not."""
    from moeflow.kernels.gemm.gate_up import gate_up_torch
    from moeflow.quant import create_scheme
    shape, weights, _, (batch, layout, xq, xs), _, _, _ = _setup("fp8-block", tokens=9)
    ref = gate_up_torch(xq, xs, weights.w13, weights.w13_scale, layout, "fp8-block", "silu", shape.dtype)
    q, s = create_scheme("fp8-block").quantize_activation(ref)

    def err(q, s):
        return verify.gemm_error("gate_up", "fp8-block", "silu", layout.meta, (xq, xs),
                                 (weights.w13, weights.w13_scale), (q, s), shape.dtype)

    assert err(q, s) < 1e-6
    bad_scale = s.clone()
    bad_scale[2, 0] *= 2
    assert not err(q, bad_scale) <= verify.MAX_REL_ERR
    swapped = q.clone()
    swapped[[0, 1]] = q[[1, 0]]
    assert not err(swapped, s) <= verify.MAX_REL_ERR


@interp
@pytest.mark.parametrize("scheme", ["fp8-tensor", "fp8-channel"])
def test_gathered_amax_is_checked(scheme):
    """fp8-tensor / fp8-channel gate_up also returns the amax of |inter| it gathered (atomic max), which sets the down
    input's scale: the kernel's passes; one row's (or the tensor's) amax off, or left at zero, is refused."""
    shape, weights, (check_gu, _), inp, _, gu, _ = _setup(scheme, tokens=9)
    from moeflow.kernels.gemm.gate_up import gate_up
    batch, layout, xq, xs = inp
    inter, extra = gate_up(xq, xs, weights.w13, weights.w13_scale, layout, scheme, "silu", shape.dtype, gu[0])

    def err(extra):
        return verify.gemm_error("gate_up", scheme, "silu", layout.meta, (xq, xs), (weights.w13, weights.w13_scale),
                                 (inter, extra), shape.dtype)

    assert extra.shape == ((1,) if scheme == "fp8-tensor" else (inter.shape[0],))
    assert err(extra) < verify.MAX_REL_ERR / 10
    off = extra.clone()
    off[-1] *= 1.5
    assert err(off) == float("inf") and err(torch.zeros_like(extra)) == float("inf")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_random_weights_in_chunks_of_any_size_are_the_same(scheme):
    """random_weights draws and quantizes at most chunk_bytes of high-precision weight at a time (Mixtral's 8 experts
    at once held 12 GB of FP8 temporaries); on the CPU's serial generator the chunking changes no bit."""
    from moeflow.tune import autotune
    shape = _shape(scheme)
    whole = autotune.random_weights(shape, "cpu")
    one = autotune.random_weights(shape, "cpu", chunk_bytes=1)  # one expert at a time
    three = autotune.random_weights(shape, "cpu", chunk=3)  # 6 experts: two chunks of 3
    for name in ("w13", "w2", "w13_scale", "w2_scale"):
        a, b, c = (getattr(w, name) for w in (whole, one, three))
        if a is None:
            assert b is None and c is None
            continue
        bits = (lambda t: t.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (lambda t: t)
        assert torch.equal(bits(a), bits(b)) and torch.equal(bits(a), bits(c))
