"""Tensor methods and Python operators, bound onto :class:`sbpflow.Tensor`; families add theirs with
:func:`bind_methods`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..autograd import is_grad_enabled
from ..errors import AutogradError, DTypeError, LocalGlobalError, OpError, SbpError, ShapeError
from ..placement import Placement
from ..sbp import Partial, format_nd, normalize
from ..tensor import Tensor
from . import _rules as R
from . import convert as _convert
from . import elementwise as _elementwise
from . import functional as F
from . import shape as _shape
from .schema import OpDef
from .views import Writer, mark_view, not_writable, refresh, write_back


def bind_methods(table: dict[str, Callable[..., Any]]) -> None:
    """Sets each ``fn`` as a method of :class:`Tensor`; registered ops are wrapped so that they bind ``self``."""
    for name, fn in table.items():
        setattr(Tensor, name, _as_function(fn))


def _as_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    # An OpDef is a callable object, not a function, so Python would not pass ``self`` to it as a method.
    if not isinstance(fn, OpDef):
        return fn

    def method(self: Tensor, *args: Any, **kwargs: Any) -> Any:
        return fn(self, *args, **kwargs)

    method.__name__ = fn.name
    return method


def _r(fn: Callable[[Any, Any], Tensor]) -> Callable[[Tensor, Any], Tensor]:
    return lambda self, other: fn(other, self)


bind_methods({
    "__add__": F.add, "__radd__": _r(F.add), "__sub__": F.sub, "__rsub__": _r(F.sub),
    "__mul__": F.mul, "__rmul__": _r(F.mul), "__truediv__": F.div, "__rtruediv__": _r(F.div),
    "__pow__": F.pow, "__rpow__": _r(F.pow), "__matmul__": F.matmul, "__rmatmul__": _r(F.matmul),
    "__neg__": F.neg, "__abs__": F.abs, "__lt__": F.lt, "__le__": F.le, "__gt__": F.gt, "__ge__": F.ge,
    "__eq__": F.eq, "__ne__": F.ne, "__and__": F.logical_and, "__or__": F.logical_or,
    "__invert__": F.logical_not,
    "add": F.add, "sub": F.sub, "mul": F.mul, "div": F.div, "pow": F.pow, "neg": F.neg, "exp": F.exp,
    "log": F.log, "sqrt": F.sqrt, "rsqrt": F.rsqrt, "abs": F.abs, "tanh": F.tanh, "sigmoid": F.sigmoid,
    "relu": F.relu, "square": F.square, "clamp": F.clamp, "clip": F.clamp, "maximum": F.maximum,
    "minimum": F.minimum, "eq": F.eq, "ne": F.ne, "lt": F.lt, "le": F.le, "gt": F.gt, "ge": F.ge,
    "matmul": F.matmul, "max": F.max, "min": F.min, "sum": F.sum, "mean": F.mean, "amax": F.amax, "amin": F.amin,
    "var": F.var,
    "std": F.std, "floor": F.floor, "sign": F.sign,  # view methods (reshape, t ...): see "views" below
    "float": lambda self: F.cast(self, torch.float32), "double": lambda self: F.cast(self, torch.float64),
    "long": lambda self: F.cast(self, torch.int64), "int": lambda self: F.cast(self, torch.int32),
    "bool": lambda self: F.cast(self, torch.bool), "half": lambda self: F.cast(self, torch.float16),
    "bfloat16": lambda self: F.cast(self, torch.bfloat16), "type_as": lambda self, o: F.cast(self, o.dtype),
})


def _to(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    dtype = kwargs.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
    return F.cast(self, dtype) if dtype is not None else self


Tensor.to = _to  # type: ignore[attr-defined]


# -- in place --------------------------------------------------------------------------------------


def _fast_ok(self: Tensor, name: str, args: tuple[Any, ...]) -> bool:
    """Whether torch's own in-place kernel can run shard by shard (same layout, shape and dtype everywhere)."""
    if not hasattr(torch.Tensor, name) or self._lazy is not None:
        return False
    if self._local is None and any(isinstance(s, Partial) for s in self.sbp):
        return False
    if name == "div_" and not self.dtype.is_floating_point:
        return False  # true division gives floats; the checked slow path says why they cannot be stored
    for a in args:
        if isinstance(a, Tensor):
            if (a._local is None) != (self._local is None) or a.shape != self.shape or a.dtype != self.dtype:
                return False
            if a._local is None and (a.placement != self.placement or a.sbp != self.sbp):
                return False
        elif isinstance(a, float) and not self.dtype.is_floating_point:
            return False  # torch refuses int += float; the checked slow path says why
    return True


