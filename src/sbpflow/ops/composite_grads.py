"""Gradients written with the functional API's composites (``sum_to``, ``expand_reduced``, ``cast`` ...).

The composites are built from the op families, so these gradients register here, above every family, and an
op family's own file imports only the schema and the families below it (no late import of the functional API).
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ShapeError
from . import _rules as R
from . import elementwise as E
from . import functional as F
from . import matrix as M
from . import reduction as RD
from . import shape as SH

# -- elementwise: broadcast operands get their gradient summed back to their shape --------------------------------


def _per_tensor(ctx: Any, *grads: Any) -> tuple[Any, ...]:
    """Keeps the gradients of tensor arguments only, reduced to each input's shape."""
    sum_to = F.sum_to

    out = []
    for arg, g in zip(ctx.args, grads, strict=False):  # scalar args may have no gradient slot
        if hasattr(arg, "shape"):
            out.append(None if g is None else sum_to(g, tuple(arg.shape)))
    return tuple(out)


def _wanted(ctx: Any) -> tuple[bool, bool]:
    """Whether each of a binary op's two arguments wants a gradient (a scalar or a tensor that needs none does
    not): a gradient nobody takes costs a full-size kernel and often a reduction to a broadcast operand's shape
    (a rotary table, a norm's weight seen by a frozen copy)."""
    a, b = ctx.args
    needs = ctx.needs_input_grad
    want_a = hasattr(a, "shape") and needs[0]
    want_b = hasattr(b, "shape") and needs[-1]
    return want_a, want_b


@E.add.grad
def _add_grad(ctx: Any, dy: Any) -> Any:
    want_a, want_b = _wanted(ctx)
    return _per_tensor(ctx, dy if want_a else None, dy if want_b else None)


@E.sub.grad
def _sub_grad(ctx: Any, dy: Any) -> Any:
    want_a, want_b = _wanted(ctx)
    return _per_tensor(ctx, dy if want_a else None, -dy if want_b else None)


@E.mul.grad
def _mul_grad(ctx: Any, dy: Any) -> Any:
    a, b = ctx.args
    want_a, want_b = _wanted(ctx)
    return _per_tensor(ctx, dy * b if want_a else None, dy * a if want_b else None)


@E.div.grad
def _div_grad(ctx: Any, dy: Any) -> Any:
    a, b = ctx.args
    want_a, want_b = _wanted(ctx)
    ga = dy / b
    gb = -ga * a / b if want_b else None
    return _per_tensor(ctx, ga if want_a else None, gb)


@E.pow_.grad
def _pow_grad(ctx: Any, dy: Any) -> Any:
    a, b = ctx.args
    want_a, want_b = _wanted(ctx)
    ga = dy * b * a ** (b - 1) if want_a else None
    gb = dy * a**b * E.log(a) if want_b else None
    return _per_tensor(ctx, ga, gb)


@E.rsub.grad
def _rsub_grad(ctx: Any, dy: Any) -> Any:
    return (-dy,)


@E.rdiv.grad
def _rdiv_grad(ctx: Any, dy: Any) -> Any:
    x, s = ctx.args
    return (-dy * s / (x * x),)


@E.rpow.grad
def _rpow_grad(ctx: Any, dy: Any) -> Any:
    x, s = ctx.args
    return (dy * E.rpow(x, s) * math.log(s),)


def _select_grad(ctx: Any, dy: Any, take_a: Any) -> Any:
    return _per_tensor(ctx, E.where(take_a, dy, 0.0), E.where(take_a, 0.0, dy))


@E.maximum.grad
def _maximum_grad(ctx: Any, dy: Any) -> Any:
    a, b = ctx.args
    return _select_grad(ctx, dy, E.ge(a, b))


@E.minimum.grad
def _minimum_grad(ctx: Any, dy: Any) -> Any:
    a, b = ctx.args
    return _select_grad(ctx, dy, E.le(a, b))


@E.where.grad
def _where_grad(ctx: Any, dy: Any) -> Any:
    sum_to = F.sum_to

    c, a, b = ctx.args
    grads: list[Any] = [None]
    if hasattr(a, "shape"):
        grads.append(sum_to(E.where(c, dy, 0.0), tuple(a.shape)))
    if hasattr(b, "shape"):
        grads.append(sum_to(E.where(c, 0.0, dy), tuple(b.shape)))
    return tuple(grads)


# -- reductions: a reduced gradient broadcasts back over the reduced dims ----------------------------------------


def _expand_back(ctx: Any, g: Any) -> Any:
    """Broadcasts a reduced gradient back to the input's shape."""
    expand_reduced = F.expand_reduced

    return expand_reduced(g, tuple(ctx.inputs[0].shape), ctx.attrs.get("dim"), ctx.attrs.get("keepdim", False))


