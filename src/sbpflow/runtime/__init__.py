"""Executors of a physical plan (:mod:`sbpflow.graph.physical`): :func:`run_plan`, node by node in list order,
the reference; and :class:`ActorRuntime`, every node an actor driven by registers and messages.
"""

from __future__ import annotations

from .actors import ActorRuntime, DeadlockError
from .inorder import ExecutionError, run_plan

__all__ = ["ActorRuntime", "DeadlockError", "ExecutionError", "run_plan"]
