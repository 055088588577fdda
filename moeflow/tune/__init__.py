"""The tuner behind `moeflow tune`: candidate tiles timed on this GPU (autotune.py), the one-launch layer's search
(fused.py), output checks (verify.py), register and spill counts without a GPU (registers.py)."""