# In-place forms (add_, mul_ ..., +=, -=, *=, /=) compute out of place, box the result to the tensor's own layout
# and copy it in; when every operand already shares that layout (nothing partial) they run torch's in-place
# kernel per shard (_fast_ok). View methods mark their output so in-place writes into it reach the input (.views).
def _inplace(name: str, fn: Callable[..., Tensor], any_dtype: bool = False, shown: str = "") -> Callable[..., Tensor]:
    """An in-place method ``name``: ``fn`` computes the new value; ``any_dtype`` lets it cast freely (copy_, fill_).

    ``shown`` is how errors name it (``-=`` for ``__isub__``). A view (``x[:, 0]``, ``x.view(12)``) passes the
    new value on to its base afterwards, so the write lands where torch's would (see ``ops.views``).
    """
    shown = shown or f"{name}()"

    def method(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if is_grad_enabled() and (self.requires_grad or any(isinstance(a, Tensor) and a.requires_grad for a in args)):
            raise AutogradError(
                f"{shown} modifies a tensor in place while gradients are recorded ({self._describe()}); "
                "wrap it in sbpflow.no_grad() or use the out-of-place form"
            )
        if self._view_of is not None:
            refresh(self)
        if _fast_ok(self, name, args):
            for r, shard in self.local_tensors().items():
                values = [a.local_tensors()[r] if isinstance(a, Tensor) else a for a in args]
                getattr(shard, name)(*values, **kwargs)
            self._version += 1
        else:
            result = fn(self, *args, **kwargs)
            _check_inplace_result(shown, self, result, any_dtype)
            if self.is_global and (result.placement != self.placement or result.sbp != self.sbp):
                result = F.to_global(result, self.placement, self.sbp)
            if result.dtype != self.dtype:
                result = F.cast(result, self.dtype)
            self._assign(result)
        write_back(self)
        return self

    method.__name__ = name
    return method


def _check_inplace_result(name: str, self: Tensor, result: Tensor, any_dtype: bool) -> None:
    if result.shape != self.shape:
        raise ShapeError(
            f"{name} cannot write a result of shape {list(result.shape)} into a tensor with {self._describe()}; "
            "the other operands must broadcast to the target's shape"
        )
    if not any_dtype and not torch.can_cast(result.dtype, self.dtype):
        raise DTypeError(
            f"{name} computes a {str(result.dtype).replace('torch.', '')} result, which cannot be stored in place "
            f"into a tensor with {self._describe()}; use the out-of-place form"
        )
    if (result._local is None) != (self._local is None):
        raise LocalGlobalError(f"{name} got local and global tensors together: target {self._describe()}, "
                      f"result {result._describe()}")


def _copy(self: Tensor, src: Any) -> Tensor:
    return F.expand(src, tuple(self.shape)) if tuple(src.shape) != tuple(self.shape) else src


def _fill(self: Tensor, value: Any) -> Tensor:
    return F.full_like(self, value)


bind_methods({
    "add_": _inplace("add_", F.add), "sub_": _inplace("sub_", F.sub), "mul_": _inplace("mul_", F.mul),
    "div_": _inplace("div_", F.div), "pow_": _inplace("pow_", F.pow), "clamp_": _inplace("clamp_", F.clamp),
    "copy_": _inplace("copy_", _copy, any_dtype=True), "fill_": _inplace("fill_", _fill, any_dtype=True),
    "zero_": _inplace("zero_", lambda self: F.zeros_like(self), any_dtype=True),
    "neg_": _inplace("neg_", F.neg), "sqrt_": _inplace("sqrt_", F.sqrt), "exp_": _inplace("exp_", F.exp),
    "maximum_": _inplace("maximum_", F.maximum),
    # x += y is in place in torch (a parameter update under no_grad must change the parameter itself)
    "__iadd__": _inplace("add_", F.add, shown="+="), "__isub__": _inplace("sub_", F.sub, shown="-="),
    "__imul__": _inplace("mul_", F.mul, shown="*="), "__itruediv__": _inplace("div_", F.div, shown="/="),
})


# -- PyTorch parity: the methods torch users reach for (issue 13) ------------------------------------

bind_methods({
    "clone": F.clone, "contiguous": F.contiguous, "sin": F.sin, "cos": F.cos, "erf": F.erf, "isnan": F.isnan,
    "isfinite": F.isfinite, "masked_fill": F.masked_fill, "argmax": F.argmax, "argmin": F.argmin, "all": F.all,
    "any": F.any, "cumsum": F.cumsum, "topk": F.topk, "masked_fill_": _inplace("masked_fill_", F.masked_fill),
})


# -- views -----------------------------------------------------------------------------------------


# -- view writers: carry a view's new value back into its base (ops.views.write_back runs them) ----------


def assign_into(base: Tensor, value: Tensor) -> None:
    """Writes ``value`` (of ``base``'s shape) into ``base`` in its own layout and dtype, then on to its base."""
    if base.is_global and (value.placement, value.sbp) != (base.placement, base.sbp):
        value = _convert.to_global(value, base.placement, base.sbp)
    if value.dtype != base.dtype:
        value = _elementwise.cast(value, dtype=base.dtype)
    base._assign(value)
    write_back(base)


def reshaped(base: Tensor, view: Tensor) -> None:
    """Writer of view/reshape/flatten/squeeze/unsqueeze: the same elements in row-major order."""
    assign_into(base, _shape.reshape(view, shape=tuple(base.shape)) if view.shape != base.shape else view)


@functools.cache
def permuted(dims: tuple[int, ...]) -> Writer:
    """Writer of permute/transpose/t/T/mT: the inverse permutation (one writer per ``dims``, made once: every
    transpose of a forward pass asks for one)."""
    inverse = tuple(sorted(range(len(dims)), key=lambda i: dims[i]))

    def write(base: Tensor, view: Tensor) -> None:
        assign_into(base, _shape.permute(view, dims=inverse))

    return write


def _viewing(name: str, fn: Callable[..., Tensor], write: Writer) -> Callable[..., Tensor]:
    """The view method ``name`` (torch's name): ``fn`` computes it, ``write`` carries in-place writes back."""

    def method(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return mark_view(fn(self, *args, **kwargs), self, write, name, *args, **kwargs)

    method.__name__ = name
    return method


def _transpose(self: Tensor, dim0: int, dim1: int) -> Tensor:
    dims = list(range(self.ndim))
    d0, d1 = R.normalize_dim(dim0, self.ndim), R.normalize_dim(dim1, self.ndim)
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return mark_view(F.transpose(self, dim0, dim1), self, permuted(tuple(dims)), "transpose", dim0, dim1)


def _permute(self: Tensor, *dims: Any) -> Tensor:
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])
    order = tuple(R.normalize_dim(d, self.ndim) for d in dims)
    return mark_view(F.permute(self, order), self, permuted(order), "permute", order)


