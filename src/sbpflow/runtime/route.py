"""Dynamic routing: ``route`` nodes send each row (token) to a group member chosen at run time.

This is the hook for data-dependent communication (seed 002; issue 9, section 7), such as a top-1
mixture of experts whose experts live on different ranks. Rows go to their member by an all-to-all
whose split sizes depend on the data, so each dispatch first exchanges its counts (a small all-to-all
of static shape), then the rows. Both run on the node's communication stream, in plan order, like
any collective; every member issues both, also when it sends or receives nothing.

Modes (``PNode.mode``), per owned rank r of the group ``node.ranks`` (member j = ``node.ranks[j]``)::

    dispatch    (x, dest) -> (y, record)   rows of x sorted by dest (stable), sent to their member;
                                           y: the rows r received, by source member, then source order
    combine     (y, record) -> (x,)        the inverse: rows go back to their source, in x's order
    redispatch  (x, record) -> (y,)        dispatch along a known record (a gradient's way forward)

The record is one int64 vector per rank: send counts (p), receive counts (p), then the sort order
of r's rows (n): enough to replay or invert the exchange, so a backward pass routes its gradients
through the forward's record (the gradient of dispatch is combine, of combine redispatch).

Shapes are data-dependent: a register holding y is charged its buffer's bound shape.

>>> from sbpflow.comm import SimulatedBackend
>>> x = {0: torch.tensor([[1.0], [2.0]]), 1: torch.tensor([[3.0], [4.0]])}
>>> y, record = dispatch((0, 1), x, {0: torch.tensor([1, 0]), 1: torch.tensor([1, 1])}, SimulatedBackend())
>>> y[0].flatten().tolist(), y[1].flatten().tolist()   # rank 0 gets row 2; rank 1 rows 1, 3, 4
([2.0], [1.0, 3.0, 4.0])
>>> combine((0, 1), y, record, SimulatedBackend())[0].flatten().tolist()
[1.0, 2.0]
"""

from __future__ import annotations

from typing import Any

import torch

from .. import boxing
from ..comm import Backend
from ..comm.base import nbytes
from ..graph.physical import Buf, PNode
from ..sbp import Broadcast, Split
from .errors import ExecutionError

Shards = dict[int, torch.Tensor]  # rank -> its local shard, as in runtime.inorder

MODES = ("dispatch", "combine", "redispatch")


def act(node: PNode, inputs: list[Any], backend: Backend) -> list[Shards]:
    """Runs one ``route`` node on this process's ranks of the group (see the module docstring)."""
    group = tuple(node.ranks)
    if node.mode == "dispatch":
        return list(dispatch(group, inputs[0], inputs[1], backend))
    if node.mode == "combine":
        return [combine(group, inputs[0], inputs[1], backend)]
    if node.mode == "redispatch":
        return [redispatch(group, inputs[0], inputs[1], backend)]
    raise ExecutionError(f"{node.label()}: route mode must be one of {MODES}, but it is {node.mode!r}")


def dispatch(group: tuple[int, ...], x: Shards, dest: Shards, backend: Backend) -> tuple[Shards, Shards]:
    """Sends row j of ``x[r]`` to member ``dest[r][j]``; returns the received rows and the records."""
    p = len(group)
    mine = backend.owned(group)
    for r in mine:
        _check_dest(dest[r], p, r)
    order = {r: torch.argsort(dest[r], stable=True) for r in mine}
    send = {r: torch.bincount(dest[r], minlength=p) for r in mine}
    recv = _exchange_counts(group, send, backend)
    records = {r: torch.cat([send[r], recv[r], order[r]]) for r in mine}
    return _move(group, {r: x[r][order[r]] for r in mine}, send, recv, backend), records


def redispatch(group: tuple[int, ...], x: Shards, record: Shards, backend: Backend) -> Shards:
    """Dispatch along ``record``: the same rows to the same members as the dispatch that wrote it."""
    p = len(group)
    mine = backend.owned(group)
    send, recv, order = ({r: _part(record[r], p)[i] for r in mine} for i in range(3))
    return _move(group, {r: x[r][order[r]] for r in mine}, send, recv, backend)


def combine(group: tuple[int, ...], y: Shards, record: Shards, backend: Backend) -> Shards:
    """The inverse of the dispatch that wrote ``record``: every row back to its source, in its first order."""
    p = len(group)
    mine = backend.owned(group)
    send, recv, order = ({r: _part(record[r], p)[i] for r in mine} for i in range(3))
    back = _move(group, y, recv, send, backend)  # the way back: what was received is sent
    out: Shards = {}
    for r in mine:
        rows = torch.empty_like(back[r])
        rows[order[r]] = back[r]  # undo the sort by destination
        out[r] = rows
    return out


def group_plan(buf: Buf) -> boxing.Plan:
    """A boxing plan on a route's placement, for ``Backend.prepare``: process groups are created per
    placement, collectively on every process, before any thread runs (see ActorRuntime)."""
    placement = buf.layout.placement
    rest = (Broadcast(),) * (placement.ndim - 1)
    split = boxing.Layout(placement, (Split(0), *rest))
    return boxing.plan((placement.size,), torch.float32, split, boxing.Layout(placement, (Broadcast(), *rest)))


def _move(group: tuple[int, ...], rows: Shards, send: Shards, recv: Shards, backend: Backend) -> Shards:
    """One all-to-all of rows: ``send[r][j]`` rows of ``rows[r]`` go to member j, ``recv[r][j]`` come from it."""
    mine = list(rows)
    sample = rows[mine[0]] if mine else None
    dtype = sample.dtype if sample is not None else torch.float32
    tail = tuple(sample.shape[1:]) if sample is not None else ()
    pieces = {r: list(torch.split(rows[r], send[r].tolist())) for r in mine}
    shapes = {r: [(int(n), *tail) for n in recv[r].tolist()] for r in mine}
    moved = sum(nbytes(s, dtype) for r in mine for j, s in enumerate(shapes[r]) if group[j] != r)
    received = backend.all_to_all(group, pieces, shapes, dtype, moved)
    return {r: torch.cat(received[r]) if received[r] else rows[r][:0] for r in mine}


def _exchange_counts(group: tuple[int, ...], send: Shards, backend: Backend) -> Shards:
    """Every member learns how many rows each member sends it: an all-to-all of one count per pair."""
    pieces = {r: list(c.view(-1, 1).unbind(0)) for r, c in send.items()}
    shapes: dict[int, list[tuple[int, ...]]] = {r: [(1,)] * len(group) for r in send}
    received = backend.all_to_all(group, pieces, shapes, torch.int64, 8 * len(group) * (len(group) - 1))
    return {r: torch.cat(received[r]) for r in send}


def _part(record: torch.Tensor, p: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return record[:p], record[p:2 * p], record[2 * p:]


def _check_dest(dest: torch.Tensor, p: int, rank: int) -> None:
    if dest.dtype != torch.int64 or dest.dim() != 1:
        raise ExecutionError(f"route dispatch on rank {rank}: destinations must be a 1-D int64 tensor, but got "
                             f"{tuple(dest.shape)} {dest.dtype}")
    if dest.numel() and (int(dest.min()) < 0 or int(dest.max()) >= p):
        raise ExecutionError(f"route dispatch on rank {rank}: destinations must lie in [0, {p}) (group members), "
                             f"but they span [{int(dest.min())}, {int(dest.max())}]")
