"""A topological order that deviates from a given priority only where dependencies force it (Kahn's algorithm,
always taking the ready node of smallest key): the reordering passes' shared core (``graph.prefetch`` on the
logical graph, ``graph.hoist`` on the physical plan).

>>> keyed_order({0: set(), 1: set(), 2: {0}}, key=lambda i: (0 if i == 2 else 1, i))
[0, 2, 1]
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable


def keyed_order(deps: dict[int, set[int]], key: Callable[[int], tuple[Hashable, ...]]) -> list[int]:
    """Every id of ``deps`` (id -> the ids it waits for) after all it waits for, each time the ready id of the
    smallest ``key`` first. AssertionError if the dependencies have a cycle."""
    readers: dict[int, list[int]] = {i: [] for i in deps}
    for i, ds in deps.items():
        for d in ds:
            readers[d].append(i)
    waiting = {i: len(ds) for i, ds in deps.items()}
    ready = [(key(i), i) for i, k in waiting.items() if k == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)[1]
        order.append(i)
        for r in readers[i]:
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, (key(r), r))
    if len(order) != len(deps):
        raise AssertionError("the dependencies have a cycle")
    return order
