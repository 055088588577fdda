"""Routing stage: ``ROUTERS`` registry ("torch"), ``create_router(config)``."""
from ..registry import Registry
from .base import Router
from .torch_topk import TorchTopK

ROUTERS: Registry[Router] = Registry("router")
ROUTERS.register(TorchTopK)


def create_router(config, name: str = "torch") -> Router:
    return ROUTERS.get(name)(config)


__all__ = ["ROUTERS", "Router", "create_router"]
