"""matmul / bmm, linear and einsum, with Megatron's column and row parallelism as signatures (table at the rules).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.nn.functional as TF

from ..errors import ShapeError
from ..sbp import Partial, Split, broadcast
from . import _rules as R
from .schema import Meta, ShardCtx, Sig, op

PSUM = Partial("sum")
B = broadcast


def _matmul_meta(a: Meta, b: Meta) -> Meta:
    if a.ndim < 2 or b.ndim < 2:
        raise ShapeError("the matmul op takes tensors of at least 2 dims (functional.matmul handles 1-D ones)")
    R.check_dtypes_equal("matmul", a, b)
    if a.shape[-1] != b.shape[-2]:
        raise ShapeError(
            "matmul needs a's last dim to equal b's second-to-last dim, "
            f"but got a {list(a.shape)} and b {list(b.shape)}"
        )
    batch = R.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return Meta(batch + (a.shape[-2], b.shape[-1]), a.dtype)


def _batch_dim(m: Meta, out_ndim: int, d: int, out: Meta) -> Any:
    k = d - (out_ndim - m.ndim)
    return Split(k) if k >= 0 and m.shape[k] == out.shape[d] else B


# Signatures (2-D view; batch dims may be split on both sides, or on the side that has them):
#
#   a       b       out
#   S(m)    B       S(m)        rows of a
#   B       S(n)    S(n)        columns of b
#   S(k)    S(k)    P(sum)      the contraction dim
#   P(sum)  B       P(sum)      linear in a
#   B       P(sum)  P(sum)      linear in b
#   B       B       B
def _matmul_sigs(a: Meta, b: Meta, outs: tuple[Meta, ...]) -> list[Sig]:
    out = outs[0]
    n = out.ndim
    sigs = [
        Sig((B, B), (B,)),
        Sig((Split(a.ndim - 2), B), (Split(n - 2),)),
        Sig((B, Split(b.ndim - 1)), (Split(n - 1),)),
        Sig((Split(a.ndim - 1), Split(b.ndim - 2)), (PSUM,)),
        Sig((PSUM, B), (PSUM,)),
        Sig((B, PSUM), (PSUM,)),
    ]
    for d in range(n - 2):
        sa, sb = _batch_dim(a, n, d, out), _batch_dim(b, n, d, out)
        if isinstance(sa, Split) or isinstance(sb, Split):
            sigs.append(Sig((sa, sb), (Split(d),)))
    return sigs


@op("matmul", meta=_matmul_meta, sbp=_matmul_sigs)
def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


# -- linear -------------------------------------------------------------------------------------


def _linear_meta(x: Meta, w: Meta, b: Any = None) -> Meta:
    if w.ndim != 2 or x.ndim < 1:
        raise ShapeError(f"linear needs weight of shape (out, in) and input (..., in), but got x {list(x.shape)}, "
                         f"weight {list(w.shape)}")
    if x.shape[-1] != w.shape[1]:
        raise ShapeError(f"linear needs input's last dim {x.shape[-1]} to equal weight's in-features {w.shape[1]} "
                         f"(x {list(x.shape)}, weight {list(w.shape)})")
    R.check_dtypes_equal("linear", x, w, *([b] if isinstance(b, Meta) else []))
    if isinstance(b, Meta) and tuple(b.shape) != (w.shape[0],):
        raise ShapeError(f"linear needs bias of shape [{w.shape[0]}], but got {list(b.shape)}")
    return Meta(x.shape[:-1] + (w.shape[0],), x.dtype)


# linear(x, w, b) uses torch's layout w: (out, in). Column-parallel is w S(0) (output S(-1)); row-parallel is
# x S(-1) with w S(1) (output P(sum), the bias added by one rank only).
def _linear_sigs(x: Meta, w: Meta, b: Any = None, *, outs: tuple[Meta, ...]) -> list[Sig]:
    has_bias = isinstance(b, Meta)
    last = x.ndim - 1

    def sig(xs: Any, ws: Any, bs: Any, out: Any) -> Sig:
        return Sig((xs, ws, bs) if has_bias else (xs, ws), (out,))

    sigs = [
        sig(B, B, B, B),
        sig(B, Split(0), Split(0), Split(last)),  # column parallel
        sig(Split(last), Split(1), PSUM, PSUM),  # row parallel: the bias counted once
        sig(PSUM, B, PSUM, PSUM),
    ]
    for d in range(last):
        sigs.append(sig(Split(d), B, B, Split(d)))
    return sigs


@op("linear", meta=_linear_meta, sbp=_linear_sigs)
def linear(x: torch.Tensor, w: torch.Tensor, b: Any = None) -> torch.Tensor:
    return TF.linear(x, w, b)





def _one_place(dy: Any) -> bool:
    """Whether the gradient lives in one place: a local tensor, or a global one on a single rank. There the fused
    :func:`linear_backward` boxes nothing, as the three ops would not. Elsewhere the three ops keep their own
    signature choices (and collectives), and a traced graph keeps its weight-gradient nodes apart (the pipeline
    schedules them on their own)."""
    if dy._local is not None:
        return True
    return dy._lazy is None and dy._placement is not None and dy._placement.size == 1


def _fused_linear_grad(dy: Any, x: Any, w: Any, needs: tuple[bool, ...], has_bias: bool) -> tuple[Any, ...]:
    wanted = (needs[0], needs[1], has_bias and needs[2])
    parts = tuple(p for p, want in zip(_PARTS, wanted, strict=True) if want)
    grads: list[Any] = [None, None, None]
    if parts:
        operands = [t for p, t in (("dx", w), ("dw", x)) if p in parts]
        outs = linear_backward(dy, *operands, parts=parts)
        for p, g in zip(parts, outs if len(parts) > 1 else (outs,), strict=True):
            grads[_PARTS.index(p)] = g
    return tuple(grads) if has_bias else tuple(grads[:2])


def _nd_meta(dy: Meta, w: Meta) -> Meta:
    return Meta(dy.shape[:-1] + (w.shape[1],), dy.dtype)


def _nd_sigs(dy: Meta, w: Meta, outs: tuple[Meta, ...]) -> list[Sig]:
    last = dy.ndim - 1
    sigs = [Sig((B, B), (B,)), Sig((Split(last), Split(0)), (PSUM,)), Sig((B, Split(1)), (Split(last),)),
            Sig((PSUM, B), (PSUM,)), Sig((B, PSUM), (PSUM,))]
    sigs += [Sig((Split(d), B), (Split(d),)) for d in range(last)]
    return sigs


@op("matmul_nd", meta=_nd_meta, sbp=_nd_sigs)
def matmul_nd(dy: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``dy (..., out) @ w (out, in) -> (..., in)``: the input gradient of linear."""
    return torch.matmul(dy, w)


