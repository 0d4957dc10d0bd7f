"""Repeated structure in a logical graph: which op nodes may share one SBP choice.

A 24-layer transformer traces the same block 24 times; nodes whose bounded neighbourhoods look alike
(colour refinement, 1-dimensional Weisfeiler-Leman) share one set of variables in the integer program
(:mod:`.select`), so it has about one block's variables.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from .ir import LNode, LogicalGraph

ROUNDS = 2  # neighbourhood depth: separates roles inside a transformer block and merges the rest


def op_classes(g: LogicalGraph, own: Callable[[LNode], Hashable], rounds: int = ROUNDS) -> dict[int, int]:
    """Op node id -> class id (the smallest node id in its class); ``own(n)`` is an op node's round-0 data.

    Round 0 colours a node by what decides its candidate signatures and costs (op, attributes, argument and
    output metadata, placement, current choice; fixed nodes by metadata and layout, never by name). Each round
    adds its inputs' producers' colours (with output index) and its consumers' colours (with input slot).
    Refined to the end this would tell every block apart (each is a different distance from the embedding);
    bounded, it separates roles inside a block and the blocks near the ends, and merges the rest. Tying only
    restricts the program, so :func:`.select.select` keeps a merged result only when it beats the greedy one."""
    colour = _intern_all(_initial(g, n, own) for n in g.nodes)
    readers = _readers(g)
    for _ in range(rounds):
        refined = _intern_all(_neighbourhood(g, n, colour, readers) for n in g.nodes)
        if len(set(refined)) == len(set(colour)):
            break  # stable: further rounds split nothing
        colour = refined
    first: dict[int, int] = {}
    out = {}
    for n in g.nodes:
        if n.kind == "op":
            out[n.id] = first.setdefault(colour[n.id], n.id)
    return out


def _initial(g: LogicalGraph, n: LNode, own: Callable[[LNode], Hashable]) -> Hashable:
    if n.kind == "op":
        return ("op", own(n))
    outs = tuple(_meta(g, v) for v in n.outputs)
    return (n.kind, n.phase, outs, tuple(n.in_sbps), tuple(_meta(g, v) for v in n.inputs))


def _meta(g: LogicalGraph, vid: int) -> tuple[Any, ...]:
    v = g.values[vid]
    return (v.shape, v.dtype, v.placement, v.sbp)


def _readers(g: LogicalGraph) -> dict[int, list[tuple[int, int]]]:
    """Value id -> (consumer node id, input slot) for each read."""
    out: dict[int, list[tuple[int, int]]] = {}
    for n in g.nodes:
        for slot, vid in enumerate(n.inputs):
            out.setdefault(vid, []).append((n.id, slot))
    return out


def _neighbourhood(g: LogicalGraph, n: LNode, colour: list[int],
                   readers: dict[int, list[tuple[int, int]]]) -> Hashable:
    ins = tuple((colour[g.values[v].producer] if g.values[v].producer >= 0 else -1, g.values[v].index)
                for v in n.inputs)
    outs = tuple(sorted((colour[c], j) for j, v in enumerate(n.outputs) for c, _ in readers.get(v, ())))
    return (colour[n.id], ins, outs)


def _intern_all(keys: Any) -> list[int]:
    """Each key -> a small int, equal keys equal ints (in order of first appearance)."""
    table: dict[Hashable, int] = {}
    return [table.setdefault(k, len(table)) for k in keys]
