"""The functional API: every op as a function, with scalars, defaults and composites.

Op families live in their own modules; this module re-exports them and adds
the argument handling (Python scalars on either side, 1-D matmul) and the ops
built from other ops (var, std, sum_to ...), so that composites get SBP
inference and gradients for free.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import Any

import torch

from ..creation import full_like, ones_like, rand_like, randn_like, uniform, zeros_like
from ..errors import ShapeError
from ..placement import Placement
from ..tensor import Tensor
from . import _rules as R
from . import elementwise as E
from . import matrix as M
from . import reduction as RD
from . import shape as SH
from .attention import *  # noqa: F401,F403
from .conv import *  # noqa: F401,F403
from .convert import local_to_global, to_global
from .indexing import *  # noqa: F401,F403
from .loss import *  # noqa: F401,F403
from .normalization import *  # noqa: F401,F403
from .subscript import getitem, setitem  # noqa: F401

Scalar = int | float | bool


def _is_t(x: Any) -> bool:
    """A tensor operand: sbpflow's, or a plain torch tensor (dispatch makes it a broadcast global value)."""
    return isinstance(x, (Tensor, torch.Tensor))


# -- elementwise -----------------------------------------------------------------------------------


def add(x: Any, y: Any, alpha: Any = None) -> Tensor:
    if alpha is not None:
        y = mul(y, alpha)
    return E.add(x, y) if _is_t(x) else E.add(y, x)


def sub(x: Any, y: Any, alpha: Any = None) -> Tensor:
    if alpha is not None:
        y = mul(y, alpha)
    return E.sub(x, y) if _is_t(x) else E.rsub(y, x)


def mul(x: Any, y: Any) -> Tensor:
    return E.mul(x, y) if _is_t(x) else E.mul(y, x)


def div(x: Any, y: Any) -> Tensor:
    return E.div(x, y) if _is_t(x) else E.rdiv(y, x)


def pow(x: Any, y: Any) -> Tensor:
    return E.pow_(x, y) if _is_t(x) else E.rpow(y, x)


def maximum(x: Any, y: Any) -> Tensor:
    """Elementwise max; a Python scalar on either side acts as a clamp bound."""
    if not _is_t(y):
        return E.clamp(x, y, None)
    return E.maximum(x, y) if _is_t(x) else E.clamp(y, x, None)


def minimum(x: Any, y: Any) -> Tensor:
    """Elementwise min; a Python scalar on either side acts as a clamp bound."""
    if not _is_t(y):
        return E.clamp(x, None, y)
    return E.minimum(x, y) if _is_t(x) else E.clamp(y, None, x)


def _cmp(op: Any, flipped: Any):  # type: ignore[no-untyped-def]
    def f(x: Any, y: Any) -> Tensor:
        return op(x, y) if _is_t(x) else flipped(y, x)

    return f


eq = _cmp(E.eq, E.eq)
ne = _cmp(E.ne, E.ne)
lt = _cmp(E.lt, E.gt)
le = _cmp(E.le, E.ge)
gt = _cmp(E.gt, E.lt)
ge = _cmp(E.ge, E.le)
logical_not = E.logical_not
logical_and = E.logical_and
logical_or = E.logical_or

neg, exp, log, sqrt, rsqrt, tanh, sigmoid, relu, silu = (
    E.neg, E.exp, E.log, E.sqrt, E.rsqrt, E.tanh, E.sigmoid, E.relu, E.silu,
)
abs = E.abs_
sign, floor, ceil, round = E.sign, E.floor, E.ceil, E.round_
sin, cos, erf, isnan, isfinite = E.sin, E.cos, E.erf, E.isnan, E.isfinite


def clone(x: Tensor) -> Tensor:
    """A copy in fresh memory with the same placement and SBP (partials stay partial), as ``torch.clone``."""
    return E.clone(x)


def contiguous(x: Tensor) -> Tensor:
    """``x`` itself when every shard is row-major (as torch returns ``self``), else a row-major copy."""
    if builtins.all(t.is_contiguous() for t in x.local_tensors().values()):
        return x
    return E.contiguous(x)


