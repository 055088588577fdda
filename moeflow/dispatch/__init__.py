"""Dispatch stage: ``DISPATCHERS`` registry and ``create_dispatcher``.

Backends: "local" (one process). Expert-parallel dispatchers register here too.
"""
from ..registry import Registry
from .base import Dispatcher
from .local import LocalDispatcher

DISPATCHERS: Registry[Dispatcher] = Registry("dispatcher")
DISPATCHERS.register(LocalDispatcher)


def create_dispatcher(name, config, scheme, process_group=None) -> Dispatcher:
    return DISPATCHERS.get(name)(config, scheme, process_group)


__all__ = ["DISPATCHERS", "Dispatcher", "create_dispatcher"]
