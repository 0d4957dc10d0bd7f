"""Accumulate before sending: a gradient summed across pipeline stages crosses them once per step.

A parameter read on two stages (an embedding tied to the head) gets a gradient part on each, and autograd
sums them where it lives, so the far part is sent every micro-batch::

    micro:  u = to_global(b)        # b on stage j, u on the parameter's stage i: m sends per step
            c = add(a, u)
    post:   g = accumulate(c)

Boxing is linear, so each stage accumulates its own part and the far part crosses once (as Megatron sums a
tied embedding's gradient)::

    post:   A = accumulate(a)       # on stage i
            B = accumulate(b)       # on stage j
            g = add(A, to_global(B))
"""

from __future__ import annotations

from dataclasses import dataclass

from .ir import LNode, LogicalGraph, Value
from .prefetch import renumber

ADD_ARGS = (("t", 0), ("t", 1))


@dataclass(frozen=True)
class _Match:
    """One ``accumulate([to_global](add(a, to_global(b))))`` whose inner to_global crosses placements; ``far``
    is its output's position in the add, ``layout`` the outer conversion on the add's placement (if any)."""

    accumulate: LNode
    add: LNode
    send: LNode  # the to_global node
    far: int
    layout: LNode | None


def accumulate_before_send(g: LogicalGraph) -> int:
    """Rewrites every cross-stage gradient sum in ``g`` (in place) to send once per step; returns how many.

    It runs before SBP selection, so the new post-phase nodes get their SBPs and boxing like any other. Only
    conversions between disjoint placements (pipeline stages) are rewritten; sums differ only by rounding.

    >>> from sbpflow.graph.ir import LogicalGraph
    >>> accumulate_before_send(LogicalGraph(micro_batches=4))
    0
    """
    if g.micro_batches == 1:
        return 0
    done = 0
    while True:  # until nothing matches: a parameter read on three stages sends both far parts once
        matches = _matches(g)
        if not matches:
            return done
        _rewrite(g, matches)
        done += len(matches)


def _matches(g: LogicalGraph) -> list[_Match]:
    consumers = g.consumers()
    out = []
    for acc in g.of_kind("accumulate"):
        layout, add = _through_layout(g, acc, consumers)
        reader = layout or acc
        if acc.name != "sum" or add is None or not _is_micro_add(add) or consumers[add.outputs[0]] != [reader.id]:
            continue
        for far, u in enumerate(add.inputs):
            send = _producer(g, u)
            if send is not None and consumers[u] == [add.id] and _crosses_stages(g, send):
                out.append(_Match(acc, add, send, far, layout))
                break
    return out


# Autograd may convert the sum to the parameter's own layout (accumulate(to_global(c))): that conversion moves
# after the accumulation too.
def _through_layout(g: LogicalGraph, acc: LNode, consumers: dict[int, list[int]]) -> tuple[LNode | None, LNode | None]:
    """The accumulated value's producer, seen through one micro-batch ``to_global`` on its own placement (autograd
    converting a gradient to its parameter's layout): (that to_global or None, the producer behind it)."""
    n = _producer(g, acc.inputs[0])
    if n is None or n.kind != "to_global" or n.phase != "micro" or n.control or consumers[n.outputs[0]] != [acc.id]:
        return None, n
    if g.values[n.inputs[0]].placement != g.values[n.outputs[0]].placement:
        return None, n
    return n, _producer(g, n.inputs[0])


def _producer(g: LogicalGraph, vid: int) -> LNode | None:
    p = g.values[vid].producer
    return g.nodes[p] if p >= 0 else None


def _is_micro_add(n: LNode) -> bool:
    return (n.kind == "op" and n.name == "add" and n.phase == "micro" and not n.attrs and not n.control
            and n.args == ADD_ARGS and len(set(n.inputs)) == 2)


def _crosses_stages(g: LogicalGraph, n: LNode) -> bool:
    """A micro-batch ``to_global`` of a micro-batch value between placements with no rank in common."""
    if n.kind != "to_global" or n.phase != "micro" or n.control:
        return False
    src = _producer(g, n.inputs[0])
    if src is None or src.phase != "micro":
        return False
    before = g.values[n.inputs[0]].placement.flat_ranks
    after = g.values[n.outputs[0]].placement.flat_ranks
    return not set(before) & set(after)


def _rewrite(g: LogicalGraph, matches: list[_Match]) -> None:
    """Puts each match's post-phase nodes where its accumulate was; drops its micro add and to_global."""
    replaced = {m.accumulate.id: _post_nodes(g, m) for m in matches}
    gone = [n for m in matches for n in (m.add, m.send, m.layout) if n is not None]
    dropped = {n.id for n in gone}
    for n in gone:
        for vid in n.outputs:
            del g.values[vid]
    nodes: list[LNode] = []
    for n in g.nodes:
        if n.id in replaced:
            nodes.extend(replaced[n.id])
        elif n.id not in dropped:
            nodes.append(n)
    renumber(g, nodes)
    for n in nodes:
        for i, vid in enumerate(n.outputs):
            g.values[vid].index = i


def _post_nodes(g: LogicalGraph, m: _Match) -> list[LNode]:
    """accumulate(a), accumulate(b), to_global(B), add(A, U) (in the add's argument order) and the conversion to
    the parameter's layout, if any, in post."""
    near = m.add.inputs[1 - m.far]
    sum_near, sum_far = _like(g, near), _like(g, m.send.inputs[0])
    sent = _like(g, m.send.outputs[0])
    total = _like(g, m.add.outputs[0]).id if m.layout is not None else m.accumulate.outputs[0]
    ins = [0, 0]
    ins[m.far], ins[1 - m.far] = sent.id, sum_near.id
    nodes = [
        LNode(0, "accumulate", "sum", (near,), (sum_near.id,), phase="post", fixed=True),
        LNode(0, "accumulate", "sum", (m.send.inputs[0],), (sum_far.id,), phase="post", fixed=True),
        _to_global(m.send, sum_far.id, sent.id),
        LNode(0, "op", "add", (ins[0], ins[1]), (total,), args=m.add.args, in_sbps=m.add.in_sbps,
              phase="post", where=m.add.where),
    ]
    if m.layout is not None:
        nodes.append(_to_global(m.layout, total, m.accumulate.outputs[0]))
    return nodes


def _to_global(like: LNode, src: int, out: int) -> LNode:
    return LNode(0, "to_global", like.name, (src,), (out,), phase="post", where=like.where, fixed=True)


def _like(g: LogicalGraph, vid: int) -> Value:
    """A new value with ``vid``'s shape, dtype, placement and SBP."""
    v = g.values[vid]
    new = Value(max(g.values) + 1, v.shape, v.dtype, v.placement, v.sbp)
    g.values[new.id] = new
    return new
