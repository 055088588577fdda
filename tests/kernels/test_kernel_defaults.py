"""Kernel configurations where no tuned table matches: the Hopper defaults (kernels/gemm/sm90_tiles.py) and borrowing
another GPU's table of the same compute capability (kernels/configs.find_table). Host-side only: which tiles are
picked and whether they survive configs.fit; the GPU suite runs them (tests/gpu/test_gpu_triton.py)."""
import json
import math

import pytest

from moeflow.kernels import configs as kc

from moeflow.kernels.gemm import tiles
from moeflow.kernels.gemm.sm90_tiles import RULES, sm90_gemm_configs
from moeflow.presets import PRESETS

HOPPER = (9, 0)
SCHEMES = ("none", "fp8-tensor", "fp8-channel", "fp8-block")
# the presets and model shapes no table covers: (E, H, I, top_k)
SHAPES = [(p["num_experts"], p["hidden_size"], p["intermediate_size"], p["top_k"]) for n, p in PRESETS.items()
          if n != "small"] + [(128, 4096, 1536, 8), (64, 2048, 1408, 6), (8, 6144, 16384, 2), (16, 1536, 1408, 4)]


def test_rules_cover_every_batch_in_order():
    for scheme, rules in RULES.items():
        bounds = [row[0] for row in rules]
        assert bounds == sorted(bounds) and bounds[-1] == math.inf, scheme
    for scheme in SCHEMES:
        assert sm90_gemm_configs(0.0, scheme, 2048, 768) == sm90_gemm_configs(1e-3, scheme, 2048, 768)


