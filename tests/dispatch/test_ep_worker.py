"""The process side of the expert-parallel CPU tests (no tests here; tests/dispatch/test_ep_cpu.py spawns it).

    python tests/dispatch/test_ep_worker.py SUITE RANK WORLD INIT_FILE OUT_DIR

Every rank runs the same list of checks in the same order (one gloo group for the whole suite) and
writes OUT_DIR/rank{RANK}.json after each: {check: "ok" | "FAIL: ..."}. Each check seeds torch from
its name, so all ranks draw the same weights and the same tokens of all ranks; a rank feeds its
slice to the expert-parallel layer and compares with a one-process layer (a group of size 1) run on
all the tokens with the same weights.
"""
import contextlib
import datetime
import json
import os
import random
import sys
import time
import traceback
import zlib

import torch
import torch.distributed as dist

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(_HERE, "..", ".."), os.path.join(_HERE, ".."), _HERE]  # the repository, tests/, here

from moeflow import MoE, MoEConfig  # noqa: E402
from moeflow.errors import MoeflowError  # noqa: E402
from moeflow.planner import cell_status  # noqa: E402
from moeflow.capabilities import Environment  # noqa: E402
from moeflow.dispatch._ep_base import expert_placement  # noqa: E402
from oracle import rel_err  # noqa: E402
from ep_balance_checks import balance_checks  # noqa: E402
from tolerances import rel_tol  # noqa: E402

DISPATCHERS = ("allgather", "alltoall", "alltoall-fixed", "alltoall-p2p", "lowlatency")
SCHEMES = ("none", "fp8-tensor", "fp8-channel", "fp8-block")
BASE = dict(num_experts=8, hidden_size=256, intermediate_size=128, top_k=2, max_tokens_per_rank=32)


def cpu_cells(world):
    """[(dispatcher, runner, scheme)] the planner accepts on CPU in a group of ``world`` ranks."""
    env = Environment("cpu", None, world_size=world)
    return [(d, r, s) for d in DISPATCHERS for r in ("reference", "grouped_mm") for s in SCHEMES
            if cell_status(MoEConfig(**BASE, quant=s, runner=r, dispatcher=d), env) == "ok"]


class Ctx:
    def __init__(self, rank, world):
        self.rank, self.world = rank, world
        self.solo = [dist.new_group([r]) for r in range(world)]  # every rank creates every group

    def compare(self, tokens, payload=None, tol=None, logits_fn=None, indexed=None, **fields):
        """EP layer on this rank's tokens vs the one-process layer on all tokens; tokens[r] per rank.
        indexed: the dispatcher hands rows by index (as for the triton runner on CUDA) or not;
        None: as the plan says."""
        cfg = MoEConfig(**{**BASE, **fields, **({"dispatch_payload": payload} if payload else {})})
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        state = {"gate_up_proj": torch.randn(e, 2 * i, h) / h ** 0.5, "down_proj": torch.randn(e, h, i) / i ** 0.5}
        if cfg.shared_size:
            s = cfg.shared_size
            state.update({"shared_experts.gate_proj.weight": torch.randn(s, h) / h ** 0.5,
                          "shared_experts.up_proj.weight": torch.randn(s, h) / h ** 0.5,
                          "shared_experts.down_proj.weight": torch.randn(h, s) / s ** 0.5})
        if cfg.use_correction_bias:
            state["e_score_correction_bias"] = torch.rand(e) - 0.5
        x = torch.randn(sum(tokens), h).to(cfg.dtype).to(cfg.device)
        logits = (logits_fn(sum(tokens), e) if logits_fn else torch.randn(sum(tokens), e) * 2).to(cfg.device)
        ep = MoE(cfg)
        if indexed is not None:
            ep.dispatcher.indexed_rows = indexed and ep.dispatcher.caps.indexed_rows
        one = MoE(cfg.replace(dispatcher="auto", placement=None), process_group=self.solo[self.rank])
        for layer in (ep, one):
            layer.load_weights(state)
        lo = sum(tokens[:self.rank])
        mine = slice(lo, lo + tokens[self.rank])
        out = ep(x[mine], logits[mine])
        ref = one(x, logits)[mine]
        assert out.shape == ref.shape and out.dtype == cfg.dtype, (out.shape, out.dtype)
        assert ep.plan.dispatcher == cfg.dispatcher or cfg.dispatcher == "auto", ep.plan
        if ref.numel():
            err = rel_err(out, ref)
            scheme = "fp8-tensor-rebatched" if cfg.quant == "fp8-tensor" else cfg.quant
            limit = tol if tol is not None else rel_tol(scheme, cfg.dtype)
            assert err <= limit, f"relative error {err:.2e} > {limit:.1e} ({ep.plan.runner}, {cfg.quant})"
        return ep, x[mine], logits[mine], out

    def expect(self, code, fn):
        try:
            fn()
        except MoeflowError as exc:
            assert exc.code == code, f"raised {exc.code}, expected {code}: {exc}"
            return exc
        raise AssertionError(f"no error; expected {code}")


