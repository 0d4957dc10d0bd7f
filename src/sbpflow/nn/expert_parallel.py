"""Expert parallelism by all-to-all: each routed token-slot travels to the rank that holds its expert, and back.

The experts are stacked, w1 (E, I, C), w2 (E, C, I), w3 (E, I, C), and split S(0) on the ``ep`` mesh axis: member
``j`` of an ep group (the ranks that differ only on that axis) holds experts ``[j * per, (j + 1) * per)``. Tokens
enter split on that axis. Per rank, forward::

    slots (n, k) --sorted by expert--> counts per expert --all-to-all (E counts, static)--> counts it receives
    slot rows    --all-to-all, split sizes = those counts--> its experts run on their own rows only (grouped)
    expert rows  --all-to-all back, the sizes reversed----> (n, k, C): each slot's expert output (0 if dropped)
                 --weighted by the routing, summed over k--> (n, C)

Backward is the same exchange reversed. On other mesh axes, data-parallel tokens keep their split (the experts'
gradients are partial there) and a Megatron split inside the experts takes the tokens whole there.

Two front ends share the routing and the experts' math (a hand-written SwiGLU backward): eager
:func:`routed_experts` keeps each rank's activations for its backward; ``nn.Graph`` traces the op
:func:`expert_exchange`, a communicating kernel (as ring attention is) whose static (n, C) output hides the
data-dependent sizes, and whose backward op routes once more and recomputes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

from .. import boxing
from .._layout import shard_box
from ..autograd import is_grad_enabled
from ..comm import Backend, get_backend
from ..comm.base import KERNEL_CHANNEL, nbytes
from ..errors import SbpflowError
from ..ops.convert import to_global
from ..ops.dispatch import record
from ..ops.schema import Meta, OpDef, ShardCtx, Sig, op
from ..placement import Placement
from ..sbp import Broadcast, NdSbp, Partial, Split, format_nd
from ..tensor import Tensor

Shards = dict[int, torch.Tensor]  # owned rank -> its local tensor
Weights = tuple[Tensor, Tensor, Tensor]  # the stacked experts' (w1, w2, w3): gate (E, I, C), down (E, C, I), up

_ROUTED = OpDef("routed_experts", kernel=lambda *a: None, meta=lambda *a: None, sbp=lambda *a: [],
                shard_aware=False, save_outputs=False, differentiable=True, mesh_aware=False)
MEGATRON = (Split(1), Split(2), Split(1))  # stacked w1, w3 column-parallel, w2 row-parallel


@dataclass(frozen=True)
class ExpertLayout:
    """Experts stacked and split S(0) over mesh axis ``axis`` of the tokens' placement ``mesh``."""

    mesh: Placement
    axis: int
    num_experts: int

    @property
    def per_member(self) -> int:
        return self.num_experts // self.mesh.hierarchy[self.axis]

    def weight_sbp(self, expert_sbp: NdSbp) -> NdSbp:
        """A stacked weight's SBP from one expert's (a split dim moves up by one): S(0) on the ep axis."""
        def one(axis: int, s: Any) -> Any:
            if axis == self.axis:
                return Split(0)
            return Split(s.dim + 1) if isinstance(s, Split) else s
        return tuple(one(a, s) for a, s in enumerate(expert_sbp))

    def token_sbp(self, sbp: NdSbp, w1_sbp: NdSbp) -> NdSbp:
        """The tokens' (N, C) SBP for dispatch, from theirs (``sbp``) and the stacked w1's: split on the ep axis,
        whole where the experts are split (Megatron), kept split or made whole elsewhere."""
        def one(axis: int, s: Any) -> Any:
            if axis == self.axis:
                return Split(0)
            return Split(0) if s == Split(0) and isinstance(w1_sbp[axis], Broadcast) else Broadcast()
        return tuple(one(a, s) for a, s in enumerate(sbp))


def check_layout(mesh: Placement, axis: int, num_experts: int) -> ExpertLayout:
    """``num_experts`` experts in contiguous groups over mesh axis ``axis`` of ``mesh``, one group per coordinate
    (the axis's size must divide them)."""
    if not 0 <= axis < mesh.ndim:
        raise SbpflowError(f"expert parallelism needs a mesh axis of the experts' placement {mesh}, but got "
                           f"mesh_axis={axis}")
    if num_experts % mesh.hierarchy[axis]:
        raise SbpflowError(f"expert parallelism: mesh axis {axis} has {mesh.hierarchy[axis]} ranks, which must "
                           f"divide the {num_experts} experts")
    return ExpertLayout(mesh, axis, num_experts)


