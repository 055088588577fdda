"""The Triton routers: softmax / sigmoid scores, grouped top-k and renormalization (routing/triton_topk.py)."""
