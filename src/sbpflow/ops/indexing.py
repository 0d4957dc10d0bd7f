"""Indexing and joining: slicing (``narrow``, ``x[...]``), ``index_select``, ``gather``, ``cat``/``stack``,
``split``/``chunk``, with the SBP rules tabled above the first of them.

Kernels return fresh tensors, not views: sbpflow tracks in-place writes per tensor, so an output must not
share storage with its input (:mod:`.views` carries writes back).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._layout import Box, box_shape
from ..errors import DTypeError, IndexOutOfRangeError, OpError, ShapeError
from ..sbp import Partial, Split, broadcast, format_nd
from ..tensor import Tensor
from . import _rules as R
from . import elementwise as E
from . import shape as SH
from .schema import DYNAMIC, Meta, ShardCtx, Sig, op

__all__ = ["narrow", "slice_", "index_select", "gather", "cat", "stack", "split", "chunk",
           "masked_select"]

B = broadcast
PSUM = Partial("sum")
_PARTIALS = (PSUM, Partial("max"), Partial("min"))
_INDEX_DTYPES = (torch.int64, torch.int32)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _describe_shard(ctx: ShardCtx) -> str:
    """The input's shape, placement and SBP, for errors raised inside a kernel."""
    shape = list(ctx.in_metas[0].shape)
    if ctx.placement is None:
        return f"input shape {shape} (local)"
    return f"input shape {shape} on {ctx.placement} sbp {format_nd(ctx.in_sbps[0])}"


def _check_index_range(name: str, ctx: ShardCtx, index: torch.Tensor, dim: int) -> None:
    """Index values are data: they can only be checked where a kernel sees them."""
    size = ctx.in_metas[0].shape[dim]
    bad = (index < 0) | (index >= size)
    if bool(bad.any()):
        value = int(index[bad].reshape(-1)[0])
        raise IndexOutOfRangeError(
            f"op {name!r}: index {value} is out of range for dim {dim} of size {size} "
            f"(expected 0..{size - 1}); {_describe_shard(ctx)}"
        )


def _check_index_meta(name: str, index: Meta) -> None:
    if index.dtype not in _INDEX_DTYPES:
        raise DTypeError(f"{name} needs an int64 or int32 index, but got {str(index.dtype).replace('torch.', '')}")


# -- slice (narrow, x[a:b:s]) ----------------------------------------------------------------------


# SBP rules, with dim the dim an op indexes or joins along:
#
#   op               input(s)          output     why
#   slice/narrow     S(k), k != dim    S(k)       every shard keeps its rows along k
#                    B                 S(dim)     each rank cuts its own output box
#   index_select     S(k), k != dim    S(k)
#                    B, index S(0)     S(dim)     output rows follow the index
#                    S(dim), index B   P(sum)     each rank looks up the rows it holds, zeros elsewhere
#                                                 (the vocab-parallel embedding)
#   gather           S(k), index S(k)  S(k)       k != dim, index as long as x along k
#                    B, index S(k)     S(k)
#                    S(dim), index B   P(sum)
#   cat              all S(k), k != dim  S(k)
#   x[mask]          B, mask B         B          the output's length is the mask's count: data, not
#                    S(k), mask B      S(k-m+1)   metadata (a data-dependent op); k >= m, the mask's ndim,
#                                                 so every rank selects the same rows
#
# Selections pick elements without mixing them, so every partial (sum, max, min) passes through them; their
# gradients scatter into zeros, so only P(sum) passes through those. A split along dim itself is boxed
# (all-gathered) where no rule above applies.
def _slice_meta(x: Meta, dim: int, start: int, stop: int, step: int) -> Meta:
    if not (0 <= dim < x.ndim and step >= 1 and 0 <= start <= stop <= x.shape[dim]):
        raise ShapeError(
            f"slice needs 0 <= start <= stop <= size and step >= 1 along dim {dim}, but got start {start}, "
            f"stop {stop}, step {step} for shape {list(x.shape)}"
        )
    length = len(range(start, stop, step))
    return Meta(x.shape[:dim] + (length,) + x.shape[dim + 1 :], x.dtype)


