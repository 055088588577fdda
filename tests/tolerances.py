"""The tests' tolerances: the one table lives in the package (moeflow/tolerances.py, with the measurements behind each
number), so that `moeflow selftest` holds a user's GPU to the numbers the suite holds the runners to."""
from moeflow.tolerances import FEW_ELEMENTS, FP8_STEP, REL_TOL, rel_tol

__all__ = ["FEW_ELEMENTS", "FP8_STEP", "REL_TOL", "rel_tol"]
