"""Every MoE family of the installed transformers (moeflow/integrations/hf/families.py), built tiny (build.py) and run
through moeflow (coverage.py), as scripts/family_table.py does for docs/families.md.

The default tier: the enumeration, the five families block replacement knows through both paths, the verdicts the
harness gives a wrong result, a refusal and a time box; about 3 s. The tier marked ``families`` runs them all (about
20 s on a CPU): none may crash or be wrong.
"""
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moeflow  # noqa: E402,F401  (registers "moeflow" with transformers' experts interfaces)
from moeflow.integrations.hf import build, coverage  # noqa: E402
from moeflow.integrations.hf.families import aliases, experts_classes, family, moe_families  # noqa: E402
from moeflow.integrations.hf.tiny import FAMILIES as BLOCK_FAMILIES  # noqa: E402

pytestmark = pytest.mark.xdist_group("hf_families")  # one worker imports the families' modeling modules once


def test_enumeration_finds_the_moe_families_from_transformers_itself():
    found = {f.name: f for f in moe_families()}
    on_interface = [f for f in found.values() if f.interface]
    assert len(found) > 20 and len(on_interface) > 20, sorted(found)
    for name in (*BLOCK_FAMILIES, "gpt_oss", "qwen3_next", "glm4_moe", "ernie4_5_moe", "minimax_m2", "deepseek_v2"):
        assert found[name].interface, name
    assert not found["llama4"].interface  # its experts run in Llama-4's own code, not through the interface
    assert [c.__name__ for c in experts_classes(found["mixtral"])] == ["MixtralExperts"]
    assert "bert" not in found and "llama" not in found  # dense families are not MoE families
    assert set(aliases().values()) <= set(found)
    with pytest.raises(KeyError, match="not an MoE family"):
        family("bert")


def test_shrink_keeps_one_layer_of_each_kind():
    fields = {"layer_types": ["a", "a", "b", "a"], "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]}
    keep, per_layer = build._keep_layers(fields, 4)
    assert keep == [0, 1, 2]  # the first dense, the first sparse, the first "b"
    assert per_layer == {"layer_types": ["a", "a", "b"], "mlp_layer_types": ["dense", "sparse", "sparse"]}


@pytest.fixture(scope="module")
def rows():
    """{family: Row} of the five families block replacement knows, run once."""
    return {name: coverage.check_family(family(name)) for name in BLOCK_FAMILIES}


@pytest.mark.parametrize("name", BLOCK_FAMILIES)
def test_block_families_match_eager_through_both_paths(rows, name):
    row = rows[name]
    assert row.experts.status == "works" and row.experts.err <= 1e-4, row
    assert row.blocks.status == "works" and row.blocks.err <= 1e-4, row


def test_a_wrong_experts_result_reads_wrong(monkeypatch):
    from moeflow.integrations.hf import experts
    forward = experts.experts_forward_eager
    monkeypatch.setattr(experts, "experts_forward_eager", lambda *args: forward(*args) * 1.001)
    row = coverage.check_family(family("qwen3_moe"))
    assert row.experts.status == "wrong" and row.experts.err > 1e-5, row


def test_a_refusal_reads_refused_with_its_code_and_feature():
    row = coverage.check_family(family("gpt_oss"))
    assert (row.experts.status, row.experts.code) == ("refused", "MF704"), row
    assert "has_bias=True" in row.experts.why
    assert row.blocks.status == "refused" and row.blocks.code in ("MF702", "MF703"), row


def test_a_family_over_its_time_box_is_recorded_not_raised(monkeypatch):
    monkeypatch.setattr(coverage, "tiny_family_model", lambda fam, seed: time.sleep(5))
    start = time.perf_counter()
    row = coverage.check_family(family("mixtral"), time_box_s=0.2)
    assert time.perf_counter() - start < 2
    assert row.experts.status == "skipped" and "time box" in " ".join(row.notes), row


@pytest.mark.families
def test_every_family_runs_or_is_refused_none_crashes_none_is_wrong():
    rows = [coverage.check_family(fam) for fam in moe_families()]
    bad = [(r.family, r.experts, r.blocks, r.notes) for r in rows
           if {r.experts.status, r.blocks.status} & {"wrong", "error"}]
    assert not bad, bad
    not_run = sorted(r.family for r in rows if r.experts.status == "skipped")
    assert not_run == ["vitpose_backbone"], [(r.family, r.notes) for r in rows if r.experts.status == "skipped"]
    works = [r for r in rows if r.experts.status == "works"]
    assert all(r.experts.err <= coverage.rel_tol("none", torch.float32) for r in works)
    assert sum(r.blocks.status == "works" for r in rows) >= len(BLOCK_FAMILIES)


def test_an_activation_given_as_a_torch_function():
    """LFM2-MoE sets act_fn = F.silu itself, not a module: read as "silu" (its family then runs through moeflow)."""
    from moeflow.errors import MoeflowError
    from moeflow.integrations.hf.experts import activation_of
    assert activation_of(torch.nn.functional.silu, "X") == "silu"
    assert activation_of(torch.nn.functional.gelu, "X") == "gelu"
    with pytest.raises(MoeflowError, match="MF704"):
        activation_of(torch.tanh, "X")
