"""The general send/recv's statistics, computed on arrays, equal what listing its pieces gives."""

from __future__ import annotations

import random

import sbpflow
from sbpflow._layout import box_shape, numel
from sbpflow.boxing import Layout
from sbpflow.boxing.plan import _transfer_stats, transfer_pieces, transfer_stats
from sbpflow.sbp import broadcast, split

MESHES = [[0, 1], [0, 1, 2], [[0, 1], [2, 3]], [[0, 1, 2], [3, 4, 5]], [[4, 5], [6, 7]], [1, 2, 3, 4, 5],
          [[0, 1, 2, 3], [4, 5, 6, 7]]]


def _listed(shape: tuple[int, ...], itemsize: int, src: Layout, dst: Layout) -> tuple[int, int, int]:
    traffic: dict[tuple[str, int], int] = {}
    messages: dict[tuple[str, int], int] = {}
    for s, d, box in transfer_pieces(shape, src, dst):
        if s == d:
            continue
        size = numel(box_shape(box)) * itemsize
        for key in (("out", s), ("in", d)):
            traffic[key] = traffic.get(key, 0) + size
            messages[key] = messages.get(key, 0) + 1
    total = sum(v for (way, _), v in traffic.items() if way == "in")
    return total, max(traffic.values(), default=0), max(messages.values(), default=0)


def test_array_statistics_equal_the_listed_pieces() -> None:
    rng = random.Random(0)
    for _ in range(600):
        shape = tuple(rng.randint(0, 7) for _ in range(rng.randint(0, 3)))
        a = sbpflow.placement("cpu", rng.choice(MESHES))
        b = rng.choice([a, sbpflow.placement("cpu", rng.choice(MESHES))])
        src, dst = (Layout(p, tuple(rng.choice([broadcast] + [split(d) for d in range(len(shape))])
                                    for _ in range(p.ndim))) for p in (a, b))
        assert _transfer_stats(shape, 4, src, dst) == _listed(shape, 4, src, dst), (shape, src, dst)


def test_statistics_are_shared_by_shifted_stages() -> None:
    stage = [sbpflow.placement("cpu", [[4 * s + 2 * d + t for t in range(2)] for d in range(2)]) for s in range(3)]
    src = Layout(stage[0], (split(0), split(1)))
    first = transfer_stats((6, 10), 4, src, Layout(stage[1], (broadcast, split(0))))
    assert first == _listed((6, 10), 4, src, Layout(stage[1], (broadcast, split(0)))) and first[0] > 0
    shifted = transfer_stats((6, 10), 4, Layout(stage[1], src.sbp), Layout(stage[2], (broadcast, split(0))))
    assert shifted == first


def test_mesh_boxes_equal_every_ranks_shard_box() -> None:
    from sbpflow._layout import shard_box
    from sbpflow.boxing.plan import mesh_boxes

    rng = random.Random(1)
    for _ in range(300):
        shape = tuple(rng.randint(0, 9) for _ in range(rng.randint(0, 3)))
        p = sbpflow.placement("cpu", rng.choice(MESHES))
        nd = tuple(rng.choice([broadcast] + [split(d) for d in range(len(shape))]) for _ in range(p.ndim))
        boxes = [shard_box(shape, p, nd, r) for r in p.flat_ranks]
        assert [tuple(map(tuple, b)) for b in mesh_boxes(shape, p.hierarchy, nd).tolist()] == boxes
