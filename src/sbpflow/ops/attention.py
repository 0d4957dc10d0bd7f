"""Scaled dot-product attention on (..., heads, T, D) shards, with torch's fused kernel per shard.

SBP rules (q, k, v of shape (B, H, T, D), logical; ``mask`` broadcastable to (B, H, Tq, Tk)):

    q        k        v        out       why
    S(b)     S(b)     S(b)     S(b)      batch or head dims: attention never mixes them
    S(Tq)    B        B        S(Tq)     query rows are independent (the causal mask shifts by the shard's offset)
    B        B        P(sum)   P(sum)    linear in v
    B        B        B        B

The mask follows the split of the dim it shares with the output, else stays B.
The backward op recomputes attention on each shard with torch autograd (one
kernel, no saved probabilities), and maps the same splits; with queries split,
dk and dv are partial sums over the query rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as TF

from ..errors import DTypeError, OpError, ShapeError
from ..sbp import Partial, SbpParallel, Split, broadcast
from ..tensor import Tensor
from . import _rules as R
from .registry import Meta, ShardCtx, Sig, op

__all__ = ["scaled_dot_product_attention"]

B = broadcast
PSUM = Partial("sum")


def _sdpa_meta(q: Meta, k: Meta, v: Meta, *mask: Meta, is_causal: bool, scale: float | None) -> Meta:
    if not (q.ndim == k.ndim == v.ndim and q.ndim >= 2):
        raise ShapeError(f"scaled_dot_product_attention needs q, k, v with one number of dims (at least 2), but got "
                         f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ShapeError(f"scaled_dot_product_attention needs q and k with one head dim, but got q {list(q.shape)} "
                         f"(head dim {q.shape[-1]}) and k {list(k.shape)} (head dim {k.shape[-1]})")
    if k.shape[-2] != v.shape[-2] or not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
        raise ShapeError(f"scaled_dot_product_attention needs q, k, v with equal batch/head dims and k, v of one "
                         f"length, but got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    R.check_dtypes_equal("scaled_dot_product_attention", q, k, v)
    if not q.dtype.is_floating_point:
        raise DTypeError(f"scaled_dot_product_attention needs floating-point q, k, v, but got {q.dtype}")
    scores = q.shape[:-1] + (k.shape[-2],)  # logical (..., Tq, Tk)
    if mask:
        if mask[0].dtype not in (torch.bool, q.dtype):
            raise DTypeError(f"scaled_dot_product_attention needs a bool mask or one of q's dtype {q.dtype}, "
                             f"but got {mask[0].dtype}")
        if R.broadcast_shapes(mask[0].shape, scores) != scores:
            raise ShapeError(f"scaled_dot_product_attention needs attn_mask broadcastable to {list(scores)}, "
                             f"but got {list(mask[0].shape)}")
    return Meta(q.shape[:-1] + (v.shape[-1],), q.dtype)


def _mask_sbp(mask: tuple[Meta, ...], d: int, ndim: int, size: int) -> tuple[SbpParallel, ...]:
    """The mask follows a split of logical score dim ``d`` when it has that dim at full size."""
    if not mask:
        return ()
    k = d - (ndim - mask[0].ndim)
    return (Split(k),) if k >= 0 and mask[0].shape[k] == size else (B,)


def _sdpa_sigs(q: Meta, k: Meta, v: Meta, *mask: Meta, outs: tuple[Meta, ...], **_: Any) -> list[Sig]:
    mb = (B,) if mask else ()
    sigs = [Sig((B, B, B) + mb, (B,)), Sig((B, B, PSUM) + mb, (PSUM,))]
    for d in range(q.ndim - 2):
        s = Split(d)
        sigs.append(Sig((s, s, s) + _mask_sbp(mask, d, q.ndim, q.shape[d]), (s,)))
    rows = Split(q.ndim - 2)
    sigs.append(Sig((rows, B, B) + _mask_sbp(mask, q.ndim - 2, q.ndim, q.shape[-2]), (rows,)))
    return sigs


def _local_sdpa(ctx: ShardCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: tuple[torch.Tensor, ...],
                is_causal: bool, scale: float | None) -> torch.Tensor:
    """torch's sdpa on one shard; a causal mask on a query-row shard is built at the shard's offset."""
    lo, hi = ctx.in_boxes[0][-2]
    attn_mask = mask[0] if mask else None
    if is_causal and (lo, hi) != (0, ctx.in_metas[0].shape[-2]):
        # torch's is_causal keeps key j for query i when j <= i (top-left aligned); i is logical here
        rows = torch.arange(lo, hi, device=q.device)[:, None]
        attn_mask = rows >= torch.arange(k.shape[-2], device=q.device)[None, :]
        is_causal = False
    return TF.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


@op("scaled_dot_product_attention", meta=_sdpa_meta, sbp=_sdpa_sigs, shard_aware=True)
def _sdpa(ctx: ShardCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *mask: torch.Tensor, is_causal: bool,
          scale: float | None) -> torch.Tensor:
    return _local_sdpa(ctx, q, k, v, mask, is_causal, scale)


@_sdpa.grad
def _sdpa_grad(ctx: Any, dy: Any) -> Any:
    dq, dk, dv = sdpa_backward(dy, *ctx.inputs, **ctx.attrs)
    return (dq, dk, dv) + (None,) * (len(ctx.inputs) - 3)


def _sdpa_backward_meta(dy: Meta, q: Meta, k: Meta, v: Meta, *mask: Meta, **_: Any) -> tuple[Meta, Meta, Meta]:
    return q, k, v


def _sdpa_backward_sigs(dy: Meta, q: Meta, k: Meta, v: Meta, *mask: Meta, outs: tuple[Meta, ...],
                        **_: Any) -> list[Sig]:
    mb = (B,) if mask else ()
    sigs = [
        Sig((B, B, B, B) + mb, (B, B, B)),
        Sig((PSUM, B, B, B) + mb, (PSUM, PSUM, PSUM)),  # linear in dy
        Sig((B, B, B, PSUM) + mb, (PSUM, PSUM, B)),  # dq, dk linear in v; dv does not depend on v
    ]
    for d in range(q.ndim - 2):
        s = Split(d)
        sigs.append(Sig((s, s, s, s) + _mask_sbp(mask, d, q.ndim, q.shape[d]), (s, s, s)))
    rows = Split(q.ndim - 2)
    row_mask = _mask_sbp(mask, q.ndim - 2, q.ndim, q.shape[-2])
    sigs.append(Sig((rows, rows, B, B) + row_mask, (rows, PSUM, PSUM)))  # dk, dv sum over query rows
    return sigs


@op("sdpa_backward", meta=_sdpa_backward_meta, sbp=_sdpa_backward_sigs, shard_aware=True, differentiable=False)
def sdpa_backward(ctx: ShardCtx, dy: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  *mask: torch.Tensor, is_causal: bool, scale: float | None) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of attention, recomputed on the shard with torch autograd (torch's own backward kernels)."""
    # the forward kernel reads q's box from in_boxes[0]: shift past dy so it sees q's
    fwd = ShardCtx(ctx.rank, ctx.placement, ctx.in_boxes[1:], ctx.out_boxes, ctx.in_metas[1:], ctx.out_metas,
                   ctx.in_sbps[1:], ctx.out_sbps)
    with torch.enable_grad():
        lq, lk, lv = leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = _local_sdpa(fwd, lq, lk, lv, mask, is_causal, scale)
        grads = torch.autograd.grad(out, leaves, dy, allow_unused=True)
    return tuple(g if g is not None else torch.zeros_like(t) for g, t in zip(grads, leaves, strict=True))


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None) -> Tensor:
    """``softmax(q k^T * scale + mask) v`` over (..., T, D) tensors, as torch's; batch and head splits need no
    communication, and neither does a split of the query rows.

    ``attn_mask`` is bool (True keeps) or additive float, and gets no gradient.
    ``dropout_p`` must be 0: the backward recomputes attention per shard, and a
    dropout mask would have to be drawn identically in both passes.

    >>> import sbpflow
    >>> q = sbpflow.randn(2, 4, 5, 8)  # (B, H, T, D)
    >>> sbpflow.functional.scaled_dot_product_attention(q, q, q, is_causal=True).shape
    torch.Size([2, 4, 5, 8])
    """
    if dropout_p != 0.0:
        raise OpError(
            f"scaled_dot_product_attention supports dropout_p=0 only (got {dropout_p}): its backward recomputes "
            f"attention per shard and would draw a different dropout mask; q {q._describe()}"
        )
    if is_causal and attn_mask is not None:
        raise OpError("scaled_dot_product_attention takes attn_mask or is_causal=True, not both (as torch); "
                      f"q {q._describe()}, attn_mask {attn_mask._describe()}")
    mask = (attn_mask,) if attn_mask is not None else ()
    return _sdpa(q, k, v, *mask, is_causal=bool(is_causal), scale=None if scale is None else float(scale))
