"""Fine-grained FP8 checkpoints (float8_e4m3fn weights + 128x128 weight_scale_inv) with moeflow.

transformers 5.24 cannot keep such a checkpoint in FP8 on a CPU (it dequantizes pre-quantized FP8
to bf16 without a GPU, and needs the accelerate package to load one at all), so the checkpoints
here are made by quantizing a saved tiny model in the test itself (plain torch, independent of
moeflow's quantizer) and read by moeflow's own loader, load_fp8_model. The FP8 experts interface
(transformers' FP8Experts, as its loader builds them on a GPU) is exercised on a module built
directly. Expert weights are rescaled per expert and per projection before quantizing (fp8_checkpoints.py), so a
scale stacked onto the wrong expert or the wrong half of gate_up_proj shows as a large error.
"""
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from moeflow import MoeflowError  # noqa: E402
from moeflow.integrations.hf import load_fp8_model  # noqa: E402
from moeflow.integrations.hf.blocks import MoeflowBlock  # noqa: E402
from moeflow.integrations.hf.tiny import FAMILIES, tiny_model  # noqa: E402
from moeflow.quant import create_scheme  # noqa: E402
from fp8_checkpoints import PROJ, write_fp8_checkpoint  # noqa: E402
from oracle import assert_close, oracle_moe  # noqa: E402
from tolerances import rel_tol  # noqa: E402

@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """family -> (fp8 dir, dequantized twin dir, {checkpoint name: tensor} of the FP8 files)."""
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = write_fp8_checkpoint(tmp_path_factory.mktemp(f"fp8_{family}"), family)
        return cache[family]
    return get


def _stacked(quant, prefix, proj, kind):
    ids = sorted({int(k.split(".")[len(prefix.split("."))]) for k in quant if k.startswith(prefix + ".")})
    names = [n for n, p in PROJ.items() if p == proj]
    return torch.stack([next(quant[f"{prefix}.{e}.{n}.{kind}"] for n in names if f"{prefix}.{e}.{n}.{kind}" in quant)
                        for e in ids])


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_fp8_checkpoint_experts_stay_fp8_and_logits_match(fp8_checkpoint, family):
    fp8_dir, deq_dir, quant = fp8_checkpoint(family)
    model = load_fp8_model(fp8_dir, dtype=torch.float32)
    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, MoeflowBlock)]
    assert blocks
    for name, block in blocks:  # bit-for-bit the checkpoint's FP8 bytes and scales: never dequantized
        prefix = name.replace(".mlp", ".block_sparse_moe" if family == "mixtral" else ".mlp") + ".experts"
        moe = block.moe
        assert moe.config.quant == "fp8-block" and moe.gate_up_proj.dtype == torch.float8_e4m3fn
        for kind, param in (("weight", moe.gate_up_proj), ("weight_scale_inv", moe.gate_up_proj_scale_inv)):
            want = torch.cat([_stacked(quant, prefix, "gate", kind), _stacked(quant, prefix, "up", kind)], dim=1)
            assert torch.equal(param.view(torch.uint8) if kind == "weight" else param,
                               want.view(torch.uint8) if kind == "weight" else want)
        assert torch.equal(moe.down_proj.view(torch.uint8), _stacked(quant, prefix, "down", "weight").view(torch.uint8))
    ids = torch.randint(0, 256, (2, 10))
    ref = transformers.AutoModelForCausalLM.from_pretrained(deq_dir, dtype=torch.float32, experts_implementation="eager")
    with torch.no_grad():
        want, got = ref.eval()(ids).logits, model(ids).logits
    assert_close(got, want, rel_tol("fp8-block-model", torch.float32), f"{family} FP8 model logits")