def _expand_as(self: Tensor, other: Tensor) -> Tensor:
    return mark_view(F.expand_as(self, other), self, not_writable("expand_as"), "expand", tuple(other.shape))


bind_methods({
    "reshape": _viewing("reshape", F.reshape, reshaped), "view": _viewing("view", F.view, reshaped),
    "flatten": _viewing("flatten", F.flatten, reshaped), "unflatten": _viewing("unflatten", F.unflatten, reshaped),
    "squeeze": _viewing("squeeze", F.squeeze, reshaped), "unsqueeze": _viewing("unsqueeze", F.unsqueeze, reshaped),
    "transpose": _transpose, "permute": _permute, "t": lambda self: _transpose(self, 0, 1) if self.ndim == 2 else self,
    "expand": _viewing("expand", F.expand, not_writable("expand")), "expand_as": _expand_as,
})
Tensor.T = property(lambda self: _permute(self, tuple(reversed(range(self.ndim)))))  # type: ignore[attr-defined]
Tensor.mT = property(lambda self: _transpose(self, -1, -2))  # type: ignore[attr-defined]


def _to_global(self: Tensor, placement: Placement | None = None, sbp: Any = None, *, grad_sbp: Any = None,
               check_meta: bool = True) -> Tensor:
    """Converts to ``placement`` and ``sbp``; an omitted argument keeps the current value.

    ``grad_sbp`` (global tensors) is the SBP, on this tensor's placement, that this tensor's gradient gets
    in backward (by default its own): ``partial_sum`` defers the gradient's reduction to its consumer.
    ``check_meta`` is OneFlow's flag (skip checking that every process passed the same shape); sbpflow
    derives the logical shape the same way either way, so it changes nothing.

    On a local tensor, the local tensor becomes this rank's shard: every rank
    contributes its local tensor and the SBP says what the contributions mean
    (split axes concatenate, ``B`` keeps the replica, ``P(sum)`` adds them up).
    Every virtual rank of this process contributes the same local tensor, so
    the numbers match one process per rank each passing that tensor:

    >>> import sbpflow
    >>> p = sbpflow.placement("cpu", [0, 1])
    >>> sbpflow.tensor([1.0, 1.0]).to_global(p, sbpflow.sbp.partial_sum).tolist()
    [2.0, 2.0]
    """
    if self._local is not None:
        if placement is None or sbp is None:
            raise SbpError("to_global() of a local tensor needs both placement= and sbp=")
        if grad_sbp is not None:
            raise SbpError(f"to_global(grad_sbp=...) sets the SBP of a global tensor's gradient, but the input is "
                           f"a {self._describe()}: its gradient is local")
        return F.local_to_global(self, placement, sbp)
    placement = self.placement if placement is None else placement
    if not isinstance(placement, Placement):
        raise SbpError(f"to_global(placement=...) needs an sbpflow.placement, but got {placement!r}")
    nd = self.sbp if sbp is None else normalize(sbp, placement, self.ndim, what=f"tensor with {self._describe()}")
    if sbp is None and placement.ndim != len(nd):
        raise SbpError(
            f"to_global() onto {placement} ({placement.ndim} mesh axes) needs sbp=, since the tensor's sbp "
            f"{format_nd(self.sbp)} has {len(self.sbp)} entries"
        )
    return F.to_global(self, placement, nd, grad_sbp)


