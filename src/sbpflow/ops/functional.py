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

from ..autograd.mode import no_grad
from ..creation import full as _full
from ..creation import full_like, ones_like, rand_like, randn_like, uniform, zeros_like
from ..errors import ShapeError
from ..placement import Placement
from ..sbp import broadcast
from ..tensor import Tensor, logical_value
from . import _rules as R
from . import elementwise as E
from . import matrix as M
from . import reduction as RD
from . import shape as SH
from .attention import *  # noqa: F401,F403
from .conv import *  # noqa: F401,F403
from .convert import local_to_global, to_global
from .indexing import *  # noqa: F401,F403
from .indexing import cat, gather_backward, index_select, index_select_backward, narrow
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
    """``x`` itself when every shard is row-major (as torch returns ``self``), else a row-major copy. While
    nn.Graph traces there are no shards to look at: the copy is traced, and costs what the plan's layout needs."""
    if x._lazy is None and builtins.all(t.is_contiguous() for t in x.local_tensors().values()):
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



# -- the torch functions that ported model files call, built from the ops above (issue 32) ------------------------
#
# Composites inherit their SBP from the ops they are made of: a sort keeps a split of any other dim (topk's rule)
# and gathers a split of its own dim; one_hot follows its input; roll and flip keep splits of the dims they leave.


def einsum(equation: str, *operands: Any) -> Tensor:
    """torch.einsum; the signatures follow the subscripts (see ``ops.matrix``).

    >>> import sbpflow
    >>> einsum("ij,j->i", sbpflow.ones(2, 3), sbpflow.tensor([1.0, 2.0, 3.0])).tolist()
    [6.0, 6.0]
    """
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    return M.einsum_(*operands, equation=equation)


def outer(a: Tensor, b: Tensor) -> Tensor:
    return mul(unsqueeze(a, 1), unsqueeze(b, 0))


def sort(x: Tensor, dim: int = -1, descending: bool = False, stable: bool = False) -> MaxMin:
    """``(values, indices)`` along ``dim``, as ``torch.sort``: a split of ``dim`` is gathered first (ties may order
    their indices differently from torch's unstable sort; the values agree)."""
    d = R.normalize_dim(dim, x.ndim) if x.ndim else 0
    size = x.shape[d] if x.ndim else 1
    return topk(x, size, dim=d, largest=descending, sorted=True)


def argsort(x: Tensor, dim: int = -1, descending: bool = False, stable: bool = False) -> Tensor:
    return sort(x, dim, descending, stable).indices


def flip(x: Tensor, dims: Any) -> Tensor:
    for d in R.normalize_dims(dims, x.ndim):
        backwards = torch.arange(x.shape[d] - 1, -1, -1)  # a torch operand: dispatch makes it a broadcast value
        x = index_select(x, d, backwards)  # type: ignore[arg-type]
    return x


def roll(x: Tensor, shifts: Any, dims: Any = None) -> Tensor:
    """torch.roll: the two slices of each rolled dim swapped (a split of that dim is gathered by the slices)."""
    if dims is None:
        return reshape(roll(reshape(x, (-1,)), shifts, 0), tuple(x.shape))
    shifts = (shifts,) if isinstance(shifts, int) else tuple(shifts)
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if len(shifts) != len(dims):
        raise ShapeError(f"roll needs one shift per dim, but got shifts {list(shifts)} and dims {list(dims)}")
    for shift, dim in zip(shifts, dims, strict=True):
        d = R.normalize_dim(dim, x.ndim)
        n = x.shape[d]
        k = shift % n if n else 0
        if k:
            x = cat([narrow(x, d, n - k, k), narrow(x, d, 0, n - k)], d)
    return x


def tril(x: Tensor, diagonal: int = 0) -> Tensor:
    """The lower triangle of the last two dims, the rest zero; batch splits and partials pass (``ops.shape``)."""
    return SH.triangle(x, diagonal=diagonal, upper=False)


def triu(x: Tensor, diagonal: int = 0) -> Tensor:
    return SH.triangle(x, diagonal=diagonal, upper=True)


