"""Elementwise ops with broadcasting and torch's type promotion; any output dim may be split, and partial
values pass through the ops that are linear or monotone in them (rules at :func:`_unary_sigs`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as TF

from ..sbp import Partial, broadcast
from . import _rules as R
from .schema import Meta, op

PSUM, PMAX, PMIN = Partial("sum"), Partial("max"), Partial("min")
B = broadcast


def _n_tensors(args: tuple[Any, ...]) -> int:
    return len(R.metas(args))


# -- unary ------------------------------------------------------------------------------------


# Any output dim may be split (inputs broadcast along it stay B). Partial values pass through ops linear in them
# (add, sub, neg, mul or div by a B factor); P(max)/P(min) through monotone non-decreasing unary ops defined on
# every value a piece can hold (the ±inf of an empty shard included), and neg swaps them; log/sqrt take only
# P(min), and cast decides by its dtypes. B + P(max) does not pass (an infinite B meets a -inf piece).
def _unary_sigs(monotone: bool | str = False, linear: bool = False, flips: bool = False):  # type: ignore[no-untyped-def]
    """``monotone``: True lets P(max) and P(min) through; "min" only P(min), for functions whose domain is
    bounded below (every P(min) piece is at least the logical value; a P(max) piece may be anything lower)."""

    def sigs(x: Meta, *rest: Any, outs: tuple[Meta, ...], **_: Any) -> list:  # type: ignore[type-arg]
        partial: list[tuple[Any, ...]] = []
        if linear:
            partial.append((PSUM, PSUM))
        if monotone is True:
            partial += [(PMAX, PMAX), (PMIN, PMIN)]
        elif monotone == "min":
            partial.append((PMIN, PMIN))
        if flips:
            partial += [(PMAX, PMIN), (PMIN, PMAX)]
        return R.elementwise_sigs((x,), outs[0], partial)

    return sigs


def _unary(name: str, fn: Any, *, meta: Any = R.same_meta, monotone: bool | str = False, linear: bool = False,
           flips: bool = False, save_outputs: bool = False, grad_reads: tuple[int, ...] | None = None) -> Any:
    return op(name, meta=meta, sbp=_unary_sigs(monotone, linear, flips), save_outputs=save_outputs,
              grad_reads=grad_reads)(fn)


neg = _unary("neg", torch.neg, linear=True, flips=True, grad_reads=())
exp = _unary("exp", torch.exp, meta=R.float_meta, monotone=True, save_outputs=True, grad_reads=())
# log and sqrt are monotone but undefined below 0: a losing P(max) piece may be negative, or -inf from an empty
# shard, and its NaN would win the max. Every P(min) piece is >= the logical value, so if that is in the domain
# all pieces are (and if it is not, torch's own answer is NaN or -inf too): only P(min) passes.
log = _unary("log", torch.log, meta=R.float_meta, monotone="min")
sqrt = _unary("sqrt", torch.sqrt, meta=R.float_meta, monotone="min", save_outputs=True, grad_reads=())
rsqrt = _unary("rsqrt", torch.rsqrt, meta=R.float_meta, save_outputs=True, grad_reads=())
abs_ = _unary("abs", torch.abs)
tanh = _unary("tanh", torch.tanh, meta=R.float_meta, monotone=True, save_outputs=True)
sigmoid = _unary("sigmoid", torch.sigmoid, meta=R.float_meta, monotone=True, save_outputs=True)
relu = _unary("relu", torch.relu, monotone=True, save_outputs=True)
silu = _unary("silu", TF.silu)
sign = _unary("sign", torch.sign)


@op("gelu", meta=R.same_meta, sbp=_unary_sigs())
def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return TF.gelu(x, approximate=approximate)


def _cast_sigs(x: Meta, outs: tuple[Meta, ...], dtype: torch.dtype) -> list[Any]:
    partial: list[tuple[Any, ...]] = []
    if R.cast_is_linear(x.dtype, dtype):
        partial.append((PSUM, PSUM))
    if R.cast_keeps_order(x.dtype, dtype):
        partial += [(PMAX, PMAX), (PMIN, PMIN)]
    return R.elementwise_sigs((x,), outs[0], partial)


@op("cast", meta=lambda x, dtype: Meta(x.shape, dtype), sbp=_cast_sigs, grad_reads=())
def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``; partial inputs pass only where the cast commutes with their reduction (see above)."""
    return x.to(dtype)


