"""Triton kernels (Gluon where Hopper runs faster); each launcher sits below its JIT code with a torch reference.

common.py configs.py (+ configs/*.json): shared JIT helpers; GemmConfig / FusedConfig and the tuned tables.
gemm/ the two grouped GEMMs: choice.py (which kernel runs), tiles.py (tile rules), sm90_tiles.py (Hopper defaults),
  gate_up.py (+ activation), down.py (+ routing weight), gate_up_wgmma.py, down_wgmma.py, down_wgmma_persistent.py,
  warp_specialized.py (Gluon, Hopper), fused_layer.py (one launch, small batches), linear.py (batch-invariant dense).
routing/ route.py, route_stream.py: scores, grouped top-k and renormalization in one launch.
rows/ align.py (rows by expert), quant.py (FP8 activations), reduce.py (top-k sum), ep_sort.py, ep_rows.py and
  peer.py (expert-parallel packing, sorting and peer barriers).
Importing moeflow imports none of these; triton is imported when a Triton kernel first runs.
"""
