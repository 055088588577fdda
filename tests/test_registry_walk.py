"""The registry walk: every (scheme, runner, dispatcher) cell of ``moeflow.planner.matrix`` on this
CPU machine is either BUILT, RUN and compared with the oracle ("ok"), or refused at construction
with its documented code, which ``moeflow explain CODE`` explains. Hypothetical environments
(Hopper, Ampere, two CPU ranks) are walked at the planner level: refusals carry catalogue codes.

Also the catalogue's own hygiene: every code explained (What/When/Fix/Example), every
``error("MFxxx"`` literal in the package catalogued, and no NotImplementedError or bare ``assert``
anywhere in moeflow/.
"""
import ast
import re
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moeflow
from moeflow import MoE, MoEConfig, MoeflowError
from moeflow.capabilities import Environment
from moeflow.dispatch import DISPATCHERS
from moeflow.errors import CATALOGUE, error, explain
from moeflow.experts import RUNNERS
from moeflow.planner import matrix, plan
from oracle import assert_close, layer_oracle, route_for
from tolerances import rel_tol

PACKAGE = Path(moeflow.__file__).parent
CPU = Environment.detect(torch.device("cpu"))  # this machine, one process
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TEMPLATES = {
    # block-aligned sizes: every scheme's shape rules hold
    "aligned": dict(num_experts=8, hidden_size=128, intermediate_size=128, top_k=2),
    # non-power-of-two sizes, grouped sigmoid routing, shared experts: fp8-block refuses (MF206)
    "odd": dict(num_experts=6, hidden_size=96, intermediate_size=40, top_k=3, scoring="sigmoid",
                num_expert_groups=3, topk_groups=2, use_correction_bias=True, num_shared_experts=1,
                shared_intermediate_size=24),
}
BUILTIN = (ValueError, TypeError, RuntimeError, TimeoutError)


def walk(env):
    """[(template, dtype, scheme, runner, dispatcher, status)] over every registered cell."""
    cells = []
    for name, fields in TEMPLATES.items():
        for dtype in DTYPES:
            for row in matrix(MoEConfig(**fields, dtype=dtype), env):
                cells.append((name, dtype, *row))
    return cells


CPU_CELLS = walk(CPU)


def cell_id(c):
    return "-".join(str(v).removeprefix("torch.") for v in c)


def test_the_walk_is_not_vacuous():
    statuses = {c[-1] for c in CPU_CELLS}
    assert "ok" in statuses and len(statuses) > 1  # both built and refused cells on CPU
    n = len(RUNNERS.names()) * len(DISPATCHERS.names()) * 4 * len(DTYPES) * len(TEMPLATES)
    assert len(CPU_CELLS) == n


@pytest.mark.parametrize("cell", CPU_CELLS, ids=cell_id)
def test_cpu_cell(cell, poison, weights_for):
    template, dtype, scheme, runner, dispatcher, status = cell
    cfg = MoEConfig(**TEMPLATES[template], dtype=dtype, quant=scheme, runner=runner, dispatcher=dispatcher)
    if status != "ok":
        with pytest.raises(MoeflowError) as info:
            MoE(cfg)  # refused when the layer is built
        err = info.value
        assert err.code == status
        assert isinstance(err, CATALOGUE[status].cls) and isinstance(err, BUILTIN)
        assert f"moeflow explain {status}" in str(err)
        assert status in explain(status) and CATALOGUE[status].title in explain(status)
        return
    layer = MoE(cfg)
    assert (layer.plan.scheme, layer.plan.runner, layer.plan.dispatcher) == (scheme, runner, dispatcher)
    layer.load_weights(weights_for(cfg))
    x = torch.randn(19, cfg.hidden_size).to(dtype)
    logits = torch.randn(19, cfg.num_experts)
    ids, w = route_for(cfg, logits, layer.e_score_correction_bias)
    assert_close(layer(x, logits), layer_oracle(layer, x, ids, w), rel_tol(scheme, dtype), what=cell_id(cell))


REFUSED_CODES = sorted({c[-1] for c in CPU_CELLS if c[-1] != "ok"})


@pytest.mark.parametrize("code", REFUSED_CODES)
def test_cli_explains_refusal_codes(code, capsys):
    from moeflow.cli import main

    assert main(["explain", code]) == 0
    assert capsys.readouterr().out.strip() == explain(code).strip()


