"""transformers integration: the "moeflow" experts implementation and whole-block replacement
against transformers' eager experts, on tiny random models of the five supported families saved
with save_pretrained (safetensors) and reloaded. Whole-model logits are held to the layer's own
rows of tests/tolerances.py (measured: ~2e-7 in float32, ~6e-3 in bfloat16).
"""
import gc
import os
import pathlib
import subprocess
import sys
import weakref

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from moeflow import MoeflowError  # noqa: E402
from moeflow.integrations.hf import prepare_experts, replace_moe_blocks  # noqa: E402
from moeflow.integrations.hf.blocks import MoeflowBlock  # noqa: E402
from moeflow.integrations.hf.tiny import FAMILIES, tiny_model  # noqa: E402
from oracle import assert_close  # noqa: E402
from tolerances import rel_tol  # noqa: E402

Auto = transformers.AutoModelForCausalLM


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{(family, dtype): directory of a saved tiny random model}, built on first use."""
    cache = {}

    def get(family, dtype=torch.float32):
        if (family, dtype) not in cache:
            path = tmp_path_factory.mktemp(f"{family}_{str(dtype)[6:]}")
            tiny_model(family, dtype=dtype).save_pretrained(path)
            cache[family, dtype] = path
        return cache[family, dtype]
    return get


def load(path, impl, dtype=torch.float32):
    return Auto.from_pretrained(path, dtype=dtype, experts_implementation=impl).eval()


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_family_logits_match_eager(checkpoints, family):
    path = checkpoints(family)
    ids = torch.randint(0, 256, (2, 11))
    ref = logits(load(path, "eager"), ids)
    via_interface = load(path, "moeflow")
    assert via_interface.config._experts_implementation == "moeflow"
    assert prepare_experts(via_interface) == via_interface.config.num_hidden_layers - (family == "deepseek_v3")
    assert_close(logits(via_interface, ids), ref, rel_tol("none", torch.float32), f"{family} experts_implementation")
    blocks = load(path, "eager")
    replaced = replace_moe_blocks(blocks)
    assert replaced and all(isinstance(blocks.get_submodule(p), MoeflowBlock) for p in replaced)
    assert_close(logits(blocks, ids), ref, rel_tol("none", torch.float32), f"{family} replace_moe_blocks")


def test_bf16_model(checkpoints):
    # Qwen2-MoE: shared expert with its sigmoid gate, routing weights rounded to bf16 by transformers
    path = checkpoints("qwen2_moe", torch.bfloat16)
    ids = torch.randint(0, 256, (2, 9))
    ref = logits(load(path, "eager", torch.bfloat16), ids)
    tol = rel_tol("none", torch.bfloat16)
    assert_close(logits(load(path, "moeflow", torch.bfloat16), ids), ref, tol, "bf16 experts_implementation")
    model = load(path, "eager", torch.bfloat16)
    replace_moe_blocks(model)
    assert_close(logits(model, ids), ref, tol, "bf16 replace_moe_blocks")


@pytest.mark.parametrize("family", FAMILIES)
def test_router_logits_are_recorded_after_replacement(checkpoints, family):
    """output_router_logits=True: transformers hooks the router module, which a replaced block keeps and then runs;
    the recorded logits (and the auxiliary loss, where the family computes one) are the eager model's, and the
    model's output is the same bits with the recording as without. The router keeps its state_dict names."""
    path = checkpoints(family)
    ids = torch.randint(0, 256, (2, 5))
    eager = load(path, "eager")
    if not hasattr(eager.config, "output_router_logits"):
        pytest.skip(f"{family} has no output_router_logits")
    with torch.no_grad():
        want = eager(ids, output_router_logits=True)
    model = load(path, "eager")
    gate_keys = {k for k in model.state_dict() if ".mlp.gate." in k}
    replace_moe_blocks(model)
    assert gate_keys and gate_keys <= set(model.state_dict())
    with torch.no_grad():
        got = model(ids, output_router_logits=True)
        plain = model(ids).logits
    assert len(got.router_logits) == len(want.router_logits) > 0
    assert torch.equal(got.router_logits[0], want.router_logits[0])  # the first MoE layer's input is eager's
    for i, (a, b) in enumerate(zip(got.router_logits, want.router_logits)):  # later ones: after moeflow's experts
        assert_close(a, b, rel_tol("none", torch.float32), f"{family} router logits {i}")
    if getattr(want, "aux_loss", None) is not None:
        assert_close(got.aux_loss, want.aux_loss, rel_tol("none", torch.float32), f"{family} aux loss")
    assert torch.equal(got.logits, plain)
    assert_close(got.logits, want.logits, rel_tol("none", torch.float32), f"{family} with router logits")


