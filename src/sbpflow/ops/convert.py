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
from ..graph import trace as _trace
from ..placement import Placement
from ..sbp import NdSbp, Partial, Split, broadcast, format_nd, normalize
from ..tensor import Tensor
from .registry import OpDef, _record

_to_global = OpDef("to_global", kernel=lambda *a: None, meta=lambda *a: None, sbp=lambda *a: [], shard_aware=False,
                   save_outputs=False, differentiable=True, mesh_aware=False)
_local_to_global = OpDef("local_to_global", kernel=lambda *a: None, meta=lambda *a: None, sbp=lambda *a: [],
                         shard_aware=False, save_outputs=False, differentiable=True, mesh_aware=False)


def to_global(x: Tensor, placement: Placement, sbp: Any) -> Tensor:
    """Boxes global ``x`` to ``(placement, sbp)`` with the cheapest plan."""
    nd = normalize(sbp, placement, x.ndim, what=f"tensor with {x._describe()}")
    src = boxing.Layout(x.placement, x.sbp)
    dst = boxing.Layout(placement, nd)
    if src == dst:
        return x
    if _trace.ACTIVE:
        out = _trace.record_to_global(x, placement, nd)
    else:
        plan = boxing.plan(tuple(x.shape), x.dtype, src, dst)
        shards = boxing.execute(plan, x._shards or {})
        out = Tensor._from_shards(tuple(x.shape), x.dtype, placement, nd, shards)
    if is_grad_enabled() and x.requires_grad:
        _record(_to_global, (x,), {}, (out,))
    return out


@_to_global.grad
def _to_global_grad(ctx: Any, dy: Tensor) -> Any:
    x = ctx.inputs[0]
    return (to_global(dy, x.placement, x.sbp),)


def local_to_global(x: Tensor, placement: Placement, sbp: Any) -> Tensor:
    """Takes the local tensor as this rank's shard: every owned (virtual) rank contributes it.

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
    shards = {}
    owned = backend.owned(placement.flat_ranks)
    for r in owned:
        coords = placement.coords(r)
        device = backend.device_for(placement.type, r)
        # A rank's local tensor is its partial contribution; virtual ranks of one process share one local
        # tensor, so there only coordinate 0 contributes it (the logical value is then the local one).
        partial_elsewhere = any(
            isinstance(s, Partial) and s.op == "sum" and c != 0 for s, c in zip(nd, coords, strict=True)
        )
        zero = len(owned) > 1 and partial_elsewhere
        shards[r] = torch.zeros_like(local, device=device) if zero else local.to(device, copy=True)
    out = Tensor._from_shards(tuple(shape), local.dtype, placement, nd, shards)
    if is_grad_enabled() and x.requires_grad:
        _record(_local_to_global, (x,), {"placement": placement, "sbp": nd}, (out,))
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
    """The local tensor's gradient: its share of ``dy``, each logical region counted once.

    A partial axis adds contributions up, so each contributor's gradient is the whole ``dy`` there: box
    partial axes to B first. One process per rank then takes its own shard. Virtual ranks share one local
    tensor: the forward made it every split piece (their gradients add up) but only one replica along
    broadcast and partial axes (coordinate 0 there), so only those shards count.
    """
    x = ctx.inputs[0]
    placement = ctx.attrs["placement"]
    adjoint = tuple(broadcast if isinstance(s, Partial) else s for s in ctx.attrs["sbp"])
    if (dy.placement, dy.sbp) != (placement, adjoint):
        dy = to_global(dy, placement, adjoint)
    shards = dy.local_tensors()
    if not shards:  # this process owns no rank of the placement: its local tensor fed nothing
        return (Tensor._from_local(torch.zeros_like(x.to_local())),)
    keep = list(shards)
    if len(shards) > 1:
        keep = [r for r in shards
                if all(c == 0 for s, c in zip(adjoint, placement.coords(r), strict=True) if not isinstance(s, Split))]
    local = shards[keep[0]].to(x.device, copy=True)
    for r in keep[1:]:
        local += shards[r].to(x.device)
    return (Tensor._from_local(local),)


def layout_of(x: Tensor) -> tuple[Placement, NdSbp]:
    return x.placement, x.sbp
