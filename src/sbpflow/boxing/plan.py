"""Boxing planner: the cheapest sequence of primitive steps between two layouts.

One mesh axis of ``p`` ranks, a value of ``|T|`` bytes, latency ``α``, inverse bandwidth ``β``; "bytes" is
what one rank receives, and every row is mirrored by a case below (tests/logic/test_planner.py checks it)::

    from      to        step             bytes per rank      time
    S(i)      S(i)      (identity)       0                   0
    S(i)      B         all_gather       (p-1)/p  |T|        (p-1)α + (p-1)/p |T| β
    S(i)      S(j)      all_to_all       (p-1)/p² |T|        (p-1)α + (p-1)/p² |T| β
    S(i)      P(op)     local (pad)      0                   0
    B         S(i)      local (slice)    0                   0
    B         P(op)     local (zero)     0                   0
    P(op)     B         all_reduce       2(p-1)/p |T|        2(p-1)α + 2(p-1)/p |T| β
    P(op)     S(i)      reduce_scatter   (p-1)/p  |T|        (p-1)α + (p-1)/p |T| β
    P(a)      P(b)      (through S or B) reduce_scatter or all_reduce, then local
    Z(i)      B         all_gather       (p-1)/p  |T|        as S(i) -> B, then local reorder
    B         Z(i)      local (2 chunks) 0                   0
    Z(i)      S(j)      all_to_all       what a rank lacks   as S(i) -> S(j); pieces by logical overlap
    S(j)      Z(i)      all_to_all       what a rank lacks   the same
    Z(i)      P, P->Z   (through B)      all_gather or all_reduce, then local

``Z(i)`` (zigzag: rank r holds chunks r and 2p-1-r) stores dim i out of logical order
(``_layout.storage_index``); only the rows above change that order, and a send/recv
runs only between layouts of one order.

Across placements (the two rank sets may overlap, differ in size or in mesh)::

    same mesh shape, same SBP   send_recv (pairwise)   shard bytes          α + shard β
    S/B → S/B                   send_recv (general)    bytes each dst lacks  msgs α + bytes β of the busiest rank
                                                       (sent or received)
    B on one rank → B           broadcast              |T|                  ⌈log2 p⌉α + |T| β
    P on p ranks → B on one     reduce                 |T|                  ⌈log2 p⌉α + |T| β
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from .._layout import Box, Shape, box_shape, intersect, logical_pieces, numel, shard_box, storage_order, zigzag_range
from ..comm import get_backend
from ..errors import BoxingError
from ..placement import Placement
from ..sbp import Broadcast, NdSbp, Partial, SbpParallel, Split, broadcast, format_nd, zigzag_valid

# ----------------------------------------------------------------------------- costs


@dataclass(frozen=True)
class LinkCost:
    """Latency per message (seconds) and seconds per byte of one link type."""

    alpha: float
    beta: float


@dataclass(frozen=True)
class CostModel:
    """α-β costs per device type and link, plus the node size that tells links apart.

    ``links`` maps ``(device_type, "intra" | "inter")`` to a :class:`LinkCost`.
    A step whose ranks span more than one node (``rank // ranks_per_node``) pays
    the inter-node cost.

    The cpu links are gloo's over TCP, what torch.distributed runs cpu tensors on: ``sbpflow calibrate`` on a
    2-core VM fits an all-reduce of 2 local processes at α 125 µs and 1.9 GB/s (a 4-byte all-reduce takes
    0.2-0.5 ms). Shared-memory figures (α of a few µs) made every collective look nearly free next to compute,
    so plans moved small tensors often (all-to-alls, all-gathers) and sent gradients of 400 KB and up alone,
    each paying gloo's real latency. A calibrated profile (``sbpflow calibrate``, ``boxing.cost_model``)
    replaces these defaults for a given cluster.
    """

    links: tuple[tuple[tuple[str, str], LinkCost], ...] = (
        (("cpu", "intra"), LinkCost(alpha=100e-6, beta=1 / 2e9)),
        (("cpu", "inter"), LinkCost(alpha=200e-6, beta=1 / 1.25e9)),
        (("cuda", "intra"), LinkCost(alpha=5e-6, beta=1 / 100e9)),
        (("cuda", "inter"), LinkCost(alpha=10e-6, beta=1 / 12.5e9)),
    )
    ranks_per_node: int = 8

    def link(self, device_type: str, ranks: tuple[int, ...]) -> LinkCost:
        nodes = {r // self.ranks_per_node for r in ranks}
        kind = "intra" if len(nodes) <= 1 else "inter"
        return dict(self.links)[(device_type, kind)]

    def with_link(self, device_type: str, kind: str, alpha: float, beta: float) -> CostModel:
        table = dict(self.links)
        table[(device_type, kind)] = LinkCost(alpha, beta)
        return replace(self, links=tuple(sorted(table.items())))


_cost_model = [CostModel()]
_target_factors: list[tuple[tuple[tuple[str, str], float], ...]] = []


@contextmanager
def target_factors(factors: tuple[tuple[tuple[str, str], float], ...]) -> Iterator[None]:
    """Plans inside the block cost collectives as the *target* backend composes them (``cost_factors``),
    whatever backend runs here: a compiled plan depends on the cluster it targets, not on the executor."""
    _target_factors.append(tuple(factors))
    try:
        yield
    finally:
        _target_factors.pop()


def current_factors() -> tuple[tuple[tuple[str, str], float], ...]:
    """The collective cost factors plans use now: the innermost :func:`target_factors` block's, else the
    installed backend's (every backend gives the target cluster's, ``comm.base.TARGET_COST_FACTORS``)."""
    return _target_factors[-1] if _target_factors else get_backend().cost_factors()


def get_cost_model() -> CostModel:
    return _cost_model[-1]


@contextmanager
def cost_model(model: CostModel) -> Iterator[CostModel]:
    """Plans inside the block use ``model``."""
    _cost_model.append(model)
    try:
        yield model
    finally:
        _cost_model.pop()


# ----------------------------------------------------------------------------- plans

LOCAL = "local"
# a mesh axis of one rank: every SBP names the same data, so nothing runs and nothing is recorded (a 1-rank
# placement costs what local tensors cost)
RELABEL = "relabel"
MOVES_NOTHING = (LOCAL, RELABEL)
COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast", "reduce", "send_recv")


@dataclass(frozen=True)
class Layout:
    """Where a logical tensor lives: a placement and an n-D SBP."""

    placement: Placement
    sbp: NdSbp

    def __str__(self) -> str:
        return f"{self.placement} {format_nd(self.sbp)}"


@dataclass(frozen=True)
class Step:
    """One primitive of a plan. ``axis`` is the mesh axis for same-placement steps."""

    kind: str
    src: Layout
    dst: Layout
    axis: int | None
    bytes: int  # received over all ranks
    bytes_per_rank: int  # received by the busiest rank
    time: float
    detail: str = ""  # "pairwise" or "general" for send_recv, the op for reductions

    def __str__(self) -> str:
        where = f" axis {self.axis}" if self.axis is not None else ""
        what = f"{self.kind}{'(' + self.detail + ')' if self.detail else ''}{where}"
        return (
            f"{what:<28} {format_nd(self.src.sbp)} -> {format_nd(self.dst.sbp)}"
            f"{'' if self.src.placement == self.dst.placement else f'  [{self.src.placement} -> {self.dst.placement}]'}"
            f"  {self.bytes_per_rank} B/rank, {self.bytes} B total, {self.time * 1e6:.1f} us"
        )


@dataclass(frozen=True)
class Plan:
    shape: Shape
    dtype: torch.dtype
    src: Layout
    dst: Layout
    steps: tuple[Step, ...] = field(default=())

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.steps)

    @property
    def bytes_per_rank(self) -> int:
        return sum(s.bytes_per_rank for s in self.steps)

    @property
    def time(self) -> float:
        return sum(s.time for s in self.steps)

    def collectives(self) -> list[str]:
        return [s.kind for s in self.steps if s.kind not in MOVES_NOTHING]

    @property
    def is_relabel(self) -> bool:
        """Whether the plan only renames SBPs on one-rank mesh axes (shards stay as they are)."""
        return all(s.kind == RELABEL for s in self.steps)

    def __str__(self) -> str:
        head = f"boxing {tuple(self.shape)} {str(self.dtype).replace('torch.', '')}: {self.src} -> {self.dst}"
        if not self.steps:
            return head + "\n  (identity: nothing moves)"
        lines = [head] + [f"  {i + 1}. {s}" for i, s in enumerate(self.steps)]
        lines.append(f"  total: {self.bytes_per_rank} B/rank, {self.bytes} B, {self.time * 1e6:.1f} us")
        return "\n".join(lines)


def plan(
    shape: Shape, dtype: torch.dtype, src: Layout, dst: Layout, model: CostModel | None = None
) -> Plan:
    """The cheapest plan from ``src`` to ``dst`` for a logical tensor of ``shape``.

    Step kinds that the comm backend composes from other collectives cost what
    the composition really moves (``Backend.cost_factors``; e.g. gloo's
    reduce-scatter is an all-reduce, twice the bytes).
    """
    factors = current_factors()
    return _plan_cached(tuple(shape), dtype, src, dst, model or get_cost_model(), factors)


@lru_cache(maxsize=8192)
def _plan_cached(shape: Shape, dtype: torch.dtype, src: Layout, dst: Layout, model: CostModel,
                 factors: tuple[tuple[tuple[str, str], float], ...] = ()) -> Plan:
    if src == dst:
        return Plan(shape, dtype, src, dst)
    ctx = _Ctx(shape, _itemsize(dtype), model, _candidates(shape, src, dst), dict(factors), factors)
    steps = _search(ctx, src, dst)
    return Plan(shape, dtype, src, dst, tuple(steps))


def transition_time(shape: Shape, dtype: torch.dtype, src: Layout, dst: Layout, model: CostModel) -> float:
    """The modelled time of boxing ``src -> dst``, fast: a change on one mesh axis that the table does in one
    valid step costs that step (what the search finds in all but contrived cases); anything else is planned.
    Used by whole-graph SBP selection, which prices many thousands of pairs."""
    if src == dst:
        return 0.0
    factors = current_factors()
    if src.placement == dst.placement:
        mesh = src.placement.hierarchy
        # one-rank axes are relabelled for free: compare only the others
        mid = Layout(src.placement, tuple(b if mesh[i] == 1 else a for i, (a, b) in enumerate(zip(src.sbp, dst.sbp,
                                                                                                strict=True))))
        differ = [axis for axis, (a, b) in enumerate(zip(mid.sbp, dst.sbp, strict=True)) if a != b]
        if not differ:
            return 0.0
        ctx = _Ctx(tuple(shape), _itemsize(dtype), model, (), dict(factors), factors)
        chains = [t for t in (_chain_time(ctx, mid, dst, differ), _chain_time(ctx, mid, dst, differ[::-1]))
                  if t is not None]
        if chains:
            return min(chains)
    return _plan_cached(tuple(shape), dtype, src, dst, model, factors).time


def _chain_time(ctx: _Ctx, src: Layout, dst: Layout, axes: list[int]) -> float | None:
    """The time of changing ``axes`` one after another by direct table steps, or None if one is invalid."""
    current, total = src, 0.0
    for axis in axes:
        a, b = current.sbp[axis], dst.sbp[axis]
        kind = _axis_kind(a, b)
        nxt = Layout(current.placement, current.sbp[:axis] + (b,) + current.sbp[axis + 1 :])
        if kind is None or not _valid_on_axis(current.sbp, axis, a, b) or not zigzag_valid(nxt.sbp):
            return None
        total += _axis_step(ctx, kind, current, nxt, axis).time
        current = nxt
    return total


@lru_cache(maxsize=64)
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ----------------------------------------------------------------------------- search


@dataclass(frozen=True)
class _Ctx:
    shape: Shape
    itemsize: int
    model: CostModel
    candidates: tuple[SbpParallel, ...]
    factors: dict[tuple[str, str], float] = field(default_factory=dict)  # (device type, kind) -> cost multiplier
    factor_items: tuple[tuple[tuple[str, str], float], ...] = ()  # the same, hashable


def _candidates(shape: Shape, src: Layout, dst: Layout) -> tuple[SbpParallel, ...]:
    """1-D SBPs worth visiting: B, every split dim, and only the partial ops in play."""
    ops = {s.op for s in src.sbp + dst.sbp if isinstance(s, Partial)} | {"sum"}
    zigzags = tuple(sorted({s for s in src.sbp + dst.sbp if isinstance(s, Split) and s.zigzag}, key=str))
    return ((broadcast,) + tuple(Split(d) for d in range(len(shape))) + zigzags
            + tuple(Partial(op) for op in sorted(ops)))


def _search(ctx: _Ctx, src: Layout, dst: Layout) -> list[Step]:
    # a shortest path over (placement, SBP) states weighted by the alpha-beta times of the table above.
    # keys are (time, collectives, steps, bytes): on equal time (always, on one rank), local steps beat a
    # collective, and of two equally fast transfers the one that moves fewer bytes wins.
    # Times that differ only by float rounding count as equal (all-reduce vs reduce-scatter + all-gather), so
    # the search runs on until no queued state can still tie with the best plan found.
    counter = itertools.count()
    best: dict[Layout, tuple[float, int, int, int]] = {src: (0.0, 0, 0, 0)}
    back: dict[Layout, Step] = {}
    heap = [(0.0, 0, 0, 0, next(counter), src)]
    while heap:
        cost, ncoll, nsteps, nbytes, _, state = heapq.heappop(heap)
        if dst in best and cost > best[dst][0] + _tolerance(best[dst][0]):
            break
        if best.get(state) != (cost, ncoll, nsteps, nbytes) or state == dst:
            continue  # a stale entry, or the goal (kept for the tie check above)
        for step in _edges(ctx, state, dst):
            key = (cost + step.time, ncoll + _tie_weight(step), nsteps + (step.kind != RELABEL), nbytes + step.bytes)
            if _better(key, best.get(step.dst)):
                best[step.dst] = key
                back[step.dst] = step
                heapq.heappush(heap, (*key, next(counter), step.dst))
    if dst not in best:
        raise BoxingError(f"no boxing plan from {src} to {dst} for a tensor of shape {ctx.shape}")
    return _unwind(back, src, dst)


def _tie_weight(step: Step) -> int:
    """How a step counts among equally fast plans: nothing for local steps, 1 for a collective, 2 for a
    general send/recv inside one placement (point-to-point patterns lose to the tuned collective they tie)."""
    if step.kind in MOVES_NOTHING:
        return 0
    if step.kind == "send_recv" and step.detail == "general" and step.src.placement == step.dst.placement:
        return 2
    return 1


def _tolerance(cost: float) -> float:
    return 1e-9 * cost + 1e-15


def _better(new: tuple[float, int, int, int], old: tuple[float, int, int, int] | None) -> bool:
    """Lower time wins; within float noise, fewer collectives, then fewer steps, then fewer bytes."""
    if old is None:
        return True
    if abs(new[0] - old[0]) <= _tolerance(max(new[0], old[0])):
        return new[1:] < old[1:]
    return new[0] < old[0]


def _unwind(back: dict[Layout, Step], src: Layout, dst: Layout) -> list[Step]:
    steps = []
    state = dst
    while state != src:
        step = back[state]
        steps.append(step)
        state = step.src
    return steps[::-1]


def _edges(ctx: _Ctx, state: Layout, dst: Layout) -> Iterator[Step]:
    yield from _axis_steps_of(ctx.shape, ctx.itemsize, ctx.model, ctx.candidates, ctx.factor_items, state)
    if state.placement == dst.placement:
        if not _has_partial(state.sbp) and state.sbp != dst.sbp:
            yield from _general_transfer(ctx, state, Layout(dst.placement, _unpartial(dst.sbp)))
    else:
        yield from _cross_steps(ctx, state, dst)


@lru_cache(maxsize=65536)
def _axis_steps_of(shape: Shape, itemsize: int, model: CostModel, candidates: tuple[SbpParallel, ...],
                   factor_items: tuple[tuple[tuple[str, str], float], ...], state: Layout) -> tuple[Step, ...]:
    """The one-axis steps out of ``state``, whatever the goal: searches for many goals (whole-graph SBP
    selection prices thousands of pairs) meet the same states, so they are cached."""
    ctx = _Ctx(shape, itemsize, model, candidates, dict(factor_items), factor_items)
    return tuple(_axis_steps(ctx, state))


def _has_partial(sbp: NdSbp) -> bool:
    return any(isinstance(s, Partial) for s in sbp)


def _unpartial(sbp: NdSbp) -> NdSbp:
    return tuple(broadcast if isinstance(s, Partial) else s for s in sbp)


# ----------------------------------------------------------------------------- same placement, one axis


def _axis_steps(ctx: _Ctx, state: Layout) -> Iterator[Step]:
    for axis, current in enumerate(state.sbp):
        for target in ctx.candidates:
            if target == current:
                continue
            sbp = state.sbp[:axis] + (target,) + state.sbp[axis + 1 :]
            if not zigzag_valid(sbp):
                continue
            if state.placement.hierarchy[axis] == 1:  # one rank holds the whole value under any SBP
                new = Layout(state.placement, sbp)
                yield Step(RELABEL, state, new, axis, 0, 0, 0.0)
                continue
            if not _valid_on_axis(state.sbp, axis, current, target):
                continue
            kind = _axis_kind(current, target)
            if kind is None:
                continue
            new = Layout(state.placement, state.sbp[:axis] + (target,) + state.sbp[axis + 1 :])
            yield _axis_step(ctx, kind, state, new, axis)


def _axis_kind(a: SbpParallel, b: SbpParallel) -> str | None:
    """The 1-D transition table above, row by row."""
    zigzag = any(isinstance(s, Split) and s.zigzag for s in (a, b))
    if zigzag and (isinstance(a, Partial) or isinstance(b, Partial)):
        return None  # Z(i) <-> P: through B
    if isinstance(a, Split) and isinstance(b, Broadcast):
        return "all_gather"
    if isinstance(a, Split) and isinstance(b, Split):
        return "all_to_all"
    if isinstance(a, Partial) and isinstance(b, Broadcast):
        return "all_reduce"
    if isinstance(a, Partial) and isinstance(b, Split):
        return "reduce_scatter"
    if isinstance(a, Partial) and isinstance(b, Partial):
        return None  # goes through B
    return LOCAL  # B -> S, B -> P, S -> P


def _split_dims(*sbps: SbpParallel) -> set[int]:
    return {s.dim for s in sbps if isinstance(s, Split)}


# n-D SBPs change one mesh axis at a time. A step on axis k is valid only if no inner axis (j > k) splits a tensor
# dim the step splits or gathers and, for steps that reduce or create partial values, no inner axis is partial
# with another op. When no chain of valid steps exists, the general send_recv covers any pair.
def _valid_on_axis(sbp: NdSbp, axis: int, a: SbpParallel, b: SbpParallel) -> bool:
    inner = sbp[axis + 1 :]
    touched = _split_dims(a, b)
    if touched & _split_dims(*inner):
        return False
    op = a.op if isinstance(a, Partial) else b.op if isinstance(b, Partial) else None
    if op is not None and any(isinstance(s, Partial) and s.op != op for s in inner):
        return False
    return True


def _axis_step(ctx: _Ctx, kind: str, src: Layout, dst: Layout, axis: int) -> Step:
    if kind == LOCAL:
        return Step(LOCAL, src, dst, axis, 0, 0, 0.0)
    pl = src.placement
    p = pl.hierarchy[axis]
    src_bytes = _held_elements(ctx.shape, src) * ctx.itemsize  # summed over the ranks
    if kind == "all_gather":
        total = (p - 1) * src_bytes
        rounds = p - 1
    elif kind == "reduce_scatter":
        total = (p - 1) * src_bytes // p
        rounds = p - 1
    elif kind == "all_reduce":
        total = 2 * (p - 1) * src_bytes // p
        rounds = 2 * (p - 1)
    else:  # all_to_all: everything but the piece a rank keeps
        total = src_bytes - _kept_elements(ctx.shape, src, dst) * ctx.itemsize
        rounds = p - 1
    factor = ctx.factors.get((pl.type, kind), 1.0)
    total = int(total * factor)
    per_rank = total // pl.size
    detail = src.sbp[axis].op if isinstance(src.sbp[axis], Partial) else ""  # type: ignore[union-attr]
    link = ctx.model.link(pl.type, pl.axis_group_of(pl.flat_ranks[0], axis))
    # Time uses the exact mean, not the floored per_rank: flooring made reduce_scatter + all_gather look a byte
    # cheaper than the all_reduce they compose on uneven sizes.
    time = factor * rounds * link.alpha + total / pl.size * link.beta
    return Step(kind, src, dst, axis, total, per_rank, time, detail)


def _shard_shape(ctx: _Ctx, layout: Layout, rank: int) -> Shape:
    return box_shape(shard_box(ctx.shape, layout.placement, layout.sbp, rank))


@lru_cache(maxsize=65536)
def _held_elements(shape: Shape, layout: Layout) -> int:
    """Elements all ranks hold together (a search prices many steps out of one state: cached)."""
    return sum(numel(box_shape(shard_box(shape, layout.placement, layout.sbp, r))) for r in layout.placement.flat_ranks)


@lru_cache(maxsize=65536)
def _kept_elements(shape: Shape, src: Layout, dst: Layout) -> int:
    """Elements a rank holds under both layouts, summed over the ranks."""
    ranks = src.placement.flat_ranks
    return sum(numel(box_shape(b)) for rank in ranks for b in common_boxes(shape, src, rank, dst, rank))


def common_boxes(shape: Shape, src: Layout, g: int, dst: Layout, h: int) -> list[Box]:
    """The logical boxes rank ``g`` holds under ``src`` and rank ``h`` under ``dst`` (a zigzag shard is two boxes:
    up to four), in one order every process computes alike."""
    out = []
    for a in logical_pieces(shape, src.placement, src.sbp, g):
        for b in logical_pieces(shape, dst.placement, dst.sbp, h):
            common = intersect(a, b)
            if common is not None:
                out.append(common)
    return out


# ----------------------------------------------------------------------------- across placements


def _cross_steps(ctx: _Ctx, state: Layout, dst: Layout) -> Iterator[Step]:
    src_pl, dst_pl = state.placement, dst.placement
    if src_pl.hierarchy == dst_pl.hierarchy:
        yield _pairwise_transfer(ctx, state, Layout(dst_pl, state.sbp))
    if not _has_partial(state.sbp):
        targets = [_unpartial(dst.sbp)]
        if dst_pl.ndim == src_pl.ndim and state.sbp != targets[0]:
            targets.append(state.sbp)  # move as is, convert on the destination
        if any(isinstance(s, Split) and s.zigzag for s in targets[0]):  # a zigzag made on the destination
            targets.append(tuple(broadcast if isinstance(s, Split) and s.zigzag else s for s in targets[0]))
        for sbp in targets:
            yield from _general_transfer(ctx, state, Layout(dst_pl, sbp))
    all_b = all(isinstance(s, Broadcast) for s in state.sbp)
    if all_b and src_pl.size == 1 and src_pl.flat_ranks[0] in dst_pl.flat_ranks and dst_pl.size > 1:
        yield _rooted(ctx, "broadcast", state, Layout(dst_pl, (broadcast,) * dst_pl.ndim), dst_pl.flat_ranks)
    ops = {s.op for s in state.sbp if isinstance(s, Partial)}
    all_p = len(ops) == 1 and all(isinstance(s, Partial) for s in state.sbp)
    if all_p and dst_pl.size == 1 and dst_pl.flat_ranks[0] in src_pl.flat_ranks and src_pl.size > 1:
        step = _rooted(ctx, "reduce", state, Layout(dst_pl, (broadcast,) * dst_pl.ndim), src_pl.flat_ranks)
        yield replace(step, detail=ops.pop())


def _rooted(ctx: _Ctx, kind: str, src: Layout, dst: Layout, group: tuple[int, ...]) -> Step:
    size = numel(ctx.shape) * ctx.itemsize
    p = len(group)
    link = ctx.model.link(src.placement.type, group)
    time = math.ceil(math.log2(p)) * link.alpha + size * link.beta
    return Step(kind, src, dst, None, (p - 1) * size, size, time)


def _pairwise_transfer(ctx: _Ctx, src: Layout, dst: Layout) -> Step:
    total, per_rank = 0, 0
    for coords in itertools.product(*(range(n) for n in src.placement.hierarchy)):
        a, b = src.placement.rank_at(coords), dst.placement.rank_at(coords)
        if a != b:
            size = numel(_shard_shape(ctx, src, a)) * ctx.itemsize
            total += size
            per_rank = max(per_rank, size)
    return _transfer_step(ctx, src, dst, total, per_rank, 1 if total else 0, "pairwise")


def _general_transfer(ctx: _Ctx, src: Layout, dst: Layout) -> Iterator[Step]:
    """Every destination fetches the boxes it lacks. The busiest rank, sending or receiving, sets the time:
    a lone source feeding many destinations sends every piece itself (which a broadcast tree avoids).
    Boxes compare only in one storage order: a zigzag layout goes through B to reach any other order."""
    if storage_order(ctx.shape, src.placement, src.sbp) != storage_order(ctx.shape, dst.placement, dst.sbp):
        return
    total, busiest, messages = transfer_stats(ctx.shape, ctx.itemsize, src, dst)
    yield _transfer_step(ctx, src, dst, total, busiest, messages, "general")


# (shape, itemsize, layouts up to a shift of every rank) -> transfer_stats; cleared past the limit
_STATS: dict[tuple[Any, ...], tuple[int, int, int]] = {}
_STATS_LIMIT = 100_000


def transfer_stats(shape: Shape, itemsize: int, src: Layout, dst: Layout) -> tuple[int, int, int]:
    """``(bytes received in all, bytes of the busiest rank in or out, messages of the busiest rank)`` of the
    general send/recv :func:`transfer_pieces` describes, without listing its pieces.

    At 64 ranks a search meets thousands of these, and listing every piece cost milliseconds each. The numbers
    only depend on which ranks hold which boxes, so they are memoised up to a shift of every rank (the same
    transfer between the next two pipeline stages costs nothing more), and computed on arrays: one row per
    destination rank, one column per distinct source box.
    """
    ranks = src.placement.flat_ranks + dst.placement.flat_ranks
    base = min(ranks)
    key = (shape, itemsize, src.placement.hierarchy, dst.placement.hierarchy, src.sbp, dst.sbp,
           tuple(r - base for r in ranks))
    found = _STATS.get(key)
    if found is None:
        if len(_STATS) >= _STATS_LIMIT:
            _STATS.clear()
        found = _STATS[key] = _transfer_stats(shape, itemsize, src, dst)
    return found


def _transfer_stats(shape: Shape, itemsize: int, src: Layout, dst: Layout) -> tuple[int, int, int]:
    src_boxes = mesh_boxes(shape, src.placement.hierarchy, src.sbp)
    n_src, ndim = src_boxes.shape[0], len(shape)
    boxes, inverse = np.unique(src_boxes.reshape(n_src, ndim * 2), axis=0, return_inverse=True)
    boxes = boxes.reshape(len(boxes), ndim, 2)
    src_ranks = np.array(src.placement.flat_ranks, dtype=np.int64)
    holders = {j: src_ranks[inverse.reshape(-1) == j].tolist() for j in range(len(boxes))}  # replicas, rank order
    dst_ranks = np.array(dst.placement.flat_ranks, dtype=np.int64)
    n_dst = len(dst_ranks)
    wants = mesh_boxes(shape, dst.placement.hierarchy, dst.sbp)
    extent = (np.minimum(wants[:, None, :, 1], boxes[None, :, :, 1])
              - np.maximum(wants[:, None, :, 0], boxes[None, :, :, 0]))  # (dst rank, source box, dim)
    meets = (extent > 0).all(axis=2)  # the pieces: boxes with a non-empty common part (intersect)
    size = np.where(meets, np.prod(np.maximum(extent, 0), axis=2), 0) * itemsize
    # who sends each piece: the destination itself if it holds the box, else the replicas in turn (transfer_pieces)
    source = np.empty(meets.shape, dtype=np.int64)
    index = np.arange(n_dst)
    box_of = {}
    for j, replicas in enumerate(holders.values()):
        source[:, j] = np.array(replicas, dtype=np.int64)[index % len(replicas)]
        box_of.update(dict.fromkeys(replicas, j))
    own = np.array([box_of.get(int(d), -1) for d in dst_ranks], dtype=np.int64)
    source = np.where(own[:, None] == np.arange(len(holders))[None, :], dst_ranks[:, None], source)
    moves = meets & (source != dst_ranks[:, None])
    if not moves.any():
        return 0, 0, 0
    traffic_in = np.where(moves, size, 0).sum(axis=1)
    messages_in = moves.sum(axis=1)
    senders, inverse_out = np.unique(source[moves], return_inverse=True)
    traffic_out = np.zeros(len(senders), dtype=np.int64)
    np.add.at(traffic_out, inverse_out, size[moves])
    messages_out = np.bincount(inverse_out, minlength=len(senders))
    busiest = max(int(traffic_in.max()), int(traffic_out.max()))
    return int(traffic_in.sum()), busiest, max(int(messages_in.max()), int(messages_out.max()))


@lru_cache(maxsize=8192)
def mesh_boxes(shape: Shape, mesh: tuple[int, ...], sbp: NdSbp) -> np.ndarray:
    """Every rank's :func:`~sbpflow._layout.shard_box` at once: ``[flat index, dim, (start, stop)]``.

    A box depends on the rank's mesh coordinates only (row-major flat order), not on which ranks the placement
    holds, so pipeline stages of one mesh share the array. Read only.
    """
    coords = np.indices(mesh).reshape(len(mesh), -1).T  # (flat index, mesh axis)
    lo = np.zeros((len(coords), len(shape)), dtype=np.int64)
    hi = np.tile(np.array(shape, dtype=np.int64), (len(coords), 1))
    for axis, s in enumerate(sbp):
        if isinstance(s, Split) and s.zigzag:  # the only split of its dim: cut from the whole dim
            ranges = np.array([zigzag_range(shape[s.dim], mesh[axis], int(i)) for i in coords[:, axis]])
            lo[:, s.dim], hi[:, s.dim] = ranges[:, 0], ranges[:, 1]
        elif isinstance(s, Split):  # split_range on the box so far, as shard_box nests the axes
            q, r = np.divmod(hi[:, s.dim] - lo[:, s.dim], mesh[axis])
            index = coords[:, axis]
            start = lo[:, s.dim] + index * q + np.minimum(index, r)
            lo[:, s.dim], hi[:, s.dim] = start, start + q + (index < r)
    out = np.stack([lo, hi], axis=-1)
    out.flags.writeable = False
    return out


def _transfer_step(ctx: _Ctx, src: Layout, dst: Layout, total: int, per_rank: int, msgs: int, how: str) -> Step:
    ranks = tuple(sorted(set(src.placement.flat_ranks) | set(dst.placement.flat_ranks)))
    link = ctx.model.link(src.placement.type if src.placement.type == dst.placement.type else "cpu", ranks)
    return Step("send_recv", src, dst, None, total, per_rank, msgs * link.alpha + per_rank * link.beta, how)


@lru_cache(maxsize=4096)
def transfer_pieces(shape: Shape, src: Layout, dst: Layout) -> tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]:
    """(src rank, dst rank, logical box) for a general send/recv between non-partial layouts.

    Distinct source boxes tile the tensor; each is held by one or more replicas.
    A destination reads a box from itself when it is a replica, otherwise from
    replicas in turn, to spread the load.
    """
    holders: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for r in src.placement.flat_ranks:
        holders.setdefault(shard_box(shape, src.placement, src.sbp, r), []).append(r)
    grid = _BoxGrid(holders)
    out = []
    for i, d in enumerate(dst.placement.flat_ranks):
        want = shard_box(shape, dst.placement, dst.sbp, d)
        for box in grid.meeting(want):
            common = intersect(want, box)
            if common is None:
                continue
            replicas = holders[box]
            source = d if d in replicas else replicas[i % len(replicas)]
            out.append((source, d, common))
    return tuple(out)


class _BoxGrid:
    """The distinct shard boxes of a layout, found by the box they meet in O(log) per dim, not by a scan.

    A dim's interval depends only on the mesh axes that split it, so the boxes are a grid: per dim, a sorted
    partition of ``[0, n)``. Scanning every box for every destination rank made planning quadratic in ranks.
    """

    def __init__(self, holders: dict[tuple[tuple[int, int], ...], list[int]]) -> None:
        self.order = {box: i for i, box in enumerate(holders)}  # keeps the pieces in the order a scan gave
        ndim = len(next(iter(holders)))
        self.intervals = [sorted({box[k] for box in holders}) for k in range(ndim)]
        self.starts = [[a for a, _ in ivs] for ivs in self.intervals]
        self.stops = [[b for _, b in ivs] for ivs in self.intervals]

    def meeting(self, want: tuple[tuple[int, int], ...]) -> list[tuple[tuple[int, int], ...]]:
        """The boxes whose interval on every dim overlaps ``want``'s (or touches it, for empty intervals)."""
        per_dim = []
        for k, (lo, hi) in enumerate(want):
            first = bisect.bisect_right(self.stops[k], lo)
            last = bisect.bisect_left(self.starts[k], hi)
            per_dim.append(self.intervals[k][first:last])
        found = [box for box in itertools.product(*per_dim) if box in self.order]
        return sorted(found, key=self.order.__getitem__)