def norm(x: Tensor, p: Any = "fro", dim: Any = None, keepdim: bool = False, dtype: torch.dtype | None = None) -> Tensor:
    """The vector p-norm over ``dim`` (all dims by default), as ``torch.norm``: 2 and "fro", 1, inf, -inf, any p."""
    if dtype is not None:
        x = cast(x, dtype)
    if p in ("fro", 2, 2.0):
        return sqrt(sum(mul(x, x), dim=dim, keepdim=keepdim))
    if p in (float("inf"), "inf"):
        return amax(abs(x), dim=dim, keepdim=keepdim)
    if p in (float("-inf"), "-inf"):
        return amin(abs(x), dim=dim, keepdim=keepdim)
    if p in (1, 1.0):
        return sum(abs(x), dim=dim, keepdim=keepdim)
    if isinstance(p, str):
        raise ValueError(f"norm supports p = 'fro', a number or ±inf, but got {p!r}")
    return pow(sum(pow(abs(x), p), dim=dim, keepdim=keepdim), 1.0 / p)


def logsumexp(x: Tensor, dim: Any, keepdim: bool = False) -> Tensor:
    """log(sum(exp(x))) over ``dim``, shifted by the max so that large values do not overflow."""
    with no_grad():
        top = amax(x, dim=dim, keepdim=True)
        top = where(isfinite(top), top, torch.zeros((), dtype=x.dtype))  # all -inf rows: log(0) = -inf, as torch
    out = add(log(sum(exp(sub(x, top)), dim=dim, keepdim=True)), top)
    if not keepdim:
        for d in reversed(R.normalize_dims(dim, x.ndim)):
            out = squeeze(out, d)
    return out


def repeat(x: Tensor, *sizes: Any) -> Tensor:
    """torch's Tensor.repeat: tiles ``x`` ``sizes[i]`` times along dim i, as an expand and a reshape."""
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = tuple(sizes[0])
    if len(sizes) < x.ndim:
        raise ShapeError(f"repeat needs at least one size per dim ({x.ndim}), but got {list(sizes)}")
    x = reshape(x, (1,) * (len(sizes) - x.ndim) + tuple(x.shape))
    spread = reshape(x, tuple(n for size in x.shape for n in (1, size)))  # (1, s0, 1, s1, ...)
    tiled = expand(spread, tuple(n for r, size in zip(sizes, x.shape, strict=True) for n in (r, size)))
    return reshape(tiled, tuple(r * size for r, size in zip(sizes, x.shape, strict=True)))


def one_hot(x: Tensor, num_classes: int = -1) -> Tensor:
    """torch's F.one_hot: an int64 tensor with one more dim; it keeps the input's split (a compare with arange)."""
    if num_classes < 0:
        num_classes = int(amax(x).item()) + 1
    return cast(eq(unsqueeze(x, -1), torch.arange(num_classes)), torch.int64)


def new_full(like: Tensor, shape: Sequence[int], value: Any) -> Tensor:
    """torch's ``like.new_full(shape, value)``: ``like``'s dtype, on its placement (broadcast), or local where it is."""
    shape = tuple(shape)
    if like.is_global:
        return _full(*shape, fill_value=value, dtype=like.dtype, placement=like.placement,
                     sbp=[broadcast] * len(like.sbp))
    return _full(*shape, fill_value=value, dtype=like.dtype)


