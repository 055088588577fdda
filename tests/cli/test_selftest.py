"""`moeflow selftest` on the CPU: the table of every cell (run, refused or the comparand) and exit 0; a cell off the
reference runner, one whose output holds NaN and one that raises are failures (exit 1) while the other cells still
run; the JSON; the header's word on the device (Plan.unvalidated); unknown names refused up front."""
import json

import pytest
import torch

from moeflow import selftest
from moeflow.cli import main
from moeflow.dispatch import DISPATCHERS
from moeflow.errors import CATALOGUE
from moeflow.experts import RUNNERS
from moeflow.experts.grouped_mm import GroupedMMRunner
from moeflow.quant import SCHEMES
from moeflow.tolerances import REL_TOL

LOCAL = [d for d in DISPATCHERS.names() if not DISPATCHERS.get(d).caps.distributed]


def _table(out: str) -> dict[tuple, list[str]]:
    """The table's rows by (quant, runner, dispatcher, dtype) -> the remaining columns."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["quant", "runner"])
    rows = {}
    for line in lines[start + 1:]:
        if line.startswith("moeflow selftest:"):
            break
        if not line.startswith(" "):  # an indented line: a failure's detail
            cols = line.split()
            rows[tuple(cols[:4])] = cols[4:]
    return rows


def test_every_cell_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "selftest.json"
    assert main(["selftest", "--device", "cpu", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].startswith("moeflow selftest: cpu, ") and "world size 1" in lines[0]
    assert lines[1] == "planner: cpu: torch code, no GPU kernels to validate"
    assert lines[2] == "runners: runs reference, grouped_mm (some cells refused: MF202); refuses triton (MF203)"
    table = _table(text)
    # every scheme x runner x single-process dispatcher x dtype: one row each
    dtypes = ("bfloat16", "float16", "float32")
    assert set(table) == {(s, r, d, t) for s in SCHEMES.names() for r in RUNNERS.names() for d in LOCAL for t in dtypes}
    for (scheme, runner, _, dtype), cols in table.items():
        if runner == "triton" or (runner == "grouped_mm" and scheme != "none"):  # the planner's refusals here
            assert cols[-2:] == ["refused", "(MF203)" if runner == "triton" else "(MF202)"], cols
        elif runner == "reference":
            assert cols == ["1,37,16*", "—", "—", "comparand"]
        else:  # grouped_mm, none: run against the reference runner
            tokens, err, tol, status = cols
            assert tokens == "1,37,16*" and status == "pass"
            assert float(err) <= float(tol) == REL_TOL[(scheme, getattr(torch, dtype))]
    assert lines[-1].startswith("moeflow selftest: PASS: 3 passed, 0 failed, 12 reference (the comparand), "
                                "21 refused on ")

    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["capability"] is None and doc["name"]
    assert doc["moeflow"] and "commit" in doc and doc["date"][:2] == "20" and doc["passed"] is True
    assert doc["unvalidated"] == "" and doc["validation"].startswith("cpu: ")
    assert doc["shape"] == selftest.SHAPE and [b["tokens"] for b in doc["batches"]] == [1, 37, 16]
    assert doc["batches"][-1]["idle_expert"] == selftest.IDLE_EXPERT
    assert len(doc["cells"]) == len(table)
    ran = [c for c in doc["cells"] if c["status"] == "pass"]
    assert {(c["scheme"], c["runner"], c["dtype"]) for c in ran} == {("none", "grouped_mm", t) for t in dtypes}
    for c in ran:
        assert len(c["errors"]) == 3 and c["rel_err"] == max(c["errors"]) <= c["tol"] and c["seconds"] > 0
    refused = [c for c in doc["cells"] if c["status"] == "refused"]
    assert len(refused) == 21 and all(c["code"] in CATALOGUE and c["errors"] == [] for c in refused)


@pytest.mark.parametrize("fault", ["off", "nan", "raises"])
def test_a_faulty_runner_fails_its_cells_and_exits_1(fault, tmp_path, capsys, monkeypatch):
    """grouped_mm made wrong (its outputs scaled by 1.05), NaN or raising: its cells FAIL with the batch or the error
    named, the summary says FAIL and the command exits 1; the other cells still run and pass."""
    run = GroupedMMRunner.run

    def faulty(self, batch, weights):
        y = run(self, batch, weights)
        if fault == "raises":
            raise RuntimeError("a kernel fault")
        return y * 1.05 if fault == "off" else torch.full_like(y, float("nan"))

    monkeypatch.setattr(GroupedMMRunner, "run", faulty)
    out = tmp_path / "selftest.json"
    argv = ["selftest", "--device", "cpu", "--schemes", "none,fp8-block", "--dtypes", "float32,bf16"]
    assert main([*argv, "--json", str(out)]) == 1
    captured = capsys.readouterr()
    table = _table(captured.out)
    for dtype in ("float32", "bfloat16"):
        assert table[("none", "grouped_mm", "local", dtype)][-1] == "FAIL"
        assert table[("fp8-block", "reference", "local", dtype)][-1] == "comparand"
    detail = {"off": "worst at ", "nan": "worst at ", "raises": "RuntimeError: a kernel fault"}[fault]
    assert f"    {detail}" in captured.out
    assert "moeflow selftest: FAIL: 0 passed, 2 failed" in captured.out.splitlines()[-1]
    assert "2 cell(s) failed" in captured.err
    doc = json.loads(out.read_text())
    failed = [c for c in doc["cells"] if c["status"] == "FAIL"]
    assert doc["passed"] is False and {c["dtype"] for c in failed} == {"float32", "bfloat16"}
    if fault == "off":
        assert all(0.04 < c["rel_err"] < 0.06 for c in failed)
    elif fault == "nan":
        assert all(c["rel_err"] == "nan" for c in failed)  # JSON has no NaN: said as a string
    else:
        assert all(c["rel_err"] is None and c["errors"] == [] for c in failed)


def test_a_tolerance_of_zero_fails_the_cell(capsys, monkeypatch):
    monkeypatch.setattr(selftest, "rel_tol", lambda scheme, dtype: 0.0)
    assert main(["selftest", "--device", "cpu", "--schemes", "none", "--dtypes", "bf16", "--tokens", "5"]) == 1
    table = _table(capsys.readouterr().out)
    assert table[("none", "grouped_mm", "local", "bfloat16")][0] == "5,16*"
    assert table[("none", "grouped_mm", "local", "bfloat16")][-1] == "FAIL"


def test_the_comparand_runs_when_the_reference_runner_is_left_out(capsys):
    assert main(["selftest", "--device", "cpu", "--schemes", "none", "--runners", "grouped_mm", "--dtypes",
                 "fp16"]) == 0
    table = _table(capsys.readouterr().out)
    assert list(table) == [("none", "grouped_mm", "local", "float16")]
    assert table[("none", "grouped_mm", "local", "float16")][-1] == "pass"


def test_the_header_says_whether_the_planner_validated_the_device(capsys, monkeypatch):
    """The header's planner line: on the CPU, torch code; where the plan says its GPU is unvalidated
    (Plan.unvalidated), that text, marked; then the runners the planner builds and refuses."""
    import dataclasses
    argv = ["selftest", "--device", "cpu", "--schemes", "none", "--runners", "grouped_mm", "--dtypes", "fp32"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "planner: cpu: torch code, no GPU kernels to validate" and lines[2] == "runners: runs grouped_mm"
    real = selftest.plan
    why = "sm_120 (Blackwell): moeflow's kernels are compiled for it but not run on one"
    monkeypatch.setattr(selftest, "plan", lambda cfg, env: dataclasses.replace(real(cfg, env), unvalidated=why))
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == f"planner: NOT VALIDATED: {why}"


@pytest.mark.parametrize("runners", ["triton", "reference"])
def test_nothing_checked_is_exit_2(runners, capsys):
    """Every cell asked for refused (triton on a CPU), or only the comparand's: no check was made, which is no pass."""
    assert main(["selftest", "--device", "cpu", "--schemes", "none", "--runners", runners, "--dtypes", "fp32"]) == 2
    captured = capsys.readouterr()
    assert "moeflow selftest: NOTHING CHECKED: 0 passed, 0 failed" in captured.out and "nothing checked" in captured.err


@pytest.mark.parametrize("argv,code", [(["--schemes", "fp8-bogus"], "MF102"), (["--runners", "bogus"], "MF201"),
                                       (["--device", "gpu"], "MF106")])
def test_unknown_names_are_refused_before_anything_runs(argv, code, capsys, monkeypatch):
    monkeypatch.setattr(selftest, "run_cell", lambda *a: pytest.fail("a cell ran"))
    assert main(["selftest", *argv]) == 2
    assert code in capsys.readouterr().err


def test_a_bad_dtype_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["selftest", "--dtypes", "float64"])
    assert info.value.code == 2 and "MF104" in capsys.readouterr().err