@pytest.mark.parametrize("family", FAMILIES)
def test_replaced_model_saves_a_checkpoint_transformers_reads(checkpoints, family, tmp_path):
    """A replaced model's state_dict names its tensors as the blocks it replaced did, so save_pretrained writes a
    checkpoint that from_pretrained loads (no missing or unexpected keys) with the original tensors, bit for bit;
    load_state_dict of the original state_dict into a replaced model reads those names back."""
    path = checkpoints(family)
    original = load(path, "eager")
    want = original.state_dict()
    model = load(path, "eager")
    replace_moe_blocks(model)
    assert set(model.state_dict()) == set(want)
    model.save_pretrained(tmp_path)
    again, info = Auto.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    got = again.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    fresh = load(path, "eager")
    replace_moe_blocks(fresh)
    for block in (b for b in fresh.modules() if isinstance(b, MoeflowBlock)):
        for t in block.moe.parameters():
            t.data.zero_()
    assert not fresh.load_state_dict(want).missing_keys
    ids = torch.randint(0, 256, (2, 5))
    assert torch.equal(logits(fresh, ids), logits(model, ids))


def test_fp8_replaced_blocks_keep_moeflow_names_and_load_block_names(checkpoints):
    """A block quantized by moeflow (quant="fp8-channel" on a float model) has no block format to save in: its
    state_dict keeps the layer's names (FP8 weights and scales); its load_state_dict still reads the block's names,
    quantizing as MoE.load_state_dict does."""
    path = checkpoints("qwen2_moe")
    original = load(path, "eager").state_dict()
    model = load(path, "eager")
    replace_moe_blocks(model, quant="fp8-channel")
    state = model.state_dict()
    assert any(k.endswith("mlp.moe.gate_up_proj_scale_inv") for k in state)
    assert not any(".mlp.experts." in k or ".mlp.shared_expert." in k for k in state)
    other = load(path, "eager")
    replace_moe_blocks(other, quant="fp8-channel")
    result = other.load_state_dict({k: v for k, v in original.items()}, strict=False)
    assert not result.unexpected_keys and all(k.endswith("_scale_inv") for k in result.missing_keys)
    got = other.state_dict()
    assert all(torch.equal(got[k].view(torch.uint8) if got[k].dtype == torch.float8_e4m3fn else got[k],
                           state[k].view(torch.uint8) if state[k].dtype == torch.float8_e4m3fn else state[k])
               for k in state)


def test_set_experts_implementation_switches_a_loaded_model(checkpoints):
    model = load(checkpoints("olmoe"), "eager")
    ids = torch.randint(0, 256, (1, 7))
    ref = logits(model, ids)
    model.set_experts_implementation("moeflow")
    got = logits(model, ids)
    experts = model.model.layers[0].mlp.experts
    assert experts.__dict__.get("_moeflow_paths"), "the moeflow path did not run"
    assert_close(got, ref, rel_tol("none", torch.float32), "set_experts_implementation")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_greedy_generation_same_tokens(checkpoints, family):
    path = checkpoints(family)
    prompt = torch.randint(0, 256, (1, 6))

    def generate(model):
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)[0].tolist()
    want = generate(load(path, "eager"))
    assert generate(load(path, "moeflow")) == want
    blocks = load(path, "eager")
    replace_moe_blocks(blocks)
    assert generate(blocks) == want


def test_adopted_weights_are_not_copied(checkpoints):
    model = load(checkpoints("qwen3_moe"), "eager")
    w = model.model.layers[1].mlp.experts.gate_up_proj
    replace_moe_blocks(model)
    assert model.model.layers[1].mlp.moe.gate_up_proj.data_ptr() == w.data_ptr()


def test_adopted_weights_are_never_allocated_twice(checkpoints):
    """A block whose experts are already in the layer's layout builds its layer around them: no tensor of the experts'
    shape is allocated on the way (the layer had allocated its own, then swapped the block's in: one block's experts
    twice at the peak)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default):
                self.shapes.append(tuple(out.shape))
            return out

    model = load(checkpoints("qwen3_moe"), "eager")
    experts = {tuple(model.model.layers[1].mlp.experts.gate_up_proj.shape),
               tuple(model.model.layers[1].mlp.experts.down_proj.shape)}
    with Allocations() as seen:
        replace_moe_blocks(model)
    assert seen.shapes and not experts & set(seen.shapes), experts & set(seen.shapes)


def test_replaced_blocks_are_freed_as_they_go(checkpoints):
    """replace_moe_blocks quantizing high-precision experts drops each old block once it is replaced (so its experts
    can be freed then), not when every block is done: the peak holds one block's old and new experts, not all."""
    model = load(checkpoints("qwen3_moe"), "eager")
    paths = [n for n, m in model.named_modules() if hasattr(m, "experts") and hasattr(m, "gate")]
    old = {n: weakref.ref(model.get_submodule(n).experts.gate_up_proj) for n in paths}
    alive = []

    def progress(done, total, path):
        gc.collect()
        alive.append(old[path]() is not None)
    assert replace_moe_blocks(model, quant="fp8-channel", progress=progress) == paths
    assert len(paths) >= 2 and alive == [False] * len(paths)


