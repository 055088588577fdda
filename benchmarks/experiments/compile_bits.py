"""Experiment (GPU): where does torch.compile's default mode part from the eager layer's bits?

Why: on an H200 at 51f3d1d (2026-12-05) tests/gpu/test_gpu_compile.py::test_compiled_stack_gives_the_eager_bits
[fp8-block-default] failed at T=100 (T=1, 3 and 16 equal), where the same test had passed at 617a4ac. The suite seeds
each test from its id; the ninth session's per-expert draw in MoE.reset_parameters changed how much of the CUDA
generator a layer's build takes, so the test's inputs changed with it. Either the moeflow op gives other bits inside
a compiled graph (an unwritten element, an input layout it mishandles), or inductor's code around it (the gate
matmuls, the residual adds, the second gate's softmax and top-k) gives other bits than eager's kernels.

Each case builds the test's two-layer stack (tests/gpu/test_gpu_compile.py: Stack) with the test's seed, then for
each T compares the compiled stack's output with the eager one; where they differ it compares the parts:
  h         x + a(x, gate_a(x))              compiled part vs eager
  route     softmax(gate_b(h)).topk(4)       compiled part vs eager (ids exactly, weights bitwise; ties counted)
  b         b.forward_topk(h, ids, w)        the op called eagerly twice (determinism) and under compile
    PYTHONPATH=$PWD:$PWD/tests python benchmarks/experiments/compile_bits.py [SEEDS=0,1,2]
Prints one line a (seed, T) and a last line per part: cases where it differed.

Answer (H100, 402a5c5, gpu_session_2026-12-05_h200_h100_51f3d1d.md): at the test's seed, T=100, one output row differed; the
first layer and the op agreed bit for bit (called eagerly twice and under compile), and inductor's softmax gave one
routing weight one ulp (1.49e-8) off eager's, ids equal. Three other seeds: no difference at any T. The test now
checks the compiled weights against eager's softmax within two ulps and compares everything moeflow computes on
the compiled routing (tests/gpu/test_gpu_compile.py, run_compiled).
"""
import os
import sys
import zlib

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "gpu"))

from conftest import random_state  # noqa: E402
from moeflow import MoE  # noqa: E402
from test_gpu_compile import SHAPE, Stack  # noqa: E402

NODE = "tests/gpu/test_gpu_compile.py::test_compiled_stack_gives_the_eager_bits[fp8-block-default]"


def make_layer(**fields):
    layer = MoE(**fields)
    layer.load_weights(random_state(layer.config))
    return layer


def main():
    seeds = [None] + [int(s) for s in os.environ.get("SEEDS", "1,2,3").split(",") if s]
    differed = {"stack": 0, "h": 0, "route": 0, "route_ties": 0, "b_eager_twice": 0, "b_compiled": 0}
    for seed in seeds:
        torch.manual_seed(zlib.crc32(NODE.encode()) if seed is None else seed)
        model = Stack(make_layer(**SHAPE, quant="fp8-block", runner="triton"),
                      make_layer(**SHAPE, quant="fp8-block", runner="triton")).requires_grad_(False).eval()
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        part_h = torch.compile(lambda x: x + model.a(x, model.gate_a(x)), fullgraph=True)
        part_route = torch.compile(lambda h: torch.softmax(model.gate_b(h).float(), dim=-1).topk(4, dim=-1),
                                   fullgraph=True)
        part_b = torch.compile(lambda h, ids, w: model.b.forward_topk(h, ids, w), fullgraph=True)
        with torch.inference_mode():
            for t in (1, 3, 16, 100, 16):
                x = torch.randn(t, 256, device="cuda", dtype=torch.bfloat16)
                y, ref = compiled(x)[0].clone(), model(x)[0]  # Stack -> (output, ids, weights)
                same = torch.equal(y, ref)
                line = f"seed {seed} T={t}: stack {'same' if same else 'DIFFERS'}"
                if not same:
                    differed["stack"] += 1
                    h = x + model.a(x, model.gate_a(x))
                    hc = part_h(x)
                    logits = model.gate_b(h).float()
                    w, ids = torch.softmax(logits, dim=-1).topk(4, dim=-1)
                    wc, idsc = part_route(h)
                    probs = torch.softmax(logits, dim=-1)
                    top5 = probs.topk(5, dim=-1).values
                    ties = int(((top5[:, 1:] == top5[:, :-1]).any(dim=1)).sum())
                    b1, b2 = model.b.forward_topk(h, ids, w), model.b.forward_topk(h, ids, w)
                    bc = part_b(h, ids, w)
                    d_h = not torch.equal(h, hc)
                    d_route = not (torch.equal(ids, idsc) and torch.equal(w, wc))
                    differed["h"] += d_h
                    differed["route"] += d_route
                    differed["route_ties"] += ties > 0
                    differed["b_eager_twice"] += not torch.equal(b1, b2)
                    differed["b_compiled"] += not torch.equal(b1, bc)
                    rows = (y != ref).any(dim=1).nonzero().flatten().tolist()
                    line += (f"; rows {rows[:8]} ({len(rows)}); h {'DIFFERS' if d_h else 'same'}; route "
                             f"{'DIFFERS' if d_route else 'same'} (tokens with a tie in the top 5: {ties}; ids "
                             f"{'equal' if torch.equal(ids, idsc) else 'differ'}; max |w - wc| "
                             f"{(w - wc).abs().max().item():.3g}); b eager twice "
                             f"{'same' if torch.equal(b1, b2) else 'DIFFERS'}, compiled "
                             f"{'same' if torch.equal(b1, bc) else 'DIFFERS'}")
                print(line, flush=True)
    print("cases that differed, by part:", differed)


if __name__ == "__main__":
    main()