def _slice_sigs(x: Meta, outs: tuple[Meta, ...], dim: int, **_: Any) -> list[Sig]:
    sigs = [Sig((B,), (B,))] + [Sig((p,), (p,)) for p in _PARTIALS]
    sigs += [Sig((Split(k),), (Split(k),)) for k in range(x.ndim) if k != dim]
    sigs += [Sig((B,), (Split(dim),)), Sig((Split(dim),), (PSUM,))]
    return sigs


def _strided_range(lo: int, hi: int, start: int, step: int, j_lo: int, j_hi: int) -> tuple[int, int]:
    """The ``j`` in ``[j_lo, j_hi)`` whose position ``start + j * step`` lies in ``[lo, hi)``."""
    return max(j_lo, _ceil_div(lo - start, step)), min(j_hi, _ceil_div(hi - start, step))


def _cut(ndim: int, dim: int, first: int, count: int, step: int) -> tuple[slice, ...]:
    """Index picking ``count`` elements ``first, first + step, ...`` along ``dim``."""
    cut = [slice(None)] * ndim
    cut[dim] = slice(first, first + (count - 1) * step + 1, step) if count > 0 else slice(0, 0)
    return tuple(cut)


@op("slice", meta=_slice_meta, sbp=_slice_sigs, shard_aware=True, box_offsets=("dim",))
def slice_(ctx: ShardCtx, x: torch.Tensor, dim: int, start: int, stop: int, step: int) -> torch.Tensor:
    """Elements ``start, start + step, ...`` below ``stop`` along ``dim`` (logical indices, all normalized).

    >>> import sbpflow
    >>> from sbpflow.ops.indexing import slice_
    >>> slice_(sbpflow.arange(6), dim=0, start=1, stop=6, step=2).tolist()
    [1, 3, 5]
    """
    (in_lo, in_hi), (out_lo, out_hi) = ctx.in_boxes[0][dim], ctx.out_boxes[0][dim]
    # output element j (logical) is input element start + j * step (logical); this shard holds in_lo..in_hi
    j_lo, j_hi = _strided_range(in_lo, in_hi, start, step, out_lo, out_hi)
    src = _cut(x.dim(), dim, start + j_lo * step - in_lo, j_hi - j_lo, step)
    if (j_lo, j_hi) == (out_lo, out_hi):
        return x[src].clone()
    out = x.new_zeros(box_shape(ctx.out_boxes[0]))  # S(dim) -> P(sum): the rows this shard lacks stay zero
    if j_lo < j_hi:
        out[_cut(x.dim(), dim, j_lo - out_lo, j_hi - j_lo, 1)] = x[src]
    return out


@slice_.grad
def _slice_grad(ctx: Any, dy: Any) -> Any:
    a = ctx.attrs
    return (slice_backward(dy, dim=a["dim"], start=a["start"], stop=a["stop"], step=a["step"],
                           size=ctx.inputs[0].shape[a["dim"]]),)


def _slice_backward_meta(dy: Meta, dim: int, start: int, stop: int, step: int, size: int) -> Meta:
    return Meta(dy.shape[:dim] + (size,) + dy.shape[dim + 1 :], dy.dtype)


def _slice_backward_sigs(dy: Meta, outs: tuple[Meta, ...], dim: int, **_: Any) -> list[Sig]:
    sigs = [Sig((B,), (B,)), Sig((PSUM,), (PSUM,))]
    sigs += [Sig((Split(k),), (Split(k),)) for k in range(dy.ndim) if k != dim]
    sigs += [Sig((B,), (Split(dim),)), Sig((Split(dim),), (PSUM,))]
    return sigs


@op("slice_backward", meta=_slice_backward_meta, sbp=_slice_backward_sigs, shard_aware=True,
    box_offsets=("dim",))
def slice_backward(ctx: ShardCtx, dy: torch.Tensor, dim: int, start: int, stop: int, step: int,
                   size: int) -> torch.Tensor:
    """Scatters ``dy`` into zeros of the sliced input's shape: the gradient of :func:`slice_`."""
    out_box = ctx.out_boxes[0]
    dx = dy.new_zeros(box_shape(out_box))  # local
    (dy_lo, dy_hi), (dx_lo, dx_hi) = ctx.in_boxes[0][dim], out_box[dim]
    # dy's element j (logical) lands at input index start + j * step; keep those inside dx's box
    j_lo, j_hi = _strided_range(dx_lo, dx_hi, start, step, dy_lo, dy_hi)
    if j_lo < j_hi:
        dst = _cut(dy.dim(), dim, start + j_lo * step - dx_lo, j_hi - j_lo, step)
        dx[dst] = dy[_cut(dy.dim(), dim, j_lo - dy_lo, j_hi - j_lo, 1)]
    return dx


