"""Indexing and joining: slicing (``narrow``, ``x[...]``), ``index_select``, ``gather``, ``cat``/``stack``,
``split``/``chunk``.

SBP rules, with ``dim`` the dim an op indexes or joins along:

    op               input(s)          output     why
    slice/narrow     S(k), k != dim    S(k)       every shard keeps its rows along k
                     B                 S(dim)     each rank cuts its own output box
    index_select     S(k), k != dim    S(k)
                     B, index S(0)     S(dim)     output rows follow the index
                     S(dim), index B   P(sum)     each rank looks up the rows it holds, zeros elsewhere
                                                  (the vocab-parallel embedding)
    gather           S(k), index S(k)  S(k)       k != dim, index as long as x along k
                     B, index S(k)     S(k)
                     S(dim), index B   P(sum)
    cat              all S(k), k != dim  S(k)
    x[mask]          B, mask B         B          the output's length is the mask's count: data, not
                     S(k), mask B      S(k-m+1)   metadata (a data-dependent op); k >= m, the mask's ndim,
                                                  so every rank selects the same rows


Selections are linear and pick elements without mixing them, so every partial
(sum, max, min) passes through them; their gradients scatter into zeros, so
only ``P(sum)`` passes through those. A split along ``dim`` itself is boxed
(all-gathered) where no rule above applies. Kernels return fresh tensors, not
views: sbpflow tracks in-place writes per tensor, so an output must not share
storage with its input.
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
from . import shape as SH
from .registry import DYNAMIC, Meta, ShardCtx, Sig, op
from .views import mark_view, setitem_writer

__all__ = ["narrow", "slice_", "getitem", "setitem", "index_select", "gather", "cat", "stack", "split", "chunk",
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


@op("slice", meta=_slice_meta, sbp=_slice_sigs, shard_aware=True)
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


@op("slice_backward", meta=_slice_backward_meta, sbp=_slice_backward_sigs, shard_aware=True)
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


# -- x[key] ----------------------------------------------------------------------------------------


def _expand_ellipsis(x: Tensor, key: tuple[Any, ...]) -> list[Any]:
    if sum(1 for k in key if k is Ellipsis) > 1:
        raise OpError(f"x[...] allows at most one Ellipsis, but got key {key!r}; input {x._describe()}")
    used = sum(1 for k in key if k is not None and k is not Ellipsis)
    if used > x.ndim:
        raise IndexOutOfRangeError(f"x[...] got {used} indices for a tensor of {x.ndim} dim(s); input {x._describe()}")
    out: list[Any] = []
    for k in key:
        out.extend([slice(None)] * (x.ndim - used) if k is Ellipsis else [k])
    return out


def _index_int(x: Tensor, d: int, i: int) -> Tensor:
    n = x.shape[d]
    if not -n <= i < n:
        raise IndexOutOfRangeError(f"x[...]: index {i} is out of range for dim {d} of size {n}; input {x._describe()}")
    i %= n
    return SH.squeeze(slice_(x, dim=d, start=i, stop=i + 1, step=1), dim=d)


def _index_slice(x: Tensor, d: int, s: slice) -> Tensor:
    start, stop, step = s.indices(x.shape[d])
    if step < 1:
        raise ShapeError(f"x[...]: slice step must be positive, but got {s.step} on dim {d}; input {x._describe()}")
    stop = max(start, stop)
    if (start, stop, step) == (0, x.shape[d], 1):
        return x
    return slice_(x, dim=d, start=start, stop=stop, step=step)


def _index_tensor(x: Tensor, d: int, index: Tensor) -> Tensor:
    if index.dtype not in _INDEX_DTYPES or index.ndim > 1:
        raise OpError(
            f"x[...] takes an int64/int32 tensor index of at most 1 dim, but got {index._describe()}; "
            f"input {x._describe()}"
        )
    out = index_select(x, d, index)
    return SH.squeeze(out, dim=d) if index.ndim == 0 else out


def getitem(x: Tensor, key: Any) -> Tensor:
    """``x[key]`` with ints, slices (positive steps), ``None``, ``...`` and at most one 1-D int tensor.

    >>> import sbpflow
    >>> x = sbpflow.arange(12).reshape(3, 4)
    >>> x[1:, ::2].tolist(), x[..., -1].tolist(), x[None, 0].shape
    ([[4, 6], [8, 10]], [3, 7, 11], torch.Size([1, 4]))
    """
    if isinstance(key, Tensor) and key.dtype == torch.bool:
        return _mask_rows(x, key)
    key = key if isinstance(key, tuple) else (key,)
    key = tuple(_list_index(x, k, _dim_of(x, key, i)) if isinstance(k, list) else k for i, k in enumerate(key))
    if any(isinstance(k, Tensor) and k.dtype == torch.bool for k in key):
        raise OpError(f"x[...] takes a bool mask only alone (x[mask]), but got key {key!r}; input {x._describe()}")
    if sum(1 for k in key if isinstance(k, Tensor)) > 1:
        raise OpError(f"x[...] takes at most one tensor index, but got key {key!r}; input {x._describe()}")
    out, d = x, 0  # d: the dim of `out` the next key entry indexes
    basic = not any(isinstance(k, Tensor) for k in key)
    for k in _expand_ellipsis(x, key):
        if k is None:
            out, d = SH.unsqueeze(out, dim=d), d + 1
        elif isinstance(k, bool) or not isinstance(k, (int, slice, Tensor)):
            raise OpError(f"x[...] takes ints, slices, None, ... and int tensors, but got {k!r}; input {x._describe()}")
        elif isinstance(k, int):
            out = _index_int(out, d, k)
        elif isinstance(k, slice):
            out, d = _index_slice(out, d, k), d + 1
        else:
            out = _index_tensor(out, d, k)
            d += 0 if k.ndim == 0 else 1
    return mark_view(out, x, setitem_writer(key), "__getitem__", key) if basic else out  # a tensor index copies


def _dim_of(x: Tensor, key: tuple[Any, ...], i: int) -> int:
    """The dim of ``x`` that entry ``i`` of ``key`` indexes (None adds no dim of x; ``...`` spans the rest)."""
    before = key[:i]
    if any(k is Ellipsis for k in before):
        after = [k for k in key[i + 1 :] if k is not None]
        return x.ndim - 1 - len(after)
    return sum(1 for k in before if k is not None)


def _list_index(x: Tensor, k: list[Any], dim: int) -> Tensor:
    """``x[[0, 2]]``, ``x[:, [-1]]``: a list of ints indexes as torch's int tensor would (negative ints count from
    the end of the dim; on ``x``'s placement, broadcast)."""
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in k):
        raise OpError(f"x[...] takes a list of ints as an index, but got {k!r}; input {x._describe()}")
    size = x.shape[dim] if dim < x.ndim else 0
    index = torch.tensor([i + size if i < 0 else i for i in k], dtype=torch.int64)
    if x.is_global:
        return Tensor._from_shards(tuple(index.shape), index.dtype, x.placement, (B,) * len(x.sbp),
                                   {r: index.to(x.device) for r in x.local_tensors()})
    return Tensor._from_local(index.to(x.device))


