"""Executors of a physical plan (:mod:`sbpflow.graph.physical`).

* :func:`run_plan` (:mod:`.inorder`): node by node in list order, the reference;
* :class:`ActorRuntime` (:mod:`.actors`, :mod:`.board`, :mod:`.workers`): every node an actor,
  registers and ready/free messages, one thread per stream, a watchdog and a timeline (:mod:`.trace`);
* :mod:`.route`: dynamic routing (``route`` nodes: rows to group members chosen at run time);
* :mod:`.source`: source actors, which produce a plan's inputs ahead of its steps (a data loader's batches),
  bounded by their register count;
* :mod:`.builder`: hand-built plans for tests and benchmarks.
"""

from __future__ import annotations

from .actors import ActorRuntime, DeadlockError
from .inorder import ExecutionError, run_plan

__all__ = ["ActorRuntime", "DeadlockError", "ExecutionError", "run_plan"]
