"""Shard layout: which box of the logical tensor each rank holds.

An n-D SBP is applied axis by axis, outermost first: mesh axis 0 maps the
logical tensor onto one group value per coordinate, axis 1 maps each of those
onto its ranks, and so on. Splits use ``torch.tensor_split`` sizes (the first
``n % p`` pieces are one longer). A partial axis leaves the box unchanged.

A zigzag split ``Z(d)`` (the only split of dim ``d``) cuts it into ``2p`` chunks as
``tensor_split`` does; rank ``r`` holds chunks ``r`` and ``2p-1-r``, one after the
other. Boxes are then in *storage order*: dim ``d`` as the ranks' shards laid end to
end (:func:`storage_index`), so that shapes, intersections and transfers between two
layouts of the same order stay box arithmetic. Code that meets logical positions
(creating values, reading them, attention's causal mask) asks :func:`logical_pieces`::

    logical  d:  c0 c1 c2 c3          (p = 2: four chunks)
    storage  d:  c0 c3 | c1 c2        rank 0 | rank 1
"""

from __future__ import annotations

from functools import lru_cache

from .errors import SbpError
from .placement import Placement
from .sbp import NdSbp, Split, format_nd, zigzag_valid

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


def zigzag_chunks(n: int, parts: int, index: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The logical (start, stop) of the two chunks rank ``index`` of ``parts`` holds under a zigzag split."""
    return split_range(n, 2 * parts, index), split_range(n, 2 * parts, 2 * parts - 1 - index)


def zigzag_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, stop) of rank ``index``'s zigzag shard in storage order (its chunks' sizes need not be
    ``split_range``'s: 7 over 2 ranks is chunks 2, 2, 2, 1, so shards of 3 and 4)."""
    start = 0
    for q in range(index):
        start += sum(b - a for a, b in zigzag_chunks(n, parts, q))
    return start, start + sum(b - a for a, b in zigzag_chunks(n, parts, index))


@lru_cache(maxsize=1024)
def storage_index(n: int, parts: int) -> tuple[int, ...]:
    """The logical positions of a zigzag dim in storage order: storage[i] = logical[storage_index[i]]."""
    out: list[int] = []
    for index in range(parts):
        for a, b in zigzag_chunks(n, parts, index):
            out.extend(range(a, b))
    return tuple(out)


def zigzag_axis(nd_sbp: NdSbp) -> int | None:
    """The mesh axis of the zigzag split, if any (``sbp._check_zigzag``: at most one)."""
    return next((a for a, s in enumerate(nd_sbp) if isinstance(s, Split) and s.zigzag), None)


@lru_cache(maxsize=65536)
def shard_box(shape: Shape, placement: Placement, nd_sbp: NdSbp, rank: int) -> Box:
    """The box held by ``rank``: logical, except a zigzag dim, which is in storage order."""
    if not zigzag_valid(nd_sbp):
        raise SbpError(f"a zigzag split Z(d) must be the only entry splitting dim d and the only zigzag entry, but "
                       f"got {format_nd(nd_sbp)}")
    box = [(0, n) for n in shape]
    coords = placement.coords(rank)
    for axis, s in enumerate(nd_sbp):
        if isinstance(s, Split):
            lo, hi = box[s.dim]
            cut = zigzag_range if s.zigzag else split_range
            a, b = cut(hi - lo, placement.hierarchy[axis], coords[axis])
            box[s.dim] = (lo + a, lo + b)
    return tuple(box)


@lru_cache(maxsize=65536)
def logical_pieces(shape: Shape, placement: Placement, nd_sbp: NdSbp, rank: int) -> tuple[Box, ...]:
    """The logical boxes ``rank`` holds, in the order its shard stores them along the zigzag dim: one box
    (:func:`shard_box`) without a zigzag split, else its two chunks (either may be empty)."""
    box = shard_box(shape, placement, nd_sbp, rank)
    axis = zigzag_axis(nd_sbp)
    if axis is None:
        return (box,)
    dim = nd_sbp[axis].dim  # type: ignore[union-attr]
    chunks = zigzag_chunks(shape[dim], placement.hierarchy[axis], placement.coords(rank)[axis])
    return tuple(box[:dim] + (chunk,) + box[dim + 1:] for chunk in chunks)


def storage_order(shape: Shape, placement: Placement, nd_sbp: NdSbp) -> tuple[int, int, int] | None:
    """(dim, length, parts) of the dim a layout stores out of logical order, or None: two layouts' boxes
    compare only when their orders are equal."""
    axis = zigzag_axis(nd_sbp)
    if axis is None or placement.hierarchy[axis] == 1:
        return None
    dim = nd_sbp[axis].dim  # type: ignore[union-attr]
    return dim, shape[dim], placement.hierarchy[axis]


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
