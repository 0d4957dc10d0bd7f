"""Reductions over dims: sum, mean, amax, amin (var and std are composites in functional).

Reducing a split dim gives a partial of the matching kind: sum and mean give
``P(sum)`` (mean divides by the logical count, so uneven shards stay exact),
amax gives ``P(max)`` and amin ``P(min)``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..sbp import Partial, Split, broadcast
from . import _rules as R
from .registry import Meta, ShardCtx, Sig, op


def _reduced_shape(x: Meta, dims: tuple[int, ...], keepdim: bool) -> tuple[int, ...]:
    if keepdim:
        return tuple(1 if d in dims else n for d, n in enumerate(x.shape))
    return tuple(n for d, n in enumerate(x.shape) if d not in dims)


def _reduce_meta(x: Meta, dim: Any = None, keepdim: bool = False, dtype: torch.dtype | None = None) -> Meta:
    dims = R.normalize_dims(dim, x.ndim)
    out_dtype = dtype or (torch.int64 if not (x.dtype.is_floating_point or x.dtype.is_complex) else x.dtype)
    return Meta(_reduced_shape(x, dims, keepdim), out_dtype)


def _keep_dtype_meta(x: Meta, dim: Any = None, keepdim: bool = False) -> Meta:
    return Meta(_reduced_shape(x, R.normalize_dims(dim, x.ndim), keepdim), x.dtype)


def _mean_meta(x: Meta, dim: Any = None, keepdim: bool = False, dtype: torch.dtype | None = None) -> Meta:
    m = _reduce_meta(x, dim, keepdim, dtype)
    if not m.dtype.is_floating_point:
        raise R.DTypeError(f"mean needs a floating-point input, but got {str(x.dtype).replace('torch.', '')}")
    return m


def _out_dim(d: int, dims: tuple[int, ...], keepdim: bool) -> int:
    return d if keepdim else d - sum(1 for r in dims if r < d)


def _reduce_sigs(kind: str):  # type: ignore[no-untyped-def]
    """kind: "sum" (P(sum) passes through, split reduced dims give P(sum)), "max", "min"."""

    def sigs(x: Meta, outs: tuple[Meta, ...], dim: Any = None, keepdim: bool = False, **_: Any) -> list[Sig]:
        dims = R.normalize_dims(dim, x.ndim)
        out = [Sig((broadcast,), (broadcast,))]
        for d in range(x.ndim):
            if d in dims:
                out.append(Sig((Split(d),), (Partial(kind),)))
            else:
                out.append(Sig((Split(d),), (Split(_out_dim(d, dims, keepdim)),)))
        out.append(Sig((Partial(kind),), (Partial(kind),)))
        return out

    return sigs


@op("sum", meta=_reduce_meta, sbp=_reduce_sigs("sum"))
def sum_(x: torch.Tensor, dim: Any = None, keepdim: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    if dim is None and not keepdim:
        return torch.sum(x, dtype=dtype)
    return torch.sum(x, dim=R.normalize_dims(dim, x.dim()), keepdim=keepdim, dtype=dtype)


@op("mean", meta=_mean_meta, sbp=_reduce_sigs("sum"), shard_aware=True)
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
            from ..boxing import identity_element

            shape = _reduced_shape(Meta(tuple(x.shape), x.dtype), dims, keepdim)
            return torch.full(shape, identity_element("max" if fn is torch.amax else "min", x.dtype), dtype=x.dtype,
                              device=x.device)
        return fn(x, dim=dims, keepdim=keepdim) if dims else x.clone()

    return kernel


amax = op("amax", meta=_keep_dtype_meta, sbp=_reduce_sigs("max"), save_outputs=True)(_minmax(torch.amax))
amin = op("amin", meta=_keep_dtype_meta, sbp=_reduce_sigs("min"), save_outputs=True)(_minmax(torch.amin))


def _expand_back(ctx: Any, g: Any) -> Any:
    """Broadcasts a reduced gradient back to the input's shape."""
    from .functional import expand_reduced

    return expand_reduced(g, tuple(ctx.inputs[0].shape), ctx.attrs.get("dim"), ctx.attrs.get("keepdim", False))


@sum_.grad
def _sum_grad(ctx: Any, dy: Any) -> Any:
    from .functional import cast

    g = _expand_back(ctx, dy)
    return (cast(g, ctx.inputs[0].dtype) if g.dtype != ctx.inputs[0].dtype else g,)


@mean.grad
def _mean_grad(ctx: Any, dy: Any) -> Any:
    x = ctx.inputs[0]
    count = 1
    for d in R.normalize_dims(ctx.attrs.get("dim"), x.ndim):
        count *= x.shape[d]
    return (_expand_back(ctx, dy) / count,)


def _minmax_grad(ctx: Any, dy: Any) -> Any:
    from .functional import eq, sum

    x = ctx.inputs[0]
    y = _expand_back(ctx, ctx.outputs[0])
    mask = eq(x, y)
    count = sum(mask, dim=ctx.attrs.get("dim"), keepdim=ctx.attrs.get("keepdim", False), dtype=x.dtype)
    return (_expand_back(ctx, dy / count) * mask,)


amax.grad(_minmax_grad)
amin.grad(_minmax_grad)
