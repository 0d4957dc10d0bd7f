"""Conversions that move data between layouts: ``to_global`` (boxing) and local <-> global.

Their gradients are conversions back: the gradient of ``to_global`` is a
``to_global`` to the input's layout, so it is boxed like any other tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import boxing
from .._layout import shard_shape
from ..autograd import is_grad_enabled
from ..comm import get_backend
from ..errors import SbpError, ShapeError
from ..placement import Placement
from ..sbp import NdSbp, Partial, Split, broadcast, format_nd, normalize
from ..tensor import Tensor
from .dispatch import interpreter_for, record
from .schema import OpDef

_to_global = OpDef("to_global", kernel=lambda *a: None, meta=lambda *a: None, sbp=lambda *a: [], shard_aware=False,
                   save_outputs=False, differentiable=True, mesh_aware=False)
_local_to_global = OpDef("local_to_global", kernel=lambda *a: None, meta=lambda *a: None, sbp=lambda *a: [],
                         shard_aware=False, save_outputs=False, differentiable=True, mesh_aware=False)


def to_global(x: Tensor, placement: Placement, sbp: Any, grad_sbp: Any = None) -> Tensor:
    """Boxes global ``x`` to ``(placement, sbp)`` with the cheapest plan.

    ``grad_sbp`` is the SBP (on ``x``'s placement) that the gradient of ``x`` gets in backward; by default
    ``x``'s own. ``P(sum)`` there, for example, leaves the reduction of the gradient to whoever needs it.
    """
    nd = normalize(sbp, placement, x.ndim, what=f"tensor with {x._describe()}")
    grad_nd = None if grad_sbp is None else normalize(grad_sbp, x.placement, x.ndim,
                                                      what=f"grad_sbp of tensor with {x._describe()}")
    src = boxing.Layout(x.placement, x.sbp)
    dst = boxing.Layout(placement, nd)
    if src == dst and (grad_nd is None or grad_nd == x.sbp or not x.requires_grad):
        return x
    out = interpreter_for(x).to_global(x, placement, nd)  # the tracer records it, meta keeps no data, eager boxes
    if is_grad_enabled() and x.requires_grad:
        record(_to_global, (x,), {"grad_sbp": grad_nd}, (out,))
    return out


@_to_global.grad
def _to_global_grad(ctx: Any, dy: Tensor) -> Any:
    x = ctx.inputs[0]
    grad_sbp = ctx.attrs.get("grad_sbp")
    return (to_global(dy, x.placement, x.sbp if grad_sbp is None else grad_sbp),)


def local_to_global(x: Tensor, placement: Placement, sbp: Any) -> Tensor:
    """Takes the local tensor as the shard of every rank of ``placement`` that this process owns.

    One rule in both modes: **each rank contributes its local tensor, and the SBP says what the
    contributions mean**. Split axes concatenate them, a broadcast axis takes the (common) replica, and a
    partial axis reduces them: ``P(sum)`` adds every rank's tensor. Virtual ranks of one process all
    contribute the one local tensor, so onto ``P(sum)`` over 2 virtual ranks ``[1, 1]`` becomes ``[2, 2]``,
    exactly as 2 processes each passing ``[1, 1]`` do.

    With one process per rank the shards may differ in length along split dims
    (as ``torch.tensor_split`` cuts them); the logical shape comes from every
    rank's local shape, which costs one small exchange between processes.
    """
    if not isinstance(placement, Placement):
        raise SbpError(f"to_global(placement=...) needs an sbpflow.placement, but got {placement!r}")
    local = x.to_local()
    nd = normalize(sbp, placement, local.dim(), what=f"local tensor of shape {list(local.shape)}")
    backend = get_backend()
    shape = _logical_shape(placement, nd, backend.local_shapes(placement, tuple(local.shape)))
    owned = backend.owned(placement.flat_ranks)
    shards = {r: local.to(backend.device_for(placement.type, r), copy=True) for r in owned}
    backend.check_replicas(placement, nd, shards, "to_global of a local tensor")
    out = Tensor._from_shards(tuple(shape), local.dtype, placement, nd, shards)
    if is_grad_enabled() and x.requires_grad:
        record(_local_to_global, (x,), {"placement": placement, "sbp": nd}, (out,))
    return out


def _logical_shape(placement: Placement, nd: NdSbp, shapes: dict[int, tuple[int, ...]]) -> tuple[int, ...]:
    """The logical shape whose shards (as ``shard_box`` cuts them) are exactly the given local ``shapes``.

    A dim split by some mesh axes is the sum of the pieces of the ranks whose
    coordinate is 0 on every other axis; any other dim must agree on all ranks.
    """
    first = shapes[placement.flat_ranks[0]]
    if any(len(s) != len(first) for s in shapes.values()):
        raise ShapeError(f"local_to_global needs local tensors of one rank (ndim) on every rank, but got {shapes}")
    shape = []
    for d in range(len(first)):
        axes = {axis for axis, s in enumerate(nd) if isinstance(s, Split) and s.dim == d}
        owners = [r for r in placement.flat_ranks
                  if all(c == 0 for axis, c in enumerate(placement.coords(r)) if axis not in axes)]
        shape.append(sum(shapes[r][d] for r in owners) if axes else first[d])
    logical = tuple(shape)
    for r in placement.flat_ranks:
        if shard_shape(logical, placement, nd, r) != tuple(shapes[r]):
            expected = {q: shard_shape(logical, placement, nd, q) for q in placement.flat_ranks}
            raise ShapeError(
                f"local_to_global onto {placement} with sbp {format_nd(nd)} needs local shapes that tile a logical "
                f"tensor the way torch.tensor_split cuts it (a logical shape {list(logical)} has shards {expected}), "
                f"but the ranks hold {shapes}"
            )
    return logical


@_local_to_global.grad
def _local_to_global_grad(ctx: Any, dy: Tensor) -> Any:
    """The local tensor's gradient: the sum of what each of its contributions received.

    A partial axis adds contributions up, so each contributor's gradient is the whole ``dy`` there: box
    partial axes to B first. One process per rank then takes its own shard. Virtual ranks share one local
    tensor, which the forward made every rank's contribution: along split and ``P(sum)`` axes each copy
    counts (their gradients add up); along broadcast and ``P(max)``/``P(min)`` axes the copies are one value
    (a replica, or the max of equal pieces), so only coordinate 0 there counts.
    """
    x = ctx.inputs[0]
    placement, nd = ctx.attrs["placement"], ctx.attrs["sbp"]
    adjoint = tuple(broadcast if isinstance(s, Partial) else s for s in nd)
    if (dy.placement, dy.sbp) != (placement, adjoint):
        dy = to_global(dy, placement, adjoint)
    shards = dy.local_tensors()
    if not shards:  # this process owns no rank of the placement: its local tensor fed nothing
        return (Tensor._from_local(torch.zeros_like(x.to_local())),)
    keep = list(shards)
    if len(shards) > 1:
        once = [axis for axis, s in enumerate(nd) if not isinstance(s, Split) and s != Partial("sum")]
        keep = [r for r in shards if all(placement.coords(r)[axis] == 0 for axis in once)]
    local = shards[keep[0]].to(x.device, copy=True)
    for r in keep[1:]:
        local += shards[r].to(x.device)
    return (Tensor._from_local(local),)


def layout_of(x: Tensor) -> tuple[Placement, NdSbp]:
    return x.placement, x.sbp
