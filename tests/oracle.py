"""Independent float64 oracle of one MoE layer (an einsum MoE, gpt-fast style) and shared checks.

The oracle shares nothing with moeflow's runners except the quantization scheme objects (used
to fake-quantize activations the same way: quantize, then dequantize) and the dequantized weights.
"""
import torch
import torch.nn.functional as F

ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}


def oracle_moe(x, ids, w, w13, w2, activation, scheme, dtype):
    """x [T,H] (layer dtype), ids [T,K], w [T,K], w13 [E,2I,H] / w2 [E,H,I] float (dequantized)
    -> [T,H] float64. scheme: a moeflow QuantScheme (activation fake-quantization)."""
    t, k = ids.shape
    xq = scheme.fake_quantize_activation(x).double()                        # [T, H]
    h = torch.einsum("th,tknh->tkn", xq, w13.double()[ids.long()])          # [T, K, 2I]
    g, u = h.chunk(2, dim=-1)
    a = (ACTS[activation](g) * u).to(dtype)                                  # rounded like the runners
    i = a.shape[-1]                                                          # explicit: -1 is ambiguous at T=0
    aq = scheme.fake_quantize_activation(a.reshape(t * k, i)).double().view(t, k, i)
    y = torch.einsum("tki,tkhi->tkh", aq, w2.double()[ids.long()])           # [T, K, H]
    return torch.einsum("tkh,tk->th", y, w.double())


