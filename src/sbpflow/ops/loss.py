"""Embedding and loss ops: embedding (vocab-parallel included), nll_loss, cross_entropy, mse_loss.

A split class dim is met by letting the rank that owns a class act for it and the others contribute zero,
which gives ``P(sum)``: the vocab-parallel loss never gathers the logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as TF

from ..errors import DTypeError, OpError, ShapeError
from ..sbp import Partial, Split, broadcast, format_nd
from ..tensor import Tensor
from . import _rules as R
from . import elementwise as E
from . import reduction as RD
from . import shape as SH
from .normalization import _log_softmax, _reduce_partials
from .schema import Meta, ShardCtx, Sig, op

B = broadcast
PSUM = Partial("sum")

__all__ = ["cross_entropy", "embedding", "mse_loss", "nll_loss"]


def _split_on(x: Tensor, dim: int) -> bool:
    return x.is_global and any(isinstance(s, Split) and s.dim == dim for s in x.sbp)


def _check_labels(name: str, labels: torch.Tensor, count: int, what: str, ctx: ShardCtx, arg_names: tuple[str, str],
                  ignore_index: int | None = None, of: str = "classes") -> None:
    """Raises sbpflow's error for the first label outside ``[0, count)`` (``ignore_index`` allowed)."""
    if labels.numel():
        lo, hi = torch.aminmax(labels)  # one kernel: the common case, every label in range, ends here
        if int(lo) >= 0 and int(hi) < count:
            return
    bad = (labels < 0) | (labels >= count)
    if ignore_index is not None:
        bad &= labels != ignore_index
    if bool(bad.any()):
        value = int(labels[bad][0])
        allowed = f" or ignore_index={ignore_index}" if ignore_index is not None else ""
        raise OpError(f"{name}: {what} {value} is out of range for {count} {of} (expected 0..{count - 1}{allowed}); "
                      f"{_describe_inputs(ctx, arg_names)}")


def _describe_inputs(ctx: ShardCtx, names: tuple[str, str]) -> str:
    """The logical inputs of a shard-aware kernel, for error messages."""
    parts = []
    for name, meta, sbp in zip(names, ctx.in_metas, ctx.in_sbps or ((),) * len(names), strict=False):
        where = f" on {ctx.placement} sbp {format_nd(sbp)}" if ctx.placement is not None else " (local)"
        parts.append(f"{name} shape {list(meta.shape)} {str(meta.dtype).replace('torch.', '')}{where}")
    return "; ".join(parts)