@RD.sum_.grad
def _sum_grad(ctx: Any, dy: Any) -> Any:
    cast = F.cast

    g = _expand_back(ctx, dy)
    return (cast(g, ctx.inputs[0].dtype) if g.dtype != ctx.inputs[0].dtype else g,)


@RD.mean.grad
def _mean_grad(ctx: Any, dy: Any) -> Any:
    x = ctx.inputs[0]
    count = 1
    for d in R.normalize_dims(ctx.attrs.get("dim"), x.ndim):
        count *= x.shape[d]
    return (_expand_back(ctx, dy) / count,)


def _minmax_grad(ctx: Any, dy: Any) -> Any:
    eq, sum = F.eq, F.sum

    x = ctx.inputs[0]
    y = _expand_back(ctx, ctx.outputs[0])
    mask = eq(x, y)
    count = sum(mask, dim=ctx.attrs.get("dim"), keepdim=ctx.attrs.get("keepdim", False), dtype=x.dtype)
    return (_expand_back(ctx, dy / count) * mask,)


RD.amax.grad(_minmax_grad)
RD.amin.grad(_minmax_grad)


@RD.cumsum.grad
def _cumsum_grad(ctx: Any, dy: Any) -> Any:
    cast = F.cast

    g = RD.cumsum(dy, dim=ctx.attrs["dim"], reverse=not ctx.attrs.get("reverse", False))
    return (cast(g, ctx.inputs[0].dtype),)


# -- matrix ---------------------------------------------------------------------------------------------------------


@M.matmul.grad
def _matmul_grad(ctx: Any, dy: Any) -> Any:
    sum_to, transpose = F.sum_to, F.transpose

    a, b = ctx.inputs
    da = sum_to(M.matmul(dy, transpose(b, -1, -2)), tuple(a.shape)) if ctx.needs_input_grad[0] else None
    db = sum_to(M.matmul(transpose(a, -1, -2), dy), tuple(b.shape)) if ctx.needs_input_grad[1] else None
    return da, db


@M.linear.grad
def _linear_grad(ctx: Any, dy: Any) -> Any:
    x, w = ctx.inputs[0], ctx.inputs[1]
    needs = ctx.needs_input_grad
    has_bias = len(ctx.inputs) == 3
    if M._one_place(dy):
        return M._fused_linear_grad(dy, x, w, needs, has_bias)
    dx = M.matmul_nd(dy, w) if needs[0] else None
    dw = M.linear_weight_grad(dy, x) if needs[1] else None
    grads = [dx, dw]
    if has_bias:
        grads.append(F.sum(dy, dim=tuple(range(dy.ndim - 1))) if needs[2] else None)
    return tuple(grads)


# -- shape ----------------------------------------------------------------------------------------------------------


@SH.expand.grad
def _expand_grad(ctx: Any, dy: Any) -> Any:
    sum_to = F.sum_to

    return (sum_to(dy, tuple(ctx.inputs[0].shape)),)


# -- einsum: each operand's gradient is an einsum of dy with the others ----------------------------------------


@M.einsum_.grad
def _einsum_grad(ctx: Any, dy: Any) -> Any:
    """Operand i's gradient is the einsum of dy with the other operands, onto i's subscripts; letters that only i
    has (summed out of the forward) come back as an expansion."""
    metas = tuple(M.Meta(tuple(t.shape), t.dtype) for t in ctx.inputs)
    subs, out = M._einsum_parse(ctx.attrs["equation"], metas)
    grads = []
    for i, (s, x) in enumerate(zip(subs, ctx.inputs, strict=True)):
        if len(set(s)) != len(s):
            raise ShapeError(f"einsum {ctx.attrs['equation']!r}: no gradient for an operand with a repeated "
                             f"subscript ({s!r})")
        others = [(sub, t) for j, (sub, t) in enumerate(zip(subs, ctx.inputs, strict=True)) if j != i]
        seen = set(out).union(*(set(sub) for sub, _ in others))
        kept = "".join(c for c in s if c in seen)
        g = M.einsum_(dy, *(t for _, t in others), equation=",".join([out] + [sub for sub, _ in others]) + "->" + kept)
        for d, c in enumerate(s):
            if c not in seen:
                g = F.unsqueeze(g, d)
        wider = tuple(d for d, (a, b) in enumerate(zip(g.shape, x.shape, strict=True)) if a > b)  # x broadcast
        if wider:
            g = F.sum(g, dim=wider, keepdim=True)
        grads.append(F.expand(g, tuple(x.shape)) if tuple(g.shape) != tuple(x.shape) else g)
    return tuple(grads)
