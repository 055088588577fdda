"""What torch.compile gives a model that holds moeflow layers (moeflow.ops), against the same model eager.

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD python benchmarks/experiments/compile_overhead.py OUT_DIR [--quick]

Part A, moeflow layers alone: a stack of 4 Qwen3-30B-A3B MoE layers (H=2048, 128 experts, top-8, I=768), each
x -> x + moe(x, gate(x)) with a bf16 linear gate, bf16 and fp8-block, triton runner, T = 1, 4, 16, 64, 512. Modes:
    eager_launched   eager, MOEFLOW_EAGER_GRAPHS=0 (every launch issued by the host)
    eager            eager, moeflow's eager graphs at T <= 16 (the default)
    compiled         torch.compile(model, fullgraph=True): inductor's default mode; each layer's op runs its eager
                     forward launch by launch (moeflow.ops: the eager graphs stand aside inside compiled models)
    cudagraphs       torch.compile(model, mode="reduce-overhead", fullgraph=True): inductor's CUDA graphs record
                     the ops' launches
    captured         the eager model captured by hand as one CUDA graph, replayed: the GPU's own time (the floor)
Part B, a transformers model: bench_hf.py's random-weight Qwen3-MoE with 4 decoder layers (Qwen3-30B-A3B's shapes),
bf16, forward without a cache on [B, S] = [1, 1], [16, 1], [1, 512], experts_implementation grouped_mm
(transformers' own) and moeflow, each eager and compiled with mode="reduce-overhead".
Each figure: 30 calls back to back (after warm-up and compilation), one synchronize, / 30: µs a call, what a serving
loop gets (host and GPU overlapped). Compilation time (first call of a shape, seconds) is recorded too.
Writes OUT_DIR/compile_overhead.json, cProfiles of 10 calls at T=64 eager (launched) and compiled
(OUT_DIR/profile_*.txt), and prints a table.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from moeflow import MoE  # noqa: E402
from moeflow.graphs import capture_graph  # noqa: E402
from moeflow.presets import preset_config  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eager_overhead import eager_us, profile_text  # noqa: E402

TOKENS = (1, 4, 16, 64, 512)
CALLS = 30


class Stack(nn.Module):
    def __init__(self, layers: list[MoE]):
        super().__init__()
        h, e = layers[0].config.hidden_size, layers[0].config.num_experts
        self.moes = nn.ModuleList(layers)
        self.gates = nn.ModuleList(nn.Linear(h, e, bias=False, device="cuda", dtype=torch.bfloat16) for _ in layers)

    def forward(self, x):
        for gate, moe in zip(self.gates, self.moes):
            x = x + moe(x, gate(x))
        return x


def loop_us(fn, calls=CALLS) -> float:
    return eager_us(fn, calls, warmups=3)


def first_call_s(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def graph_us(fn) -> float:
    g = capture_graph(fn, warmups=2)
    return loop_us(g.replay)


def part_a(tokens, out_dir: str) -> list[dict]:
    rows = []
    for scheme in ("none", "fp8-block"):
        rows += scheme_rows(scheme, tokens, out_dir)
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return rows


def scheme_rows(scheme: str, tokens, out_dir: str) -> list[dict]:
    torch.manual_seed(0)
    cfg = preset_config("qwen3-30b-a3b", dtype=torch.bfloat16, device="cuda", quant=scheme, runner="triton")
    model = Stack([MoE(cfg) for _ in range(4)]).requires_grad_(False).eval()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    cudagraphs = torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False)
    rows = []
    for t in tokens:
        x = torch.randn(t, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        row = dict(part="A", model="4 x qwen3-30b-a3b layers", scheme=scheme, T=t)
        with torch.inference_mode():
            os.environ["MOEFLOW_EAGER_GRAPHS"] = "0"
            row["eager_launched"] = loop_us(lambda: model(x))
            row["captured"] = graph_us(lambda: model(x))
            os.environ["MOEFLOW_EAGER_GRAPHS"] = "16"
            row["eager"] = loop_us(lambda: model(x))
            row["compiled_first_s"] = first_call_s(lambda: compiled(x))
            row["compiled"] = loop_us(lambda: compiled(x))
            row["cudagraphs_first_s"] = first_call_s(lambda: cudagraphs(x))
            row["cudagraphs"] = loop_us(lambda: cudagraphs(x))
            ref = model(x)
            row["compiled_equal"] = bool(torch.equal(compiled(x), ref))
            row["cudagraphs_equal"] = bool(torch.equal(cudagraphs(x).clone(), ref))
            if t == 64:  # where the host's cost shows: the compiled model's Python against the eager model's
                os.environ["MOEFLOW_EAGER_GRAPHS"] = "0"
                for name, fn in (("eager_launched", lambda: model(x)), ("compiled", lambda: compiled(x))):
                    with open(os.path.join(out_dir, f"profile_{scheme}_T{t}_{name}.txt"), "w") as f:
                        f.write(profile_text(fn, calls=10))
                os.environ["MOEFLOW_EAGER_GRAPHS"] = "16"
        rows.append(row)
        print(fmt(row), flush=True)
    return rows


def part_b(shapes) -> list[dict]:
    import transformers
    from bench_hf import model_config  # imports moeflow first, which registers "moeflow" with transformers
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(model_config(4, False), dtype=torch.bfloat16)
    model = model.cuda().eval()
    rows = []
    for impl in ("grouped_mm", "moeflow"):
        model.set_experts_implementation(impl)
        torch._dynamo.reset()
        cudagraphs = torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False)
        for b, s in shapes:
            ids = torch.randint(0, 32000, (b, s), device="cuda")
            row = dict(part="B", model="transformers Qwen3-MoE, 4 layers", impl=impl, B=b, S=s)
            with torch.inference_mode():
                row["eager"] = loop_us(lambda: model(ids, use_cache=False))
                row["cudagraphs_first_s"] = first_call_s(lambda: cudagraphs(ids, use_cache=False))
                row["cudagraphs"] = loop_us(lambda: cudagraphs(ids, use_cache=False))
                ref = model(ids, use_cache=False).logits
                out = cudagraphs(ids, use_cache=False).logits.clone()
                row["cudagraphs_rel_err"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            row["eager_tokens_s"] = b * s / row["eager"] * 1e6
            row["cudagraphs_tokens_s"] = b * s / row["cudagraphs"] * 1e6
            rows.append(row)
            print(fmt(row), flush=True)
    return rows


def fmt(row: dict) -> str:
    return "  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


def table(rows: list[dict]) -> str:
    out = ["| scheme | T | eager launched | eager (eager graphs) | compiled | compiled, CUDA graphs | captured (GPU) |",
           "|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["part"] == "A"):
        out.append(f"| {r['scheme']} | {r['T']} | {r['eager_launched']:.0f} | {r['eager']:.0f} | {r['compiled']:.0f} | "
                   f"{r['cudagraphs']:.0f} | {r['captured']:.0f} |")
    out += ["", "| impl | B x S | eager µs | eager tokens/s | CUDA graphs µs | CUDA graphs tokens/s | rel err |",
            "|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["part"] == "B"):
        out.append(f"| {r['impl']} | {r['B']}x{r['S']} | {r['eager']:.0f} | {r['eager_tokens_s']:.0f} | "
                   f"{r['cudagraphs']:.0f} | {r['cudagraphs_tokens_s']:.0f} | {r['cudagraphs_rel_err']:.1e} |")
    return "\n".join(out)


def main() -> int:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    quick = "--quick" in sys.argv
    os.makedirs(out_dir, exist_ok=True)
    import triton
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": os.environ.get("MOEFLOW_COMMIT", "unknown"), "calls": CALLS, "rows": []}
    # two compiled forms of one model, each recompiled per T (dynamic=False), share the forward's recompile budget
    torch._dynamo.config.recompile_limit = 64
    res["rows"] += part_a((1, 16) if quick else TOKENS, out_dir)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    res["rows"] += part_b(((1, 1),) if quick else ((1, 1), (16, 1), (1, 512)))
    with open(os.path.join(out_dir, "compile_overhead.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(table(res["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
