"""The command line: matrix, check, explain, env, bench (small, on the CPU), generate's and tune's argument checks, and
the commands the documents name."""
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from moeflow.cli import main
from moeflow.errors import CATALOGUE


def test_explain_every_code(capsys):
    for code, spec in CATALOGUE.items():
        assert main(["explain", code]) == 0
        out = capsys.readouterr().out
        assert code in out and spec.explanation in out


def test_explain_lists_codes_and_refuses_unknown(capsys):
    assert main(["explain"]) == 0
    listing = capsys.readouterr().out
    assert all(code in listing for code in CATALOGUE)
    assert main(["explain", "MF999"]) == 2
    assert "MF602" in capsys.readouterr().err


def test_a_reader_that_leaves_early_is_no_error():
    """`moeflow explain | head -1`: the listing outlives its reader; the command stops without a traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "moeflow", "explain"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    proc.stdout.readline()
    proc.stdout.close()  # the reader leaves after one line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 141) and "Traceback" not in err and "BrokenPipe" not in err, err


def test_check_prints_plan_or_code(capsys):
    assert main(["check", "--quant", "fp8-block", "--device", "cpu"]) == 0
    assert "runner:      reference" in capsys.readouterr().out
    assert main(["check", "--quant", "fp8-block", "--runner", "grouped_mm", "--device", "cpu"]) == 2
    assert "MF202" in capsys.readouterr().err
    assert main(["check", "--preset", "nope"]) == 2
    assert "MF601" in capsys.readouterr().err
    assert main(["check", "--device", "cpu", "--batch-invariant"]) == 0
    assert "batch-invariant: router 'torch'" in capsys.readouterr().out
    assert main(["check", "--device", "cpu", "--batch-invariant", "--quant", "fp8-tensor"]) == 2
    assert "MF212" in capsys.readouterr().err


def test_matrix_hypothetical_gpu(capsys):
    assert main(["matrix", "--device", "cuda", "--cc", "8.0"]) == 0
    out = capsys.readouterr().out
    assert "MF204" in out  # grouped_mm needs sm_90


def test_env_lists_variables(capsys):
    assert main(["env"]) == 0
    assert "MOEFLOW_VALIDATE_INPUTS" in capsys.readouterr().out


@pytest.mark.parametrize("quant", ["none", "fp8-block"])
def test_bench_small_runs_and_checks(tmp_path, capsys, quant):
    out = tmp_path / "rows.json"
    assert main(["bench", "--quant", quant, "--tokens", "3,17", "--device", "cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    ran = [r for r in rows if r["status"] == "ok"]
    assert {r["T"] for r in ran} == {3, 17}
    for r in ran:
        assert r["us"] > 0 and r["timing"] == "eager"  # the CPU: host timing (CUDA: graph replay)
        assert r["rel_err"] is None or r["rel_err"] < 2e-2  # bf16 vs the reference runner
        # GB/s: the fewest bytes the layer moves (moeflow.benchmark.layer_bytes) over its time, counting the experts
        # the row's routing touched (docs/performance.md), here at most E = 8 and at least one
        assert 1 <= r["experts_hit"] <= min(8, 2 * r["T"])
        assert r["gbs"] == pytest.approx(r["tflops"] * 1e3 * _bytes_per_flop(quant, r["T"], r["experts_hit"]), rel=1e-9)
        assert "pct_roofline" not in r and "floor_us" not in r  # no ceilings on the CPU
    refused = [r for r in rows if r["status"] != "ok"]
    assert all(r["status"] in CATALOGUE for r in refused)


def test_bench_marks_rows_off_the_reference(tmp_path, capsys, monkeypatch):
    """A runner whose output is off the reference runner's by more than WRONG_REL_ERR: its rows say "wrong", the
    table marks them, and the command exits 1 naming the runner; within it, "ok" (NaN is wrong)."""
    from moeflow.cli import bench
    assert bench.accuracy_status(3e-2) == "ok" and bench.accuracy_status(bench.WRONG_REL_ERR) == "ok"
    assert bench.accuracy_status(0.2) == "wrong" and bench.accuracy_status(float("nan")) == "wrong"
    measure = bench._measure

    def off(layer, x, logits, want, ceilings):  # the CPU runs only the reference runner: its rows stand for a faulty one's
        return dict(measure(layer, x, logits, want, ceilings), runner="triton", rel_err=1 / 3,
                    status=bench.accuracy_status(1 / 3))

    monkeypatch.setattr(bench, "_measure", off)
    out = tmp_path / "rows.json"
    assert main(["bench", "--quant", "none", "--tokens", "3", "--device", "cpu", "--json", str(out)]) == 1
    captured = capsys.readouterr()
    assert "WRONG: error over 0.1" in captured.out and "off the reference runner" in captured.err
    assert "triton none" in captured.err
    assert {r["status"] for r in json.loads(out.read_text()) if r["T"] == 3} == {"wrong"}


def test_bench_holds_two_layers_at_a_time(tmp_path, capsys, monkeypatch):
    """Each layer is built with at most one other alive (the scheme's reference beside the layer under test), as
    _check_memory's two copies of the experts assume: the last runner's and the last scheme's layers are freed
    first."""
    import gc
    import weakref

    from moeflow import MoE
    from moeflow.cli import bench
    live, others = weakref.WeakSet(), []

    class Counted(MoE):
        def __init__(self, *args, **kwargs):
            gc.collect()
            others.append(len(live))
            super().__init__(*args, **kwargs)
            live.add(self)
    monkeypatch.setattr(bench, "MoE", Counted)
    out = tmp_path / "rows.json"
    args = ["bench", "--quant", "none,fp8-tensor", "--runners", "auto", "--tokens", "3", "--device", "cpu"]
    assert main([*args, "--json", str(out)]) == 0
    assert others == [0, 1, 0, 1], others  # per scheme: its reference, then the auto runner's layer


def test_bench_refuses_a_preset_that_does_not_fit(capsys, monkeypatch):
    # deepseek-v3 keeps 2 x 22.5 GB of bf16 experts: refused up front (MF605), not killed mid-run
    monkeypatch.setattr("os.sysconf", lambda name: {"SC_AVPHYS_PAGES": 1 << 20, "SC_PAGE_SIZE": 4096}[name])
    assert main(["bench", "--preset", "deepseek-v3", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "MF605" in err and "45.1 GB" in err


def test_bench_row_counts_the_experts_routed_and_uses_the_ceilings_given():
    """A row's GB/s and floor count the experts its routing touched, not random routing's expectation, and
    its % of roofline divides by the ceilings handed in (on CUDA, measured at the start of the run)."""
    from moeflow import MoE
    from moeflow.benchmark import Ceilings, layer_bytes, roofline_seconds
    from moeflow.cli import bench
    from moeflow.presets import preset_config
    torch.manual_seed(0)
    layer = MoE(preset_config("small", device="cpu"))  # E = 8, K = 2
    x = torch.randn(64, layer.config.hidden_size, dtype=layer.config.dtype)
    logits = torch.full((64, 8), -5.0)
    logits[:, 3], logits[:, 6] = 2.0, 1.0  # every token to experts 3 and 6
    with torch.no_grad():
        want = layer(x, logits)
    ceil = Ceilings(bf16_flops=1e12, fp8_flops=2e12, bandwidth=1e9)
    row = bench._measure(layer, x, logits, want, ceil)
    assert row["experts_hit"] == 2
    assert row["gbs"] == pytest.approx(layer_bytes(layer.config, 64, 2) / (row["us"] * 1e-6) / 1e9)
    assert row["floor_us"] == pytest.approx(roofline_seconds(layer.config, 64, ceil, 2) * 1e6)
    assert row["pct_roofline"] == pytest.approx(100 * row["floor_us"] / row["us"])
    assert "pct_roofline" not in bench._measure(layer, x, logits, want)  # no ceilings: no roofline
    nan_fp8 = Ceilings(bf16_flops=1e12, fp8_flops=float("nan"), bandwidth=1e9)
    fp8 = MoE(preset_config("small", quant="fp8-block", device="cpu"))
    with torch.no_grad():
        assert "pct_roofline" not in bench._measure(fp8, x, logits, fp8(x, logits), nan_fp8)  # no fp8 peak here


def _bytes_per_flop(quant, tokens, hit):
    """The small preset's layer_bytes / layer_flops at T = tokens (bf16 layer), ``hit`` experts touched."""
    from moeflow.benchmark import layer_bytes, layer_flops
    from moeflow.presets import preset_config
    cfg = preset_config("small", quant=quant)
    return layer_bytes(cfg, tokens, hit) / layer_flops(cfg, tokens)


def test_bench_png_plots_every_scheme(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    assert main(["bench", "--quant", "none,fp8-block", "--tokens", "1,5", "--device", "cpu", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_gives_each_runner_one_colour_in_every_panel(tmp_path):
    """A runner missing from one panel must not shift the others' colours (moeflow bench's PNG, one panel a scheme)."""
    plt = pytest.importorskip("matplotlib.pyplot")
    from moeflow.benchmark import plot_panels
    made = []

    class Recording:  # pyplot, remembering the axes plot_panels draws on
        def subplots(self, *a, **kw):
            fig, axes = plt.subplots(*a, **kw)
            made.append(axes[0])
            return fig, axes

        def __getattr__(self, name):
            return getattr(plt, name)

    panels = [("fp8-block", {"reference": [(1, 9.0), (5, 20.0)], "triton": [(1, 1.0), (5, 2.0)]}, []),
              ("none", {"grouped_mm": [(1, 3.0), (5, 4.0)], "reference": [(1, 8.0), (5, 9.0)],
                        "triton": [(1, 1.0), (5, 3.0)]}, [(1, 0.5), (5, 1.0)])]
    plot_panels(Recording(), panels, str(tmp_path / "p.png"))
    colours = [{ln.get_label(): ln.get_color() for ln in ax.get_lines()} for ax in made[0]]
    assert colours[0]["triton"] == colours[1]["triton"] and colours[0]["reference"] == colours[1]["reference"]
    assert len({colours[1][n] for n in ("grouped_mm", "reference", "triton")}) == 3


def test_bench_png_without_matplotlib_is_refused_up_front(tmp_path, capsys, monkeypatch):
    import builtins
    real = builtins.__import__

    def no_matplotlib(name, *a, **kw):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert main(["bench", "--tokens", "1", "--device", "cpu", "--png", str(tmp_path / "x.png")]) == 2
    captured = capsys.readouterr()
    assert "MF606" in captured.err and "moeflow bench:" not in captured.out  # nothing was benchmarked
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("argv,text", [
    (["bench", "--tokens", "-3"], "below 0"),
    (["bench", "--tokens", "1,abc"], "'abc' is not an integer"),
    (["bench", "--tokens", ","], "no value"),
    (["bench", "--hidden", "0"], "below 1"),
    (["tune", "--tokens", "0"], "below 1"),
    (["matrix", "--device", "cuda", "--cc", "nine"], "compute capability"),
    (["matrix", "--world-size", "0"], "below 1"),
    (["generate", "--max-new-tokens", "0"], "below 1"),
    (["bench", "--json", "/proc/no-such-dir/rows.json"], "cannot write"),
])
def test_bad_arguments_are_usage_errors_before_anything_runs(argv, text, capsys):
    """argparse's usage error (exit 2) naming the value, not a traceback after a benchmark ran."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert text in err and "Traceback" not in err, err


def test_bench_makes_the_output_directory(tmp_path):
    out = tmp_path / "new" / "dir" / "rows.json"
    assert main(["bench", "--quant", "none", "--tokens", "2", "--device", "cpu", "--json", str(out)]) == 0
    assert json.loads(out.read_text())


# ---------------------------------------------------------------- the CLI audit's fixes

@pytest.mark.parametrize("device,why", [
    pytest.param("cuda", "CUDA is not available", marks=pytest.mark.skipif(torch.cuda.is_available(),
                                                                            reason="this machine has CUDA")),
    ("gpu", "Expected one of"),
    ("meta", "holds data"),
])
def test_generate_refuses_a_device_up_front(device, why, capsys):
    """A device generate cannot run on: MF106 as check and bench give (was a traceback: torch's AssertionError for
    cuda, a RuntimeError for gpu, .item() on meta), before any model is built."""
    assert main(["generate", "--device", device, "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "MF106" in err and why in err and "Traceback" not in err


def _matrix(argv, capsys) -> str:
    assert main(["matrix", *argv]) == 0
    return capsys.readouterr().out


def test_matrix_reads_the_device_as_check_does(capsys):
    """cuda:N is cuda (its --cc honoured), cpu:0 is cpu: not MF203 in every cell; a string torch does not parse
    (CPU, gpu) is MF106 (it was MF203 in every cell, exit 0)."""
    cuda = _matrix(["--device", "cuda", "--cc", "8.0"], capsys)
    assert "MF204" in cuda and "✓" in cuda
    assert _matrix(["--device", "cuda:0", "--cc", "8.0"], capsys) == cuda
    assert _matrix(["--device", "cpu:0"], capsys) == _matrix(["--device", "cpu"], capsys)
    for bad in ("CPU", "gpu"):
        assert main(["matrix", "--device", bad]) == 2
        assert "MF106" in capsys.readouterr().err


def test_bench_refuses_an_output_it_cannot_write_before_running(tmp_path, capsys, monkeypatch):
    """A directory given for a file, or a plot format matplotlib has no writer for: argparse's usage error before
    the benchmark runs (it was IsADirectoryError / matplotlib's ValueError after the whole run)."""
    from moeflow.cli import bench
    monkeypatch.setattr(bench, "_measure", lambda *a: pytest.fail("the benchmark ran"))
    cases = [(["--json", str(tmp_path)], "names a directory"), (["--csv", f"{tmp_path}/"], "names a directory")]
    if importlib.util.find_spec("matplotlib"):
        cases.append((["--png", str(tmp_path / "plot.foo")], "matplotlib writes no 'foo' files"))
    for argv, text in cases:
        with pytest.raises(SystemExit) as info:
            main(["bench", "--quant", "none", "--tokens", "1", "--device", "cpu", *argv])
        err = capsys.readouterr().err
        assert info.value.code == 2 and text in err and "Traceback" not in err, err


def test_bench_makes_no_directory_when_it_does_not_run(tmp_path, capsys):
    """The output's directories are made when the file is written, not while the arguments are parsed."""
    out = tmp_path / "new" / "rows.json"
    assert main(["bench", "--quant", "bogus", "--device", "cpu", "--json", str(out)]) == 2
    assert "MF102" in capsys.readouterr().err and not (tmp_path / "new").exists()


def test_bench_runner_names_the_runner_benchmarked(tmp_path, capsys):
    """--runner is --runners (it was accepted and ignored: every runner ran)."""
    out = tmp_path / "rows.json"
    assert main(["bench", "--quant", "none", "--tokens", "2", "--device", "cpu", "--runner", "grouped_mm",
                 "--json", str(out)]) == 0
    assert {r["runner"] for r in json.loads(out.read_text())} == {"reference", "grouped_mm"}


@pytest.mark.parametrize("argv,code", [
    (["--quant", "bogus"], "MF102"),
    (["--quant", "none,fp8-bogus"], "MF102"),
    (["--runners", "bogus"], "MF201"),
    (["--runners", "grouped_mm,bogus"], "MF201"),
    (["--dispatcher", "bogus"], "MF201"),
])
def test_bench_refuses_unknown_names_up_front(argv, code, capsys):
    """A scheme, runner or dispatcher that does not exist: its coded error, exit 2, nothing benchmarked (it printed
    a table of refused rows and exited 0)."""
    assert main(["bench", "--tokens", "1", "--device", "cpu", *argv]) == 2
    captured = capsys.readouterr()
    assert code in captured.err and "moeflow bench:" not in captured.out


@pytest.mark.parametrize("argv,rc", [
    (["--quant", "none", "--dispatcher", "alltoall"], 2),  # every row refused (MF208), the reference's too
    (["--quant", "fp8-block", "--runners", "grouped_mm"], 2),  # the one runner asked for refused (MF202)
    (["--quant", "none,fp8-block", "--runners", "grouped_mm"], 0),  # refused for one scheme, ran for the other
])
def test_bench_exits_2_when_nothing_asked_for_ran(argv, rc, capsys):
    """The table is printed, then exit 2 with one line where no row of the runners asked for was benchmarked."""
    assert main(["bench", "--tokens", "1", "--device", "cpu", *argv]) == rc
    captured = capsys.readouterr()
    assert "refused with MF2" in captured.out
    assert ("nothing benchmarked" in captured.err) == (rc == 2)


def test_tune_help_names_the_schemes_no_fused_skips():
    """--no-fused's help names every scheme the one-launch layer is searched for (the triton runner's fused_layer;
    it named none and fp8-block only)."""
    import argparse

    from moeflow.cli import build_parser
    from moeflow.experts import RUNNERS
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    help_ = next(a.help for a in sub.choices["tune"]._actions if "--no-fused" in a.option_strings)
    assert all(scheme in help_ for scheme in RUNNERS.get("triton").caps.fused_layer), help_


ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("doc", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/*.md"))])
def test_docs_name_only_commands_that_exist(doc):
    """Every `moeflow WORD` a document names is a subcommand (docs/architecture.md named `moeflow plan`)."""
    from moeflow.cli import COMMANDS
    text = (ROOT / doc).read_text()
    named = set(re.findall(r"`(?:python -m )?moeflow ([a-z][a-z_-]*)", text))
    assert named <= set(COMMANDS), named - set(COMMANDS)
