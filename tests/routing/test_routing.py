"""Routing: moeflow's router against an independent Hugging Face-style reference (oracle.hf_route)
and, where transformers is installed, against transformers' own router classes.

Indices are compared exactly as sets per row (continuous random logits: no ties); weights,
matched by expert id, to float32 rounding.

Masking of dropped groups: moeflow gives dropped groups -inf, and so does transformers 5.x's
DeepseekV3TopkRouter. Older DeepSeek code paths in transformers (DeepseekV2TopkRouter's
group_limited_greedy, and the routers of Mistral4 / MistralLarge4 / axk2 / deepseek_ocr2) fill
dropped experts with 0.0 instead. The two agree whenever the (biased) choice scores of the kept
groups are positive (always true for softmax, and for sigmoid without a bias); with a negative
correction bias a 0.0 fill can let an expert of a dropped group win over a kept expert whose
biased score is negative. The tests below show both facts.
"""
import pytest
import torch

from moeflow import MoEConfig
from moeflow.routing import create_router
from oracle import hf_route

T = 64


def route(logits, bias=None, **fields):
    cfg = MoEConfig(hidden_size=64, intermediate_size=32, **fields)
    return create_router(cfg, "torch")(logits, bias)


def assert_same_routing(ids, weights, ref_ids, ref_weights):
    """Per row: the same set of experts, and the same weight for each expert (fp32 rounding)."""
    assert ids.shape == ref_ids.shape
    ids_s, order = ids.long().sort(dim=1)
    ref_s, ref_order = ref_ids.long().sort(dim=1)
    bad = (ids_s != ref_s).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:5]} select {ids_s[bad[0]].tolist()}, reference {ref_s[bad[0]].tolist()}"
    torch.testing.assert_close(weights.gather(1, order), ref_weights.float().gather(1, ref_order),
                               rtol=1e-6, atol=1e-9)


# name -> routing fields; what each mimics is in its name
CASES = {
    "mixtral": dict(num_experts=8, top_k=2),
    "qwen3-norm_topk_prob": dict(num_experts=16, top_k=4, renormalize=True),
    "qwen3-no-norm": dict(num_experts=16, top_k=4, renormalize=False),
    "top1": dict(num_experts=7, top_k=1),
    "k-equals-e": dict(num_experts=6, top_k=6),
    "deepseek-v3": dict(num_experts=16, top_k=4, scoring="sigmoid", num_expert_groups=4, topk_groups=2,
                        use_correction_bias=True, routed_scaling_factor=2.5),
    "deepseek-v3-wide": dict(num_experts=64, top_k=8, scoring="sigmoid", num_expert_groups=8, topk_groups=4,
                             use_correction_bias=True, routed_scaling_factor=2.5),
    "deepseek-v3-no-norm": dict(num_experts=32, top_k=6, scoring="sigmoid", num_expert_groups=4, topk_groups=3,
                                use_correction_bias=True, renormalize=False),
    "sigmoid-bias-ungrouped": dict(num_experts=12, top_k=3, scoring="sigmoid", use_correction_bias=True),
    "sigmoid-grouped-no-bias": dict(num_experts=16, top_k=3, scoring="sigmoid", num_expert_groups=4, topk_groups=1),
    "deepseek-v2-group-limited": dict(num_experts=16, top_k=4, num_expert_groups=4, topk_groups=2,
                                      renormalize=False, routed_scaling_factor=16.0),
}


def make_bias(case):
    return torch.rand(case["num_experts"]) - 0.5 if case.get("use_correction_bias") else None


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("logit_dtype", (torch.float32, torch.bfloat16), ids=str)
def test_matches_hf_style_reference(name, logit_dtype):
    case = CASES[name]
    logits = (torch.randn(T, case["num_experts"]) * 2).to(logit_dtype)
    bias = make_bias(case)
    ids, weights = route(logits, bias, **case)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    cfg = MoEConfig(hidden_size=64, intermediate_size=32, **case)
    ref_ids, ref_weights = hf_route(logits, cfg.top_k, cfg.scoring, cfg.renormalize, cfg.num_expert_groups,
                                    cfg.topk_groups, bias, cfg.routed_scaling_factor)
    assert_same_routing(ids, weights, ref_ids, ref_weights)


