"""Expert-runner stage: ``RUNNERS`` registry and ``create_runner``.

Backends: "reference" (torch loop, any device: the oracle), "grouped_mm" (torch grouped GEMMs),
and "triton" when its module is present. Capabilities are declared on each class (``caps``).
"""
from ..registry import Registry
from .base import ExpertRunner, ExpertWeights, gated_activation
from .grouped_mm import GroupedMMRunner
from .reference import ReferenceRunner

RUNNERS: Registry[ExpertRunner] = Registry("runner")
for _cls in (ReferenceRunner, GroupedMMRunner):
    RUNNERS.register(_cls)
RUNNERS.register(__import__(f"{__name__}.triton", fromlist=["TritonRunner"]).TritonRunner)  # imports no triton


def create_runner(name, config, scheme) -> ExpertRunner:
    return RUNNERS.get(name)(config, scheme)


__all__ = ["RUNNERS", "create_runner", "ExpertRunner", "ExpertWeights", "gated_activation"]
