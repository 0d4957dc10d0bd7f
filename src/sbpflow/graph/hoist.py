"""Collectives on the step's data alone go out first: a pass over the physical plan's order.

Some collectives read only the step's inputs (a loss's count of kept labels, a batch gathered for a weight
gradient). Traced in place, they make every rank wait for the slowest mid-step; issued as soon as their
inputs exist, they are done long before they are read.
"""

from __future__ import annotations

from dataclasses import replace

from .lower import registers
from .order import keyed_order
from .physical import PHASES, PhysicalPlan, PNode

SOURCES = ("input", "unpack")  # what the step's data enters by
MOVABLE = ("compute", "boxing")
COMMUNICATING = ("boxing", "route")


def issue_data_collectives(plan: PhysicalPlan) -> PhysicalPlan:
    """``plan`` with its collectives on data alone, and their producers, as early as their inputs allow.

    They go ahead of the other collectives, and each kind keeps its order among itself, so every group's
    members still issue one sequence (the verifier checks it); every other node keeps its relative order.
    Only for plans without a pipeline, whose schedule fixes the order of its streams' acts."""
    nodes = _ordered(plan.nodes)
    if [n.id for n in nodes] == [n.id for n in plan.nodes]:
        return plan
    out = replace(plan, nodes=nodes, registers={})
    out.registers = registers(out)
    return out


def _ordered(nodes: list[PNode]) -> list[PNode]:
    """A topological order that prefers the early nodes, then plan order.

    >>> from sbpflow.graph.physical import PNode
    >>> nodes = [PNode(0, "input", "y", (), (0,), (0, 1)), PNode(1, "compute", "w", (), (1,), (0, 1)),
    ...          PNode(2, "compute", "matmul", (1,), (2,), (0, 1)), PNode(3, "compute", "ne", (0,), (3,), (0, 1)),
    ...          PNode(4, "boxing", "all_gather", (3,), (4,), (0, 1)), PNode(5, "compute", "div", (2, 4), (5,), (0, 1))]
    >>> [n.name for n in _ordered(nodes)]
    ['y', 'ne', 'all_gather', 'w', 'matmul', 'div']
    """
    early = _early(nodes)
    if not early:
        return nodes
    producer = {b: n.id for n in nodes for b in n.outputs}
    position = {n.id: i for i, n in enumerate(nodes)}
    deps = {n.id: {producer[b] for b in n.inputs if b in producer} | set(n.control) for n in nodes}
    comm = [n.id for n in nodes if n.kind in COMMUNICATING]
    for chain in ([i for i in comm if i in early], [i for i in comm if i not in early]):
        for before, after in zip(chain, chain[1:], strict=False):  # each kind keeps its order
            deps[after].add(before)
    by_id = {n.id: n for n in nodes}
    return [by_id[i] for i in keyed_order(
        deps, lambda i: (PHASES.index(by_id[i].phase), 0 if i in early else 1, position[i]))]


def _early(nodes: list[PNode]) -> set[int]:
    """Ids of the micro-batch collectives made from the step's data alone, and of the nodes that make their
    inputs, unpacks included (nothing upstream of them reads a variable)."""
    made_by = {b: n for n in nodes for b in n.outputs}
    data: set[int] = set()  # buffers derived from inputs alone
    for n in nodes:
        if n.kind in SOURCES or (n.kind in MOVABLE and n.phase == "micro" and n.inputs and not n.control
                                 and all(b in data for b in n.inputs)):
            data.update(n.outputs)
    early: set[int] = set()
    stack = [n for n in nodes if n.kind == "boxing" and n.outputs and n.outputs[0] in data]
    while stack:
        n = stack.pop()
        if n.id in early or n.kind == "input":  # an input acts before every micro-batch anyway
            continue
        early.add(n.id)  # an unpack (a micro-batch's slice of an input) moves up with its readers
        if n.kind != "unpack":
            stack.extend(made_by[b] for b in n.inputs)
    return early
