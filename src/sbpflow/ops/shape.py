"""Shape ops that map SBP through where they can: reshape, transpose, permute,
unsqueeze, squeeze, expand.

A split dim maps through a reshape when it stays whole, or when it is the
outermost dim of a merged or split group and divides evenly over the mesh.
Partial values pass through every op here (they are all linear).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._layout import box_shape, numel
from ..errors import ShapeError
from ..sbp import Partial, Split, broadcast
from . import _rules as R
from .schema import Meta, ShardCtx, Sig, op

B = broadcast
_PARTIALS = (Partial("sum"), Partial("max"), Partial("min"))


def _passthrough(ins: int = 1) -> list[Sig]:
    return [Sig((B,) * ins, (B,))] + [Sig((p,) * ins, (p,)) for p in _PARTIALS]


# -- reshape ---------------------------------------------------------------------------------------


def infer_shape(requested: Sequence[int], numel_in: int) -> tuple[int, ...]:
    shape = tuple(requested)
    if shape.count(-1) > 1:
        raise ShapeError(f"reshape allows at most one -1, but got {list(shape)}")
    if -1 in shape:
        known = numel(tuple(n for n in shape if n != -1))
        if known == 0 or numel_in % known:
            raise ShapeError(f"cannot reshape {numel_in} elements into {list(shape)}")
        at = shape.index(-1)
        shape = shape[:at] + (numel_in // known,) + shape[at + 1 :]
    if numel(shape) != numel_in or any(n < 0 for n in shape):
        raise ShapeError(f"cannot reshape a tensor of {numel_in} elements into shape {list(shape)}")
    return tuple(shape)


def _reshape_meta(x: Meta, shape: tuple[int, ...]) -> Meta:
    return Meta(infer_shape(shape, numel(x.shape)), x.dtype)


def _groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pairs of dim index lists with equal products, scanning both shapes left to right."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        ga, gb, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                pa *= a[i]
                ga.append(i)
                i += 1
            elif pb < pa and j < len(b):
                pb *= b[j]
                gb.append(j)
                j += 1
            else:
                break
        out.append((ga, gb))
    return out


def _reshape_sigs(x: Meta, outs: tuple[Meta, ...], shape: Any = None, mesh: tuple[int, ...] = ()) -> list[Sig]:
    out = outs[0]
    ranks = numel(mesh) if mesh else 1
    sigs = _passthrough()
    for ga, gb in _groups(x.shape, out.shape):
        da = next((d for d in ga if x.shape[d] != 1), None)
        db = next((d for d in gb if out.shape[d] != 1), None)
        if ranks == 1:  # one piece (one rank, or whole rows of a micro-batch): a group's outermost dims map
            sigs.append(Sig((Split(ga[0]),), (Split(gb[0]),)))
        if da is None or db is None:
            continue
        na, nb = x.shape[da], out.shape[db]
        small, big = min(na, nb), max(na, nb)
        if (na == nb or (small % ranks == 0 and big % small == 0)) and Sig((Split(da),), (Split(db),)) not in sigs:
            sigs.append(Sig((Split(da),), (Split(db),)))
    return sigs


@op("reshape", meta=_reshape_meta, sbp=_reshape_sigs, shard_aware=True, mesh_aware=True, grad_reads=(),
    box_offsets=())
def reshape(ctx: ShardCtx, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return x.reshape(box_shape(ctx.out_boxes[0]))


@reshape.grad
def _reshape_grad(ctx: Any, dy: Any) -> Any:
    return (reshape(dy, shape=tuple(ctx.inputs[0].shape)),)


# -- permute / transpose ------------------------------------------------------------------------


def _permute_meta(x: Meta, dims: tuple[int, ...]) -> Meta:
    if len(dims) != x.ndim or sorted(R.normalize_dim(d, x.ndim) for d in dims) != list(range(x.ndim)):
        raise ShapeError(f"permute needs a permutation of {x.ndim} dims, but got {list(dims)}")
    return Meta(tuple(x.shape[R.normalize_dim(d, x.ndim)] for d in dims), x.dtype)


def _permute_sigs(x: Meta, outs: tuple[Meta, ...], dims: tuple[int, ...]) -> list[Sig]:
    dims = tuple(R.normalize_dim(d, x.ndim) for d in dims)
    return _passthrough() + [Sig((Split(src),), (Split(i),)) for i, src in enumerate(dims)]


@op("permute", meta=_permute_meta, sbp=_permute_sigs, grad_reads=())
def permute(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return x.permute(dims)


@permute.grad
def _permute_grad(ctx: Any, dy: Any) -> Any:
    dims = tuple(R.normalize_dim(d, dy.ndim) for d in ctx.attrs["dims"])
    inverse = tuple(sorted(range(len(dims)), key=lambda i: dims[i]))
    return (permute(dy, dims=inverse),)


# -- unsqueeze / squeeze / expand -----------------------------------------------------------------


def _unsqueeze_meta(x: Meta, dim: int) -> Meta:
    d = R.normalize_dim(dim, x.ndim + 1)
    return Meta(x.shape[:d] + (1,) + x.shape[d:], x.dtype)


def _unsqueeze_sigs(x: Meta, outs: tuple[Meta, ...], dim: int) -> list[Sig]:
    d = R.normalize_dim(dim, x.ndim + 1)
    return _passthrough() + [Sig((Split(k),), (Split(k if k < d else k + 1),)) for k in range(x.ndim)]


@op("unsqueeze", meta=_unsqueeze_meta, sbp=_unsqueeze_sigs, grad_reads=())
def unsqueeze(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.unsqueeze(dim)


@unsqueeze.grad
def _unsqueeze_grad(ctx: Any, dy: Any) -> Any:
    return (squeeze(dy, dim=R.normalize_dim(ctx.attrs["dim"], dy.ndim)),)


def _squeeze_meta(x: Meta, dim: int) -> Meta:
    d = R.normalize_dim(dim, x.ndim)
    if x.shape[d] != 1:
        return x
    return Meta(x.shape[:d] + x.shape[d + 1 :], x.dtype)


def _squeeze_sigs(x: Meta, outs: tuple[Meta, ...], dim: int) -> list[Sig]:
    d = R.normalize_dim(dim, x.ndim)
    removed = x.shape[d] == 1
    return _passthrough() + [
        Sig((Split(k),), (Split(k - 1 if removed and k > d else k),)) for k in range(x.ndim) if not (removed and k == d)
    ]


@op("squeeze", meta=_squeeze_meta, sbp=_squeeze_sigs, grad_reads=())
def squeeze(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.squeeze(dim)


@squeeze.grad
def _squeeze_grad(ctx: Any, dy: Any) -> Any:
    x = ctx.inputs[0]
    return (reshape(dy, shape=tuple(x.shape)),)


def _expand_meta(x: Meta, shape: tuple[int, ...]) -> Meta:
    if len(shape) < x.ndim:
        raise ShapeError(f"expand needs at least {x.ndim} dims, but got shape {list(shape)} for input {list(x.shape)}")
    lead = len(shape) - x.ndim
    out = list(shape)
    for i, n in enumerate(x.shape):
        want = shape[lead + i]
        if want == -1:
            out[lead + i] = n
        elif n != 1 and n != want:
            raise ShapeError(f"cannot expand shape {list(x.shape)} to {list(shape)}: dim {i} has size {n}, not 1")
    return Meta(tuple(out), x.dtype)


def _expand_sigs(x: Meta, outs: tuple[Meta, ...], shape: tuple[int, ...]) -> list[Sig]:
    lead = outs[0].ndim - x.ndim
    sigs = [Sig((B,), (B,))] + [Sig((p,), (p,)) for p in _PARTIALS[1:]] + [Sig((_PARTIALS[0],), (_PARTIALS[0],))]
    for k, n in enumerate(x.shape):
        if n == outs[0].shape[lead + k]:
            sigs.append(Sig((Split(k),), (Split(lead + k),)))
    return sigs


@op("expand", meta=_expand_meta, sbp=_expand_sigs, shard_aware=True, grad_reads=(), box_offsets=())
def expand(ctx: ShardCtx, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return x.expand(box_shape(ctx.out_boxes[0]))


# -- reshape then permute, permute then reshape (attention's split into heads and merge back) ----------------------
#
# One op each instead of two: one dispatch and one gradient node where a transformer layer calls the pair four
# times. Their signatures are the two ops' signatures joined on the SBP of the intermediate value, so a split
# maps through exactly when it maps through both ops (C split by heads becomes H split, the batch split stays).


def _inverse(dims: Sequence[int]) -> tuple[int, ...]:
    return tuple(sorted(range(len(dims)), key=lambda i: dims[i]))


def _joined(first: list[Sig], second: list[Sig]) -> list[Sig]:
    """Signatures of ``second(first(x))``: each pair that agrees on the intermediate SBP, without repeats."""
    out: list[Sig] = []
    for a in first:
        for b in second:
            if b.ins == a.outs:
                joined = Sig(a.ins, b.outs)
                if joined not in out:
                    out.append(joined)
    return out


def _reshape_permute_meta(x: Meta, shape: tuple[int, ...], dims: tuple[int, ...]) -> Meta:
    return _permute_meta(_reshape_meta(x, shape), dims)


def _reshape_permute_sigs(x: Meta, outs: tuple[Meta, ...], shape: tuple[int, ...], dims: tuple[int, ...],
                          mesh: tuple[int, ...] = ()) -> list[Sig]:
    mid = _reshape_meta(x, shape)
    return _joined(_reshape_sigs(x, (mid,), shape, mesh), _permute_sigs(mid, outs, dims))


@op("reshape_permute", meta=_reshape_permute_meta, sbp=_reshape_permute_sigs, shard_aware=True, mesh_aware=True,
    grad_reads=(), box_offsets=())
def reshape_permute(ctx: ShardCtx, x: torch.Tensor, shape: tuple[int, ...], dims: tuple[int, ...]) -> torch.Tensor:
    """``x.reshape(shape).permute(dims)``; ``shape`` has no -1 and ``dims`` no negative dim (the functional wrapper
    resolves both)."""
    out = box_shape(ctx.out_boxes[0])
    mid = [0] * len(out)
    for i, d in enumerate(dims):  # the shard of the reshaped value, before the permutation
        mid[d] = out[i]
    return x.reshape(mid).permute(dims)


def _permute_reshape_meta(x: Meta, dims: tuple[int, ...], shape: tuple[int, ...]) -> Meta:
    return _reshape_meta(_permute_meta(x, dims), shape)


def _permute_reshape_sigs(x: Meta, outs: tuple[Meta, ...], dims: tuple[int, ...], shape: tuple[int, ...],
                          mesh: tuple[int, ...] = ()) -> list[Sig]:
    mid = _permute_meta(x, dims)
    return _joined(_permute_sigs(x, (mid,), dims), _reshape_sigs(mid, outs, shape, mesh))


@op("permute_reshape", meta=_permute_reshape_meta, sbp=_permute_reshape_sigs, shard_aware=True, mesh_aware=True,
    grad_reads=(), box_offsets=())
def permute_reshape(ctx: ShardCtx, x: torch.Tensor, dims: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """``x.permute(dims).reshape(shape)`` (a copy where torch's reshape copies); resolved ``dims`` and ``shape``."""
    return x.permute(dims).reshape(box_shape(ctx.out_boxes[0]))


@reshape_permute.grad
def _reshape_permute_grad(ctx: Any, dy: Any) -> Any:
    return (permute_reshape(dy, dims=_inverse(ctx.attrs["dims"]), shape=tuple(ctx.inputs[0].shape)),)


@permute_reshape.grad
def _permute_reshape_grad(ctx: Any, dy: Any) -> Any:
    dims = ctx.attrs["dims"]
    x_shape = tuple(ctx.inputs[0].shape)
    return (reshape_permute(dy, shape=tuple(x_shape[d] for d in dims), dims=_inverse(dims)),)


# -- tril / triu ---------------------------------------------------------------------------------------------------
#
# One op for both triangles of the last two dims. Every entry either stays or becomes 0, the same on every piece,
# so partial sums pass (zeros add to zero) and so do max and min (every piece holds the same 0 there). Batch dims
# may be split; the two matrix dims are not (a shard would need its offset on the diagonal).


def _triangle_meta(x: Meta, diagonal: int, upper: bool) -> Meta:
    if x.ndim < 2:
        raise ShapeError(f"{'triu' if upper else 'tril'} needs a tensor of 2 or more dims, but got shape "
                         f"{list(x.shape)}")
    return x


def _triangle_sigs(x: Meta, outs: tuple[Meta, ...], diagonal: int, upper: bool) -> list[Sig]:
    return _passthrough() + [Sig((Split(d),), (Split(d),)) for d in range(x.ndim - 2)]


@op("triangle", meta=_triangle_meta, sbp=_triangle_sigs, grad_reads=())
def triangle(x: torch.Tensor, diagonal: int, upper: bool) -> torch.Tensor:
    return torch.triu(x, diagonal) if upper else torch.tril(x, diagonal)


@triangle.grad
def _triangle_grad(ctx: Any, dy: Any) -> Any:
    return (triangle(dy, diagonal=ctx.attrs["diagonal"], upper=ctx.attrs["upper"]),)