@slice_backward.grad
def _slice_backward_grad(ctx: Any, g: Any) -> Any:
    a = ctx.attrs
    return (slice_(g, dim=a["dim"], start=a["start"], stop=a["stop"], step=a["step"]),)


def _norm_dim(name: str, x: Tensor, dim: int, extra: int = 0) -> int:
    try:
        return R.normalize_dim(dim, x.ndim + extra)
    except ShapeError as e:
        raise type(e)(f"{name}: {e}; input {x._describe()}") from None


def narrow(x: Tensor, dim: int, start: int, length: int) -> Tensor:
    """``length`` elements of ``x`` from ``start`` along ``dim`` (``start`` may be negative), as ``torch.narrow``.

    >>> import sbpflow
    >>> sbpflow.arange(6).narrow(0, 2, 3).tolist()
    [2, 3, 4]
    """
    d = _norm_dim("narrow", x, dim)
    n = x.shape[d]
    begin = start + n if start < 0 else start
    if not (0 <= begin <= n and length >= 0 and begin + length <= n):
        raise ShapeError(
            f"narrow: start {start} and length {length} must lie within dim {d} of size {n}; input {x._describe()}"
        )
    return slice_(x, dim=d, start=begin, stop=begin + length, step=1)


# -- x[mask]: boolean-mask selection, a data-dependent op -------------------------------------------


def _masked_select_meta(x: Meta, mask: Meta) -> Meta:
    if mask.dtype != torch.bool:
        raise DTypeError(f"x[mask] needs a bool mask, but got {str(mask.dtype).replace('torch.', '')}")
    if mask.ndim == 0 or x.shape[: mask.ndim] != mask.shape:
        raise ShapeError(f"x[mask] needs a mask of at least 1 dim whose shape {list(mask.shape)} is the leading part "
                         f"of the input's shape {list(x.shape)}")
    return Meta((DYNAMIC,) + x.shape[mask.ndim :], x.dtype)  # (count of set mask entries, *trailing dims)


def _masked_select_sigs(x: Meta, mask: Meta, outs: tuple[Meta, ...]) -> list[Sig]:
    """A broadcast mask selects the same entries on every rank: partials and splits of trailing dims pass."""
    m = mask.ndim
    sigs = [Sig((B, B), (B,))] + [Sig((p, B), (p,)) for p in _PARTIALS]
    return sigs + [Sig((Split(k), B), (Split(k - m + 1),)) for k in range(m, x.ndim)]