def _comm_cast_sigs(x: Meta, outs: tuple[Meta, ...], dtype: torch.dtype) -> list[Any]:
    return R.elementwise_sigs((x,), outs[0], [(PSUM, PSUM)])


@op("comm_cast", meta=lambda x, dtype: Meta(x.shape, dtype), sbp=_comm_cast_sigs)
def comm_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``cast`` that passes ``P(sum)`` on purpose: each rank rounds its own piece, so the reduction after it runs
    in the narrow dtype (bf16 gradient communication, sbpflow.amp.gradient_communication). The sum of rounded
    pieces differs from the rounded sum by a few ulps of the narrow dtype: an accuracy-for-bandwidth trade the
    caller opts into, which ``cast`` never makes silently."""
    return x.to(dtype)


@comm_cast.grad
def _comm_cast_grad(ctx: Any, dy: Any) -> Any:
    return (comm_cast(dy, dtype=ctx.inputs[0].dtype),)


@neg.grad
def _neg_grad(ctx: Any, dy: Any) -> Any:
    return (-dy,)


@exp.grad
def _exp_grad(ctx: Any, dy: Any) -> Any:
    return (dy * ctx.outputs[0],)


@log.grad
def _log_grad(ctx: Any, dy: Any) -> Any:
    return (dy / ctx.inputs[0],)


@sqrt.grad
def _sqrt_grad(ctx: Any, dy: Any) -> Any:
    return (dy / (2 * ctx.outputs[0]),)


@rsqrt.grad
def _rsqrt_grad(ctx: Any, dy: Any) -> Any:
    y = ctx.outputs[0]
    return (dy * y * y * y * -0.5,)


@abs_.grad
def _abs_grad(ctx: Any, dy: Any) -> Any:
    return (dy * sign(ctx.inputs[0]),)


@tanh.grad
def _tanh_grad(ctx: Any, dy: Any) -> Any:
    y = ctx.outputs[0]
    return (dy * (1 - y * y),)


@sigmoid.grad
def _sigmoid_grad(ctx: Any, dy: Any) -> Any:
    y = ctx.outputs[0]
    return (dy * y * (1 - y),)


@relu.grad
def _relu_grad(ctx: Any, dy: Any) -> Any:
    return (relu_backward(dy, ctx.outputs[0]),)


@op("relu_backward", meta=lambda dy, y: dy, differentiable=False,
    sbp=lambda dy, y, outs: R.elementwise_sigs((dy, y), outs[0], [(PSUM, B, PSUM)]))
def relu_backward(dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``dy`` where the relu output ``y`` is positive, else 0: one kernel instead of gt + where (linear in dy)."""
    return torch.ops.aten.threshold_backward(dy, y, 0)


@silu.grad
def _silu_grad(ctx: Any, dy: Any) -> Any:
    return (silu_backward(dy, ctx.inputs[0]),)


@op("silu_backward", meta=R.elementwise_meta, differentiable=False,
    sbp=lambda dy, x, outs: R.elementwise_sigs((dy, x), outs[0], [(PSUM, B, PSUM)]))
