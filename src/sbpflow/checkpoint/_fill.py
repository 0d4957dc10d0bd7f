"""Fills a tensor of the state in place, shard by shard, from the saved boxes that meet each shard."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .._layout import Box, box_shape, intersect, numel, relative, shard_box, zigzag_axis
from ..errors import CheckpointError
from ..sbp import Partial
from ..tensor import Tensor

# reads the part of one saved box given by slices relative to that box
Reader = Callable[[tuple[slice, ...]], torch.Tensor]


@dataclass(frozen=True)
class Source:
    """A saved box and how to read parts of it."""

    box: Box
    read: Reader


@dataclass(frozen=True)
class TargetShard:
    """One local torch tensor of the target, the logical box it holds, and whether it gets zeros instead."""

    data: torch.Tensor
    box: Box
    zero: bool


def target_shards(t: Tensor | torch.Tensor) -> list[TargetShard]:
    """The pieces of ``t`` this process holds: every owned shard of a global tensor, or the whole local one."""
    if isinstance(t, torch.Tensor):
        return [TargetShard(t.data, tuple((0, n) for n in t.shape), False)]
    full = tuple((0, n) for n in t.shape)
    if not t.is_global:
        return [TargetShard(t.to_local().data, full, False)]
    if zigzag_axis(t.sbp) is not None:  # its shards' boxes are in storage order, not the saved logical ones
        raise CheckpointError(f"loading into a zigzag-split tensor is not supported: {t._describe()}; load into a "
                              f"plain split or B and convert (to_global) after")
    shape = tuple(t.shape)
    out = []
    for rank, data in t.local_tensors().items():
        coords = t.placement.coords(rank)
        zero = any(isinstance(s, Partial) and s.op == "sum" and c != 0 for s, c in zip(t.sbp, coords, strict=True))
        out.append(TargetShard(data.data, shard_box(shape, t.placement, t.sbp, rank), zero))
    return out


def fill(t: Tensor | torch.Tensor, name: str, sources: Sequence[Source]) -> int:
    """Copies the saved values into ``t``'s own shards; returns the number of bytes read."""
    nbytes = 0
    with torch.no_grad():
        for shard in target_shards(t):
            if shard.zero:
                shard.data.zero_()
                continue
            nbytes += _fill_shard(shard, name, sources)
    if isinstance(t, Tensor):
        mark_written(t)
    return nbytes


# A target shard is one logical box. Every saved box meeting it contributes the overlap, read on its own (a rank
# reads just what it holds). Saved boxes are disjoint (_index.writer_boxes), so the overlaps add up to the shard
# exactly; anything else means a damaged index. A P(sum) target gets the value on coordinate 0 of each partial
# axis and zeros elsewhere; P(max)/P(min) hold it everywhere.
def _fill_shard(shard: TargetShard, name: str, sources: Sequence[Source]) -> int:
    covered = 0
    nbytes = 0
    for source in sources:
        overlap = intersect(shard.box, source.box)
        if overlap is None:
            continue
        piece = source.read(relative(overlap, source.box))
        shard.data[relative(overlap, shard.box)] = piece
        covered += numel(box_shape(overlap))
        nbytes += piece.numel() * piece.element_size()
    if covered != numel(box_shape(shard.box)):
        raise CheckpointError(f"the saved boxes of {name!r} cover {covered} of the {numel(box_shape(shard.box))} "
                              f"elements of the box {list(shard.box)} to fill; the checkpoint index is damaged")
    return nbytes


def mark_written(t: Tensor) -> None:
    """A tensor whose shards were overwritten: new version, so no boxed copy or saved graph uses the old value."""
    t._version += 1
    if t._boxed is not None:
        t._boxed = {}