# -- x[key] = value ----------------------------------------------------------------------------------
#
# Written in place, in x's own layout: each rank writes the part of the indexed region its shard holds,
# from the value broadcast to every rank. A P(sum) piece off coordinate 0 gets zeros there (the region's
# sum is then the value); P(max)/P(min) pieces all get the value.

Region = list[tuple[int, int, int]]  # (start, stop, step) per dim of x, in logical indices


def _region(x: Tensor, key: Any) -> tuple[Region, tuple[int, ...]]:
    """The region ``x[key]`` selects, and that view's shape (``torch``'s ``x[key].shape``)."""
    key = key if isinstance(key, tuple) else (key,)
    region: Region = []
    shape: list[int] = []
    for k in _expand_ellipsis(x, key):
        if k is None:
            shape.append(1)
            continue
        if isinstance(k, bool) or not isinstance(k, (int, slice)):
            raise OpError(f"x[...] = value takes ints, slices, None and ... (basic indexing), but got {k!r}; "
                          f"target {x._describe()}")
        d, n = len(region), x.shape[len(region)]
        if isinstance(k, int):
            if not -n <= k < n:
                raise IndexOutOfRangeError(f"x[...] = value: index {k} is out of range for dim {d} of size {n}; "
                                           f"target {x._describe()}")
            region.append((k % n, k % n + 1, 1))
            continue
        start, stop, step = k.indices(n)
        if step < 1:
            raise ShapeError(f"x[...] = value: slice step must be positive, but got {k.step} on dim {d}; "
                             f"target {x._describe()}")
        region.append((start, max(start, stop), step))
        shape.append(len(range(*region[-1])))
    for d in range(len(region), x.ndim):
        region.append((0, x.shape[d], 1))
        shape.append(x.shape[d])
    return region, tuple(shape)