@contextlib.contextmanager
def kernels_on_cpu():
    """The dispatchers' Triton kernel paths (kernels/rows/ep_rows.py, ep_sort.py), which run on CUDA
    only, forced onto CPU tensors through Triton's interpreter: the kernels inside the real
    multi-process dispatch, gloo standing in for NCCL."""
    import importlib

    import triton_interp  # noqa: F401  (TRITON_INTERPRET=1 and the interpreter's numpy fix)
    from moeflow.dispatch import _ep_rows
    original, used = _ep_rows._ep_kernels, []

    def kernels(t, module="ep_rows"):
        used.append(module)
        return importlib.import_module(f"moeflow.kernels.rows.{module}")

    _ep_rows._ep_kernels = kernels
    try:
        yield used
    finally:
        _ep_rows._ep_kernels = original


def compare_with_kernels(c, name, **fields):
    if triton_missing():
        return  # reported as ok: the kernels cannot run here (tests/kernels/test_kernels_ep_*.py skip likewise)
    with kernels_on_cpu() as used:
        c.compare(tokens_for(c, name), runner="reference", dtype=torch.float16, **fields)
    assert "ep_rows" in used, "the kernel path was not taken"


def triton_missing() -> bool:
    import importlib.util
    return importlib.util.find_spec("triton") is None


def tokens_for(ctx, name):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return [int(t) for t in torch.randint(1, 24, (ctx.world,), generator=g)]


