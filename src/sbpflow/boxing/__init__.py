"""Boxing: converting a global tensor between SBPs and placements.

:mod:`.plan` finds the cheapest sequence of primitive steps (its module
docstring holds the transition table); :mod:`.execute` runs it on a backend.
"""

from __future__ import annotations

from .execute import execute, identity_element
from .plan import (
    CostModel,
    Layout,
    LinkCost,
    Plan,
    Step,
    cost_model,
    current_factors,
    get_cost_model,
    plan,
    target_factors,
)

__all__ = [
    "CostModel", "Layout", "LinkCost", "Plan", "Step", "cost_model", "get_cost_model", "plan", "execute",
    "target_factors", "current_factors", "identity_element",
]
