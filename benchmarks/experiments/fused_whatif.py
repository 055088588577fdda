"""What bounds the one-launch layer at T=1 (kernels/fused_layer.py): the kernel with one thing left out or changed,
each from a patched copy of its source (fused_trace.py's trace patches plus the variant's), timed as the whole
layer (route -> one launch, graph, L2 flushed) and traced once (per-phase timeline). One H200.

    PYTHONPATH=$PWD OUT=DIR python benchmarks/experiments/fused_whatif.py [preset:scheme:T ...]

Variants marked "wrong" compute wrong outputs on purpose (they only bound what a change could gain); the others
must give the shipped bits. Writes fused_whatif.json under OUT; prints a table last.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fused_trace import routed_case, routed_layer, summary, traced_launch, traced_module  # noqa: E402

CASES = ["qwen3-30b-a3b:none:1", "qwen3-30b-a3b:fp8-block:1", "deepseek-v3:fp8-block:1"]
X_LOAD = "    vals = tl.load(x_row + rk, mask=rk < H, other=0.0)\n"
INTER_LOAD = ("    vals = tl.load(inter_ptr + (t * TOP_K + k).to(tl.int64) * I + rk, mask=rk < I, other=0.0, "
              "cache_modifier=\".cg\")\n")
SPIN = "        while ready < tiles1:\n"
SLEEP = ("        while ready < tiles1:\n            tl.inline_asm_elementwise(\"nanosleep.u32 256; mov.u32 $0, 0;\", "
         "\"=r,r\", [ready], dtype=tl.int32, is_pure=False, pack=1)\n")
VARIANTS = {  # name -> (patches, whether the output must equal the shipped kernel's)
    "shipped": ([], True),
    "pdl early start": ([("early_start=False))", "early_start=True))")], True),
    "spin with nanosleep": ([(SPIN, SLEEP)], True),
    "x not loaded (wrong)": ([(X_LOAD, "    vals = tl.full((BLOCK_K,), 0.01, x_row.dtype.element_ty)\n")], False),
    "inter not loaded (wrong)": ([(INTER_LOAD, "    vals = tl.full((BLOCK_K,), 0.01, inter_ptr.dtype.element_ty)\n")],
                                 False),
    "down waits for nothing (wrong)": ([(SPIN, "        while ready < 0:\n")], False),
    "none of the three (wrong)": ([(X_LOAD, "    vals = tl.full((BLOCK_K,), 0.01, x_row.dtype.element_ty)\n"),
                                   (INTER_LOAD, "    vals = tl.full((BLOCK_K,), 0.01, inter_ptr.dtype.element_ty)\n"),
                                   (SPIN, "        while ready < 0:\n")], False),
}


def main():
    from bench_layer import graph_us
    mods = {name: traced_module(p, f"whatif{i}") for i, (name, (p, _)) in enumerate(VARIANTS.items())}
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    rows, text = [], []
    for spec in sys.argv[1:] or CASES:
        preset, scheme, t = spec.split(":")
        case, runner, x, logits, ids, w, cfg = routed_case(preset, scheme, int(t))
        ref = runner.run_fused(x, ids, w, case.weights, cfg)
        text.append(f"== {spec} {cfg}")
        for name, mod in mods.items():
            got, tr, items1 = traced_launch(mod, runner, case, x, ids, w, cfg, flush)
            layer = routed_layer(mod, case, x, logits, ids.shape[1], cfg, tr.shape[0])
            us = [graph_us(layer) for _ in range(2)]
            same = torch.equal(got, ref)
            rows.append(dict(case=spec, variant=name, us=min(us), rounds=us, equal_to_shipped=same,
                             must_equal=VARIANTS[name][1], summary=summary(tr, items1)))
            text.append(f"  {name:32} {min(us):7.1f} us  equal {same}")
            text += ["    " + s for s in summary(tr, items1)]
        del runner, case
        torch.cuda.empty_cache()
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "fused_whatif.json"), "w"), indent=1)
    print("\n".join(text))


if __name__ == "__main__":
    main()