def _value_per_rank(x: Tensor, value: Any, counts: tuple[int, ...], shape: tuple[int, ...]) -> dict[int, Any]:
    """The value for the whole region on every rank x's process owns: a Python scalar, or a tensor of
    ``counts`` (the region's extent on every dim of x) broadcast from ``value`` by torch's rules."""
    from .convert import to_global

    ranks = list(x.local_tensors())
    if isinstance(value, (bool, int, float)):
        return dict.fromkeys(ranks, value)
    if isinstance(value, Tensor):
        if value.is_global != x.is_global:
            raise OpError(f"x[...] = value needs a value that is global like the target, or a scalar or torch tensor, "
                          f"but got {value._describe()} for target {x._describe()}")
        if value.is_global:
            value = to_global(value.detach(), x.placement, (B,) * x.placement.ndim)
        full = value.local_tensors()
    elif isinstance(value, torch.Tensor):
        full = dict.fromkeys(ranks, value.detach())
    else:
        raise OpError(f"x[...] = value takes a number or a tensor, but got {type(value).__name__}; "
                      f"target {x._describe()}")
    out = {}
    for r in ranks:
        v = full[r]
        while v.dim() > len(shape) and v.shape[0] == 1:  # torch drops leading unit dims of the value
            v = v[0]
        try:
            out[r] = v.broadcast_to(shape).reshape(counts)
        except RuntimeError:
            raise ShapeError(f"x[...] = value needs a value that broadcasts to the indexed shape {list(shape)}, "
                             f"but got shape {list(v.shape)}; target {x._describe()}") from None
    return out


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


def _write_region(x: Tensor, region: Region, values: dict[int, Any]) -> None:
    """Each owned shard takes the part of ``region`` inside its box."""
    from .._layout import shard_box

    for r, shard in x.local_tensors().items():
        box = shard_box(tuple(x.shape), x.placement, x.sbp, r) if x.is_global else tuple((0, n) for n in x.shape)
        dst, src = [], []
        for (lo, hi), (start, stop, step) in zip(box, region, strict=True):
            j_lo, j_hi = _strided_range(lo, hi, start, step, 0, len(range(start, stop, step)))
            if j_lo >= j_hi:
                break
            dst.append(slice(start + j_lo * step - lo, start + (j_hi - 1) * step - lo + 1, step))
            src.append(slice(j_lo, j_hi))
        else:
            value = values[r]
            if x.is_global and _zero_piece(x, r):
                value = 0
            elif isinstance(value, torch.Tensor):
                value = value[tuple(src)].to(device=shard.device, dtype=shard.dtype)
            shard[tuple(dst)] = value


def _zero_piece(x: Tensor, rank: int) -> bool:
    """Whether ``rank`` holds a P(sum) piece other than the one at coordinate 0 (it writes zeros)."""
    coords = x.placement.coords(rank)
    return any(s == PSUM and c != 0 for s, c in zip(x.sbp, coords, strict=True))


def _set_masked(x: Tensor, mask: Tensor, value: Any) -> None:
    """``x[mask] = value`` for a bool mask of x's shape and a scalar value: torch's idiom ``x[x < 0] = 0``."""
    scalar = isinstance(value, (bool, int, float)) or (isinstance(value, (Tensor, torch.Tensor)) and value.ndim == 0)
    if tuple(mask.shape) != tuple(x.shape) or not scalar:
        raise OpError(f"x[mask] = value takes a bool mask of x's shape {list(x.shape)} and a scalar value, but got "
                      f"mask {mask._describe()} and value {value!r}; target {x._describe()}")
    x.masked_fill_(mask, value)  # type: ignore[attr-defined]  # bound by ops.methods: in place, version, views


def _with_region(x: Tensor, region: Region, shape: tuple[int, ...], value: Any) -> Tensor:
    """``x`` with ``value`` written over ``region``, out of place (how nn.Graph traces ``x[key] = value``): the
    value, broadcast to the view's shape, is placed into zeros of x's shape by the slicing gradient, then chosen
    where the region is."""
    from . import functional as F
    from .elementwise import cast

    counts = tuple(len(range(*r)) for r in region)  # the region's shape: an int index keeps its dim as 1
    where = torch.zeros(tuple(x.shape), dtype=torch.bool)
    where[tuple(slice(*r) for r in region)] = True
    mask = _broadcast_on(x, where)  # a constant of the graph
    if isinstance(value, torch.Tensor) and not isinstance(value, Tensor):
        value = _broadcast_on(x, value)
    if not isinstance(value, Tensor) or value.ndim == 0 and not value.is_global:
        return _in_layout_of(x, F.where(mask, value if not isinstance(value, Tensor) else value.item(), x))
    if tuple(value.shape) != shape:
        if not _broadcasts_to(tuple(value.shape), shape):
            raise ShapeError(f"x[...] = value: a value of shape {list(value.shape)} does not broadcast to the "
                             f"indexed shape {list(shape)}; target {x._describe()}")
        value = F.expand(value, *shape)
    placed = F.reshape(cast(value, dtype=x.dtype), counts)  # logical region shape
    for d, (start, stop, step) in enumerate(region):
        if counts[d] != x.shape[d]:
            placed = slice_backward(placed, dim=d, start=start, stop=stop, step=step, size=x.shape[d])
    return _in_layout_of(x, F.where(mask, placed, x))