# ----------------------------------------------------------------------------- routing, shared by both paths


@dataclass
class _Route:
    """One rank's exchange: which of its slots leave, to whom, and how the rows it receives group."""

    order: torch.Tensor  # the slots routed, sorted by expert (indices into the rank's n * k slots)
    token: torch.Tensor  # each routed slot's token (order // k)
    send_rows: list[int]  # rows sent to each member
    recv_rows: list[int]  # rows received from each member
    group: torch.Tensor  # the received rows' order grouped by local expert (stable)
    sizes: list[int]  # received rows per local expert


def _routes(index: Shards, first: Mapping[int, int], members: int, per: Mapping[int, int],
            groups: Sequence[tuple[int, ...]] | None, backend: Backend) -> dict[int, _Route]:
    """Every owned rank r's route of its (n, k) slots to experts ``[first[r], first[r] + members * per[r])``,
    ``per[r]`` to a member; other experts (a dropped slot's ``num_experts``, or experts held elsewhere when nothing is
    exchanged) stay out. ``groups``: the ep groups (the count all-to-all); None: each rank alone."""
    k = next(iter(index.values())).shape[-1] if index else 1
    order, send = {}, {}
    for r, ids in index.items():
        expert = ids.reshape(-1) - first[r]  # (n * k,) local slots
        routed = (expert >= 0) & (expert < members * per[r])
        order[r] = torch.argsort(torch.where(routed, expert, members * per[r]), stable=True)[:int(routed.sum())]
        send[r] = torch.bincount(expert[order[r]], minlength=members * per[r]).view(members, per[r])
    recv = send if groups is None else _exchange_counts(groups, send, members, backend)
    routes = {}
    for r, o in order.items():
        counts = recv[r]  # (members, per): rows from member j for local expert e
        local = torch.repeat_interleave(torch.arange(per[r]).repeat(members), counts.reshape(-1))
        routes[r] = _Route(o, o // k, send[r].sum(1).tolist(), counts.sum(1).tolist(),
                           torch.argsort(local, stable=True), counts.sum(0).tolist())
    return routes


def _send(groups: Sequence[tuple[int, ...]] | None, rows: Shards, routes: dict[int, _Route], backend: Backend,
          back: bool = False) -> Shards:
    """Rows to their experts' members (``back``: home again), in every ep group; None: no exchange."""
    if groups is None:
        return rows
    sizes = {r: (x.recv_rows, x.send_rows) if back else (x.send_rows, x.recv_rows) for r, x in routes.items()}
    out: Shards = {}
    for group in groups:
        mine = [r for r in group if r in rows]
        if mine:
            out.update(backend.all_to_all_rows(group, {r: rows[r] for r in mine}, {r: sizes[r][0] for r in mine},
                                               {r: sizes[r][1] for r in mine}))
    return out


def _exchange_counts(groups: Sequence[tuple[int, ...]], send: Shards, members: int, backend: Backend) -> Shards:
    """Every member learns how many slot rows each member sends it, per local expert: (p, per) counts, one row
    from each member."""
    ones = {r: [1] * members for r in send}
    out: Shards = {}
    for group in groups:
        mine = [r for r in group if r in send]
        if mine:
            out.update(backend.all_to_all_rows(group, {r: send[r] for r in mine}, {r: ones[r] for r in mine},
                                               {r: ones[r] for r in mine}))
    return out


Pre = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]  # gate, up, silu(gate), silu(gate) * up


def _experts(rows: torch.Tensor, sizes: list[int], w1: torch.Tensor, w2: torch.Tensor,
             w3: torch.Tensor) -> tuple[torch.Tensor, Pre]:
    """Local expert ``e`` (stacked local weights (per, ...)) on its ``sizes[e]`` rows of ``rows`` (grouped): its
    :class:`~sbpflow.nn.moe.Expert`, ``w2(silu(w1 x) * w3 x)``; and what :func:`_experts_grad` reads."""
    outs: list[torch.Tensor] = []
    pre: Pre = []  # per local expert with rows
    for e, x in enumerate(torch.split(rows, sizes)):
        if sizes[e]:
            gate, up = x @ w1[e].t(), x @ w3[e].t()  # (rows, I) local
            act = torch.nn.functional.silu(gate)
            hidden = act * up
            outs.append(torch.nn.functional.linear(hidden, w2[e]))
            pre.append((gate, up, act, hidden))
    return (torch.cat(outs) if outs else rows.new_zeros(0, w2.shape[1])), pre