def masked_fill(x: Tensor, mask: Tensor, value: Any) -> Tensor:
    """``x`` with ``value`` (a scalar or a 0-d tensor) where the bool ``mask`` (broadcast to ``x``) is set.

    >>> import sbpflow
    >>> x = sbpflow.tensor([1.0, 2.0, 3.0])
    >>> masked_fill(x, x > 1.5, float("-inf")).tolist()
    [1.0, -inf, -inf]
    """
    if _is_t(value):
        if value.ndim != 0:
            raise ShapeError(f"masked_fill takes a 0-d tensor value, but got {value._describe()}")
        return E.where(mask, cast(value, x.dtype), x)
    return E.masked_fill(x, mask, value=value)


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu approximate must be 'none' or 'tanh', but got {approximate!r}")
    return E.gelu(x, approximate=approximate)


def square(x: Tensor) -> Tensor:
    return E.mul(x, x)


def where(condition: Tensor, x: Any, y: Any) -> Tensor:
    if not _is_t(x) and not _is_t(y):
        raise TypeError("where needs at least one tensor among x and y")
    return E.where(condition, x, y)


def clamp(x: Tensor, min: Any = None, max: Any = None) -> Tensor:
    if _is_t(min) or _is_t(max):
        out = x
        if min is not None:
            out = maximum(out, min) if _is_t(min) else E.clamp(out, min, None)
        if max is not None:
            out = minimum(out, max) if _is_t(max) else E.clamp(out, None, max)
        return out
    return E.clamp(x, min, max)


clip = clamp


def cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x if x.dtype == dtype else E.cast(x, dtype=dtype)


# -- matrix ------------------------------------------------------------------------------------------


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """torch.matmul semantics, 1-D operands included."""
    if a.ndim == 0 or b.ndim == 0:
        raise ShapeError(f"matmul needs tensors of at least 1 dim, but got a {list(a.shape)} and b {list(b.shape)}")
    squeeze_a, squeeze_b = a.ndim == 1, b.ndim == 1
    if squeeze_a:
        a = SH.unsqueeze(a, dim=0)
    if squeeze_b:
        b = SH.unsqueeze(b, dim=1)
    out = M.matmul(a, b)
    if squeeze_a:
        out = SH.squeeze(out, dim=-2)
    if squeeze_b:
        out = SH.squeeze(out, dim=-1)
    return out


def bmm(a: Tensor, b: Tensor) -> Tensor:
    if a.ndim != 3 or b.ndim != 3:
        raise ShapeError(f"bmm needs 3-D tensors, but got a {list(a.shape)} and b {list(b.shape)}")
    return M.matmul(a, b)


mm = matmul


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return M.linear(x, weight, bias) if bias is not None else M.linear(x, weight)


# -- reductions --------------------------------------------------------------------------------------


def _dims(dim: Any) -> Any:
    if isinstance(dim, list):
        return tuple(dim)
    return dim


def sum(x: Tensor, dim: Any = None, keepdim: bool = False, dtype: torch.dtype | None = None) -> Tensor:
    return RD.sum_(x, dim=_dims(dim), keepdim=keepdim, dtype=dtype)


def mean(x: Tensor, dim: Any = None, keepdim: bool = False, dtype: torch.dtype | None = None) -> Tensor:
    return RD.mean(x, dim=_dims(dim), keepdim=keepdim, dtype=dtype)


