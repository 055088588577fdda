"""Set up Triton's CPU interpreter for the interpreter tests (tests/kernels/ and others).

Import this module before anything imports moeflow.kernels: @triton.jit reads TRITON_INTERPRET
when a kernel is defined. ``SKIP_REASON`` is None when the interpreter tests can run here.

Also works around one incompatibility of triton 3.6's interpreter with numpy >= 2.4: it keeps
scalar kernel arguments as 1-element arrays and converts them with int(array), which numpy 2.4
refuses for arrays of ndim > 0 ("only 0-dimensional arrays can be converted to Python scalars"),
so every `range(runtime_int)` in a kernel failed. The patch converts through ``.item()``.
"""
import importlib.util
import os

import torch

SKIP_REASON = None
if importlib.util.find_spec("triton") is None:
    SKIP_REASON = "triton is not installed (pip install 'moeflow[triton]')"
elif torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    SKIP_REASON = "a GPU is present: these are the CPU-interpreter tests; tests/gpu/ covers the GPU"
else:
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime import interpreter as _interp

    _original = _interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0].item()))

    if not getattr(_interp, "_moeflow_patched", False):
        _interp._patch_lang_tensor = _patch_lang_tensor
        _interp._moeflow_patched = True
