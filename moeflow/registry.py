"""A name -> backend-class registry, one per pipeline stage.

Backend modules are imported by their stage's ``__init__`` and must not import optional packages
at module level (they declare them in ``caps.requires``), so a missing package never breaks
``import moeflow``: the planner refuses that backend with MF205 instead.
"""
from __future__ import annotations

from typing import Generic, TypeVar

from .errors import error

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind  # "runner" | "dispatcher" | "quant scheme" | "router"
        self._classes: dict[str, type[T]] = {}

    def register(self, cls: type[T]) -> type[T]:
        """Class decorator: ``@RUNNERS.register`` on a class with a ``name`` attribute."""
        name = cls.name
        if name in self._classes:
            raise RuntimeError(f"{self.kind} {name!r} registered twice")  # programming error, not user-facing
        self._classes[name] = cls
        return cls

    def get(self, name: str) -> type[T]:
        try:
            return self._classes[name]
        except KeyError:
            raise error("MF201", kind=self.kind, name=name, valid=self.names()) from None

    def names(self) -> list[str]:
        return list(self._classes)

    def items(self):
        return self._classes.items()

    def __contains__(self, name: str) -> bool:
        return name in self._classes
