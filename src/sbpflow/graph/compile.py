"""The compiler's passes, in order: dead code -> ZeRO-3 prefetch window -> SBP selection -> lowering (boxing
nodes) -> pipeline -> verification.

Each pass is a function with a clear input and output; :func:`compile_graph` runs them and times each one,
since compile time is where users of graph compilers suffer first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import boxing
from .bucket import bucket_all_reduces
from .ir import LogicalGraph
from .lower import lower
from .physical import PhysicalPlan
from .pipeline import plan_pipeline
from .prefetch import renumber, window_gathers
from .select import Selection, select
from .verify import verify

ROOT_KINDS = ("assign", "output")


@dataclass
class CompileReport:
    """What the compiler did: seconds per pass, the selection's costs, node counts."""

    times: dict[str, float] = field(default_factory=dict)
    selection: Selection | None = None
    logical_nodes: int = 0
    removed_nodes: int = 0
    physical_nodes: int = 0


def eliminate_dead_code(g: LogicalGraph) -> int:
    """Drops nodes none of whose outputs reach an ``assign`` or ``output``; returns how many."""
    live: set[int] = set()
    needed: set[int] = set()
    for n in reversed(g.nodes):
        if n.kind in ROOT_KINDS or any(v in needed for v in n.outputs):
            live.add(n.id)
            needed.update(n.inputs)
    before = len(g.nodes)
    kept = [n for n in g.nodes if n.id in live]
    renumber(g, kept)
    defined = {v for n in kept for v in n.outputs}
    g.values = {vid: v for vid, v in g.values.items() if vid in defined}
    return before - len(kept)


def compile_graph(g: LogicalGraph, method: str = "ilp", model: boxing.CostModel | None = None,
                  factors: tuple[Any, ...] | None = None,
                  agree: Callable[[Any], Any] | None = None,
                  schedule: str = "1f1b", prefetch: int = 1) -> tuple[PhysicalPlan, LogicalGraph, CompileReport]:
    """Runs every pass on ``g`` (modified in place) and returns the verified physical plan; ``agree`` (see
    :func:`select`) lets processes adopt one shared SBP choice; ``schedule`` is the pipeline schedule when the
    plan has several stages (``graph.pipeline``); ``prefetch`` is the window of ZeRO-3 gathers
    (``graph.prefetch``; used only when tracing recorded gathers)."""
    from ..comm.torch_dist import TARGET_COST_FACTORS

    model = model or boxing.get_cost_model()
    factors = TARGET_COST_FACTORS if factors is None else factors
    report = CompileReport(logical_nodes=len(g.nodes))
    start = time.perf_counter()
    report.removed_nodes = eliminate_dead_code(g)
    report.times["dead code"] = time.perf_counter() - start
    if g.gathers:
        start = time.perf_counter()
        window_gathers(g, prefetch)
        report.times["prefetch"] = time.perf_counter() - start
    start = time.perf_counter()
    report.selection = select(g, model, factors, method, agree=agree)
    report.times["sbp selection"] = time.perf_counter() - start
    start = time.perf_counter()
    plan = lower(g, model, factors)
    report.times["lowering"] = time.perf_counter() - start
    start = time.perf_counter()
    plan = bucket_all_reduces(plan, model, factors)
    report.times["gradient buckets"] = time.perf_counter() - start
    start = time.perf_counter()
    plan_pipeline(plan, seed_buffers(plan, g), schedule)
    report.times["pipeline"] = time.perf_counter() - start
    start = time.perf_counter()
    verify(plan)
    report.times["verify"] = time.perf_counter() - start
    report.physical_nodes = len(plan.nodes)
    return plan, g, report


def seed_buffers(plan: PhysicalPlan, g: LogicalGraph) -> list[int]:
    """The physical buffers of the loss's implicit gradients (constants named after their value)."""
    names = {f"const{vid}" for vid in g.grad_seeds}
    return [b for n in plan.nodes if n.kind == "variable" and n.name in names for b in n.outputs]
