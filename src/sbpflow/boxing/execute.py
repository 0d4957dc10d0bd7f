"""Boxing executor: runs a :class:`Plan` step by step on a comm backend.

Shards are ``{global rank: torch.Tensor}`` for the ranks this process owns.
Each step kind below is one row of the table in :mod:`sbpflow.boxing.plan`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from .._layout import Box, Shape, box_shape, logical_pieces, numel, relative, shard_box, storage_index, zigzag_axis
from ..comm import Backend, Transfer, get_backend
from ..distributed import activity
from ..sbp import Broadcast, Partial, Split
from .plan import Layout, Plan, Step, common_boxes, transfer_pieces

Shards = dict[int, torch.Tensor]


def execute(plan: Plan, shards: Shards, backend: Backend | None = None, donate: bool = False) -> Shards:
    """Runs every step of ``plan``; returns the destination shards this process owns.

    Every process runs every plan, also one whose placements it has no rank of:
    it then just takes part in the steps that involve it (and in process-group set-up).
    ``donate=True``: nothing reads ``shards`` afterwards, so a one-step all-reduce may reduce in them
    instead of in a copy (a compiled plan's gradient buckets: :func:`sbpflow.graph.lower.donate_inputs`).
    """
    backend = backend or get_backend()
    if plan.is_relabel:
        return shards
    backend.prepare(plan)
    if donate and len(plan.steps) == 1 and plan.steps[0].kind == "all_reduce":
        with activity(_StepName(plan, 0)):
            return _run_all_reduce(plan.steps[0], plan.shape, plan.dtype, shards, backend, donate=True)
    for i, step in enumerate(plan.steps):
        with activity(_StepName(plan, i)):
            shards = _RUNNERS[step.kind](step, plan.shape, plan.dtype, shards, backend)
    return shards


ASYNC_KINDS = ("all_reduce", "all_gather", "send_recv")  # the steps execute_async issues without waiting


def runs_async(plan: Plan) -> bool:
    """Whether :func:`execute_async` issues ``plan`` without waiting: one all-reduce, all-gather or send/recv of
    cpu shards (its transport works on threads of its own; a cuda collective is ordered by streams instead)."""
    return (len(plan.steps) == 1 and plan.steps[0].kind in ASYNC_KINDS and plan.src.placement.type == "cpu"
            and plan.dst.placement.type == "cpu")


class InFlight:
    """A collective issued and not waited for: :meth:`wait` gives its destination shards (the first call waits,
    later ones return them at once)."""

    __slots__ = ("pending", "finish", "result", "waited")

    def __init__(self, pending: list[Any], finish: Callable[[Any], Shards]) -> None:
        self.pending = pending  # comm.base.Pending, one per group this process takes part in
        self.finish = finish  # a group's result -> its members' destination shards
        self.result: Shards | None = None
        self.waited: Callable[[], None] | None = None  # called once the result is in (a timeline's span)

    def wait(self) -> Shards:
        if self.result is None:
            out: Shards = {}
            for p in self.pending:
                out.update(self.finish(p.wait()))
            self.result, self.pending = out, []
            if self.waited is not None:
                self.waited()
        return self.result


def execute_async(plan: Plan, shards: Shards, backend: Backend, donate: bool = False) -> InFlight:
    """:func:`execute` of a :func:`runs_async` plan that returns once the collective is issued: the caller
    computes meanwhile and waits (``.wait()``) where it reads the result. Every process must issue its collectives
    in the same order, blocking or not (a compiled plan's order); they may wait in any order. ``donate``: as
    :func:`execute`'s (all-reduce only)."""
    assert runs_async(plan), plan
    backend.prepare(plan)
    step = plan.steps[0]
    if step.kind == "send_recv":
        return _send_recv_async(plan, Route.of(plan.shape, plan.dtype, step, backend), shards, backend)
    source, groups = step.src.sbp[step.axis], _groups(step, backend)  # type: ignore[index]
    with activity(_StepName(plan, 0)):
        if isinstance(source, Partial):
            return InFlight([backend.all_reduce_async(group, {r: shards[r] for r in backend.owned(group)},
                                                      source.op, donate) for group in groups], _same)
        assert isinstance(source, Split)
        shapes = {g: [box_shape(_box(plan.shape, step.src, r)) for r in g] for g in groups}
        parts = step.src.placement.hierarchy[step.axis] if source.zigzag else 1  # type: ignore[index]
        return InFlight([backend.all_gather_async(g, {r: shards[r] for r in backend.owned(g)}, shapes[g], plan.dtype)
                         for g in groups], partial(_joined, source.dim, parts))


def bind_async(plan: Plan, backend: Backend, donate: bool = False) -> Callable[[Shards], InFlight]:
    """``execute_async(plan, shards, backend, donate)`` as a function of ``shards``, for a plan that runs every
    micro-batch (a compiled boxing node): a send/recv works out its :class:`Route` here, once, not at every
    call."""
    assert runs_async(plan), plan
    if plan.steps[0].kind != "send_recv":
        return lambda shards: execute_async(plan, shards, backend, donate)
    route = Route.of(plan.shape, plan.dtype, plan.steps[0], backend)  # no communication: safe at bind time

    def send_recv(shards: Shards) -> InFlight:
        backend.prepare(plan)  # at the call, as execute_async: every process sets up groups in plan order
        return _send_recv_async(plan, route, shards, backend)

    return send_recv


def _send_recv_async(plan: Plan, route: Route, shards: Shards, backend: Backend) -> InFlight:
    with activity(_StepName(plan, 0)):
        return InFlight([backend.send_recv_async(route.transfers, route.payloads(shards))], route.assemble)


def _same(result: Shards) -> Shards:
    return result


def _joined(dim: int, parts: int, gathered: dict[int, list[torch.Tensor]]) -> Shards:
    """An all-gather's pieces, concatenated along the split dim (as :func:`_run_all_gather`)."""
    return {r: _logical_order(torch.cat(pieces, dim=dim), dim, parts) for r, pieces in gathered.items()}


def _logical_order(t: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    """A whole zigzag dim gathered in storage order (the ranks' shards end to end), put in logical order;
    ``parts`` 1: not a zigzag split, nothing to do."""
    if parts == 1:
        return t
    order = torch.tensor(storage_index(t.shape[dim], parts), device=t.device)
    out = torch.empty_like(t)
    out.index_copy_(dim, order, t)  # storage position i holds logical position order[i]
    return out


class _StepName:
    """Names a running step for comm errors; formatted only when an error needs it."""

    __slots__ = ("plan", "index")

    def __init__(self, plan: Plan, index: int) -> None:
        self.plan, self.index = plan, index

    def __call__(self) -> str:
        step = self.plan.steps[self.index]
        where = f"axis {step.axis} " if step.axis is not None else ""
        return (f"boxing {list(self.plan.shape)} {self.plan.src} -> {self.plan.dst}, step {self.index + 1}/"
                f"{len(self.plan.steps)}: {step.kind} {where}{step.src} -> {step.dst}")


def identity_element(op: str, dtype: torch.dtype) -> float | int | bool:
    """The value that does not change a reduction by ``op``: 0, or the dtype's lowest/highest."""
    if op == "sum":
        return 0
    if dtype == torch.bool:
        return op == "min"
    if dtype.is_floating_point:
        return -float("inf") if op == "max" else float("inf")
    info = torch.iinfo(dtype)
    return info.min if op == "max" else info.max


def _box(shape: Shape, layout: Layout, rank: int) -> Box:
    return shard_box(shape, layout.placement, layout.sbp, rank)


def _overlap(a: Box, b: Box) -> Box:
    """Intersection of two boxes, possibly empty (zero-length dims)."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        lo = max(a0, b0)
        out.append((lo, max(lo, min(a1, b1))))
    return tuple(out)


def _owned(step: Step, layout: Layout, backend: Backend) -> list[int]:
    return backend.owned(layout.placement.flat_ranks)


# -- local: B -> S (slice), S -> P (pad with the identity), B -> P (zero or keep) -----------


def _run_local(step: Step, shape: Shape, dtype: torch.dtype, shards: Shards, backend: Backend) -> Shards:
    assert step.axis is not None
    target = step.dst.sbp[step.axis]
    source = step.src.sbp[step.axis]
    out: Shards = {}
    for r in _owned(step, step.src, backend):
        old, new = _box(shape, step.src, r), _box(shape, step.dst, r)
        t = shards[r]
        if isinstance(target, Split):  # B -> S; B -> Z: its two chunks, end to end
            pieces = logical_pieces(shape, step.dst.placement, step.dst.sbp, r) if target.zigzag else (new,)
            out[r] = t[relative(new, old)] if len(pieces) == 1 else torch.cat(
                [t[relative(piece, old)] for piece in pieces], dim=target.dim)
        elif isinstance(source, Split):  # S -> P: pad around the slice
            assert isinstance(target, Partial)
            full = torch.full(box_shape(new), identity_element(target.op, t.dtype), dtype=t.dtype, device=t.device)
            full[relative(old, new)] = t
            out[r] = full
        else:  # B -> P
            assert isinstance(source, Broadcast) and isinstance(target, Partial)
            first = step.src.placement.coords(r)[step.axis] == 0
            out[r] = t if target.op != "sum" or first else torch.zeros_like(t)
    return out


# -- collectives along one mesh axis ---------------------------------------------------------


def _groups(step: Step, backend: Backend) -> list[tuple[int, ...]]:
    assert step.axis is not None
    groups = step.src.placement.axis_groups(step.axis)
    return [g for g in groups if backend.owned(g)]


def _run_all_gather(step: Step, shape: Shape, dtype: torch.dtype, shards: Shards, backend: Backend) -> Shards:
    source = step.src.sbp[step.axis]  # type: ignore[index]
    assert isinstance(source, Split)
    out: Shards = {}
    for group in _groups(step, backend):
        shapes = [box_shape(_box(shape, step.src, g)) for g in group]
        gathered = backend.all_gather(group, {r: shards[r] for r in backend.owned(group)}, shapes, dtype)
        parts = len(group) if source.zigzag else 1
        for r, pieces in gathered.items():
            out[r] = _logical_order(torch.cat(pieces, dim=source.dim), source.dim, parts)
    return out


def _run_all_reduce(step: Step, shape: Shape, dtype: torch.dtype, shards: Shards, backend: Backend,
                    donate: bool = False) -> Shards:
    source = step.src.sbp[step.axis]  # type: ignore[index]
    assert isinstance(source, Partial)
    out: Shards = {}
    for group in _groups(step, backend):
        out.update(backend.all_reduce(group, {r: shards[r] for r in backend.owned(group)}, source.op, donate))
    return out


def _run_reduce_scatter(step: Step, shape: Shape, dtype: torch.dtype, shards: Shards, backend: Backend) -> Shards:
    source = step.src.sbp[step.axis]  # type: ignore[index]
    assert isinstance(source, Partial)
    out: Shards = {}
    for group in _groups(step, backend):
        inputs = {}
        for r in backend.owned(group):
            mine = _box(shape, step.src, r)
            inputs[r] = [shards[r][relative(_box(shape, step.dst, g), mine)].contiguous() for g in group]
        out.update(backend.reduce_scatter(group, inputs, source.op))
    return out


def _run_all_to_all(step: Step, shape: Shape, dtype: torch.dtype, shards: Shards, backend: Backend) -> Shards:
    source, target = step.src.sbp[step.axis], step.dst.sbp[step.axis]  # type: ignore[index]
    assert isinstance(source, Split) and isinstance(target, Split)
    if source.zigzag or target.zigzag:
        return _run_reorder(step, shape, dtype, shards, backend)
    out: Shards = {}
    for group in _groups(step, backend):
        owned = backend.owned(group)
        inputs, recv_shapes = {}, {}
        for r in owned:
            mine = _box(shape, step.src, r)
            cuts = [relative(_overlap(mine, _box(shape, step.dst, g)), mine) for g in group]
            inputs[r] = [shards[r][where].contiguous() for where in cuts]
            want = _box(shape, step.dst, r)
            recv_shapes[r] = [box_shape(_overlap(_box(shape, step.src, g), want)) for g in group]
        moved = _a2a_bytes(shape, step, group, dtype)
        received = backend.all_to_all(group, inputs, recv_shapes, dtype, moved)
        for r, pieces in received.items():
            out[r] = torch.cat(pieces, dim=source.dim)
    return out


def _run_reorder(step: Step, shape: Shape, dtype: torch.dtype, shards: Shards, backend: Backend) -> Shards:
    """An all-to-all to or from a zigzag split: each pair of members swaps the logical boxes their shards share
    (:func:`common_boxes`: a zigzag shard is two boxes), flattened end to end, and each rank writes what it
    receives where its own order stores it."""
    out: Shards = {}
    itemsize = torch.empty((), dtype=dtype).element_size()
    for group in _groups(step, backend):
        owned = backend.owned(group)
        inputs = {r: [_flat(shards[r], [_storage_cut(shape, step.src, r, b)
                                        for b in common_boxes(shape, step.src, r, step.dst, g)]) for g in group]
                  for r in owned}
        recv_shapes: dict[int, list[Shape]] = {
            r: [(_elements(common_boxes(shape, step.src, g, step.dst, r)),) for g in group] for r in owned}
        moved = sum(_elements(common_boxes(shape, step.src, g, step.dst, h)) for g in group for h in group if g != h)
        received = backend.all_to_all(group, inputs, recv_shapes, dtype, moved * itemsize)
        for r, pieces in received.items():
            full = torch.empty(box_shape(_box(shape, step.dst, r)), dtype=dtype, device=shards[r].device)
            for g, flat in zip(group, pieces, strict=True):
                offset = 0
                for b in common_boxes(shape, step.src, g, step.dst, r):
                    n = numel(box_shape(b))
                    full[_storage_cut(shape, step.dst, r, b)] = flat[offset:offset + n].reshape(box_shape(b))
                    offset += n
            out[r] = full
    return out


def _elements(boxes: list[Box]) -> int:
    return sum(numel(box_shape(b)) for b in boxes)


def _flat(shard: torch.Tensor, cuts: list[tuple[slice, ...]]) -> torch.Tensor:
    """The pieces of ``shard`` at ``cuts``, flattened end to end (1-D)."""
    if not cuts:
        return shard.new_empty((0,))
    return torch.cat([shard[c].reshape(-1) for c in cuts])


def _storage_cut(shape: Shape, layout: Layout, rank: int, box: Box) -> tuple[slice, ...]:
    """Where logical ``box`` (inside one of ``rank``'s logical pieces) sits in its shard: its pieces lie end to end
    along the zigzag dim, if any."""
    pieces = logical_pieces(shape, layout.placement, layout.sbp, rank)
    piece = next(p for p in pieces if all(p0 <= b0 and b1 <= p1 for (p0, p1), (b0, b1) in zip(p, box, strict=True)))
    axis = zigzag_axis(layout.sbp)
    dim = layout.sbp[axis].dim if axis is not None else -1  # type: ignore[union-attr]
    before = sum(p[dim][1] - p[dim][0] for p in pieces[:pieces.index(piece)]) if axis is not None else 0
    return tuple(slice(b0 - p0 + (before if d == dim else 0), b1 - p0 + (before if d == dim else 0))
                 for d, ((p0, _), (b0, b1)) in enumerate(zip(piece, box, strict=True)))


def _a2a_bytes(shape: Shape, step: Step, group: tuple[int, ...], dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = 0
    for g in group:
        for h in group:
            if g != h:
                total += numel(box_shape(_overlap(_box(shape, step.src, g), _box(shape, step.dst, h))))
    return total * itemsize


# -- across placements -----------------------------------------------------------------------


def _run_send_recv(step: Step, shape: Shape, dtype: torch.dtype, shards: Shards, backend: Backend) -> Shards:
    route = Route.of(shape, dtype, step, backend)
    both_cuda = step.src.placement.type == step.dst.placement.type == "cuda"
    received = backend.send_recv(route.transfers, route.payloads(shards), device_type="cuda" if both_cuda else "cpu")
    return route.assemble(received)


Cut = tuple[slice, ...] | None  # where a piece sits in a shard; None: it is the whole shard


@dataclass(frozen=True, slots=True)
class Route:
    """A send/recv step as one process runs it, worked out from the step alone: its transfers, which pieces this
    process sends (from which of its shards, cut where), and how its destination shards are put together from the
    pieces it receives. A compiled plan's boxing node sends every micro-batch of every step, so it works this out
    once (:func:`bind_async`); eager boxing, once per call."""

    transfers: tuple[Transfer, ...]
    sends: tuple[tuple[int, int, Cut], ...]  # (piece, owned source rank, cut of its shard)
    # (owned destination rank, its device, its shape, its pieces as (piece, cut of the shard)): one piece cut None
    # is the shard itself, received whole
    takes: tuple[tuple[int, torch.device, Shape, tuple[tuple[int, Cut], ...]], ...]
    dtype: torch.dtype

    @staticmethod
    def of(shape: Shape, dtype: torch.dtype, step: Step, backend: Backend) -> Route:
        pieces = _pairwise_pieces(shape, step) if step.detail == "pairwise" else transfer_pieces(shape, step.src,
                                                                                                   step.dst)
        sends = []
        for i, (src, _, box) in enumerate(pieces):
            if backend.owns(src):
                held = _box(shape, step.src, src)
                sends.append((i, src, None if box == held else relative(box, held)))
        by_dst: dict[int, list[tuple[int, Box]]] = {}  # grouped once: a scan per destination is quadratic in ranks
        for i, (_, dst, box) in enumerate(pieces):
            by_dst.setdefault(dst, []).append((i, box))
        dst_pl, takes = step.dst.placement, []
        for d in backend.owned(dst_pl.flat_ranks):
            want, mine = _box(shape, step.dst, d), by_dst.get(d, [])
            if step.detail == "pairwise":  # the piece from the source at the same mesh coordinates
                src_r = step.src.placement.rank_at(dst_pl.coords(d))
                mine = [(i, want) for i, _ in mine if pieces[i][0] == src_r]
            cuts = tuple((i, None if box == want else relative(box, want)) for i, box in mine)
            takes.append((d, backend.device_for(dst_pl.type, d), box_shape(want), cuts))
        transfers = tuple(Transfer(src, dst, box_shape(box), dtype) for src, dst, box in pieces)
        return Route(transfers, tuple(sends), tuple(takes), dtype)

    def payloads(self, shards: Shards) -> dict[int, torch.Tensor]:
        """The pieces this process sends, by piece index (a source it owns with no shard here sends nothing)."""
        out = {}
        for i, src, cut in self.sends:
            shard = shards.get(src)
            if shard is not None:
                out[i] = shard if cut is None else shard[cut].contiguous()
        return out

    def assemble(self, received: dict[int, torch.Tensor]) -> Shards:
        """This process's destination shards from the pieces it received (by piece index)."""
        out: Shards = {}
        for d, device, shape, cuts in self.takes:
            if len(cuts) == 1 and cuts[0][1] is None:
                out[d] = received[cuts[0][0]].to(device)
                continue
            full = torch.empty(shape, dtype=self.dtype, device=device)
            for i, cut in cuts:
                full[cut] = received[i].to(device)
            out[d] = full
        return out


def _pairwise_pieces(shape: Shape, step: Step) -> list[tuple[int, int, Box]]:
    src_pl, dst_pl = step.src.placement, step.dst.placement
    out = []
    for r in src_pl.flat_ranks:
        coords = src_pl.coords(r)
        out.append((r, dst_pl.rank_at(coords), _box(shape, step.src, r)))
    return out


def _run_broadcast(step: Step, shape: Shape, dtype: torch.dtype, shards: Shards, backend: Backend) -> Shards:
    root = step.src.placement.flat_ranks[0]
    group = step.dst.placement.flat_ranks
    out = backend.broadcast(group, root, {root: shards[root]} if root in shards else {}, shape, dtype,
                            device_type=step.dst.placement.type)
    return {r: t.to(backend.device_for(step.dst.placement.type, r)) for r, t in out.items()}


def _run_reduce(step: Step, shape: Shape, dtype: torch.dtype, shards: Shards, backend: Backend) -> Shards:
    root = step.dst.placement.flat_ranks[0]
    group = step.src.placement.flat_ranks
    owned = {r: shards[r] for r in backend.owned(group)}
    out = backend.reduce(group, root, owned, step.detail, shape, dtype)
    return {r: t.to(backend.device_for(step.dst.placement.type, r)) for r, t in out.items()}


def _run_relabel(step: Step, shape: Shape, dtype: torch.dtype, shards: Shards, backend: Backend) -> Shards:
    return shards


_RUNNERS: dict[str, Callable[[Step, Shape, torch.dtype, Shards, Backend], Shards]] = {
    "local": _run_local,
    "relabel": _run_relabel,
    "all_gather": _run_all_gather,
    "all_reduce": _run_all_reduce,
    "reduce_scatter": _run_reduce_scatter,
    "all_to_all": _run_all_to_all,
    "send_recv": _run_send_recv,
    "broadcast": _run_broadcast,
    "reduce": _run_reduce,
}
