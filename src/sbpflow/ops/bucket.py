"""Gradient buckets (graph.bucket): many whole tensors as one flat buffer for one collective, and back.

>>> import torch
>>> flat = bucket_flatten(torch.ones(2, 2), torch.zeros(3))
>>> flat.tolist()
[1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
>>> [t.shape for t in bucket_split(flat, shapes=((2, 2), (3,)))]
[torch.Size([2, 2]), torch.Size([3])]

Sharded tensors (ZeRO's updated parameters, ``S(0)`` in equal pieces) are gathered in one flat buffer too: each
rank flattens its pieces, one all-gather puts the ranks' flat pieces one after another, and
:func:`bucket_unshard` reads each tensor's pieces back out of every rank's part.

>>> mine, theirs = bucket_flatten(torch.zeros(1, 2), torch.zeros(1)), bucket_flatten(torch.ones(1, 2), torch.ones(1))
>>> gathered = bucket_flatten(mine, theirs)  # what the all-gather leaves on every rank: rank 0's part, rank 1's
>>> [t.tolist() for t in bucket_unshard(gathered, shapes=((2, 2), (2,)), parts=2)]
[[[0.0, 0.0], [1.0, 1.0]], [0.0, 1.0]]
"""

from __future__ import annotations

from typing import Any

import torch

from .._layout import numel
from ..sbp import Partial, broadcast
from .schema import Meta, Sig, op

# layouts whose local tensor is the whole logical tensor; moving elements keeps every kind of partial value
_WHOLE = (broadcast, Partial("sum"), Partial("max"), Partial("min"))


def _flatten_meta(*xs: Meta) -> Meta:
    return Meta((sum(numel(x.shape) for x in xs),), xs[0].dtype)


def _split_meta(flat: Meta, *, shapes: tuple[tuple[int, ...], ...]) -> tuple[Meta, ...]:
    return tuple(Meta(s, flat.dtype) for s in shapes)


# Both ops see whole local tensors (no split on any mesh axis), so a flat buffer of a partial sum is the partial sum
# of the flat buffer: one all-reduce of it is the all-reduces of its pieces, elementwise the same sums.
def _flatten_sigs(*xs: Meta, outs: Any, **_: Any) -> list[Sig]:
    return [Sig((s,) * len(xs), (s,)) for s in _WHOLE]


def _split_sigs(flat: Meta, outs: Any, **_: Any) -> list[Sig]:
    return [Sig((s,), (s,) * len(outs)) for s in _WHOLE]


@op("bucket_flatten", meta=_flatten_meta, sbp=_flatten_sigs, differentiable=False)
def bucket_flatten(*xs: torch.Tensor) -> torch.Tensor:
    """The tensors, flattened and concatenated in order: shape (sum of their numels,)."""
    return torch.cat([x.reshape(-1) for x in xs])


@op("bucket_split", meta=_split_meta, sbp=_split_sigs, differentiable=False)
def bucket_split(flat: torch.Tensor, *, shapes: tuple[tuple[int, ...], ...]) -> tuple[torch.Tensor, ...]:
    """The inverse of :func:`bucket_flatten`: views of ``flat`` in ``shapes``, in order."""
    pieces = torch.split(flat, [numel(s) for s in shapes])
    return tuple(p.view(s) for p, s in zip(pieces, shapes, strict=True))


def _unshard_meta(flat: Meta, *, shapes: tuple[tuple[int, ...], ...], parts: int) -> tuple[Meta, ...]:
    return tuple(Meta(s, flat.dtype) for s in shapes)


def _unshard_sigs(flat: Meta, outs: Any, **_: Any) -> list[Sig]:
    return [Sig((broadcast,), (broadcast,) * len(outs))]


@op("bucket_unshard", meta=_unshard_meta, sbp=_unshard_sigs, differentiable=False)
def bucket_unshard(flat: torch.Tensor, *, shapes: tuple[tuple[int, ...], ...], parts: int) -> tuple[torch.Tensor, ...]:
    """Whole tensors of ``shapes`` from the all-gather of ``parts`` ranks' flattened equal dim-0 pieces."""
    by_rank = flat.view(parts, -1)  # (ranks, one rank's flat pieces)
    sizes = [numel(s) // parts for s in shapes]
    pieces = torch.split(by_rank, sizes, dim=1)  # each (ranks, its piece's numel): rank r's rows come r-th
    return tuple(p.reshape(s) for p, s in zip(pieces, shapes, strict=True))
