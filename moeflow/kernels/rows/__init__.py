"""Kernels that move token rows: sort by expert, quantize, pack for expert parallelism, sum the top-k copies."""
