"""Conversions that move data between layouts: ``to_global`` (boxing) and local <-> global.

Their gradients are conversions back: the gradient of ``to_global`` is a
``to_global`` to the input's layout, so it is boxed like any other tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import boxing
from ..autograd import is_grad_enabled
from ..comm import get_backend
from ..errors import SbpError
from ..placement import Placement
from ..sbp import NdSbp, Partial, Split, normalize
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
    """Takes the local tensor as this rank's shard: every owned (virtual) rank contributes it."""
    if not isinstance(placement, Placement):
        raise SbpError(f"to_global(placement=...) needs an sbpflow.placement, but got {placement!r}")
    local = x.to_local()
    nd = normalize(sbp, placement, local.dim(), what=f"local tensor of shape {list(local.shape)}")
    shape = list(local.shape)
    for axis, s in enumerate(nd):
        if isinstance(s, Split):
            shape[s.dim] *= placement.hierarchy[axis]
    backend = get_backend()
    shards = {}
    for r in backend.owned(placement.flat_ranks):
        coords = placement.coords(r)
        device = backend.device_for(placement.type, r)
        zero = any(isinstance(s, Partial) and s.op == "sum" and c != 0 for s, c in zip(nd, coords))
        shards[r] = torch.zeros_like(local, device=device) if zero else local.to(device, copy=True)
    out = Tensor._from_shards(tuple(shape), local.dtype, placement, nd, shards)
    if is_grad_enabled() and x.requires_grad:
        _record(_local_to_global, (x,), {}, (out,))
    return out


@_local_to_global.grad
def _local_to_global_grad(ctx: Any, dy: Tensor) -> Any:
    local = sum(t.to(ctx.inputs[0].device) for t in dy.local_tensors().values())
    return (Tensor._from_local(local),)


def layout_of(x: Tensor) -> tuple[Placement, NdSbp]:
    return x.placement, x.sbp
