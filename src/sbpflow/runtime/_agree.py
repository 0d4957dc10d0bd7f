"""Processes must run one plan: a check before the first act, so a disagreement is an error, not a gloo abort.

Each process compiles its own copy of the plan; copies that differ (a solver breaking ties differently
under load, a shape that differs on one rank) issue mismatched collectives, which gloo aborts on and NCCL
hangs on.
"""

from __future__ import annotations

import hashlib

from ..comm import Backend, SimulatedBackend
from ..graph.physical import PhysicalPlan, PNode
from .errors import ExecutionError


def check_same_plan(plan: PhysicalPlan, backend: Backend) -> None:
    """Raises ExecutionError naming the first node on which the processes' plans differ (collective over all
    processes; a no-op on virtual ranks, where one process holds the plan).

    One ``all_gather_object`` of a digest when the runtime is built; only on a mismatch are the node lists
    exchanged, to name the first difference."""
    import torch.distributed as dist

    if isinstance(backend, SimulatedBackend) or not dist.is_available() or not dist.is_initialized():
        return
    lines = [f"{plan.micro_batches} micro-batches"] + [describe(plan, n) for n in plan.nodes if communicates(n)]
    digest = hashlib.sha1("\n".join(lines).encode()).hexdigest()
    digests: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) == 1:
        return
    sides: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(sides, lines)
    raise ExecutionError(first_difference([list(s) for s in sides if isinstance(s, list)]))


# What must agree is what crosses processes: the communication nodes in plan order, with their ranks, streams and
# buffers. Compute nodes and local boxing steps may differ (two equally cheap local layouts that meet again before
# any collective).
def communicates(node: PNode) -> bool:
    if node.kind == "route":
        return True
    return node.kind == "boxing" and node.boxing is not None and bool(node.boxing.collectives())


def describe(plan: PhysicalPlan, node: PNode) -> str:
    """What must agree across processes about one node: its kind, op, ranks, stream and buffers' layouts."""
    bufs = ", ".join(str(plan.bufs[b]) for b in node.inputs + node.outputs)
    return f"{node.label()} op={node.op} ranks={list(node.ranks)} {node.phase} {node.stream} [{bufs}]"


def first_difference(sides: list[list[str]]) -> str:
    """The message for processes whose node lists differ: the first index where they do, each rank's side."""
    length = max(len(s) for s in sides)
    for i in range(length):
        seen = [s[i] if i < len(s) else "(no node)" for s in sides]
        if len(set(seen)) > 1:
            lines = [f"  rank {r}: {line}" for r, line in enumerate(seen)]
            return ("the processes compiled different physical plans, so their collectives would not match; "
                    f"the plans first differ at entry {i} of {length} (micro-batches, then communication nodes):\n"
                    + "\n".join(lines))
    return "the processes compiled different physical plans (different numbers of communication nodes)"