def _in_layout_of(x: Tensor, new: Tensor) -> Tensor:
    from . import functional as F

    if (new.placement, new.sbp) != (x.placement, x.sbp):
        new = F.to_global(new, x.placement, x.sbp)
    return new


def _broadcast_on(x: Tensor, value: torch.Tensor) -> Tensor:
    from ..creation import tensor as make_tensor

    return make_tensor(value, placement=x.placement, sbp=(broadcast,) * x.placement.ndim)


def _broadcasts_to(src: tuple[int, ...], dst: tuple[int, ...]) -> bool:
    try:
        return R.broadcast_shapes(src, dst) == dst
    except ShapeError:
        return False


def setitem(x: Tensor, key: Any, value: Any) -> None:
    """``x[key] = value`` in place, as torch does for basic indexing (ints, slices, None, ...) and a bool mask.

    >>> import sbpflow, torch
    >>> x = sbpflow.zeros(2, 4, placement=sbpflow.placement("cpu", [0, 1]), sbp=sbpflow.sbp.split(1))
    >>> x[:, 1:3] = torch.tensor([5.0, 6.0])
    >>> x[1] = 9
    >>> x.tolist()
    [[0.0, 5.0, 6.0, 0.0], [9.0, 9.0, 9.0, 9.0]]
    """
    from ..autograd import is_grad_enabled
    from ..errors import AutogradError
    from .views import refresh, write_back

    wants_grad = x.requires_grad or (isinstance(value, (Tensor, torch.Tensor)) and value.requires_grad)
    if is_grad_enabled() and wants_grad:
        raise AutogradError(f"x[...] = value writes in place while gradients are recorded (target {x._describe()}); "
                            "wrap it in sbpflow.no_grad() or build the result out of place (sbpflow.where, cat)")
    if isinstance(key, Tensor) and key.dtype == torch.bool:
        _set_masked(x, key, value)
        return
    refresh(x)  # a view whose base was written since: its other elements must be current before write_back
    region, shape = _region(x, key)
    if x._lazy is not None:  # tracing holds no shards to write into: the new value becomes an explicit graph op
        x._assign(_with_region(x, region, shape, value))
        write_back(x)
        return
    counts = tuple(len(range(*r)) for r in region)
    _write_region(x, region, _value_per_rank(x, value, counts, shape))
    x._version += 1
    write_back(x)


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
    from .elementwise import cast

    dim, grads, offset = ctx.attrs["dim"], [], 0
    for x, needed in zip(ctx.inputs, ctx.needs_input_grad, strict=True):
        n = x.shape[dim]
        g = slice_(dy, dim=dim, start=offset, stop=offset + n, step=1) if needed else None
        grads.append(cast(g, dtype=x.dtype) if g is not None and g.dtype != x.dtype else g)
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


def _narrow_view(x: Tensor, dim: int, start: int, length: int) -> Tensor:
    d = _norm_dim("narrow", x, dim)
    begin = start + x.shape[d] if start < 0 else start
    out = narrow(x, dim, start, length)
    return mark_view(out, x, setitem_writer(_along(d, begin, begin + length)), "narrow", dim, start, length)


def _pieces_as_views(x: Tensor, op: str, arg: Any, dim: int) -> tuple[Tensor, ...]:
    """split/chunk as methods: each piece is a view of its rows of ``x`` (torch's are)."""
    pieces = split(x, arg, dim) if op == "split" else chunk(x, arg, dim)
    d, offset = _norm_dim(op, x, dim), 0
    for i, piece in enumerate(pieces):
        n = piece.shape[d]
        mark_view(piece, x, setitem_writer(_along(d, offset, offset + n)), op, arg, dim, item=i)
        offset += n
    return pieces


def _along(dim: int, start: int, stop: int) -> tuple[slice, ...]:
    return (slice(None),) * dim + (slice(start, stop),)


Tensor.narrow = _narrow_view  # type: ignore[attr-defined]
Tensor.index_select = index_select  # type: ignore[attr-defined]
Tensor.gather = gather  # type: ignore[attr-defined]
Tensor.split = lambda x, size, dim=0: _pieces_as_views(x, "split", size, dim)  # type: ignore[attr-defined]
Tensor.chunk = lambda x, chunks, dim=0: _pieces_as_views(x, "chunk", chunks, dim)  # type: ignore[attr-defined]
Tensor.masked_select = masked_select  # type: ignore[attr-defined]
Tensor.__getitem__ = getitem  # type: ignore[attr-defined,misc]
Tensor.__setitem__ = setitem  # type: ignore[attr-defined,index]