def test_expert_parallel_sentinels(checkpoints):
    """A rank holding experts 2..5 of 8: ids of other ranks' experts arrive as sentinels (>= the
    local count, weight 0) and must contribute exactly nothing."""
    full = load(checkpoints("qwen3_moe"), "eager").model.layers[0].mlp.experts
    local = load(checkpoints("qwen3_moe"), "moeflow").model.layers[0].mlp.experts
    local.gate_up_proj = nn.Parameter(full.gate_up_proj[2:6].clone())
    local.down_proj = nn.Parameter(full.down_proj[2:6].clone())
    local.num_experts, local._is_expert_parallel = 4, True
    x = torch.randn(13, full.hidden_dim)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(13)])
    w = torch.rand(13, 2)
    mine = (ids >= 2) & (ids < 6)
    with torch.no_grad():
        want = full(x, ids, torch.where(mine, w, 0.0))
        got = local(x, torch.where(mine, ids - 2, 4 + ids % 3), torch.where(mine, w, 0.0))  # sentinels 4, 5, 6
    assert_close(got, want, rel_tol("none", torch.float32), "EP sentinels")


def _experts_class(**flags):
    from transformers.activations import ACT2FN
    from transformers.integrations.moe import use_experts_implementation

    class ToyExperts(nn.Module):
        def __init__(self, config):
            super().__init__()
            e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
            t = flags.get("is_transposed", False)
            self.num_experts = e
            self.gate_up_proj = nn.Parameter(torch.randn(*((e, h, 2 * i) if t else (e, 2 * i, h))) / h ** 0.5)
            self.down_proj = nn.Parameter(torch.randn(*((e, i, h) if t else (e, h, i))) / i ** 0.5)
            if flags.get("has_bias"):
                self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i))
                self.down_proj_bias = nn.Parameter(torch.zeros(e, h))
            self.act_fn = ACT2FN[config.hidden_act]

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise AssertionError("an experts implementation should have run instead")
    return use_experts_implementation(ToyExperts, **flags)


def test_transposed_weights_match_batched_mm():
    config = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=4)
    module = _experts_class(is_transposed=True)(config)
    x, ids, w = torch.randn(9, 32), torch.stack([torch.randperm(4)[:2] for _ in range(9)]), torch.rand(9, 2)
    with torch.no_grad():
        config._experts_implementation = "batched_mm"  # transformers' own handling of is_transposed
        want = module(x, ids, w)
        config._experts_implementation = "moeflow"
        got = module(x, ids, w)
    assert_close(got, want, rel_tol("none", torch.float32), "is_transposed")


@pytest.mark.parametrize("flags,act,feature", [
    (dict(has_bias=True), "silu", "has_bias"),
    (dict(), "relu", "act_fn"),
])
def test_unsupported_experts_are_refused(flags, act, feature):
    config = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=4, hidden_act=act)
    config._experts_implementation = "moeflow"
    module = _experts_class(**flags)(config)
    with pytest.raises(MoeflowError) as info:
        module(torch.randn(3, 32), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))
    assert info.value.code == "MF704" and feature in str(info.value)


def test_unknown_block_refused_and_model_untouched(checkpoints):
    model = load(checkpoints("qwen3_moe"), "eager")

    class MysteryMoE(nn.Module):  # a gate and experts, but routing moeflow does not know
        def __init__(self, block):
            super().__init__()
            self.gate, self.experts = block.gate, block.experts
    before = model.model.layers[0].mlp
    model.model.layers[1].mlp = MysteryMoE(model.model.layers[1].mlp)
    with pytest.raises(MoeflowError) as info:
        replace_moe_blocks(model)
    assert info.value.code == "MF702" and "MysteryMoE" in str(info.value)
    assert model.model.layers[0].mlp is before  # nothing replaced before the refusal
    assert replace_moe_blocks(model, skip_unknown=True) == ["model.layers.0.mlp"]
    with pytest.raises(MoeflowError) as info:
        replace_moe_blocks(nn.Sequential(nn.Linear(4, 4)))
    assert info.value.code == "MF703"


def test_bad_activation_dtype_is_refused_and_model_untouched(checkpoints):
    """An explicit dtype that is no layer dtype is MF104 before any block is replaced (it read as bfloat16)."""
    model = load(checkpoints("qwen3_moe"), "eager")
    before = model.model.layers[0].mlp
    with pytest.raises(MoeflowError) as info:
        replace_moe_blocks(model, dtype=torch.float64)
    assert info.value.code == "MF104" and model.model.layers[0].mlp is before


@pytest.mark.slow
def test_registration_is_lazy_and_transformers_optional():
    """In fresh interpreters: `import moeflow` imports no transformers, registers "moeflow" with both
    interfaces once transformers loads them; without transformers, import works and register() is MF701."""
    lazy = ("import sys, moeflow; assert 'transformers' not in sys.modules; "
            "from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS as A; "
            "from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS as B; "
            "assert 'moeflow' in A and 'moeflow' in B; print('ok')")
    absent = ("import sys; sys.modules['transformers'] = None; import moeflow; "
              "from moeflow.integrations import hf\n"
              "try:\n    hf.register()\nexcept moeflow.MoeflowError as e:\n    print(e.code)")
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    for code, want in ((lazy, "ok"), (absent, "MF701")):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0 and proc.stdout.strip() == want, proc.stderr[-2000:]
