"""The Python subscript front end: ``x[key]``, ``x[key] = value``, and narrow/split/chunk as views.

Built on the registered ops of :mod:`.indexing` (slice, index_select, masked_select ...): a basic index is a
view whose writer carries writes back into its base (:mod:`.views`).
"""

from __future__ import annotations

from typing import Any

import torch

from .._layout import shard_box, zigzag_axis
from ..autograd import is_grad_enabled
from ..creation import tensor as make_tensor
from ..errors import AutogradError, IndexOutOfRangeError, OpError, SbpflowError, ShapeError
from ..sbp import broadcast
from ..tensor import Tensor
from . import _rules as R
from . import elementwise as E
from . import shape as SH
from .convert import to_global
from .indexing import (
    _INDEX_DTYPES,
    PSUM,
    B,
    _mask_rows,
    _norm_dim,
    _strided_range,
    chunk,
    index_select,
    narrow,
    slice_,
    slice_backward,
    split,
)
from .views import Writer, mark_view, refresh, write_back

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
        return Tensor._from_shards(tuple(index.shape), index.dtype, x.placement, (broadcast,) * len(x.sbp),
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


def _write_region(x: Tensor, region: Region, values: dict[int, Any]) -> None:
    """Each owned shard takes the part of ``region`` inside its box."""
    if x.is_global and zigzag_axis(x.sbp) is not None:  # its boxes are in storage order, not the region's
        raise SbpflowError(f"x[...] = value writes in place, which a zigzag split does not support: {x._describe()}; "
                           f"convert x to a plain split or B first (x.to_global(sbp=...))")
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
    counts = tuple(len(range(*r)) for r in region)  # the region's shape: an int index keeps its dim as 1
    where = torch.zeros(tuple(x.shape), dtype=torch.bool)
    where[tuple(slice(*r) for r in region)] = True
    mask = _broadcast_on(x, where)  # a constant of the graph
    if isinstance(value, torch.Tensor) and not isinstance(value, Tensor):
        value = _broadcast_on(x, value)
    if not isinstance(value, Tensor) or value.ndim == 0 and not value.is_global:
        return _in_layout_of(x, E.where(mask, value if not isinstance(value, Tensor) else value.item(), x))
    if tuple(value.shape) != shape:
        if not _broadcasts_to(tuple(value.shape), shape):
            raise ShapeError(f"x[...] = value: a value of shape {list(value.shape)} does not broadcast to the "
                             f"indexed shape {list(shape)}; target {x._describe()}")
        value = SH.expand(value, shape=tuple(shape))
    cast_value = E.cast(value, dtype=x.dtype)
    placed = cast_value if counts == tuple(cast_value.shape) else SH.reshape(cast_value, shape=counts)  # logical region
    for d, (start, stop, step) in enumerate(region):
        if counts[d] != x.shape[d]:
            placed = slice_backward(placed, dim=d, start=start, stop=stop, step=step, size=x.shape[d])
    return _in_layout_of(x, E.where(mask, placed, x))


def _in_layout_of(x: Tensor, new: Tensor) -> Tensor:
    if (new.placement, new.sbp) != (x.placement, x.sbp):
        new = to_global(new, x.placement, x.sbp)
    return new


def _broadcast_on(x: Tensor, value: torch.Tensor) -> Tensor:
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


def setitem_writer(key: Any) -> Writer:
    """Writer of basic indexing ``x[key]``: ``base[key] = view``."""

    def write(base: Tensor, view: Tensor) -> None:
        setitem(base, key, view)

    return write


Tensor.narrow = _narrow_view  # type: ignore[attr-defined]
Tensor.split = lambda x, size, dim=0: _pieces_as_views(x, "split", size, dim)  # type: ignore[attr-defined]
Tensor.chunk = lambda x, chunks, dim=0: _pieces_as_views(x, "chunk", chunks, dim)  # type: ignore[attr-defined]
Tensor.__getitem__ = getitem  # type: ignore[attr-defined,misc]
Tensor.__setitem__ = setitem  # type: ignore[attr-defined,index]