def test_python_m_moeflow_explain():
    """The real entry point, in a fresh interpreter (one code: a subprocess costs seconds)."""
    code = REFUSED_CODES[0]
    root = PACKAGE.parent
    proc = subprocess.run([sys.executable, "-m", "moeflow", "explain", code], capture_output=True, text=True,
                          cwd=root, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == explain(code).strip()


# ---------------------------------------------------------------- hypothetical environments
HYPOTHETICAL = {
    "cuda-sm90": Environment("cuda", (9, 0)),
    "cuda-sm80": Environment("cuda", (8, 0)),
    "cpu-2-ranks": Environment("cpu", None, world_size=2),
}


@pytest.mark.parametrize("env_name", HYPOTHETICAL)
def test_hypothetical_environment_refusals_are_coded(env_name):
    env = HYPOTHETICAL[env_name]
    cells = walk(env)
    for template, dtype, scheme, runner, dispatcher, status in cells:
        if status == "ok":
            continue
        assert status in CATALOGUE and status.startswith("MF2"), status
        cfg = MoEConfig(**TEMPLATES[template], dtype=dtype, quant=scheme, runner=runner, dispatcher=dispatcher)
        with pytest.raises(MoeflowError) as info:
            plan(cfg, env)
        err = info.value
        assert err.code == status and isinstance(err, CATALOGUE[status].cls)
        named = (runner, dispatcher, scheme, "hidden_size", "intermediate_size")
        assert any(n in str(err) for n in named), f"{status} does not name the offending value: {err}"
    assert any(c[-1] == "ok" for c in cells) or env_name == "cpu-2-ranks"


def status_of(env, scheme, runner, dispatcher, dtype=torch.bfloat16, template="aligned"):
    cfg = MoEConfig(**TEMPLATES[template], dtype=dtype)
    rows = {(s, r, d): st for s, r, d, st in matrix(cfg, env)}
    return rows[(scheme, runner, dispatcher)]


def test_known_cells():
    """Specific cells whose status the capability declarations fix."""
    sm90, sm80, two = HYPOTHETICAL["cuda-sm90"], HYPOTHETICAL["cuda-sm80"], HYPOTHETICAL["cpu-2-ranks"]
    assert status_of(CPU, "none", "grouped_mm", "local") == "ok"
    assert status_of(CPU, "fp8-tensor", "grouped_mm", "local") == "MF202"  # no CPU FP8 grouped GEMM
    assert status_of(CPU, "fp8-block", "reference", "local", template="odd") == "MF206"  # H=96 not /128
    assert status_of(sm90, "none", "grouped_mm", "local") == "ok"
    assert status_of(sm90, "fp8-channel", "grouped_mm", "local") == "ok"  # row-wise _scaled_grouped_mm
    assert status_of(sm90, "fp8-block", "grouped_mm", "local") == "MF202"  # no block-scale mode
    assert status_of(sm90, "none", "grouped_mm", "local", dtype=torch.float32) == "MF207"
    assert status_of(sm80, "none", "grouped_mm", "local") == "MF204"  # needs sm90
    assert status_of(sm80, "fp8-block", "reference", "local") == "ok"  # the reference runs anywhere
    for scheme in ("none", "fp8-tensor", "fp8-channel", "fp8-block"):
        assert status_of(two, scheme, "reference", "local") == "MF208"  # local serves one process


def test_auto_picks_the_highest_priority_valid_runner():
    for scheme in ("none", "fp8-block"):
        layer = MoE(num_experts=4, hidden_size=128, intermediate_size=128, top_k=2, quant=scheme, dtype=torch.float32)
        valid = [r for s, r, d, st in matrix(layer.config.replace(runner="auto"), CPU)
                 if s == scheme and d == layer.plan.dispatcher and st == "ok"]
        best = max(valid, key=lambda r: RUNNERS.get(r).caps.priority)
        assert layer.plan.runner == best
        assert best in str(layer.plan) and "auto" in str(layer.plan)
    assert MoE(num_experts=4, hidden_size=64, intermediate_size=32, top_k=2,
               dtype=torch.float32).plan.runner == "grouped_mm"  # over reference on CPU


def test_router_choice():
    """The plan routes with the one-launch Triton router where its caps allow, else torch, and says why."""
    from moeflow.planner import check_router
    sm90 = Environment("cuda", (9, 0))
    base = MoEConfig(num_experts=256, hidden_size=128, intermediate_size=128, top_k=8, scoring="sigmoid",
                     num_expert_groups=8, topk_groups=4, use_correction_bias=True)
    assert plan(base, sm90).router == "triton" and "router 'auto' -> 'triton'" in str(plan(base, sm90))
    assert plan(base, CPU).router == "torch" and check_router("triton", base, CPU).code == "MF203"
    too_many = base.replace(num_experts=2048)
    assert plan(too_many, sm90).router == "torch" and check_router("triton", too_many, sm90).code == "MF206"
    odd_grouped = base.replace(num_experts=96)
    assert plan(odd_grouped, sm90).router == "torch" and check_router("triton", odd_grouped, sm90).code == "MF206"
    assert plan(odd_grouped.replace(num_expert_groups=1, topk_groups=1), sm90).router == "triton"
    no_triton = Environment("cuda", (9, 0), unavailable=frozenset({"triton"}))
    assert plan(base, no_triton).router == "torch" and check_router("triton", base, no_triton).code == "MF205"
    assert "skipped triton (MF205)" in str(plan(base, no_triton))


@pytest.mark.parametrize("cc", [(7, 5), (8, 7), (10, 3), (12, 1)])
def test_triton_router_and_glue_only_on_the_gpus_they_are_built_for(cc, monkeypatch):
    """The Triton router, like the runners, is planned only on the GPUs its kernels are built for (moeflow.targets:
    sm_80 to sm_120): elsewhere the torch router routes and check_router says MF210, naming the targets;
    MOEFLOW_ALLOW_UNVALIDATED_GPU=1 lets it through. The dispatchers' Triton kernels (sort, top-k sum, row packing)
    follow the same rule (capabilities.triton_glue), and those that write FP8 run only where FP8 is (sm_89 on)."""
    from moeflow import capabilities
    from moeflow.planner import check_router
    cfg = MoEConfig(num_experts=64, hidden_size=128, intermediate_size=128, top_k=4)
    env = Environment("cuda", cc)
    assert plan(cfg, env).router == "torch" and "skipped triton (MF210)" in str(plan(cfg, env))
    err = check_router("triton", cfg, env)
    assert err.code == "MF210" and "router 'triton'" in str(err) and "valid routers here: ['torch']" in str(err)
    assert "sm_80, sm_86, sm_89, sm_90, sm_100, sm_120" in str(err)
    for built in ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)):
        assert plan(cfg, Environment("cuda", built)).router == "triton"

    class OnCuda:  # what triton_glue reads of a tensor
        is_cuda, device = True, torch.device("cuda", 0)
    monkeypatch.setattr(capabilities, "_capability", lambda index: cc)
    assert not capabilities.triton_glue(OnCuda()) and not capabilities.triton_glue(torch.zeros(1))
    monkeypatch.setattr(capabilities, "_capability", lambda index: (8, 0))
    assert capabilities.triton_glue(OnCuda()) and not capabilities.triton_glue(OnCuda(), fp8=True)
    monkeypatch.setattr(capabilities, "_capability", lambda index: (8, 9))
    assert capabilities.triton_glue(OnCuda(), fp8=True)
    monkeypatch.setenv("MOEFLOW_ALLOW_UNVALIDATED_GPU", "1")
    monkeypatch.setattr(capabilities, "_capability", lambda index: cc)
    assert capabilities.triton_glue(OnCuda()) and plan(cfg, env).router == "triton"