def oracle_moe_grouped(x, ids, w, w13, w2, activation, scheme, dtype):
    """oracle_moe computed expert by expert (float64 matmuls over each expert's copies) for batches whose
    [T, K, 2I, H] gather would not fit in memory: the same operations in the same precision. -> [T, H] float64."""
    t, k = ids.shape
    xq = scheme.fake_quantize_activation(x).double()                        # [T, H]
    flat = ids.long().flatten()                                              # copy t * K + k -> its expert
    groups = [(e, (flat == e).nonzero().flatten()) for e in flat.unique().tolist()]
    h = torch.empty(t * k, w13.shape[1], dtype=torch.float64, device=x.device)
    for e, rows in groups:
        h[rows] = xq[rows // k] @ w13[e].double().T
    g, u = h.chunk(2, dim=-1)
    aq = scheme.fake_quantize_activation((ACTS[activation](g) * u).to(dtype)).double()  # [T * K, I]
    y = torch.empty(t * k, w2.shape[1], dtype=torch.float64, device=x.device)
    for e, rows in groups:
        y[rows] = aq[rows] @ w2[e].double().T
    return (y.view(t, k, -1) * w.double()[..., None]).sum(1)


def bits(t):
    """A tensor's raw bytes (a uint8 view: the last dimension times the element size), for exact comparison:
    torch.equal would call NaN != NaN and -0.0 == 0.0, and some torch builds have no float8 comparison."""
    flat = t.detach().clone(memory_format=torch.contiguous_format).view(-1).view(torch.uint8)  # whatever t's strides
    return flat.view(*t.shape[:-1], t.shape[-1] * t.element_size()) if t.dim() else flat


def same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def rel_err(out, ref):
    """‖out − ref‖ / ‖ref‖ in float64 (NaN when out has NaN)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out, ref, tol, what=""):
    err = rel_err(out, ref)
    if not err <= tol:  # also catches NaN
        diff = (out.double() - ref.double()).abs()
        where = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0]) if diff.numel() else ()
        raise AssertionError(f"{what}: relative error {err:.3e} > {tol:.1e}; worst at {where}: "
                             f"out={out.double()[where].item() if where else None} ref={ref.double()[where].item() if where else None}")


# ---------------------------------------------------------------- routing, Hugging Face style
def captured(fn):
    """fn (zero arguments, returning a tensor) captured as a CUDA graph after a warm-up call outside the capture
    (moeflow.graphs.capture_graph) -> (the graph, its output tensor, which each replay rewrites)."""
    from moeflow.graphs import capture_graph
    outs = []
    graph = capture_graph(lambda: outs.append(fn()))
    return graph, outs[-1]


def replayed(fn):
    """fn()'s output (a tensor) from a CUDA graph: a warm-up call outside the capture, the capture, then the
    captured output poisoned with NaN and the graph replayed (every element must be rewritten)."""
    graph, out = captured(fn)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return out


def hf_route(logits, top_k, scoring="softmax", renormalize=True, groups=1, topk_groups=1, bias=None, scale=1.0):
    """Routing as Hugging Face's Mixtral / Qwen3-MoE / DeepSeek-V3 routers do it, float32.

    -> (ids [T, K] int64, weights [T, K] float32), ids in topk order (unsorted for grouped).
    softmax: softmax -> top-k -> optional renormalize (Mixtral: on; Qwen3-MoE: norm_topk_prob).
    sigmoid (DeepSeek-V3): scores = sigmoid; choice = scores + bias; with groups, a group's score
    is the sum of its two best choice values (bias) or its best value (no bias); the
    topk_groups best groups are kept and the rest masked with -inf; top-k on choice; weights
    are the *unbiased* scores gathered; renormalize with a +1e-20 guard; times ``scale``.
    """
    logits = logits.float()
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if groups > 1:
        t, e = choice.shape
        per_group = choice.view(t, groups, e // groups)
        gscore = per_group.topk(2, dim=-1)[0].sum(-1) if bias is not None else per_group.max(-1).values
        gidx = torch.topk(gscore, k=topk_groups, dim=-1, sorted=False)[1]
        gmask = torch.zeros_like(gscore).scatter_(1, gidx, 1)
        emask = gmask.unsqueeze(-1).expand(-1, groups, e // groups).reshape(t, e)
        choice = choice.masked_fill(~emask.bool(), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scale


def route_for(cfg, logits, bias=None):
    """hf_route with the routing fields of a moeflow MoEConfig."""
    return hf_route(logits, cfg.top_k, cfg.scoring, cfg.renormalize, cfg.num_expert_groups, cfg.topk_groups,
                    bias if cfg.use_correction_bias else None, cfg.routed_scaling_factor)


# ---------------------------------------------------------------- whole layer
def dequantized_experts(layer):
    """(w13 [E,2I,H], w2 [E,H,I]) float32 as the layer's scheme stores them, dequantized."""
    s = layer.scheme
    return (s.dequantize_weight(layer.gate_up_proj, layer.gate_up_proj_scale_inv),
            s.dequantize_weight(layer.down_proj, layer.down_proj_scale_inv))


def shared_oracle(layer, x):
    """The shared-expert part of a layer, float64 [T, H] (zeros without shared experts): a gated
    MLP whose intermediate is rounded to the layer dtype like the routed experts', optionally
    scaled by sigmoid(x @ shared_expert_gate)."""
    cfg = layer.config
    xd = x.double()
    if layer.shared_experts is None:
        return torch.zeros_like(xd)
    m = layer.shared_experts
    g, u = xd @ m.gate_proj.weight.double().T, xd @ m.up_proj.weight.double().T
    a = (ACTS[cfg.activation](g) * u).to(cfg.dtype).double()
    y = a @ m.down_proj.weight.double().T
    if layer.shared_expert_gate is not None:
        y = y * torch.sigmoid(xd @ layer.shared_expert_gate.weight.double().T)
    return y


def layer_oracle(layer, x, ids, w, grouped=False):
    """The whole layer in float64 for given routing: routed experts (oracle_moe on the dequantized
    weights, activations fake-quantized by the layer's scheme; grouped: oracle_moe_grouped, for large
    batches) + shared experts. -> [T, H]."""
    w13, w2 = dequantized_experts(layer)
    cfg = layer.config
    routed = oracle_moe_grouped if grouped else oracle_moe
    return routed(x, ids, w, w13, w2, cfg.activation, layer.scheme, cfg.dtype) + shared_oracle(layer, x)
