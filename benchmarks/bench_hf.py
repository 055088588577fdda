"""Prefill and decode tokens/s of a transformers MoE model: transformers' own experts
implementations (grouped_mm, batched_mm) vs moeflow (experts_implementation="moeflow", and
replace_moe_blocks: routing + experts in moeflow).

    python benchmarks/bench_hf.py --out $OUT --commit $(git rev-parse --short HEAD)

Model: a random-weight Qwen3-MoE with Qwen3-30B-A3B's MoE shapes (H=2048, 128 experts, top-8,
I=768, 32 heads / 4 KV heads of 128) and --layers decoder layers (default 4), vocabulary 32000,
bf16, built on the GPU from its config (nothing downloaded). Per implementation:
    prefill  forward of [B, S] prompts without cache; tokens/s = B*S / median of 5 timed calls
    decode   greedy generate of N new tokens after a 64-token prompt, batch B;
             tokens/s = B*(N-1) / (t(N tokens) - t(1 token)), fastest of 3 (prefill cancels out)
    agree    greedy tokens (batch 1) equal to the first implementation's, and relative error of
             the prefill logits vs the first implementation (bf16, so small differences are expected)
Shapes whose batched_mm would gather more than 40 GB of expert weights are skipped for it ("-").
Writes hf_bench.json and hf_bench.md under --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import moeflow  # noqa: E402,F401  (registers "moeflow" with transformers' experts interfaces)
import transformers  # noqa: E402
from moeflow.integrations.hf import prepare_experts, replace_moe_blocks  # noqa: E402

IMPLS = ("grouped_mm", "batched_mm", "moeflow", "moeflow-block")


def model_config(layers: int, small: bool):
    if small:  # CPU smoke run of this script
        return transformers.Qwen3MoeConfig(
            vocab_size=512, hidden_size=128, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, intermediate_size=256, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2)
    return transformers.Qwen3MoeConfig(
        vocab_size=32000, hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def moeflow_runner(model) -> str | None:
    """The runner moeflow planned for the model's MoE layers (block replacement or experts interface)."""
    for m in model.modules():
        if hasattr(m, "moe"):
            return m.moe.plan.runner
        for path in m.__dict__.get("_moeflow_paths", {}).values():
            return path.plan.runner
    return None


def use_implementation(model, name: str) -> None:
    """Switch the model's MoE layers to one of IMPLS ("moeflow-block" replaces the blocks: call it last)."""
    if name == "moeflow-block":
        replace_moe_blocks(model)
    else:
        model.set_experts_implementation(name)
        if name == "moeflow":
            prepare_experts(model, torch.bfloat16)


@torch.no_grad()
def measure(model, name, cfg, args, first) -> dict:
    row = dict(impl=name, prefill={}, decode={})
    for b, s in args.prefill:
        if name == "batched_mm" and b * s * cfg.num_experts_per_tok * 3 * cfg.moe_intermediate_size * cfg.hidden_size * 2 > 40e9:
            row["prefill"][f"{b}x{s}"] = None
            continue
        ids = torch.randint(0, cfg.vocab_size, (b, s), device=args.device)
        for _ in range(2):
            model(ids, use_cache=False)
        row["prefill"][f"{b}x{s}"] = b * s / statistics.median(timed(lambda: model(ids, use_cache=False)) for _ in range(5))
    for b in args.decode:
        prompt = torch.randint(0, cfg.vocab_size, (b, 64), device=args.device)
        gen = lambda n: model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        gen(2)
        t1 = min(timed(lambda: gen(1)) for _ in range(3))
        tn = min(timed(lambda: gen(args.new_tokens)) for _ in range(3))
        row["decode"][str(b)] = b * (args.new_tokens - 1) / (tn - t1) if tn > t1 else None  # None: lost in noise
    torch.manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (1, 64), device=args.device)
    row["tokens"] = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)[0, 64:].tolist()
    row["logits"] = model(prompt, use_cache=False).logits.float()
    if first is not None:
        row["same_tokens"] = row["tokens"] == first["tokens"]
        row["logits_rel_err"] = ((row["logits"] - first["logits"]).norm() / first["logits"].norm()).item()
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--prefill", default="1x512,4x1024", help="BxS,... prompt shapes")
    p.add_argument("--decode", default="1,16", help="batch sizes")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny shapes: a CPU smoke run of the script")
    args = p.parse_args()
    args.prefill = [tuple(int(v) for v in s.split("x")) for s in args.prefill.split(",")]
    args.decode = [int(b) for b in args.decode.split(",")]
    cfg = model_config(args.layers, args.small)
    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    print(f"model built in {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    rows, first = [], None
    impls = [i for i in IMPLS if i in args.impls.split(",")]  # moeflow-block last: it replaces the blocks
    for name in impls:
        start = time.perf_counter()
        try:
            use_implementation(model, name)
            row = measure(model, name, cfg, args, first)
            row["moeflow_runner"] = moeflow_runner(model) if name.startswith("moeflow") else None
        except Exception as exc:  # record and go on: one implementation failing must not lose the others
            row = dict(impl=name, error=f"{type(exc).__name__}: {exc}"[:400])
        row["seconds"] = time.perf_counter() - start
        print(json.dumps({k: v for k, v in row.items() if k not in ("logits", "tokens")}), file=sys.stderr, flush=True)
        first = first or (row if "logits" in row else None)
        rows.append(row)
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=args.commit,
                device=torch.cuda.get_device_name() if args.device == "cuda" else args.device, torch=torch.__version__,
                transformers=transformers.__version__, layers=args.layers,
                model="random Qwen3-MoE, " + ("tiny shapes" if args.small else "Qwen3-30B-A3B MoE shapes") + ", bf16",
                decode_new_tokens=args.new_tokens)
    for r in rows:
        r.pop("logits", None)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hf_bench.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    table = markdown(meta, rows, args)
    with open(os.path.join(args.out, "hf_bench.md"), "w") as f:
        f.write(table)
    print(table)
    return 0


def markdown(meta, rows, args) -> str:
    lines = [f"# transformers MoE: prefill / decode tokens/s ({meta['device']})", "",
             "; ".join(f"{k}: {v}" for k, v in meta.items()), "",
             "| experts | " + " | ".join(f"prefill {b}x{s}" for b, s in args.prefill) + " | "
             + " | ".join(f"decode B={b}" for b in args.decode) + " | same tokens | logits rel err |",
             "|" + "---|" * (3 + len(args.prefill) + len(args.decode))]
    fmt = lambda v: "-" if v is None else f"{v:,.0f}"
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['impl']} | error: {r['error']} |")
            continue
        cells = [fmt(r["prefill"][f"{b}x{s}"]) for b, s in args.prefill] + [fmt(r["decode"][str(b)]) for b in args.decode]
        agree = "(reference)" if "same_tokens" not in r else str(r["same_tokens"])
        agree += f" [runner {r['moeflow_runner']}]" if r.get("moeflow_runner") else ""
        err = "" if "logits_rel_err" not in r else f"{r['logits_rel_err']:.2e}"
        lines.append(f"| {r['impl']} | " + " | ".join(cells) + f" | {agree} | {err} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
