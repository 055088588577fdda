"""Integrations with model libraries. Importing this package imports no model library.

* ``moeflow.integrations.hf`` — Hugging Face transformers (optional: ``pip install moeflow[transformers]``):
  the experts implementation "moeflow", whole-block replacement, FP8 checkpoints.
* ``moeflow.integrations.path`` — moeflow's planned dispatcher + runner on weights the caller owns.

``install_import_hooks()`` runs once on ``import moeflow``, so that afterwards
``from_pretrained(..., experts_implementation="moeflow")`` works with no other call.
"""
from __future__ import annotations

import importlib.abc
import sys
import warnings

# module name -> function registering moeflow with the interface that module defines
_WATCHED = ("transformers.integrations.moe", "transformers.integrations.finegrained_fp8")


def _on_import(module_name: str) -> None:
    try:
        from .hf import register_module
        register_module(module_name)
    except Exception as exc:  # a registration failure must never break importing transformers
        warnings.warn(f"moeflow could not register its experts implementation with {module_name}: {exc}",
                      stacklevel=2)


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then registers moeflow with the freshly executed module."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _on_import(module.__name__)

    def __getattr__(self, name):  # get_source, get_filename, is_package, ...: the real loader's
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """A post-import hook for the watched modules only; every other import is left alone."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


_FINDER = _Finder()


def install_import_hooks() -> None:
    """Register with transformers' experts interfaces now if they are imported, else when they are.

    Importing transformers' experts modules costs seconds, so nothing is imported here: when
    ``transformers.integrations.moe`` or ``transformers.integrations.finegrained_fp8`` is (or already was)
    imported, moeflow registers its experts implementation with the interface defined there.
    Idempotent; costs nothing when transformers is never imported.
    """
    for name in _WATCHED:
        if name in sys.modules:
            _on_import(name)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
