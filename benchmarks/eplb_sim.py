"""Expert-parallel load-balancing simulation (CPU only, deterministic): DeepSeek-V3's 256 routed experts, top-8, over
8, 16, 32 and 64 ranks. How uneven are the ranks' loads with the contiguous placement, and after moeflow.balance's
plan_placement with redundant slots?

    python benchmarks/eplb_sim.py                       # writes benchmarks/results/eplb/ (JSON, CSV, PNG, RESULTS.md)
    python benchmarks/eplb_sim.py --tokens 4096 --out /tmp/eplb

Routing (synthetic: no recorded trace is in the repository). Each window is T tokens, each choosing 8 distinct experts:
  zipf-0.8, zipf-1.2   expert popularity 1 / (rank + 1)^s over a shuffled order; per token, Gumbel top-8 on the log
                       popularities (sampling without replacement by popularity);
  recorded-like        DeepSeek-V3's router shape on synthetic scores: log-normal expert popularity (sigma 1.0) times
                       a log-normal factor per routing group (8 groups of 32, sigma 0.5), Gumbel noise per token,
                       grouped top-k (the 4 groups with the best sum of their two best scores, then the top 8 in them).
A placement is planned from one window's counts (A) and used on later windows, as a serving engine would: window B
draws fresh tokens from the same popularities (sampling noise only), window C from popularities drifted by a
log-normal factor per expert (sigma 0.3: popularity moved between two rebalances).

Measured per (routing, ranks): max / mean of the ranks' token copies (1.0 = even; the slowest rank sets the layer's
time), for the contiguous placement (expert e on rank e // (256 / W)), for plan_placement without replicas and with W
redundant slots (one a rank), and the smallest number of redundant slots (a multiple of W: every rank gets the same
slot count) that brings it under 1.1: "same" plans and measures on window A, each replica taking an equal share of its expert's load; "fresh" and
"drifted" count windows B and C's copies as the layer routes them: tokens split over the ranks in contiguous blocks,
each copy to the replica moeflow.balance.to_slots picks. Also the hierarchical plan (groups of 32 experts kept on
nodes of 8 ranks) for recorded-like routing.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from moeflow.balance import Placement, imbalance, plan_placement, to_slots  # noqa: E402
from moeflow.balance.slots import ExpertSlots  # noqa: E402

E, K, GROUPS, TOPK_GROUPS = 256, 8, 8, 4
WORLDS = (8, 16, 32, 64)
ROUTINGS = ("zipf-0.8", "zipf-1.2", "recorded-like")
TARGET = 1.1
MAX_REDUNDANT = 512  # searched up to this many redundant slots (3x the logical experts in all)


def popularity(routing: str, g: torch.Generator) -> torch.Tensor:
    """[E] log-popularity of each expert for ``routing`` (see the module docstring)."""
    if routing.startswith("zipf-"):
        s = float(routing.split("-")[1])
        return -s * torch.log(torch.arange(1, E + 1, dtype=torch.float64))[torch.randperm(E, generator=g)]
    per_expert = torch.randn(E, generator=g, dtype=torch.float64)
    per_group = 0.5 * torch.randn(GROUPS, generator=g, dtype=torch.float64)
    return per_expert + per_group.repeat_interleave(E // GROUPS)


def drifted(logp: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return logp + 0.3 * torch.randn(E, generator=g, dtype=torch.float64)


def route(routing: str, logp: torch.Tensor, tokens: int, g: torch.Generator) -> torch.Tensor:
    """[T, K] int32 expert ids of one window."""
    u = torch.rand(tokens, E, generator=g, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
    scores = logp + (-torch.log(-torch.log(u)))
    if routing.startswith("zipf-"):
        return scores.topk(K, dim=1).indices.to(torch.int32)
    grouped = scores.view(tokens, GROUPS, E // GROUPS)
    group_score = grouped.topk(2, dim=2).values.sum(dim=2)  # DeepSeek-V3: the sum of each group's best two
    keep = torch.zeros(tokens, GROUPS, dtype=torch.bool)
    keep.scatter_(1, group_score.topk(TOPK_GROUPS, dim=1).indices, True)
    masked = torch.where(keep[:, :, None], grouped, -torch.inf).view(tokens, E)
    return masked.topk(K, dim=1).indices.to(torch.int32)


def counts(ids: torch.Tensor) -> torch.Tensor:
    return torch.bincount(ids.long().flatten(), minlength=E)


def contiguous(world: int) -> Placement:
    return Placement.of_ranks([e * world // E for e in range(E)])


def measured(placement: Placement, ids: torch.Tensor, world: int) -> float:
    """max / mean of the ranks' copies when the layer routes ``ids`` by ``placement``: tokens split over the ranks in
    contiguous blocks, each copy to the replica to_slots picks on the token's rank."""
    per_rank = torch.zeros(world, dtype=torch.int64)
    ranks = torch.tensor(placement.ranks)
    for r, block in enumerate(ids.chunk(world)):
        table = ExpertSlots(placement, E, "cpu", rank=r)
        slots = to_slots(block, table.start, table.count, table.slots, r)
        per_rank += torch.bincount(ranks[slots.long().flatten()], minlength=world)
    return float(per_rank.max()) / float(per_rank.float().mean())