@op("masked_select", meta=_masked_select_meta, sbp=_masked_select_sigs, data_dependent=True)
def _masked_select(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x[mask]  # advanced indexing copies: a fresh tensor


@_masked_select.grad
def _masked_select_grad(ctx: Any, dy: Any) -> Any:
    return masked_select_backward(dy, ctx.inputs[1]), None


def _masked_select_backward_meta(dy: Meta, mask: Meta) -> Meta:
    return Meta(mask.shape + dy.shape[1:], dy.dtype)


def _masked_select_backward_sigs(dy: Meta, mask: Meta, outs: tuple[Meta, ...]) -> list[Sig]:
    m = mask.ndim
    sigs = [Sig((B, B), (B,)), Sig((PSUM, B), (PSUM,))]
    return sigs + [Sig((Split(k), B), (Split(k + m - 1),)) for k in range(1, dy.ndim)]


@op("masked_select_backward", meta=_masked_select_backward_meta, sbp=_masked_select_backward_sigs,
    differentiable=False)
def masked_select_backward(dy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Zeros of the input's shape with the rows of ``dy`` where ``mask`` is set: the gradient of ``x[mask]``."""
    out = dy.new_zeros(tuple(mask.shape) + tuple(dy.shape[1:]))  # local
    out[mask] = dy
    return out


def _mask_rows(x: Tensor, mask: Tensor) -> Tensor:
    """``x[mask]``: the rows of ``x`` (over the mask's dims) where ``mask`` is set, in row-major order."""
    if mask.ndim == 0 or tuple(x.shape[: mask.ndim]) != tuple(mask.shape):
        raise ShapeError(f"x[mask] needs a mask whose shape is the leading part of the input's shape (as torch), but "
                         f"got mask {mask._describe()}; input {x._describe()}")
    return _masked_select(x, mask)


def masked_select(x: Tensor, mask: Tensor) -> Tensor:
    """The entries of ``x`` where the bool ``mask`` (broadcast with ``x``) is set, as a 1-D tensor.

    Its length depends on the mask's values, so it is a data-dependent op: eager only, and its
    output is never split (B, or a partial of a partial input).

    >>> import sbpflow
    >>> x = sbpflow.tensor([[1.0, -2.0], [-3.0, 4.0]])
    >>> masked_select(x, x > 0).tolist(), x[x < 0].tolist()
    ([1.0, 4.0], [-2.0, -3.0])
    """
    shape = R.broadcast_shapes(tuple(x.shape), tuple(mask.shape))
    if tuple(x.shape) != shape:
        x = SH.expand(x, shape=shape)
    if tuple(mask.shape) != shape:
        mask = SH.expand(mask, shape=shape)
    if not shape:
        x, mask = SH.unsqueeze(x, dim=0), SH.unsqueeze(mask, dim=0)
    return _mask_rows(x, mask)


# -- index_select ----------------------------------------------------------------------------------


def _index_select_meta(x: Meta, index: Meta, dim: int) -> Meta:
    _check_index_meta("index_select", index)
    if index.ndim > 1:
        raise ShapeError(f"index_select needs a 0-D or 1-D index, but got index shape {list(index.shape)}")
    n = index.shape[0] if index.ndim else 1
    return Meta(x.shape[:dim] + (n,) + x.shape[dim + 1 :], x.dtype)


def _index_select_sigs(x: Meta, index: Meta, outs: tuple[Meta, ...], dim: int) -> list[Sig]:
    sigs = [Sig((B, B), (B,))] + [Sig((p, B), (p,)) for p in _PARTIALS]
    sigs += [Sig((Split(k), B), (Split(k),)) for k in range(x.ndim) if k != dim]
    if index.ndim == 1:
        sigs.append(Sig((B, Split(0)), (Split(dim),)))
    sigs.append(Sig((Split(dim), B), (PSUM,)))
    return sigs


def _broadcast_along(mask: torch.Tensor, dim: int, ndim: int) -> torch.Tensor:
    return mask.reshape((1,) * dim + (-1,) + (1,) * (ndim - dim - 1))


@op("index_select", meta=_index_select_meta, sbp=_index_select_sigs, shard_aware=True)
def _index_select(ctx: ShardCtx, x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    _check_index_range("index_select", ctx, index, dim)
    idx = index.reshape(-1).long()
    lo, hi = ctx.in_boxes[0][dim]
    if (lo, hi) == (0, ctx.in_metas[0].shape[dim]):
        return torch.index_select(x, dim, idx)
    # x holds rows lo..hi (logical) of dim: look those up and leave zeros for the rest (a partial sum)
    out_shape = box_shape(ctx.out_boxes[0])  # local
    if hi == lo:
        return x.new_zeros(out_shape)
    inside = (idx >= lo) & (idx < hi)
    rows = torch.index_select(x, dim, torch.where(inside, idx - lo, 0))
    return torch.where(_broadcast_along(inside, dim, x.dim()), rows, 0)


@_index_select.grad
def _index_select_grad(ctx: Any, dy: Any) -> Any:
    x, index = ctx.inputs
    dim = ctx.attrs["dim"]
    return index_select_backward(dy, index, dim=dim, size=x.shape[dim]), None


def _index_select_backward_meta(dy: Meta, index: Meta, dim: int, size: int) -> Meta:
    return Meta(dy.shape[:dim] + (size,) + dy.shape[dim + 1 :], dy.dtype)


def _index_select_backward_sigs(dy: Meta, index: Meta, outs: tuple[Meta, ...], dim: int, size: int) -> list[Sig]:
    sigs = [Sig((B, B), (B,)), Sig((PSUM, B), (PSUM,))]
    sigs += [Sig((Split(k), B), (Split(k),)) for k in range(dy.ndim) if k != dim]
    if index.ndim == 1:
        sigs.append(Sig((Split(dim), Split(0)), (PSUM,)))
    sigs.append(Sig((B, B), (Split(dim),)))
    return sigs


@op("index_select_backward", meta=_index_select_backward_meta, sbp=_index_select_backward_sigs, shard_aware=True,
    differentiable=False)
def index_select_backward(ctx: ShardCtx, dy: torch.Tensor, index: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Adds the rows of ``dy`` into zeros at ``index`` along ``dim``: the gradient of :func:`index_select`."""
    dx = dy.new_zeros(box_shape(ctx.out_boxes[0]))  # local
    lo, hi = ctx.out_boxes[0][dim]
    idx = index.reshape(-1).long()
    inside = (idx >= lo) & (idx < hi)
    if not bool(inside.all()):
        keep = inside.nonzero().reshape(-1)
        idx, dy = idx[keep], dy.index_select(dim, keep)
    return dx.index_add_(dim, idx - lo, dy)


def index_select(x: Tensor, dim: int, index: Tensor) -> Tensor:
    """The entries of ``x`` at ``index`` (0-D or 1-D ints) along ``dim``, as ``torch.index_select``.

    >>> import sbpflow
    >>> x = sbpflow.arange(6).reshape(3, 2)
    >>> x.index_select(0, sbpflow.tensor([2, 0])).tolist()
    [[4, 5], [0, 1]]
    """
    if x.ndim == 0:
        raise ShapeError(f"index_select needs a tensor of at least 1 dim, but got {x._describe()}")
    return _index_select(x, index, dim=_norm_dim("index_select", x, dim))


# -- gather ----------------------------------------------------------------------------------------


def _gather_meta(x: Meta, index: Meta, dim: int) -> Meta:
    _check_index_meta("gather", index)
    fits = index.ndim == x.ndim and all(index.shape[d] <= x.shape[d] for d in range(x.ndim) if d != dim)
    if not fits:
        raise ShapeError(
            f"gather needs an index with the input's number of dims, no longer than the input on every dim but "
            f"{dim}, but got input {list(x.shape)} and index {list(index.shape)}"
        )
    return Meta(index.shape, x.dtype)


def _gather_sigs(x: Meta, index: Meta, outs: tuple[Meta, ...], dim: int) -> list[Sig]:
    sigs = [Sig((B, B), (B,))] + [Sig((p, B), (p,)) for p in _PARTIALS]
    sigs += [Sig((Split(k), Split(k)), (Split(k),)) for k in range(x.ndim) if k != dim and x.shape[k] == index.shape[k]]
    sigs += [Sig((B, Split(k)), (Split(k),)) for k in range(x.ndim)]
    sigs.append(Sig((Split(dim), B), (PSUM,)))
    return sigs


def _align_to(x: torch.Tensor, x_box: Box, target: Box, skip: int) -> torch.Tensor:
    """Cuts ``target`` (a logical box inside ``x_box``) out of ``x`` on every dim but ``skip``."""
    for d, ((x_lo, _), (t_lo, t_hi)) in enumerate(zip(x_box, target, strict=True)):
        if d != skip:
            x = x.narrow(d, t_lo - x_lo, t_hi - t_lo)
    return x


@op("gather", meta=_gather_meta, sbp=_gather_sigs, shard_aware=True)
def _gather(ctx: ShardCtx, x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    _check_index_range("gather", ctx, index, dim)
    x_box, index_box = ctx.in_boxes
    x = _align_to(x, x_box, index_box, dim)
    idx = index.long()
    lo, hi = x_box[dim]
    if (lo, hi) == (0, ctx.in_metas[0].shape[dim]):
        return torch.gather(x, dim, idx)
    # x holds lo..hi (logical) along dim: gather those, zeros elsewhere (a partial sum)
    if hi == lo:
        return x.new_zeros(idx.shape)
    inside = (idx >= lo) & (idx < hi)
    return torch.where(inside, torch.gather(x, dim, torch.where(inside, idx - lo, 0)), 0)


@_gather.grad
def _gather_grad(ctx: Any, dy: Any) -> Any:
    x, index = ctx.inputs
    return gather_backward(dy, index, dim=ctx.attrs["dim"], shape=tuple(x.shape)), None


def _gather_backward_meta(dy: Meta, index: Meta, dim: int, shape: tuple[int, ...]) -> Meta:
    return Meta(shape, dy.dtype)


def _gather_backward_sigs(dy: Meta, index: Meta, outs: tuple[Meta, ...], dim: int, shape: tuple[int, ...]) -> list[Sig]:
    sigs = [Sig((B, B), (B,)), Sig((PSUM, B), (PSUM,))]
    sigs += [Sig((Split(k), Split(k)), (Split(k),)) for k in range(dy.ndim) if k != dim and dy.shape[k] == shape[k]]
    sigs += [Sig((Split(k), Split(k)), (PSUM,)) for k in range(dy.ndim)]
    sigs += [Sig((B, B), (Split(k),)) for k in range(dy.ndim)]
    return sigs


@op("gather_backward", meta=_gather_backward_meta, sbp=_gather_backward_sigs, shard_aware=True,
    differentiable=False)
def gather_backward(ctx: ShardCtx, dy: torch.Tensor, index: torch.Tensor, dim: int,
                    shape: tuple[int, ...]) -> torch.Tensor:
    """Scatter-adds ``dy`` into zeros of ``shape`` at ``index``: the gradient of :func:`gather`."""
    dx_box, dy_box = ctx.out_boxes[0], ctx.in_boxes[0]
    dx = dy.new_zeros(box_shape(dx_box))  # local
    dst, src = [slice(None)] * dy.dim(), [slice(None)] * dy.dim()
    for d in range(dy.dim()):
        if d == dim:
            continue
        # rows of dy/index (logical) whose target rows fall inside dx's box
        lo, hi = max(dy_box[d][0], dx_box[d][0]), min(dy_box[d][1], dx_box[d][1])
        if lo >= hi:
            return dx
        src[d], dst[d] = slice(lo - dy_box[d][0], hi - dy_box[d][0]), slice(lo - dx_box[d][0], hi - dx_box[d][0])
    lo, hi = dx_box[dim]
    if hi == lo:
        return dx
    idx, g = index[tuple(src)].long(), dy[tuple(src)]
    inside = (idx >= lo) & (idx < hi)
    dx[tuple(dst)].scatter_add_(dim, torch.where(inside, idx - lo, 0), torch.where(inside, g, 0))
    return dx


def gather(x: Tensor, dim: int, index: Tensor) -> Tensor:
    """``out[i][j] = x[index[i][j]][j]`` for ``dim=0`` (and so on), as ``torch.gather``.

    >>> import sbpflow
    >>> x = sbpflow.tensor([[1., 2.], [3., 4.]])
    >>> x.gather(1, sbpflow.tensor([[1, 1], [0, 1]])).tolist()
    [[2.0, 2.0], [3.0, 4.0]]
    """
    if x.ndim == 0:
        raise ShapeError(f"gather needs a tensor of at least 1 dim, but got {x._describe()}")
    return _gather(x, index, dim=_norm_dim("gather", x, dim))


# -- cat / stack -----------------------------------------------------------------------------------


def _cat_meta(*xs: Meta, dim: int) -> Meta:
    first = xs[0]
    for i, m in enumerate(xs):
        same_rank = m.ndim == first.ndim
        if not same_rank or any(a != b for d, (a, b) in enumerate(zip(m.shape, first.shape, strict=True)) if d != dim):
            raise ShapeError(
                f"cat needs tensors of one shape except along dim {dim}, but tensor 0 has shape {list(first.shape)} "
                f"and tensor {i} has shape {list(m.shape)}"
            )
    size = sum(m.shape[dim] for m in xs)
    return Meta(first.shape[:dim] + (size,) + first.shape[dim + 1 :], R.result_type(*xs))


def _cat_sigs(*xs: Meta, outs: tuple[Meta, ...], dim: int) -> list[Sig]:
    n = len(xs)
    sigs = [Sig((B,) * n, (B,))] + [Sig((p,) * n, (p,)) for p in _PARTIALS]
    sigs += [Sig((Split(k),) * n, (Split(k),)) for k in range(xs[0].ndim) if k != dim]
    return sigs


@op("cat", meta=_cat_meta, sbp=_cat_sigs)
def _cat(*xs: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cat(xs, dim=dim)  # promotes mixed dtypes as the meta does


@_cat.grad
def _cat_grad(ctx: Any, dy: Any) -> Any:
    dim, grads, offset = ctx.attrs["dim"], [], 0
    for x, needed in zip(ctx.inputs, ctx.needs_input_grad, strict=True):
        n = x.shape[dim]
        g = slice_(dy, dim=dim, start=offset, stop=offset + n, step=1) if needed else None
        grads.append(E.cast(g, dtype=x.dtype) if g is not None and g.dtype != x.dtype else g)
        offset += n
    return tuple(grads)


def _check_tensor_list(name: str, tensors: Sequence[Any]) -> list[Tensor]:
    tensors = list(tensors)
    if not tensors or not all(isinstance(t, Tensor) for t in tensors):
        raise OpError(f"{name} needs a non-empty sequence of tensors, but got {tensors!r}")
    return tensors


def cat(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Joins ``tensors`` along ``dim``; splits along other dims pass through.

    >>> import sbpflow
    >>> sbpflow.functional.cat([sbpflow.zeros(1, 2), sbpflow.ones(2, 2)]).shape
    torch.Size([3, 2])
    """
    tensors = _check_tensor_list("cat", tensors)
    return _cat(*tensors, dim=_norm_dim("cat", tensors[0], dim))


def stack(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Joins same-shaped ``tensors`` along a new dim ``dim``.

    >>> import sbpflow
    >>> sbpflow.functional.stack([sbpflow.zeros(2), sbpflow.ones(2)], dim=1).shape
    torch.Size([2, 2])
    """
    tensors = _check_tensor_list("stack", tensors)
    for i, t in enumerate(tensors):
        if tuple(t.shape) != tuple(tensors[0].shape):
            raise ShapeError(f"stack needs tensors of one shape, but tensor 0 is {tensors[0]._describe()} and "
                             f"tensor {i} is {t._describe()}")
    d = _norm_dim("stack", tensors[0], dim, extra=1)
    return _cat(*(SH.unsqueeze(t, dim=d) for t in tensors), dim=d)


# -- split / chunk ---------------------------------------------------------------------------------


def split(x: Tensor, split_size_or_sections: int | Sequence[int], dim: int = 0) -> tuple[Tensor, ...]:
    """Pieces of ``x`` along ``dim``: of size ``split_size`` (the last may be shorter) or of the given sizes.

    >>> import sbpflow
    >>> [t.tolist() for t in sbpflow.arange(5).split(2)]
    [[0, 1], [2, 3], [4]]
    """
    d = _norm_dim("split", x, dim)
    n = x.shape[d]
    if isinstance(split_size_or_sections, int):
        size = split_size_or_sections
        if size <= 0:
            raise ShapeError(f"split needs a positive split size, but got {size}; input {x._describe()}")
        sizes = [min(size, n - s) for s in range(0, n, size)] or [0]
    else:
        sizes = list(split_size_or_sections)
        if sum(sizes) != n or any(s < 0 for s in sizes):
            raise ShapeError(f"split sections {sizes} must be non-negative and sum to dim {d}'s size {n}; "
                             f"input {x._describe()}")
    pieces, offset = [], 0
    for s in sizes:
        pieces.append(slice_(x, dim=d, start=offset, stop=offset + s, step=1))
        offset += s
    return tuple(pieces)


def chunk(x: Tensor, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:
    """``chunks`` pieces of ``x`` along ``dim`` (fewer if the dim is short), as ``torch.chunk``.

    >>> import sbpflow
    >>> [t.tolist() for t in sbpflow.arange(5).chunk(2)]
    [[0, 1, 2], [3, 4]]
    """
    if chunks <= 0:
        raise ShapeError(f"chunk needs a positive number of chunks, but got {chunks}; input {x._describe()}")
    n = x.shape[_norm_dim("chunk", x, dim)]
    return split(x, max(_ceil_div(n, chunks), 1), dim)


Tensor.index_select = index_select  # type: ignore[attr-defined]
Tensor.gather = gather  # type: ignore[attr-defined]
Tensor.masked_select = masked_select  # type: ignore[attr-defined]