def test_fp8_block_matches_oracle(fp8_checkpoint):
    fp8_dir, _, quant = fp8_checkpoint("qwen3_moe")
    model = load_fp8_model(fp8_dir, dtype=torch.float32)
    moe = model.model.layers[1].mlp.moe
    prefix = "model.layers.1.mlp.experts"
    deq = lambda proj: _stacked(quant, prefix, proj, "weight").float() * _stacked(
        quant, prefix, proj, "weight_scale_inv").repeat_interleave(128, 1).repeat_interleave(128, 2)
    x = torch.randn(21, moe.config.hidden_size)
    ids = torch.stack([torch.randperm(moe.config.num_experts)[:2] for _ in range(21)])
    w = torch.rand(21, 2)
    with torch.no_grad():
        got = moe.forward_topk(x, ids, w)
    want = oracle_moe(x, ids, w, torch.cat([deq("gate"), deq("up")], dim=1), deq("down"), "silu",
                      create_scheme("fp8-block"), torch.float32)
    assert_close(got, want, rel_tol("fp8-block", torch.float32), "fp8-block layer from the checkpoint")


def _fp8_experts(quant, **overrides):
    """transformers' FP8Experts as its FP8 loader builds them, with experts_implementation="moeflow"."""
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
    from transformers.integrations.moe import use_experts_implementation
    from moeflow.integrations.hf.tiny import tiny_config
    config = tiny_config("qwen3_moe", size="fp8")
    config._experts_implementation = "moeflow"
    cls = use_experts_implementation(FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    module = cls(config, **{"block_size": (128, 128), **overrides})
    prefix = "model.layers.0.mlp.experts"
    with torch.no_grad():
        for name, parts in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
            getattr(module, name).data = torch.cat([_stacked(quant, prefix, p, "weight") for p in parts], dim=1)
            getattr(module, name + "_scale_inv").data = torch.cat(
                [_stacked(quant, prefix, p, "weight_scale_inv") for p in parts], dim=1)
    return module


def test_fp8_experts_interface(fp8_checkpoint):
    _, _, quant = fp8_checkpoint("qwen3_moe")
    module = _fp8_experts(quant)
    x, ids, w = torch.randn(17, 128), torch.stack([torch.randperm(4)[:2] for _ in range(17)]), torch.rand(17, 2)
    with torch.no_grad():
        got = module(x, ids, w)
    scheme = create_scheme("fp8-block")
    want = oracle_moe(x, ids, w, scheme.dequantize_weight(module.gate_up_proj, module.gate_up_proj_scale_inv),
                      scheme.dequantize_weight(module.down_proj, module.down_proj_scale_inv), "silu", scheme, torch.float32)
    assert_close(got, want, rel_tol("fp8-block", torch.float32), "FP8Experts via the FP8 interface")
    path = next(iter(module.__dict__["_moeflow_paths"].values()))
    assert path.plan.scheme == "fp8-block"


@pytest.mark.parametrize("overrides,feature", [(dict(block_size=(64, 64)), "block_size"),
                                               (dict(activation_scheme="static"), "activation_scheme")])
def test_fp8_experts_refusals(fp8_checkpoint, overrides, feature):
    module = _fp8_experts(fp8_checkpoint("qwen3_moe")[2], **overrides)
    with pytest.raises(MoeflowError) as info:
        module(torch.randn(3, 128), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))
    assert info.value.code == "MF704" and feature in str(info.value)


def test_load_fp8_refuses_non_fp8(fp8_checkpoint, tmp_path):
    _, deq_dir, _ = fp8_checkpoint("qwen3_moe")
    for path, why in ((deq_dir, "quant_method"), (tmp_path, "config.json")):
        with pytest.raises(MoeflowError) as info:
            load_fp8_model(path)
        assert info.value.code == "MF705" and why in str(info.value)