Tensor.to_global = _to_global  # type: ignore[method-assign]


# -- the methods ported model files call (issue 32) --------------------------------------------------------------


def _new(fill: Any) -> Callable[..., Tensor]:
    """``x.new_zeros(size)`` and the like: a tensor of ``x``'s dtype (unless given) on ``x``'s placement (broadcast),
    or local where ``x`` is."""

    def method(self: Tensor, *size: Any, dtype: torch.dtype | None = None, **_: Any) -> Tensor:
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        out = F.new_full(self, shape, fill)
        return F.cast(out, dtype) if dtype is not None and dtype != out.dtype else out

    return method


def _new_full(self: Tensor, size: Any, fill_value: Any, dtype: torch.dtype | None = None, **_: Any) -> Tensor:
    return _new(fill_value)(self, tuple(size), dtype=dtype)


_TYPE_NAMES = {
    torch.float32: "torch.FloatTensor", torch.float64: "torch.DoubleTensor", torch.float16: "torch.HalfTensor",
    torch.bfloat16: "torch.BFloat16Tensor", torch.int64: "torch.LongTensor", torch.int32: "torch.IntTensor",
    torch.bool: "torch.BoolTensor", torch.int8: "torch.CharTensor", torch.uint8: "torch.ByteTensor",
}


def _type(self: Tensor, dtype: Any = None) -> Any:
    """``x.type()`` names the dtype as torch does; ``x.type(torch.float64)`` casts."""
    if dtype is None:
        return _TYPE_NAMES.get(self.dtype, str(self.dtype))
    if isinstance(dtype, str):
        names = {v: k for k, v in _TYPE_NAMES.items()}
        if dtype not in names:
            raise DTypeError(f"type() takes a dtype or one of {sorted(names)}, but got {dtype!r}")
        dtype = names[dtype]
    return F.cast(self, dtype) if dtype != self.dtype else self


bind_methods({
    "repeat": F.repeat, "tril": F.tril, "triu": F.triu, "norm": F.norm, "sort": F.sort, "argsort": F.argsort,
    "flip": F.flip, "roll": F.roll, "logsumexp": F.logsumexp, "type": _type, "new_zeros": _new(0),
    "new_ones": _new(1), "new_full": _new_full, "new_empty": _new(0),
    "cpu": lambda self: self,  # sbpflow tensors already live where their placement says; CPU runs keep them
    "outer": F.outer, "softmax": F.softmax, "log_softmax": F.log_softmax,
})


def _scatter_add(self: Tensor, dim: int, index: Tensor, src: Tensor) -> Tensor:
    return F.scatter_add(self, dim, index, src)


def _index_add(self: Tensor, dim: int, index: Tensor, source: Tensor, alpha: float = 1.0) -> Tensor:
    return F.index_add(self, dim, index, source, alpha=alpha)


bind_methods({
    "repeat_interleave": F.repeat_interleave, "nonzero": F.nonzero, "index_add": _index_add,
    "index_add_": _inplace("index_add_", _index_add), "scatter_add": _scatter_add,
    "scatter_add_": _inplace("scatter_add_", _scatter_add), "histc": F.histc, "baddbmm": F.baddbmm,
    "pin_memory": lambda self: self,  # shards are host tensors already on CPU; a CUDA copy reads them directly
    "cuda": lambda self, device=None: _to_cuda(self, device),
})


def _to_cuda(self: Tensor, device: Any) -> Tensor:
    """A local tensor copied to a CUDA device, as torch's ``x.cuda()``; a global one lives where its placement says."""
    if self.is_global:
        raise OpError(f"x.cuda() moves local tensors; a global tensor ({self._describe()}) lives on its placement: "
                      "use x.to_global(sbpflow.placement('cuda', ranks))")
    return Tensor._from_local(self.to_local().cuda(device), requires_grad=self.requires_grad)
