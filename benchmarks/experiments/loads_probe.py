"""Experiment (GPU): how fast can an SM draw operand boxes by TMA, by box shape, ring depth and operand size?

Why: multicast_probe.py (benchmarks/results/multicast_2026-12-05_h200.md) showed that the L2 does not bound the
warp-specialized GEMMs' loads, and that its "own" form delivered very different rates by tile at about equal bytes in
flight: 17.5 TB/s for fp8 64 x 256 x 128 B at 4 stages, 12.3 for bf16 128 x 128 x 128 B at 5. That probe timed
each launch after an L2 flush, so its rates mix the operands' first read from HBM (32 MB, 7+ µs of 55-90) and the
flush's write-back with the steady rate. This one asks the next question with those removed.

The kernel is multicast_probe's, without clusters: a persistent warp-specialized loop whose loader streams each
tile's K steps (an A box [BM, BK] and a B box [BN, BK], BK in bytes) into a ring of STAGES slots and whose consumer
warpgroup waits for each slot and releases it, with no math. Form "own": CTA pairs take row tiles 2i and 2i + 1 of
one column tile, and consecutive pairs the next row tiles; own-split, own-cols and own-g<G> (FORMED below) change
how the A box is copied or the tile order. Before timing, eight CTAs' final rings are compared with the operand
boxes (multicast_probe.check).

Timing: a CUDA graph of one launch and one of REPS launches back to back (moeflow.benchmark.graph_us, which flushes
the L2 before each replay). "steady" = (t[REPS] - t[1]) / (REPS - 1): a launch whose operands the launch before
left in the L2, without the flush's write-back; "cold" = t[1].

    PYTHONPATH=$PWD [ONLY=own-split] python benchmarks/experiments/loads_probe.py OUT_DIR    # GPU; a table last
Writes OUT_DIR/loads_probe.json.
Reading it: the steady rate by (BM, BN, BK, STAGES) is the ceiling the tables' tiles can draw operands at, loads
alone. If it depends on the box rows rather than on the bytes in flight, the tiles' shapes, not their depth,
are what to change; if the 8 MB operands run no faster than the 32 MB ones, the L2's capacity is not the limit.
"""
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import multicast_probe as mp  # noqa: E402

REPS = 6
L2_32MB = (4096, 4096, 4096)  # A [M, K bytes] and B [N, K bytes]: 16 + 16 MB, as multicast_probe
L2_8MB = (4096, 4096, 1024)  # 4 + 4 MB, the same tiles over a quarter of the K steps
HBM_B = (4096, 32768, 4096)  # B 128 MB: each column tile of B comes from HBM once, then from the L2

# (name, 1 (bytes), BM, BN, BK bytes, STAGES): the ring holds STAGES * (BM + BN) * BK bytes
SHAPES = [(f"{bm}x{bn}x{bk}B s{s}", 1, bm, bn, bk, s) for bm, bn, bk, s in (
    # about 144-160 KB in flight, by box shape
    (64, 256, 128, 4), (128, 128, 128, 5), (128, 256, 128, 3), (64, 128, 128, 6), (256, 128, 128, 3),
    (64, 64, 128, 10), (128, 128, 64, 10), (64, 256, 64, 8), (256, 256, 64, 4),
    # by depth
    (64, 256, 128, 2), (64, 256, 128, 3), (64, 256, 128, 5),
    (128, 128, 128, 2), (128, 128, 128, 3), (128, 128, 128, 4), (128, 128, 128, 6),
    (128, 256, 128, 2), (128, 256, 128, 4))]
# other forms of multicast_probe's kernel, 32 MB operands: own-split loads each A box as two of BM / 2 rows (does the
# rate follow the box's rows?); own-cols lets CTA pairs share the row tile and consecutive pairs take the next column
# tiles (does it follow which boxes the CTAs read at once?)
FORMED = (("own-split", ("64x256x128B s4", "128x128x128B s5", "128x256x128B s3", "256x128x128B s3")),
          ("own-cols", ("64x256x128B s4", "128x128x128B s5", "128x256x128B s3", "256x128x128B s3",
                        "64x128x128B s6")))
# own-g<G>: GROUP row tiles a column tile, then the next column tile (multicast_probe.tile_of): from the own order
# (every row tile, then the next column tile) towards own-cols, through orders whose CTAs at once share both boxes
FORMED += tuple((f"own-g{g}", names) for g, names in (
    (2, ("64x256x128B s4", "128x128x128B s5")), (4, ("64x256x128B s4", "128x128x128B s5", "128x256x128B s3")),
    (8, ("64x256x128B s4", "128x128x128B s5", "128x256x128B s3")),
    (16, ("64x256x128B s4", "128x128x128B s5", "128x256x128B s3")), (32, ("64x256x128B s4",))))