def search(load_a, ids_b, ids_c, world, **groups) -> dict:
    """Redundant slots (multiples of world, up to MAX_REDUNDANT) until the three measures fall under TARGET (None:
    not within MAX_REDUNDANT); the rows on the way."""
    rows, need = [], {"same": None, "fresh": None, "drifted": None}
    for r in range(0, MAX_REDUNDANT + 1, world):
        placement = plan_placement(load_a, world, r, **groups)
        row = {"redundant": r, "same": imbalance(placement, load_a, world),
               "fresh": measured(placement, ids_b, world), "drifted": measured(placement, ids_c, world)}
        rows.append({k: round(v, 4) for k, v in row.items()})
        for k in need:
            if need[k] is None and row[k] < TARGET:
                need[k] = r
        if all(v is not None for v in need.values()):
            break
    return {"curve": rows, **{f"needed_{k}": v for k, v in need.items()}}


def simulate(tokens: int, seed: int) -> list[dict]:
    results = []
    for n, routing in enumerate(ROUTINGS):
        g = torch.Generator().manual_seed(seed + n)
        logp = popularity(routing, g)
        ids_a, ids_b = route(routing, logp, tokens, g), route(routing, logp, tokens, g)
        ids_c = route(routing, drifted(logp, g), tokens, g)
        load_a = counts(ids_a)
        for world in WORLDS:
            start = time.perf_counter()
            row = {"routing": routing, "ranks": world, "tokens": tokens}
            rearranged, one_each = plan_placement(load_a, world, 0), plan_placement(load_a, world, world)
            for name, placement in (("contiguous", contiguous(world)), ("rearranged", rearranged),
                                    ("one_each", one_each)):
                row[f"{name}_same"] = round(imbalance(placement, load_a, world), 4)
                row[f"{name}_fresh"] = round(measured(placement, ids_b, world), 4)
                row[f"{name}_drifted"] = round(measured(placement, ids_c, world), 4)
            row.update(search(load_a, ids_b, ids_c, world))
            if routing == "recorded-like":
                hier = search(load_a, ids_b, ids_c, world, group_size=E // GROUPS, ranks_per_node=8)
                row.update({f"grouped_{k}": v for k, v in hier.items()})
            row["seconds"] = round(time.perf_counter() - start, 2)
            results.append(row)
            print(f"{routing:14s} W={world:2d}: contiguous {row['contiguous_same']:.2f} / {row['contiguous_fresh']:.2f}"
                  f" / {row['contiguous_drifted']:.2f}, rearranged {row['rearranged_same']:.2f} / "
                  f"{row['rearranged_fresh']:.2f} / {row['rearranged_drifted']:.2f}; redundant slots for <{TARGET} "
                  f"(same / fresh / drifted): {row['needed_same']} / {row['needed_fresh']} / {row['needed_drifted']}",
                  flush=True)
    return results


def commit() -> str:
    """HEAD's short hash, "+ uncommitted changes" where the tree differs from it."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=here, check=False).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD") or "unknown"
        return head + (" + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except OSError:
        return "unknown"


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def write(results: list[dict], out: str, meta: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "eplb_sim.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    fields = ["routing", "ranks", "tokens"] + [f"{p}_{m}" for p in ("contiguous", "rearranged", "one_each")
                                                for m in ("same", "fresh", "drifted")]
    fields += [f"{g}needed_{m}" for g in ("", "grouped_") for m in ("same", "fresh", "drifted")]
    with open(os.path.join(out, "eplb_sim.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(results)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    fig, axes = plt.subplots(1, len(ROUTINGS), figsize=(5 * len(ROUTINGS), 4), sharey=True)
    for ax, routing in zip(axes, ROUTINGS):
        for row in (r for r in results if r["routing"] == routing):
            xs = [c["redundant"] / row["ranks"] for c in row["curve"]]
            line, = ax.plot(xs, [c["fresh"] for c in row["curve"]], marker="o", label=f"W={row['ranks']}")
            ax.plot(xs, [c["drifted"] for c in row["curve"]], linestyle=":", color=line.get_color())
        ax.axhline(TARGET, color="gray", linestyle="--", linewidth=1)
        ax.set_title(f"{routing}: planned on A, routed on B (—), C (··)", fontsize=10)
        ax.set_xlabel("redundant slots per rank")
        ax.set_yscale("log")
        ax.set_yticks([1, 1.1, 1.25, 1.5, 2, 3, 5, 8], labels=["1", "1.1", "1.25", "1.5", "2", "3", "5", "8"])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("max / mean rank load")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "eplb_sim.png"), dpi=110)


def results_md(results: list[dict], meta: dict) -> str:
    """RESULTS.md: how the files were made, and the table."""
    def need(v):
        return "—" if v is None else str(v)
    lines = [
        "# Expert-parallel load balancing, simulated (`benchmarks/eplb_sim.py`)", "",
        f"Device: {meta['device']} (a CPU simulation: no GPU, no communication timed). Commit {meta['commit']}, "
        f"{meta['date']}, {meta['seconds']} s:", "", f"    {meta['command']}", "",
        f"DeepSeek-V3's {meta['experts']} routed experts, top-{meta['top_k']}, {results[0]['tokens']} tokens a window. "
        "**The routing is synthetic** (no recorded trace is in the repository): Zipf popularity with exponents 0.8 "
        "and 1.2, and a \"recorded-like\" skew (log-normal expert and group popularity through DeepSeek-V3's "
        "grouped top-k: 4 of 8 groups, then 8 experts). The placement is planned from window A's counts "
        "(`moeflow.balance.plan_placement`); \"same\" is window A itself (each replica an equal share), \"fresh\" "
        "a new window from the same popularity and \"drifted\" one from popularity moved by a log-normal factor "
        "(sigma 0.3) per expert, both counted as the layer routes them (`moeflow.balance.to_slots`, tokens split "
        "over the ranks in blocks). The module docstring has the details.", "",
        "max / mean rank load (1.0 = even), each cell same / fresh / drifted: before (the contiguous placement), "
        "after plan_placement without replicas and with one redundant slot a rank (W of them), and the redundant "
        f"slots (a multiple of W, up to {MAX_REDUNDANT}) that bring it under {meta['target']} (— : not within "
        f"{MAX_REDUNDANT}):", "",
        "| routing | W | before: contiguous | after: no replicas | after: W redundant | redundant slots for < 1.1 |",
        "|---|---|---|---|---|---|"]
    for r in results:
        cells = [" / ".join(f"{r[f'{p}_{m}']:.2f}" for m in ("same", "fresh", "drifted"))
                 for p in ("contiguous", "rearranged", "one_each")]
        lines.append(f"| {r['routing']} | {r['ranks']} | " + " | ".join(cells) + f" | {need(r['needed_same'])} / "
                     f"{need(r['needed_fresh'])} / {need(r['needed_drifted'])} |")
    grouped = [r for r in results if "grouped_needed_same" in r]
    if grouped:
        lines += ["", "Recorded-like, groups of 32 experts kept on nodes of 8 ranks (`group_size=32, "
                  "ranks_per_node=8`): redundant slots for < 1.1, same / fresh / drifted: " + "; ".join(
                      f"W={r['ranks']}: {need(r['grouped_needed_same'])} / {need(r['grouped_needed_fresh'])} / "
                      f"{need(r['grouped_needed_drifted'])}" for r in grouped) + "."]
    lines += ["", "Files: `eplb_sim.json` (every row, with the curve of each search), `eplb_sim.csv`, `eplb_sim.png` "
              "(max/mean on windows B and C against redundant slots per rank). Not measured: the layer's time on "
              "several GPUs with and without balancing (it waits for multi-GPU machines), and real routing traces.",
              ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per window (the whole group's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "eplb"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    results = simulate(args.tokens, args.seed)
    meta = {"device": f"CPU ({cpu_name()}), torch {torch.__version__}", "commit": commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python benchmarks/eplb_sim.py" + (" " + " ".join(argv or sys.argv[1:])).rstrip(),
            "experts": E, "top_k": K, "target": TARGET, "seconds": round(time.perf_counter() - start, 1)}
    write(results, args.out, meta)
    with open(os.path.join(args.out, "RESULTS.md"), "w") as f:
        f.write(results_md(results, meta))
    print(f"wrote {args.out} in {meta['seconds']} s")


if __name__ == "__main__":
    main()