def silu_backward(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``dy * s * (1 + x * (1 - s))`` with ``s = sigmoid(x)``: torch's one kernel instead of six (linear in dy)."""
    return torch.ops.aten.silu_backward(dy, x)


@gelu.grad
def _gelu_grad(ctx: Any, dy: Any) -> Any:
    return (gelu_backward(dy, ctx.inputs[0], approximate=ctx.attrs.get("approximate", "none")),)


@op("gelu_backward", meta=R.elementwise_meta, sbp=lambda dy, x, outs, **_: R.elementwise_sigs((dy, x), outs[0]),
    differentiable=False)
def gelu_backward(dy: torch.Tensor, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return torch.ops.aten.gelu_backward(dy, x, approximate=approximate)


@cast.grad
def _cast_grad(ctx: Any, dy: Any) -> Any:
    return (cast(dy, dtype=ctx.inputs[0].dtype),)


@sign.grad
def _sign_grad(ctx: Any, dy: Any) -> Any:
    return (dy * 0.0,)


# -- binary -----------------------------------------------------------------------------------


def _binary_sigs(kind: str):  # type: ignore[no-untyped-def]
    """``kind``: "add" (P+P), "mul" (P*B, B*P), "div" (P/B), "rsub"... or "" (none)."""

    def sigs(*args: Any, outs: tuple[Meta, ...], **_: Any) -> list:  # type: ignore[type-arg]
        n = _n_tensors(args)
        partial: list[tuple[Any, ...]] = []
        # No P(max)/P(min) + B: max(a, c) + b = max(a + b, c + b) fails for an infinite b, as a losing piece may be
        # -inf (an empty shard's) and -inf + inf is NaN, which then wins the max.
        if n == 2 and kind in ("add", "sub"):
            partial.append((PSUM, PSUM, PSUM))
        elif n == 2 and kind == "mul":
            partial += [(PSUM, B, PSUM), (B, PSUM, PSUM)]
        elif n == 2 and kind == "div":
            partial.append((PSUM, B, PSUM))
        elif n == 1 and kind in ("mul", "div"):
            partial.append((PSUM, PSUM))
        return R.elementwise_sigs(args, outs[0], partial)

    return sigs


def _binary(name: str, fn: Any, kind: str = "", meta: Any = R.elementwise_meta,
            grad_reads: tuple[int, ...] | None = None) -> Any:
    return op(name, meta=meta, sbp=_binary_sigs(kind), grad_reads=grad_reads)(fn)


add = _binary("add", torch.add, "add", grad_reads=())  # the residual branch's output is freed once added
sub = _binary("sub", torch.sub, "sub", grad_reads=())
mul = _binary("mul", torch.mul, "mul")
div = _binary("div", torch.div, "div", meta=R.float_meta)
pow_ = _binary("pow", torch.pow)
maximum = _binary("maximum", torch.maximum)
minimum = _binary("minimum", torch.minimum)
rsub = _binary("rsub", lambda x, s: s - x)
rdiv = _binary("rdiv", lambda x, s: s / x, meta=R.float_meta)
rpow = _binary("rpow", lambda x, s: torch.pow(s, x), meta=R.float_meta)

eq = op("eq", meta=R.bool_meta, sbp=_binary_sigs(""), differentiable=False)(torch.eq)
ne = op("ne", meta=R.bool_meta, sbp=_binary_sigs(""), differentiable=False)(torch.ne)
lt = op("lt", meta=R.bool_meta, sbp=_binary_sigs(""), differentiable=False)(torch.lt)
le = op("le", meta=R.bool_meta, sbp=_binary_sigs(""), differentiable=False)(torch.le)
gt = op("gt", meta=R.bool_meta, sbp=_binary_sigs(""), differentiable=False)(torch.gt)
ge = op("ge", meta=R.bool_meta, sbp=_binary_sigs(""), differentiable=False)(torch.ge)
logical_not = op("logical_not", meta=lambda x: Meta(x.shape, torch.bool), sbp=_unary_sigs(),
                 differentiable=False)(torch.logical_not)


def _where_meta(c: Meta, a: Any, b: Any) -> Meta:
    shape = R.broadcast_shapes(*(m.shape for m in R.metas((c, a, b))))
    return Meta(shape, R.result_type(a, b))


@op("where", meta=_where_meta, sbp=lambda *args, outs, **_: R.elementwise_sigs(args, outs[0]))
def where(c: torch.Tensor, a: Any, b: Any) -> torch.Tensor:
    return torch.where(c, a, b)


def _clamp_meta(x: Meta, lo: Any, hi: Any) -> Meta:
    return x


def _clamp_sigs(x: Meta, lo: Any, hi: Any, outs: tuple[Meta, ...]) -> list[Any]:
    return R.elementwise_sigs((x,), outs[0], [(PMAX, PMAX), (PMIN, PMIN)])  # clamp is monotone


@op("clamp", meta=_clamp_meta, sbp=_clamp_sigs)
def clamp(x: torch.Tensor, lo: Any, hi: Any) -> torch.Tensor:
    return torch.clamp(x, lo, hi)


def _grad_pair(ctx: Any) -> tuple[Any, Any, Any]:
    a, b = ctx.args
    return a, b, ctx.needs_input_grad


@clamp.grad
def _clamp_grad(ctx: Any, dy: Any) -> Any:
    x, lo, hi = ctx.args
    keep = x == x
    if lo is not None:
        keep = keep & ge(x, lo)
    if hi is not None:
        keep = keep & le(x, hi)
    return (where(keep, dy, 0.0),)


logical_and = op("logical_and", meta=R.bool_meta, sbp=_binary_sigs(""), differentiable=False)(torch.logical_and)
logical_or = op("logical_or", meta=R.bool_meta, sbp=_binary_sigs(""), differentiable=False)(torch.logical_or)


floor = _unary("floor", torch.floor, monotone=True)
ceil = _unary("ceil", torch.ceil, monotone=True)
round_ = _unary("round", torch.round, monotone=True)


@floor.grad
def _floor_grad(ctx: Any, dy: Any) -> Any:
    return (dy * 0.0,)


ceil.grad(_floor_grad)
round_.grad(_floor_grad)


# -- identity, trigonometric, erf, tests for nan/inf ------------------------------------------


@op("clone", meta=R.same_meta, sbp=_unary_sigs(monotone=True, linear=True))
def clone(x: torch.Tensor) -> torch.Tensor:
    """A copy in fresh memory: the identity, so every partial passes through it."""
    return x.clone(memory_format=torch.contiguous_format)


@op("contiguous", meta=R.same_meta, sbp=_unary_sigs(monotone=True, linear=True))
def contiguous(x: torch.Tensor) -> torch.Tensor:
    """A row-major copy; ``Tensor.contiguous`` calls it only when some shard is not row-major (as torch)."""
    return x.contiguous()


@clone.grad
def _clone_grad(ctx: Any, dy: Any) -> Any:
    return (dy,)


contiguous.grad(_clone_grad)

# sin and cos are neither linear nor monotone: a split passes, partial values are reduced first
sin = _unary("sin", torch.sin, meta=R.float_meta)
cos = _unary("cos", torch.cos, meta=R.float_meta)
# erf is increasing and defined everywhere (erf(-inf) = -1), so P(max)/P(min) pieces pass through it
erf = _unary("erf", torch.erf, meta=R.float_meta, monotone=True)


@sin.grad
def _sin_grad(ctx: Any, dy: Any) -> Any:
    return (dy * cos(ctx.inputs[0]),)


@cos.grad
def _cos_grad(ctx: Any, dy: Any) -> Any:
    return (-dy * sin(ctx.inputs[0]),)


@erf.grad
def _erf_grad(ctx: Any, dy: Any) -> Any:
    x = ctx.inputs[0]
    return (dy * exp(-(x * x)) * (2.0 / math.sqrt(math.pi)),)


def _bool_like(x: Meta) -> Meta:
    return Meta(x.shape, torch.bool)


# A partial's pieces say nothing about whether the reduced value is nan or finite: no partial rules.
isnan = op("isnan", meta=_bool_like, sbp=_unary_sigs(), differentiable=False)(torch.isnan)
isfinite = op("isfinite", meta=_bool_like, sbp=_unary_sigs(), differentiable=False)(torch.isfinite)


# -- masked_fill ------------------------------------------------------------------------------


def _masked_fill_meta(x: Meta, mask: Meta, value: Any) -> Meta:
    if mask.dtype != torch.bool:
        raise R.DTypeError(f"masked_fill needs a bool mask, but got {str(mask.dtype).replace('torch.', '')}")
    shape = R.broadcast_shapes(x.shape, mask.shape)
    if shape != x.shape:
        raise R.ShapeError(f"masked_fill needs a mask that broadcasts to the input's shape {list(x.shape)}, but got "
                           f"mask shape {list(mask.shape)}")
    return x


def _masked_fill_sigs(x: Meta, mask: Meta, outs: tuple[Meta, ...], value: Any) -> list:  # type: ignore[type-arg]
    """Every piece of a partial gets ``value`` where the mask is set: max/min of equal values is that value, and
    a sum of zeros is zero, so P(max)/P(min) pass always and P(sum) only when filling with 0."""
    partial = [(PMAX, B, PMAX), (PMIN, B, PMIN)]
    if value == 0:
        partial.append((PSUM, B, PSUM))
    return R.elementwise_sigs((x, mask), outs[0], partial)


@op("masked_fill", meta=_masked_fill_meta, sbp=_masked_fill_sigs)
def masked_fill(x: torch.Tensor, mask: torch.Tensor, value: Any) -> torch.Tensor:
    """``x`` with ``value`` where ``mask`` is set; ``value`` is a static attribute (the P(sum) rule reads it)."""
    return x.masked_fill(mask, value)


@masked_fill.grad
def _masked_fill_grad(ctx: Any, dy: Any) -> Any:
    return masked_fill(dy, ctx.inputs[1], value=0.0), None
