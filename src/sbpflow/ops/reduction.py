"""Reductions over dims: sum, mean, amax, amin (var and std are composites in functional).

Reducing a split dim gives a partial of the matching kind: sum and mean give
``P(sum)`` (mean divides by the logical count, so uneven shards stay exact),
amax gives ``P(max)`` and amin ``P(min)``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..boxing import identity_element
from ..errors import IndexOutOfRangeError
from ..sbp import Partial, Split, broadcast
from . import _rules as R
from .indexing import gather_backward
from .schema import Meta, ShardCtx, Sig, op


def _reduced_shape(x: Meta, dims: tuple[int, ...], keepdim: bool) -> tuple[int, ...]:
    if keepdim:
        return tuple(1 if d in dims else n for d, n in enumerate(x.shape))
    return tuple(n for d, n in enumerate(x.shape) if d not in dims)


def _reduce_meta(x: Meta, dim: Any = None, keepdim: bool = False, dtype: torch.dtype | None = None) -> Meta:
    dims = R.normalize_dims(dim, x.ndim)
    out_dtype = dtype or (torch.int64 if not (x.dtype.is_floating_point or x.dtype.is_complex) else x.dtype)
    return Meta(_reduced_shape(x, dims, keepdim), out_dtype)


def _minmax_meta(x: Meta, dim: Any = None, keepdim: bool = False) -> Meta:
    """amax/amin keep the dtype; like torch, they refuse to reduce nothing (max has no identity to return).

    Only the logical shape counts: an empty *shard* of a non-empty tensor gives the reduction's identity.
    """
    dims = R.normalize_dims(dim, x.ndim)
    if dim is None and 0 in x.shape:
        raise R.ShapeError(f"max/min of a tensor with no elements (shape {list(x.shape)}) is undefined; "
                           "give dim= to reduce a non-empty dim")
    empty = [d for d in dims if x.shape[d] == 0]
    if empty:
        raise IndexOutOfRangeError(f"max/min over dim {empty[0]} needs a non-empty dim, but the input has shape "
                                   f"{list(x.shape)}")
    return Meta(_reduced_shape(x, dims, keepdim), x.dtype)


def _mean_meta(x: Meta, dim: Any = None, keepdim: bool = False, dtype: torch.dtype | None = None) -> Meta:
    m = _reduce_meta(x, dim, keepdim, dtype)
    if not m.dtype.is_floating_point:
        raise R.DTypeError(f"mean needs a floating-point input, but got {str(x.dtype).replace('torch.', '')}")
    return m


def _out_dim(d: int, dims: tuple[int, ...], keepdim: bool) -> int:
    return d if keepdim else d - sum(1 for r in dims if r < d)


def _reduce_sigs(kind: str):  # type: ignore[no-untyped-def]
    """kind: "sum" (P(sum) passes through, split reduced dims give P(sum)), "max", "min"."""

    def sigs(x: Meta, outs: tuple[Meta, ...], dim: Any = None, keepdim: bool = False, dtype: Any = None,
             **_: Any) -> list[Sig]:
        dims = R.normalize_dims(dim, x.ndim)
        out = [Sig((broadcast,), (broadcast,))]
        for d in range(x.ndim):
            if d in dims:
                out.append(Sig((Split(d),), (Partial(kind),)))
            else:
                out.append(Sig((Split(d),), (Split(_out_dim(d, dims, keepdim)),)))
        # sum(dtype=...) casts each element first: on the pieces of a P(sum) that is exact only for a cast that
        # commutes with the sum (see elementwise.cast); split pieces are whole elements, so they need no check
        if dtype is None or dtype == x.dtype or R.cast_is_linear(x.dtype, dtype):
            out.append(Sig((Partial(kind),), (Partial(kind),)))
        return out

    return sigs


@op("sum", meta=_reduce_meta, sbp=_reduce_sigs("sum"), grad_reads=())
def sum_(x: torch.Tensor, dim: Any = None, keepdim: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    if dim is None and not keepdim:
        return torch.sum(x, dtype=dtype)
    return torch.sum(x, dim=R.normalize_dims(dim, x.dim()), keepdim=keepdim, dtype=dtype)


@op("mean", meta=_mean_meta, sbp=_reduce_sigs("sum"), shard_aware=True, grad_reads=(), box_offsets=())
def mean(ctx: ShardCtx, x: torch.Tensor, dim: Any = None, keepdim: bool = False,
         dtype: torch.dtype | None = None) -> torch.Tensor:
    dims = R.normalize_dims(dim, x.dim())
    count = 1
    for d in dims:
        count *= ctx.in_metas[0].shape[d]
    total = torch.sum(x, dim=dims, keepdim=keepdim, dtype=dtype) if dims else x.to(dtype or x.dtype).clone()
    return total / count if count else total * float("nan")


def _minmax(fn: Any):  # type: ignore[no-untyped-def]
    def kernel(x: torch.Tensor, dim: Any = None, keepdim: bool = False) -> torch.Tensor:
        dims = R.normalize_dims(dim, x.dim())
        if x.numel() == 0:  # an empty shard holds the reduction's identity

            shape = _reduced_shape(Meta(tuple(x.shape), x.dtype), dims, keepdim)
            return torch.full(shape, identity_element("max" if fn is torch.amax else "min", x.dtype), dtype=x.dtype,
                              device=x.device)
        return fn(x, dim=dims, keepdim=keepdim) if dims else x.clone()

    return kernel


amax = op("amax", meta=_minmax_meta, sbp=_reduce_sigs("max"), save_outputs=True)(_minmax(torch.amax))
amin = op("amin", meta=_minmax_meta, sbp=_reduce_sigs("min"), save_outputs=True)(_minmax(torch.amin))


# -- max / min over one dim, with indices ---------------------------------------------------------
#
# Indices are positions along the logical dim, so the reduced dim is never split here: a split
# input is boxed to B along it first (the signatures below list no split of ``dim``). Other dims
# may stay split; the values and indices keep that split.


def _minmax_dim_meta(x: Meta, dim: int, keepdim: bool = False) -> tuple[Meta, Meta]:
    if x.ndim and x.shape[R.normalize_dim(dim, x.ndim)] == 0:
        raise IndexOutOfRangeError(
            f"max/min over dim {dim} needs a non-empty dim, but the input has shape {list(x.shape)}")
    shape = _reduced_shape(x, (R.normalize_dim(dim, x.ndim),), keepdim)
    return Meta(shape, x.dtype), Meta(shape, torch.int64)


def _minmax_dim_sigs(x: Meta, outs: tuple[Meta, ...], dim: int, keepdim: bool = False) -> list[Sig]:
    reduced = R.normalize_dim(dim, x.ndim)
    sigs = [Sig((broadcast,), (broadcast, broadcast))]
    for d in range(x.ndim):
        if d != reduced:
            out = Split(_out_dim(d, (reduced,), keepdim))
            sigs.append(Sig((Split(d),), (out, out)))
    return sigs


def _minmax_dim(fn: Any):  # type: ignore[no-untyped-def]
    def kernel(x: torch.Tensor, dim: int, keepdim: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = fn(x, dim=dim, keepdim=keepdim)
        return values, indices

    return kernel


max_dim = op("max_dim", meta=_minmax_dim_meta, sbp=_minmax_dim_sigs)(_minmax_dim(torch.max))
min_dim = op("min_dim", meta=_minmax_dim_meta, sbp=_minmax_dim_sigs)(_minmax_dim(torch.min))


def _minmax_dim_grad(ctx: Any, dvalues: Any, dindices: Any) -> Any:
    x = ctx.inputs[0]
    dim, keepdim = ctx.attrs["dim"], ctx.attrs.get("keepdim", False)
    indices = ctx.outputs[1]
    return (index_scatter(dvalues, indices, shape=tuple(x.shape), dim=R.normalize_dim(dim, x.ndim), keepdim=keepdim),)


max_dim.save_outputs = True
min_dim.save_outputs = True
max_dim.grad(_minmax_dim_grad)
min_dim.grad(_minmax_dim_grad)


def _scatter_meta(g: Meta, idx: Meta, shape: tuple[int, ...], dim: int, keepdim: bool) -> Meta:
    return Meta(shape, g.dtype)


def _scatter_sigs(g: Meta, idx: Meta, outs: tuple[Meta, ...], shape: tuple[int, ...], dim: int,
                  keepdim: bool) -> list[Sig]:
    # the inverse of _minmax_dim_sigs: the scattered dim is whole on every rank
    sigs = [Sig((broadcast, broadcast), (broadcast,)), Sig((Partial("sum"), broadcast), (Partial("sum"),))]
    for d in range(len(shape)):
        if d != dim:
            src = Split(_out_dim(d, (dim,), keepdim))
            sigs.append(Sig((src, src), (Split(d),)))
    return sigs


@op("index_scatter", meta=_scatter_meta, sbp=_scatter_sigs, shard_aware=True, differentiable=False)
def index_scatter(ctx: ShardCtx, g: torch.Tensor, idx: torch.Tensor, shape: tuple[int, ...], dim: int,
                  keepdim: bool) -> torch.Tensor:
    """Zeros of ``shape`` with ``g`` placed at ``idx`` along ``dim``: the gradient of max/min over a dim."""
    local_shape = tuple(hi - lo for lo, hi in ctx.out_boxes[0])  # per shard
    if not keepdim:
        g, idx = g.unsqueeze(dim), idx.unsqueeze(dim)
    return torch.zeros(local_shape, dtype=g.dtype, device=g.device).scatter(dim, idx, g)


# -- argmax / argmin ------------------------------------------------------------------------------
#
# Like max/min over a dim, an index is a position along the whole logical dim, so the reduced dim is
# never split (a split input is boxed along it first); with no dim the index is into the flattened
# tensor, which only a broadcast input can give.


def _arg_meta(x: Meta, dim: int | None = None, keepdim: bool = False) -> Meta:
    if dim is None:
        if 0 in x.shape:
            raise R.ShapeError(f"argmax/argmin need a non-empty tensor, but got shape {list(x.shape)}")
        return Meta((1,) * x.ndim if keepdim else (), torch.int64)
    return _minmax_dim_meta(x, dim, keepdim)[1]


def _arg_sigs(x: Meta, outs: tuple[Meta, ...], dim: int | None = None, keepdim: bool = False) -> list[Sig]:
    if dim is None:
        return [Sig((broadcast,), (broadcast,))]
    return [Sig(s.ins, s.outs[1:]) for s in _minmax_dim_sigs(x, outs + outs, dim, keepdim)]


def _arg_kernel(fn: Any):  # type: ignore[no-untyped-def]
    def kernel(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
        return fn(x, dim=dim, keepdim=keepdim)

    return kernel


argmax = op("argmax", meta=_arg_meta, sbp=_arg_sigs, differentiable=False)(_arg_kernel(torch.argmax))
argmin = op("argmin", meta=_arg_meta, sbp=_arg_sigs, differentiable=False)(_arg_kernel(torch.argmin))


# -- all / any ------------------------------------------------------------------------------------
#
# all() of a split dim is the AND of every shard's all(), which is P(min) over bools (an empty shard
# gives True, min's identity); any() is the OR, P(max). A bool partial of the same kind passes too:
# the AND of ANDs is an AND. Other dtypes are tested for nonzero first, which no partial survives.


def _logical_meta(x: Meta, dim: Any = None, keepdim: bool = False) -> Meta:
    return Meta(_reduced_shape(x, R.normalize_dims(dim, x.ndim), keepdim), torch.bool)


def _logical_sigs(kind: str):  # type: ignore[no-untyped-def]
    def sigs(x: Meta, outs: tuple[Meta, ...], dim: Any = None, keepdim: bool = False) -> list[Sig]:
        out = _reduce_sigs(kind)(x, outs, dim=dim, keepdim=keepdim)
        return out if x.dtype == torch.bool else [s for s in out if not isinstance(s.ins[0], Partial)]

    return sigs


def _logical_kernel(fn: Any):  # type: ignore[no-untyped-def]
    def kernel(x: torch.Tensor, dim: Any = None, keepdim: bool = False) -> torch.Tensor:
        dims = R.normalize_dims(dim, x.dim())
        if dim is None and not keepdim:
            return fn(x)
        out = x.bool() if x.dtype != torch.bool else x
        for d in reversed(dims):  # torch.all takes one dim at a time
            out = fn(out, dim=d, keepdim=keepdim) if keepdim else fn(out, dim=d)
        return out

    return kernel


all_ = op("all", meta=_logical_meta, sbp=_logical_sigs("min"), differentiable=False)(_logical_kernel(torch.all))
any_ = op("any", meta=_logical_meta, sbp=_logical_sigs("max"), differentiable=False)(_logical_kernel(torch.any))


# -- cumsum ---------------------------------------------------------------------------------------
#
# A running sum is linear (P(sum) passes) and runs along one dim: any other dim may stay split; a
# split of the summed dim itself would need every earlier shard's total, so it is boxed first.


def _cumsum_meta(x: Meta, dim: int, dtype: torch.dtype | None = None, reverse: bool = False) -> Meta:
    R.normalize_dim(dim, x.ndim)
    integral = not (x.dtype.is_floating_point or x.dtype.is_complex)
    return Meta(x.shape, dtype or (torch.int64 if integral else x.dtype))


def _cumsum_sigs(x: Meta, outs: tuple[Meta, ...], dim: int, **_: Any) -> list[Sig]:
    d = R.normalize_dim(dim, x.ndim)
    sigs = [Sig((broadcast,), (broadcast,)), Sig((Partial("sum"),), (Partial("sum"),))]
    return sigs + [Sig((Split(k),), (Split(k),)) for k in range(x.ndim) if k != d]


@op("cumsum", meta=_cumsum_meta, sbp=_cumsum_sigs)
def cumsum(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None, reverse: bool = False) -> torch.Tensor:
    """Running sums along ``dim``; ``reverse`` sums from the end (the gradient of a forward running sum)."""
    if not reverse:
        return torch.cumsum(x, dim=dim, dtype=dtype)
    return torch.cumsum(x.flip(dim), dim=dim, dtype=dtype).flip(dim)


# -- topk -----------------------------------------------------------------------------------------


def _topk_meta(x: Meta, k: int, dim: int, largest: bool = True, sorted: bool = True) -> tuple[Meta, Meta]:
    d = R.normalize_dim(dim, x.ndim)
    size = x.shape[d] if x.ndim else 1
    if not 0 <= k <= size:
        raise R.ShapeError(f"topk needs 0 <= k <= {size} (the size of dim {dim}), but got k {k} for shape "
                           f"{list(x.shape)}")
    shape = x.shape[:d] + (k,) + x.shape[d + 1 :] if x.ndim else ()
    return Meta(shape, x.dtype), Meta(shape, torch.int64)


def _topk_sigs(x: Meta, outs: tuple[Meta, ...], k: int, dim: int, **_: Any) -> list[Sig]:
    """The k largest of a dim need the whole dim (indices are logical positions); other dims stay split."""
    d = R.normalize_dim(dim, x.ndim)
    sigs = [Sig((broadcast,), (broadcast, broadcast))]
    return sigs + [Sig((Split(j),), (Split(j), Split(j))) for j in range(x.ndim) if j != d]


@op("topk", meta=_topk_meta, sbp=_topk_sigs, save_outputs=True)
def topk(x: torch.Tensor, k: int, dim: int, largest: bool = True,
         sorted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    values, indices = torch.topk(x, k, dim=dim, largest=largest, sorted=sorted)
    return values, indices


@topk.grad
def _topk_grad(ctx: Any, dvalues: Any, dindices: Any) -> Any:
    x = ctx.inputs[0]
    if x.ndim == 0:
        return (dvalues,)
    dim = R.normalize_dim(ctx.attrs["dim"], x.ndim)
    return (gather_backward(dvalues, ctx.outputs[1], dim=dim, shape=tuple(x.shape)),)
