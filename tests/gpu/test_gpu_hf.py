"""transformers integration on a real GPU: the "moeflow" experts implementation and block
replacement against transformers' eager on tiny bf16 models, and FP8Experts (128x128 blocks)
through the FP8 interface against the float64 oracle. Run: pytest -m gpu tests/gpu/test_gpu_hf.py
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from moeflow.integrations.hf import prepare_experts, replace_moe_blocks  # noqa: E402
from moeflow.integrations.hf.tiny import tiny_config, tiny_model  # noqa: E402
from moeflow.quant import create_scheme  # noqa: E402
from oracle import assert_close, oracle_moe  # noqa: E402
from tolerances import rel_tol  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_bf16_model_on_gpu(family):
    model = tiny_model(family, size="fp8", dtype=torch.bfloat16).cuda()  # H = I = 128: every runner's alignment
    ids = torch.randint(0, 256, (2, 33), device="cuda")
    with torch.no_grad():
        model.set_experts_implementation("eager")
        want = model(ids).logits
        model.set_experts_implementation("moeflow")
        assert prepare_experts(model, torch.bfloat16) > 0
        got_interface = model(ids).logits
        replace_moe_blocks(model)
        got_blocks = model(ids).logits
    tol = rel_tol("none", torch.bfloat16)
    assert_close(got_interface, want, tol, f"{family} experts_implementation on GPU")
    assert_close(got_blocks, want, tol, f"{family} replace_moe_blocks on GPU")


def test_fp8_experts_interface_on_gpu():
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
    from transformers.integrations.moe import use_experts_implementation
    config = tiny_config("qwen3_moe", size="fp8")
    config._experts_implementation = "moeflow"
    with torch.device("cuda"):
        module = use_experts_implementation(FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)(
            config, block_size=(128, 128))
    scheme = create_scheme("fp8-block")
    for name, shape in (("gate_up_proj", (4, 256, 128)), ("down_proj", (4, 128, 128))):
        q, s = scheme.quantize_weight(torch.randn(shape, device="cuda") / 11)
        getattr(module, name).data, getattr(module, name + "_scale_inv").data = q, s
    x = torch.randn(70, 128, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(4, device="cuda")[:2] for _ in range(70)])
    w = torch.rand(70, 2, device="cuda")
    with torch.no_grad():
        got = module(x, ids, w)
    want = oracle_moe(x, ids, w, scheme.dequantize_weight(module.gate_up_proj, module.gate_up_proj_scale_inv),
                      scheme.dequantize_weight(module.down_proj, module.down_proj_scale_inv), "silu", scheme, torch.bfloat16)
    assert_close(got, want, rel_tol("fp8-block", torch.bfloat16), "FP8Experts via the FP8 interface on GPU")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_load_fp8_model_on_gpu(family, tmp_path):
    """load_fp8_model(device="cuda"): the checkpoint read memory-mapped on the host, each block's experts moved to
    the GPU as it is replaced; the experts keep the checkpoint's bytes, and the logits match the same checkpoint
    loaded on the CPU."""
    pytest.importorskip("safetensors")
    from fp8_checkpoints import write_fp8_checkpoint
    from moeflow.integrations.hf import load_fp8_model
    from moeflow.integrations.hf.blocks import MoeflowBlock
    fp8_dir, _, _ = write_fp8_checkpoint(tmp_path, family)
    on_gpu = load_fp8_model(fp8_dir, dtype=torch.float32, device="cuda")
    on_cpu = load_fp8_model(fp8_dir, dtype=torch.float32)
    blocks = [(n, m) for n, m in on_gpu.named_modules() if isinstance(m, MoeflowBlock)]
    assert blocks and all(p.device.type == "cuda" for p in on_gpu.parameters())
    for name, block in blocks:
        cpu = on_cpu.get_submodule(name).moe
        assert torch.equal(block.moe.gate_up_proj.view(torch.uint8).cpu(), cpu.gate_up_proj.view(torch.uint8))
        assert torch.equal(block.moe.down_proj_scale_inv.cpu(), cpu.down_proj_scale_inv)
    ids = torch.randint(0, 256, (2, 33))
    with torch.no_grad():
        got, want = on_gpu(ids.cuda()).logits.cpu(), on_cpu(ids).logits
    assert_close(got, want, rel_tol("fp8-block-model", torch.float32), f"{family} load_fp8_model on GPU vs CPU")
