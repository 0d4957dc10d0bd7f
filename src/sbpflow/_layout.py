"""Shard layout: which box of the logical tensor each rank holds.

An n-D SBP is applied axis by axis, outermost first: mesh axis 0 maps the
logical tensor onto one group value per coordinate, axis 1 maps each of those
onto its ranks, and so on. Splits use ``torch.tensor_split`` sizes (the first
``n % p`` pieces are one longer). A partial axis leaves the box unchanged.
"""

from __future__ import annotations

from functools import lru_cache

from .placement import Placement
from .sbp import NdSbp, Split

Shape = tuple[int, ...]
Box = tuple[tuple[int, int], ...]  # (start, stop) per tensor dim, in logical coordinates


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``parts`` pieces of a length-``n`` dim, as ``torch.tensor_split``."""
    q, r = divmod(n, parts)
    return [q + 1 if i < r else q for i in range(parts)]


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, stop) of piece ``index`` of a length-``n`` dim split into ``parts``."""
    q, r = divmod(n, parts)
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0)


@lru_cache(maxsize=65536)
def shard_box(shape: Shape, placement: Placement, nd_sbp: NdSbp, rank: int) -> Box:
    """The logical box held by ``rank``."""
    box = [(0, n) for n in shape]
    coords = placement.coords(rank)
    for axis, s in enumerate(nd_sbp):
        if isinstance(s, Split):
            lo, hi = box[s.dim]
            a, b = split_range(hi - lo, placement.hierarchy[axis], coords[axis])
            box[s.dim] = (lo + a, lo + b)
    return tuple(box)


def box_shape(box: Box) -> Shape:
    return tuple(hi - lo for lo, hi in box)


def shard_shape(shape: Shape, placement: Placement, nd_sbp: NdSbp, rank: int) -> Shape:
    return box_shape(shard_box(shape, placement, nd_sbp, rank))


def intersect(a: Box, b: Box) -> Box | None:
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def relative(inner: Box, outer: Box) -> tuple[slice, ...]:
    """Slices that cut ``inner`` out of a tensor holding ``outer``."""
    return tuple(slice(i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer, strict=True))


def numel(shape: Shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
