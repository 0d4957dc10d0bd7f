"""Which rows of a batch each process reads, and how those rows become its ranks' shards.

A process reads the union of its ranks' dim-0 ranges (:func:`row_ranges`) and cuts every rank's shard out
of what it read (:func:`shards_of`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..._layout import logical_pieces, shard_box
from ...errors import SbpflowError
from ...placement import Placement
from ...sbp import NdSbp, Partial, Split, format_nd


def check_batch_sbp(nd_sbp: NdSbp, placement: Placement) -> None:
    for s in nd_sbp:
        if isinstance(s, Partial):
            raise SbpflowError(f"DataLoader batches are split or broadcast on each mesh axis of {placement}, but the "
                               f"sbp has {s}: a loaded batch holds values, not partial sums")
        if isinstance(s, Split) and s.zigzag and s.dim == 0:
            raise SbpflowError(f"DataLoader batches are read by rows, so dim 0 cannot be split zigzag, but the sbp "
                               f"on {placement} is {format_nd(nd_sbp)}; zigzag a later dim (the sequence: Z(1))")


def rank_rows(n: int, placement: Placement, nd_sbp: NdSbp, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s rows [lo, hi) of an ``n``-row batch (only dim 0's splits matter)."""
    ndim = 1 + max((s.dim for s in nd_sbp if isinstance(s, Split)), default=0)
    box = shard_box((n,) + (1,) * (ndim - 1), placement, nd_sbp, rank)
    return box[0]


def row_ranges(n: int, holders: list[tuple[Placement, NdSbp, list[int]]]) -> list[tuple[int, int]]:
    """The disjoint, sorted row ranges that the given ranks hold together (what this process reads): ``holders``
    lists (placement, sbp, this process's ranks of it), one per field layout."""
    spans = sorted(rank_rows(n, placement, nd_sbp, r) for placement, nd_sbp, ranks in holders for r in ranks)
    merged: list[tuple[int, int]] = []
    for lo, hi in spans:
        if hi <= lo:
            continue
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def part_offset(ranges: list[tuple[int, int]], row: int) -> int:
    """Where batch row ``row`` sits in the part made of ``ranges``' rows, in order."""
    offset = 0
    for lo, hi in ranges:
        if lo <= row < hi:
            return offset + row - lo
        offset += hi - lo
    raise AssertionError(f"row {row} is in none of the ranges read, {ranges}")


def shards_of(part: torch.Tensor, n: int, ranges: list[tuple[int, int]], placement: Placement, nd_sbp: NdSbp,
              ranks: list[int], devices: dict[int, torch.device], field: str) -> dict[int, torch.Tensor]:
    """Each rank's shard of one field, cut from ``part`` (the collated rows of ``ranges``)."""
    shape = (n, *part.shape[1:])  # logical (global) shape of the field
    for s in nd_sbp:
        if isinstance(s, Split) and s.dim >= len(shape):
            raise SbpflowError(f"DataLoader: field {field} of the batch has shape {list(shape)}, but the sbp splits "
                               f"dim {s.dim}; expected split(d) with d < {len(shape)}")
    out = {}
    for r in ranks:
        box = shard_box(shape, placement, nd_sbp, r)
        lo, hi = box[0]
        start = part_offset(ranges, lo) if hi > lo else 0  # an empty shard cuts 0 rows anywhere
        pieces = [part[(slice(start, start + hi - lo), *(slice(a, b) for a, b in logical[1:]))]
                  for logical in logical_pieces(shape, placement, nd_sbp, r)]  # a zigzag dim: two chunks
        piece = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=_zigzag_dim(nd_sbp))
        out[r] = piece.to(devices[r], copy=True)  # each shard its own memory, as sbpflow.tensor makes them
    return out


def _zigzag_dim(nd_sbp: NdSbp) -> int:
    return next(s.dim for s in nd_sbp if isinstance(s, Split) and s.zigzag)


def flatten(value: Any, where: str = "batch") -> tuple[list[tuple[str, torch.Tensor]], Any]:
    """The tensor leaves of a collated batch (with names for messages) and how to rebuild it."""
    if isinstance(value, torch.Tensor):
        return [(where, value)], None
    if isinstance(value, (tuple, list)):
        leaves, specs = [], []
        for i, v in enumerate(value):
            sub, spec = flatten(v, f"{where}[{i}]")
            leaves += sub
            specs.append((len(sub), spec))
        return leaves, (type(value), specs)
    if isinstance(value, dict):
        keyed: list[tuple[Any, int, Any]] = []
        leaves = []
        for k, v in value.items():
            sub, spec = flatten(v, f"{where}[{k!r}]")
            leaves += sub
            keyed.append((k, len(sub), spec))
        return leaves, (dict, keyed)
    raise SbpflowError(f"DataLoader: {where} of the collated batch is {type(value).__name__}; a batch placed on "
                       "ranks holds tensors (or tuples, lists and dicts of them)")


def unflatten(leaves: list[Any], spec: Any) -> Any:
    if spec is None:
        return leaves[0]
    kind, specs = spec
    if kind is dict:
        out, at = {}, 0
        for key, count, sub in specs:
            out[key] = unflatten(leaves[at:at + count], sub)
            at += count
        return out
    items, at = [], 0
    for count, sub in specs:
        items.append(unflatten(leaves[at:at + count], sub))
        at += count
    return tuple(items) if kind is tuple else items