@matmul_nd.grad
def _matmul_nd_grad(ctx: Any, g: Any) -> Any:
    dy, w = ctx.inputs
    d_dy = linear(g, w) if ctx.needs_input_grad[0] else None
    d_w = linear_weight_grad(dy, g) if ctx.needs_input_grad[1] else None
    return d_dy, d_w


def _wgrad_meta(dy: Meta, x: Meta) -> Meta:
    return Meta((dy.shape[-1], x.shape[-1]), dy.dtype)


def _wgrad_sigs(dy: Meta, x: Meta, outs: tuple[Meta, ...]) -> list[Sig]:
    last = dy.ndim - 1
    sigs = [Sig((B, B), (B,)), Sig((Split(last), B), (Split(0),)), Sig((B, Split(last)), (Split(1),)),
            Sig((PSUM, B), (PSUM,)), Sig((B, PSUM), (PSUM,))]
    sigs += [Sig((Split(d), Split(d)), (PSUM,)) for d in range(last)]
    return sigs


@op("linear_weight_grad", meta=_wgrad_meta, sbp=_wgrad_sigs)
def linear_weight_grad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``sum over batch dims of dy^T x``: (out, in), the weight gradient of linear."""
    return torch.matmul(_rows(dy).t(), _rows(x))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(N, last): the batch dims merged; an empty shard too (reshape(-1, 0) cannot tell N from 0 elements)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


@linear_weight_grad.grad
def _wgrad_grad(ctx: Any, g: Any) -> Any:
    dy, x = ctx.inputs
    return (linear(x, g) if ctx.needs_input_grad[0] else None, matmul_nd(dy, g) if ctx.needs_input_grad[1] else None)


# -- linear's whole gradient in one op ------------------------------------------------------------------------------
#
# dx = dy @ w, dw = sum over batch dims of dy^T x, db = sum over batch dims of dy: one dispatch instead of three for
# each linear of a backward pass. ``parts`` names the gradients wanted, in this order; the tensor inputs are dy,
# then w if dx is wanted, then x if dw is. Its signatures are those of matmul_nd, linear_weight_grad and the bias
# sum that agree on dy's SBP (each output as its own op would have it).

_PARTS = ("dx", "dw", "db")


def _parts_inputs(dy: Any, rest: tuple[Any, ...], parts: tuple[str, ...]) -> tuple[Any, Any]:
    """(w, x) from the tensor inputs after dy, None where the part that reads it is not wanted."""
    w = rest[0] if "dx" in parts else None
    x = rest[1 if w is not None else 0] if "dw" in parts else None
    return w, x


def _linear_backward_meta(dy: Meta, *rest: Meta, parts: tuple[str, ...]) -> tuple[Meta, ...]:
    if not parts or any(p not in _PARTS for p in parts) or list(parts) != sorted(parts, key=_PARTS.index):
        raise ShapeError(f"linear_backward needs parts from {list(_PARTS)} in that order, but got {list(parts)}")
    w, x = _parts_inputs(dy, rest, parts)
    metas = []
    if w is not None:
        metas.append(_nd_meta(dy, w))
    if x is not None:
        metas.append(_wgrad_meta(dy, x))
    if "db" in parts:
        metas.append(Meta((dy.shape[-1],), dy.dtype))
    return tuple(metas)


def _bias_sigs(dy: Meta) -> list[tuple[Any, Any]]:
    """(dy's SBP, db's SBP) of the bias gradient, a sum over every dim but the last."""
    last = dy.ndim - 1
    return [(B, B), (Split(last), Split(0)), (PSUM, PSUM)] + [(Split(d), PSUM) for d in range(last)]


def _linear_backward_sigs(dy: Meta, *rest: Meta, outs: tuple[Meta, ...], parts: tuple[str, ...]) -> list[Sig]:
    w, x = _parts_inputs(dy, rest, parts)
    # each part: (dy's SBP, its other input's SBP or None, its output's SBP)
    per_part: list[list[tuple[Any, Any, Any]]] = []
    if w is not None:
        per_part.append([(s.ins[0], s.ins[1], s.outs[0]) for s in _nd_sigs(dy, w, outs=())])
    if x is not None:
        per_part.append([(s.ins[0], s.ins[1], s.outs[0]) for s in _wgrad_sigs(dy, x, outs=())])
    if "db" in parts:
        per_part.append([(d, None, o) for d, o in _bias_sigs(dy)])
    sigs: list[Sig] = []
    for combo in itertools.product(*per_part):
        if all(c[0] == combo[0][0] for c in combo):
            sig = Sig((combo[0][0],) + tuple(c[1] for c in combo if c[1] is not None), tuple(c[2] for c in combo))
            if sig not in sigs:
                sigs.append(sig)
    return sigs


@op("linear_backward", meta=_linear_backward_meta, sbp=_linear_backward_sigs, differentiable=False)
def linear_backward(dy: torch.Tensor, *rest: torch.Tensor, parts: tuple[str, ...]) -> Any:
    """The gradients of linear named in ``parts`` (see above), in that order (one tensor for one part)."""
    w, x = _parts_inputs(dy, rest, parts)
    outs = []
    if w is not None:
        outs.append(torch.matmul(dy, w))
    flat = _rows(dy)  # (N, out): the batch dims merged
    if x is not None:
        outs.append(torch.matmul(flat.t(), _rows(x)))
    if "db" in parts:
        outs.append(flat.sum(0))
    return tuple(outs) if len(outs) > 1 else outs[0]


del ShardCtx


# -- einsum --------------------------------------------------------------------------------------------------------
#
# The signatures come from the subscripts, one letter at a time (ellipses are written out as letters first):
#
#     a letter kept in the output      every operand that has it S(its place)  ->  S(its place in the output)
#     a letter summed over             every operand that has it S(its place)  ->  P(sum)
#     linear in each operand           that operand P(sum), the others B       ->  P(sum)
#
# A letter that repeats inside one operand (a diagonal, "ii->i") or that some operand broadcasts (size 1) is not
# split.


def _einsum_parse(equation: str, metas: tuple[Meta, ...]) -> tuple[list[str], str]:
    """The subscripts of each operand and of the output, ellipses replaced by capital letters."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    subs = lhs.split(",")
    if len(subs) != len(metas):
        raise ShapeError(f"einsum {equation!r} names {len(subs)} operand(s), but got {len(metas)}")
    spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq]
    widest = max((m.ndim - len(s.replace("...", "")) for s, m in zip(subs, metas, strict=True) if "..." in s),
                 default=0)
    ell = "".join(spare[:widest])
    subs = [s.replace("...", ell[widest - (m.ndim - len(s.replace("...", ""))):]) if "..." in s else s
            for s, m in zip(subs, metas, strict=True)]
    for s, m in zip(subs, metas, strict=True):
        if len(s) != m.ndim or (s and not s.isalpha()):
            raise ShapeError(f"einsum {equation!r}: subscripts {s!r} do not fit an operand of shape {list(m.shape)}")
    if arrow:
        out = rhs.replace("...", ell)
    else:
        letters = "".join(subs)
        out = ell + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in ell))
    return subs, out


