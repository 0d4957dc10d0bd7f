"""Normalization and activation-over-dims ops: softmax, log_softmax, layer_norm, rms_norm, batch_norm, dropout.

A split along the normalized dim is met with partial statistics (or boxing x to B, whichever costs less),
reduced so that backward never moves an input-sized tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import boxing
from .. import random as sbp_random
from ..autograd import is_grad_enabled, no_grad
from ..errors import DTypeError, LocalGlobalError, OpError, ShapeError
from ..sbp import NdSbp, Partial, Split, broadcast
from ..tensor import Tensor
from . import _rules as R
from . import elementwise as E
from . import reduction as RD
from . import shape as SH
from .convert import to_global
from .dispatch import record
from .schema import Meta, OpDef, ShardCtx, Sig, op

B = broadcast
PSUM = Partial("sum")

__all__ = ["batch_norm", "dropout", "layer_norm", "log_softmax", "rms_norm", "softmax"]


# -- reducing partial statistics ---------------------------------------------------------------

# How each op meets a split along the dim it normalizes over:
#
#   op             split on a batch/other dim           split on the normalized dim
#   softmax        fused kernel, no comm                 amax -> P(max) -> all-reduce, sum -> P(sum) -> all-reduce,
#   log_softmax                                          or box x to B first: whichever the boxing cost model prefers
#   layer_norm     fused kernel, no comm; weight         mean -> P(sum) -> all-reduce (twice: mean, then variance);
#   rms_norm       and bias grads come out P(sum)        weight and bias split like the normalized dim
#   batch_norm     statistics over the split batch dim are P(sum) and reduced by boxing (synchronized BN)
#   dropout        any split, B or P(sum): the mask is a function of (key, logical shape, shard box) only
_reduce_partials_def = OpDef("reduce_partials", kernel=lambda *a: None, meta=lambda *a: None, sbp=lambda *a: [],
                             shard_aware=False, save_outputs=False, differentiable=True, mesh_aware=False)


def _reduce_partials(t: Tensor) -> Tensor:
    """Boxes every partial mesh axis of ``t`` to B (an all-reduce of a small statistic).

    Unlike ``to_global``, whose gradient boxes back to the partial layout (so a
    B -> P zeroing would spread a partial gradient into input-sized tensors),
    the gradient here is reduced the same way: the logical gradient of a
    partial tensor may live in any layout, and B is the one later ops want.
    """
    if not t.is_global:
        return t
    target = tuple(B if isinstance(s, Partial) else s for s in t.sbp)
    if target == t.sbp:
        return t
    with no_grad():
        out = to_global(t, t.placement, target)
    if is_grad_enabled() and t.requires_grad:
        record(_reduce_partials_def, (t,), {}, (out,))
    return out


@_reduce_partials_def.grad
def _reduce_partials_grad(ctx: Any, dy: Tensor) -> Any:
    return (_reduce_partials(dy),)


def _split_axes(x: Tensor, dims: Sequence[int]) -> list[int]:
    """Mesh axes (of more than one rank) that split ``x`` along one of ``dims``."""
    if not x.is_global:
        return []
    sizes = x.placement.hierarchy
    return [a for a, s in enumerate(x.sbp) if isinstance(s, Split) and s.dim in dims and sizes[a] > 1]


def _has_partial(x: Tensor) -> bool:
    return x.is_global and any(isinstance(s, Partial) for s in x.sbp)


def _replace_axes(sbp: NdSbp, axes: Sequence[int], value: Any) -> NdSbp:
    return tuple(value if a in axes else s for a, s in enumerate(sbp))


# -- softmax and log_softmax -------------------------------------------------------------------


def _softmax_meta(x: Meta, dim: int) -> Meta:
    R.normalize_dim(dim, max(x.ndim, 1))
    if not x.dtype.is_floating_point:
        raise DTypeError(f"softmax needs a floating-point input, but got {str(x.dtype).replace('torch.', '')}")
    return x


def _rowwise_sigs(x: Meta, outs: tuple[Meta, ...], dim: int, **_: Any) -> list[Sig]:
    """Split on any dim except the one the row op runs along."""
    d = R.normalize_dim(dim, max(x.ndim, 1))
    return [Sig((B,), (B,))] + [Sig((Split(k),), (Split(k),)) for k in range(x.ndim) if k != d]


@op("softmax", meta=_softmax_meta, sbp=_rowwise_sigs, save_outputs=True, grad_reads=())
def _softmax_fused(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.softmax(x, dim)


@op("log_softmax", meta=_softmax_meta, sbp=_rowwise_sigs, save_outputs=True, grad_reads=())  # logits freed
def _log_softmax_fused(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.log_softmax(x, dim)


@_softmax_fused.grad
def _softmax_grad(ctx: Any, dy: Any) -> Any:
    y, dim = ctx.outputs[0], ctx.attrs["dim"]
    return (y * (dy - RD.sum_(dy * y, dim=dim, keepdim=True)),)


@_log_softmax_fused.grad
def _log_softmax_grad(ctx: Any, dy: Any) -> Any:
    y, dim = ctx.outputs[0], ctx.attrs["dim"]
    return (dy - E.exp(y) * RD.sum_(dy, dim=dim, keepdim=True),)


def _stats_cheaper_than_gather(x: Tensor, dim: int, axes: list[int]) -> bool:
    """Compares, with the boxing planner's costs, two all-reduces of a row statistic against gathering ``x``."""
    p = x.placement
    stat_shape = tuple(1 if d == dim else n for d, n in enumerate(x.shape))  # logical (..., 1, ...)
    settled = boxing.Layout(p, _replace_axes(x.sbp, axes, B))
    one_stat = boxing.plan(stat_shape, x.dtype, boxing.Layout(p, _replace_axes(x.sbp, axes, Partial("max"))), settled)
    gather = boxing.plan(tuple(x.shape), x.dtype, boxing.Layout(p, x.sbp), settled)
    return 2 * one_stat.time < gather.time