@pytest.mark.parametrize("name", CASES)
def test_routing_invariants(name):
    """Distinct experts per row; renormalized rows sum to routed_scaling_factor; grouped routing
    only picks from topk_groups groups; weights are the *unbiased* scores."""
    case = CASES[name]
    cfg = MoEConfig(hidden_size=64, intermediate_size=32, **case)
    logits = torch.randn(T, cfg.num_experts) * 2
    ids, weights = route(logits, make_bias(case), **case)
    srt = ids.sort(dim=1).values
    assert (srt[:, 1:] != srt[:, :-1]).all()
    assert ids.min() >= 0 and ids.max() < cfg.num_experts
    if cfg.renormalize:
        torch.testing.assert_close(weights.sum(1), torch.full((T,), cfg.routed_scaling_factor), rtol=1e-6, atol=0)
    else:
        scores = logits.softmax(-1) if cfg.scoring == "softmax" else logits.sigmoid()
        torch.testing.assert_close(weights, scores.gather(1, ids.long()) * cfg.routed_scaling_factor,
                                   rtol=1e-6, atol=0)
    if cfg.grouped:
        groups_used = (ids.long() // (cfg.num_experts // cfg.num_expert_groups)).sort(1).values
        distinct = 1 + (groups_used[:, 1:] != groups_used[:, :-1]).sum(1)
        assert distinct.max() <= cfg.topk_groups


def test_bias_is_for_selection_only():
    """A large bias forces an expert with a low score into the top-k; its weight stays its own
    unbiased sigmoid score."""
    logits = torch.randn(T, 8)
    logits[:, 5] = -4.0
    bias = torch.zeros(8)
    bias[5] = 10.0
    ids, weights = route(logits, bias, num_experts=8, top_k=2, scoring="sigmoid", use_correction_bias=True,
                         renormalize=False)
    assert (ids == 5).any(dim=1).all()
    w5 = weights[ids == 5]
    torch.testing.assert_close(w5, torch.sigmoid(torch.tensor(-4.0)).expand_as(w5))


def test_zero_tokens():
    ids, weights = route(torch.randn(0, 16), torch.zeros(16), num_experts=16, top_k=4, scoring="sigmoid",
                         num_expert_groups=4, topk_groups=2, use_correction_bias=True)
    assert ids.shape == (0, 4) and weights.shape == (0, 4)


# ---------------------------------------------------------------- zero-fill vs -inf group masking
def route_zero_fill(logits, bias, top_k, groups, topk_groups):
    """DeepSeek-V3 routing with the 0.0 fill for dropped groups (older transformers DeepSeek code)."""
    scores = logits.float().sigmoid()
    choice = scores + bias
    t, e = choice.shape
    gscore = choice.view(t, groups, -1).topk(2, dim=-1)[0].sum(-1)
    gmask = torch.zeros_like(gscore).scatter_(1, gscore.topk(topk_groups, dim=-1)[1], 1)
    emask = gmask.repeat_interleave(e // groups, dim=1)
    ids = choice.masked_fill(~emask.bool(), 0.0).topk(top_k, dim=-1)[1]
    w = scores.gather(1, ids)
    return ids, w / (w.sum(-1, keepdim=True) + 1e-20)


V3 = dict(num_experts=16, top_k=6, scoring="sigmoid", num_expert_groups=4, topk_groups=2, use_correction_bias=True)


def test_zero_fill_agrees_when_biased_scores_are_positive():
    logits = torch.randn(T, 16) * 2
    bias = torch.rand(16) * 0.5  # sigmoid > 0 and bias >= 0: every biased score is positive
    ids, w = route(logits, bias, **V3)
    assert_same_routing(ids, w, *route_zero_fill(logits, bias, 6, 4, 2))


def test_zero_fill_differs_with_negative_biased_scores():
    """Every biased score negative: the 0.0 fill makes the dropped groups' experts win, moeflow's
    -inf keeps every pick inside the kept groups."""
    logits = torch.randn(T, 16)
    bias = torch.full((16,), -2.0)  # every biased score in (-2, -1)
    choice = logits.sigmoid() + bias
    kept = choice.view(T, 4, 4).topk(2, dim=-1)[0].sum(-1).topk(2, dim=-1)[1]  # [T, 2] kept groups
    in_kept = lambda ids: (ids.long()[:, :, None] // 4 == kept[:, None, :]).any(-1)  # [T, K]
    ids, _ = route(logits, bias, **V3)
    zf_ids, _ = route_zero_fill(logits, bias, 6, 4, 2)
    assert in_kept(ids).all()
    assert not in_kept(zf_ids).all(dim=1).any()  # no row of the 0.0-fill routing stays in its kept groups


# ---------------------------------------------------------------- transformers' own routers
def hf_router(router_cls, config, num_experts):
    """A transformers router whose weight is the identity, so that router_logits == its input."""
    router = router_cls(config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(num_experts))
    return router


def run_hf(router, logits):
    out_logits, weights, ids = router(logits)
    assert torch.equal(out_logits, logits)  # the identity trick is exact
    return ids, weights


@pytest.mark.parametrize("e,k", ((8, 2), (7, 3)))
def test_matches_transformers_mixtral(e, k):
    pytest.importorskip("transformers")
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    router = hf_router(MixtralTopKRouter, MixtralConfig(hidden_size=e, num_local_experts=e, num_experts_per_tok=k), e)
    logits = torch.randn(T, e) * 2
    assert_same_routing(*route(logits, num_experts=e, top_k=k), *run_hf(router, logits))


@pytest.mark.parametrize("norm", (True, False))
def test_matches_transformers_qwen3_moe(norm):
    pytest.importorskip("transformers")
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=16, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm)
    logits = torch.randn(T, 16) * 2
    assert_same_routing(*route(logits, num_experts=16, top_k=4, renormalize=norm),
                        *run_hf(hf_router(Qwen3MoeTopKRouter, cfg, 16), logits))


@pytest.mark.parametrize("bias_sign", ("positive", "mixed", "negative"))
@pytest.mark.parametrize("norm", (True, False))
def test_matches_transformers_deepseek_v3(norm, bias_sign):
    """transformers 5.x masks dropped groups with -inf like moeflow, so the routers agree even
    when biased scores are negative (see the module docstring for the 0.0-fill variants)."""
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    e, k, g, tg, scale = 32, 6, 8, 3, 2.5
    cfg = DeepseekV3Config(hidden_size=e, n_routed_experts=e, num_experts_per_tok=k, n_group=g, topk_group=tg,
                           norm_topk_prob=norm, routed_scaling_factor=scale)
    router = hf_router(DeepseekV3TopkRouter, cfg, e)
    bias = {"positive": torch.rand(e) * 0.5, "mixed": torch.rand(e) - 0.5, "negative": -1.5 - torch.rand(e)}[bias_sign]
    with torch.no_grad():
        router.e_score_correction_bias.copy_(bias)
    logits = torch.randn(T, e) * 2
    ours = route(logits, bias, num_experts=e, top_k=k, scoring="sigmoid", num_expert_groups=g, topk_groups=tg,
                 use_correction_bias=True, renormalize=norm, routed_scaling_factor=scale)
    assert_same_routing(*ours, *run_hf(router, logits))


def test_matches_transformers_deepseek_v2_group_limited():
    """DeepSeek-V2's group_limited_greedy (softmax, group = its best score, 0.0 fill, no renorm):
    softmax scores are positive, so the 0.0 fill and moeflow's -inf agree."""
    pytest.importorskip("transformers")
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(hidden_size=16, num_attention_heads=1, num_key_value_heads=1, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                           topk_method="group_limited_greedy", routed_scaling_factor=16.0)
    logits = torch.randn(T, 16) * 2
    ours = route(logits, num_experts=16, top_k=4, num_expert_groups=4, topk_groups=2, renormalize=False,
                 routed_scaling_factor=16.0)
    assert_same_routing(*ours, *run_hf(hf_router(DeepseekV2TopkRouter, cfg, 16), logits))