def suite(world):
    """[(name, fn(ctx))] in the order every rank runs them."""
    checks = []
    for d, r, s in cpu_cells(world):
        dtype = torch.float32 if (d, r, s) == (d, "reference", "none") else torch.bfloat16
        checks.append((f"matrix-{d}-{r}-{s}", lambda c, d=d, r=r, s=s, dt=dtype, n=f"matrix-{d}-{r}-{s}":
                       c.compare(tokens_for(c, n), dispatcher=d, runner=r, quant=s, dtype=dt)))
    for d in DISPATCHERS:
        # compressing a bf16 layer's payload to FP8 costs one FP8 rounding of each token
        checks.append((f"fp8-payload-{d}", lambda c, d=d: c.compare(
            tokens_for(c, d), payload="fp8", tol=rel_tol("fp8-payload", torch.bfloat16), dispatcher=d,
            runner="reference", dtype=torch.bfloat16)))
        uneven = tuple([world - 1] * 3 + [r % world for r in range(5)])  # rank W-1 owns 3+ experts
        checks.append((f"uneven-placement-{d}", lambda c, d=d, p=uneven: c.compare(
            tokens_for(c, "u" + d), placement=p, dispatcher=d, runner="grouped_mm", dtype=torch.float32)))
        checks.append((f"rank-with-zero-tokens-{d}", lambda c, d=d: c.compare(
            [0 if r == 1 else 9 + r for r in range(c.world)], dispatcher=d, runner="reference", dtype=torch.float32)))
        checks.append((f"no-tokens-anywhere-{d}", lambda c, d=d: c.compare(
            [0] * c.world, dispatcher=d, runner="grouped_mm", dtype=torch.float32)))
        checks.append((f"all-to-one-rank-{d}", lambda c, d=d: c.compare(
            [7 + 3 * r for r in range(c.world)], dispatcher=d, runner="reference", quant="fp8-block", dtype=torch.float32,
            logits_fn=lambda t, e: torch.randn(t, e) + 20 * (torch.arange(e) >= e - e // c.world))))
        checks.append((f"halves-shared-experts-{d}", lambda c, d=d: check_halves(c, d)))
    for d, s in (("alltoall", "none"), ("alltoall", "fp8-block"), ("alltoall-fixed", "fp8-block")):
        # received rows named in the receive buffer; the runner gathers
        checks.append((f"{d}-rows-by-index-{s}", lambda c, d=d, s=s: c.compare(
            tokens_for(c, "ix" + s), indexed=True, dispatcher=d, runner="reference", quant=s,
            dtype=torch.bfloat16)))
    # the Triton kernel paths of the dispatchers (CUDA-only in the library) inside a real group:
    # pack, where tokens go, the receiver's sort, the masked slab (fp16: the interpreter has no bf16)
    for d, s, indexed in (("alltoall", "none", True), ("alltoall", "fp8-block", True), ("alltoall", "fp8-channel", False),
                          ("alltoall-fixed", "none", True), ("alltoall-fixed", "fp8-channel", False),
                          ("alltoall-p2p", "none", True), ("alltoall-p2p", "fp8-block", False),
                          ("lowlatency", "fp8-block", False), ("lowlatency", "none", False), ("allgather", "none", False)):
        checks.append((f"triton-kernels-{d}-{s}", lambda c, d=d, s=s, ix=indexed: compare_with_kernels(
            c, f"k{d}{s}", dispatcher=d, quant=s, indexed=ix)))
    checks.append(("deepseek-routing-shared-alltoall", lambda c: c.compare(
        tokens_for(c, "ds"), num_experts=16, top_k=4, scoring="sigmoid", num_expert_groups=4, topk_groups=2,
        use_correction_bias=True, routed_scaling_factor=2.5, num_shared_experts=1, shared_intermediate_size=64,
        dispatcher="alltoall", runner="reference", dtype=torch.float32)))
    for d, r, s in (("alltoall", "grouped_mm", "none"), ("alltoall-p2p", "reference", "fp8-block")):
        checks.append((f"converted-{d}-{s}", lambda c, d=d, r=r, s=s: check_converted(c, d, r, s)))
    rng = random.Random(world)  # the same draws on every rank
    for n in range(RANDOM_CONFIGS):
        checks.append((f"random-{n}", lambda c, f=random_config(rng, world), t=random_tokens(rng, world):
                       check_random(c, t, f)))
    checks.append(("compiled-alltoall", check_compiled))
    checks.append(("auto-picks-alltoall", check_auto))
    checks.append(("mismatch-MF501", check_mismatch))
    checks.append(("bad-placement-MF504", lambda c: c.expect("MF504", lambda: MoE(**BASE, placement=(0,) * 8))))
    for d in ("lowlatency", "alltoall-fixed", "alltoall-p2p"):
        checks.append((f"overflow-MF503-{d}", lambda c, d=d: check_overflow(c, d)))
    for d in ("alltoall", "allgather", "lowlatency", "alltoall-fixed", "alltoall-p2p"):
        checks.append((f"refused-on-one-rank-{d}", lambda c, d=d: check_refused_on_one_rank(c, d)))
    checks.append(("copies-MF508", check_copies))
    checks.append(("payload-survives-conversion", check_payload_converted))
    checks.append(("placement-written-out-agrees", lambda c: c.compare(
        tokens_for(c, "pl"), dispatcher="alltoall", runner="reference", dtype=torch.float32,
        placement=None if c.rank == 0 else expert_placement(MoEConfig(**BASE), c.world))))
    checks.append(("alltoall-p2p-repeated-dispatch", check_p2p_repeated))
    checks.append(("alltoall-p2p-unmappable-MF507", check_unmappable))
    checks.append(("alltoall-p2p-unmappable-on-one-rank-MF507", check_p2p_unmappable_on_one_rank))
    checks.append(("alltoall-p2p-second-batch-MF509", check_p2p_second_batch))
    checks.append(("alltoall-p2p-after-a-raise", check_p2p_after_a_raise))
    checks.append(("alltoall-p2p-inference-mode", check_p2p_inference_mode))
    checks.append(("with-payload-keeps-settings", check_with_payload_keeps_settings))
    checks.append(("alltoall-p2p-layers-share-buffers", check_p2p_layers_share_buffers))
    checks.append(("alltoall-p2p-shared-buffers-held-by-one-rank", check_p2p_shared_buffers_held_by_one_rank))
    # alltoall-fixed's combine in 3 pieces (C_rank = 27), and in one
    checks.append(("alltoall-fixed-combine-3-pieces", lambda c: c.compare(
        tokens_for(c, "p3"), dispatcher="alltoall-fixed", runner="reference", max_tokens_per_rank=27,
        dtype=torch.float32)))
    checks.append(("alltoall-fixed-combine-1-piece", lambda c: check_pieces(c, 1)))
    checks.append(("fp8-payload-fp8-tensor-MF506", lambda c: c.expect(
        "MF506", lambda: MoE(**BASE, quant="fp8-tensor", runner="reference").dispatcher.with_payload("fp8"))))
    checks.append(("fp8-payload-config-fp8-tensor-MF506", lambda c: c.expect(
        "MF506", lambda: MoE(**BASE, quant="fp8-tensor", runner="reference", dispatch_payload="fp8"))))
    checks += balance_checks(world)  # redundant experts, load counts, rebalance (ep_balance_checks.py)
    return checks


RANDOM_CONFIGS = 16
# what the planner may answer a random draw with (a refusal at build is the promise kept; any other error is not)
PLANNER_CODES = {"MF202", "MF203", "MF205", "MF206", "MF207", "MF208", "MF209", "MF504"}


def random_config(rng, world):
    """Layer fields of one random expert-parallel draw: dispatcher, runner, scheme, dtype, sizes (odd ones where
    the scheme allows), expert count, placement (a rank may own no expert), shared experts."""
    e = rng.choice([world, 2 * world, 5, 12])
    scheme = rng.choice(SCHEMES)
    block = scheme == "fp8-block"
    f = dict(num_experts=e, top_k=rng.randint(1, min(e, 4)), quant=scheme, dispatcher=rng.choice(DISPATCHERS),
             runner=rng.choice(["auto", "reference", "grouped_mm"]), dtype=rng.choice([torch.float32, torch.bfloat16]),
             hidden_size=rng.choice([128, 256] if block else [64, 72, 128]),
             intermediate_size=rng.choice([128, 256] if block else [16, 24, 40]),
             max_tokens_per_rank=rng.choice([8, 32]),
             placement=tuple(rng.randrange(world) for _ in range(e)) if rng.random() < 0.5 else None)
    if rng.random() < 0.3:
        f.update(num_shared_experts=1, shared_intermediate_size=16)
    return f


def random_tokens(rng, world):
    return [rng.choice([0, 1, 3, 8]) for _ in range(world)]


def check_random(c, tokens, fields):
    try:
        c.compare(tokens, **fields)
    except MoeflowError as exc:
        assert exc.code in PLANNER_CODES, f"{fields}: {exc}"


def check_halves(c, d, **fields):
    ep, x, logits, want = c.compare(tokens_for(c, "h" + d), dispatcher=d, runner="reference", dtype=torch.float32,
                                    num_shared_experts=1, shared_intermediate_size=32, **fields)
    ids, w = ep.router(logits, None)
    disp = ep.dispatcher
    pending = disp.dispatch_start(x, ids, w)
    shared = ep.shared_experts(x, "silu")  # overlapped with the transfer
    batch, handle = disp.dispatch_wait(pending)
    from moeflow.layouts import run_in_layout
    pending = disp.combine_start(run_in_layout(ep.runner, batch, ep.expert_weights()), handle)
    got = (disp.combine_wait(pending).float() + shared).to(ep.config.dtype)
    assert rel_err(got, want) <= 1e-6, rel_err(got, want)  # == on CPU; GPU index_add_ order varies


def check_pieces(c, most):
    from moeflow.dispatch import alltoall_fixed
    saved, alltoall_fixed.COMBINE_CHUNKS = alltoall_fixed.COMBINE_CHUNKS, most
    try:
        ep = c.compare(tokens_for(c, f"pieces{most}"), dispatcher="alltoall-fixed", runner="reference",
                       dtype=torch.float32)[0]
        assert ep.dispatcher.combine_chunks == most
    finally:
        alltoall_fixed.COMBINE_CHUNKS = saved


def check_converted(c, d, r, s):
    """ep.float() then ep.bfloat16() on every rank: the layer is planned again in its group each time (a new
    dispatcher, the same experts; FP8 weights stay FP8, bf16 ones round-trip exactly), and computes in float32, then
    the bits it computed before. (bf16 against float32 is no check of an FP8 layer: rounding x to bf16 before its
    FP8 quantization moves some values a whole FP8 step, ~3e-2 in one process.)"""
    ep, x, logits, want = c.compare(tokens_for(c, "conv" + d), dispatcher=d, runner=r, quant=s, dtype=torch.bfloat16)
    experts, dispatcher, w13 = ep.local_experts, ep.dispatcher, ep.gate_up_proj.dtype
    ep.float()
    assert ep.dispatcher is not dispatcher and ep.plan.dispatcher == d and ep.local_experts == experts, ep.plan
    assert ep.gate_up_proj.dtype == (w13 if s != "none" else torch.float32)
    assert ep(x.float(), logits).dtype == torch.float32
    ep.bfloat16()
    assert ep.gate_up_proj.dtype == w13 and ep.config.dtype == torch.bfloat16
    assert torch.equal(ep(x, logits), want)


def check_compiled(c):
    """torch.compile through an expert-parallel layer (moeflow.ops): the layer is one op of the rank's graph (the
    form tagged cudagraph_unsafe: the dispatch synchronizes the host), and each rank gets its eager bits."""
    ep, x, logits, want = c.compare(tokens_for(c, "compiled"), dispatcher="alltoall", runner="grouped_mm",
                                    dtype=torch.float32)
    assert not ep.plan.graph_safe
    got = torch.compile(ep, backend="aot_eager", fullgraph=True)(x, logits)
    assert torch.equal(got, want)


def check_auto(c):
    ep = c.compare(tokens_for(c, "auto"), dtype=torch.float32)[0]
    assert ep.plan.dispatcher == "alltoall" and len(ep.local_experts) < BASE["num_experts"], ep.plan


def check_mismatch(c):
    exc = c.expect("MF501", lambda: MoE(**{**BASE, "top_k": 2 + (c.rank == 1)}, dispatcher="alltoall"))
    assert "top_k" in str(exc), str(exc)


def check_unmappable(c):
    """alltoall-p2p whose buffers cannot be mapped (here: creating the shared file fails on every rank)
    is refused at construction with MF507, naming the dispatchers that work without peer memory."""
    original = torch.from_file

    def refuse(*args, **kwargs):
        raise OSError("no shared memory here")

    torch.from_file = refuse
    try:
        exc = c.expect("MF507", lambda: MoE(**BASE, dispatcher="alltoall-p2p", runner="reference"))
    finally:
        torch.from_file = original
    assert "alltoall-fixed" in str(exc) and "no shared memory here" in str(exc), str(exc)


def check_overflow(c, d):
    """A rank given more than max_tokens_per_rank tokens raises MF503 (dispatchers with fixed buffers)."""
    cap = BASE["max_tokens_per_rank"]
    tokens = [cap + 5 if r == 0 else 6 for r in range(c.world)]
    if c.rank == 0:
        exc = c.expect("MF503", lambda: c.compare(tokens, dispatcher=d, runner="reference", dtype=torch.float32))
        assert f"{cap + 5} token" in str(exc) and d in str(exc), str(exc)
    else:  # the other ranks finish, with correct outputs
        c.compare(tokens, dispatcher=d, runner="reference", dtype=torch.float32)
    torch.manual_seed(1234)  # the group is still usable: one more forward on every rank
    c.compare(tokens_for(c, "after" + d), dispatcher=d, runner="reference", dtype=torch.float32)


def check_refused_on_one_rank(c, d):
    """Rank 0's call of layer A is refused (MF305 from forward_topk's duplicate id, MF301 from forward's misshaped
    logits) while the other ranks call A rightly; every rank then calls layer B. The refused call still takes its
    part in A's collectives, so the other ranks' A and every rank's B equal the one-process layers (before, the other
    ranks' A silently paired with rank 0's B)."""
    cfg = MoEConfig(**BASE, dispatcher=d, runner="reference", dtype=torch.float32)
    e, h, i, k = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k
    layers = []
    for _ in range(2):
        state = {"gate_up_proj": torch.randn(e, 2 * i, h) / h ** 0.5, "down_proj": torch.randn(e, h, i) / i ** 0.5}
        ep, one = MoE(cfg), MoE(cfg.replace(dispatcher="auto"), process_group=c.solo[c.rank])
        for layer in (ep, one):
            layer.load_weights(state)
        layers.append((ep, one))
    (a, a1), (b, b1) = layers
    x, logits = torch.randn(5, h), torch.randn(5, e)
    ids, w = torch.stack([torch.randperm(e)[:k] for _ in range(5)]), torch.rand(5, k)
    tol = rel_tol("none", torch.float32)
    for refused, call, call_one in (
            ("MF305", lambda: a.forward_topk(x, torch.zeros_like(ids), w), lambda: a1.forward_topk(x, ids, w)),
            ("MF301", lambda: a(x, logits[:, :-1]), lambda: a1(x, logits))):
        if c.rank == 0:
            c.expect(refused, call)
        else:
            want = call_one()
            got = a.forward_topk(x, ids, w) if refused == "MF305" else a(x, logits)
            assert rel_err(got, want) <= tol, (refused, rel_err(got, want))
        assert rel_err(b(x, logits), b1(x, logits)) <= tol, refused


def check_copies(c):
    """copy.deepcopy / pickle of a layer with a process group: an expert-parallel one is MF508 (it was torch's
    TypeError from inside copy.py); a group of one's layer is copied, sharing the group, and runs the same."""
    import copy
    import pickle
    ep = MoE(**BASE, dispatcher="alltoall", runner="reference", dtype=torch.float32)
    for how, fn in (("copying", copy.deepcopy), ("pickling", pickle.dumps)):
        exc = c.expect("MF508", lambda fn=fn: fn(ep))
        assert how in str(exc) and "alltoall" in str(exc), str(exc)
    one = MoE(**BASE, runner="reference", dtype=torch.float32, process_group=c.solo[c.rank])
    twin = copy.deepcopy(one)
    assert twin.dispatcher.process_group is one.dispatcher.process_group
    assert twin.gate_up_proj.data_ptr() != one.gate_up_proj.data_ptr()
    x, logits = torch.randn(5, BASE["hidden_size"]), torch.randn(5, BASE["num_experts"])
    assert torch.equal(twin(x, logits), one(x, logits))
    c.expect("MF508", lambda: pickle.dumps(one))


def check_payload_converted(c):
    """A payload chosen with dispatcher.with_payload("fp8") survives .to(dtype), which builds the dispatcher again
    (it was silently back to "auto": bf16 tokens travelling)."""
    layer = MoE(**BASE, dispatcher="alltoall", runner="reference", dtype=torch.float32)
    layer.dispatcher = layer.dispatcher.with_payload("fp8")
    layer.bfloat16()
    assert layer.dispatcher.payload == "fp8" and layer.config.dispatch_payload == "fp8", layer.dispatcher.payload
    assert layer.config.dtype == torch.bfloat16


def check_p2p_repeated(c):
    """alltoall-p2p reuses its mapped buffers: three forwards of one layer, each batch smaller or larger
    than the last (stale rows of the previous call must be blanked), each equal to the one-process layer."""
    ep, one = _p2p_pair(c)
    h, e = ep.config.hidden_size, ep.config.num_experts
    for n in (20, 3, 28):
        x, logits, mine = _mine(c, [n + r for r in range(c.world)], h, e)
        err = rel_err(ep(x[mine], logits[mine]), one(x, logits)[mine])
        assert err <= rel_tol("none", torch.float32), (n, err)


def _p2p_pair(c, **fields):
    """(alltoall-p2p layer, the one-process layer) with the same random weights."""
    cfg = MoEConfig(**{**BASE, "dispatcher": "alltoall-p2p", "runner": "reference", "dtype": torch.float32, **fields})
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    state = {"gate_up_proj": torch.randn(e, 2 * i, h) / h ** 0.5, "down_proj": torch.randn(e, h, i) / i ** 0.5}
    ep, one = MoE(cfg), MoE(cfg.replace(dispatcher="auto", placement=None), process_group=c.solo[c.rank])
    for layer in (ep, one):
        layer.load_weights(state)
    return ep, one


def _mine(c, tokens, h, e):
    """(x, logits) of all ranks' tokens, and this rank's slice."""
    x, logits = torch.randn(sum(tokens), h), torch.randn(sum(tokens), e)
    lo = sum(tokens[:c.rank])
    return x, logits, slice(lo, lo + tokens[c.rank])


def check_p2p_second_batch(c):
    """alltoall-p2p holds one batch at a time. Batch A dispatched, then B: A's rows are B's now, and A is MF509 at
    its dispatch_wait (it was silently computed from B's rows); B finishes right. A's combine started, then B's: A
    is MF509 at its combine_wait. A dispatch repeated without its combine (benchmarks) is no error, and the layer's
    next call is right."""
    from moeflow.layouts import run_in_layout
    ep, one = _p2p_pair(c)
    h, e = ep.config.hidden_size, ep.config.num_experts
    disp, tol = ep.dispatcher, rel_tol("none", torch.float32)

    def batch(n):
        x, logits, mine = _mine(c, [n + r for r in range(c.world)], h, e)
        ids, w = ep.router(logits[mine], None)
        return x[mine], ids, w, one(x, logits)[mine]

    def experts(pending):
        got, handle = disp.dispatch_wait(pending)
        return run_in_layout(ep.runner, got, ep.expert_weights()), handle

    (xa, ia, wa, want_a), (xb, ib, wb, want_b) = batch(9), batch(4)
    pending_a = disp.dispatch_start(xa, ia, wa)
    pending_b = disp.dispatch_start(xb, ib, wb)
    exc = c.expect("MF509", lambda: disp.dispatch_wait(pending_a))
    assert "alltoall-fixed" in str(exc) and "rows" in str(exc), str(exc)
    out_b, handle_b = experts(pending_b)
    assert rel_err(disp.combine_wait(disp.combine_start(out_b, handle_b)), want_b) <= tol
    out_a, handle_a = experts(disp.dispatch_start(xa, ia, wa))
    combine_a = disp.combine_start(out_a, handle_a)
    out_b, handle_b = experts(disp.dispatch_start(xb, ib, wb))  # B's dispatch after A's combine started: allowed
    combine_b = disp.combine_start(out_b, handle_b)
    c.expect("MF509", lambda: disp.combine_wait(combine_a))
    assert rel_err(disp.combine_wait(combine_b), want_b) <= tol
    for _ in range(3):  # dispatched and dropped
        disp.dispatch(xa, ia, wa)
    out_a, handle_a = experts(disp.dispatch_start(xa, ia, wa))  # A alone: right
    assert rel_err(disp.combine_wait(disp.combine_start(out_a, handle_a)), want_a) <= tol
    x, logits, mine = _mine(c, [4 + 2 * r for r in range(c.world)], h, e)
    assert rel_err(ep(x[mine], logits[mine]), one(x, logits)[mine]) <= tol


def check_p2p_after_a_raise(c):
    """A forward whose experts raise between dispatch and combine, or whose dispatch_start raises after its first
    barrier (on every rank), leaves nothing behind: the next call runs, right."""
    ep, one = _p2p_pair(c)
    h, e = ep.config.hidden_size, ep.config.num_experts
    x, logits, mine = _mine(c, [7 + r for r in range(c.world)], h, e)

    def fail(*args, **kwargs):
        raise RuntimeError("planted")
    for owner, attr in ((ep.runner, "run"), (ep.dispatcher, "_send_rows")):
        setattr(owner, attr, fail)  # an instance attribute over the method
        try:
            ep(x[mine], logits[mine])
            raise AssertionError(f"the planted error in {attr} was not raised")
        except RuntimeError as exc:
            assert "planted" in str(exc), exc
        delattr(owner, attr)
        assert rel_err(ep(x[mine], logits[mine]), one(x, logits)[mine]) <= rel_tol("none", torch.float32), attr


def check_p2p_inference_mode(c):
    """alltoall-p2p built under torch.inference_mode and called outside it (no_grad), and the reverse: its mapped
    buffers, written in place at every call, were inference tensors, which raised outside that mode."""
    with torch.inference_mode():
        ep, one = _p2p_pair(c)
    h, e = ep.config.hidden_size, ep.config.num_experts
    for mode in (torch.no_grad, torch.inference_mode):
        x, logits, mine = _mine(c, [5 + r for r in range(c.world)], h, e)
        with mode():
            assert rel_err(ep(x[mine], logits[mine]), one(x, logits)[mine]) <= rel_tol("none", torch.float32), mode


def check_p2p_unmappable_on_one_rank(c):
    """Creating the shared files fails on the last rank only: every rank raises MF507 at once (the others name that
    rank), where the others waited in torch's all_gather_object for the group's timeout and then raised MF505."""
    original = torch.from_file

    def refuse(*args, **kwargs):
        raise OSError("no shared memory on this rank")

    if c.rank == c.world - 1:
        torch.from_file = refuse
    start = time.monotonic()
    try:
        exc = c.expect("MF507", lambda: MoE(**BASE, dispatcher="alltoall-p2p", runner="reference"))
    finally:
        torch.from_file = original
    assert time.monotonic() - start < 20, time.monotonic() - start
    want = "no shared memory on this rank" if c.rank == c.world - 1 else f"failed on rank {c.world - 1}"
    assert want in str(exc) and "alltoall-fixed" in str(exc), str(exc)
    c.compare(tokens_for(c, "after-unmappable"), dispatcher="alltoall-p2p", runner="reference", dtype=torch.float32)


def check_p2p_layers_share_buffers(c):
    """Layers of one group, device and sizes share alltoall-p2p's buffers (one set for a model, not one a layer):
    calls interleaved between two layers are right; another size maps its own; a batch of one layer dispatched
    while another layer's is in flight makes that one MF509, and finishes right itself."""
    from moeflow.layouts import run_in_layout
    (a, a1), (b, b1) = _p2p_pair(c, hidden_size=192), _p2p_pair(c, hidden_size=192)
    other, other1 = _p2p_pair(c, hidden_size=128)
    assert a.dispatcher.peers is b.dispatcher.peers and other.dispatcher.peers is not a.dispatcher.peers
    for layer, twin in ((a, a1), (b, b1), (a, a1), (other, other1)):
        x, logits, mine = _mine(c, [6 + r for r in range(c.world)], layer.config.hidden_size, layer.config.num_experts)
        assert rel_err(layer(x[mine], logits[mine]), twin(x, logits)[mine]) <= rel_tol("none", torch.float32)
    x, logits, mine = _mine(c, [5 + r for r in range(c.world)], 192, a.config.num_experts)
    ids, w = a.router(logits[mine], None)
    pending_a = a.dispatcher.dispatch_start(x[mine], ids, w)
    pending_b = b.dispatcher.dispatch_start(x[mine], ids, w)
    c.expect("MF509", lambda: a.dispatcher.dispatch_wait(pending_a))
    batch, handle = b.dispatcher.dispatch_wait(pending_b)
    got = b.dispatcher.combine_wait(b.dispatcher.combine_start(run_in_layout(b.runner, batch, b.expert_weights()),
                                                               handle))
    assert rel_err(got, b1(x, logits)[mine]) <= rel_tol("none", torch.float32)


def check_p2p_shared_buffers_held_by_one_rank(c):
    """Rank 0 still holds an old layer's buffers, the others freed theirs: the next layer of those sizes maps new
    ones on every rank (the ranks agree first), where rank 0 alone reusing them would have split the group."""
    import gc
    old, _ = _p2p_pair(c, hidden_size=160)
    kept = old.dispatcher.peers if c.rank == 0 else None
    del old
    gc.collect()
    new, one = _p2p_pair(c, hidden_size=160)
    assert new.dispatcher.peers is not kept
    x, logits, mine = _mine(c, [6 + r for r in range(c.world)], 160, new.config.num_experts)
    assert rel_err(new(x[mine], logits[mine]), one(x, logits)[mine]) <= rel_tol("none", torch.float32)


def check_with_payload_keeps_settings(c):
    """with_payload builds the dispatcher again and keeps what was set after construction: rows by index (as the
    plan chose for the runner) and the combine's pieces; they were reset to the class defaults."""
    layer = MoE(**BASE, dispatcher="alltoall-fixed", runner="reference", dtype=torch.float32)
    layer.dispatcher.indexed_rows, layer.dispatcher.combine_chunks = True, 3
    new = layer.dispatcher.with_payload("fp8")
    assert (new.payload, new.indexed_rows, new.combine_chunks) == ("fp8", True, 3), vars(new)


def check_timeout(c):
    """Last check (W=2): rank W-1 never builds the layer but stays alive; the others get MF502."""
    os.environ["MOEFLOW_DIST_TIMEOUT_S"] = "2"
    if c.rank != c.world - 1:
        exc = c.expect("MF502", lambda: MoE(**BASE, dispatcher="alltoall"))
        assert "configuration check" in str(exc) and "2.0s" in str(exc), str(exc)
    else:
        time.sleep(5)


def check_peer_exit(c):
    """Last check (W=4): rank W-1 exits instead of building the layer; the others get MF505."""
    if c.rank == c.world - 1:
        os._exit(0)
    exc = c.expect("MF505", lambda: MoE(**BASE, dispatcher="alltoall"))
    assert "configuration check" in str(exc), str(exc)


LAST = {2: ("timeout-MF502", check_timeout), 4: ("peer-exit-MF505", check_peer_exit)}


def main():
    name, rank, world, init, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    ctx, results = Ctx(rank, world), {}
    checks = suite(world) + ([LAST[world]] if world in LAST else [])
    for check, fn in checks:
        torch.manual_seed(zlib.crc32(f"{name}-{check}".encode()))
        try:
            fn(ctx)
            results[check] = "ok"
        except Exception as exc:  # report, keep going: the other ranks expect this rank's collectives
            results[check] = f"FAIL: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    os._exit(0)  # skip teardown: the timeout check leaves a collective pending on purpose


if __name__ == "__main__":
    main()