def _owned(labels: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which labels fall in this shard's class range [lo, hi), and their local offsets (clamped in range)."""
    own = (labels >= lo) & (labels < hi)
    local = (labels - lo).clamp(0, max(hi - lo - 1, 0))
    return own, local


# -- embedding --------------------------------------------------------------------------------


def _embedding_meta(ids: Meta, weight: Meta, padding_idx: int | None) -> Meta:
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise DTypeError(f"embedding needs integer ids, but got {str(ids.dtype).replace('torch.', '')}")
    if weight.ndim != 2:
        raise ShapeError(f"embedding needs a 2-D weight (num_embeddings, dim), but got shape {list(weight.shape)}")
    return Meta(ids.shape + (weight.shape[1],), weight.dtype)


# embedding      ids S(d)/B with weight B -> S(d)/B; weight S(0) (vocab-parallel) -> P(sum);
#                weight S(1) -> output split on its last dim
# pick           x[..., target] with x S(last) -> P(sum) (the owner of the target's class picks)
# cross_entropy  log_softmax through partial max and sum (two all-reduces of (N, 1)), then pick
def _embedding_sigs(ids: Meta, weight: Meta, outs: tuple[Meta, ...], padding_idx: int | None) -> list[Sig]:
    sigs = [Sig((B, B), (B,))]
    sigs += [Sig((Split(d), B), (Split(d),)) for d in range(ids.ndim)]
    sigs.append(Sig((B, Split(1)), (Split(ids.ndim),)))  # split embedding dim
    sigs.append(Sig((B, Split(0)), (PSUM,)))  # vocab-parallel: each rank looks up its row range
    return sigs


@op("embedding", meta=_embedding_meta, sbp=_embedding_sigs, shard_aware=True, box_offsets=(1,))  # weight rows
def _embedding(ctx: ShardCtx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
    lo, hi = ctx.in_boxes[1][0]  # this shard's rows of the logical weight
    if (lo, hi) == (0, ctx.in_metas[1].shape[0]):  # all rows here: torch's lookup checks the range itself
        try:
            return TF.embedding(ids, weight)
        except IndexError:
            pass  # raise sbpflow's own error, naming the first bad index
    _check_labels("embedding", ids, ctx.in_metas[1].shape[0], "index", ctx, ("ids", "weight"), of="weight rows")
    own, local = _owned(ids, lo, hi)
    if hi == lo:
        return weight.new_zeros(tuple(ids.shape) + (weight.shape[1],))
    out = weight[local]  # local (..., dim)
    return out * own.unsqueeze(-1).to(out.dtype) if (lo, hi) != (0, ctx.in_metas[1].shape[0]) else out


def _embedding_grad_meta(dy: Meta, ids: Meta, num_rows: int, padding_idx: int | None, rows_split: bool) -> Meta:
    return Meta((num_rows, dy.shape[-1]), dy.dtype)


def _embedding_grad_sigs(dy: Meta, ids: Meta, outs: tuple[Meta, ...], rows_split: bool, **_: Any) -> list[Sig]:
    # with a vocab-parallel weight, each rank builds only its rows from the full grad: no comm, S(0) directly
    rows = [Sig((B, B), (Split(0),))]
    sigs = rows + [Sig((B, B), (B,))] if rows_split else [Sig((B, B), (B,))] + rows
    sigs += [Sig((Split(d), Split(d)), (PSUM,)) for d in range(ids.ndim)]
    sigs.append(Sig((Split(ids.ndim), B), (Split(1),)))
    sigs.append(Sig((PSUM, B), (PSUM,)))
    return sigs


@op("embedding_backward", meta=_embedding_grad_meta, sbp=_embedding_grad_sigs, shard_aware=True,
    differentiable=False, box_offsets=(2,))  # dW's rows
def _embedding_backward(ctx: ShardCtx, dy: torch.Tensor, ids: torch.Tensor, num_rows: int, padding_idx: int | None,
                        rows_split: bool) -> torch.Tensor:
    lo, hi = ctx.out_boxes[0][0]
    if (lo, hi) == (0, num_rows):  # every row here: torch's own kernel, no masking
        return torch.ops.aten.embedding_dense_backward(dy, ids, num_rows, -1 if padding_idx is None else padding_idx,
                                                       False)
    keep = (ids >= lo) & (ids < hi)
    if padding_idx is not None:
        keep &= ids != padding_idx
    out = dy.new_zeros((hi - lo, dy.shape[-1]))  # local rows of the logical (num_rows, dim) grad
    return out.index_add_(0, (ids[keep] - lo).reshape(-1), dy[keep].reshape(-1, dy.shape[-1]))


@_embedding.grad
def _embedding_grad(ctx: Any, dy: Any) -> Any:
    ids, weight = ctx.inputs
    rows_split = _split_on(weight, 0)
    return None, _embedding_backward(dy, ids, num_rows=weight.shape[0], padding_idx=ctx.attrs["padding_idx"],
                                     rows_split=rows_split)


def embedding(ids: Tensor, weight: Tensor, padding_idx: int | None = None) -> Tensor:
    """``torch.nn.functional.embedding``: rows of ``weight`` at ``ids``.

    With ``weight`` split on rows (vocab-parallel) each rank looks up the ids in its row range and
    the output is ``P(sum)``; the weight gradient then stays split on rows without communication.

    >>> import sbpflow
    >>> w = sbpflow.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]])
    >>> embedding(sbpflow.tensor([2, 0]), w).numpy().tolist()
    [[4.0, 5.0], [0.0, 1.0]]
    """
    if weight.ndim == 2 and padding_idx is not None:
        rows = weight.shape[0]
        if not -rows <= padding_idx < rows:
            raise OpError(f"embedding: padding_idx must be within [{-rows}, {rows}), but got {padding_idx}")
        padding_idx %= rows
    return _embedding(ids, weight, padding_idx=padding_idx)


# -- pick: x[..., target] along the last dim ---------------------------------------------------------


def _pick_meta(x: Meta, target: Meta, ignore_index: int, name: str) -> Meta:
    return Meta(target.shape, x.dtype)


def _pick_sigs(x: Meta, target: Meta, outs: tuple[Meta, ...], **_: Any) -> list[Sig]:
    sigs = [Sig((B, B), (B,))]
    sigs += [Sig((Split(d), Split(d)), (Split(d),)) for d in range(target.ndim)]
    sigs.append(Sig((Split(x.ndim - 1), B), (PSUM,)))  # the rank owning the target's class picks it
    sigs.append(Sig((PSUM, B), (PSUM,)))
    return sigs


# grad_reads: the targets, not the log-probs; box offsets: the classes' (x's last dim)
@op("pick", meta=_pick_meta, sbp=_pick_sigs, shard_aware=True, grad_reads=(1,), box_offsets=((0, -1),))
def _pick(ctx: ShardCtx, x: torch.Tensor, target: torch.Tensor, ignore_index: int, name: str) -> torch.Tensor:
    classes = ctx.in_metas[0].shape[-1]
    _check_labels(name, target, classes, "target label", ctx, ("input", "target"), ignore_index)
    lo, hi = ctx.in_boxes[0][-1]
    if (lo, hi) == (0, classes):
        # every class here, and (checked above) every label in [0, C) or ignore_index: _owned's range test
        # would keep exactly the labels that are not ignore_index, and its offsets are the labels clamped
        own, local = target != ignore_index, target.clamp(0, max(classes - 1, 0))
    else:
        own, local = _owned(target, lo, hi)
        own &= target != ignore_index  # an ignore_index inside [0, C) is a class id too: never pick it
    if hi == lo:
        return x.new_zeros(target.shape)
    picked = x.gather(-1, local.unsqueeze(-1)).squeeze(-1)  # local (...)
    return torch.where(own, picked, torch.zeros((), dtype=x.dtype))


def _unpick_meta(dy: Meta, target: Meta, num_classes: int, ignore_index: int, class_split: bool) -> Meta:
    return Meta(target.shape + (num_classes,), dy.dtype)


def _unpick_sigs(dy: Meta, target: Meta, outs: tuple[Meta, ...], class_split: bool, **_: Any) -> list[Sig]:
    # a class-split x wants its gradient split the same way: each rank fills its own columns, no comm
    cols = [Sig((B, B), (Split(target.ndim),))]
    sigs = cols + [Sig((B, B), (B,))] if class_split else [Sig((B, B), (B,))] + cols
    sigs += [Sig((Split(d), Split(d)), (Split(d),)) for d in range(target.ndim)]
    sigs.append(Sig((PSUM, B), (PSUM,)))
    return sigs


@op("unpick", meta=_unpick_meta, sbp=_unpick_sigs, shard_aware=True, box_offsets=((2, -1),))  # the classes
def _unpick(ctx: ShardCtx, dy: torch.Tensor, target: torch.Tensor, num_classes: int, ignore_index: int,
            class_split: bool) -> torch.Tensor:
    lo, hi = ctx.out_boxes[0][-1]
    own, local = _owned(target, lo, hi)
    own &= target != ignore_index
    out = dy.new_zeros(tuple(target.shape) + (hi - lo,))  # local (..., classes of this shard)
    if hi == lo:
        return out
    return out.scatter_(-1, local.unsqueeze(-1), torch.where(own, dy, torch.zeros((), dtype=dy.dtype)).unsqueeze(-1))


@_pick.grad
def _pick_grad(ctx: Any, dy: Any) -> Any:
    x, target = ctx.inputs
    split = _split_on(x, x.ndim - 1)
    return _unpick(dy, target, num_classes=x.shape[-1], ignore_index=ctx.attrs["ignore_index"],
                   class_split=split), None


@_unpick.grad
def _unpick_grad(ctx: Any, g: Any) -> Any:
    _, target = ctx.inputs
    return _pick(g, target, ignore_index=ctx.attrs["ignore_index"], name="unpick"), None


# -- nll_loss and cross_entropy ------------------------------------------------------------------


def _classes_last(name: str, x: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Checks torch's shapes ((C,) with (), or (N, C, d...) with (N, d...)) and moves the class dim last."""
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise DTypeError(f"{name}: target must hold integer class indices, but got {target._describe()}")
    if x.ndim == 0:
        raise ShapeError(f"{name}: input needs a class dim, but got {x._describe()}")
    expected = () if x.ndim == 1 else (x.shape[0],) + tuple(x.shape[2:])
    if tuple(target.shape) != expected:
        raise ShapeError(
            f"{name}: input {x._describe()} needs a target of shape {list(expected)} (batch and extra dims, no "
            f"class dim), but got {target._describe()}"
        )
    if x.ndim == 1:
        return SH.unsqueeze(x, dim=0), SH.unsqueeze(target, dim=0)
    if x.ndim > 2:
        dims = (0,) + tuple(range(2, x.ndim)) + (1,)  # logical (N, d..., C)
        x = SH.permute(x, dims=dims)
    return x, target


# A mean divides by the logical count of non-ignored targets, so it is exact under uneven batch splits.
def _reduce(name: str, losses: Tensor, valid: Tensor | None, reduction: str, squeeze: bool) -> Tensor:
    """none/sum/mean of per-sample losses; mean divides by the logical count of valid samples."""
    if reduction == "none":
        return SH.squeeze(losses, dim=0) if squeeze else losses
    if valid is None:  # a mean op, not a division by numel(): under gradient accumulation it divides by the batch
        return RD.sum_(losses) if reduction == "sum" else RD.mean(losses)
    total = RD.sum_(losses)
    if reduction == "sum":
        return total
    count = _reduce_partials(RD.sum_(valid))  # P(sum) under a batch split -> B (one scalar all-reduce)
    return E.div(total, count)


def _check_reduction(name: str, reduction: str) -> None:
    if reduction not in ("none", "mean", "sum"):
        raise OpError(f"{name}: reduction must be 'none', 'mean' or 'sum', but got {reduction!r}")


def _check_weight(name: str, weight: Tensor | None, logits: Tensor) -> None:
    classes = logits.shape[0 if logits.ndim == 1 else 1] if logits.ndim else 0
    if weight is not None and tuple(weight.shape) != (classes,):
        raise ShapeError(f"{name}: weight needs one entry per class, shape [{classes}] for input {logits._describe()}, "
                         f"but got weight {weight._describe()}")


def _target_weights(x: Tensor, t: Tensor, weight: Tensor | None, ignore_index: int) -> Tensor:
    """Each sample's weight: ``weight[target]``, or 1; 0 where the target is ``ignore_index``.

    Picked from the weight broadcast over the samples, so a class-split weight is picked where it
    lives (``P(sum)``), like the logits; summed, it is what a weighted mean divides by, as in torch.
    """
    if weight is None:
        return E.cast(E.ne(t, ignore_index), dtype=x.dtype)
    spread = SH.expand(E.cast(weight, dtype=x.dtype), shape=tuple(x.shape))  # logical (N, d..., C)
    return _pick(spread, t, ignore_index=ignore_index, name="weight")


def nll_loss(logp: Tensor, target: Tensor, weight: Tensor | None = None, ignore_index: int = -100,
             reduction: str = "mean") -> Tensor:
    """``torch.nn.functional.nll_loss`` over class indices; the class dim may be split (``P(sum)`` picks).

    ``weight`` (one entry per class) scales each sample's loss by its target's weight; the mean then
    divides by the sum of those weights, as torch does.
    """
    _check_reduction("nll_loss", reduction)
    _check_weight("nll_loss", weight, logp)
    x, t = _classes_last("nll_loss", logp, target)
    valid = _target_weights(x, t, weight, ignore_index)
    losses = E.neg(_pick(x, t, ignore_index=ignore_index, name="nll_loss"))
    if weight is not None:
        losses = E.mul(losses, valid)
    return _reduce("nll_loss", losses, valid, reduction, logp.ndim == 1)


def cross_entropy(logits: Tensor, target: Tensor, weight: Tensor | None = None, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    """``torch.nn.functional.cross_entropy`` (class dim 1 for inputs of 2 or more dims), with class-index
    targets or, as in torch, floating-point class probabilities of the input's shape.

    With the class dim split (the vocab-parallel loss) the log-softmax takes its max and
    log-sum-exp through partials and the rank owning each target class picks its logit, so the
    forward pass all-reduces only (N, 1) statistics and never gathers the logits.

    ``weight`` (one entry per class, split like the classes or not) scales each class's terms; with
    class-index targets the mean divides by the summed weights of the targets, as in torch.

    >>> import sbpflow
    >>> p = sbpflow.placement("cpu", [0, 1])
    >>> logits = sbpflow.tensor([[0.0, 0.0, 0.0, 0.0]], placement=p, sbp=sbpflow.sbp.split(1))
    >>> round(cross_entropy(logits, sbpflow.tensor([3], placement=p, sbp=sbpflow.sbp.broadcast)).item(), 4)
    1.3863
    """
    _check_reduction("cross_entropy", reduction)
    if not 0.0 <= label_smoothing <= 1.0:
        raise OpError(f"cross_entropy: label_smoothing must be in [0, 1], but got {label_smoothing}")
    _check_weight("cross_entropy", weight, logits)
    if target.dtype.is_floating_point:
        return _soft_cross_entropy(logits, target, weight, reduction, label_smoothing)
    x, t = _classes_last("cross_entropy", logits, target)
    last = x.ndim - 1
    logp = _log_softmax(x, last, force_partial=_split_on(x, last))  # logical (N, d..., C)
    valid = _target_weights(x, t, weight, ignore_index)
    losses = E.neg(_pick(logp, t, ignore_index=ignore_index, name="cross_entropy"))
    if weight is not None:
        losses = E.mul(losses, valid)
    if label_smoothing > 0.0:
        classes = x.shape[-1]
        weighted = logp if weight is None else E.mul(logp, E.cast(weight, dtype=x.dtype))
        present = E.cast(E.ne(t, ignore_index), dtype=x.dtype)
        smooth = E.mul(E.neg(RD.sum_(weighted, dim=last)), present)  # P(sum) when classes are split
        losses = E.add(E.mul(losses, 1.0 - label_smoothing), E.mul(smooth, label_smoothing / classes))
    return _reduce("cross_entropy", losses, valid, reduction, logits.ndim == 1)


def _soft_cross_entropy(logits: Tensor, target: Tensor, weight: Tensor | None, reduction: str,
                        label_smoothing: float) -> Tensor:
    """-sum(w * p * log_softmax(x)) over the class dim; mean divides by the number of samples (all count)."""
    if tuple(target.shape) != tuple(logits.shape):
        raise ShapeError(
            f"cross_entropy: class-probability targets need the input's shape {list(logits.shape)}, but got "
            f"{target._describe()}"
        )
    dim = 0 if logits.ndim == 1 else 1
    classes = logits.shape[dim]
    if label_smoothing > 0.0:
        target = E.add(E.mul(target, 1.0 - label_smoothing), label_smoothing / classes)
    logp = _log_softmax(logits, dim, force_partial=_split_on(logits, dim))
    if weight is not None:  # weight is (C,): give it trailing unit dims to meet the class dim of (N, C, d...)
        w = E.cast(weight, dtype=logp.dtype)
        for _ in range(logits.ndim - dim - 1):
            w = SH.unsqueeze(w, dim=w.ndim)
        target = E.mul(target, w)
    losses = E.neg(RD.sum_(E.mul(logp, target), dim=dim))  # P(sum) when classes are split
    if reduction == "none":
        return losses
    # a mean op, not a division by numel(): under gradient accumulation it divides by the whole batch (graph.micro)
    return RD.sum_(losses) if reduction == "sum" else RD.mean(losses)


def mse_loss(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    """``torch.nn.functional.mse_loss``: the mean (or sum) of squared differences."""
    _check_reduction("mse_loss", reduction)
    try:
        R.broadcast_shapes(tuple(input.shape), tuple(target.shape))
    except ShapeError as e:
        raise ShapeError(f"mse_loss: input and target must be broadcastable: {e}") from None
    diff = E.sub(input, target)
    squared = E.mul(diff, diff)
    if reduction == "none":
        return squared
    return RD.sum_(squared) if reduction == "sum" else RD.mean(squared)
