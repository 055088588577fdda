"""The command line: matrix, check, explain, env, bench (small, on the CPU)."""
import json

import pytest

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


def test_check_prints_plan_or_code(capsys):
    assert main(["check", "--quant", "fp8-block", "--device", "cpu"]) == 0
    assert "runner:      reference" in capsys.readouterr().out
    assert main(["check", "--quant", "fp8-block", "--runner", "grouped_mm", "--device", "cpu"]) == 2
    assert "MF202" in capsys.readouterr().err
    assert main(["check", "--preset", "nope"]) == 2
    assert "MF601" in capsys.readouterr().err


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
        # GB/s: the fewest bytes the layer moves (moeflow.benchmark.layer_bytes) over its time
        assert r["gbs"] == pytest.approx(r["tflops"] * 1e3 * _bytes_per_flop(quant, r["T"]), rel=1e-9)
    refused = [r for r in rows if r["status"] != "ok"]
    assert all(r["status"] in CATALOGUE for r in refused)


def test_bench_marks_rows_off_the_reference(tmp_path, capsys, monkeypatch):
    """A runner whose output is off the reference runner's by more than WRONG_REL_ERR: its rows say "wrong", the
    table marks them, and the command exits 1 naming the runner; within it, "ok" (NaN is wrong)."""
    from moeflow.cli import bench
    assert bench.accuracy_status(3e-2) == "ok" and bench.accuracy_status(bench.WRONG_REL_ERR) == "ok"
    assert bench.accuracy_status(0.2) == "wrong" and bench.accuracy_status(float("nan")) == "wrong"
    measure = bench._measure

    def off(layer, x, logits, want):  # the CPU runs only the reference runner: its rows stand for a faulty runner's
        return dict(measure(layer, x, logits, want), runner="triton", rel_err=1 / 3, status=bench.accuracy_status(1 / 3))

    monkeypatch.setattr(bench, "_measure", off)
    out = tmp_path / "rows.json"
    assert main(["bench", "--quant", "none", "--tokens", "3", "--device", "cpu", "--json", str(out)]) == 1
    captured = capsys.readouterr()
    assert "WRONG: error over 0.1" in captured.out and "off the reference runner" in captured.err
    assert "triton none" in captured.err
    assert {r["status"] for r in json.loads(out.read_text()) if r["T"] == 3} == {"wrong"}


def test_bench_refuses_a_preset_that_does_not_fit(capsys, monkeypatch):
    # deepseek-v3 keeps 2 x 22.5 GB of bf16 experts: refused up front (MF605), not killed mid-run
    monkeypatch.setattr("os.sysconf", lambda name: {"SC_AVPHYS_PAGES": 1 << 20, "SC_PAGE_SIZE": 4096}[name])
    assert main(["bench", "--preset", "deepseek-v3", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "MF605" in err and "45.1 GB" in err


def _bytes_per_flop(quant, tokens):
    """The small preset's layer_bytes / layer_flops at T = tokens (bf16 layer)."""
    from moeflow.benchmark import layer_bytes, layer_flops
    from moeflow.presets import preset_config
    cfg = preset_config("small", quant=quant)
    return layer_bytes(cfg, tokens) / layer_flops(cfg, tokens)


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
