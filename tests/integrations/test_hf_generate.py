"""`moeflow generate`: builds a random model (or loads a local checkpoint), generates with
transformers' implementations and moeflow, reports tokens/s and token agreement."""
import re

import pytest
import torch

pytest.importorskip("transformers")

from moeflow.cli import main  # noqa: E402
from moeflow.integrations.hf.tiny import tiny_model  # noqa: E402

FAST = ["--max-new-tokens", "4", "--repeats", "1", "--prompt", "hi"]


def rows(out: str) -> dict[str, str]:
    """implementation -> its table line."""
    return {m.group(1): m.group(0) for m in re.finditer(r"^(eager|grouped_mm|batched_mm|moeflow(?:-block)?) .*$", out, re.M)}


def test_random_model_all_implementations(capsys):
    assert main(["generate", "--size", "tiny", "--experts", "eager,batched_mm,moeflow,moeflow-block", *FAST]) == 0
    out = capsys.readouterr()
    table = rows(out.out)
    assert set(table) == {"eager", "batched_mm", "moeflow", "moeflow-block"}
    for name in ("batched_mm", "moeflow", "moeflow-block"):
        assert table[name].rstrip().endswith("yes"), table[name]  # same greedy tokens as eager
    assert "byte-level" in out.err and "nothing is downloaded" in out.err


def test_local_checkpoint(tmp_path, capsys):
    tiny_model("olmoe", dtype=torch.float32).save_pretrained(tmp_path)
    assert main(["generate", "--model", str(tmp_path), *FAST]) == 0  # default: both = eager, moeflow
    table = rows(capsys.readouterr().out)
    assert set(table) == {"eager", "moeflow"} and table["moeflow"].rstrip().endswith("yes")


def test_bad_model_and_bad_experts(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), *FAST]) == 2
    assert "MF706" in capsys.readouterr().err
    assert main(["generate", "--experts", "fastest", *FAST]) == 2
    assert "MF102" in capsys.readouterr().err
