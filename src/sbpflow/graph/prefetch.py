"""The prefetch pass: ZeRO-3's parameter gathers run ahead of their units by a bounded window.

Without it a forward gather reads only a variable, so a communication thread may gather every layer at the
start of the step. Control edges bound it to ``window + 1`` units holding a gathered copy, and each gather
moves as early as those edges allow.
"""

from __future__ import annotations

from ..errors import SbpflowError
from .ir import Gather, LNode, LogicalGraph
from .order import keyed_order


def window_gathers(g: LogicalGraph, window: int) -> None:
    """Adds the window's control edges to ``g``'s gather nodes and moves each gather as early as they allow."""
    if window < 0:
        raise SbpflowError(f"ZeRO-3 prefetch window must be >= 0 layers, but got {window!r}")
    events = _live_events(g)
    if not events:
        return
    readers = g.consumers()
    gates = _gates(g, events, window, readers)
    for event, gate in zip(events, gates, strict=True):
        for node in _gather_nodes(g, event):
            node.control = gate
    _reorder(g, {n.id for e in events for n in _gather_nodes(g, e)})


def _live_events(g: LogicalGraph) -> list[Gather]:
    """The windowed gathers, each reduced to the values dead code kept."""
    out = []
    for e in g.gathers:
        values = tuple(v for v in e.values if v in g.values)
        if values and not e.nested:
            out.append(Gather(e.unit, e.backward, values, e.nested))
    return out


def _gather_nodes(g: LogicalGraph, e: Gather) -> list[LNode]:
    return [g.nodes[g.values[v].producer] for v in e.values]


def _need(e: Gather, readers: dict[int, list[int]]) -> int:
    """Position of the first node reading the event's gathered values."""
    return min((n for v in e.values for n in readers[v]), default=1 << 60)


def _gates(g: LogicalGraph, events: list[Gather], window: int, readers: dict[int, list[int]]) -> list[tuple[int, ...]]:
    """Each event's control values.

    The gathers of units that nest no other unit (the blocks) form one sequence e_0, e_1, ...: forward in
    layer order, then backward in reverse. e_i waits for every reader of e_(i-w-1)'s values, so at most w + 1
    units hold a copy (w = 1: layer k + 1 is gathered while layer k computes); a backward gather also waits
    for the gradient that reached the unit w places earlier in backward (prefetching from where backward is).
    A unit that nests others (the model) is gathered around the blocks, outside the window. The gates act
    within one micro-batch: micro-batch k + 1's first gathers may overlap k's last ones (up to twice the
    copies). Edges only come from nodes placed before the first reader of the gather they gate, so they
    cannot close a cycle (a gate reading a later value is left out, and that part of the bound unenforced)."""
    original = [tuple(sorted({c for n in _gather_nodes(g, e) for c in n.control})) for e in events]
    first_backward = next((i for i, e in enumerate(events) if e.backward), len(events))
    out = []
    for i, e in enumerate(events):
        need = _need(e, readers)
        gate: set[int] = set()
        if i - window - 1 >= 0:
            previous = events[i - window - 1]
            for n in {n for v in previous.values for n in readers[v]}:
                if n < need and g.nodes[n].outputs:
                    gate.add(g.nodes[n].outputs[0])
        if e.backward:
            gate.update(c for c in original[max(i - window, first_backward)] if g.values[c].producer < need)
        out.append(tuple(sorted(gate)))
    return out


def _reorder(g: LogicalGraph, early: set[int]) -> None:
    """A topological order of ``g`` that keeps program order, except that the ``early`` nodes come as soon as
    their inputs and control values exist; node ids are renumbered to the new positions."""
    deps = {n.id: {g.values[v].producer for v in (*n.inputs, *n.control)} for n in g.nodes}
    try:
        order = [g.nodes[i] for i in keyed_order(deps, lambda i: (-1 if i in early else i,))]
    except AssertionError:
        raise AssertionError("the prefetch pass closed a cycle of control edges") from None
    renumber(g, order)


def renumber(g: LogicalGraph, nodes: list[LNode]) -> None:
    """Makes ``nodes`` the graph's program order, ids equal to positions."""
    for i, n in enumerate(nodes):
        n.id = i
        for v in n.outputs:
            g.values[v].producer = i
    g.nodes = nodes
