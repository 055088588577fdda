"""Experiment (GPU): peak GPU memory of building a quantized layer, and of quantizing its whole gate_up at once.

Why: MoE._store_expert_weight quantized a whole [E, N, K] weight in one call until 2026-12-05 (14734ab); every FP8
scheme's quantize_weight makes float32 temporaries of all of it. It now quantizes one expert at a time.

For each FP8 scheme, at E=64, H=7168, I=1024 (gate_up [64, 2048, 7168], 1.75 GiB in bf16): the peak allocated above
the start while MoE(..., device="cuda") draws and quantizes its random weights, and the peak of one
scheme.quantize_weight over a whole bf16 gate_up of that shape (what building did before).

    PYTHONPATH=$PWD python benchmarks/experiments/quantize_peak_memory.py

H100, 2026-12-05, at 14734ab plus `del w` in reset_parameters (gpu_session_2026-12-05_h100_617a4ac.md): build peak
3.19-3.24 GiB (1.31 stored, 1.75 the bf16 source); whole-tensor quantize 8.75 GiB (fp8-tensor, -channel) and
12.25 GiB (fp8-block).
"""
import torch

from moeflow import MoE
from moeflow.quant import create_scheme

E, H, I = 64, 7168, 1024


def fresh_peak() -> int:
    """Empties the allocator's cache, resets its peak; -> the bytes allocated now."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def main():
    for scheme in ("fp8-tensor", "fp8-channel", "fp8-block"):
        base = fresh_peak()
        layer = MoE(num_experts=E, hidden_size=H, intermediate_size=I, top_k=2, quant=scheme, dtype=torch.bfloat16,
                    device="cuda", runner="reference")
        stored = torch.cuda.memory_allocated() - base
        peak = torch.cuda.max_memory_allocated() - base
        del layer
        base = fresh_peak()
        w = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
        q, s = create_scheme(scheme).quantize_weight(w)
        whole = torch.cuda.max_memory_allocated() - base
        del w, q, s
        gib = 2 ** 30
        print(f"{scheme}: build peak above start {peak / gib:.2f} GiB (stored {stored / gib:.2f}); whole-tensor "
              f"quantize of a bf16 gate_up [{E}, {2 * I}, {H}] alone: peak {whole / gib:.2f} GiB")


if __name__ == "__main__":
    main()
