"""A name -> backend-class registry, one per pipeline stage.

Backend modules are imported by their stage's ``__init__`` and must not import optional packages
at module level (they declare them in ``caps.requires``), so a missing package never breaks
``import moeflow``: the planner refuses that backend with MF205 instead.
"""
from __future__ import annotations

from typing import Generic, TypeVar

from .errors import error

T = TypeVar("T")
_ALL: list[Registry] = []  # every stage's registry, in creation order


def device_types() -> list[str]:
    """The device types on which every stage whose backends declare devices (``caps.devices``: routers, dispatchers,
    runners) has a backend: where a layer can run at all."""
    stages = [set().union(*(cls.caps.devices for cls in r._classes.values())) for r in _ALL
              if r._classes and all(hasattr(cls.caps, "devices") for cls in r._classes.values())]
    return sorted(set.intersection(*stages)) if stages else []


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind  # "runner" | "dispatcher" | "quant scheme" | "router"
        self._classes: dict[str, type[T]] = {}
        _ALL.append(self)

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
