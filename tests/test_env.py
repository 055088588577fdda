"""moeflow.env: variables read at call time, and held for one layer call inside env.one_reading()."""
import threading

import pytest
import torch

from moeflow import MoE, MoEConfig, MoeflowError
from moeflow import env as moeflow_env


def test_read_at_call_time_outside_a_block(monkeypatch):
    monkeypatch.setenv("MOEFLOW_TRITON_PDL", "0")
    assert not moeflow_env.TRITON_PDL.get_bool()
    monkeypatch.setenv("MOEFLOW_TRITON_PDL", "1")
    assert moeflow_env.TRITON_PDL.get_bool()
    monkeypatch.delenv("MOEFLOW_TRITON_PDL")
    assert moeflow_env.TRITON_PDL.get() == moeflow_env.TRITON_PDL.default


def test_one_reading_holds_the_first_value_until_the_outermost_block_ends(monkeypatch):
    monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", "7")
    with moeflow_env.one_reading():
        assert moeflow_env.EAGER_GRAPHS.get() == "7"
        monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", "9")
        assert moeflow_env.EAGER_GRAPHS.get() == "7"  # held
        with moeflow_env.one_reading():  # reentrant: the inner block neither re-reads nor releases
            assert moeflow_env.EAGER_GRAPHS.get() == "7"
            monkeypatch.setenv("MOEFLOW_TRITON_TMA", "0")
            assert not moeflow_env.TRITON_TMA.get_bool()  # first read inside the block: the current value
        assert moeflow_env.EAGER_GRAPHS.get() == "7"
    assert moeflow_env.EAGER_GRAPHS.get() == "9"  # released


def test_one_reading_releases_on_an_exception(monkeypatch):
    monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", "3")
    with pytest.raises(RuntimeError):
        with moeflow_env.one_reading():
            assert moeflow_env.EAGER_GRAPHS.get() == "3"
            raise RuntimeError("boom")
    monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", "5")
    assert moeflow_env.EAGER_GRAPHS.get() == "5"


def test_one_reading_is_per_thread(monkeypatch):
    monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", "3")
    seen = []
    with moeflow_env.one_reading():
        assert moeflow_env.EAGER_GRAPHS.get() == "3"
        monkeypatch.setenv("MOEFLOW_EAGER_GRAPHS", "4")
        worker = threading.Thread(target=lambda: seen.append(moeflow_env.EAGER_GRAPHS.get()))
        worker.start()
        worker.join()
    assert seen == ["4"]  # another thread outside any block reads os.environ


def _held() -> bool:
    return getattr(moeflow_env._HELD, "values", None) is not None


def test_a_layer_call_runs_inside_one_reading_and_the_next_call_reads_again(monkeypatch):
    """MoE.forward, MoE.forward_topk and ExpertsPath run their whole path inside one block (the runner sees held
    values), and a variable changed between two calls takes effect at the second."""
    from moeflow.experts import ExpertWeights
    from moeflow.integrations.path import ExpertsPath
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=16, dtype=torch.float32)
    moe = MoE(cfg)
    path = ExpertsPath(cfg)
    seen = []
    for runner in (moe.runner, path.runner):
        run = runner.run
        monkeypatch.setattr(runner, "run", lambda *a, _run=run: seen.append(_held()) or _run(*a))
    x, ids, w = torch.randn(3, 8), torch.tensor([[0, 1], [1, 2], [3, 0]]), torch.full((3, 2), 0.5)
    moe(x, torch.randn(3, 4))
    moe.forward_topk(x, ids, w)
    path(x, ids, w, ExpertWeights(moe.gate_up_proj, moe.down_proj))
    assert seen == [True, True, True] and not _held()
    bad = torch.tensor([[0, 9], [1, 2], [3, 0]])
    monkeypatch.setenv("MOEFLOW_VALIDATE_INPUTS", "1")
    with pytest.raises(MoeflowError, match="MF304"):
        moe.forward_topk(x, bad, w)
    monkeypatch.setenv("MOEFLOW_VALIDATE_INPUTS", "0")
    monkeypatch.setattr("moeflow.layer._check_ids", lambda *a: pytest.fail("MOEFLOW_VALIDATE_INPUTS=0 was not seen"))
    moe.forward_topk(x, ids, w)