def amax(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    return RD.amax(x, dim=_dims(dim), keepdim=keepdim)


def amin(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    return RD.amin(x, dim=_dims(dim), keepdim=keepdim)


class MaxMin(tuple):  # type: ignore[type-arg]
    """``(values, indices)`` of :func:`max` / :func:`min` over a dim and of :func:`topk`, like
    ``torch.return_types.max``."""

    __slots__ = ()

    def __new__(cls, values: Tensor, indices: Tensor) -> MaxMin:
        return super().__new__(cls, (values, indices))

    @property
    def values(self) -> Tensor:
        return self[0]  # type: ignore[no-any-return]

    @property
    def indices(self) -> Tensor:
        return self[1]  # type: ignore[no-any-return]


def max(x: Tensor, dim: Any = None, keepdim: bool = False) -> Any:
    """torch.max: no dim gives the largest value; a dim gives ``(values, indices)``; a tensor is ``maximum``.

    >>> import sbpflow
    >>> x = sbpflow.tensor([[1.0, 5.0], [4.0, 2.0]])
    >>> max(x).item(), max(x, dim=1).indices.tolist()
    (5.0, [1, 0])
    """
    if _is_t(dim):
        return maximum(x, dim)
    if dim is None:
        return RD.amax(x)
    return MaxMin(*RD.max_dim(x, dim=dim, keepdim=keepdim))


def min(x: Tensor, dim: Any = None, keepdim: bool = False) -> Any:
    """torch.min: no dim gives the smallest value; a dim gives ``(values, indices)``; a tensor is ``minimum``."""
    if _is_t(dim):
        return minimum(x, dim)
    if dim is None:
        return RD.amin(x)
    return MaxMin(*RD.min_dim(x, dim=dim, keepdim=keepdim))


def argmax(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Index of the largest value along ``dim`` (of the flattened tensor when ``dim`` is None), first on ties."""
    return RD.argmax(x, dim=None if dim is None else R.normalize_dim(dim, x.ndim), keepdim=keepdim)


def argmin(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Index of the smallest value along ``dim`` (of the flattened tensor when ``dim`` is None), first on ties."""
    return RD.argmin(x, dim=None if dim is None else R.normalize_dim(dim, x.ndim), keepdim=keepdim)


def all(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    """Whether every element (along ``dim``) is nonzero; a split reduced dim gives P(min) over bools."""
    return RD.all_(x, dim=_dims(dim), keepdim=keepdim)


def any(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    """Whether some element (along ``dim``) is nonzero; a split reduced dim gives P(max) over bools."""
    return RD.any_(x, dim=_dims(dim), keepdim=keepdim)


def cumsum(x: Tensor, dim: int, dtype: torch.dtype | None = None) -> Tensor:
    """Running sums along ``dim``, as ``torch.cumsum`` (integers accumulate in int64)."""
    return RD.cumsum(x, dim=R.normalize_dim(dim, x.ndim), dtype=dtype)


def topk(x: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> MaxMin:
    """``(values, indices)`` of the ``k`` largest (or smallest) entries along ``dim``, as ``torch.topk``.

    >>> import sbpflow
    >>> topk(sbpflow.tensor([3.0, 1.0, 4.0, 1.5]), 2).indices.tolist()
    [2, 0]
    """
    return MaxMin(*RD.topk(x, k=k, dim=R.normalize_dim(dim, x.ndim), largest=largest, sorted=sorted))


def var(x: Tensor, dim: Any = None, keepdim: bool = False, correction: int = 1, unbiased: bool | None = None) -> Tensor:
    """Variance as mean((x - mean)^2) * n / (n - correction): exact under uneven splits."""
    if unbiased is not None:
        correction = 1 if unbiased else 0
    dims = R.normalize_dims(_dims(dim), x.ndim)
    n = 1
    for d in dims:
        n *= x.shape[d]
    centered = sub(x, mean(x, dim=dims, keepdim=True))
    out = mean(mul(centered, centered), dim=dims, keepdim=keepdim)
    return mul(out, n / (n - correction) if n - correction > 0 else float("nan"))


def std(x: Tensor, dim: Any = None, keepdim: bool = False, correction: int = 1, unbiased: bool | None = None) -> Tensor:
    return sqrt(var(x, dim, keepdim, correction, unbiased))


# -- shape ------------------------------------------------------------------------------------------


def reshape(x: Tensor, *shape: Any) -> Tensor:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    try:
        target = SH.infer_shape(shape, x.numel())
    except ShapeError as e:
        raise ShapeError(f"op 'reshape': {e}; input: {x._describe()}") from None
    return x if target == tuple(x.shape) else SH.reshape(x, shape=target)


view = reshape


def transpose(x: Tensor, dim0: int, dim1: int) -> Tensor:
    d0, d1 = R.normalize_dim(dim0, x.ndim), R.normalize_dim(dim1, x.ndim)
    if d0 == d1:
        return x
    dims = list(range(x.ndim))
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return SH.permute(x, dims=tuple(dims))


def permute(x: Tensor, *dims: Any) -> Tensor:
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])
    return SH.permute(x, dims=tuple(dims))


def t(x: Tensor) -> Tensor:
    return transpose(x, 0, 1) if x.ndim == 2 else x


def reshape_permute(x: Tensor, shape: Sequence[int], dims: Sequence[int]) -> Tensor:
    """``x.reshape(shape).permute(dims)`` as one op (one dispatch, one gradient node), such as attention's split
    into heads: ``reshape_permute(q, (b, t, n_head, hd), (0, 2, 1, 3))``. Not a view: in-place writes into the
    result do not reach ``x`` (use the two view methods for that)."""
    try:
        target = SH.infer_shape(tuple(shape), x.numel())
    except ShapeError as e:
        raise ShapeError(f"op 'reshape_permute': {e}; input: {x._describe()}") from None
    return SH.reshape_permute(x, shape=target, dims=tuple(R.normalize_dim(d, len(target)) for d in dims))


def permute_reshape(x: Tensor, dims: Sequence[int], shape: Sequence[int]) -> Tensor:
    """``x.permute(dims).reshape(shape)`` as one op, such as attention's merge of heads:
    ``permute_reshape(y, (0, 2, 1, 3), (b, t, c))``. Not a view (see :func:`reshape_permute`)."""
    try:
        target = SH.infer_shape(tuple(shape), x.numel())
    except ShapeError as e:
        raise ShapeError(f"op 'permute_reshape': {e}; input: {x._describe()}") from None
    return SH.permute_reshape(x, dims=tuple(R.normalize_dim(d, x.ndim) for d in dims), shape=target)


def unsqueeze(x: Tensor, dim: int) -> Tensor:
    return SH.unsqueeze(x, dim=dim)


def squeeze(x: Tensor, dim: Any = None) -> Tensor:
    if dim is None:
        for d in reversed(range(x.ndim)):
            if x.shape[d] == 1:
                x = SH.squeeze(x, dim=d)
        return x
    return SH.squeeze(x, dim=dim)


def expand(x: Tensor, *shape: Any) -> Tensor:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    return SH.expand(x, shape=tuple(shape))


def expand_as(x: Tensor, other: Tensor) -> Tensor:
    return expand(x, tuple(other.shape))


def sum_to(g: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Sums a broadcast gradient back to ``shape`` (the reverse of broadcasting)."""
    if tuple(g.shape) == tuple(shape):
        return g
    lead = g.ndim - len(shape)
    dims = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape) if n == 1 and g.shape[lead + i] != 1)
    out = sum(g, dim=dims, keepdim=True) if dims else g
    return reshape(out, tuple(shape)) if tuple(out.shape) != tuple(shape) else out


def expand_reduced(g: Tensor, shape: tuple[int, ...], dim: Any, keepdim: bool) -> Tensor:
    """Broadcasts the result of a reduction over ``dim`` back to the input ``shape``."""
    if dim is None and not keepdim:  # a 0-d result expands straight to any shape
        return expand(g, tuple(shape)) if shape else g
    dims = R.normalize_dims(dim, len(shape))
    if not keepdim:
        for d in dims:
            g = unsqueeze(g, d)
    return expand(g, tuple(shape)) if tuple(g.shape) != tuple(shape) else g


def randint(low: int, high: int, size: Sequence[int], *, placement: Placement | None = None, sbp: Any = None,
            dtype: torch.dtype = torch.int64) -> Tensor:
    """Integers on [low, high), from the same placement-independent stream."""
    u = uniform(*size, low=float(low), high=float(high), placement=placement, sbp=sbp, dtype=torch.float64)
    return cast(floor(u), dtype)


def flatten(x: Tensor, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    if x.ndim == 0:
        return reshape(x, (1,))
    s, e = R.normalize_dim(start_dim, x.ndim), R.normalize_dim(end_dim, x.ndim)
    merged = 1
    for n in x.shape[s : e + 1]:
        merged *= n
    return reshape(x, tuple(x.shape[:s]) + (merged,) + tuple(x.shape[e + 1 :]))


def unflatten(x: Tensor, dim: int, sizes: Sequence[int]) -> Tensor:
    d = R.normalize_dim(dim, x.ndim)
    return reshape(x, tuple(x.shape[:d]) + tuple(sizes) + tuple(x.shape[d + 1 :]))


__all__ = [n for n in dir() if not n.startswith("_") and n not in {"Any", "Sequence", "annotations", "builtins",
                                                                     "torch", "Tensor", "R", "E", "M", "RD", "SH"}]
_ = (builtins, full_like, ones_like, rand_like, randn_like, zeros_like, local_to_global, to_global)
