"""Collectives on the step's data alone go out first: a pass over the physical plan's order.

Some collectives read nothing but the step's inputs: the global mean of a loss with ``ignore_index`` counts the
kept labels of every rank (an all-gather or all-reduce of a mask made from the targets), whatever the model
computes. Traced in place, such a collective sits at the end of the forward pass, and its reader waits there for
the slowest rank to reach it: a synchronisation in the middle of every step, which data parallelism otherwise has
only at its end (a rank that ran ahead idles, and the jitter of both halves of the step adds up). Likewise a
batch the selection gathers for a weight gradient (the dp2 MLP's first layer, computed whole from the gathered
batch and gradient): traced in place, it goes out at the end of backward, queued with the gradient all-reduces
and the other gather. Issued as soon as its inputs exist, such a collective is done long before it is read.

:func:`issue_data_collectives` moves every micro-batch collective whose inputs derive from inputs alone, with the
nodes that make them, to the earliest place their dependencies allow: ahead of the other collectives, which keep
their order among themselves, as these do. The plan is every process's, so every group's members still issue one
sequence (the verifier checks it). Every other node keeps its relative order (a topological sort that prefers
those nodes, then plan order). It runs only on plans without a pipeline: a pipeline's schedule fixes the order
of its streams' acts.

>>> from sbpflow.graph.physical import Buf, PNode
>>> nodes = [PNode(0, "input", "y", (), (0,), (0, 1)), PNode(1, "compute", "w", (), (1,), (0, 1)),
...          PNode(2, "compute", "matmul", (1,), (2,), (0, 1)), PNode(3, "compute", "ne", (0,), (3,), (0, 1)),
...          PNode(4, "boxing", "all_gather", (3,), (4,), (0, 1)), PNode(5, "compute", "div", (2, 4), (5,), (0, 1))]
>>> [n.name for n in _ordered(nodes)]
['y', 'ne', 'all_gather', 'w', 'matmul', 'div']
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
    """``plan`` with its collectives on data alone, and their producers, as early as their inputs allow."""
    nodes = _ordered(plan.nodes)
    if [n.id for n in nodes] == [n.id for n in plan.nodes]:
        return plan
    out = replace(plan, nodes=nodes, registers={})
    out.registers = registers(out)
    return out


def _ordered(nodes: list[PNode]) -> list[PNode]:
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