# the row copies (multicast_probe._loader's GATHER): each A box as BM one-row copies, from A's own rows (rows: its ring
# must equal the own form's byte for byte, which shows a row copy lands in the full box's swizzle) or from rows in a
# random order (gather: the loader's threads a row each; gather-1: one thread every row; gather-4w: the 4 warps a
# quarter of the rows each). Can a gate_up gather its token rows by TMA itself, with no row copy before it?
GATHERED = ("64x256x128B s4", "128x128x128B s5", "128x256x128B s3", "64x128x128B s6")
FORMED += tuple((form, GATHERED) for form in ("rows", "gather", "gather-1", "gather-4w"))
SIZED = ((L2_8MB, ("64x256x128B s4", "128x128x128B s5", "128x256x128B s3", "64x128x128B s6")),
         (HBM_B, ("64x256x128B s4", "128x128x128B s5", "128x256x128B s3")))


def runs() -> list[tuple]:
    """(case, sizes, form) of every row main() times, in order: SHAPES at 32 MB, FORMED, then SIZED."""
    out = [(case, L2_32MB, "own") for case in SHAPES]
    out += [(case, L2_32MB, form) for form, names in FORMED for case in SHAPES if case[0] in names]
    return out + [(case, sizes, "own") for sizes, names in SIZED for case in SHAPES if case[0] in names]


def sharing(case, programs: int, sizes, form: str) -> dict:
    """How many CTAs read each A box and each B box at once, in the first wave of tiles (programs of them):
    programs / distinct row tiles, programs / distinct column tiles."""
    bm, bn = case[2], case[3]
    m_pairs, n_tiles = sizes[0] // bm // 2, sizes[1] // bn
    const = mp._constexprs(bm, bn, case[4], case[5], form, False)
    tiles = [mp.tile_of(q, r, m_pairs, n_tiles, const["COLPAIRS"], const["GROUP"]) for q in range(programs // 2)
             for r in (0, 1)]
    return dict(a_share=round(programs / len({t[0] for t in tiles}), 1),
                b_share=round(programs / len({t[1] for t in tiles}), 1))


def _times(case, programs: int, sizes, form: str) -> dict:
    run, _, _, delivered, _, _ = mp._launcher(case, form, False, programs, sizes)
    from moeflow.benchmark import graph_us

    def many():
        for _ in range(REPS):
            run()
    one, rep = graph_us(run), graph_us(many)
    steady = (rep - one) / (REPS - 1)
    return dict(cold_us=round(one, 2), steady_us=round(steady, 2), cold_tbs=round(delivered / one / 1e6, 2),
                steady_tbs=round(delivered / steady / 1e6, 2), gb=round(delivered / 1e9, 3))


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = sms - sms % 2
    rows = []
    only = os.environ.get("ONLY")  # forms (comma-separated), to run those forms' rows alone
    for case, sizes, form in runs():
        if only and form not in only.split(","):
            continue
        ok = mp.check(case, programs, forms=("own", form) if form != "own" else ("own",), sizes=sizes)[form]
        good = ok["marker_ok"] and not ok["boxes_wrong"]
        r = dict(case=case[0], sizes=sizes, form=form, programs=programs,
                 ring_kb=case[5] * (case[2] + case[3]) * case[4] // 1024, checks_ok=good,
                 same_as_own=ok["same_as_own"],
                 **sharing(case, programs, sizes, form))
        if good:
            r |= _times(case, programs, sizes, form)
        rows.append(r)
        print(json.dumps(r), flush=True)
    with open(os.path.join(out_dir, "loads_probe.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), triton=triton.__version__, reps=REPS, rows=rows), f,
                  indent=1)
    print(f"{'tile':18} {'form':9} {'operands':18} {'A/B share':>9} {'ring KB':>7} {'cold us':>8} {'steady us':>9} "
          f"{'cold TB/s':>9} {'steady TB/s':>11}")
    for r in rows:
        if not r["checks_ok"]:
            print(f"{r['case']:18} {r['form']:9} {str(r['sizes']):18} CHECK FAILED")
            continue
        print(f"{r['case']:18} {r['form']:9} {str(r['sizes']):18} {r['a_share']:4}/{r['b_share']:<4} "
              f"{r['ring_kb']:7} {r['cold_us']:8.1f} {r['steady_us']:9.1f} {r['cold_tbs']:9.2f} "
              f"{r['steady_tbs']:11.2f}")


if __name__ == "__main__":
    main()