@pytest.mark.parametrize("raw,want", [("1", True), ("TRUE", True), (" yes ", True), ("on", True), ("0", False),
                                      ("false", False), ("No", False), ("off", False), ("", False)])
def test_switches_read_the_usual_spellings(monkeypatch, raw, want):
    monkeypatch.setenv("MOEFLOW_TRITON_PDL", raw)
    assert moeflow_env.TRITON_PDL.get_bool() is want


@pytest.mark.parametrize("raw", ["2", "enable", "y e s", "-1"])
def test_a_switch_of_moeflow_with_another_value_is_mf107(monkeypatch, raw):
    """A typo in a switch is reported (MF107 naming the variable and the value), not read silently as off."""
    monkeypatch.setenv("MOEFLOW_TRITON_TMA", raw)
    with pytest.raises(MoeflowError, match="MOEFLOW_TRITON_TMA") as info:
        moeflow_env.TRITON_TMA.get_bool()
    assert info.value.code == "MF107" and repr(raw) in str(info.value)


def test_another_programs_switch_is_read_as_it_reads_it(monkeypatch):
    """TRITON_INTERPRET is Triton's: a value moeflow does not know is off, as Triton takes it, never an error."""
    monkeypatch.setenv("TRITON_INTERPRET", "2")
    assert moeflow_env.TRITON_INTERPRET.get_bool() is False


@pytest.mark.parametrize("value,why", [("5 minutes", "expected a number"), ("0", "> 0"), ("-5", "> 0"),
                                       ("nan", "> 0"), ("inf", "> 0")])
def test_a_timeout_that_is_not_a_positive_number_is_mf107(monkeypatch, value, why):
    """Not a number, or one no timeout can be (0, negative, nan, inf: torch's own errors later, or no timeout)."""
    monkeypatch.setenv("MOEFLOW_DIST_TIMEOUT_S", value)
    with pytest.raises(MoeflowError, match=why) as info:
        moeflow_env.DIST_TIMEOUT_S.get_positive()
    assert info.value.code == "MF107"
    monkeypatch.setenv("MOEFLOW_DIST_TIMEOUT_S", "12.5")
    assert moeflow_env.DIST_TIMEOUT_S.get_positive() == 12.5


@pytest.mark.parametrize("name,value", [("MOEFLOW_EAGER_GRAPHS", "-1"), ("MOEFLOW_EAGER_GRAPHS", "1.5"),
                                        ("LOCAL_RANK", "x"), ("MOEFLOW_TRITON_PDL", "maybe"),
                                        ("MOEFLOW_DIST_TIMEOUT_S", "0")])
def test_moeflow_env_shows_a_value_it_cannot_read_and_exits_2(monkeypatch, capsys, name, value):
    """`moeflow env` reads every variable as its kind and shows the MF107 of one it cannot read (a listing alone
    let a wrong value through until the call that first read it)."""
    from moeflow.cli import main
    assert main(["env"]) == 0
    monkeypatch.setenv(name, value)
    assert main(["env"]) == 2
    out = capsys.readouterr().out
    assert f"    invalid: [MF107] {name}=" in out and out.count("    invalid: ") == 1


def test_every_variable_has_a_kind_its_default_reads_as():
    for var in moeflow_env.ALL:
        assert var.kind in ("switch", "seconds", "count", "text", "choice"), var.name
        assert var.read() is not None, var.name


def test_kernel_arch_names_the_targets(monkeypatch):
    """MOEFLOW_KERNEL_ARCH's choices are moeflow.targets' architectures; another value is MF107."""
    from moeflow.targets import TARGETS
    assert moeflow_env.KERNEL_ARCH.choices == tuple(t.arch for t in TARGETS)
    monkeypatch.setenv("MOEFLOW_KERNEL_ARCH", "sm_75")
    with pytest.raises(MoeflowError) as info:
        moeflow_env.KERNEL_ARCH.get_choice()
    assert info.value.code == "MF107" and "sm_80, sm_86" in str(info.value)