def _experts_grad(rows: torch.Tensor, sizes: list[int], pre: Pre, weights: Sequence[torch.Tensor],
                  d_out: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """:func:`_experts`' gradient by hand, no autograd graph: the rows' (grouped) and the stacked (w1, w2, w3)'s
    in ``dtype``, each expert's written in place (zero for an expert without rows)."""
    w1, w2, w3 = weights
    d_rows = torch.empty_like(rows)
    d_weights = [torch.empty(w.shape, dtype=dtype, device=w.device) for w in weights]
    saved = iter(pre)
    for e, (x, dy, dx) in enumerate(zip(*(torch.split(t, sizes) for t in (rows, d_out, d_rows)), strict=True)):
        if not sizes[e]:
            for d in d_weights:
                d[e].zero_()
            continue
        gate, up, act, hidden = next(saved)
        dh = dy @ w2[e]  # (rows, I)
        d_gate = torch.ops.aten.silu_backward(dh * up, gate)
        d_up = dh * act
        _mm_into(d_weights[1][e], dy.t(), hidden)
        _mm_into(d_weights[0][e], d_gate.t(), x)
        _mm_into(d_weights[2][e], d_up.t(), x)
        torch.mm(d_gate, w1[e], out=dx)
        dx.addmm_(d_up, w3[e])
    return d_rows, d_weights


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    if out.dtype == a.dtype:
        torch.mm(a, b, out=out)
    else:  # (autocast: a narrower compute dtype than the weights')
        out.copy_(a @ b)


def _ungroup(grouped: torch.Tensor, group: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Rows grouped by local expert back to received order."""
    out = like.new_empty(like.shape[0], grouped.shape[1])
    out[group] = grouped
    return out


def _combine(back: torch.Tensor, route: _Route, top: torch.Tensor) -> torch.Tensor:
    """(n, C) each token's routed slots' outputs (``back``, sorted like the rows sent) weighted by the routing
    and summed (a dropped slot adds nothing)."""
    weight = top.reshape(-1)[route.order].to(back.dtype).unsqueeze(1)  # (routed slots, 1)
    return back.new_zeros(top.shape[0], back.shape[1]).index_add_(0, route.token, back * weight)


# ----------------------------------------------------------------------------- eager: one node, activations kept


@dataclass
class _Saved:
    """What backward needs from one forward: the layouts, and per owned rank the route and the activations."""

    layout: ExpertLayout
    y_sbp: NdSbp  # the output's; its gradient's too, with partial axes made whole
    dx_sbp: NdSbp
    w_sbps: tuple[NdSbp, ...]
    routes: dict[int, _Route]
    rows_in: dict[int, torch.Tensor] = field(default_factory=dict)  # received rows grouped by local expert
    weights_in: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # the local stacked w1, w2, w3 (cast)
    pre: dict[int, Pre] = field(default_factory=dict)  # the local experts' pre-activations
    back: Shards = field(default_factory=dict)  # (routed slots, C): their expert outputs, sorted like the rows sent
    top: Shards = field(default_factory=dict)  # (n, k): the routing weights


def routed_experts(x: Tensor, top: Tensor, index: Tensor, keep: Tensor | None, experts: Weights,
                   layout: ExpertLayout) -> tuple[Tensor, Tensor]:
    """Each token's routed experts' outputs weighted by the routing, global (N, C), by the all-to-all exchange
    (module docstring); and the slots each expert received, global (E,).

    ``x`` is the (N, C) tokens laid out as ``layout.token_sbp`` gives; ``top`` their (N, k) routing weights,
    ``index`` their (N, k) expert ids and ``keep`` (N, k) which slots their expert takes (``None``: all,
    dropless), all three in ``x``'s layout; ``experts`` the stacked (w1, w2, w3), S(0) on the ep axis.
    """
    y_sbp, dx_sbp, w_sbps = _sbps(x.sbp, tuple(w.sbp for w in experts), tuple(w.placement for w in experts), layout)
    backend = get_backend()
    backend.prepare(_group_plan(layout.mesh))  # the ep groups' process groups, made collectively
    ids = index.local_tensors()
    if keep is not None:  # a dropped slot's expert becomes num_experts, which no member holds
        keeps = keep.local_tensors()
        ids = {r: torch.where(keeps[r], i, layout.num_experts) for r, i in ids.items()}
    groups = _axis_groups(layout.mesh, layout.axis)
    p = layout.mesh.hierarchy[layout.axis]
    routes = _routes(ids, dict.fromkeys(ids, 0), p, dict.fromkeys(ids, layout.per_member), groups, backend)
    xs = x.local_tensors()
    rows = _send(groups, {r: xs[r][route.token] for r, route in routes.items()}, routes, backend)
    tracked = is_grad_enabled() and any(t.requires_grad for t in (x, top, *experts))
    saved = _Saved(layout, y_sbp, dx_sbp, w_sbps, routes)
    weights = [w.local_tensors() for w in experts]
    outputs = {r: _run_local_experts(saved, r, rows[r], [w[r] for w in weights], tracked) for r in xs}
    back = _send(groups, outputs, routes, backend, back=True)
    tops = top.local_tensors()
    outs = {}
    for r, route in routes.items():
        outs[r] = _combine(back[r], route, tops[r])
    out = Tensor._from_shards(tuple(x.shape), x.dtype, layout.mesh, y_sbp, outs)
    if tracked:
        saved.top, saved.back = tops, back
        record(_ROUTED, (x, top, *experts), {"saved": saved}, (out,))
    return out, _expert_counts(x, routes, ids, layout)


def _expert_counts(x: Tensor, routes: dict[int, _Route], ids: Shards, layout: ExpertLayout) -> Tensor:
    """The slots each expert received, (E,) in ``x``'s dtype: each rank's own counts, added up over the axes
    that split the tokens (a P(sum) there)."""
    counts = {r: torch.bincount(ids[r].reshape(-1)[route.order], minlength=layout.num_experts).to(x.dtype)
              for r, route in routes.items()}
    sbp = tuple(Partial("sum") if s == Split(0) else Broadcast() for s in x.sbp)
    return Tensor._from_shards((layout.num_experts,), x.dtype, layout.mesh, sbp, counts)


@_ROUTED.grad
def _routed_experts_grad(ctx: Any, dy: Tensor) -> Any:
    saved: _Saved = ctx.attrs["saved"]
    layout = saved.layout
    backend = get_backend()
    want = tuple(Broadcast() if isinstance(s, Partial) else s for s in saved.y_sbp)
    if (dy.placement, dy.sbp) != (layout.mesh, want):
        dy = to_global(dy, layout.mesh, want)
    douts = dy.local_tensors()
    groups = _axis_groups(layout.mesh, layout.axis)
    d_sent, d_top = {}, {}
    for r, g in douts.items():  # g: (n, C); a slot's output gradient is its routing weight times the token's
        route, top_r = saved.routes[r], saved.top[r]
        weight = top_r.reshape(-1)[route.order].to(g.dtype)  # (routed slots,), sorted like the rows sent
        g_slots = g[route.token]  # (routed slots, C): each slot's token's gradient
        d_sent[r] = g_slots * weight.unsqueeze(1)
        d_top[r] = top_r.new_zeros(top_r.shape)
        d_top[r].view(-1)[route.order] = (saved.back[r] * g_slots).sum(1).to(top_r.dtype)  # 0 where dropped
    d_rows_out = _send(groups, d_sent, saved.routes, backend)
    d_rows_in, d_weights = {}, {}
    for r in douts:
        route, rows = saved.routes[r], saved.rows_in[r]
        d_grouped, d_weights[r] = _experts_grad(rows, route.sizes, saved.pre[r], saved.weights_in[r],
                                                d_rows_out[r][route.group], ctx.inputs[2].dtype)
        d_rows_in[r] = _ungroup(d_grouped, route.group, rows)
    d_back = _send(groups, d_rows_in, saved.routes, backend, back=True)
    x, top = ctx.inputs[0], ctx.inputs[1]
    dxs = {}
    for r, g in d_back.items():
        rows = g.new_zeros(douts[r].shape[0], g.shape[-1])
        dxs[r] = rows.index_add_(0, saved.routes[r].token, g)  # each token sums its k slots
    dx = Tensor._from_shards(tuple(x.shape), x.dtype, layout.mesh, saved.dx_sbp, dxs)
    dtop = Tensor._from_shards(tuple(top.shape), top.dtype, layout.mesh, saved.y_sbp, d_top)
    dws = [Tensor._from_shards(tuple(w.shape), w.dtype, layout.mesh, saved.w_sbps[i],
                               {r: d[i] for r, d in d_weights.items()}) for i, w in enumerate(ctx.inputs[2:])]
    return (dx, dtop, *dws)


def _run_local_experts(saved: _Saved, r: int, rows: torch.Tensor, weights: list[torch.Tensor],
                       tracked: bool) -> torch.Tensor:
    """Rank ``r``'s experts, each on its own received rows; returns the outputs in received order, and keeps
    what the backward (:func:`_experts_grad`, by hand: no local autograd graph) reads."""
    route = saved.routes[r]
    rows_in = rows[route.group]  # (received rows, C) grouped by local expert
    cast = [w.to(rows.dtype) for w in weights]  # (a no-op unless autocast gave the tokens a narrower dtype)
    grouped, pre = _experts(rows_in, route.sizes, *cast)
    if tracked:
        saved.rows_in[r], saved.weights_in[r], saved.pre[r] = rows_in, cast, pre
    return _ungroup(grouped, route.group, rows)


@lru_cache(maxsize=256)
def _sbps(x_sbp: NdSbp, w_sbps: tuple[NdSbp, ...], placements: tuple[Placement, ...],
          layout: ExpertLayout) -> tuple[NdSbp, NdSbp, tuple[NdSbp, ...]]:
    """The output's, the tokens' gradient's and each stacked weight gradient's SBP, from the tokens' SBP and the
    stacked (w1, w2, w3)'s; raises on layouts that the exchange cannot run (see the module docstring)."""
    if x_sbp[layout.axis] != Split(0) or any(s not in (Split(0), Broadcast()) for s in x_sbp):
        raise SbpflowError(f"routed_experts needs the tokens split on the ep axis {layout.axis} and split or whole "
                           f"on the others, but got tokens with sbp {format_nd(x_sbp)} on {layout.mesh}")
    for placement, sbp in zip(placements, w_sbps, strict=True):
        if placement != layout.mesh or sbp[layout.axis] != Split(0):
            raise SbpflowError(f"routed_experts: the stacked experts must lie on {layout.mesh} split S(0) on mesh "
                               f"axis {layout.axis}, but one lies on {placement} with sbp {format_nd(sbp)}")
    y_sbp, dx_sbp = list(x_sbp), list(x_sbp)
    for axis in range(layout.mesh.ndim):
        if axis == layout.axis:
            continue
        split = tuple(sbp[axis] for sbp in w_sbps)
        if split == MEGATRON and x_sbp[axis] == Broadcast():
            y_sbp[axis] = dx_sbp[axis] = Partial("sum")
        elif not all(s == Broadcast() for s in split):
            raise SbpflowError(
                f"routed_experts: on mesh axis {axis} the stacked (w1, w2, w3) must be whole (B) or Megatron "
                f"(S(1), S(2), S(1)) with the tokens whole, but they are {tuple(format_nd((s,)) for s in split)} "
                f"and the tokens sbp {format_nd(x_sbp)}")
    grads = tuple(tuple(_weight_grad_sbp(sbp[a], x_sbp[a], a == layout.axis) for a in range(layout.mesh.ndim))
                  for sbp in w_sbps)
    return tuple(y_sbp), tuple(dx_sbp), grads


def _weight_grad_sbp(weight: Any, tokens: Any, ep_axis: bool) -> Any:
    if ep_axis or isinstance(weight, Split):
        return weight  # the rank's experts, or its slice of them
    return Partial("sum") if tokens == Split(0) else Broadcast()  # each rank's tokens add to the gradient


@lru_cache(maxsize=64)
def _axis_groups(mesh: Placement, axis: int) -> tuple[tuple[int, ...], ...]:
    """``mesh.axis_groups(axis)``, once per mesh (five exchanges a step read it)."""
    return tuple(mesh.axis_groups(axis))


@lru_cache(maxsize=64)
def _group_plan(mesh: Placement) -> boxing.Plan:
    """A boxing plan on the mesh, for ``Backend.prepare``, which makes every axis's process groups."""
    rest = (Broadcast(),) * (mesh.ndim - 1)
    return boxing.plan((mesh.size,), torch.float32, boxing.Layout(mesh, (Split(0), *rest)),
                       boxing.Layout(mesh, (Broadcast(), *rest)))


# ----------------------------------------------------------------------------- the compiled path (nn.Graph)
#
# One communicating op on the mesh: its (n, C) output has a static shape, the routed rows' sizes stay inside the
# kernel. Per mesh axis, inputs (x, top, index, w1, w2, w3) -> y:
#
#     S0 S0 S0 | S0 S0 S0  -> S0     the exchange: only routed rows move (at most one such axis)
#     S0 S0 S0 | B  B  B   -> S0     data parallel
#     B  B  B  | S0 S0 S0  -> P      tokens whole: each member its own experts, no exchange
#     B  B  B  | S1 S2 S1  -> P      Megatron inside the experts
#     B  B  B  | B  B  B   -> B
#
# The backward op routes again (counts, then the tokens with their gradients in one all-to-all), recomputes the
# experts on the rows it receives, and sends the rows' gradients home.


def _exchange_meta(x: Meta, top: Meta, index: Meta, w1: Meta, w2: Meta, w3: Meta) -> Meta:
    return Meta(x.shape, x.dtype)


_FORWARD_SIGS = (((Split(0),) * 6, Split(0)), ((Split(0),) * 3 + (Broadcast(),) * 3, Split(0)),
                 ((Broadcast(),) * 3 + (Split(0),) * 3, Partial("sum")),
                 ((Broadcast(),) * 3 + MEGATRON, Partial("sum")), ((Broadcast(),) * 6, Broadcast()))


def _exchange_sigs(x: Meta, top: Meta, index: Meta, w1: Meta, w2: Meta, w3: Meta, outs: Any) -> list[Sig]:
    return [Sig(ins, (out,)) for ins, out in _FORWARD_SIGS]


_UNSUPPORTED = (1 << 20, 1 << 60)  # (messages, bytes) that no selection picks: a layout the kernel refuses


def _routed_row_bytes(metas: tuple[Meta, ...], sbps: tuple[NdSbp, ...], placement: Placement,
                      width: int) -> tuple[int, int]:
    """(messages, bytes) one rank sends in one exchange of ``width``-wide rows, if routing is uniform: each of
    its n * k slots leaves with probability (p - 1) / p."""
    try:
        axes = _exchange_axes(sbps, metas[3].shape[0], placement)
    except SbpflowError:
        return _UNSUPPORTED
    p = math.prod(placement.hierarchy[a] for a in axes)
    if p == 1:
        return 0, 0
    box = shard_box(metas[0].shape, placement, sbps[0], placement.flat_ranks[0])
    slots = (box[0][1] - box[0][0]) * metas[2].shape[-1]
    return 2 * (p - 1), 2 * nbytes((slots * (p - 1) // p, width), metas[0].dtype)


def _forward_talks(metas: tuple[Meta, ...], sbps: tuple[NdSbp, ...], placement: Placement) -> tuple[int, int]:
    """The count exchange is small; the rows go there and come back."""
    return _routed_row_bytes(metas, sbps, placement, metas[0].shape[-1])


def _backward_talks(metas: tuple[Meta, ...], sbps: tuple[NdSbp, ...], placement: Placement) -> tuple[int, int]:
    """Tokens with their gradients and routing weight there (2C + 1), the rows' gradients and dtop back (C + 1)."""
    messages, there_and_back = _routed_row_bytes(metas[1:], sbps[1:], placement, 3 * metas[1].shape[-1] + 2)
    return messages, there_and_back // 2


def _exchange_axes(sbps: Sequence[NdSbp], experts: int, placement: Placement) -> tuple[int, ...]:
    """The mesh axes on which both the tokens (input 0) and the stacked w1 (input 3) are split on dim 0: the
    routing's. Raises where the experts are split on another axis too, or unevenly over these."""
    axes = tuple(a for a, (s, w) in enumerate(zip(sbps[0], sbps[3], strict=True)) if s == Split(0) == w)
    split = tuple(a for a, w in enumerate(sbps[3]) if w == Split(0))
    members = math.prod(placement.hierarchy[a] for a in axes)
    if axes and (split != axes or experts % members):
        raise SbpflowError(f"expert_exchange routes over the mesh axes that split both the tokens and the experts "
                           f"(evenly), but the tokens {format_nd(sbps[0])} and the experts {format_nd(sbps[3])} "
                           f"on {placement} split {experts} experts over {members} members on axes {axes}, and "
                           f"the experts on axes {split}")
    return axes


@dataclass(frozen=True)
class _Where:
    """Which experts an op call routes to, and over which groups: from the ranks' ShardCtxs."""

    first: dict[int, int]  # per owned rank, the first expert routed to
    members: int  # members of an ep group (1: no exchange, the rank's own experts only)
    per: dict[int, int]  # per owned rank, experts per member
    groups: tuple[tuple[int, ...], ...] | None  # the ep groups, members in expert order; None: no exchange


def _where(ctxs: dict[int, ShardCtx], w1: int = 3) -> _Where:
    """For the forward (w1 at input 3) and the backward (w1 at input 4)."""
    ctx = next(iter(ctxs.values()))
    placement = ctx.placement
    shape = ctx.in_metas[w1].shape
    if placement is None:  # local tensors: every expert here
        return _Where(dict.fromkeys(ctxs, 0), 1, dict.fromkeys(ctxs, shape[0]), None)
    sbp = ctx.in_sbps[w1]
    axes = _exchange_axes(ctx.in_sbps[w1 - 3:], shape[0], placement)
    if not axes:  # each rank its own experts, on its own tokens
        boxes = {r: c.in_boxes[w1][0] for r, c in ctxs.items()}
        return _Where({r: lo for r, (lo, _) in boxes.items()}, 1, {r: hi - lo for r, (lo, hi) in boxes.items()}, None)
    groups: dict[tuple[int, ...], list[int]] = {}  # ranks alike off the routing axes, by their experts
    for r in placement.flat_ranks:
        groups.setdefault(tuple(c for a, c in enumerate(placement.coords(r)) if a not in axes), []).append(r)
    ordered = tuple(tuple(sorted(g, key=lambda r: shard_box(shape, placement, sbp, r)[0][0])) for g in groups.values())
    members = len(ordered[0])
    return _Where(dict.fromkeys(ctxs, 0), members, dict.fromkeys(ctxs, shape[0] // members), ordered)


@contextmanager
def _kernel_channel(ctxs: dict[int, ShardCtx], backend: Backend) -> Iterator[None]:
    """The kernel's all-to-alls over process groups of their own: under nn.Graph it runs on a thread of its own,
    beside other threads' collectives over the same ranks (the runtime makes the groups before a step)."""
    placement = next(iter(ctxs.values())).placement
    if placement is not None:
        backend.prepare_channel(placement, KERNEL_CHANNEL)
    with backend.on_channel(KERNEL_CHANNEL):
        yield


@op("expert_exchange", meta=_exchange_meta, sbp=_exchange_sigs, shard_aware=True, communicating=_forward_talks)
def expert_exchange(ctxs: dict[int, ShardCtx], x: Shards, top: Shards, index: Shards, w1: Shards, w2: Shards,
                    w3: Shards) -> Shards:
    """Each token's experts' outputs weighted by the routing, local (n, C) per owned rank: ``x`` (N, C) tokens,
    ``top`` and ``index`` their (N, k) routing weights and experts (a dropped slot: expert E), and the stacked
    experts (w1, w2, w3); the table above gives the layouts."""
    where = _where(ctxs)
    backend = get_backend()
    with _kernel_channel(ctxs, backend):
        return _exchange_forward(where, x, top, index, w1, w2, w3, backend)


def _exchange_forward(where: _Where, x: Shards, top: Shards, index: Shards, w1: Shards, w2: Shards, w3: Shards,
                      backend: Backend) -> Shards:
    routes = _routes(index, where.first, where.members, where.per, where.groups, backend)
    rows = _send(where.groups, {r: x[r][route.token] for r, route in routes.items()}, routes, backend)
    outs = {}
    for r, route in routes.items():
        grouped, _ = _experts(rows[r][route.group], route.sizes, *(w[r].to(x[r].dtype) for w in (w1, w2, w3)))
        outs[r] = _ungroup(grouped, route.group, rows[r])
    back = _send(where.groups, outs, routes, backend, back=True)
    return {r: _combine(back[r], route, top[r]) for r, route in routes.items()}


@expert_exchange.grad
def _expert_exchange_grad(ctx: Any, dy: Tensor) -> Any:
    dx, dtop, *dws = expert_exchange_backward(dy, *ctx.inputs)
    return (dx, dtop, None, *dws)


def _backward_meta(dy: Meta, x: Meta, top: Meta, index: Meta, w1: Meta, w2: Meta, w3: Meta) -> tuple[Meta, ...]:
    return x, top, w1, w2, w3


def _backward_sigs(dy: Meta, x: Meta, top: Meta, index: Meta, w1: Meta, w2: Meta, w3: Meta, outs: Any) -> list[Sig]:
    """The forward's table with dy in front (as y's) and (dx, dtop, dw1, dw2, dw3) out."""
    s0, b, psum = Split(0), Broadcast(), Partial("sum")
    return [Sig((s0,) * 7, (s0,) * 5),
            Sig((s0,) * 4 + (b,) * 3, (s0, s0, psum, psum, psum)),
            Sig((b,) * 4 + (s0,) * 3, (psum, psum, s0, s0, s0)),
            Sig((b,) * 4 + MEGATRON, (psum, psum) + MEGATRON),
            Sig((b,) * 7, (b,) * 5)]


@op("expert_exchange_backward", meta=_backward_meta, sbp=_backward_sigs, shard_aware=True, differentiable=False,
    communicating=_backward_talks)
def expert_exchange_backward(ctxs: dict[int, ShardCtx], dy: Shards, x: Shards, top: Shards, index: Shards,
                             w1: Shards, w2: Shards, w3: Shards) -> dict[int, tuple[torch.Tensor, ...]]:
    """(dx, dtop, dw1, dw2, dw3) of :func:`expert_exchange`, local per owned rank."""
    where = _where(ctxs, w1=4)
    backend = get_backend()
    with _kernel_channel(ctxs, backend):
        return _exchange_backward(where, dy, x, top, index, w1, w2, w3, backend)


def _exchange_backward(where: _Where, dy: Shards, x: Shards, top: Shards, index: Shards, w1: Shards, w2: Shards,
                       w3: Shards, backend: Backend) -> dict[int, tuple[torch.Tensor, ...]]:
    routes = _routes(index, where.first, where.members, where.per, where.groups, backend)
    sent = {}
    for r, route in routes.items():  # each routed slot's token, its output's gradient and its routing weight
        weight = top[r].reshape(-1)[route.order].to(x[r].dtype).unsqueeze(1)
        sent[r] = torch.cat([x[r][route.token], dy[r][route.token].to(x[r].dtype), weight], dim=1)
    rows = _send(where.groups, sent, routes, backend)
    replies, dws = {}, {}
    for r, route in routes.items():
        replies[r], dws[r] = _experts_backward(rows[r], route, w1[r], w2[r], w3[r])
    back = _send(where.groups, replies, routes, backend, back=True)
    out = {}
    for r, route in routes.items():
        width = x[r].shape[1]
        dx = x[r].new_zeros(x[r].shape).index_add_(0, route.token, back[r][:, :width])  # a token sums its slots
        dtop = top[r].new_zeros(top[r].numel())
        dtop[route.order] = back[r][:, width].to(dtop.dtype)
        out[r] = (dx, dtop.view(top[r].shape), *dws[r])
    return out


def _experts_backward(rows: torch.Tensor, route: _Route, w1: torch.Tensor, w2: torch.Tensor,
                      w3: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """On received rows (token, output gradient, routing weight): (each row's token gradient and routing weight
    gradient, (rows, C + 1)), and the local experts' weight gradients."""
    width = (rows.shape[1] - 1) // 2
    grouped = rows[route.group]
    xs, dys, weight = grouped[:, :width], grouped[:, width:2 * width], grouped[:, 2 * width:]
    cast = [w.to(xs.dtype) for w in (w1, w2, w3)]
    out, pre = _experts(xs, route.sizes, *cast)
    d_rows, d_weights = _experts_grad(xs, route.sizes, pre, cast, dys * weight, w1.dtype)
    d_weight = (out * dys).sum(1, keepdim=True)  # the slot's output against its token's gradient
    reply = _ungroup(torch.cat([d_rows, d_weight], dim=1), route.group, rows)
    return reply, d_weights


__all__ = ["ExpertLayout", "check_layout", "expert_exchange", "routed_experts"]
