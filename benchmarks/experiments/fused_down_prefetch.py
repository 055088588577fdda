"""Does the one-launch layer (kernels/fused_layer.py) gain if each down item asks the L2 for its weight tiles
before it waits for the gate_up items, so that the down phase's weights stream during the gate_up phase? One H200.

At T=1 the down items of a Qwen3 launch wait 13 µs (fp8-block) for the gate_up phase and then stream their
weights from HBM in 6-10 µs (benchmarks/results/fused_prefetch_2026-12-01_h200.md); the earlier prefetch
experiment (8655c3d) also prefetched every gate_up item's own range, which delays that item's first tiles, so the
down-only prefetch was never measured alone. Variants (each from a patched copy of the source, with
fused_trace.py's trace patches; none changes the arithmetic, so each output must equal the shipped bits):

    shipped        the kernel as it is
    lines          before waiting, each 128-byte line of the item's first PF_STEPS weight tiles: prefetch.global.L2
    lines_last     the same with the L2::evict_last hint (kept over the gate_up stream's lines)
    bulk           one cp.async.bulk.prefetch.L2 a weight row (the item's first PF_STEPS tiles)

each at the table's FusedConfig and at overrides that make the down items few enough to start in the first
wave beside the gate_up items (block_n2=128, or split2 halved) or the gate_up items more (split1 doubled).

    PYTHONPATH=$PWD OUT=DIR python benchmarks/experiments/fused_down_prefetch.py [preset:scheme:T ...]

Timed as the whole layer (route -> one launch) from a CUDA graph: do_bench (L2 zeroed before each replay, PERF.md's
method) twice, by turns over the variants, and after a clean read of 1 GiB once; one traced launch per variant.
Writes fused_down_prefetch.json under OUT; prints a table last.
"""
import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fused_trace import routed_case, routed_layer, summary, traced_launch, traced_module  # noqa: E402

CASES = ["qwen3-30b-a3b:fp8-block:1", "qwen3-30b-a3b:none:1", "deepseek-v3:fp8-block:1", "mixtral-8x7b:fp8-block:1",
         "qwen3-30b-a3b:fp8-block:4", "qwen3-30b-a3b:none:4"]
PF_STEPS = int(os.environ.get("PF_STEPS", "8"))

HELPERS = '''
@triton.jit
def _pf_tile(ptrs, nbytes, MODE: tl.constexpr):
    """Ask the L2 for nbytes [R] bytes at each of ptrs [R] (one weight row's part of a tile): MODE 1 a
    prefetch.global.L2 per 128-byte line (at most 2 a row), 2 the same with L2::evict_last, 3 one bulk prefetch
    a row (cp.async.bulk.prefetch.L2; start and size rounded down to 16 bytes). Nothing is loaded."""
    addr = ptrs.to(tl.pointer_type(tl.int8)).to(tl.int64, bitcast=True)
    if MODE == 3:
        lo = addr & -16
        size = ((addr + nbytes) - lo) & -16
        done = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [lo, size.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        off = tl.arange(0, 2) * 128
        line = addr[:, None] + off[None, :]
        on = (off[None, :] < nbytes[:, None]).to(tl.int32)
        if MODE == 2:
            done = tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
                "=r,l,r", [line, on], dtype=tl.int32, is_pure=False, pack=1)
        else:
            done = tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                "=r,l,r", [line, on], dtype=tl.int32, is_pure=False, pack=1)
    return done

'''
WAIT = "    for k in range(k_lo, tl.maximum(k_hi // steps + 1, k_lo)):  # the copies this split reads: each one's gate_up done\n"