def test_generate_cli_on_fp8_checkpoint(fp8_checkpoint, capsys):
    from moeflow.cli import main
    fp8_dir, _, _ = fp8_checkpoint("qwen3_moe")
    assert main(["generate", "--model", str(fp8_dir), "--experts", "eager,moeflow-block", "--max-new-tokens", "3",
                 "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "eager          skipped: FP8 checkpoint" in out and re.search(r"^moeflow-block +[\d.]+ +[\d.]+", out, re.M)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_model_is_built_without_its_experts_in_high_precision(fp8_checkpoint, family):
    """load_fp8_model builds the model on the meta device and gives memory to all but the routed experts, which stay
    on meta until their blocks are replaced; the buffers no checkpoint holds (rotary inv_freq) are computed as
    from_config computes them, and nothing is left on meta."""
    from moeflow.integrations.hf import fp8
    fp8_dir, _, _ = fp8_checkpoint(family)
    config = transformers.AutoConfig.from_pretrained(fp8_dir)
    fp8._check_quantization(config, fp8_dir)
    routed = {n for n, m in tiny_model(family, size="fp8").named_modules() if n.endswith(".experts")}
    built = fp8._build(transformers, config, torch.float32, "cpu", routed)
    for name, t in [*built.named_parameters(), *built.named_buffers()]:
        assert t.is_meta == any(name.startswith(r + ".") for r in routed), name
    want = dict(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).named_buffers())
    rotary = {n: b for n, b in built.named_buffers() if "rotary" in n}
    assert rotary
    for name, buf in rotary.items():
        assert torch.equal(buf, want[name]), name
    model = load_fp8_model(fp8_dir, dtype=torch.float32)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert any(isinstance(m, MoeflowBlock) for m in model.modules())


def test_tied_embeddings_stay_tied(fp8_checkpoint, tmp_path):
    """A checkpoint with tie_word_embeddings (no lm_head.weight of its own): the head is the embedding, loaded."""
    import json
    import shutil
    fp8_dir, _, quant = fp8_checkpoint("qwen3_moe")
    tied = tmp_path / "tied"
    shutil.copytree(fp8_dir, tied)
    cfg = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    state = {k: v for k, v in quant.items() if k != "lm_head.weight"}
    safetensors_torch.save_file(state, tied / "model.safetensors", metadata={"format": "pt"})
    model = load_fp8_model(tied, dtype=torch.float32)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert head.data_ptr() == embed.data_ptr() and torch.equal(embed, quant["model.embed_tokens.weight"])


def test_a_buffer_left_uncomputed_is_refused(fp8_checkpoint, monkeypatch):
    """The meta-device build leaves the rotary buffers NaN until the model's initializer computes them: a
    transformers whose initializer does not is MF705, not a model with uninitialized memory for inv_freq."""
    fp8_dir, _, _ = fp8_checkpoint("qwen3_moe")
    from_config = transformers.AutoModelForCausalLM.from_config

    def no_init(*args, **kwargs):
        model = from_config(*args, **kwargs)
        model._init_weights = lambda module: None
        return model
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", no_init)
    with pytest.raises(MoeflowError) as info:
        load_fp8_model(fp8_dir, dtype=torch.float32)
    assert info.value.code == "MF705" and "rotary_emb.inv_freq" in str(info.value), str(info.value)


def test_each_block_is_read_once_and_a_missing_expert_is_refused_before_any_block_is_replaced(fp8_checkpoint,
                                                                                             monkeypatch, tmp_path):
    """load_fp8_model plans every block from shapes alone (_BlockExperts.plan) and stacks and copies each block's
    checkpoint experts once, to build it; a checkpoint without one expert's down_proj is MF705 from that plan, before
    any block is built."""
    import shutil
    from moeflow.integrations.hf import fp8
    fp8_dir, _, quant = fp8_checkpoint("qwen3_moe")
    reads, get = [], fp8._BlockExperts.get
    monkeypatch.setattr(fp8._BlockExperts, "get", lambda self, block, default=None: reads.append(block) or
                        get(self, block, default))
    model = load_fp8_model(fp8_dir, dtype=torch.float32)
    blocks = [n for n, m in model.named_modules() if isinstance(m, MoeflowBlock)]
    assert len(blocks) > 1 and sorted(reads) == sorted(blocks), reads

    gone = next(k for k in quant if ".experts.1.down_proj.weight" in k and k.endswith("weight"))
    broken = tmp_path / "broken"
    shutil.copytree(fp8_dir, broken)
    safetensors_torch.save_file({k: v for k, v in quant.items() if not k.startswith(gone)},
                                broken / "model.safetensors", metadata={"format": "pt"})
    built = []
    monkeypatch.setattr(fp8._BlockExperts, "get", lambda self, block, default=None: built.append(block))
    with pytest.raises(MoeflowError) as info:
        load_fp8_model(broken, dtype=torch.float32)
    assert info.value.code == "MF705" and "down" in str(info.value) and "[1]" in str(info.value), str(info.value)
    assert not built
