"""The compiler: runs the passes in order, from a traced logical graph to a verified physical plan, and times
each one, since compile time is where the users of graph compilers suffer first.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .. import boxing
from ..comm.base import TARGET_COST_FACTORS
from ..errors import AutogradError
from .accumulate import accumulate_before_send
from .bucket import bucket_all_reduces
from .fuse import fuse_segments
from .gather_bucket import bucket_all_gathers
from .group import group_accumulates
from .hoist import issue_data_collectives
from .ir import LogicalGraph
from .late_reduce import reduce_after_accumulating
from .lower import donate_inputs, lower
from .physical import PhysicalPlan
from .pipeline import plan_pipeline
from .prefetch import renumber, window_gathers
from .select import Selection, select
from .update_split import update_per_bucket
from .verify import verify

ROOT_KINDS = ("assign", "output")


@dataclass
class CompileReport:
    """What the compiler did: seconds per pass (wall clock, and CPU of this process, which a loaded machine
    inflates less), the selection's costs, node counts."""

    times: dict[str, float] = field(default_factory=dict)
    cpu_times: dict[str, float] = field(default_factory=dict)
    selection: Selection | None = None
    logical_nodes: int = 0
    removed_nodes: int = 0
    physical_nodes: int = 0

    @contextmanager
    def timing(self, name: str) -> Iterator[None]:
        """Times the block as pass ``name``."""
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.times[name] = time.perf_counter() - wall
            self.cpu_times[name] = time.process_time() - cpu


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block. Tracing and compiling make millions of short-lived
    tuples (keys, signatures), which set off collections that rescan the whole heap (every module, tensor and
    graph node) many times; refcounting frees them all the same, and one collection may follow."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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
    seeds = [v for v in g.grad_seeds if v in defined]
    if g.grad_seeds and not seeds:
        raise AutogradError("build() calls backward(), but nothing reads the gradients it computes: nn.Graph keeps "
                            "no .grad of its own; add an optimizer (add_optimizer) or return the gradients you need")
    g.grad_seeds = seeds
    return before - len(kept)


@dataclass(frozen=True)
class CompileOptions:
    """Which passes run and how (nn.Graph builds one from its GraphConfig)."""

    method: str = "ilp"  # SBP selection: "ilp" or the greedy "eager" baseline (graph.select)
    schedule: str = "1f1b"  # the pipeline schedule when the plan has several stages (graph.pipeline)
    prefetch: int = 1  # the window of ZeRO-3 gathers, used only when tracing recorded gathers (graph.prefetch)
    fused_segments: bool = True  # each run of plain compute nodes becomes one node of generated code (graph.fuse)
    torch_compile: bool = False  # fused segments run under torch.compile
    group: bool = True  # one accumulate node sums the gradients one act of the schedule makes (graph.group)
    late_reduce: bool = True  # all-reduce a data-parallel gradient once a step, after its micro-batches (late_reduce)
    split_updates: bool = True  # cut a multi-tensor update by the collective each parameter waits for (update_split)
    gather_buckets: bool = True  # ZeRO's updated shards all-gathered in flat buckets, not one by one (gather_bucket)
    # bytes per rank of the activations kept for backward that the SBP selection may choose: None (no bound),
    # "traced" (no more than the traced layouts keep) or an int (graph.select's activation_cap)
    activation_cap: int | str | None = None


def compile_graph(g: LogicalGraph, options: CompileOptions | None = None, model: boxing.CostModel | None = None,
                  factors: tuple[Any, ...] | None = None,
                  agree: Callable[[Any], Any] | None = None) -> tuple[PhysicalPlan, LogicalGraph, CompileReport]:
    """Runs every pass on ``g`` (modified in place) as ``options`` say and returns the verified physical plan;
    ``agree`` (see :func:`select`) lets processes adopt one shared SBP choice."""
    opts = options or CompileOptions()
    method, schedule, prefetch = opts.method, opts.schedule, opts.prefetch
    model = model or boxing.get_cost_model()
    factors = TARGET_COST_FACTORS if factors is None else factors
    report = CompileReport(logical_nodes=len(g.nodes))
    with gc_paused():
        with report.timing("dead code"):
            report.removed_nodes = eliminate_dead_code(g)
        with report.timing("accumulate before send"):
            accumulate_before_send(g)
        if g.gathers:
            with report.timing("prefetch"):
                window_gathers(g, prefetch)
        with report.timing("sbp selection"):
            report.selection = select(g, model, factors, method, agree=agree, activation_cap=opts.activation_cap)
        with report.timing("lowering"):
            plan = lower(g, model, factors)
        if opts.late_reduce:
            with report.timing("reduce after accumulating"):
                plan = reduce_after_accumulating(plan, model)
        with report.timing("gradient buckets"):
            plan = donate_inputs(bucket_all_reduces(plan, model, factors))
        if opts.split_updates:
            with report.timing("updates per bucket"):
                plan = update_per_bucket(plan)
        if opts.gather_buckets:
            with report.timing("gather buckets"):
                plan = bucket_all_gathers(plan, model, factors)
        with report.timing("pipeline"):
            plan_pipeline(plan, seed_buffers(plan, g), schedule)
        if opts.group:
            with report.timing("grouped accumulation"):
                plan = group_accumulates(plan)
        if plan.pipeline is None:  # a pipeline's registers and schedule are sized on its order as it is
            with report.timing("data collectives first"):
                plan = issue_data_collectives(plan)
        if opts.fused_segments:
            with report.timing("fused segments"):
                plan = fuse_segments(plan, opts.torch_compile)
        with report.timing("verify"):
            verify(plan)
    report.physical_nodes = len(plan.nodes)
    return plan, g, report


def seed_buffers(plan: PhysicalPlan, g: LogicalGraph) -> list[int]:
    """The physical buffers of the loss's implicit gradients (constants named after their value)."""
    names = {f"const{vid}" for vid in g.grad_seeds}
    return [b for n in plan.nodes if n.kind == "variable" and n.name in names for b in n.outputs]
