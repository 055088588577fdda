"""Triton kernels of the "triton" expert runner (moeflow/experts/triton.py), one stage a module,
each JIT kernel above its launcher and a torch reference (``*_torch``) beside it:

    common.py   block alignment of token copies to experts (in-kernel), gated activation, FP8 rounding
    align.py    the alignment as a table (tests, inspection): block -> (expert, first row, last row);
                sort_copies: copies grouped by expert in one launch (the local dispatcher, decode
                sizes; its torch reference is dispatch/expert_sort.py, which runs without triton)
    quant.py    dynamic FP8 activation quantization (1x128 groups, per token, per tensor)
    gate_up.py  x @ W_gate/up^T with act(gate)*up fused (+ amax, or fp8-block quantization, fused)
    down.py     inter @ W_down^T with the routing weight fused; zeros for empty masked slots
    down_wgmma.py  the fp8-block down in Gluon for Hopper, its per-step scaling overlapped with the
                next step's wgmma (a tuned choice; reference: down.down_torch)
    gate_up_wgmma.py  the fp8-block gate_up in Gluon for Hopper, the same overlap in 64-column
                quarters (a tuned choice; reference: gate_up.gate_up_torch)
    route.py    routing in one launch: scores, grouped top-k, renormalize (routing/triton_topk.py)
    ep_rows.py  expert-parallel packed rows: where tokens go (alltoall), pack in one launch, the
                low-latency masked slab (references: dispatch/_ep_reference.py)
    ep_sort.py  received copies grouped by local expert (alltoall's sorted batch)
    reduce.py   the top-k reduction: sum of each token's K weighted copies (for dispatchers)
    fused_layer.py  a small batch's whole single-process layer after routing in one launch: gate_up and down
                work items by ticket, down waiting per copy, no sort or top-k sum (reference: fused_layer_torch)
    configs.py  tuned configs (JSON under configs/) and documented defaults
    registers.py registers and spills of the GEMMs for sm_90a, from ptxas, without a GPU

Importing this package imports triton; moeflow imports it only when a Triton kernel runs.
"""
