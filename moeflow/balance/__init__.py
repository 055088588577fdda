"""Expert-parallel load balancing: redundant experts (replicas), load statistics, rebalancing without a restart.

    placement.py  Placement: physical slot -> (logical expert, rank), validated (MF510)
    slots.py      on the device: to_slots (the replica rule), count_copies (the load counter), ExpertSlots
    plan.py       plan_placement (EPLB-style: replicate the heaviest, pack evenly), rank_loads, imbalance
    rebalance.py  MoE.rebalance (collective weight moves, MF511), MoE.expert_load, replicas' weights
docs/load-balancing.md says how they fit together.
"""
from .placement import Placement
from .plan import imbalance, plan_placement, rank_loads
from .slots import count_copies, to_slots

__all__ = ["Placement", "count_copies", "imbalance", "plan_placement", "rank_loads", "to_slots"]