def _shifted_rows(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """``x - max`` along a split ``dim`` and ``sum(exp(...))`` of it, both statistics reduced over ranks."""
    with no_grad():  # softmax does not depend on the shift, so the max carries no gradient
        row_max = _reduce_partials(RD.amax(x, dim=dim, keepdim=True))  # P(max) -> B, logical (..., 1, ...)
    z = E.sub(x, row_max)
    total = _reduce_partials(RD.sum_(E.exp(z), dim=dim, keepdim=True))  # P(sum) -> B
    return z, total


def _row_op(x: Tensor, dim: int, fused: Any, force_partial: bool) -> tuple[Tensor, bool]:
    """Runs ``fused`` where ``dim`` is whole on every rank (or once gathered): (result, False); else (x, True),
    meaning the caller takes the partial-statistics path."""
    d = R.normalize_dim(dim, max(x.ndim, 1))
    axes = _split_axes(x, [d])
    if not axes or _has_partial(x):
        return fused(x, dim=d), False
    if force_partial or _stats_cheaper_than_gather(x, d, axes):
        return x, True
    gathered = to_global(x, x.placement, _replace_axes(x.sbp, axes, B))
    return fused(gathered, dim=d), False


def softmax(x: Tensor, dim: int) -> Tensor:
    """``torch.softmax`` along ``dim``; a split ``dim`` is handled through partial max and sum.

    >>> import sbpflow
    >>> p = sbpflow.placement("cpu", [0, 1])
    >>> x = sbpflow.tensor([[1.0, 2.0, 3.0, 4.0]], placement=p, sbp=sbpflow.sbp.split(1))
    >>> [round(v, 4) for v in softmax(x, dim=1).numpy()[0].tolist()]
    [0.0321, 0.0871, 0.2369, 0.6439]
    """
    out, partial_path = _row_op(x, dim, _softmax_fused, force_partial=False)
    if not partial_path:
        return out
    d = R.normalize_dim(dim, x.ndim)
    z, total = _shifted_rows(x, d)
    return E.exp(z) / total


def log_softmax(x: Tensor, dim: int) -> Tensor:
    """``torch.log_softmax`` along ``dim``; a split ``dim`` is handled through partial max and sum."""
    return _log_softmax(x, dim, force_partial=False)


def _log_softmax(x: Tensor, dim: int, force_partial: bool) -> Tensor:
    out, partial_path = _row_op(x, dim, _log_softmax_fused, force_partial)
    if not partial_path:
        return out
    z, total = _shifted_rows(x, R.normalize_dim(dim, x.ndim))
    return z - E.log(total)


# -- layer_norm and rms_norm -------------------------------------------------------------------


def _norm_meta(x: Meta, *params: Any, normalized_ndim: int, eps: float) -> Meta:
    if not x.dtype.is_floating_point:
        raise DTypeError(f"normalization needs a floating-point input, but got {str(x.dtype).replace('torch.', '')}")
    return x


def _stats_meta(x: Meta, normalized_ndim: int) -> Meta:
    """A per-row statistic as torch's native kernels keep it: logical (..., 1, ..., 1), fp32 for half inputs."""
    dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    return Meta(x.shape[:x.ndim - normalized_ndim] + (1,) * normalized_ndim, dtype)


def _layer_norm_meta(x: Meta, *params: Any, normalized_ndim: int, eps: float) -> tuple[Meta, Meta, Meta]:
    """(y, mean, rstd): the statistics are saved for the native backward kernel."""
    y = _norm_meta(x, *params, normalized_ndim=normalized_ndim, eps=eps)
    return y, _stats_meta(x, normalized_ndim), _stats_meta(x, normalized_ndim)


def _rms_norm_meta(x: Meta, *params: Any, normalized_ndim: int, eps: float) -> tuple[Meta, Meta]:
    """(y, rstd): the statistic is saved for the native backward kernel."""
    return _norm_meta(x, *params, normalized_ndim=normalized_ndim, eps=eps), _stats_meta(x, normalized_ndim)


def _norm_sigs(x: Meta, *params: Any, outs: tuple[Meta, ...], normalized_ndim: int, **_: Any) -> list[Sig]:
    """Split on a batch dim (params stay B; the statistics split alike), or all B."""
    rest = (B,) * len(R.metas(params))
    n_out = len(outs)
    sigs = [Sig((B,) + rest, (B,) * n_out)]
    sigs += [Sig((Split(d),) + rest, (Split(d),) * n_out) for d in range(x.ndim - normalized_ndim)]
    return sigs


def _norm_backward_meta(dy: Meta, x: Meta, *rest: Any, normalized_ndim: int, eps: float,
                        n_stats: int) -> tuple[Meta, ...]:
    return (x,) + tuple(R.metas(rest[n_stats:]))


def _norm_backward_sigs(dy: Meta, x: Meta, *rest: Any, outs: tuple[Meta, ...], normalized_ndim: int,
                        n_stats: int, **_: Any) -> list[Sig]:
    """Inputs (dy, x, statistics..., params...). dx follows a batch split (the statistics with it); weight and
    bias grads sum over the local rows, so they come out P(sum)."""
    n = len(R.metas(rest[n_stats:]))
    sigs = [Sig((B, B) + (B,) * (n_stats + n), (B,) * (1 + n))]
    for d in range(x.ndim - normalized_ndim):
        s = Split(d)
        sigs.append(Sig((s, s) + (s,) * n_stats + (B,) * n, (s,) + (PSUM,) * n))
    return sigs


def _normalized_shape(x: torch.Tensor, normalized_ndim: int) -> list[int]:
    return list(x.shape[x.dim() - normalized_ndim:])


@op("layer_norm", meta=_layer_norm_meta, sbp=_norm_sigs, save_outputs=True, diff_outputs=1)
def _layer_norm_fused(x: torch.Tensor, w: Any, b: Any, normalized_ndim: int, eps: float) -> Any:
    return torch.native_layer_norm(x, _normalized_shape(x, normalized_ndim), w, b, eps)


@op("rms_norm", meta=_rms_norm_meta, sbp=_norm_sigs, save_outputs=True, diff_outputs=1)
def _rms_norm_fused(x: torch.Tensor, w: Any, normalized_ndim: int, eps: float) -> Any:
    return torch.ops.aten._fused_rms_norm(x, _normalized_shape(x, normalized_ndim), w, eps)


def _present(t: Any) -> bool:
    return t is not None


@op("layer_norm_backward", meta=_norm_backward_meta, sbp=_norm_backward_sigs, differentiable=False)
def _layer_norm_backward(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, w: Any, b: Any,
                         normalized_ndim: int, eps: float, n_stats: int) -> Any:
    """torch's native backward from the saved mean and rstd: no second forward.

    The CPU kernel reads mean and rstd as row-major memory whatever their strides, so a strided view (a local
    B -> S slice of the statistics, for one) is copied first: they are one value per row, a small copy."""
    mask = [True, _present(w), _present(b)]
    mean, rstd = mean.contiguous(), rstd.contiguous()
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(dy, x, _normalized_shape(x, normalized_ndim), mean, rstd,
                                                           w, b, mask)
    grads = (dx,) + tuple(g for g in (dw, db) if g is not None)
    return grads if len(grads) > 1 else dx


@op("rms_norm_backward", meta=_norm_backward_meta, sbp=_norm_backward_sigs, differentiable=False)
def _rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, w: Any, normalized_ndim: int,
                       eps: float, n_stats: int) -> Any:
    """The gradient from the saved rstd, no second forward (torch has no CPU kernel for
    ``_fused_rms_norm_backward``): with x^ = x rstd and g = dy w, dx = rstd (g - x^ mean(g x^)), dw = sum dy x^."""
    dims = tuple(range(x.dim() - normalized_ndim, x.dim()))  # the normalized dims, local = logical
    x_hat = x * rstd
    g = dy * w if w is not None else dy
    dx = (rstd * (g - x_hat * (g * x_hat).mean(dims, keepdim=True))).to(x.dtype)
    if w is None:
        return dx
    rows = tuple(range(x.dim() - normalized_ndim))
    dw = (dy * x_hat).sum(rows) if rows else dy * x_hat
    return dx, dw.to(w.dtype)


