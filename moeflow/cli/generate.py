"""`moeflow generate` — load a local Hugging Face checkpoint (or build a small random-weight
Qwen3-MoE-style model), generate greedily with transformers' own experts implementation and with
moeflow, and print prefill and decode tokens/s for each, and whether the tokens agree.

Implementations (--experts, comma-separated): eager, grouped_mm, batched_mm (transformers' own),
moeflow (experts_implementation="moeflow": transformers routes, moeflow computes the experts),
moeflow-block (replace_moe_blocks: routing, experts and shared experts in moeflow); "both" means
eager,moeflow. Nothing is downloaded; a model without tokenizer files gets moeflow's byte-level one.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from ..config import parse_device, parse_dtype
from ..errors import error
from .common import default_device, int_at_least

HF_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
MOEFLOW_IMPLEMENTATIONS = ("moeflow", "moeflow-block")


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate with a Hugging Face MoE model: moeflow vs transformers, tokens/s")
    p.add_argument("--model", help="local checkpoint directory (default: build a small random Qwen3-MoE-style model)")
    p.add_argument("--size", default="small", choices=("tiny", "small"), help="size of the random model (no --model)")
    p.add_argument("--prompt", default="The quick brown fox")
    p.add_argument("--experts", default="both", help="comma-separated: eager, grouped_mm, batched_mm, moeflow, "
                   "moeflow-block; 'both' = eager,moeflow (default)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=32)
    p.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32 (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    p.add_argument("--repeats", type=int_at_least(1), default=2,
                   help="timed runs per implementation; the fastest counts")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def _say(msg: str, end: str = "\n") -> None:
    print(msg, end=end, file=sys.stderr, flush=True)


def _variants(spec: str) -> list[str]:
    names = ["eager", "moeflow"] if spec == "both" else [s.strip() for s in spec.split(",") if s.strip()]
    valid = HF_IMPLEMENTATIONS + MOEFLOW_IMPLEMENTATIONS
    bad = [n for n in names if n not in valid]
    if bad or not names:
        raise error("MF102", field="--experts", value=spec, valid=list(valid) + ["both"])
    return sorted(set(names), key=names.index)


def _device(text: str) -> torch.device:
    """The device to generate on: config.parse_device's (MF106 for a bad string or a GPU this machine lacks), and
    MF106 for a device type that holds no data (meta) or that generate does not run on."""
    device = parse_device(text)
    if device.type == "meta":
        raise error("MF106", value=text, why="generation needs a device that holds data (a meta tensor has a shape "
                    "only); use cpu or cuda")
    if device.type not in ("cpu", "cuda"):
        raise error("MF106", value=text, why="moeflow generate runs on cpu or cuda")
    return device


def run(args) -> int:
    from ..integrations.hf import require_transformers
    names = _variants(args.experts)
    device = _device(args.device or default_device())
    dtype = parse_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    transformers = require_transformers("moeflow generate")
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else _build_random(Path(tmp), args.size, dtype)
        if not (path / "config.json").is_file():
            raise error("MF706", path=str(path), why="no config.json there (a local checkpoint directory is needed)")
        tokenizer, note = _tokenizer(transformers, path, bool(args.model))
        _say(note)
        prompt = torch.tensor([tokenizer.encode(args.prompt)], device=device)
        rows = [_run_one(transformers, path, name, dtype, device, prompt, args.max_new_tokens, max(args.repeats, 1))
                for name in names]
    _report(rows, tokenizer, prompt.shape[1], dtype, device, path if args.model else f"random Qwen3-MoE-style ({args.size})")
    return 0


def _build_random(tmp: Path, size: str, dtype) -> Path:
    from ..integrations.hf.tiny import tiny_model
    _say(f"building a {size} random-weight Qwen3-MoE-style model (nothing is downloaded) ...", end=" ")
    start = time.perf_counter()
    model = tiny_model("qwen3_moe", size=size, dtype=dtype)
    model.save_pretrained(tmp / "model")
    _say(f"done in {time.perf_counter() - start:.1f}s: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
         f"parameters, {model.config.num_experts} experts, top-{model.config.num_experts_per_tok}")
    return tmp / "model"


def _tokenizer(transformers, path: Path, real: bool):
    from ..integrations.hf.tiny import ByteTokenizer
    if real and any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        try:
            return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True), "tokenizer: the checkpoint's"
        except Exception as exc:  # a broken or unsupported tokenizer: fall back, and say so
            return ByteTokenizer(), f"tokenizer: the checkpoint's failed to load ({exc}); using moeflow's byte-level one"
    return ByteTokenizer(), "tokenizer: none in the checkpoint; using moeflow's byte-level one (ids 0-255 are bytes)"


def _is_fp8(transformers, path: Path) -> bool:
    qc = getattr(transformers.AutoConfig.from_pretrained(path), "quantization_config", None)
    qc = qc if isinstance(qc, dict) else (qc.to_dict() if qc is not None else {})
    return qc.get("quant_method") == "fp8"


def _load(transformers, path: Path, name: str, dtype, device):
    from ..integrations.hf import load_fp8_model, prepare_experts, replace_moe_blocks
    progress = lambda done, total, what: _say(f"\r  replacing MoE blocks {done}/{total}", end="" if done < total else "\n")
    if _is_fp8(transformers, path):
        if name != "moeflow-block" and device.type != "cuda":
            return None, "FP8 checkpoint: transformers keeps FP8 only on a GPU; on CPU only moeflow-block runs it"
        if name == "moeflow-block":
            return load_fp8_model(path, dtype=dtype, device=device, progress=progress), "fp8-block experts"
    impl = "eager" if name == "moeflow-block" else name
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=None,
                                                                  experts_implementation=impl).to(device).eval()
    except (OSError, ValueError) as exc:
        raise error("MF706", path=str(path), why=str(exc).splitlines()[0]) from None
    if name == "moeflow":
        prepare_experts(model, dtype)
    if name == "moeflow-block":
        replace_moe_blocks(model, progress=progress)
    return model, ""


@torch.no_grad()
def _run_one(transformers, path: Path, name: str, dtype, device, prompt, max_new: int, repeats: int) -> dict:
    _say(f"[{name}] loading ...", end=" ")
    start = time.perf_counter()
    model, note = _load(transformers, path, name, dtype, device)
    if model is None:
        _say(f"skipped: {note}")
        return dict(name=name, skipped=note)
    _say(f"{time.perf_counter() - start:.1f}s; generating {max_new} tokens ...", end=" ")
    pad = _pad_id(model)
    runs = []
    for i in range(repeats + 1):  # the first run warms up (planning, allocator, caches) and is not counted
        clock = _Clock()
        out = model.generate(prompt, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                             pad_token_id=pad, streamer=clock)
        runs += [clock.rates(prompt.shape[1])] if i else []
    prefill, decode = max(r[0] for r in runs), max(r[1] for r in runs)
    _say(f"prefill {prefill:.0f} tok/s, decode {decode:.1f} tok/s")
    return dict(name=name, prefill_tok_s=prefill, decode_tok_s=decode, ids=out[0, prompt.shape[1]:].tolist(), note=note)


class _Clock:
    """A generate() streamer that only timestamps: put() gets the prompt first, then each new
    token (moved to the host, so the device is synchronized)."""

    def __init__(self):
        self.times = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def rates(self, prompt_len: int) -> tuple[float, float]:
        """-> (prefill tokens/s: prompt over time to the first new token, decode tokens/s after it)."""
        t = self.times
        return prompt_len / (t[1] - t[0]), (len(t) - 2) / max(t[-1] - t[1], 1e-9)


def _pad_id(model) -> int:
    for value in (model.generation_config.pad_token_id, model.generation_config.eos_token_id, 0):
        value = value[0] if isinstance(value, (list, tuple)) and value else value
        if isinstance(value, int):
            return value
    return 0


def _report(rows, tokenizer, prompt_len, dtype, device, source) -> None:
    print(f"moeflow generate: {source}, dtype={str(dtype).removeprefix('torch.')}, device={device}, "
          f"prompt {prompt_len} tokens, greedy")
    ran = [r for r in rows if "ids" in r]
    first = ran[0] if ran else None
    print(f"{'experts':<14} {'prefill tok/s':>14} {'decode tok/s':>13}  {'same tokens as ' + first['name'] if first else ''}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['name']:<14} skipped: {r['skipped']}")
            continue
        same = "-" if r is first else _agreement(r["ids"], first["ids"])
        print(f"{r['name']:<14} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.1f}  {same}")
    for r in ran:
        print(f"  {r['name']}: {tokenizer.decode(r['ids'])!r}")


def _agreement(ids, ref) -> str:
    if ids == ref:
        return "yes"
    i = next(i for i, (a, b) in enumerate(zip(ids, ref)) if a != b) if any(a != b for a, b in zip(ids, ref)) else len(ref)
    return f"no (first difference at token {i})"
