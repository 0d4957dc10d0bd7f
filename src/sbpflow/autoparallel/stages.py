"""Pipeline stage cuts: a dynamic program over layer boundaries, in the style of Alpa's inter-op pass.

Alpa (Zheng et al., OSDI'22, §5.1) minimises a pipeline's latency ``Σ t_i + (m - 1) · max t_i`` by
enumerating ``max t_i`` and solving a DP for ``Σ t_i`` under it. Here every block of the transformer costs
the same on every stage, and what a stage adds beyond its blocks (embedding, output layer, sends) is fixed
by its position, so ``Σ t_i`` is the same for every cut: minimising the slowest stage is then exact, which
one DP does directly:

    best[s][j] = min over k of max(best[s-1][j-k], t_s(k)),   stage s holding blocks j-k .. j-1

restricted to the ``k`` whose memory fits (a stage early in a 1F1B pipeline holds more micro-batches in
flight, so the memory limit differs per stage, which is why the cuts need not be even).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np

from .predict import PlanCosts


def cut_stages(costs: PlanCosts) -> tuple[int, ...] | None:
    """Blocks per stage that minimise the slowest stage with every stage in memory; None when none fits."""
    layers, stages = costs.spec.layers, costs.plan.pp
    best = np.full(layers + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((stages, layers + 1), dtype=np.int64)
    for stage in range(stages):
        times, fits = _stage_table(costs, stage)
        best = _relax(best, times, fits, choice[stage])
    if not np.isfinite(best[layers]):
        return None
    return _unwind(choice, layers)


def _stage_table(costs: PlanCosts, stage: int) -> tuple[np.ndarray, np.ndarray]:
    """Time and fit of ``stage`` holding 0..l blocks. Both are affine in the block count (each block adds
    the same seconds, parameters and activations), so two evaluations give the whole table."""
    blocks = np.arange(costs.spec.layers + 1)
    t0, t1 = costs.stage_cost(stage, 0).total, costs.stage_cost(stage, 1).total
    m0 = sum(costs.stage_memory(stage, 0).values())
    m1 = sum(costs.stage_memory(stage, 1).values())
    memory = m0 + blocks * (m1 - m0)
    return t0 + blocks * (t1 - t0), memory <= costs.cluster.profile.usable_memory


def _relax(best: np.ndarray, times: np.ndarray, fits: np.ndarray, choice: np.ndarray) -> np.ndarray:
    """One stage more: for each prefix of ``j`` blocks, the best split of it into the stages so far
    (all prefixes at once: row ``j``, column ``k - 1`` is the new stage taking ``k`` blocks)."""
    layers = len(best) - 1
    j = np.arange(layers + 1)[:, None]
    k = np.arange(1, layers + 1)[None, :]
    candidate = np.maximum(best[np.clip(j - k, 0, None)], times[k])
    candidate[(k > j) | ~fits[k]] = np.inf
    pick = np.argmin(candidate, axis=1)
    choice[:] = pick + 1
    return candidate[np.arange(layers + 1), pick]


def _unwind(choice: np.ndarray, layers: int) -> tuple[int, ...]:
    sizes = []
    j = layers
    for stage in range(len(choice) - 1, -1, -1):
        k = int(choice[stage][j])
        sizes.append(k)
        j -= k
    return tuple(sizes[::-1])


def all_cuts(layers: int, stages: int) -> Iterator[tuple[int, ...]]:
    """Every way to give ``stages`` contiguous stages at least one block each (for checking the DP).

    >>> list(all_cuts(3, 2))
    [(1, 2), (2, 1)]
    """
    for bounds in itertools.combinations(range(1, layers), stages - 1):
        edges = (0, *bounds, layers)
        yield tuple(b - a for a, b in itertools.pairwise(edges))