def _fused_norm_grad(backward_op: OpDef) -> Any:
    def grad(ctx: Any, dy: Any) -> Any:
        x, *params = ctx.args
        stats = ctx.outputs[1:]
        out = backward_op(dy, x, *stats, *params, n_stats=len(stats), **ctx.attrs)
        return out if isinstance(out, tuple) else (out,)

    return grad


_layer_norm_fused.grad(_fused_norm_grad(_layer_norm_backward))
_rms_norm_fused.grad(_fused_norm_grad(_rms_norm_backward))


def _check_normalized(name: str, x: Tensor, normalized_shape: Any, params: dict[str, Any]) -> tuple[int, ...]:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    k = len(shape)
    if k == 0 or k > x.ndim or tuple(x.shape[x.ndim - k:]) != shape:
        raise ShapeError(
            f"{name}: normalized_shape {list(shape)} must match the trailing dims of the input, but the input has "
            f"shape {list(x.shape)} ({x._describe()})"
        )
    for what, p in params.items():
        if p is not None and tuple(p.shape) != shape:
            raise ShapeError(f"{name}: {what} must have shape normalized_shape {list(shape)}, but got {p._describe()}")
    return shape


def _norm_dims(x: Tensor, k: int) -> tuple[int, ...]:
    return tuple(range(x.ndim - k, x.ndim))