@pytest.mark.parametrize("e,h,i,k", SHAPES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_hopper_tiles_survive_fit(scheme, e, h, i, k):
    """Every rule's tiles, fitted to the shape as the runner fits them: the Gluon flags a rule sets stay (the tile is
    one those kernels run, within shared memory), the stages are not cut, fp8-block's gate_up quantizes its groups in
    the epilogue (BLOCK_N a multiple of 128)."""
    nbytes = 1 if scheme != "none" else 2
    for t in (1, 16, 128, 300, 1024, 4096, 16384):
        m = t * k / e
        gate_up, down = sm90_gemm_configs(m, scheme, h, i)
        for cfg, pair, n in ((gate_up, True, i), (down, False, h)):
            got = tiles.fit(cfg, fused_pair=pair, scheme=scheme, elem_bytes=nbytes, n_size=n)
            assert got.warp_specialize == cfg.warp_specialize, (t, cfg)
            assert bool(got.scale_overlap) == bool(cfg.scale_overlap), (t, cfg)
            assert got.num_stages == cfg.num_stages and got.block_m == cfg.block_m, (t, cfg)
        if scheme == "fp8-block":
            assert tiles.fit(gate_up, fused_pair=True, scheme=scheme, elem_bytes=1, n_size=i).block_n % 128 == 0


def test_hopper_rules_follow_rows_per_expert_and_shape():
    """16-row tiles up to 16 rows an expert; the warp-specialized kernels past 48 (bf16, fp8-block with short K
    loops); fp8-block's long K loops (H or I over 2048) take the per-tile Gluon kernels; bf16's gate_up runs COOP
    tiles from 48 to 96 rows an expert, past 384, and between them for H over 4096; bf16's down takes the 128 x 256
    tile from H = 4096 past 96 rows an expert; fp8-tensor/-channel never a Gluon kernel."""
    for scheme in SCHEMES:
        assert all(c.block_m == 16 for c in sm90_gemm_configs(16, scheme, 2048, 768))
        assert all(c.block_m == 64 for c in sm90_gemm_configs(17, scheme, 2048, 768))
    assert all(c.warp_specialize for c in sm90_gemm_configs(49, "none", 2048, 768))
    gate_up, down = sm90_gemm_configs(1000, "none", 2048, 768)
    assert (gate_up.block_m, gate_up.block_n, down.block_n) == (128, 128, 128)
    assert sm90_gemm_configs(1000, "none", 4096, 768)[1].block_n == 256
    assert sm90_gemm_configs(90, "none", 4096, 768)[1].block_n == 128
    assert sm90_gemm_configs(90, "none", 2048, 768)[0].block_m == 128  # COOP gate_up from 48 to 96 rows
    assert sm90_gemm_configs(200, "none", 4096, 768)[0].block_m == 64
    assert sm90_gemm_configs(200, "none", 7168, 2048)[0].block_m == 128  # a long K loop: COOP
    short = sm90_gemm_configs(1000, "fp8-block", 2048, 768)
    assert all(c.warp_specialize and not c.scale_overlap for c in short)
    long_h, long_i = sm90_gemm_configs(1000, "fp8-block", 7168, 14336)
    assert long_h.scale_overlap == 1 and not long_h.warp_specialize and long_i.scale_overlap == 2
    for scheme in ("fp8-tensor", "fp8-channel"):
        for m in (1, 32, 1000):
            assert not any(c.warp_specialize or c.scale_overlap for c in sm90_gemm_configs(m, scheme, 7168, 2048))


def test_default_config_takes_the_hopper_rules_on_hopper_only():
    """capability (9, x) with the shape given -> the Hopper rules; no capability (the interpreter), another
    architecture, or no shape -> the generic defaults; the one-token one-launch tiles either way."""
    for t in (1, 64, 4096):
        hopper = tiles.default_config(t, 8, 128, "fp8-block", hidden=2048, inter=768, capability=HOPPER)
        assert (hopper.gate_up, hopper.down) == sm90_gemm_configs(t * 8 / 128, "fp8-block", 2048, 768)
        generic = tiles.default_config(t, 8, 128, "fp8-block")
        for other in (dict(hidden=2048, inter=768), dict(hidden=2048, inter=768, capability=(10, 0)),
                      dict(capability=HOPPER)):
            assert tiles.default_config(t, 8, 128, "fp8-block", **other) == generic
        assert (hopper.fused is not None) == (generic.fused is not None) == (t == 1)
    assert tiles.default_config(4096, 8, 128, "none", hidden=2048, inter=768, capability=(9, 0)).gate_up.warp_specialize
    assert not tiles.default_config(4096, 8, 128, "none").gate_up.warp_specialize


def _table(path, device, capability, entry):
    meta = {"device": device} | ({"capability": list(capability)} if capability else {})
    kc.write_table(path, meta, {1: entry})


def test_table_borrowed_from_a_gpu_of_the_same_capability(monkeypatch, tmp_path):
    """No file for this GPU: another GPU's file for the same shape and scheme whose header records the same compute
    capability is borrowed, with a warning naming both; the same GPU's file of another expert count still wins over
    it; a file of another capability, or one that records none, is never borrowed across GPUs."""
    monkeypatch.setenv("MOEFLOW_KERNEL_CONFIG_DIR", str(tmp_path))
    a, b, c = (kc.MoEKernelConfig(kc.GemmConfig(16, n, 128), kc.GemmConfig(16, 64, 128)) for n in (32, 64, 128))
    _table(tmp_path / kc.file_name("GPU A", 8, 128, 256, "none"), "GPU A", (9, 0), a)
    _table(tmp_path / kc.file_name("GPU B", 8, 128, 256, "none"), "GPU B", (8, 9), b)
    _table(tmp_path / kc.file_name("GPU C", 8, 128, 256, "fp8-block"), "GPU C", None, c)
    with pytest.warns(UserWarning, match=r"borrowing 'E=8,N=128,K=256,device=GPU_A,scheme=none\.json', tuned on "
                                         r"GPU A \(compute capability 9\.0"):
        assert kc.find_table("GPU D", 8, 128, 256, "none", capability=(9, 0)) == {1: a}
    with pytest.warns(UserWarning, match=r"borrowing 'E=8,N=128.*GPU_A.*\(E=8\) at the same rows per expert"):
        assert kc.find_table("GPU D", 4, 128, 256, "none", capability=(9, 0)) == {1: a}
    with pytest.warns(UserWarning, match="GPU_B"):
        assert kc.find_table("GPU D", 8, 128, 256, "none", capability=(8, 9)) == {1: b}
    for capability in (None, (10, 0)):
        with pytest.warns(UserWarning, match="using defaults"):
            assert kc.find_table("GPU D", 8, 128, 256, "none", capability=capability) is None
    with pytest.warns(UserWarning, match="using defaults"):
        assert kc.find_table("GPU D", 8, 128, 256, "fp8-block", capability=(9, 0)) is None
    _table(tmp_path / kc.file_name("GPU D", 16, 128, 256, "none"), "GPU D", (9, 0), c)
    with pytest.warns(UserWarning, match=r"borrowing 'E=16,N=128,K=256,device=GPU_D.*moeflow tune --local-experts 8"):
        assert kc.find_table("GPU D", 8, 128, 256, "none", capability=(9, 0)) == {1: c}


def test_shipped_tables_record_their_capability():
    """The shipped H200 files say sm_90 in their header, so that an H100 or H20 borrows them."""
    for path in kc.SHIPPED_DIR.glob("*.json"):
        data = json.loads(path.read_text())
        assert data["device"] == "NVIDIA H200" and data["capability"] == [9, 0], path.name


def test_table_source_says_where_the_tiles_come_from(monkeypatch, tmp_path):
    """`moeflow check`'s line: this GPU's own file, a borrowed one (another expert count, another GPU of the same
    capability), or the defaults (Hopper's rules on sm_90, the generic ones elsewhere); never a warning."""
    import warnings
    monkeypatch.setenv("MOEFLOW_KERNEL_CONFIG_DIR", str(tmp_path))
    entry = kc.MoEKernelConfig(kc.GemmConfig(16, 64, 128), kc.GemmConfig(16, 64, 128))
    _table(tmp_path / kc.file_name("GPU A", 8, 128, 256, "none"), "GPU A", (9, 0), entry)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kc.table_source("GPU A", 8, 128, 256, "none", (9, 0)).startswith("tuned file ")
        assert "(E=8) at the same rows per expert" in kc.table_source("GPU A", 4, 128, 256, "none", (9, 0))
        assert "tuned on GPU A" in kc.table_source("GPU B", 8, 128, 256, "none", (9, 0))
        assert "Hopper rules" in kc.table_source("GPU B", 8, 128, 512, "none", (9, 0))
        assert "generic defaults" in kc.table_source("GPU B", 8, 128, 256, "none", (10, 0))
    shipped = kc.table_source("NVIDIA H100 80GB HBM3", 128, 768, 2048, "fp8-block", (9, 0))
    assert "'E=128,N=768,K=2048,device=NVIDIA_H200,scheme=fp8-block.json', tuned on NVIDIA H200" in shipped
