"""`moeflow bench` on a GPU: every valid runner against the reference, the rows timed as CUDA graphs (the
layer as one CUDA graph, L2 flushed) where the layer can be captured, with GB/s and % of roofline, and its plot.
Run: pytest -m gpu tests/gpu/test_gpu_cli.py"""
import json

import pytest
import torch

from moeflow.cli import main

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_bench_on_gpu_graph_timed_with_roofline_and_plot(tmp_path):
    out, png = tmp_path / "rows.json", tmp_path / "bench.png"
    args = ["bench", "--quant", "none,fp8-block", "--tokens", "1,16", "--device", "cuda", "--json", str(out)]
    if __import__("importlib").util.find_spec("matplotlib"):
        args += ["--png", str(png)]
    assert main(args) == 0
    rows = [r for r in json.loads(out.read_text()) if r["status"] == "ok"]
    triton = [r for r in rows if r["runner"] == "triton"]
    assert {(r["quant"], r["T"]) for r in triton} == {(q, t) for q in ("none", "fp8-block") for t in (1, 16)}
    assert all(r["timing"] == "graph" for r in triton)  # capturable: timed as CUDA graphs
    for r in rows:
        assert r["us"] > 0 and r["gbs"] > 0 and 0 < r["pct_roofline"]
        assert r["rel_err"] is None or r["rel_err"] < 3e-2
    if "--png" in args:
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_check_says_where_the_triton_tiles_come_from(capsys):
    """`moeflow check` on the GPU: a preset with a shipped table names its file on an H200 (or the borrowed H200
    file on another sm_90 GPU) and, per token count, the kernel each GEMM runs (kernels/gemm/choice.py) with its
    tile; a shape no table covers names the Hopper rules."""
    assert main(["check", "--preset", "qwen3-30b-a3b", "--quant", "fp8-block", "--device", "cuda"]) == 0
    out = capsys.readouterr().out.splitlines()
    line = next(x for x in out if x.startswith("kernel configs: "))
    assert "E=128,N=768,K=2048,device=NVIDIA_H200,scheme=fp8-block.json" in line
    kernels = [x.strip() for x in out if x.strip().startswith("T=")]
    assert [k.split(":")[0] for k in kernels] == [f"T={t}" for t in (1, 16, 128, 1024, 4096, 16384)]
    assert all("gate_up " in k and "; down " in k or "one launch" in k for k in kernels), kernels
    assert "gluon" in kernels[-1], kernels  # the table's large-T tiles run the Gluon kernels on Hopper
    assert main(["check", "--experts", "16", "--hidden", "1536", "--inter", "1408", "--topk", "4", "--device",
                 "cuda", "--tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert "the Hopper rules (kernels/gemm/sm90_tiles.py)" in out and "T=64: " in out