def test_refusals_name_alternatives_that_build():
    """MF204, MF206 and MF207 name the alternatives that pass every check here: MF207's dtypes are those the runner
    then accepts (it had named bfloat16 for grouped_mm on GPUs where grouped_mm is refused in any dtype), and a
    scheme's MF206 names the schemes whose rules hold (the reference runner has the same rule to meet)."""
    from moeflow.planner import check_runner, check_scheme
    fp16 = MoEConfig(num_experts=8, hidden_size=256, intermediate_size=128, top_k=2, dtype=torch.float16)
    sm80, sm90 = Environment("cuda", (8, 0)), Environment("cuda", (9, 0))
    err = check_runner("grouped_mm", fp16, sm80)
    assert err.code == "MF207" and "dtypes it runs here: []" in str(err) and "['reference', 'triton']" in str(err)
    assert "dtypes it runs here: ['bfloat16']" in str(check_runner("grouped_mm", fp16, sm90))
    err = check_runner("triton", fp16.replace(dtype=torch.bfloat16), Environment("cuda", (7, 5)))
    assert err.code == "MF204" and "valid runners here: ['reference']" in str(err)
    block = MoEConfig(num_experts=8, hidden_size=96, intermediate_size=128, top_k=2, quant="fp8-block")
    err = check_scheme(block, sm90)
    assert err.code == "MF206" and "valid quant schemes here: ['none', 'fp8-tensor', 'fp8-channel']" in str(err)
    with pytest.raises(MoeflowError) as info:
        MoE(block.replace(runner="reference", device="cpu"))
    assert info.value.code == "MF206"


