"""Shared meta and SBP rule builders used by the op families."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import DTypeError, IndexOutOfRangeError, ShapeError
from ..sbp import Partial, SbpParallel, Split, broadcast
from .schema import Meta, Scalar, Sig


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """NumPy broadcasting of shapes, with an error that names them."""
    ndim = max(len(s) for s in shapes)
    out = []
    for d in range(ndim):
        sizes = {s[d - ndim + len(s)] for s in shapes if d - ndim + len(s) >= 0} - {1}
        if len(sizes) > 1:
            listed = [list(s) for s in shapes]
            raise ShapeError(f"shapes {listed} are not broadcastable (dim {d} has sizes {sorted(sizes)})")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _probe(a: Any) -> Any:
    if isinstance(a, Meta):
        return torch.empty((0,) if a.shape else (), dtype=a.dtype)
    return {bool: True, int: 1, float: 1.0, complex: 1j}.get(a.type, 1.0)


def result_type(*args: Any) -> torch.dtype:
    """torch's type promotion for tensor metas and scalar types (0-dim tensors rank below n-dim ones)."""
    probes = [_probe(a) for a in args]
    out = probes[0] if isinstance(probes[0], torch.Tensor) else torch.tensor(probes[0])
    for p in probes[1:]:
        out = torch.empty((0,) if out.dim() or (isinstance(p, torch.Tensor) and p.dim()) else (),
                          dtype=torch.result_type(out, p))
    return out.dtype


def metas(args: Sequence[Any]) -> list[Meta]:
    return [a for a in args if isinstance(a, Meta)]


def elementwise_meta(*args: Any, dtype: torch.dtype | None = None, **_: Any) -> Meta:
    shape = broadcast_shapes(*(m.shape for m in metas(args)))
    return Meta(shape, dtype if dtype is not None else result_type(*args))


def float_meta(*args: Any, **kw: Any) -> Meta:
    m = elementwise_meta(*args, **kw)
    if not m.dtype.is_floating_point:
        m = Meta(m.shape, torch.get_default_dtype())
    return m


def bool_meta(*args: Any, **_: Any) -> Meta:
    return Meta(broadcast_shapes(*(m.shape for m in metas(args))), torch.bool)


def same_meta(x: Meta, *_: Any, **__: Any) -> Meta:
    return x


def elementwise_sigs(args: Sequence[Any], out: Meta, partial: Sequence[tuple[Any, ...]] = ()) -> list[Sig]:
    """Split signatures for every output dim (inputs broadcast along a dim stay B), then B, then ``partial``.

    ``partial`` lists extra patterns: tuples with one SBP per tensor input followed by the output SBP.
    """
    ms = metas(args)
    sigs = [Sig(tuple(broadcast for _ in ms), (broadcast,))]
    for d in range(len(out.shape)):
        ins: list[SbpParallel] = []
        for m in ms:
            k = d - (len(out.shape) - len(m.shape))
            ins.append(Split(k) if k >= 0 and m.shape[k] == out.shape[d] else broadcast)
        if any(isinstance(s, Split) for s in ins):
            sigs.append(Sig(tuple(ins), (Split(d),)))
    for pattern in partial:
        sigs.append(Sig(tuple(pattern[:-1]), (pattern[-1],)))
    return sigs


def cast_is_linear(src: torch.dtype, dst: torch.dtype) -> bool:
    """A cast commutes with a sum only from a float to a wider float: each piece is then exact in the target.

    Casting each piece of a P(sum) to a narrower float, an int or bool rounds every piece on its own:
    ``long()`` of pieces 0.6 and 0.6 gives 0, where the logical 1.2 gives 1.
    """
    return src.is_floating_point and dst.is_floating_point and torch.finfo(dst).bits > torch.finfo(src).bits and (
        torch.finfo(dst).eps <= torch.finfo(src).eps)


def cast_keeps_order(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether the cast is non-decreasing on every value a P(max)/P(min) piece can hold (±inf of empty shards too).

    Float to float rounds monotonically and keeps ±inf; an int to a type holding its whole range is exact; bool
    (False < True) maps to 0 < 1. Casting to bool is not monotone (-1 -> True), float to int is undefined for
    ±inf and NaN, and a narrower int wraps around.
    """
    if dst == torch.bool:
        return src == torch.bool
    if src == torch.bool or src.is_complex or dst.is_complex:
        return src == torch.bool and not dst.is_complex
    if src.is_floating_point:
        return dst.is_floating_point
    if dst.is_floating_point:
        return True
    lo, hi = torch.iinfo(src), torch.iinfo(dst)
    return hi.min <= lo.min and lo.max <= hi.max


def check_dtypes_equal(op: str, *ms: Meta) -> None:
    dtypes = {m.dtype for m in ms}
    if len(dtypes) > 1:
        raise DTypeError(f"{op} needs inputs of one dtype, but got {[str(m.dtype).replace('torch.', '') for m in ms]}")


def normalize_dim(dim: int, ndim: int, what: str = "dim") -> int:
    lo, hi = (-ndim, ndim - 1) if ndim else (-1, 0)
    if not lo <= dim <= hi:
        raise IndexOutOfRangeError(
            f"{what} {dim} is out of range for a tensor with {ndim} dim(s) (expected {lo}..{hi})")
    return dim % ndim if ndim else 0


def normalize_dims(dims: Any, ndim: int) -> tuple[int, ...]:
    if dims is None:
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = (dims,)
    out = tuple(sorted({normalize_dim(d, ndim) for d in dims}))
    return out


def psum() -> Partial:
    return Partial("sum")


def is_scalar(a: Any) -> bool:
    return isinstance(a, Scalar)
