"""Routing stage: ``ROUTERS`` registry ("torch", "triton"), ``create_router(config, name)``.
The plan picks the router (planner.check_router: the valid router of highest priority)."""
from ..registry import Registry
from .base import Router
from .torch_topk import TorchTopK
from .triton_topk import TritonTopK

ROUTERS: Registry[Router] = Registry("router")
ROUTERS.register(TorchTopK)
ROUTERS.register(TritonTopK)


def create_router(config, name: str) -> Router:
    """The router ``name`` for ``config`` (a layer takes ``Plan.router``)."""
    return ROUTERS.get(name)(config)


__all__ = ["ROUTERS", "Router", "create_router"]