def test_planner_refuses_an_fp8_payload_the_expert_parallel_dispatchers_cannot_send():
    """dispatch_payload="fp8" with fp8-tensor (one activation scale for the whole batch): the expert-parallel
    dispatchers refuse it when built (MF506), and now the planner says so too, where plan() and the matrix had said
    ok; per-row schemes, and the local dispatcher, are unaffected."""
    from moeflow.planner import cell_status, check_scheme
    two = Environment("cpu", None, world_size=2)
    cfg = MoEConfig(num_experts=8, hidden_size=256, intermediate_size=128, top_k=2, quant="fp8-tensor",
                    runner="reference", dispatcher="alltoall", dispatch_payload="fp8")
    assert cell_status(cfg, two) == cell_status(cfg.replace(dispatcher="auto"), two) == "MF506"
    assert "valid payloads: ['auto', 'dtype']" in str(check_scheme(cfg, two))
    assert check_scheme(cfg.replace(quant="fp8-block"), two) is None
    assert check_scheme(cfg.replace(dispatch_payload="auto"), two) is None
    assert check_scheme(cfg.replace(dispatcher="local"), CPU) is None


def test_auto_with_nothing_valid_is_mf209():
    """A device no dispatcher declares: "auto" lists each candidate with the code that refused it."""
    with pytest.raises(MoeflowError) as info:
        plan(MoEConfig(**TEMPLATES["aligned"]), Environment("mps", None))
    assert info.value.code == "MF209" and "local (MF203)" in str(info.value)


@pytest.mark.parametrize("field", ("runner", "dispatcher"))
def test_unknown_backend_name_is_mf201(field):
    with pytest.raises(MoeflowError) as info:
        MoE(num_experts=4, hidden_size=64, intermediate_size=32, top_k=2, **{field: "no-such-backend"})
    assert info.value.code == "MF201" and isinstance(info.value, ValueError)
    registry = RUNNERS if field == "runner" else DISPATCHERS
    assert all(name in str(info.value) for name in registry.names())  # names the valid choices


# ---------------------------------------------------------------- the catalogue itself
@pytest.mark.parametrize("code", sorted(CATALOGUE))
def test_catalogue_entry(code):
    spec = CATALOGUE[code]
    assert re.fullmatch(r"MF\d{3}", code) and spec.code == code
    assert issubclass(spec.cls, MoeflowError) and issubclass(spec.cls, BUILTIN)
    for part in ("What:", "When:", "Fix:", "Example:"):
        assert part in spec.explanation, f"{code} explanation lacks {part!r}"
    text = explain(code)
    assert text.startswith(code) and spec.explanation in text and explain(code.lower()) == text
    # the message fills from its named fields into one line
    names = {f for _, f, _, _ in string.Formatter().parse(spec.message) if f}
    err = error(code, **{n: f"<{n}>" for n in names})
    assert isinstance(err, spec.cls) and err.code == code and "\n" not in str(err)
    assert all(f"<{n}>" in str(err) for n in names)


def test_explain_unknown_code_is_mf602():
    with pytest.raises(MoeflowError) as info:
        explain("MF999")
    assert info.value.code == "MF602" and isinstance(info.value, RuntimeError) and "MF101" in str(info.value)


def package_sources():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20
    return files


def test_every_raised_code_is_catalogued():
    literal = re.compile(r"""\berror\(\s*["'](MF\d{3})["']""")
    found = {}
    for path in package_sources():
        for code in literal.findall(path.read_text()):
            found.setdefault(code, path.relative_to(PACKAGE.parent))
    assert len(found) >= 20  # the pattern matches the package's style
    missing = {c: str(p) for c, p in found.items() if c not in CATALOGUE}
    assert not missing, f"codes raised but not catalogued: {missing}"


def test_no_not_implemented_and_no_bare_assert():
    offences = []
    for path in package_sources():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Assert):
                offences.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: assert")
            elif isinstance(node, ast.Name) and node.id == "NotImplementedError":
                offences.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: NotImplementedError")
    assert not offences, "\n".join(offences)