def pad(x: Tensor, pad: Sequence[int], mode: str = "constant", value: float | None = None) -> Tensor:
    """torch's F.pad in constant mode: ``pad`` lists (before, after) pairs from the last dim backwards."""
    if mode != "constant":
        raise ValueError(f"pad supports mode='constant', but got mode={mode!r}")
    if len(pad) % 2 or len(pad) // 2 > x.ndim:
        raise ShapeError(f"pad needs (before, after) pairs for at most {x.ndim} dims, but got {list(pad)}")
    for i in range(len(pad) // 2):
        d = x.ndim - 1 - i
        before, after = pad[2 * i], pad[2 * i + 1]
        if before < 0:
            x, before = narrow(x, d, -before, x.shape[d] + before), 0
        if after < 0:
            x, after = narrow(x, d, 0, x.shape[d] + after), 0
        parts = []
        for n in (before, after):
            shape = tuple(x.shape[:d]) + (n,) + tuple(x.shape[d + 1 :])
            parts.append(new_full(x, shape, value or 0) if n else None)
        pieces = [p for p in (parts[0], x, parts[1]) if p is not None]
        x = cat(pieces, d) if len(pieces) > 1 else x
    return x


def normalize(x: Tensor, p: float = 2.0, dim: int = 1, eps: float = 1e-12) -> Tensor:
    return div(x, clamp(norm(x, p, dim=dim, keepdim=True), min=eps))


def leaky_relu(x: Tensor, negative_slope: float = 0.01, inplace: bool = False) -> Tensor:
    return where(gt(x, 0), x, mul(x, negative_slope))


def binary_cross_entropy_with_logits(x: Tensor, target: Tensor, weight: Tensor | None = None,
                                     reduction: str = "mean", pos_weight: Tensor | None = None) -> Tensor:
    """The stable form max(x, 0) - x * t + log(1 + exp(-|x|)), with torch's weight and pos_weight."""
    soft = log(add(exp(neg(abs(x))), 1.0))  # log(1 + exp(-|x|))
    if pos_weight is None:
        loss = add(sub(clamp(x, min=0), mul(x, target)), soft)
    else:  # (1 - t) x + (1 + (pw - 1) t) (log(1 + exp(-|x|)) + max(-x, 0))
        scale = add(mul(sub(pos_weight, 1.0), target), 1.0)
        loss = add(mul(sub(1.0, target), x), mul(scale, add(soft, clamp(neg(x), min=0))))
    if weight is not None:
        loss = mul(loss, weight)
    if reduction == "mean":
        return mean(loss)
    return sum(loss) if reduction == "sum" else loss



def group_norm(x: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    """torch's F.group_norm over (N, C, *): the channels in ``num_groups`` groups, each normalised over its channels
    and positions. Built from reshape and mean, so a channel split reduces across the ranks that share a group."""
    if x.ndim < 2 or x.shape[1] % num_groups:
        raise ShapeError(f"group_norm needs (N, C, ...) with C divisible by num_groups {num_groups}, but got shape "
                         f"{list(x.shape)}")
    n, c = x.shape[0], x.shape[1]
    grouped = reshape(x, (n, num_groups, -1))  # (N, G, C/G * spatial), global
    centred = sub(grouped, mean(grouped, dim=2, keepdim=True))
    var = mean(mul(centred, centred), dim=2, keepdim=True)
    out = reshape(mul(centred, rsqrt(add(var, eps))), tuple(x.shape))
    per_channel = (1, c) + (1,) * (x.ndim - 2)
    if weight is not None:
        out = mul(out, reshape(weight, per_channel))
    if bias is not None:
        out = add(out, reshape(bias, per_channel))
    return out



def baddbmm(input: Any, batch1: Tensor, batch2: Tensor, *, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
    """``beta * input + alpha * batch1 @ batch2`` (``beta=0`` ignores ``input``, NaNs included, as torch)."""
    product = bmm(batch1, batch2)
    product = mul(product, alpha) if alpha != 1.0 else product
    return product if beta == 0 else add(mul(input, beta) if beta != 1.0 else input, product)


greater = gt


def l1_loss(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    loss = abs(sub(input, target))
    if reduction == "none":
        return loss
    return mean(loss) if reduction == "mean" else sum(loss)


def pixel_shuffle(x: Tensor, upscale_factor: int) -> Tensor:
    """(N, C*r*r, H, W) -> (N, C, H*r, W*r), as torch's F.pixel_shuffle (a reshape, a permute and a reshape)."""
    r = upscale_factor
    n, c, h, w = x.shape[0], x.shape[1] // (r * r), x.shape[2], x.shape[3]
    x = reshape(x, (n, c, r, r, h, w))
    return reshape(permute(x, (0, 1, 4, 2, 5, 3)), (n, c, h * r, w * r))


def repeat_interleave(x: Tensor, repeats: int, dim: int | None = None) -> Tensor:
    """Each element ``repeats`` times in a row along ``dim`` (the flattened tensor by default): an int count."""
    if not isinstance(repeats, int):
        raise ShapeError(f"repeat_interleave takes an int count (a tensor of counts gives a data-dependent shape), "
                         f"but got {type(repeats).__name__}; tensor {x._describe()}")
    if dim is None:
        x, dim = reshape(x, (-1,)), 0
    d = R.normalize_dim(dim, x.ndim)
    spread = expand(unsqueeze(x, d + 1), tuple(x.shape[: d + 1]) + (repeats,) + tuple(x.shape[d + 1 :]))
    return reshape(spread, tuple(x.shape[:d]) + (x.shape[d] * repeats,) + tuple(x.shape[d + 1 :]))


def index_add(x: Tensor, dim: int, index: Tensor, source: Tensor, alpha: float = 1.0) -> Tensor:
    """``x`` with the slices of ``source`` added at ``index`` along ``dim`` (repeated indices add up)."""
    d = R.normalize_dim(dim, x.ndim)
    source = mul(source, alpha) if alpha != 1.0 else source
    return add(x, index_select_backward(source, index, dim=d, size=x.shape[d]))


def scatter_add(x: Tensor, dim: int, index: Tensor, src: Tensor) -> Tensor:
    """``x`` with ``src[i][j]`` added at ``x[index[i][j]][j]`` (for ``dim=0``), as torch.scatter_add."""
    return add(x, gather_backward(src, index, dim=R.normalize_dim(dim, x.ndim), shape=tuple(x.shape)))


def histc(x: Tensor, bins: int = 100, min: float = 0.0, max: float = 0.0) -> Tensor:
    """Counts of ``x`` in ``bins`` equal bins over ``[min, max]`` (the data's range when both are 0); values
    outside are left out, as torch.histc. A compare with each bin and a sum: a split input gives partial counts."""
    lo, hi = (float(amin(x).item()), float(amax(x).item())) if min == 0 and max == 0 else (float(min), float(max))
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    flat = reshape(x, (-1,))
    inside = logical_and(ge(flat, lo), le(flat, hi))
    position = clamp(floor(mul(sub(flat, lo), bins / (hi - lo))), 0, bins - 1)  # the top edge joins the last bin
    hits = logical_and(eq(unsqueeze(position, 1), torch.arange(bins, dtype=position.dtype)), unsqueeze(inside, 1))
    return sum(hits, dim=0, dtype=x.dtype)


def nonzero(x: Tensor, as_tuple: bool = False) -> Any:
    """The indices of the non-zero entries, (count, ndim) int64, as torch.nonzero; the count depends on the data,
    so the result is a broadcast value (local for a local input)."""
    found = torch.nonzero(x.to_local() if x.is_local else logical_value(x))
    out = new_full(x, tuple(found.shape), 0)
    out = cast(out, torch.int64)
    for t in out.local_tensors().values():
        t.copy_(found)
    return tuple(_column(out, i) for i in range(x.ndim)) if as_tuple else out


def select_row(x: Tensor, i: int) -> Tensor:
    """``x[i]`` along dim 0, without the view bookkeeping of indexing (a time step of a sequence)."""
    return squeeze(narrow(x, 0, i, 1), 0)


def _column(x: Tensor, i: int) -> Tensor:
    return squeeze(narrow(x, 1, i, 1), 1)


__all__ = [n for n in dir() if not n.startswith("_") and n not in {"Any", "Sequence", "annotations", "builtins",
                                                                     "torch", "Tensor", "R", "E", "M", "RD", "SH",
                                                                     "broadcast", "logical_value", "no_grad"}]
_ = (builtins, full_like, ones_like, rand_like, randn_like, zeros_like, local_to_global, to_global)