def prefetch_patches(mode: int) -> list:
    """(old, new) pairs that give the down items MODE's prefetch of their first PF_STEPS weight tiles."""
    pf = (f"    elem_b = w2p.dtype.element_ty.primitive_bitwidth // 8\n"
          f"    for st_p in range(s * per, tl.minimum(tl.minimum((s + 1) * per, last_p + 1), s * per + {PF_STEPS})):\n"
          f"        e_p = tl.sum(tl.where(kk == st_p // steps, ids, 0), axis=0)\n"
          f"        k0_p = (st_p % steps) * BLOCK_K2\n"
          f"        nb = (tl.minimum(k0_p + BLOCK_K2, I) - k0_p) * elem_b\n"
          f"        _pf_tile(w2p + e_p.to(tl.int64) * stride_w2e + n_rows.to(tl.int64) * stride_w2n + k0_p,\n"
          f"                 tl.full((BLOCK_N2,), 0, tl.int32) + nb, {mode})\n")
    return [
        ("@triton.jit\ndef _x_step", HELPERS + "@triton.jit\ndef _x_step"),
        ("def _down_item(d, ids_ptr, rw_ptr, w2, w2s_ptr,", "def _down_item(d, ids_ptr, rw_ptr, w2, w2p, w2s_ptr,"),
        ("_down_item(item - items1, ids_ptr, rw_ptr, w2, w2s_ptr,",
         "_down_item(item - items1, ids_ptr, rw_ptr, w2, w2p, w2s_ptr,"),
        ("w13s_ptr, w2, w2s_ptr, inter_ptr, part1_ptr", "w13s_ptr, w2, w2s_ptr, w2p, inter_ptr, part1_ptr"),
        ("w2_arg, s2, inter,", "w2_arg, s2, w2, inter,"),
        (WAIT, "    last_p = TOP_K * steps - 1\n" + pf + WAIT),
    ]


VARIANTS = {"shipped": [], "lines": prefetch_patches(1), "lines_last": prefetch_patches(2),
            "bulk": prefetch_patches(3)}


def overrides(cfg) -> dict:
    """Config name -> FusedConfig: the table's; down items fewer (block_n2 128, or split2 halved); gate_up items
    more (split1 doubled), alone and with block_n2 128."""
    out = {"table": cfg}
    if cfg.block_n2 < 128:
        out["bn2=128"] = replace(cfg, block_n2=128)
    if cfg.split2 > 1:
        out[f"split2={cfg.split2 // 2}"] = replace(cfg, split2=cfg.split2 // 2)
    out[f"split1={2 * cfg.split1}"] = replace(cfg, split1=2 * cfg.split1)
    if cfg.block_n2 < 128:
        out[f"split1={2 * cfg.split1},bn2=128"] = replace(cfg, split1=2 * cfg.split1, block_n2=128)
    return out


def main():
    from moeflow.benchmark import clean_graph_us, graph_us
    mods = {name: traced_module(p, f"dpf{i}") for i, (name, p) in enumerate(VARIANTS.items())}
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    rows, text = [], [f"PF_STEPS={PF_STEPS}"]
    for spec in sys.argv[1:] or CASES:
        preset, scheme, t = spec.split(":")
        case, runner, x, logits, ids, w, table = routed_case(preset, scheme, int(t))
        text.append(f"== {spec} table {table}")
        layers = {}
        refs = {cname: runner.run_fused(x, ids, w, case.weights, cfg) for cname, cfg in overrides(table).items()}
        for cname, cfg in overrides(table).items():
            for name, mod in mods.items():
                got, tr, items1 = traced_launch(mod, runner, case, x, ids, w, cfg, flush)
                layer = routed_layer(mod, case, x, logits, ids.shape[1], cfg, tr.shape[0])
                same = torch.equal(got, refs[cname])
                layers[(cname, name)] = (layer, same, summary(tr, items1))
        us = {key: [] for key in layers}
        for _ in range(2):  # by turns, so drift spreads over the variants
            for key, (layer, _s, _t) in layers.items():
                us[key].append(graph_us(layer))
        for key, (layer, same, summ) in layers.items():
            clean = clean_graph_us(layer)
            rows.append(dict(case=spec, config=key[0], variant=key[1], us=min(us[key]), rounds=us[key],
                             clean_us=clean, equal_to_shipped=same, summary=summ))
            text.append(f"  {key[0]:10} {key[1]:11} do_bench {min(us[key]):7.1f} ({us[key][0]:.1f} {us[key][1]:.1f})"
                        f"  clean {clean:7.1f}  equal {same}")
            text += ["      " + s for s in summ[1:]]
        del runner, case, layers
        torch.cuda.empty_cache()
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "fused_down_prefetch.json"), "w"), indent=1)
    print("\n".join(text))


if __name__ == "__main__":
    main()