def _einsum_sizes(equation: str, subs: list[str], metas: tuple[Meta, ...]) -> dict[str, set[int]]:
    sizes: dict[str, set[int]] = {}
    for s, m in zip(subs, metas, strict=True):
        for c, n in zip(s, m.shape, strict=True):
            sizes.setdefault(c, set()).add(n)
    return sizes


def _einsum_meta(*metas: Meta, equation: str) -> Meta:
    subs, out = _einsum_parse(equation, metas)
    sizes = _einsum_sizes(equation, subs, metas)
    for c, ns in sizes.items():
        if len(ns - {1}) > 1:
            raise ShapeError(f"einsum {equation!r}: subscript {c!r} has sizes {sorted(ns)} in operands of shapes "
                             f"{[list(m.shape) for m in metas]}")
    missing = [c for c in out if c not in sizes]
    if missing:
        raise ShapeError(f"einsum {equation!r}: output subscript {missing[0]!r} names no operand's dim")
    R.check_dtypes_equal("einsum", *metas)
    return Meta(tuple(max(sizes[c]) for c in out), metas[0].dtype)


def _einsum_sigs(*metas: Meta, outs: tuple[Meta, ...], equation: str) -> list[Sig]:
    subs, out = _einsum_parse(equation, metas)
    sizes = _einsum_sizes(equation, subs, metas)
    n = len(metas)
    sigs = [Sig((broadcast,) * n, (broadcast,))]
    for c, ns in sizes.items():
        if len(ns) > 1 or any(s.count(c) > 1 for s in subs) or out.count(c) > 1:
            continue
        ins = tuple(Split(s.index(c)) if c in s else broadcast for s in subs)
        sigs.append(Sig(ins, (Split(out.index(c)) if c in out else Partial("sum"),)))
    for i in range(n):
        sigs.append(Sig(tuple(Partial("sum") if j == i else broadcast for j in range(n)), (Partial("sum"),)))
    return sigs


@op("einsum", meta=_einsum_meta, sbp=_einsum_sigs)
def einsum_(*operands: torch.Tensor, equation: str) -> torch.Tensor:
    return torch.einsum(equation, *operands)
