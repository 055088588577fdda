"""``require_transformers``: the one import of transformers behind every function that needs it (MF701 without)."""
from __future__ import annotations

import importlib

from ...errors import error


def require_transformers(what: str):
    """Import and return transformers, or raise MF701 naming ``what`` needed it."""
    try:
        return importlib.import_module("transformers")
    except Exception as exc:
        raise error("MF701", what=what, why=f"{type(exc).__name__}: {exc}") from None