def layer_norm(x: Tensor, normalized_shape: Any, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    """``torch.nn.functional.layer_norm``. A batch split runs one fused kernel per shard; a split of the
    normalized dims gets its mean and variance through ``P(sum)`` all-reduces (exact for uneven shards).

    >>> import sbpflow
    >>> x = sbpflow.tensor([[1.0, 2.0, 3.0]], placement=sbpflow.placement("cpu", [0, 1]), sbp=sbpflow.sbp.split(1))
    >>> [round(v, 3) for v in layer_norm(x, (3,)).numpy()[0].tolist()]
    [-1.225, 0.0, 1.225]
    """
    shape = _check_normalized("layer_norm", x, normalized_shape, {"weight": weight, "bias": bias})
    dims = _norm_dims(x, len(shape))
    if not _split_axes(x, dims) or _has_partial(x):
        return _layer_norm_fused(x, weight, bias, normalized_ndim=len(shape), eps=float(eps))[0]  # type: ignore[no-any-return]
    mean = _reduce_partials(RD.mean(x, dim=dims, keepdim=True))  # P(sum) -> B, logical (..., 1)
    centered = E.sub(x, mean)
    var = _reduce_partials(RD.mean(E.mul(centered, centered), dim=dims, keepdim=True))
    out = E.mul(centered, E.rsqrt(E.add(var, eps)))
    if weight is not None:
        out = E.mul(out, weight)
    if bias is not None:
        out = E.add(out, bias)
    return out


def rms_norm(x: Tensor, normalized_shape: Any, weight: Tensor | None = None, eps: float | None = None) -> Tensor:
    """``torch.nn.functional.rms_norm`` (``eps=None`` means the dtype's machine epsilon, as in torch)."""
    shape = _check_normalized("rms_norm", x, normalized_shape, {"weight": weight})
    eps = float(torch.finfo(x.dtype).eps if eps is None else eps)
    dims = _norm_dims(x, len(shape))
    if not _split_axes(x, dims) or _has_partial(x):
        return _rms_norm_fused(x, weight, normalized_ndim=len(shape), eps=eps)[0]  # type: ignore[no-any-return]
    mean_square = _reduce_partials(RD.mean(E.mul(x, x), dim=dims, keepdim=True))  # P(sum) -> B, logical (..., 1)
    out = E.mul(x, E.rsqrt(E.add(mean_square, eps)))
    return E.mul(out, weight) if weight is not None else out


# -- batch_norm ------------------------------------------------------------------------------


def _channel_view(t: Tensor, ndim: int) -> Tensor:
    """A per-channel (C,) tensor reshaped to broadcast against a (N, C, *spatial) input."""
    return SH.reshape(t, shape=(t.shape[0],) + (1,) * (ndim - 2)) if ndim > 2 else t


def _check_batch_norm(x: Tensor, tensors: dict[str, Any]) -> None:
    if x.ndim < 2:
        raise ShapeError(f"batch_norm needs an input of shape (N, C) or (N, C, *spatial), but got {x._describe()}")
    channels = x.shape[1]
    for what, t in tensors.items():
        if t is None:
            continue
        if tuple(t.shape) != (channels,):
            raise ShapeError(f"batch_norm: {what} must have shape ({channels},) (the input's channels), "
                             f"but got {t._describe()}")
        if t.is_global != x.is_global or (t.is_global and t.placement != x.placement):
            # checked before the running statistics are updated in place, so a refused call changes nothing
            raise LocalGlobalError(f"batch_norm needs {what} and the input both local, or both global on one "
                                   f"placement, but got {what}: {t._describe()}; input: {x._describe()}")


def batch_norm(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None, weight: Tensor | None = None,
               bias: Tensor | None = None, training: bool = False, momentum: float = 0.1,
               eps: float = 1e-5) -> Tensor:
    """``torch.nn.functional.batch_norm`` on (N, C) or (N, C, *spatial) inputs.

    In training the batch statistics are means over (N, *spatial): with the batch split they come out
    ``P(sum)`` and are all-reduced by boxing, so a split batch normalizes exactly like one device
    (synchronized BN). Running statistics are updated in place with torch's rule (unbiased variance).
    """
    _check_batch_norm(x, {"running_mean": running_mean, "running_var": running_var, "weight": weight, "bias": bias})
    dims = (0,) + tuple(range(2, x.ndim))
    if training:
        mean = _reduce_partials(RD.mean(x, dim=dims, keepdim=True))  # logical (1, C, 1...)
        centered = E.sub(x, mean)
        var = _reduce_partials(RD.mean(E.mul(centered, centered), dim=dims, keepdim=True))
        _update_running(x, mean, var, running_mean, running_var, momentum)
    else:
        if running_mean is None or running_var is None:
            raise OpError("batch_norm: evaluation (training=False) needs running_mean and running_var")
        centered = E.sub(x, _channel_view(running_mean, x.ndim))
        var = _channel_view(running_var, x.ndim)
    out = E.mul(centered, E.rsqrt(E.add(var, eps)))
    if weight is not None:
        out = E.mul(out, _channel_view(weight, x.ndim))
    if bias is not None:
        out = E.add(out, _channel_view(bias, x.ndim))
    return out


def _update_running(x: Tensor, mean: Tensor, var: Tensor, running_mean: Any, running_var: Any,
                    momentum: float) -> None:
    count = x.numel() // x.shape[1]  # logical values per channel
    with no_grad():
        if running_mean is not None:
            batch_mean = SH.reshape(mean, shape=(x.shape[1],))
            running_mean.mul_(1 - momentum).add_(E.mul(batch_mean, momentum))
        if running_var is not None:
            unbiased = E.mul(SH.reshape(var, shape=(x.shape[1],)), count / max(count - 1, 1))
            running_var.mul_(1 - momentum).add_(E.mul(unbiased, momentum))


# -- dropout ---------------------------------------------------------------------------------


def _dropout_sigs(x: Meta, key: Any, outs: tuple[Meta, ...], p: float) -> list[Sig]:
    # the mask is the same on every rank holding a box, so it is linear in partial sums
    return R.elementwise_sigs((x,), outs[0], [(PSUM, PSUM)])


@op("dropout", meta=lambda x, key, p: x, sbp=_dropout_sigs, shard_aware=True)
def _dropout(ctx: ShardCtx, x: torch.Tensor, key: int, p: float) -> torch.Tensor:
    # the mask is cut out of one logical uniform tensor: it depends on (key, logical shape, box), never on SBP
    u = sbp_random.fill(key, ctx.in_metas[0].shape, ctx.in_boxes[0], "uniform", torch.float32, x.device)
    return x * (u >= p).to(x.dtype) / (1.0 - p)


@_dropout.grad
def _dropout_grad(ctx: Any, dy: Any) -> Any:
    _, key = ctx.args
    return (_dropout(dy, key, p=ctx.attrs["p"]),)  # same key, same logical shape: the same mask


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    """Zeroes each element with probability ``p`` and scales the rest by ``1 / (1 - p)``.

    The mask depends only on the seed and the call order (a key from :func:`sbpflow.random.next_key`),
    so split, broadcast and local tensors draw the same logical mask.
    """
    if not 0.0 <= p <= 1.0:
        raise OpError(f"dropout: p must be in [0, 1], but got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return E.mul(x, 0.0)
    return _dropout(x, sbp_random.next_key(), p=float(p))


def _bind_methods() -> None:
    # tensor.py does not import ops, so binding here (at import of ops) makes no cycle
    Tensor.softmax = softmax  # type: ignore[attr-defined]
    Tensor.log_softmax = log_softmax  # type: ignore[attr-defined]


_bind_methods()
