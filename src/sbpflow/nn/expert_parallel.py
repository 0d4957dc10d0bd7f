"""Expert parallelism by all-to-all: each routed token-slot travels to the rank that holds its expert, and back.

Member ``j`` of an ep group (the ranks that differ only on the ``ep`` mesh axis) holds experts
``[j * per, (j + 1) * per)``; tokens enter split on that axis. Per rank, forward::

    slots (n, k) --sorted by expert--> counts per expert --all-to-all (E counts, static)--> counts it receives
    slot rows    --all-to-all, split sizes = those counts--> its experts run on their own rows only (grouped)
    expert rows  --all-to-all back, the sizes reversed----> (n, k, C): each slot's expert output (0 if dropped)
                 --weighted by the routing, summed over k--> (n, C)

Backward is the same exchange reversed. On other mesh axes, data-parallel tokens keep their split (the experts'
gradients are partial there) and a Megatron split inside the experts takes the tokens whole there.

``nn.Graph`` cannot trace this exchange (a traced op has one placement for all its tensors, but the routed rows
would lie on the mesh and each member's experts on the member's), so it uses :func:`member_exchange`: a dropless
buffer of every token sent to each member, which computes its routed rows only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from .. import boxing
from ..autograd import is_grad_enabled
from ..comm import Backend, get_backend
from ..errors import SbpflowError
from ..ops.convert import to_global
from ..ops.dispatch import record
from ..ops.elementwise import add
from ..ops.schema import Meta, OpDef, Sig, op
from ..placement import Placement
from ..sbp import Broadcast, NdSbp, Partial, Split, format_nd
from ..tensor import Tensor

Shards = dict[int, torch.Tensor]  # owned rank -> its local tensor
Weights = tuple[Tensor, Tensor, Tensor]  # one SwiGLU expert's (w1, w2, w3) weights: gate, down, up

_ROUTED = OpDef("routed_experts", kernel=lambda *a: None, meta=lambda *a: None, sbp=lambda *a: [],
                shard_aware=False, save_outputs=False, differentiable=True, mesh_aware=False)


@dataclass(frozen=True)
class ExpertLayout:
    """Experts grouped over mesh axis ``axis`` of the tokens' placement ``mesh``, contiguously."""

    mesh: Placement
    axis: int
    num_experts: int
    members: tuple[Placement, ...]  # member j's ranks: coordinate j on the ep axis (a size-1 axis there)

    @property
    def per_member(self) -> int:
        return self.num_experts // self.mesh.hierarchy[self.axis]

    def placement_of(self, expert: int) -> Placement:
        """Where expert ``expert`` lives: the ranks at coordinate ``expert // per_member`` on the ep axis."""
        return self.members[expert // self.per_member]

    def token_sbp(self, sbp: NdSbp, expert_sbp: NdSbp) -> NdSbp:
        """The tokens' (N, C) SBP for dispatch, from theirs (``sbp``) and an expert weight's: split on the ep axis,
        whole where the experts are split (Megatron), kept split or made whole elsewhere."""
        def one(axis: int, s: Any) -> Any:
            if axis == self.axis:
                return Split(0)
            return Split(0) if s == Split(0) and isinstance(expert_sbp[axis], Broadcast) else Broadcast()
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
    ranks = np.asarray(mesh.flat_ranks).reshape(mesh.hierarchy)
    members = tuple(Placement(mesh.type, np.take(ranks, [j], axis=axis).tolist()) for j in range(mesh.hierarchy[axis]))
    return ExpertLayout(mesh, axis, num_experts, members)


@dataclass
class _Saved:
    """What backward needs from one forward: the layouts, and per owned rank the exchange and the local graph."""

    layout: ExpertLayout
    y_sbp: NdSbp  # the output's; its gradient's too, with partial axes made whole
    dx_sbp: NdSbp
    w_sbps: tuple[NdSbp, ...]
    order: Shards  # the kept slots, sorted by expert (indices into the rank's n * k slots)
    token: Shards  # each kept slot's token (order // k)
    send: Shards  # (p, per) slot rows sent to each member, per expert of that member
    recv: Shards  # (p, per) slot rows received from each member, per local expert
    send_rows: dict[int, list[int]]  # send's rows per member, as the all-to-alls take them
    recv_rows: dict[int, list[int]]
    group: dict[int, torch.Tensor]  # the received rows' order grouped by local expert (stable)
    rows_in: dict[int, torch.Tensor]  # the received rows grouped by local expert (a torch leaf)
    weights_in: dict[int, list[torch.Tensor]]  # the local experts' weights (torch leaves), w1, w2, w3 per expert
    rows_out: dict[int, torch.Tensor]  # the local experts' outputs, grouped like rows_in
    slots: Shards = field(default_factory=dict)  # (n, k, C): each of the rank's slots' expert output
    top: Shards = field(default_factory=dict)  # (n, k): the routing weights


def routed_experts(x: Tensor, top: Tensor, index: Tensor, keep: Tensor | None, experts: Sequence[Weights],
                   layout: ExpertLayout) -> tuple[Tensor, Tensor]:
    """Each token's routed experts' outputs weighted by the routing, global (N, C), by the all-to-all exchange
    (module docstring); and the slots each expert received, global (E,).

    ``x`` is the (N, C) tokens laid out as ``layout.token_sbp`` gives; ``top`` their (N, k) routing weights,
    ``index`` their (N, k) expert ids and ``keep`` (N, k) which slots their expert takes (``None``: all,
    dropless), all three in ``x``'s layout; expert ``e``'s weights lie on ``layout.placement_of(e)``.
    """
    y_sbp, dx_sbp, w_sbps = _sbps(x.sbp, tuple((w.placement, w.sbp) for t in experts for w in t), layout)
    backend = get_backend()
    backend.prepare(_group_plan(layout.mesh))  # the ep groups' process groups, made collectively
    k = int(index.shape[1])
    xs, ids = x.local_tensors(), index.local_tensors()
    keeps = keep.local_tensors() if keep is not None else None
    order, send = {}, {}
    for r in xs:
        expert = ids[r].reshape(-1)  # (n * k,) local slots
        if keeps is None:
            order[r] = torch.argsort(expert, stable=True)
        else:  # dropped slots sort last (as expert E) and stay home
            kept = keeps[r].reshape(-1)
            order[r] = torch.argsort(torch.where(kept, expert, layout.num_experts), stable=True)[:int(kept.sum())]
        counts = torch.bincount(expert[order[r]], minlength=layout.num_experts)
        send[r] = counts.view(-1, layout.per_member)  # (p, per)
    recv = _exchange_counts(layout, send, backend)
    send_rows = {r: c.sum(1).tolist() for r, c in send.items()}
    recv_rows = {r: c.sum(1).tolist() for r, c in recv.items()}
    token = {r: o // k for r, o in order.items()}
    sent = {r: xs[r][token[r]] for r in xs}  # (kept slots, C), sorted by expert
    rows = _exchange(layout, sent, send_rows, recv_rows, backend)
    tracked = _needs_grad((x, top, *[w for triple in experts for w in triple]))
    saved = _Saved(layout, y_sbp, dx_sbp, w_sbps, order, token, send, recv, send_rows, recv_rows, {}, {}, {}, {})
    outputs = {r: _run_local_experts(saved, r, rows[r], _local_weights(experts, layout, r), tracked) for r in xs}
    back = _exchange(layout, outputs, recv_rows, send_rows, backend)
    tops = top.local_tensors()
    outs = {}
    for r, rows_r in xs.items():
        slots = rows_r.new_zeros(rows_r.shape[0] * k, rows_r.shape[1])
        slots[order[r]] = back[r].detach()
        saved.slots[r] = slots.view(rows_r.shape[0], k, rows_r.shape[1])  # (n, k, C) local: each slot's output
        weights = tops[r].to(slots.dtype).unsqueeze(1)  # (n, 1, k)
        outs[r] = torch.bmm(weights, saved.slots[r]).squeeze(1)  # (n, C): weighted, summed over k
    out = Tensor._from_shards(tuple(x.shape), x.dtype, layout.mesh, y_sbp, outs)
    if tracked:
        saved.top = tops
        record(_ROUTED, (x, top, *[w for triple in experts for w in triple]), {"saved": saved}, (out,))
    return out, _expert_counts(x, send, layout)


def _expert_counts(x: Tensor, send: Shards, layout: ExpertLayout) -> Tensor:
    """The slots each expert received, (E,) in ``x``'s dtype: each rank's own counts, added up over the axes
    that split the tokens (a P(sum) there)."""
    counts = {r: c.reshape(-1).to(x.dtype) for r, c in send.items()}
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
    d_sent, d_top = {}, {}
    for r, g in douts.items():  # g: (n, C); a slot's output gradient is its routing weight times the token's
        top_r = saved.top[r]
        weight = top_r.reshape(-1)[saved.order[r]].to(g.dtype)  # (kept slots,), sorted like the rows sent
        d_sent[r] = g[saved.token[r]] * weight.unsqueeze(1)
        d_top[r] = torch.bmm(saved.slots[r], g.unsqueeze(-1)).squeeze(-1).to(top_r.dtype)  # (n, k)
    d_rows_out = _exchange(layout, d_sent, saved.send_rows, saved.recv_rows, backend)
    d_rows_in, d_weights = {}, {}
    for r in douts:
        leaves = [saved.rows_in[r], *saved.weights_in[r]]
        # the local graph lives as long as this node (the engine drops its attrs once backward ran without
        # retain_graph), so that backward(retain_graph=True) can run through it again
        group = saved.group[r]
        grads = torch.autograd.grad(saved.rows_out[r], leaves, d_rows_out[r][group], allow_unused=True,
                                    retain_graph=True)
        d_rows_in[r] = torch.empty_like(leaves[0])
        d_rows_in[r][group] = _or_zeros(grads[0], leaves[0])  # back to received order
        d_weights[r] = [_or_zeros(g, w) for g, w in zip(grads[1:], leaves[1:], strict=True)]
    d_back = _exchange(layout, d_rows_in, saved.recv_rows, saved.send_rows, backend)
    x = ctx.inputs[0]
    dxs = {}
    for r, g in d_back.items():
        rows = torch.zeros(douts[r].shape[0], g.shape[-1], dtype=g.dtype, device=g.device)
        dxs[r] = rows.index_add_(0, saved.token[r], g)  # each token sums its k slots
    dx = Tensor._from_shards(tuple(x.shape), x.dtype, layout.mesh, saved.dx_sbp, dxs)
    top = ctx.inputs[1]
    dtop = Tensor._from_shards(tuple(top.shape), top.dtype, layout.mesh, saved.y_sbp, d_top)
    return (dx, dtop, *_weight_grads(ctx.inputs[2:], saved, d_weights, backend))


def _run_local_experts(saved: _Saved, r: int, rows: torch.Tensor, weights: list[torch.Tensor],
                       tracked: bool) -> torch.Tensor:
    """Rank ``r``'s experts, each on its own received rows (grouped by a stable sort of their expert); returns
    the outputs in received order. The two reorderings stay out of the local graph: as plain gathers both ways,
    they cost less than autograd's accumulating scatters."""
    per = saved.layout.per_member
    counts = saved.recv[r]  # (p, per): rows from member j for local expert e
    local = torch.repeat_interleave(torch.arange(per).repeat(counts.shape[0]), counts.reshape(-1))
    group = torch.argsort(local, stable=True)
    with torch.enable_grad() if tracked else torch.no_grad():
        rows_in = rows[group].requires_grad_(tracked)  # (received rows, C) grouped by local expert
        leaves = [w.detach().requires_grad_(tracked) for w in weights]
        cast = [w.to(rows.dtype) for w in leaves]  # (a no-op unless autocast gave the tokens a narrower dtype)
        sizes = counts.sum(0).tolist()
        outs = [_swiglu(c, *cast[3 * e: 3 * e + 3]) for e, c in enumerate(torch.split(rows_in, sizes)) if sizes[e]]
        grouped = torch.cat(outs) if outs else rows_in[:0]
    saved.group[r], saved.rows_in[r], saved.weights_in[r], saved.rows_out[r] = group, rows_in, leaves, grouped
    out = torch.empty_like(rows)
    out[group] = grouped.detach()  # back to received order
    return out


def _swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """:class:`~sbpflow.nn.moe.Expert` on local shards: ``w2(silu(w1 x) * w3 x)``."""
    return torch.nn.functional.linear(torch.nn.functional.silu(x @ w1.t()) * (x @ w3.t()), w2)


def _local_weights(experts: Sequence[Weights], layout: ExpertLayout, r: int) -> list[torch.Tensor]:
    """Rank ``r``'s shards of its experts' weights, w1, w2, w3 per expert, its experts in order."""
    member = _member(layout, r)
    mine = experts[member * layout.per_member:(member + 1) * layout.per_member]
    return [w.local_tensors()[r] for triple in mine for w in triple]


def _weight_grads(weights: Sequence[Tensor], saved: _Saved, d_weights: dict[int, list[torch.Tensor]],
                  backend: Backend) -> list[Tensor]:
    """Expert ``e``'s weight gradients on its placement: each of its ranks holds the gradient of its tokens."""
    out = []
    layout = saved.layout
    owned = [[r for r in d_weights if _member(layout, r) == j] for j in range(len(layout.members))]
    for i, w in enumerate(weights):
        e, which = divmod(i, 3)
        j, local = divmod(e, layout.per_member)
        shards = {r: d_weights[r][3 * local + which] for r in owned[j]}
        out.append(Tensor._from_shards(tuple(w.shape), w.dtype, w.placement, saved.w_sbps[i], shards))
    return out


def _member(layout: ExpertLayout, r: int) -> int:
    """Rank ``r``'s member of its ep group: its coordinate on the ep axis."""
    return layout.mesh.coords(r)[layout.axis]


@lru_cache(maxsize=256)
def _sbps(x_sbp: NdSbp, weights: tuple[tuple[Placement, NdSbp], ...],
          layout: ExpertLayout) -> tuple[NdSbp, NdSbp, tuple[NdSbp, ...]]:
    """The slot outputs', the tokens' gradient's and each weight gradient's SBP, from the tokens' SBP and each
    expert weight's (placement, SBP), w1, w2, w3 per expert; raises on layouts that the exchange cannot run (see
    the module docstring)."""
    if x_sbp[layout.axis] != Split(0) or any(s not in (Split(0), Broadcast()) for s in x_sbp):
        raise SbpflowError(f"routed_experts needs the tokens split on the ep axis {layout.axis} and split or whole "
                           f"on the others, but got tokens with sbp {format_nd(x_sbp)} on {layout.mesh}")
    y_sbp, dx_sbp = list(x_sbp), list(x_sbp)
    megatron = (Split(0), Split(1), Split(0))  # w1 column-parallel, w2 row-parallel, w3 column-parallel
    for e in range(len(weights) // 3):
        triple = weights[3 * e: 3 * e + 3]
        where = layout.placement_of(e)
        for placement, sbp in triple:
            if placement != where:
                raise SbpflowError(f"routed_experts: expert {e}'s weights must lie on {where} (its group on mesh "
                                   f"axis {layout.axis}), but one lies on {placement} with sbp {format_nd(sbp)}")
        for axis in range(layout.mesh.ndim):
            if axis == layout.axis:
                continue
            split = tuple(sbp[axis] for _, sbp in triple)
            if split == megatron and x_sbp[axis] == Broadcast():
                y_sbp[axis] = dx_sbp[axis] = Partial("sum")
            elif not all(s == Broadcast() for s in split):
                raise SbpflowError(
                    f"routed_experts: on mesh axis {axis} an expert's (w1, w2, w3) must be whole (B) or Megatron "
                    f"(S(0), S(1), S(0)) with the tokens whole, but expert {e} has "
                    f"{tuple(format_nd((s,)) for s in split)} and the tokens sbp {format_nd(x_sbp)}")
    w_sbps = tuple(tuple(_weight_grad_sbp(sbp[a], x_sbp[a], a == layout.axis) for a in range(layout.mesh.ndim))
                   for _, sbp in weights)
    return tuple(y_sbp), tuple(dx_sbp), w_sbps


def _weight_grad_sbp(weight: Any, tokens: Any, ep_axis: bool) -> Any:
    if ep_axis:
        return Broadcast()  # one rank on the expert's placement along the ep axis
    if isinstance(weight, Split):
        return weight  # the rank's slice of the expert
    return Partial("sum") if tokens == Split(0) else Broadcast()  # each rank's tokens add to the gradient


def _needs_grad(inputs: Sequence[Tensor]) -> bool:
    return is_grad_enabled() and any(t.requires_grad for t in inputs)


def _or_zeros(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad


def _exchange_counts(layout: ExpertLayout, send: Shards, backend: Backend) -> Shards:
    """Every member learns how many slot rows each member sends it, per local expert: (p, per) counts, one row
    from each member."""
    p = layout.mesh.hierarchy[layout.axis]
    ones = {r: [1] * p for r in send}
    return _exchange(layout, send, ones, ones, backend)


def _exchange(layout: ExpertLayout, rows: Shards, send: dict[int, list[int]], recv: dict[int, list[int]],
              backend: Backend) -> Shards:
    """One all-to-all of rows in every ep group: ``send[r][j]`` rows of ``rows[r]`` go to member j, and
    ``recv[r][j]`` come from it (split sizes known from the count exchange)."""
    out: Shards = {}
    for group in _axis_groups(layout.mesh, layout.axis):
        mine = [r for r in group if r in rows]
        if mine:
            out.update(backend.all_to_all_rows(group, {r: rows[r] for r in mine}, {r: send[r] for r in mine},
                                               {r: recv[r] for r in mine}))
    return out


@lru_cache(maxsize=64)
def _axis_groups(mesh: Placement, axis: int) -> tuple[tuple[int, ...], ...]:
    """``mesh.axis_groups(axis)``, once per mesh (five exchanges a step read it)."""
    return tuple(mesh.axis_groups(axis))


def _group_plan(mesh: Placement) -> boxing.Plan:
    """A boxing plan on the mesh, for ``Backend.prepare``, which makes every axis's process groups."""
    rest = (Broadcast(),) * (mesh.ndim - 1)
    return boxing.plan((mesh.size,), torch.float32, boxing.Layout(mesh, (Split(0), *rest)),
                       boxing.Layout(mesh, (Broadcast(), *rest)))


# ----------------------------------------------------------------------------- the compiled path (nn.Graph)
#
# A traced step needs every shape from metadata, so the exchange carries a dropless capacity buffer: each member
# of an ep group receives its group's tokens and routing (capacity = every token) by one transfer node of the
# plan, runs its experts on the rows routed to them only, and sends its weighted (N, C) contribution back.
#
#     tokens, top, index (mesh, S(0) on ep) --transfer--> member j: member_experts (its experts' rows only)
#     member j's (N, C) --transfer back--> mesh, S(0) on ep --summed over the members--> routed output


def _member_experts_meta(x: Meta, top: Meta, index: Meta, *weights: Meta, first: int) -> Meta:
    return Meta(x.shape, x.dtype)


def _member_experts_sigs(x: Meta, top: Meta, index: Meta, *weights: Meta, outs: Any, first: int) -> list[Sig]:
    """Tokens whole or split (data parallel, weights whole), or whole with Megatron experts (a partial sum)."""
    per = len(weights) // 3
    whole, rows, psum = Broadcast(), Split(0), Partial("sum")
    return [Sig((whole,) * (3 + 3 * per), (whole,)),
            Sig((rows,) * 3 + (whole,) * (3 * per), (rows,)),
            Sig((whole,) * 3 + (Split(0), Split(1), Split(0)) * per, (psum,))]


@op("member_experts", meta=_member_experts_meta, sbp=_member_experts_sigs)
def member_experts(x: torch.Tensor, top: torch.Tensor, index: torch.Tensor, *weights: torch.Tensor,
                   first: int) -> torch.Tensor:
    """One ep member's experts ``first, first + 1, ...`` (w1, w2, w3 each), each on the token slots routed to it
    only, weighted by the routing: local (n, C), zero on tokens routed elsewhere."""
    out = x.new_zeros(x.shape)
    for e in range(len(weights) // 3):
        rows, slot = torch.nonzero(index == first + e, as_tuple=True)  # the (token, slot) pairs routed to it
        y = _swiglu(x[rows], *(w.to(x.dtype) for w in weights[3 * e: 3 * e + 3]))
        out.index_add_(0, rows, top[rows, slot].to(y.dtype).unsqueeze(1) * y)
    return out


@member_experts.grad
def _member_experts_grad(ctx: Any, dy: Tensor) -> Any:
    x, top, index, *weights = ctx.inputs
    grads = member_experts_backward(dy, x, top, index, *weights, **ctx.attrs)
    return (grads[0], grads[1], None, *grads[2:])


def _member_backward_meta(dy: Meta, x: Meta, top: Meta, index: Meta, *weights: Meta, first: int) -> tuple[Meta, ...]:
    return (x, top, *weights)


def _member_backward_sigs(dy: Meta, x: Meta, top: Meta, index: Meta, *weights: Meta, outs: Any,
                          first: int) -> list[Sig]:
    per = len(weights) // 3
    whole, rows, psum = Broadcast(), Split(0), Partial("sum")
    megatron = (Split(0), Split(1), Split(0)) * per
    return [Sig((whole,) * (4 + 3 * per), (whole,) * (2 + 3 * per)),
            Sig((rows,) * 4 + (whole,) * (3 * per), (rows, rows) + (psum,) * (3 * per)),
            Sig((whole,) * 4 + megatron, (psum, psum) + megatron)]


@op("member_experts_backward", meta=_member_backward_meta, sbp=_member_backward_sigs, differentiable=False)
def member_experts_backward(dy: torch.Tensor, x: torch.Tensor, top: torch.Tensor, index: torch.Tensor,
                            *weights: torch.Tensor, first: int) -> tuple[torch.Tensor, ...]:
    """(dx, dtop, dw per weight) of :func:`member_experts` on local shards, by torch autograd over the routed rows."""
    with torch.enable_grad():
        lx, ltop = x.detach().requires_grad_(), top.detach().requires_grad_()
        leaves = [w.detach().requires_grad_() for w in weights]
        out = member_experts.kernel(lx, ltop, index, *leaves, first=first)
        grads = torch.autograd.grad(out, [lx, ltop, *leaves], dy, allow_unused=True)
    return tuple(_or_zeros(g, t) for g, t in zip(grads, [lx, ltop, *leaves], strict=True))


def member_exchange(x: Tensor, top: Tensor, index: Tensor, experts: Sequence[Weights],
                    layout: ExpertLayout) -> Tensor:
    """:func:`routed_experts`' output by static-shaped ops (what ``nn.Graph`` traces): each ep member receives
    the tokens, ``top`` and ``index`` (dropped slots: expert ``num_experts``) on its placement, computes its
    experts on their routed rows only, and its (N, C) contribution returns in ``x``'s layout."""
    _sbps(x.sbp, tuple((w.placement, w.sbp) for t in experts for w in t), layout)  # the eager path's checks
    out: Tensor | None = None
    per = layout.per_member
    for j, member in enumerate(layout.members):
        sbp = tuple(Broadcast() if a == layout.axis else s for a, s in enumerate(x.sbp))
        moved = [to_global(t, member, sbp) for t in (x, top, index)]
        weights = [w for triple in experts[j * per:(j + 1) * per] for w in triple]
        part = to_global(member_experts(*moved, *weights, first=j * per), layout.mesh, x.sbp)
        out = part if out is None else add(out, part)
    assert out is not None
    return out


__all__ = ["ExpertLayout", "check_layout", "member_exchange", "routed_experts"]
