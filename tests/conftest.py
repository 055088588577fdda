"""Shared fixtures of the CPU suite.

- every test is seeded from its own id (fresh random data per test, reproducible run to run);
- ``make_layer`` builds a layer and loads fresh random weights through ``load_weights`` with
  Hugging Face names (never the zeros/ones a broken init might leave);
- ``poison`` makes ``torch.empty`` / ``torch.empty_like`` return NaN-filled floating tensors, so
  an element a kernel forgets to write shows up as NaN in the output instead of as stale memory.
"""
import random
import zlib

import pytest
import torch

# first: on a machine without a GPU, Triton's interpreter must be chosen before any test module (tests/gpu/ included,
# which are collected but skipped there) imports moeflow.kernels, since @triton.jit reads it when a kernel is defined
import triton_interp  # noqa: F401,I001

from moeflow import MoE

# The suite's tensors are tiny: intra-op threads only add OpenMP hand-offs, which on a loaded
# 2-core machine cost ~50 ms per op (a small layer's forward: 4 ms on one thread, 240 ms on two).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed(request):
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)


@pytest.fixture(autouse=True)
def _gpu_eager_calls_launch_by_launch(request, monkeypatch):
    """tests/gpu: eager calls past MOEFLOW_EAGER_GRAPHS run launch by launch (MOEFLOW_EAGER_BUCKETS=0) unless a test
    sets the variable itself. Those files compare an eager call's bits with the same launches captured in a graph or
    compiled; a bucketed call is another computation (the bucket's tiles), which tests/gpu/test_gpu_eager_graphs.py
    checks against the launched calls and the oracle."""
    if "gpu" in request.node.path.parent.parts[-1:]:
        monkeypatch.setenv("MOEFLOW_EAGER_BUCKETS", "0")


@pytest.fixture
def poison(monkeypatch):
    empty, empty_like = torch.empty, torch.empty_like

    def nan_fill(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: nan_fill(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: nan_fill(empty_like(*a, **kw)))


@pytest.fixture
def poison_empty(monkeypatch):
    """torch.empty returns 0x7f bytes (floats 3.4e38, ints 0x7f7f...): unwritten outputs show."""
    empty = torch.empty

    def filled(*a, **kw):
        t = empty(*a, **kw)
        if t.numel():
            t.view(-1).view(torch.uint8).fill_(0x7F)
        return t

    monkeypatch.setattr(torch, "empty", filled)


def random_state(cfg, dtype=torch.float32):
    """Fresh random weights for ``cfg`` under Hugging Face names, scaled like nn.Linear (outputs O(1))."""
    e, h, i, s = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.shared_size
    state = {
        "gate_up_proj": torch.randn(e, 2 * i, h, dtype=dtype) / h ** 0.5,
        "down_proj": torch.randn(e, h, i, dtype=dtype) / i ** 0.5,
    }
    if cfg.use_correction_bias:
        # DeepSeek-V3 biases are O(0.1-1): some biased choice scores become negative
        state["e_score_correction_bias"] = torch.rand(e) - 0.5
    if s:
        state["shared_experts.gate_proj.weight"] = torch.randn(s, h, dtype=dtype) / h ** 0.5
        state["shared_experts.up_proj.weight"] = torch.randn(s, h, dtype=dtype) / h ** 0.5
        state["shared_experts.down_proj.weight"] = torch.randn(h, s, dtype=dtype) / s ** 0.5
    if cfg.shared_expert_gate:
        state["shared_expert_gate.weight"] = torch.randn(1, h, dtype=dtype) / h ** 0.5
    return state


@pytest.fixture
def make_layer():
    """make_layer(config=None, **fields) -> MoE with fresh random weights loaded by HF names."""

    def make(config=None, **fields):
        layer = MoE(config, **fields)
        layer.load_weights(random_state(layer.config))
        return layer

    return make


@pytest.fixture
def weights_for():
    """weights_for(cfg, dtype=float32) -> dict of fresh random HF-named weights for ``cfg``."""
    return random_state


# markers whose tests run only when the -m expression names them -> the reason shown for the skip otherwise
OPT_IN = {"targets": "the compile matrix: run with -m targets (.ci/run does)",
          "families": "every MoE family of transformers: run with -m families"}


def pytest_collection_modifyitems(config, items):
    """Tests marked ``targets`` (the compile tier: the compile matrix, minutes a GPU target, and the sm_90a / sm_80
    compile checks) or ``families`` (every MoE family of the installed transformers through moeflow, about a minute)
    run only when the -m expression names their marker (.ci/run's second step names targets); the README's test
    command leaves them out."""
    markexpr = config.getoption("markexpr") or ""
    for marker, reason in OPT_IN.items():
        if marker in markexpr:
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)
